"""In-process PyTorch reporter: allocator figures to the local agent, and OOM diagnoses.

Use it from a training script::

    import gpuwatch.torch
    gpuwatch.torch.install()                 # once, at start-up

    with gpuwatch.torch.guard():             # optional: explicit, works in notebooks too
        train()

    gpuwatch.torch.log_epoch_peak(epoch)     # once per epoch: a slow leak shows early

What it does:

1. A daemon thread posts PyTorch's own allocator view every ``interval_seconds`` to
   ``POST {agent_url}/torch`` (a :class:`gpuwatch.wire.TorchReport`): allocated,
   reserved, reserved-but-unallocated and the peak since the previous report
   (``reset_peak_memory_stats`` after each read), for every device on which this
   process's allocator holds memory. NVML cannot see this split; the agent attaches it
   to the process in its snapshot. The training loop never waits on it, and an absent
   agent costs one refused connection per interval.
2. On ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) or an older
   ``RuntimeError("CUDA out of memory...")``, through ``sys.excepthook`` (chained to
   the previous hook) or :func:`guard`, it prints the ``gpuwatch explain`` diagnosis to
   stderr, posts an incident (a :class:`gpuwatch.wire.OomIncident`) to
   ``POST {agent_url}/incidents/oom`` (the agent adds who was on the GPU and forwards
   it to the central server) and lets the exception go on.

The agent URL is ``agent_url``, else the environment variable ``GPUWATCH_AGENT_URL``,
else ``http://127.0.0.1:9402``. This is the one place outside gpuwatch.settings that
reads the environment: it runs inside the user's training process, where no gpuwatch
settings exist, and an environment variable is how a cluster points every job at a
non-default agent without editing training scripts.

``torch`` is imported lazily (first use), and nothing in the base package imports
this module. The allocator source is injectable (:class:`AllocatorStats`) so it can
be tested without a GPU.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ContextDecorator, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ValidationError

from gpuwatch.doctor import DEFAULT_AGENT_URL
from gpuwatch.doctor.explain import Explanation, explain_facts
from gpuwatch.doctor.live import fetch_local_snapshot
from gpuwatch.doctor.parse import parse_oom
from gpuwatch.doctor.report import render
from gpuwatch.doctor.units import format_size
from gpuwatch.errors import NotRecognized
from gpuwatch.wire import (
    INCIDENTS_OOM_PATH,
    MAX_OOM_MESSAGE_CHARS,
    TORCH_PATH,
    OomIncident,
    TorchReport,
)

__all__ = [
    "AllocatorSample",
    "AllocatorStats",
    "OomGuard",
    "Reporter",
    "TorchCudaStats",
    "guard",
    "install",
    "is_oom",
    "log_epoch_peak",
    "uninstall",
]

log = logging.getLogger(__name__)

AGENT_URL_ENV = "GPUWATCH_AGENT_URL"
REPORT_TIMEOUT_SECONDS = 0.5
INCIDENT_TIMEOUT_SECONDS = 2.0
HISTORY_LENGTH = 360  # an hour of reports at the default 10 s
LOW_HEADROOM = 0.10


@dataclass(frozen=True)
class AllocatorSample:
    """PyTorch's allocator on one device, in bytes (``torch.cuda.memory_stats``)."""

    device_index: int
    allocated_bytes: int  # torch.cuda.memory_allocated: live tensors
    reserved_bytes: int  # torch.cuda.memory_reserved: the whole cache
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated since the last reset

    @property
    def reserved_unallocated_bytes(self) -> int:
        return max(0, self.reserved_bytes - self.allocated_bytes)


class AllocatorStats(Protocol):
    """Where allocator figures come from; :class:`TorchCudaStats` in production."""

    def devices(self) -> list[int]:
        """Device indices on which this process's allocator holds memory."""
        ...

    def sample(self, device: int) -> AllocatorSample: ...

    def reset_peak(self, device: int) -> None: ...

    def total_memory(self, device: int) -> int | None:
        """The device's memory in bytes, or ``None`` if unknown."""
        ...


class TorchCudaStats:
    """:class:`AllocatorStats` read from ``torch.cuda`` (imported on first use).

    It never initialises CUDA itself: until the training code has created a CUDA
    context there are no devices to report, so the reporter thread cannot create a
    context on the wrong GPU.
    """

    def devices(self) -> list[int]:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        return [d for d in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(d) > 0]

    def sample(self, device: int) -> AllocatorSample:
        import torch

        return AllocatorSample(
            device_index=device,
            allocated_bytes=torch.cuda.memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        )

    def reset_peak(self, device: int) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(device)

    def total_memory(self, device: int) -> int | None:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(device).total_memory)


