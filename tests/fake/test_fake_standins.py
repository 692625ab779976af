"""Stand-in processes: real PIDs that look like the scenario's commands, and die properly."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pynvml
import pytest

from gpuwatch.nvml import fake
from gpuwatch.nvml.fake import lifecycle
from gpuwatch.nvml.fake.procfs import ProcessIdentity, identify, is_alive
from gpuwatch.nvml.fake.runtime_state import locked, read_state, remove_lock, state_path

GIB = 2**30

TWO_GPUS = """
[[gpu]]
memory_total = "16GiB"
[[gpu]]
memory_total = "16GiB"
coherent = true

[[process]]
gpu = 0
spawn = ["python", "-m", "ipykernel_launcher", "-f", "/tmp/kernel-1.json"]
env = { SLURM_JOB_ID = "4242", USER = "alice" }
memory = "1GiB"
[[process]]
gpu = 0
spawn = ["python", "train.py", "--lr", "3e-4"]
orphan = true
memory = "2GiB"
sm_percent = 90
[[process]]
gpu = 1
spawn = ["/usr/bin/python3", "infer.py"]
memory = "3GiB"
[[process]]
gpu = 0
attach = "self"
memory = "512MiB"
"""


@pytest.fixture
def host(write_scenario: Callable[..., Path], runtime_dir: Path) -> fake.FakeHost:
    installed = fake.install(write_scenario(TWO_GPUS), runtime_dir=runtime_dir)
    pynvml.nvmlInit()
    return installed


def listed(index: int) -> dict[int, int]:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(index))
    return {p.pid: p.usedGpuMemory for p in procs}


def used(index: int) -> int:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)


def test_standins_show_the_scenario_command_and_environment(host: fake.FakeHost) -> None:
    kernel, trainer, inferrer = host.pids["0.0"], host.pids["1.0"], host.pids["2.0"]
    raw = Path(f"/proc/{kernel}/cmdline").read_bytes()
    assert raw == b"python\0-m\0ipykernel_launcher\0-f\0/tmp/kernel-1.json\0"
    process = psutil.Process(kernel)
    assert process.cmdline() == ["python", "-m", "ipykernel_launcher", "-f", "/tmp/kernel-1.json"]
    assert process.name() == "python"
    assert process.environ() == {"SLURM_JOB_ID": "4242", "USER": "alice"}
    assert process.cwd() == "/"
    assert psutil.Process(trainer).cmdline() == ["python", "train.py", "--lr", "3e-4"]
    assert psutil.Process(inferrer).name() == "python3"
    assert listed(0) == {kernel: 1 * GIB, trainer: 2 * GIB, os.getpid(): 512 * 2**20}
    assert listed(1) == {inferrer: 3 * GIB}


def test_orphan_is_reparented_and_others_are_children_of_the_supervisor(
    host: fake.FakeHost,
) -> None:
    supervisor = host.state.supervisor.pid
    assert psutil.Process(host.pids["0.0"]).ppid() == supervisor
    orphan_parent = psutil.Process(host.pids["1.0"]).ppid()
    assert orphan_parent not in (supervisor, os.getpid())
    # The supervisor itself is detached from whoever booted the scenario.
    assert psutil.Process(supervisor).ppid() != os.getpid()


def test_every_install_on_the_host_sees_the_same_boot(
    host: fake.FakeHost, write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    again = fake.install(host.scenario.source, runtime_dir=runtime_dir)
    assert again.state.epoch == host.state.epoch
    assert again.pids == host.pids


def test_a_killed_standin_disappears_and_frees_its_memory(
    host: fake.FakeHost, wait_until_dead: Callable[[ProcessIdentity], None]
) -> None:
    before = used(0)
    victim = host.state.processes["0.0"]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until_dead(victim)
    assert victim.pid not in listed(0)
    assert used(0) == before - 1 * GIB


def test_on_a_coherent_gpu_a_dead_process_memory_stays_used(
    host: fake.FakeHost, wait_until_dead: Callable[[ProcessIdentity], None]
) -> None:
    victim = host.state.processes["2.0"]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until_dead(victim)
    assert listed(1) == {}
    assert used(1) == 3 * GIB


def test_stop_kills_standins_but_never_attached_pids(host: fake.FakeHost) -> None:
    identities = [host.state.processes[key] for key in host.state.standins] + [
        host.state.supervisor
    ]
    killed = fake.stop(host.scenario, runtime_dir=host.runtime_dir)
    assert sorted(killed) == sorted(i.pid for i in identities)
    assert not any(is_alive(i) for i in identities)
    assert is_alive(identify(os.getpid()))
    assert (
        read_state(state_path(host.runtime_dir, host.scenario.name, host.scenario.content_hash))
        is None
    )
    assert fake.stop(host.scenario, runtime_dir=host.runtime_dir) == []
    # Nothing of it stays behind: no state, and no zero-byte lock file either.
    assert list(host.runtime_dir.iterdir()) == []


def test_stop_all_removes_a_lock_left_without_its_state(tmp_path: Path) -> None:
    leftover = tmp_path / "old-0123456789abcdef.lock"
    leftover.touch()  # what a stop before lock files were removed left
    assert lifecycle.stop_all(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_waiter_on_a_removed_lock_file_locks_the_one_now_at_its_path(tmp_path: Path) -> None:
    # A stop removes the lock file while holding it; a process waiting on it then holds
    # a lock on a file no longer at the path, and without a check a newcomer would lock
    # the fresh file there and boot the same scenario at the same time.
    path = tmp_path / "s-0123456789abcdef.json"
    waiting, holding, release = threading.Event(), threading.Event(), threading.Event()

    def waiter() -> None:
        waiting.set()
        with locked(path):
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=waiter)
    with locked(path):
        thread.start()
        waiting.wait(10)
        time.sleep(0.2)  # let it block in flock on the file about to go
        remove_lock(path)
    try:
        assert holding.wait(10)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        release.set()
        thread.join(10)


def test_standins_exit_on_their_own_when_the_state_file_goes(
    host: fake.FakeHost, wait_until_dead: Callable[..., None]
) -> None:
    path = state_path(host.runtime_dir, host.scenario.name, host.scenario.content_hash)
    path.unlink()
    for key in host.state.standins:
        wait_until_dead(host.state.processes[key], timeout=10)
    wait_until_dead(host.state.supervisor, timeout=10)


def test_standin_exits_at_its_scenario_exit_time(
    write_scenario: Callable[..., Path], runtime_dir: Path, wait_until_dead: Callable[..., None]
) -> None:
    path = write_scenario(
        '[[gpu]]\nmemory_total = "1GiB"\n[[process]]\ngpu = 0\nspawn = ["sleepy"]\nexit = "30s"\n'
    )
    path.write_text(
        path.read_text().replace("[fake]\n", "[fake]\nspeed = 100.0\n")
    )  # exit after 0.3 s
    host = fake.install(path, runtime_dir=runtime_dir)
    wait_until_dead(host.state.processes["0.0"], timeout=10)


def test_a_state_from_another_boot_is_replaced_and_its_standins_killed(
    host: fake.FakeHost, wait_until_dead: Callable[..., None]
) -> None:
    path = state_path(host.runtime_dir, host.scenario.name, host.scenario.content_hash)
    document = json.loads(path.read_text())
    document["boot_id"] = "an-earlier-boot"
    path.write_text(json.dumps(document))
    again = fake.install(host.scenario.source, runtime_dir=host.runtime_dir)
    assert again.state.epoch > host.state.epoch
    assert set(again.pids.values()).isdisjoint(host.pids.values())
    for key in host.state.standins:
        wait_until_dead(host.state.processes[key])


def test_lifetime_bounds_the_standins(
    write_scenario: Callable[..., Path], runtime_dir: Path, wait_until_dead: Callable[..., None]
) -> None:
    path = write_scenario(
        '[[gpu]]\nmemory_total = "1GiB"\n[[process]]\ngpu = 0\nspawn = ["worker"]\n'
    )
    path.write_text(path.read_text().replace('lifetime = "2m"', 'lifetime = "1s"'))
    host = fake.install(path, runtime_dir=runtime_dir)
    wait_until_dead(host.state.processes["0.0"], timeout=10)
    wait_until_dead(host.state.supervisor, timeout=10)
    rebooted = fake.install(path, runtime_dir=runtime_dir)  # expired: a fresh boot
    assert rebooted.state.epoch > host.state.epoch
