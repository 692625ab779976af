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
   reserved, reserved-but-unallocated and the peak allocated, for every device on which
   this process's allocator holds memory. The peak is PyTorch's own counter, read and
   left alone: resetting it would break the training code's own
   ``max_memory_allocated()`` and its frameworks' memory trackers
   (``install(reset_peak_each_report=True)`` opts in to per-report peaks). NVML cannot
   see this split; the agent attaches it to the process in its snapshot. The training
   loop never waits on it, and an absent agent costs one refused connection per
   interval. Each report names its GPU by UUID: PyTorch's device ordinal is not NVML's
   index (``CUDA_VISIBLE_DEVICES``, CUDA's fastest-first order).
2. On ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) or an older
   ``RuntimeError("CUDA out of memory...")``, through ``sys.excepthook`` and
   ``threading.excepthook`` (each chained to the previous hook) or :func:`guard`, it
   prints the ``gpuwatch explain`` diagnosis to stderr, with the live view of the GPU
   the reporter resolved (not PyTorch's ordinal the message prints), posts an incident
   (a :class:`gpuwatch.wire.OomIncident`) to ``POST {agent_url}/incidents/oom`` (the
   agent adds who was on the GPU and forwards it to the central server) and lets the
   exception go on.

The agent URL is ``agent_url``, else the environment variable ``GPUWATCH_AGENT_URL``,
else ``http://127.0.0.1:9402``. This is the one place outside gpuwatch.settings that
reads the environment: it runs inside the user's training process, where no gpuwatch
settings exist, and an environment variable is how a cluster points every job at a
non-default agent without editing training scripts. (It also reads CUDA's own
``CUDA_VISIBLE_DEVICES``, to name a device when PyTorch cannot tell its UUID.)

Nothing here may break the training process: a missing or CPU-only torch, an invalid
agent URL or a failing allocator read is logged and skipped, and the OOM handler never
replaces the user's exception with its own. Nor hold or grow it, whatever listens on
the agent's port: every exchange has a deadline on the whole of it and a bound on the
answer, never goes through a proxy, and goes only to a listener owned by root, the
agent's service user or this user (:func:`gpuwatch.doctor.live.agent_exchange`); an
OOM'ing process is held at most SNAPSHOT_TIMEOUT_SECONDS + INCIDENT_TIMEOUT_SECONDS.
Nor write into its logs: nothing per request (httpx's INFO line is never emitted).

``torch`` is imported lazily (at :func:`install`, or first use), and nothing in the
base package imports this module. The allocator source is injectable
(:class:`AllocatorStats`), and so is the device identity (``identify``), so both can
be tested without a GPU.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
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
from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.live import (
    MAX_POST_ANSWER_BYTES,
    AgentExchangeError,
    AgentRefused,
    agent_exchange,
    agent_url_problem,
    fetch_local_snapshot,
)
from gpuwatch.doctor.parse import parse_oom
from gpuwatch.doctor.report import render
from gpuwatch.doctor.units import format_size
from gpuwatch.errors import NotRecognized
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import (
    INCIDENTS_OOM_PATH,
    MAX_DEVICE_UUID_CHARS,
    MAX_OOM_MESSAGE_CHARS,
    TORCH_PATH,
    OomIncident,
    TorchReport,
)

__all__ = [
    "AllocatorSample",
    "AllocatorStats",
    "DeviceRef",
    "OomGuard",
    "Reporter",
    "TorchCudaStats",
    "cuda_device_ref",
    "guard",
    "install",
    "is_oom",
    "log_epoch_peak",
    "uninstall",
]

log = logging.getLogger(__name__)

AGENT_URL_ENV = "GPUWATCH_AGENT_URL"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Each is the deadline of a whole exchange (gpuwatch.doctor.live.agent_exchange), so an
# OOM'ing process is held at most SNAPSHOT + INCIDENT seconds by whatever listens.
REPORT_TIMEOUT_SECONDS = 0.5
SNAPSHOT_TIMEOUT_SECONDS = 0.5
INCIDENT_TIMEOUT_SECONDS = 2.0
# Above this the interval could not be waited on (threading's timeout overflows near
# 1e10 s), and reports a day apart are long stale at the agent anyway.
MAX_INTERVAL_SECONDS = 86400.0
# After an agent refused device_uuid (it predates it), the index alone is sent for this
# long, then the UUID again: what answered may have been something else on the port.
UUID_RETRY_SECONDS = 600.0
# How long the periodic reports trust a listener found trusted, while it keeps answering.
LISTENER_RECHECK_SECONDS = 60.0
HISTORY_LENGTH = 360  # an hour of reports at the default 10 s
LOW_HEADROOM = 0.10


@dataclass(frozen=True)
class AllocatorSample:
    """PyTorch's allocator on one device, in bytes (``torch.cuda.memory_stats``)."""

    device_index: int
    allocated_bytes: int  # torch.cuda.memory_allocated: live tensors
    reserved_bytes: int  # torch.cuda.memory_reserved: the whole cache
    peak_allocated_bytes: int  # torch.cuda.max_memory_allocated since the last reset
    # torch.cuda.max_memory_reserved since the last reset: what the card lost at most.
    # None from a source that cannot tell.
    peak_reserved_bytes: int | None = None

    @property
    def peak_held_bytes(self) -> int:
        """The most the card lost to this allocator: the reserved peak (the cache is
        memory no other process can have), else the best lower bound."""
        if self.peak_reserved_bytes is not None:
            return self.peak_reserved_bytes
        return max(self.reserved_bytes, self.peak_allocated_bytes)

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
            peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        )

    def reset_peak(self, device: int) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(device)

    def total_memory(self, device: int) -> int | None:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(device).total_memory)