def is_oom(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` and any RuntimeError holding an OOM message.

    The second covers PyTorch before 1.13 (a plain RuntimeError), ``CUDA error: out of
    memory`` (``torch.AcceleratorError``), cuBLAS/cuDNN allocation failures and MPS.
    """
    torch = sys.modules.get("torch")
    oom_types = tuple(
        t
        for t in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(t, type)
    )
    if oom_types and isinstance(exc, oom_types):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    try:
        parse_oom(str(exc))
    except NotRecognized:
        return False
    return True


class Reporter:
    """Posts allocator figures on a daemon thread and handles OOMs for this process."""

    def __init__(
        self,
        *,
        agent_url: str,
        interval_seconds: float = 10.0,
        device: int | None = None,
        stats: AllocatorStats | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive")
        self.agent_url = agent_url.rstrip("/")
        self.interval_seconds = interval_seconds
        self.device = device
        self.stats: AllocatorStats = stats if stats is not None else TorchCudaStats()
        self._transport = transport
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._history: dict[int, deque[int]] = {}
        self._epoch_peak: dict[int, int] = {}
        self._lock = threading.Lock()
        self._warned_unreachable = False

    def start(self) -> None:
        """Start the reporting thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="gpuwatch-torch-reporter", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread; waits at most ``timeout`` seconds for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        with httpx.Client(timeout=REPORT_TIMEOUT_SECONDS, transport=self._transport) as client:
            while not self._stop.wait(self.interval_seconds):
                self.report_once(client)

    def _devices(self) -> list[int]:
        return [self.device] if self.device is not None else self.stats.devices()

    def report_once(self, client: httpx.Client | None = None) -> int:
        """Sample every device and post one report each; returns how many the agent took."""
        posted = 0
        try:
            samples = []
            for device in self._devices():
                samples.append(self.stats.sample(device))
                self.stats.reset_peak(device)
        except RuntimeError as err:  # CUDA torn down at interpreter exit, a lost GPU
            log.debug("cannot read allocator stats: %s", err)
            return 0
        own = client or httpx.Client(timeout=REPORT_TIMEOUT_SECONDS, transport=self._transport)
        try:
            for sample in samples:
                self._remember(sample)
                report = self._report(sample)
                if report is not None:
                    posted += self._post(own, TORCH_PATH, report, quiet=True)
        finally:
            if client is None:
                own.close()
        return posted

    def _report(self, sample: AllocatorSample) -> TorchReport | None:
        """``sample`` as the agent's ``/torch`` body; ``None`` (logged) if out of bounds."""
        try:
            return TorchReport(
                pid=os.getpid(),
                device_index=sample.device_index,
                allocated_bytes=sample.allocated_bytes,
                reserved_bytes=sample.reserved_bytes,
                reserved_unallocated_bytes=sample.reserved_unallocated_bytes,
                peak_allocated_bytes=sample.peak_allocated_bytes,
                reported_at=self._clock(),
            )
        except ValidationError as err:
            # Never kill the reporting thread over one odd figure.
            log.debug("allocator figures not reportable: %s", err)
            return None

    def _remember(self, sample: AllocatorSample) -> None:
        with self._lock:
            self._history.setdefault(sample.device_index, deque(maxlen=HISTORY_LENGTH)).append(
                sample.allocated_bytes
            )
            peak = max(self._epoch_peak.get(sample.device_index, 0), sample.peak_allocated_bytes)
            self._epoch_peak[sample.device_index] = peak

    def _post(self, client: httpx.Client, path: str, body: BaseModel, *, quiet: bool) -> int:
        try:
            client.post(
                self.agent_url + path,
                content=body.model_dump_json().encode(),
                headers={"Content-Type": "application/json"},
            ).raise_for_status()
        except httpx.HTTPError as err:
            # No agent is normal (a laptop, a job on a host without one): say it once.
            level = logging.DEBUG if quiet and self._warned_unreachable else logging.INFO
            log.log(level, "gpuwatch agent at %s did not take %s: %s", self.agent_url, path, err)
            self._warned_unreachable = True
            return 0
        return 1

    def history(self, device: int) -> list[int]:
        """Allocated bytes per report on ``device``, oldest first."""
        with self._lock:
            return list(self._history.get(device, ()))

    def take_epoch_peak(self, device: int) -> int:
        """Highest peak reported on ``device`` since the last call (and resets it)."""
        with self._lock:
            return self._epoch_peak.pop(device, 0)

    def handle_oom(self, exc: BaseException, *, stream: Any = None) -> Explanation:
        """Diagnose ``exc`` to stderr and post the incident; never raises."""
        if getattr(exc, "_gpuwatch_reported", False):
            return Explanation.not_recognized()
        message = str(exc)
        try:
            facts = parse_oom(message)
        except NotRecognized:
            explanation, device = Explanation.not_recognized(), None
        else:
            device = self._incident_device(facts.device_index)
            snapshot = fetch_local_snapshot(
                self.agent_url, timeout=REPORT_TIMEOUT_SECONDS, transport=self._transport
            )
            growth = self.history(device) or None
            explanation = explain_facts(facts, snapshot=snapshot, growth=growth)
        out = stream if stream is not None else sys.stderr
        print("gpuwatch: diagnosis of this out-of-memory error", file=out)
        print(
            render(explanation) if explanation.recognized else "  (message not recognised)\n",
            file=out,
            end="",
        )
        try:
            incident: OomIncident | None = OomIncident(
                pid=os.getpid(),
                device_index=self._incident_device(device),
                message=message[:MAX_OOM_MESSAGE_CHARS],
                explanation=explanation.model_dump(mode="json"),
                occurred_at=self._clock(),
            )
        except ValidationError as err:  # e.g. a device index past what the agent takes
            log.info("gpuwatch cannot report this out-of-memory error to the agent: %s", err)
            incident = None
        if incident is not None:
            with httpx.Client(
                timeout=INCIDENT_TIMEOUT_SECONDS, transport=self._transport
            ) as client:
                self._post(client, INCIDENTS_OOM_PATH, incident, quiet=False)
        # Marks it so guard() and the excepthook do not report it twice; an exception
        # type with __slots__ refuses the attribute, and a second report is harmless.
        with suppress(AttributeError):
            exc._gpuwatch_reported = True  # type: ignore[attr-defined]
        return explanation

    def _incident_device(self, device: int | None) -> int:
        # The message's GPU, else the configured one, else the one this process uses.
        if device is not None:
            return device
        if self.device is not None:
            return self.device
        devices = self.stats.devices()
        return devices[0] if devices else 0


_installed: Reporter | None = None
_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = (
    None
)


def install(
    *,
    agent_url: str | None = None,
    interval_seconds: float = 10.0,
    device: int | None = None,
    stats: AllocatorStats | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Reporter:
    """Start reporting and hook uncaught OOMs; returns the (single) :class:`Reporter`.

    ``agent_url``: the local agent (default: ``$GPUWATCH_AGENT_URL``, else
    http://127.0.0.1:9402). ``interval_seconds``: seconds between reports.
    ``device``: report only this CUDA device (default: every device this process's
    allocator holds memory on). ``stats``/``transport``: test seams. Calling it again
    replaces the previous reporter.
    """
    global _installed, _previous_hook
    url = agent_url or os.environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL
    if _installed is not None:
        _installed.stop()
    _installed = Reporter(
        agent_url=url,
        interval_seconds=interval_seconds,
        device=device,
        stats=stats,
        transport=transport,
    )
    _installed.start()
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    return _installed


def uninstall() -> None:
    """Stop the reporter and restore the previous ``sys.excepthook``."""
    global _installed, _previous_hook
    if _installed is not None:
        _installed.stop()
        _installed = None
    if _previous_hook is not None:
        sys.excepthook = _previous_hook
        _previous_hook = None


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if _installed is not None and is_oom(exc):
        _installed.handle_oom(exc)
    (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)


class OomGuard(ContextDecorator):
    """Context manager and decorator: diagnose and report an OOM, then re-raise it."""

    def __init__(self, reporter: Reporter | None = None) -> None:
        self._reporter = reporter

    def __enter__(self) -> OomGuard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is not None and is_oom(exc):
            reporter = self._reporter or _installed or _offline_reporter()
            reporter.handle_oom(exc)
        return False  # never swallow: the caller's own handling still runs


def guard(reporter: Reporter | None = None) -> OomGuard:
    """``with guard(): ...`` or ``@guard()``: report OOMs raised inside, then re-raise."""
    return OomGuard(reporter)


def _offline_reporter() -> Reporter:
    # guard() without install(): diagnose and post the incident, but report nothing
    # periodically (no thread is started).
    url = os.environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL
    return Reporter(agent_url=url)


def log_epoch_peak(
    epoch: int, *, logger: logging.Logger | None = None, device: int | None = None
) -> int | None:
    """Log the epoch's peak allocated memory and the headroom left on the card.

    Uses the installed reporter's peaks since the previous call (the reporter resets
    PyTorch's peak counter at each report) together with the current
    ``max_memory_allocated``; without a reporter, reads and resets PyTorch's counter.
    Returns the peak in bytes, or ``None`` when no device has memory in use.
    """
    out = logger or log
    stats: AllocatorStats = _installed.stats if _installed is not None else TorchCudaStats()
    devices = [device] if device is not None else stats.devices()
    if not devices:
        out.debug("epoch %s: no CUDA memory in use", epoch)
        return None
    index = devices[0]
    peak = stats.sample(index).peak_allocated_bytes
    if _installed is not None:
        peak = max(peak, _installed.take_epoch_peak(index))
    stats.reset_peak(index)
    total = stats.total_memory(index)
    if not total:
        out.info("epoch %s: peak allocated %s on device %s", epoch, format_size(peak), index)
        return peak
    headroom = 1 - peak / total
    level = logging.WARNING if headroom < LOW_HEADROOM else logging.INFO
    out.log(
        level,
        "epoch %s: peak allocated %s of %s on device %s (%.0f%% headroom)",
        epoch,
        format_size(peak),
        format_size(total),
        index,
        100 * headroom,
    )
    return peak
