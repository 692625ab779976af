"""A notification's JSON (the stored body) is exactly what ``asdict`` makes of it."""

from __future__ import annotations

from dataclasses import asdict

from gpuwatch.server.notifications.model import Culprit, Notification, NotifiedAlert


def test_to_json_is_asdict_and_round_trips() -> None:
    alert = NotifiedAlert(
        rule="gpu_filling_up",
        status="firing",
        labels={"rule": "gpu_filling_up", "hostname": "h"},
        summary="s",
        description="d",
        starts_at=1.5,
        ends_at=None,
        fingerprint="f",
        culprits=[Culprit(1, "alice", "python", 2**30, "c", "p", "7", 3.0)],
    )
    notification = Notification("r", "{k}", {"rule": "x"}, "firing", [alert, alert], "https://g/")
    body = notification.to_json()
    assert body == asdict(notification)
    assert list(body) == list(asdict(notification))
    assert list(body["alerts"][0]) == list(asdict(alert))
    assert Notification.from_json(body) == notification
    body["alerts"][0]["labels"]["hostname"] = "changed"  # a copy, as asdict makes
    assert alert.labels["hostname"] == "h"