@dataclass(frozen=True)
class DeviceRef:
    """How the agent is told which GPU a CUDA device ordinal is.

    ``uuid`` names it for sure: PyTorch's UUID of the device, bare (a GPU's or a MIG
    instance's, which PyTorch prints alike), else the ``CUDA_VISIBLE_DEVICES`` entry as
    written (``GPU-...``, ``MIG-...``, a unique prefix of either, or CUDA 11's
    ``MIG-GPU-<uuid>/<gi>/<ci>``); the agent resolves each form
    (``gpuwatch.wire.find_device``). ``index`` is the best guess at NVML's index, for an
    agent that predates UUIDs: the ``CUDA_VISIBLE_DEVICES`` entry when that is a number,
    else the ordinal itself.
    """

    index: int
    uuid: str | None = None


def cuda_device_ref(ordinal: int) -> DeviceRef:
    """The GPU behind PyTorch's device ``ordinal``; never raises, never initialises CUDA."""
    entry = _visible_entry(ordinal)
    uuid = _torch_uuid(ordinal)
    if uuid is None and entry is not None and entry.upper().startswith(("GPU-", "MIG-")):
        uuid = _clean_uuid(entry)
    number = _DEVICE_NUMBER.fullmatch(entry) if entry is not None else None
    return DeviceRef(index=int(number.group()) if number else ordinal, uuid=uuid)


# A CUDA_VISIBLE_DEVICES index: ASCII digits only ("²".isdigit() is True, int() refuses
# it), and short enough for int() (which refuses 4,300 digits and more).
_DEVICE_NUMBER = re.compile(r"[0-9]{1,9}")


