"""No stop follows a warning the server has not stored.

Any local user can keep a host's event budget busy with OOM incidents; a warning that
never reached the server must not pass for given. Real processes on fake GPUs, the
agent's poll loop on a fake clock; the sink answers each event with a delivery the test
settles, as the agent's event sender does once the server answers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import Hold, Rig, Victim

from gpuwatch.agent.event_delivery import EventDelivery
from gpuwatch.wire import ReportedEvent


class HeldEvents(Events):
    """Keeps every event, and a delivery the test settles for each."""

    def __init__(self) -> None:
        super().__init__()
        self.deliveries: list[EventDelivery] = []

    def send_event(self, event: ReportedEvent) -> EventDelivery:  # type: ignore[override]
        super().send_event(event)
        delivery = EventDelivery()
        self.deliveries.append(delivery)
        return delivery


def test_a_stop_waits_for_its_warning_to_reach_the_server(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    idle = victims()
    rig.install([Hold(idle.pid, memory="12GiB")])  # 12 of 16 GiB: contended
    sink = HeldEvents()
    agent = policy_agent(rig, tmp_path, sink)  # idle 30m, warn 10m, check 1m
    run_polls(agent, rig, 31)
    assert sink.stages(idle.pid) == ["warning"]

    # The server answers 429 for 12 minutes, past warn_before: still no stop.
    run_polls(agent, rig, 12)
    assert sink.stages(idle.pid) == ["warning"] and idle.alive()

    # Stored at last: the owner gets warn_before (less one check) from now on.
    sink.deliveries[0].settle(delivered=True)
    run_polls(agent, rig, 8)
    assert idle.alive()
    run_polls(agent, rig, 4, until=lambda: not idle.alive())
    assert sink.stages(idle.pid) == ["warning", "stopped"]


def test_a_warning_the_server_never_stored_is_issued_again_not_acted_on(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    idle = victims()
    rig.install([Hold(idle.pid, memory="12GiB")])
    sink = HeldEvents()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 31)
    sink.deliveries[0].settle(delivered=False)  # refused for good, or dropped
    run_polls(agent, rig, 1)
    assert sink.stages(idle.pid) == ["warning", "warning"] and idle.alive()
    sink.deliveries[1].settle(delivered=True)
    run_polls(agent, rig, 12, until=lambda: not idle.alive())
    assert sink.stages(idle.pid) == ["warning", "warning", "stopped"]
