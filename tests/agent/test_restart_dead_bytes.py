"""The dead-process and orphaned sums are unknown, not 0, while a PID's fate is open.

The sampler reports a PID missing from ``/proc`` dead only at the second poll in a row,
so at an agent's first poll a dead PID is "not visible". Exporting the dead-process sum
as 0 then made it drop to 0 and back at every agent restart, restarting the ``for:`` of
``GpuMemoryHeldByDeadProcesses``; absent, it is one missed sample the rules bridge.

The restart runs the real sampler and pynvml over a fake GPU whose context belongs to a
dead PID; the other cases use hand-built snapshots.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from support.snapshots import GiB, sample_snapshot

from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession
from gpuwatch.snapshot import GpuProcess, HostSnapshot

GHOST = 4100001
FIXTURE = Path(__file__).parent.parent / "fixtures" / "proc" / "host"
SCENARIO = f"""
[fake]
name = "restart"
lifetime = "2m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
ghost = {GHOST}
memory = "6GiB"
"""
DEAD = "gpuwatch_gpu_memory_dead_process_bytes"
ORPHANED = "gpuwatch_gpu_memory_orphaned_bytes"


@pytest.fixture
def proc_root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    host = fake.install(path, runtime_dir=tmp_path / "runtime")
    root = tmp_path / "proc"
    shutil.copytree(FIXTURE, root, symlinks=True)
    (root / "uptime").write_text("1000.00 100.00\n")
    try:
        yield root
    finally:
        fake.uninstall()
        host.stop()


class Agent:
    """What an agent process holds: a sampler and the GPU collector it renders with;
    a restart is a new one of each."""

    def __init__(self, proc_root: Path) -> None:
        self.sampler = Sampler(
            NvmlSession.open(),
            ProcInfo(proc_root, isolated=False),
            HostIdentity(agent_id="agent-1", hostname="ws", boot_id="boot-1"),
            timeout_seconds=10,
        )
        self.latest: HostSnapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GpuCollector(lambda: self.latest))  # type: ignore[arg-type]

    def poll(self) -> tuple[float | None, float | None]:
        self.latest = self.sampler.poll()
        (gpu,) = self.latest.gpus
        labels = {"gpu": "0", "uuid": gpu.uuid}
        return (
            self.registry.get_sample_value(DEAD, labels),
            self.registry.get_sample_value(ORPHANED, labels),
        )


def test_an_agent_restart_leaves_the_dead_pids_memory_unknown_not_zero(proc_root: Path) -> None:
    before = Agent(proc_root)
    before.poll()
    assert before.poll() == (6 * GiB, 0)  # the ghost's death confirmed

    after = Agent(proc_root)  # restarted: the sampler has to confirm the death again
    assert after.poll() == (None, None)  # unknown: absent, not 0
    assert after.poll() == (6 * GiB, 0)
    assert after.poll() == (6 * GiB, 0)


# --- hand-built snapshots ----------------------------------------------------------------

UUID = "GPU-00000000-0000-0000-0000-000000000000"
LABELS = {"gpu": "0", "uuid": UUID}


def _snapshot(sequence: int, *extra: GpuProcess) -> HostSnapshot:
    """The sample snapshot (GPU 0: a 2 GiB dead PID, a 20 GiB kernel whose server is
    gone, a busy trainer) with ``extra`` processes on GPU 0."""
    snapshot = sample_snapshot()
    gpus = list(snapshot.gpus)
    gpus[0] = gpus[0].model_copy(update={"processes": [*gpus[0].processes, *extra]})
    return snapshot.model_copy(update={"sequence": sequence, "gpus": gpus})


class Scraped:
    def __init__(self) -> None:
        self.latest: HostSnapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GpuCollector(lambda: self.latest))  # type: ignore[arg-type]

    def sums(self, snapshot: HostSnapshot) -> tuple[float | None, float | None]:
        self.latest = snapshot
        return (
            self.registry.get_sample_value(DEAD, LABELS),
            self.registry.get_sample_value(ORPHANED, LABELS),
        )


def test_a_process_exiting_blanks_the_sums_for_one_poll_only() -> None:
    job = GpuProcess(pid=7000, used_bytes=4 * GiB, start_time=1_700_000_000.0)
    scraped = Scraped()
    assert scraped.sums(_snapshot(1, job)) == (2 * GiB, 20 * GiB)
    gone = job.model_copy(update={"visible": False})  # not in /proc: unconfirmed
    assert scraped.sums(_snapshot(2, gone)) == (None, None)
    # Rendered again (another scraper) before the next poll: the same answer.
    assert scraped.sums(_snapshot(2, gone)) == (None, None)
    dead = job.model_copy(update={"alive": False})
    assert scraped.sums(_snapshot(3, dead)) == (6 * GiB, 20 * GiB)


def test_a_process_hidden_for_good_does_not_hide_the_sums_for_good() -> None:
    """A PID ``/proc`` hides (hidepid) stays not visible and alive: only the first poll
    that lists it leaves its fate open."""
    hidden = GpuProcess(pid=8000, used_bytes=4 * GiB, visible=False)
    scraped = Scraped()
    assert scraped.sums(_snapshot(1, hidden)) == (None, None)
    assert scraped.sums(_snapshot(2, hidden)) == (2 * GiB, 20 * GiB)
    assert scraped.sums(_snapshot(3, hidden)) == (2 * GiB, 20 * GiB)


def test_a_gpu_without_an_open_fate_keeps_its_sums() -> None:
    scraped = Scraped()
    snapshot = _snapshot(1, GpuProcess(pid=7000, used_bytes=4 * GiB, visible=False))
    other = snapshot.gpus[0].model_copy(
        update={"index": 1, "uuid": "GPU-1", "processes": snapshot.gpus[0].processes[:-1]}
    )
    scraped.sums(snapshot.model_copy(update={"gpus": [snapshot.gpus[0], other]}))
    assert scraped.registry.get_sample_value(DEAD, LABELS) is None
    assert scraped.registry.get_sample_value(DEAD, {"gpu": "1", "uuid": "GPU-1"}) == 2 * GiB
