"""Reported events obey the snapshots' clock-skew rule, and a reaped event dated ahead
of the server's clock (one stored before that rule) never pins a firing alert."""

from __future__ import annotations

from typing import Any

from gpuwatch.server.alerts import rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.facts import EventFact, Facts
from gpuwatch.server.ingest.service import MAX_FUTURE_SKEW_SECONDS
from server.factories import T0
from server.harness import Live


def reaped(pid: int, occurred_at: float) -> dict[str, Any]:
    return {
        "kind": "reaped",
        "hostname": "host-1",
        "gpu_index": 0,
        "pid": pid,
        "user": "fay",
        "summary": "stopped an idle holder",
        "evidence": {"stage": "stopped"},
        "occurred_at": occurred_at,
    }


def test_an_event_from_further_ahead_than_snapshots_may_be_is_refused(live: Live) -> None:
    headers = {"Authorization": f"Bearer {live.token('host-1')}"}
    now = live.clock()

    def post(pid: int, at: float) -> Any:
        return live.client.post("/api/v1/events", json=reaped(pid, at), headers=headers)

    eleven_days, year_2242 = post(1, now + 10**6), post(2, 2.0**33)
    within = post(3, now + MAX_FUTURE_SKEW_SECONDS - 1)

    for refused in (eleven_days, year_2242):
        assert refused.status_code == 422, refused.text
        (problem,) = refused.json()["detail"]
        assert problem["type"] == "clock_skew"
        assert problem["loc"] == ["body", "occurred_at"]
        assert "fix the agent's clock" in problem["msg"]
    assert within.status_code == 200, within.text
    items = live.client.get("/api/v1/events", params={"kind": "reaped"}).json()["items"]
    assert [e["pid"] for e in items] == [3]


def test_a_reaped_event_dated_ahead_is_not_announced_until_its_time() -> None:
    def event(at: float) -> EventFact:
        return EventFact(
            "reaped", "stopped", "host-1", 0, 42, "fay", None, at, "stopped", {"stage": "stopped"}
        )

    config = AlertSettings.model_validate({})
    ahead = Facts(reaped=[event(2.0**33)])
    assert rules.evaluate(ahead, config, now=T0) == []  # it would never have aged out
    (alert,) = rules.evaluate(Facts(reaped=[event(T0 - 1)]), config, now=T0)
    assert alert.rule == "process_reaped"
