"""The running agent: poll on an interval, export, and push to the server when configured.

Data flows one way: NVML -> :class:`~gpuwatch.agent.sampler.Sampler` -> snapshot ->
{:class:`~gpuwatch.agent.state.AgentState` (read by ``/metrics`` and ``/snapshot``),
reporter -> central server}. A failed poll is counted and logged once per failure
streak; the loop keeps going, because a GPU that errors now may answer in a minute.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpuwatch.agent.collectors.agent import AgentCollector, PushStats
from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.collectors.registry import NamedCollector, ScrapeRenderer
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.sampler import Sampler
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.errors import GpuwatchError
from gpuwatch.settings import AgentSettings, parse_host_port
from gpuwatch.snapshot import HostSnapshot

log = logging.getLogger(__name__)


class SnapshotSink(Protocol):
    """Where snapshots go besides the exporter (the reporter to the central server)."""

    def offer(self, snapshot: HostSnapshot) -> None: ...

    def push_stats(self) -> PushStats: ...

    def send_event(self, event: dict[str, Any]) -> object: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Agent:
    """Owns the poll loop and the exporter; everything it needs is passed in."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        sampler: Sampler,
        state: AgentState,
        torch_reports: TorchReports,
        sink: SnapshotSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._sampler = sampler
        self.state = state
        self._torch = torch_reports
        self._sink = sink
        self._clock = clock
        self._stop = threading.Event()
        self._last_offer = float("-inf")
        self._failing = False
        self.exporter = Exporter(
            parse_host_port(settings.listen),
            render_metrics=self._renderer().render,
            state=state,
            torch_reports=torch_reports,
            poll_interval_seconds=settings.poll_interval_seconds,
            on_oom=self._on_oom,
            clock=clock,
        )

    def _renderer(self) -> ScrapeRenderer:
        source = lambda: self.state.latest  # noqa: E731 - read at scrape time
        from_snapshot: list[NamedCollector] = [
            GpuCollector(source),
            ProcessCollector(
                source,
                enabled=self._settings.process_metrics,
                max_series=self._settings.process_metrics_max_series,
            ),
        ]
        if self._settings.dcgm_compat:
            from_snapshot.append(DcgmCompatCollector(source))
        live: list[NamedCollector] = [
            AgentCollector(
                self.state,
                torch_reports_total=lambda: self._torch.received_total,
                push_stats=self._sink.push_stats if self._sink else None,
            )
        ]
        return ScrapeRenderer(from_snapshot, live, sequence=self._latest_sequence)

    def _latest_sequence(self) -> int | None:
        latest = self.state.latest
        return None if latest is None else latest.sequence

    def poll_once(self) -> HostSnapshot | None:
        """One poll; the snapshot is recorded and offered to the sink. ``None`` on failure."""
        try:
            snapshot = self._sampler.poll()
        except GpuwatchError as err:
            self.state.record_failure()
            if not self._failing:
                log.error("poll failed: %s", err)
                self._failing = True
            return None
        if self._failing:
            log.warning("polls succeed again")
            self._failing = False
        self.state.record_poll(snapshot)
        now = self._clock()
        if (
            self._sink is not None
            and now - self._last_offer >= self._settings.push_interval_seconds
        ):
            self._sink.offer(snapshot)
            self._last_offer = now
        return snapshot

    def run(self) -> None:
        """Serve and poll until :meth:`stop` is called (SIGTERM / SIGINT in the CLI)."""
        self.exporter.start()
        if self._sink is not None:
            self._sink.start()
        log.info("agent serving on %s", self.exporter.url)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.poll_once()
                elapsed = time.monotonic() - started
                self._stop.wait(max(0.0, self._settings.poll_interval_seconds - elapsed))
        finally:
            if self._sink is not None:
                self._sink.stop()
            self.exporter.stop()

    def stop(self) -> None:
        self._stop.set()

    def _on_oom(self, incident: dict[str, Any]) -> None:
        """An OOM incident from ``gpuwatch.torch``: attach who was on the GPU, forward it."""
        latest = self.state.latest
        log.warning(
            "OOM incident reported by pid %s on GPU %s",
            incident.get("pid"),
            incident.get("device_index"),
        )
        if self._sink is None:
            return
        event = {
            "kind": "oom",
            "hostname": latest.hostname if latest else socket.gethostname(),
            "gpu_index": incident.get("device_index"),
            "pid": incident.get("pid"),
            "summary": str(incident.get("message", ""))[:1000],
            "evidence": {
                "explanation": incident.get("explanation"),
                "snapshot": latest.model_dump(mode="json") if latest else None,
            },
            "occurred_at": incident.get("occurred_at") or self._clock(),
        }
        self._sink.send_event(event)