def _visible_entry(ordinal: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES``'s entry for ``ordinal`` (a number or a UUID), if set."""
    value = os.environ.get(VISIBLE_DEVICES_ENV)
    if not value:
        return None
    entries = [e.strip() for e in value.split(",")]
    return entries[ordinal] if 0 <= ordinal < len(entries) and entries[ordinal] else None


def _torch_uuid(ordinal: int) -> str | None:
    """PyTorch's UUID of ``ordinal`` (``get_device_properties().uuid``, PyTorch >= 2.0).

    Asked only once the training code has initialised CUDA: the reporter must not
    create a CUDA context itself.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except Exception as err:  # an old torch, a lost device: the index has to do
        log.debug("no UUID for CUDA device %s: %s", ordinal, err)
        return None
    return None if uuid is None else _clean_uuid(str(uuid))


_UUID_TEXT = re.compile(r"[!-~]+")  # what the agent's wire model accepts


def _clean_uuid(text: str) -> str | None:
    """``text`` as it was given, trimmed, or ``None`` if the agent would refuse it (and
    with it the whole report).

    No prefix is added: PyTorch prints a GPU's UUID and a MIG instance's alike, without
    ``GPU-`` or ``MIG-``, so it cannot tell which one it has, and the agent compares
    UUIDs without their prefix (``gpuwatch.wire.find_device``)."""
    uuid = text.strip()
    if len(uuid) > MAX_DEVICE_UUID_CHARS or not _UUID_TEXT.fullmatch(uuid):
        return None
    return uuid


# OOM families on memory no NVML GPU holds: the agent must not pin them on a GPU.
_NOT_CUDA_KINDS = frozenset({"host", "mps", "metal", "hip", "xpu", "vulkan", "directml"})
_CUDA_DEVICE_TYPES = frozenset({"cuda", "gpu"})  # "gpu": TensorFlow/XLA's name for it


def on_cuda_device(facts: OomFacts) -> bool:
    """True unless the message says the memory was not a CUDA device's (host RAM,
    MPS, XPU, ROCm ...). A message that names no device type may be CUDA's."""
    if facts.kind in _NOT_CUDA_KINDS:
        return False
    return facts.device_type is None or facts.device_type in _CUDA_DEVICE_TYPES


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
    """Posts allocator figures on a daemon thread and handles OOMs for this process.

    ``reset_peak_each_report``: reset PyTorch's peak counters after each report, so
    each report's peak covers its interval only; off by default, because the counters
    are the process's own (``torch.cuda.max_memory_allocated()``, frameworks' memory
    trackers) and a reset every interval silently breaks them. ``identify`` tells which
    GPU a device ordinal is (:func:`cuda_device_ref`; a test seam).
    """

    def __init__(
        self,
        *,
        agent_url: str,
        interval_seconds: float = 10.0,
        device: int | None = None,
        stats: AllocatorStats | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        reset_peak_each_report: bool = False,
        identify: Callable[[int], DeviceRef] | None = None,
    ) -> None:
        _check_interval(interval_seconds)
        self.agent_url = agent_url.rstrip("/")
        # Checked once here: httpx raises InvalidURL (not an HTTPError) at every post.
        self.url_problem = agent_url_problem(self.agent_url)
        self.interval_seconds = interval_seconds
        self.device = device
        self.stats: AllocatorStats = stats if stats is not None else TorchCudaStats()
        self.reset_peak_each_report = reset_peak_each_report
        self._identify = identify if identify is not None else cuda_device_ref
        self._refs: dict[int, DeviceRef] = {}
        self._transport = transport
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._history: dict[int, deque[int]] = {}
        self._epoch_peak: dict[int, int] = {}
        self._lock = threading.Lock()
        self._warned_unreachable = False
        self._warned_refused = False
        self._warned_stats = False
        # When (monotonic) an agent refused ``device_uuid`` and took the index alone: it
        # predates it, and is sent the index alone until UUID_RETRY_SECONDS later.
        self._uuid_refused_at: float | None = None
        # When (monotonic) the agent's listener was last found trusted; None: check it.
        self._listener_trusted_at: float | None = None

    def start(self) -> None:
        """Start the reporting thread (idempotent; not with an unusable agent URL)."""
        if self.url_problem is not None:
            return
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
        while not self._stop.wait(self.interval_seconds):
            try:
                self.report_once()
            except Exception as err:  # a report must never end the reporting
                self._stats_failed(err)

    def _devices(self) -> list[int]:
        return [self.device] if self.device is not None else self.stats.devices()

    def report_once(self) -> int:
        """Sample every device and post one report each; returns how many the agent
        took. Never raises, and each post ends within REPORT_TIMEOUT_SECONDS."""
        try:
            samples = self._samples()
        except Exception as err:  # CUDA torn down at exit, a lost GPU, no torch at all
            self._stats_failed(err)
            return 0
        posted = 0
        for sample in samples:
            self._remember(sample)
            report = self._report(sample)
            if report is not None:
                posted += self._post(TORCH_PATH, report, quiet=True, seconds=REPORT_TIMEOUT_SECONDS)
        return posted

    def _samples(self) -> list[AllocatorSample]:
        samples = []
        for device in self._devices():
            samples.append(self.stats.sample(device))
            if self.reset_peak_each_report:  # opted in: see the class docstring
                self.stats.reset_peak(device)
        return samples

    def _stats_failed(self, err: Exception) -> None:
        # Said once at INFO (the user may wonder why the agent shows no figures), then
        # quietly: the thread goes on and reads again next interval.
        level = logging.DEBUG if self._warned_stats else logging.INFO
        log.log(level, "gpuwatch cannot read PyTorch's allocator figures: %r", err)
        self._warned_stats = True

    def device_ref(self, ordinal: int) -> DeviceRef:
        """Which GPU PyTorch's device ``ordinal`` is, for the agent (cached once known)."""
        ref = self._device(ordinal)
        refused = self._uuid_refused_at
        if refused is not None and time.monotonic() - refused < UUID_RETRY_SECONDS:
            return DeviceRef(index=ref.index)
        return ref

    def _device(self, ordinal: int) -> DeviceRef:
        ref = self._refs.get(ordinal)
        if ref is None:
            ref = self._identify(ordinal)
            if ref.uuid is not None:  # before CUDA is initialised it may not be known yet
                self._refs[ordinal] = ref
        return ref

    def _report(self, sample: AllocatorSample) -> TorchReport | None:
        """``sample`` as the agent's ``/torch`` body; ``None`` (logged) if out of bounds."""
        ref = self.device_ref(sample.device_index)
        try:
            return TorchReport(
                pid=os.getpid(),
                device_index=ref.index,
                device_uuid=ref.uuid,
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
            peak = max(self._epoch_peak.get(sample.device_index, 0), sample.peak_held_bytes)
            self._epoch_peak[sample.device_index] = peak

    def _post(self, path: str, body: BaseModel, *, quiet: bool, seconds: float) -> int:
        """POST ``body``; 1 when the agent took it. Never raises, and returns within
        ``seconds`` whatever listens (:func:`~gpuwatch.doctor.live.agent_exchange`)."""
        if self.url_problem is not None:
            self._unreachable(path, self.url_problem, quiet=quiet)
            return 0
        deadline = time.monotonic() + seconds
        status = self._send(path, body, quiet=quiet, seconds=seconds)
        if status == 422 and getattr(body, "device_uuid", None) is not None:
            # Perhaps an agent older than device_uuid: say it by index, as it understands.
            # Only if that is taken is the UUID held back (for a while): a 422 to both is
            # something else answering, and says nothing about UUIDs.
            left = deadline - time.monotonic()
            without = body.model_copy(update={"device_uuid": None})
            status = self._send(path, without, quiet=quiet, seconds=left) if left > 0 else None
            if status is not None and 200 <= status < 300:
                self._uuid_refused_at = time.monotonic()
        if status is None:
            return 0
        if not 200 <= status < 300:
            self._unreachable(path, f"HTTP {status}", quiet=quiet)
            return 0
        return 1

    def _send(self, path: str, body: BaseModel, *, quiet: bool, seconds: float) -> int | None:
        """The status the agent answered ``body`` with; ``None`` (logged) for none.

        Who owns the listener is checked before every incident (it holds the OOM
        message). For the periodic reports (``quiet``) a listener found trusted is
        checked again LISTENER_RECHECK_SECONDS later, or after any failed exchange (the
        port can change hands only while the agent is down): reading ``/proc/net/tcp``
        costs milliseconds on a busy host, every interval, in the training process."""
        now = time.monotonic()
        trusted = self._listener_trusted_at
        check = not quiet or trusted is None or now - trusted >= LISTENER_RECHECK_SECONDS
        try:
            status = agent_exchange(
                self.agent_url + path,
                method="POST",
                # Unset optional fields are left out, so an agent that predates one
                # (its bodies are strict) still takes the body.
                json_body=body.model_dump_json(exclude_none=True).encode(),
                seconds=seconds,
                max_bytes=MAX_POST_ANSWER_BYTES,
                transport=self._transport,
                check_listener=check,
            ).status
        except AgentRefused as err:
            self._listener_trusted_at = None
            self._refused(path, err, quiet=quiet)
        except AgentExchangeError as err:
            self._listener_trusted_at = None
            self._unreachable(path, err, quiet=quiet)
        else:
            if check:
                self._listener_trusted_at = now
            return status
        return None

    def _unreachable(self, path: str, err: object, *, quiet: bool) -> None:
        # No agent is normal (a laptop, a job on a host without one): say it once.
        level = logging.DEBUG if quiet and self._warned_unreachable else logging.INFO
        log.log(level, "gpuwatch agent at %s did not take %s: %s", self.agent_url, path, err)
        self._warned_unreachable = True

    def _refused(self, path: str, err: AgentRefused, *, quiet: bool) -> None:
        # Another user's listener on the agent's port: worth a warning, once per
        # reporter (every interval would flood the job's log); an incident always.
        level = logging.DEBUG if quiet and self._warned_refused else logging.WARNING
        log.log(level, "%s; %s not sent", err, path)
        self._warned_refused = True

    def history(self, device: int | None) -> list[int]:
        """Allocated bytes per report on ``device``, oldest first."""
        with self._lock:
            return list(self._history.get(device, ())) if device is not None else []

    def take_epoch_peak(self, device: int) -> int:
        """Highest reserved peak reported on ``device`` since the last call (and resets
        it: this is gpuwatch's own record, not PyTorch's counter)."""
        with self._lock:
            return self._epoch_peak.pop(device, 0)

    def handle_oom(self, exc: BaseException, *, stream: Any = None) -> Explanation:
        """Diagnose ``exc`` to stderr and post the incident; never raises.

        It runs while the user's OutOfMemoryError propagates: an error of its own would
        replace that exception, so any is logged and swallowed.
        """
        try:
            return self._handle_oom(exc, stream)
        except Exception as err:
            log.warning("gpuwatch could not diagnose or report this out-of-memory error: %r", err)
            return Explanation.not_recognized()

    def _handle_oom(self, exc: BaseException, stream: Any) -> Explanation:
        if getattr(exc, "_gpuwatch_reported", False):
            return Explanation.not_recognized()
        message = str(exc)
        try:
            facts: OomFacts | None = parse_oom(message)
        except NotRecognized:
            facts = None
        device = self._incident_device(facts)
        explanation = (
            Explanation.not_recognized() if facts is None else self._explain(facts, device)
        )
        out = stream if stream is not None else sys.stderr
        print("gpuwatch: diagnosis of this out-of-memory error", file=out)
        print(
            render(explanation) if explanation.recognized else "  (message not recognised)\n",
            file=out,
            end="",
        )
        self._post_incident(message, explanation, device)
        # Marks it so guard() and the excepthook do not report it twice; an exception
        # type with __slots__ refuses the attribute, and a second report is harmless.
        with suppress(AttributeError):
            exc._gpuwatch_reported = True  # type: ignore[attr-defined]
        return explanation

    def _post_incident(self, message: str, explanation: Explanation, device: int | None) -> None:
        ref = None if device is None else self.device_ref(device)
        try:
            incident = OomIncident(
                pid=os.getpid(),
                device_index=None if ref is None else ref.index,
                device_uuid=None if ref is None else ref.uuid,
                message=message[:MAX_OOM_MESSAGE_CHARS],
                explanation=explanation.model_dump(mode="json"),
                occurred_at=self._clock(),
            )
        except ValidationError as err:  # e.g. a device index past what the agent takes
            log.info("gpuwatch cannot report this out-of-memory error to the agent: %s", err)
            return
        self._post(INCIDENTS_OOM_PATH, incident, quiet=False, seconds=INCIDENT_TIMEOUT_SECONDS)

    def _explain(self, facts: OomFacts, device: int | None) -> Explanation:
        """``explain`` of ``facts`` with the live view of the GPU this process resolved
        its ``device`` to, and the growth history reported from it."""
        growth = self.history(device) or None
        snapshot = None
        if self.url_problem is None:
            snapshot = fetch_local_snapshot(
                self.agent_url, timeout=SNAPSHOT_TIMEOUT_SECONDS, transport=self._transport
            )
        live_facts = facts if snapshot is None else self._live_facts(facts, device, snapshot)
        if live_facts is None:  # no GPU of the snapshot is known to be this one
            return explain_facts(facts, growth=growth)
        explanation = explain_facts(live_facts, snapshot=snapshot, growth=growth)
        # The device as the message and the training code name it ("cuda:0").
        return explanation.model_copy(update={"device": facts.device, "printed": facts})

    def _live_facts(
        self, facts: OomFacts, device: int | None, snapshot: HostSnapshot
    ) -> OomFacts | None:
        """``facts`` as the live view must read them: with NVML's index of the GPU this
        process resolved ``device`` to (its UUID, else ``CUDA_VISIBLE_DEVICES``), not
        PyTorch's ordinal from the message (``CUDA_VISIBLE_DEVICES=3``: "GPU 0" is
        NVML's GPU 3, and on a host of identical cards the card-size check cannot tell).
        ``None`` when the UUID names no GPU of ``snapshot``; ``facts`` unchanged when no
        device is known (the message, or the only GPU, is all there is)."""
        if device is None:
            return facts
        try:
            # The agent's own resolution, so the view is of the GPU the incident is
            # counted on (imported here: the agent's modules are needed only now).
            from gpuwatch.agent.service import incident_device

            ref = self._device(device)
            index, _ = incident_device(
                OomIncident(
                    pid=os.getpid(), device_index=ref.index, device_uuid=ref.uuid, message="-"
                ),
                snapshot,
            )
        except Exception as err:  # e.g. an index the wire model refuses
            log.debug("cannot tell which GPU of the snapshot CUDA device %s is: %r", device, err)
            return None
        return None if index is None else facts.model_copy(update={"device_index": index})

    def _incident_device(self, facts: OomFacts | None) -> int | None:
        """The CUDA device ordinal the OOM is about, ``None`` for none or unknown.

        The message's device, else the configured one, else the one this process
        uses; never a GPU for host memory or a non-CUDA device (the agent would count
        it against a GPU that has nothing to do with it).
        """
        if facts is not None and not on_cuda_device(facts):
            return None
        if facts is not None and facts.device_index is not None:
            return facts.device_index
        if self.device is not None:
            return self.device
        try:
            devices = self.stats.devices()
        except Exception as err:  # no torch, CUDA torn down
            log.debug("cannot tell which CUDA device ran out of memory: %r", err)
            return None
        return devices[0] if devices else None


_installed: Reporter | None = None
# The hooks install() replaced: sys.excepthook sees the main thread's uncaught
# exceptions, threading.excepthook every other thread's (a training loop run in a
# thread). None: not replaced.
_previous_hook: Callable[[type[BaseException], BaseException, TracebackType | None], Any] | None = (
    None
)
_previous_thread_hook: Callable[[threading.ExceptHookArgs], Any] | None = None


def _check_interval(seconds: float) -> None:
    """Refuse an interval the reporter thread could not wait on: not a number, NaN
    (it would post in a busy loop), zero or less, infinite or too large (the wait
    overflows and kills the thread)."""
    number = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
    if not number or not math.isfinite(seconds) or not 0 < seconds <= MAX_INTERVAL_SECONDS:
        raise ValueError(
            f"interval_seconds must be a number of seconds above 0 and at most "
            f"{MAX_INTERVAL_SECONDS:g}, not {seconds!r}"
        )


def install(
    *,
    agent_url: str | None = None,
    interval_seconds: float = 10.0,
    device: int | None = None,
    stats: AllocatorStats | None = None,
    transport: httpx.BaseTransport | None = None,
    reset_peak_each_report: bool = False,
) -> Reporter | None:
    """Start reporting and hook uncaught OOMs; returns the (single) :class:`Reporter`.

    ``agent_url``: the local agent (default: ``$GPUWATCH_AGENT_URL``, else
    http://127.0.0.1:9402). ``interval_seconds``: seconds between reports.
    ``device``: report only this CUDA device (default: every device this process's
    allocator holds memory on). ``reset_peak_each_report``: reset PyTorch's peak
    counters after each report (per-interval peaks), which breaks the training code's
    own ``torch.cuda.max_memory_allocated()``; off by default. ``stats``/``transport``:
    test seams. Calling it again replaces the previous reporter.

    Without an importable torch with CUDA (and no ``stats`` of the caller's), it logs
    one line and does nothing (``None``). With an agent URL that is not one, it logs
    one line and only hooks OOMs: the diagnosis still goes to stderr. An
    ``interval_seconds`` that is not a finite number in (0, MAX_INTERVAL_SECONDS]
    raises ValueError at once, on any host: a programming error, said before the
    thread could die of it.
    """
    global _installed
    _check_interval(interval_seconds)  # a programming error: said at once, on any host
    if stats is None:
        problem = _cuda_problem()
        if problem is not None:
            log.info("gpuwatch.torch not installed: %s", problem)
            return None
    url = agent_url or os.environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL
    if _installed is not None:
        _installed.stop()
    _installed = Reporter(
        agent_url=url,
        interval_seconds=interval_seconds,
        device=device,
        stats=stats,
        transport=transport,
        reset_peak_each_report=reset_peak_each_report,
    )
    if _installed.url_problem is not None:
        log.warning(
            "gpuwatch.torch: agent URL %r is unusable (%s); nothing is sent to the agent",
            url,
            _installed.url_problem,
        )
    _installed.start()
    _hook()
    return _installed


def _cuda_problem() -> str | None:
    """Why this process cannot report CUDA allocator figures (``None``: it can)."""
    try:
        import torch
    except Exception as err:  # ImportError, or a broken install failing otherwise
        return f"torch cannot be imported ({err!r})"
    try:
        available = torch.cuda.is_available()  # does not create a CUDA context
    except Exception as err:
        return f"torch cannot tell whether CUDA is available ({err!r})"
    if not available:
        return "this torch has no usable CUDA (a CPU-only build, or no GPU visible)"
    return None


def uninstall() -> None:
    """Stop the reporter and restore the previous ``sys.excepthook`` and
    ``threading.excepthook``, where they are still this module's."""
    global _installed
    if _installed is not None:
        _installed.stop()
        _installed = None
    _unhook()


def _hook() -> None:
    """Chain this module's hooks in front of the current ones (once: a hook still
    chained from an earlier install() is not chained again)."""
    global _previous_hook, _previous_thread_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if _previous_thread_hook is None:
        _previous_thread_hook = threading.excepthook
        threading.excepthook = _thread_excepthook


def _unhook() -> None:
    """Put back the hooks this module replaced, where they are still this module's.

    A hook another library installed since then wraps this one and may call it:
    replacing it would silently drop that library's hook. So it stays, and this
    module's stays under it, passing everything on (with no reporter it reports
    nothing)."""
    global _previous_hook, _previous_thread_hook
    if _previous_hook is not None and sys.excepthook is _excepthook:
        sys.excepthook = _previous_hook
        _previous_hook = None
    if _previous_thread_hook is not None and threading.excepthook is _thread_excepthook:
        threading.excepthook = _previous_thread_hook
        _previous_thread_hook = None


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    try:
        if _installed is not None:
            _report_oom(exc, _installed)
    finally:  # even when the report is interrupted (Ctrl-C): the user's hook runs
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    try:
        if _installed is not None and args.exc_value is not None:
            _report_oom(args.exc_value, _installed)
    finally:
        (_previous_thread_hook or threading.__excepthook__)(args)


def _report_oom(exc: BaseException, reporter: Reporter | None) -> None:
    """Diagnose and report ``exc`` if it is an OOM; never raises (the caller is passing
    the user's exception on, and an error here would replace it)."""
    try:
        if is_oom(exc):
            (reporter or _offline_reporter()).handle_oom(exc)
    except Exception as err:
        log.warning("gpuwatch could not handle %s: %r", type(exc).__name__, err)


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
        if exc is not None:
            _report_oom(exc, self._reporter or _installed)
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
    epoch: int,
    *,
    logger: logging.Logger | None = None,
    device: int | None = None,
    reset_peak: bool = False,
) -> int | None:
    """Log the peak memory PyTorch's allocator reserved and the headroom left on the card.

    Reserved, not allocated: the allocator's cache is memory the card lost, whether or
    not tensors fill it. The peak is PyTorch's counter (since the process started or
    the training code last reset it) together with the installed reporter's peaks since
    the previous call. PyTorch's counter is left alone unless ``reset_peak`` (then each
    call logs that epoch's peak, and the training code's own ``max_memory_*()`` readings
    restart with it). Returns the peak in bytes, or ``None`` when no device has memory
    in use or the figures cannot be read (no torch, no CUDA: logged, never raised into
    the training loop).
    """
    out = logger or log
    stats: AllocatorStats = _installed.stats if _installed is not None else TorchCudaStats()
    try:
        devices = [device] if device is not None else stats.devices()
        if not devices:
            out.debug("epoch %s: no CUDA memory in use", epoch)
            return None
        index = devices[0]
        peak = stats.sample(index).peak_held_bytes
        if _installed is not None:
            peak = max(peak, _installed.take_epoch_peak(index))
        if reset_peak:
            stats.reset_peak(index)
        total = stats.total_memory(index)
    except Exception as err:
        out.info("epoch %s: cannot read PyTorch's allocator figures: %r", epoch, err)
        return None
    if not total:
        out.info("epoch %s: peak reserved %s on device %s", epoch, format_size(peak), index)
        return peak
    headroom = 1 - peak / total
    level = logging.WARNING if headroom < LOW_HEADROOM else logging.INFO
    out.log(
        level,
        "epoch %s: peak reserved %s of %s on device %s (%.0f%% headroom)",
        epoch,
        format_size(peak),
        format_size(total),
        index,
        100 * headroom,
    )
    return peak
