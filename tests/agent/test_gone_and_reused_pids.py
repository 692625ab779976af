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
from support.clock import FakeClock

from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

PID = 4100001
FIXTURE = Path(__file__).parent.parent / "fixtures" / "proc" / "host"
HZ = os.sysconf("SC_CLK_TCK")
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
