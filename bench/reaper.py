"""Reaper benchmark: how fast memory comes back, and what the agent's history costs.

1. **Decision to memory freed**, as a ratio to the grace period (``--grace``): a real
   process on a fake GPU (attached, 8 GiB), stopped by the same executor ``gpuwatch
   reap`` uses (pidfd, identity re-check, fresh NVML confirmation, audit fsync before
   each signal, NVML read until the process is no longer listed). Cooperative: it exits
   on SIGTERM (goal: a small fraction of the grace). Uncooperative: it ignores SIGTERM
   and is killed at the grace deadline (goal: just above 1x). Grace 2 s, median of 3.
2. **The agent's memory with a full day of local history** for 8 GPUs x 200 processes
   (goal: under 10 MiB more than without it): a day of polls every 15 s into
   :class:`~gpuwatch.agent.reaper.history.ProcessHistory`, at the default bounds. The mix
   is 60% steadily idle, 25% steadily busy, 10% switching every ~10 min, 5% flapping at
   every poll (the worst case, bounded by ``max_runs_per_process``), and 5% of the
   processes replaced by new ones every hour. Measured as the deep size of everything
   the history holds at the end (objects counted once) and as the RSS growth of this
   process while it fed the history.

About a minute on 2 cores.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import write_result

MIB, GIB = 2**20, 2**30
GRACE = 2.0
DAY = 86400.0
POLL = 15.0
GPUS, PER_GPU = 8, 200

_COOPERATIVE = "import time; print('ready', flush=True); time.sleep(600)"
_STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)


def _victim(stubborn: bool) -> subprocess.Popen[str]:
    uid = 4242  # root is protected: victims are an ordinary user's
    process = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            sys.executable,
            "-c",
            _STUBBORN if stubborn else _COOPERATIVE,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def _one_stop(stubborn: bool, workdir: Path) -> dict[str, Any]:
    from gpuwatch.agent.procinfo import ProcInfo
    from gpuwatch.agent.reaper.audit import AuditLog
    from gpuwatch.agent.reaper.events import Actor
    from gpuwatch.agent.reaper.evidence import IdleEvidence
    from gpuwatch.agent.reaper.execute import Executor
    from gpuwatch.agent.reaper.killer import Killer
    from gpuwatch.agent.reaper.plan import Plan
    from gpuwatch.agent.reaper.policy import Candidate, Decision, Holding, Protections
    from gpuwatch.agent.reaper.procfs import ProcReader
    from gpuwatch.agent.sampler import HostIdentity, Sampler
    from gpuwatch.nvml import fake
    from gpuwatch.nvml.fake.lifecycle import stop_all
    from gpuwatch.nvml.library import NvmlSession

    victim = _victim(stubborn)
    runtime = workdir / f"runtime-{victim.pid}"
    scenario = workdir / f"reap-{victim.pid}.toml"
    scenario.write_text(
        f'[fake]\nname = "bench-reap"\nlifetime = "5m"\n[[gpu]]\nmemory_total = "80GiB"\n'
        f'[[process]]\ngpu = 0\nattach = {victim.pid}\nmemory = "8GiB"\n'
    )
    fake.install(scenario, runtime_dir=runtime)
    session = NvmlSession.open()
    try:
        sampler = Sampler(
            session, ProcInfo(isolated=False), HostIdentity("b", "b", "b"), timeout_seconds=5
        )
        process = sampler.poll().gpus[0].processes[0]

        class Observer:
            def observe(self):  # type: ignore[no-untyped-def]
                return sampler.poll()

        idle = IdleEvidence(True, "idle", "idle", idle_seconds=7200, coverage_ratio=1.0)
        candidate = Candidate(
            pid=victim.pid,
            start_time=process.start_time,
            uid=process.owner.uid,
            user=process.owner.user,
            name=process.name,
            command=process.command,
            holdings=(Holding(0, "GPU-0", process.used_bytes, idle),),
        )
        decision = Decision(candidate, "reap", "idle", "idle")
        executor = Executor(
            killer=Killer(ProcReader(), grace_seconds=GRACE, unkillable_seconds=5),
            audit=AuditLog(workdir / "audit.jsonl"),
            observer=Observer(),
            protections=Protections(),
            caller_uid=None,
            actor=Actor(uid=0, user="root", pid=os.getpid(), via="bench"),
            run_id="bench",
            verify_seconds=10,
        )
        started = time.monotonic()
        (result,) = executor.run(Plan(time.time(), "b", "b", 7200, [decision]), dry_run=False)
        elapsed = time.monotonic() - started
    finally:
        session.close()
        fake.uninstall()
        victim.kill()
        victim.wait()
        stop_all(runtime)
    assert result.memory_freed, result
    return {"outcome": result.outcome, "seconds": elapsed, "ratio_to_grace": elapsed / GRACE}


def time_to_freed() -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-reap-"))
    try:
        out: dict[str, Any] = {"grace_seconds": GRACE}
        for name, stubborn in (("cooperative", False), ("uncooperative", True)):
            runs = [_one_stop(stubborn, workdir) for _ in range(3)]
            out[name] = {
                "outcome": runs[0]["outcome"],
                "seconds_median": statistics.median(r["seconds"] for r in runs),
                "ratio_to_grace_median": statistics.median(r["ratio_to_grace"] for r in runs),
                "ratios": [round(r["ratio_to_grace"], 3) for r in runs],
            }
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class _Slot:
    """One process position on a GPU: how it behaves, and its idle and busy readings."""

    kind: str
    idle: Any
    busy: Any
    phase: float


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _deep_size(root: object) -> int:
    """Bytes of ``root`` and everything it references (each object once)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, name) for name in obj.__slots__ if hasattr(obj, name))
    return total


