"""Who owns a context NVML lists: a PID gone from /proc is dead only at the second poll
in a row, and a process that started after NVML first listed its PID is not its owner.

The real sampler and pynvml run over the fake GPUs; ``/proc`` is a copy of the host
fixture whose process, uptime and start ticks each test changes between polls.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.clock import FakeClock

from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import DeviceReading, NvmlSession, ProcessUsage
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

PID = 4100001
FIXTURE = Path(__file__).parent.parent / "fixtures" / "proc" / "host"
HZ = os.sysconf("SC_CLK_TCK")
GIB = 2**30
JUPYTER = "/opt/conda/bin/python3.11 /opt/conda/bin/jupyter-lab --no-browser --port=8888"
BTIME = 1_700_000_000  # the fixture's boot time
FIXTURE_START = BTIME + 500.0  # what Proc.process(started=500.0) reads back
SCENARIO = f"""
[fake]
name = "owners"
lifetime = "2m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
ghost = {PID}
memory = "12GiB"
"""


class Proc:
    """A /proc tree where PID either is a process started at ``started`` seconds after
    boot, or does not exist; ``uptime`` is the tree's seconds since boot."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.copytree(FIXTURE, root, symlinks=True)

    def now(self, uptime: float) -> None:
        (self.root / "uptime").write_text(f"{uptime:.2f} 100.00\n")

    def process(self, started: float | None) -> None:
        target = self.root / str(PID)
        shutil.rmtree(target, ignore_errors=True)
        if started is None:
            return
        shutil.copytree(FIXTURE / "1200", target)
        fields = (FIXTURE / "1200" / "stat").read_text().split(" ")
        fields[0] = str(PID)
        fields[21] = str(int(started * HZ))  # starttime, in clock ticks since boot
        (target / "stat").write_text(" ".join(fields))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Proc, Path]]:
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    host = fake.install(path, runtime_dir=tmp_path / "runtime")
    try:
        yield Proc(tmp_path / "proc"), tmp_path
    finally:
        fake.uninstall()
        host.stop()


def _sampler(proc: Proc, *, confirm_gone: bool = True) -> Sampler:
    identity = HostIdentity(agent_id="agent-1", hostname="gpu-box", boot_id="boot-1")
    procinfo = ProcInfo(proc.root, isolated=False)
    return Sampler(
        NvmlSession.open(), procinfo, identity, timeout_seconds=10, confirm_gone=confirm_gone
    )


def _listed(sampler: Sampler) -> tuple[bool, bool, str | None]:
    (process,) = sampler.poll().gpus[0].processes
    assert process.pid == PID
    return process.alive, process.visible, process.command


def test_a_pid_gone_from_proc_is_dead_only_at_the_second_poll(setup) -> None:
    proc, _ = setup
    proc.now(1000.0)
    proc.process(started=500.0)
    sampler = _sampler(proc)
    assert _listed(sampler)[:2] == (True, True)
    proc.process(started=None)  # it exits; NVML still lists its context
    assert _listed(sampler)[:2] == (True, False)  # unknown: perhaps an exit racing the list
    assert _listed(sampler)[:2] == (False, True)  # still listed a poll later: a dead PID


def test_a_one_shot_read_reports_a_gone_pid_at_once(setup) -> None:
    proc, _ = setup
    proc.now(1000.0)
    assert _listed(_sampler(proc, confirm_gone=False))[:2] == (False, True)


def _dead_owner_then_reused(proc: Proc) -> Sampler:
    """A sampler that saw a context's owner crash (its context still listed, a dead
    PID's) and the kernel give its PID to someone's editor an hour later."""
    proc.now(1000.0)
    sampler = _sampler(proc)
    proc.process(started=None)  # the job crashed: its context stays listed
    _listed(sampler)
    assert _listed(sampler)[:2] == (False, True)
    proc.now(4600.0)
    proc.process(started=4500.0)
    return sampler


def test_a_process_started_after_the_context_was_listed_is_not_its_owner(setup) -> None:
    proc, _ = setup
    sampler = _dead_owner_then_reused(proc)
    alive, _, command = _listed(sampler)
    assert not alive and command is None  # still the dead job's context, nobody blamed


def test_the_owner_that_started_before_the_listing_stays_the_owner(setup) -> None:
    proc, _ = setup
    proc.now(1000.0)
    proc.process(started=999.5)  # started half a second before the poll that listed it
    sampler = _sampler(proc)
    for uptime in (1000.0, 1015.0, 1030.0):
        proc.now(uptime)
        assert _listed(sampler)[:2] == (True, True)


def test_a_poll_that_could_not_read_the_gpu_does_not_forget_when_a_context_was_listed(
    tmp_path: Path,
) -> None:
    """GPU 0 falls off the bus for one poll after the owner died and its PID went to a
    later process: a poll that lists nothing says nothing of the context. Before, the
    next poll took the later process for the owner (blamed, then idle for an hour)."""
    path = tmp_path / "scenario.toml"
    path.write_text(
        SCENARIO + '\n[[fault]]\ngpu = 0\nkind = "gpu_lost"\nat = "60s"\nduration = "10s"\n'
    )
    clock = FakeClock(time.time())
    host = fake.install(path, runtime_dir=tmp_path / "runtime", clock=clock)
    try:
        sampler = _dead_owner_then_reused(Proc(tmp_path / "proc"))
        clock.now = host.state.epoch + 65  # one poll with the GPU off the bus
        assert sampler.poll().gpus[0].lost
        clock.now = host.state.epoch + 75
        alive, _, command = _listed(sampler)
        assert not alive and command is None  # still the dead job's context
    finally:
        fake.uninstall()
        host.stop()


