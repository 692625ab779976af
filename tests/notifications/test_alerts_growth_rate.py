"""Every receiver says the same of a culprit's growth, and none makes a rate up.

A GPU filled by workers that arrive one after another names the newest arrivals as its
culprits: each grew the GPU by arriving, at its full size, so its memory floor is flat
(slope 0). Slack and Alertmanager printed "u4: python worker.py --rank 7 (9.0 GiB,
+0 B/min, pid 12903)" under "growing", while the webhook's description left the rate
out. Now a rate is shown only for a floor that rose, in every receiver.
"""

from __future__ import annotations

import json

from gpuwatch.server.alerts import rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.facts import EventFact, Facts, GpuFact, Holder
from gpuwatch.server.notifications.model import Culprit, Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers import alertmanager, slack
from gpuwatch.server.notifications.receivers.text import culprit_facts

GIB = 2**30
T = 1_800_000_000.0


def _alert() -> NotifiedAlert:
    worker = Holder(12903, "u4", "python worker.py --rank 7", 9 * GIB)
    leaker = Holder(12801, "u1", "python leak.py", 20 * GIB)
    event = EventFact(
        "filling_up", "filling_up", "box1", 3, None, None, None, T, "",
        {
            "time_to_full_seconds": 600.0,
            "culprits": [
                {"pid": 12903, "slope_bytes_per_second": 0.0, "growth_bytes": 9 * GIB},
                {"pid": 12801, "slope_bytes_per_second": GIB / 60, "growth_bytes": 4 * GIB},
            ],
        },
    )  # fmt: skip
    gpu = GpuFact("box1", 3, 80 * GIB, 75 * GIB, 0, True, (leaker, worker))
    (candidate, *_) = rules.evaluate(Facts([gpu], [event]), AlertSettings(), now=T)
    return NotifiedAlert(
        rule=candidate.rule,
        status="firing",
        labels=candidate.labels,
        summary=candidate.summary,
        description=candidate.description,
        starts_at=T,
        ends_at=None,
        fingerprint=candidate.fingerprint,
        culprits=candidate.culprits,
    )


def test_a_new_worker_is_shown_without_a_rate_by_every_receiver() -> None:
    alert = _alert()
    notification = Notification("r", "{}", {}, "firing", [alert])
    webhook = notification.to_json()["alerts"][0]
    slack_text = json.dumps(slack.render(notification))
    (am,) = alertmanager.payload(notification)

    # The webhook: no slope for the worker (null: not known), the leaker's as computed.
    slopes = {c["pid"]: c["slope_bytes_per_second"] for c in webhook["culprits"]}
    assert slopes == {12903: None, 12801: GIB / 60}
    worker_line, leaker_line = alert.description.split("\n")
    assert "12903" in worker_line and "/min" not in worker_line
    assert leaker_line.endswith("+1.0 GiB/min")
    assert "/min" not in alert.summary  # it names the worker first: the largest growth
    # Slack and Alertmanager: the same facts.
    for text in (slack_text, am["annotations"]["culprits"]):
        assert "+0 B/min" not in text and "9.0 GiB, pid 12903" in text
        assert "20.0 GiB, +1.0 GiB/min, pid 12801" in text


def test_a_stored_culprit_with_a_flat_or_falling_slope_is_shown_without_a_rate() -> None:
    """Notifications planned before the change are sent from their stored JSON."""
    for slope in (0.0, -1e6):
        culprit = Culprit(12903, "u4", "python worker.py", 9 * GIB, slope_bytes_per_second=slope)
        assert culprit_facts(culprit) == ["9.0 GiB", "pid 12903"]
        assert "/min" not in rules.describe(culprit)