def history_memory() -> dict[str, Any]:
    from gpuwatch.agent.reaper.history import ProcessHistory
    from gpuwatch.agent.reaper.settings import ReapSettings
    from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

    rng = random.Random(7)
    settings = ReapSettings.model_validate({})
    owner = ProcessOwner(user="alice", uid=4242)
    t0 = 1_800_000_000.0
    kinds = ["idle"] * 120 + ["busy"] * 50 + ["switch"] * 20 + ["flap"] * 10

    def process(pid: int, sm: float) -> GpuProcess:
        return GpuProcess.model_construct(
            pid=pid,
            kind="compute",
            used_bytes=2 * GIB,
            sm_ratio=sm,
            visible=True,
            alive=True,
            start_time=t0 - 1000 + pid,
            owner=owner,
        )

    # One slot per process position; 5% of the positions get a new process per hour.
    next_pid = 10_000
    slots: list[list[_Slot]] = []
    for _ in range(GPUS):
        row = []
        for kind in kinds:
            idle, busy = process(next_pid, 0.0), process(next_pid, 0.4)
            row.append(_Slot(kind, idle, busy, rng.uniform(0, 600)))
            next_pid += 1
        slots.append(row)
    history = ProcessHistory(
        poll_interval_seconds=POLL,
        history_seconds=settings.history_seconds,
        max_gap_seconds=settings.max_gap_seconds,
        max_runs=settings.max_runs_per_process,
    )
    rss_before = _rss_bytes()
    polls = int(DAY / POLL)
    started = time.perf_counter()
    for i in range(polls):
        t = t0 + i * POLL
        if i and i % int(3600 / POLL) == 0:  # hourly churn
            for row in slots:
                for slot in rng.sample(row, len(row) // 20):
                    slot.idle, slot.busy = process(next_pid, 0.0), process(next_pid, 0.4)
                    next_pid += 1
        gpus = []
        for index, row in enumerate(slots):
            procs = []
            for slot in row:
                if slot.kind == "idle":
                    procs.append(slot.idle)
                elif slot.kind == "busy":
                    procs.append(slot.busy)
                elif slot.kind == "switch":
                    working = int((t + slot.phase) // 600) % 2 == 1
                    procs.append(slot.busy if working else slot.idle)
                else:
                    procs.append(slot.busy if i % 2 else slot.idle)
            gpus.append(
                Gpu.model_construct(
                    index=index,
                    uuid=f"GPU-{index}",
                    lost=False,
                    read_error=None,
                    mig_instances=[],
                    utilization_ratio=0.5,
                    processes=procs,
                )
            )
        history.observe(
            HostSnapshot.model_construct(hostname="b", boot_id="b", collected_at=t, gpus=gpus)
        )
    feed_seconds = time.perf_counter() - started
    rss_growth = _rss_bytes() - rss_before
    held = _deep_size(history._tracks)
    return {
        "gpus": GPUS,
        "processes_per_gpu": PER_GPU,
        "polls": polls,
        "poll_interval_seconds": POLL,
        "tracks_kept": len(history),
        "history_deep_size_mib": round(held / MIB, 2),
        "rss_growth_mib": round(rss_growth / MIB, 2),
        "goal_mib": 10,
        "observe_ms_per_poll": round(feed_seconds / polls * 1000, 3),
    }


def main() -> None:
    result = {"time_to_freed": time_to_freed(), "history_memory": history_memory()}
    path = write_result("reaper", result)
    print(path.read_text())


if __name__ == "__main__":
    main()
