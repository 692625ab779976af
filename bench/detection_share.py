"""What detection costs inside ingest: detector seconds as a share of ingest seconds.

One host of 8 GPUs and 50 processes (some leaking, some breathing like training loops,
some idle, one orphan) pushes a snapshot every 15 s for 100 minutes to an in-process
ingest on a real SQLite file, at the server's default settings. Every detector the
ingest path calls is wrapped in a timer, so the two figures come from the same run and
the same snapshots: the share is detector time inside ingest over the whole ingest
time, per snapshot. The first 40 minutes fill the trend windows and are not timed.

Run: ``./dev bench detection_share``; results in ``bench/results/detection_share.json``.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import write_result

GIB = 2**30
PUSH = 15.0
WARM_SNAPSHOTS = 160  # 40 min: every trend window full before timing starts
TIMED_SNAPSHOTS = 240  # 60 min timed
T0 = 1_800_000_000.0
DETECTORS = ("detect_orphan", "detect_share", "detect_unattributed")
TREND_DETECTORS = ("detect_idle", "detect_leak", "detect_filling")


def _processes(seq: int) -> list[list[Any]]:
    from gpuwatch.snapshot import GpuProcess, ProcessOwner

    at = T0 + seq * PUSH
    per_gpu: list[list[Any]] = [[] for _ in range(8)]
    for i in range(50):
        shape = i % 5
        if shape == 0:  # a leak, 0.2 GiB/min
            used, sm = 2 + 0.2 * seq * PUSH / 60, 0.8
        elif shape == 1:  # a training loop breathing with a 90 s period
            used, sm = 6 + 3 * (1 + math.sin(2 * math.pi * at / 90)), 0.9
        elif shape == 2:  # an idle notebook
            used, sm = 4.0, 0.0
        else:
            used, sm = 3.0 + i % 3, 0.5
        per_gpu[i % 8].append(
            GpuProcess(
                pid=10_000 + i,
                used_bytes=int(used * GIB),
                sm_ratio=sm,
                name="python",
                command=f"python job{i}.py",
                start_time=T0 - 100,
                ppid=1 if i == 7 else 900,
                orphaned=i == 7,
                owner=ProcessOwner(user=f"user{i % 6}", uid=1000 + i % 6),
            )
        )
    return per_gpu


def _snapshot(seq: int) -> Any:
    from gpuwatch.snapshot import Gpu, HostSnapshot

    gpus = []
    for index, procs in enumerate(_processes(seq)):
        used = sum(p.used_bytes for p in procs)
        total = 80 * GIB
        gpus.append(
            Gpu(
                index=index,
                uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
                name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=total,
                memory_used_bytes=used,
                memory_free_bytes=total - used,
                unattributed_bytes=0,
                utilization_ratio=0.5,
                processes=procs,
            )
        )
    return HostSnapshot(
        agent_id="agent-bench",
        hostname="bench-host",
        boot_id="boot-1",
        sequence=seq,
        collected_at=T0 + seq * PUSH,
        driver_version="550.54.15",
        gpus=gpus,
    )


class _Timed:
    """Wraps the detectors ``findings`` calls, summing the seconds spent in each."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def _run(tmp: Path) -> dict[str, Any]:
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade
    from gpuwatch.server.ingest import findings
    from gpuwatch.server.ingest.service import ingest_snapshots
    from gpuwatch.settings import ServerSettings
    from gpuwatch.wire import IngestRequest

    settings = ServerSettings(data_dir=tmp, scheduler=False)
    database = create_database(settings.resolved_database_url())
    upgrade(database)
    with database.writer() as session, session.begin():
        from gpuwatch.server.auth import service as auth_service

        auth_service.create_token(session=session, hostname="bench-host", now=T0)
    with database.reader() as session:
        from sqlalchemy import select

        from gpuwatch.server.hosts.models import Host

        host_id = session.scalar(select(Host.id).where(Host.hostname == "bench-host"))
    assert host_id is not None  # the token above created it
    timed = _Timed()
    for name in DETECTORS + TREND_DETECTORS:
        setattr(findings, name, timed.wrap(name, getattr(findings, name)))
    ingest_seconds = 0.0
    snapshots = [_snapshot(seq) for seq in range(WARM_SNAPSHOTS + TIMED_SNAPSHOTS)]
    for seq, snapshot in enumerate(snapshots):
        if seq == WARM_SNAPSHOTS:
            timed.reset()
            ingest_seconds = 0.0
        started = time.perf_counter()
        with database.writer() as session, session.begin():
            ingest_snapshots(
                session=session,
                dialect=database.dialect,
                host_id=host_id,
                request=IngestRequest(snapshots=[snapshot]),
                settings=settings,
                now=snapshot.collected_at,
            )
        ingest_seconds += time.perf_counter() - started
    database.dispose()
    detector_seconds = sum(timed.seconds.values())
    return {
        "snapshots_timed": TIMED_SNAPSHOTS,
        "ingest_ms_per_snapshot": round(1000 * ingest_seconds / TIMED_SNAPSHOTS, 3),
        "detectors_ms_per_snapshot": round(1000 * detector_seconds / TIMED_SNAPSHOTS, 3),
        "detector_share_of_ingest": round(detector_seconds / ingest_seconds, 4),
        "by_detector": {
            name: {
                "calls_per_snapshot": round(timed.calls[name] / TIMED_SNAPSHOTS, 2),
                "us_per_call": round(1e6 * timed.seconds[name] / timed.calls[name], 1),
                "share_of_ingest": round(timed.seconds[name] / ingest_seconds, 4),
            }
            for name in sorted(timed.seconds)
        },
    }


def main() -> None:
    runs = []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(_run(Path(tmp)))
    runs.sort(key=lambda r: r["detector_share_of_ingest"])
    result = {
        "shape": "8 GPUs x 50 processes, one snapshot per request, push every 15 s, "
        "default server settings, SQLite, in-process (no HTTP)",
        "median_run": runs[1],
        "runs": runs,
    }
    path = write_result("detection_share", result)
    print(f"wrote {path}: {runs[1]}")


if __name__ == "__main__":
    main()
