"""The agent's snapshot sink as a test double: it keeps what the agent gives it.

``gpuwatch.agent.service.Agent`` hands every poll's snapshot to ``offer`` and every
reported event to ``send_event``; the real sink spools and pushes them. Tests that
drive an agent in-process give it this one and read ``offered`` and ``events``.
"""

from __future__ import annotations

from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import ReportedEvent


class RecordingSink:
    def __init__(self) -> None:
        self.offered: list[HostSnapshot] = []
        self.events: list[ReportedEvent] = []

    def offer(self, snapshot: HostSnapshot) -> None:
        self.offered.append(snapshot)

    def push_stats(self) -> PushStats:
        return PushStats()

    def send_event(self, event: ReportedEvent) -> None:
        self.events.append(event)

    def spool_problem(self) -> None:
        return None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def stages(self, pid: int) -> list[str]:
        """The reaper policy's stages reported for ``pid`` (warned, withdrawn, ...)."""
        return [e.evidence["stage"] for e in self.events if e.pid == pid]