# --- the owner of a context whose process died -----------------------------------------------


def _process(sampler: Sampler) -> GpuProcess:
    (process,) = sampler.poll().gpus[0].processes
    return process


def test_a_process_that_dies_leaving_its_context_is_still_named(setup) -> None:
    """The crashed job's context stays listed: whoever ran it is the one to ask, and the
    server keys the lifetime by its start time, so the dead PID stays the same lifetime."""
    proc, _ = setup
    proc.now(1000.0)
    proc.process(started=500.0)
    sampler = _sampler(proc)
    alive = _process(sampler)
    proc.process(started=None)  # it exits; NVML still lists its context

    unknown, dead = _process(sampler), _process(sampler)

    assert (unknown.alive, unknown.visible, dead.alive, dead.visible) == (True, False, False, True)
    for later in (unknown, dead):
        assert later.start_time == alive.start_time
        assert later.command == alive.command == JUPYTER
        assert later.owner == alive.owner and later.owner.uid == 1000
        assert not later.orphaned and later.jupyter_server_alive is None  # judged now, not then


def test_a_reused_pid_leaves_the_context_to_its_dead_owner_not_the_new_process(setup) -> None:
    proc, _ = setup
    proc.now(1000.0)
    proc.process(started=500.0)
    sampler = _sampler(proc)
    _process(sampler)
    proc.process(started=None)  # the job crashed: its context stays listed
    _process(sampler)
    proc.now(4600.0)
    proc.process(started=4500.0)  # an hour later the kernel gives its PID to an editor
    (proc.root / str(PID) / "cmdline").write_bytes(b"vim\x00notes.txt\x00")

    process = _process(sampler)

    assert not process.alive
    assert process.command == JUPYTER  # the context's owner, never the editor
    assert process.start_time == FIXTURE_START


def test_a_pid_never_seen_alive_has_no_owner_to_keep(setup) -> None:
    proc, _ = setup
    proc.now(1000.0)
    sampler = _sampler(proc, confirm_gone=False)
    process = _process(sampler)
    assert (process.alive, process.command, process.start_time) == (False, None, None)


# --- one process, two contexts (nvidia-smi's C+G) -------------------------------------------


class TwoContextSession:
    """An NVML session whose one GPU lists PID 4242 twice, as a compute and a graphics
    context of the same memory (NVML does so; the fake GPUs refuse to), and PID 4343 once."""

    driver_version = nvml_version = "550.54.15"
    cuda_driver_version = "12.4"

    def device_count(self) -> int:
        return 1

    def read_device(self, index: int) -> DeviceReading:
        listed = [
            ProcessUsage(4242, "graphics", 2 * GIB),
            ProcessUsage(4343, "compute", GIB),
            ProcessUsage(4242, "compute", 2 * GIB),
        ]
        return DeviceReading(
            index=index,
            uuid="GPU-00000000-0000-0000-0000-000000000000",
            name="NVIDIA RTX 6000 Ada Generation",
            memory_total_bytes=48 * GIB,
            memory_used_bytes=3 * GIB,
            processes=listed,
            processes_before_memory=listed,
        )


def test_a_process_with_compute_and_graphics_contexts_is_one_process(tmp_path: Path) -> None:
    sampler = Sampler(
        TwoContextSession(),  # type: ignore[arg-type]
        ProcInfo(Proc(tmp_path / "proc").root, isolated=False),
        HostIdentity(agent_id="agent-1", hostname="gpu-box", boot_id="boot-1"),
        timeout_seconds=10,
        confirm_gone=False,
    )
    snapshot = sampler.poll()
    (gpu,) = snapshot.gpus

    assert [(p.pid, p.kind, p.used_bytes) for p in gpu.processes] == [
        (4242, "compute", 2 * GIB),
        (4343, "compute", GIB),
    ]
    assert gpu.unattributed_bytes == 0
    registry = CollectorRegistry()
    registry.register(ProcessCollector(lambda: snapshot, enabled=True, max_series=10))
    series = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith("gpuwatch_gpu_process_memory_used_bytes{")
    ]
    assert len(series) == 2 and sum('pid="4242"' in line for line in series) == 1


def test_the_process_collector_gives_one_series_per_pid_whatever_the_snapshot() -> None:
    """A snapshot from elsewhere may list a PID once per context kind (the schema allows
    it): still one series, with the larger figure."""
    listed = [
        GpuProcess(pid=4242, kind="graphics", used_bytes=GIB, name="isaac-sim"),
        GpuProcess(pid=4242, kind="compute", used_bytes=2 * GIB, name="isaac-sim"),
    ]
    snapshot = HostSnapshot(
        agent_id="a",
        hostname="h",
        boot_id="b",
        sequence=1,
        collected_at=1.7e9,
        gpus=[Gpu(index=0, uuid="GPU-0", processes=listed)],
    )
    registry = CollectorRegistry()
    registry.register(ProcessCollector(lambda: snapshot, enabled=True, max_series=10))
    series = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith("gpuwatch_gpu_process_memory_used_bytes{")
    ]
    assert len(series) == 1 and series[0].endswith(" 2.147483648e+09")  # 2 GiB
