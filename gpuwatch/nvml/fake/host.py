"""The fake host at a moment: what each GPU and process reads as, given the clock.

Everything here is a pure function of the scenario, the runtime state (epoch and
stand-in identities), the clock and process liveness. Scenario time is
``(clock() - epoch) * speed`` seconds, or a fixed ``at`` when frozen. A process is
listed while ``start <= t < exit`` and it is alive (same PID and start time, not a
zombie); ghosts are listed regardless, by design. Memory of processes that are gone is
freed, except on ``coherent`` GPUs, where (as NVML documents for NUMA-coherent parts)
freed pages stay counted as used until the GPU is reset.

Derived values, used when the scenario does not give a timeline:
GPU utilisation is the sum of its processes' SM percentages (at most 100); memory busy
is the sum of the processes' memory busy (default 40 % of their SM); power is
``limit * (0.12 + 0.8 * utilisation)``; temperature ``32 + 0.5 * utilisation`` °C.
The energy counter is the integral of power since the scenario booted; with derived
power it integrates the utilisation the scenario schedules (each process's
``sm_percent`` between its ``start`` and ``exit``, liveness aside), so it never goes
back and needs no state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuwatch.nvml.fake.procfs import ProcessIdentity, is_alive
from gpuwatch.nvml.fake.runtime_state import RuntimeState
from gpuwatch.nvml.fake.scenario import (
    NO_MIG_INSTANCE,
    FaultSpec,
    Ghost,
    GpuSpec,
    ProcessKind,
    ProcessSpec,
    Scenario,
)

Clock = Callable[[], float]

# NVML keeps per-process utilisation samples on a driver-side cadence; one per second
# is coarse enough to be cheap and fine enough for any poll interval gpuwatch uses.
SAMPLE_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class ProcessReading:
    """One GPU context as NVML lists it. ``used_bytes`` None: NVML_VALUE_NOT_AVAILABLE."""

    pid: int
    kind: ProcessKind
    used_bytes: int | None
    sm_percent: int
    memory_busy_percent: int
    encoder_percent: int
    decoder_percent: int
    mig: int | None
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class MemoryReading:
    """Bytes, with nvmlMemory_v2 semantics: ``total = reserved + used + free``."""

    total: int
    reserved: int
    used: int

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


class FakeHost:
    """One booted scenario as seen from this process. Returned by ``install()``."""

    def __init__(
        self,
        scenario: Scenario,
        state: RuntimeState,
        *,
        runtime_dir: Path,
        clock: Clock | None = None,
        at: float | None = None,
    ) -> None:
        self.scenario = scenario
        self.state = state
        self.runtime_dir = runtime_dir
        self.clock: Clock = clock or time.time
        self.frozen_at = at

    # -- time -------------------------------------------------------------------------

    def scenario_time(self) -> float:
        """Scenario seconds since the scenario booted (``at`` when frozen)."""
        if self.frozen_at is not None:
            return self.frozen_at
        return max(0.0, (self.clock() - self.state.epoch) * self.scenario.speed)

    def latest_sample_us(self) -> int:
        """Wall-clock microseconds of the newest per-process utilisation sample."""
        now_us = int(self.clock() * 1_000_000)
        return now_us - now_us % SAMPLE_PERIOD_US

    # -- processes --------------------------------------------------------------------

    @property
    def pids(self) -> dict[str, int]:
        """Stand-in PIDs by process key (``"<entry>.<copy>"``), as started at boot."""
        return {key: self.state.processes[key].pid for key in self.state.standins}

    def identity(self, process: ProcessSpec) -> ProcessIdentity:
        if isinstance(process.origin, Ghost):
            return ProcessIdentity(process.origin.pid, None)
        return self.state.processes.get(process.key, ProcessIdentity(0, None))

    def _listed(self, process: ProcessSpec, t: float) -> bool:
        if t < process.start or (process.exit is not None and t >= process.exit):
            return False
        return isinstance(process.origin, Ghost) or is_alive(self.identity(process))

    def _reading(self, process: ProcessSpec, t: float) -> ProcessReading:
        local = t - process.start
        sm = round(process.sm_percent.at(local))
        busy = process.memory_busy_percent
        mig = self.scenario.gpus[process.gpu].mig[process.mig] if process.mig is not None else None
        return ProcessReading(
            pid=self.identity(process).pid,
            kind=process.kind,
            used_bytes=None if process.memory_not_available else int(process.memory.at(local)),
            sm_percent=sm,
            memory_busy_percent=round(busy.at(local)) if busy else round(sm * 0.4),
            encoder_percent=round(process.encoder_percent.at(local)),
            decoder_percent=round(process.decoder_percent.at(local)),
            mig=process.mig,
            gpu_instance_id=mig.gpu_instance_id if mig else NO_MIG_INSTANCE,
            compute_instance_id=mig.compute_instance_id if mig else NO_MIG_INSTANCE,
        )

    def _listed_specs(self, gpu: int, t: float, mig: int | None) -> list[ProcessSpec]:
        return [
            p
            for p in self.scenario.processes_on(gpu)
            if (mig is None or p.mig == mig) and self._listed(p, t)
        ]

    def processes(self, gpu: int, t: float, *, mig: int | None = None) -> list[ProcessReading]:
        """Contexts listed on GPU ``gpu`` (every MIG instance, or just ``mig``) at ``t``."""
        return [self._reading(p, t) for p in self._listed_specs(gpu, t, mig)]

    def _retained_bytes(self, gpu: GpuSpec, t: float, mig: int | None) -> int:
        """On coherent GPUs, memory of processes that have ended stays allocated."""
        if not gpu.coherent:
            return 0
        retained = 0
        for p in self.scenario.processes_on(gpu.index):
            if t < p.start or isinstance(p.origin, Ghost) or (mig is not None and p.mig != mig):
                continue
            identity = self.identity(p)
            ended = p.exit is not None and t >= p.exit
            died = identity.start_ticks is not None and not is_alive(identity)
            if ended or died:
                until = t if p.exit is None else min(t, p.exit)
                retained += int(p.memory.at(until - p.start))
        return retained

    # -- devices ----------------------------------------------------------------------

    def memory(self, gpu: int, t: float, *, mig: int | None = None) -> MemoryReading:
        """Device (or MIG instance) memory; used is clamped to what the device has.

        Memory of ``memory_not_available`` processes counts: NVML cannot attribute it,
        but it is in use all the same.
        """
        spec = self.scenario.gpus[gpu]
        held = sum(int(p.memory.at(t - p.start)) for p in self._listed_specs(gpu, t, mig))
        held += self._retained_bytes(spec, t, mig)
        if mig is not None:
            total = spec.mig[mig].memory_total
            return MemoryReading(total, 0, min(held, total))
        held += int(spec.unattributed.at(t))
        usable = spec.memory_total - spec.memory_reserved
        return MemoryReading(spec.memory_total, spec.memory_reserved, min(held, usable))

    def utilization_percent(self, gpu: int, t: float) -> int:
        spec = self.scenario.gpus[gpu]
        if spec.utilization_percent is not None:
            return round(spec.utilization_percent.at(t))
        return min(100, sum(p.sm_percent for p in self.processes(gpu, t)))

    def memory_busy_percent(self, gpu: int, t: float) -> int:
        spec = self.scenario.gpus[gpu]
        if spec.memory_busy_percent is not None:
            return round(spec.memory_busy_percent.at(t))
        return min(100, sum(p.memory_busy_percent for p in self.processes(gpu, t)))

    def activity_percent(self, gpu: int, t: float, *, mig: int | None = None) -> int:
        """GR-engine activity at ``t``: the GPU's utilisation, or for MIG instance ``mig``
        its ``activity_percent``, else the SM percentages of its processes (at most 100)."""
        if mig is None:
            return self.utilization_percent(gpu, t)
        timeline = self.scenario.gpus[gpu].mig[mig].activity_percent
        if timeline is not None:
            return round(timeline.at(t))
        return min(100, sum(p.sm_percent for p in self.processes(gpu, t, mig=mig)))

    def busy_percent_seconds(self, gpu: int, t: float, *, mig: int | None = None) -> float:
        """Activity integrated since the scenario booted (percent x seconds), as a GPM
        counter accumulates it: of the GPU's ``utilization_percent`` (or the MIG
        instance's ``activity_percent``) when given, else of the ``sm_percent`` the
        scenario schedules on it (liveness aside, as for energy), at most 100 % at a time."""
        spec = self.scenario.gpus[gpu]
        timeline = spec.utilization_percent if mig is None else spec.mig[mig].activity_percent
        if timeline is not None:
            return timeline.integral(t)
        return self._scheduled_percent_seconds(gpu, t, mig, lambda p, u: p.sm_percent.integral(u))

    def codec_percent(self, gpu: int, t: float, engine: Literal["encoder", "decoder"]) -> int:
        """The video encoder's or decoder's busy share: its processes' (at most 100)."""
        readings = self.processes(gpu, t)
        if engine == "encoder":
            return min(100, sum(p.encoder_percent for p in readings))
        return min(100, sum(p.decoder_percent for p in readings))

    def tensor_percent(self, gpu: int, t: float, *, mig: int | None = None) -> float:
        """Tensor-pipe activity at ``t``: its processes' ``tensor_percent`` (at most 100)."""
        listed = self._listed_specs(gpu, t, mig)
        return min(100.0, sum(p.tensor_percent.at(t - p.start) for p in listed))

    def tensor_percent_seconds(self, gpu: int, t: float, *, mig: int | None = None) -> float:
        """Tensor-pipe activity integrated since boot, like :meth:`busy_percent_seconds`."""
        return self._scheduled_percent_seconds(
            gpu, t, mig, lambda p, u: p.tensor_percent.integral(u)
        )

    def dram_percent(self, gpu: int, t: float, *, mig: int | None = None) -> float:
        """DRAM activity at ``t``: the GPU's memory busy, or the instance's processes'."""
        if mig is None:
            return self.memory_busy_percent(gpu, t)
        return min(100, sum(p.memory_busy_percent for p in self.processes(gpu, t, mig=mig)))

    def dram_percent_seconds(self, gpu: int, t: float, *, mig: int | None = None) -> float:
        """DRAM activity integrated since boot: the GPU's ``memory_busy_percent`` when
        given, else its processes' (``memory_busy_percent``, or 40 % of ``sm_percent``)."""
        spec = self.scenario.gpus[gpu]
        if mig is None and spec.memory_busy_percent is not None:
            return spec.memory_busy_percent.integral(t)

        def busy(p: ProcessSpec, until: float) -> float:
            if p.memory_busy_percent is not None:
                return p.memory_busy_percent.integral(until)
            return 0.4 * p.sm_percent.integral(until)

        return self._scheduled_percent_seconds(gpu, t, mig, busy)

    def _scheduled_percent_seconds(
        self,
        gpu: int,
        t: float,
        mig: int | None,
        integral: Callable[[ProcessSpec, float], float],
    ) -> float:
        """Sum of ``integral(process, seconds it has run)`` over the processes the
        scenario schedules on ``gpu`` (or instance ``mig``) up to ``t``, at most 100 %."""
        busy = 0.0
        for p in self.scenario.processes_on(gpu):
            if mig is not None and p.mig != mig:
                continue
            until = t if p.exit is None else min(t, p.exit)
            if until > p.start:
                busy += integral(p, until - p.start)
        return min(busy, 100 * max(0.0, t))

    def power_watts(self, gpu: int, t: float) -> float:
        spec = self.scenario.gpus[gpu]
        if spec.power_watts is not None:
            return spec.power_watts.at(t)
        return spec.power_limit_watts * (0.12 + 0.8 * self.utilization_percent(gpu, t) / 100)

    def energy_joules(self, gpu: int, t: float) -> float:
        """Energy since the scenario booted: the integral of the power draw (see above)."""
        spec = self.scenario.gpus[gpu]
        if spec.power_watts is not None:
            return spec.power_watts.integral(t)
        busy = self.busy_percent_seconds(gpu, t) / 100
        return spec.power_limit_watts * (0.12 * max(0.0, t) + 0.8 * busy)

    def throttle_mask(self, gpu: int, t: float) -> int:
        """nvmlClocksEventReason* bits: the scenario's, else GpuIdle while idle."""
        spec = self.scenario.gpus[gpu]
        if spec.health.throttle_reasons is not None:
            return int(spec.health.throttle_reasons.at(t))
        return 0x1 if self.utilization_percent(gpu, t) == 0 else 0

    def temperature_celsius(self, gpu: int, t: float) -> int:
        spec = self.scenario.gpus[gpu]
        if spec.temperature_celsius is not None:
            return round(spec.temperature_celsius.at(t))
        return round(32 + 0.5 * self.utilization_percent(gpu, t))

    # -- faults -----------------------------------------------------------------------

    def lost(self, gpu: int, t: float) -> bool:
        """True from a ``gpu_lost`` fault's ``at`` on (NVML_ERROR_GPU_IS_LOST)."""
        return any(
            f.kind == "gpu_lost" and f.gpu == gpu and f.active(t) for f in self.scenario.faults
        )

    def fault(
        self, symbol: str, gpu: int | None, t: float, mig: int | None = None
    ) -> FaultSpec | None:
        """The first active fault other than ``gpu_lost`` on ``symbol``, called on GPU
        ``gpu`` (None: a system call) through its own handle or MIG instance ``mig``'s."""
        for f in self.scenario.faults:
            if f.kind != "gpu_lost" and f.active(t) and f.matches(symbol) and f.covers(gpu, mig):
                return f
        return None

    # -- lifecycle --------------------------------------------------------------------

    def stop(self) -> list[int]:
        """Kill this scenario's stand-ins and remove its state (for every process)."""
        from gpuwatch.nvml.fake.lifecycle import stop

        return stop(self.scenario, self.runtime_dir)
