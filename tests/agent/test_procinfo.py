"""ProcInfo against a real-format fixture /proc tree and against real child processes."""

from __future__ import annotations

import os
import pwd
import re
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from gpuwatch.agent.identity import UserNames
from gpuwatch.agent.procinfo import (
    DEFAULT_SUBREAPERS,
    MAX_COMMAND_CHARS,
    ProcInfo,
    pid_namespace_isolated,
    read_boot_id,
    read_boot_time,
)
from gpuwatch.errors import GpuwatchError
from gpuwatch.snapshot import GpuProcess

FIXTURES = Path(__file__).parent.parent / "fixtures" / "proc"
HOST = FIXTURES / "host"  # a host /proc: initial PID namespace, btime 1700000000
CONTAINER = FIXTURES / "container"  # a container's own /proc, without --pid=host
BTIME = 1_700_000_000
TICKS = os.sysconf("SC_CLK_TCK")
DEADLINE_SECONDS = 10.0


@pytest.fixture
def host() -> ProcInfo:
    return ProcInfo(HOST)


# --- the fixture tree ------------------------------------------------------------------------


def test_training_run_whose_shell_died_is_orphaned(host: ProcInfo) -> None:
    facts = host.describe(1400)
    assert facts.alive and facts.visible
    assert (facts.name, facts.command) == ("python", "python train.py --epochs 90")
    assert facts.ppid == 1
    assert facts.orphaned
    assert facts.start_time == BTIME + 70000 / TICKS
    assert facts.uid == 1001
    assert facts.owner.systemd_unit == "session-4.scope"
    # No readable environ (another user's, typically) just means no job id, never an error.
    assert facts.owner.slurm_job_id is None


@pytest.mark.parametrize(
    ("pid", "why"),
    [
        (1500, "a daemon that called setsid() under PID 1"),
        (1700, "a forking daemon still owned by its system service unit"),
        (1610, "tini's own child, in tini's session"),
        (1600, "a container init under its shim"),
        (1410, "a rootless container's process under conmon"),
        (2100, "a Slurm task under slurmstepd"),
        (1, "PID 1"),
    ],
)
def test_deliberately_detached_processes_are_not_orphaned(
    host: ProcInfo, pid: int, why: str
) -> None:
    assert not host.describe(pid).orphaned, why


@pytest.mark.parametrize(
    ("pid", "why"),
    [
        (1620, "left behind by a docker exec shell, reparented to tini"),
        (1660, "reparented to a container init that is not a known subreaper"),
        (2200, "reparented to PID 1 while its session leader is gone"),
    ],
)
def test_reparented_processes_are_orphaned(host: ProcInfo, pid: int, why: str) -> None:
    assert host.describe(pid).orphaned, why


def test_container_process_owner(host: ProcInfo) -> None:
    owner = host.describe(1620).owner
    assert owner.container_runtime == "docker"
    assert owner.container_id == "3f4c1a2b9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a29180706f5e4d3c2b1a090"
    assert (owner.user, owner.uid) == ("root", 0)


def test_a_subuid_is_named_after_the_user_whose_manager_runs_it(tmp_path: Path) -> None:
    # 1410 is a rootless Podman container's process (subuid 100999) under user@1000.service;
    # no /etc/subuid here, so the cgroup's user manager names the owner.
    names = UserNames(etc=tmp_path, lookup={1000: "alice"}.__getitem__)
    facts = ProcInfo(HOST, user_names=names).describe(1410)
    assert (facts.user, facts.uid) == ("alice", 100999)  # the uid stays the kernel's
    assert facts.owner.container_runtime == "podman"


def test_a_uid_nobody_owns_falls_back_to_the_number(tmp_path: Path) -> None:
    names = UserNames(etc=tmp_path, lookup={}.__getitem__)
    assert names.name(100999) == "100999"


def test_slurm_job_from_cgroup_and_from_environment(host: ProcInfo) -> None:
    assert host.describe(2100).owner.slurm_job_id == "4242"
    # No job cgroup, but the job id is in its environment.
    assert host.describe(2200).owner.slurm_job_id == "5151"


def test_jupyter_kernel_under_its_live_server(host: ProcInfo) -> None:
    facts = host.describe(1300)
    assert facts.jupyter_kernel
    assert facts.jupyter_server_alive is True
    assert not facts.orphaned
    assert facts.owner.systemd_unit == "jupyter.service"


def test_jupyter_kernel_whose_server_died(host: ProcInfo) -> None:
    facts = host.describe(1301)  # reparented to systemd --user; its own session leader
    assert facts.jupyter_kernel
    assert facts.jupyter_server_alive is False
    assert facts.orphaned


def test_jupyter_kernel_started_by_something_else_has_unknown_server(host: ProcInfo) -> None:
    facts = host.describe(1302)  # started by an editor, not a Jupyter server
    assert facts.jupyter_kernel
    assert facts.jupyter_server_alive is None


def test_non_kernels_have_no_jupyter_facts(host: ProcInfo) -> None:
    server = host.describe(1200)
    assert not server.jupyter_kernel
    assert server.jupyter_server_alive is None


def test_comm_with_spaces_and_parentheses(host: ProcInfo) -> None:
    facts = host.describe(1800)
    assert facts.name == ") x (y) z"
    assert facts.ppid == 1400
    assert facts.start_time == BTIME + 99000 / TICKS


def test_zombie_and_missing_pids_are_not_alive(host: ProcInfo) -> None:
    zombie = host.describe(1900)
    assert (zombie.alive, zombie.visible) == (False, True)
    missing = host.describe(424242)
    assert (missing.alive, missing.visible) == (False, True)
    assert missing.name is None


def test_facts_fill_a_gpu_process(host: ProcInfo) -> None:
    facts = host.describe(1300)
    process = GpuProcess(pid=1300, used_bytes=2**30, **facts.to_gpu_process_fields())
    assert process.command == facts.command
    assert process.jupyter_server_alive is True
    assert process.owner == facts.owner
    # Shared with the cache, which is safe only because owners are frozen.
    with pytest.raises(ValidationError):
        process.owner.user = "mallory"  # type: ignore[misc]


def test_boot_id_and_boot_time() -> None:
    assert read_boot_id(HOST) == "6f1d2c3b-4a59-4e8f-9d7c-1b2a3c4d5e6f"
    assert read_boot_time(HOST) == BTIME
    assert read_boot_time(FIXTURES) is None
    with pytest.raises(GpuwatchError, match="boot id"):
        read_boot_id(FIXTURES)


# --- PID namespaces ----------------------------------------------------------------------------


def make_self(root: Path, namespace_inode: int, nspid: str) -> Path:
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "status").write_text(f"Name:\tgpuwatch\nPid:\t7\nNSpid:\t{nspid}\n")
    os.symlink(f"pid:[{namespace_inode}]", root / "self" / "ns" / "pid")
    return root


def test_namespace_detection_on_fixture_trees(tmp_path: Path) -> None:
    assert not pid_namespace_isolated(HOST)
    assert pid_namespace_isolated(CONTAINER)
    # A host /proc bind-mounted into a container: nested namespace, but host PIDs visible.
    assert not pid_namespace_isolated(make_self(tmp_path / "bind", 4026532290, "31337\t7"))
    # No namespace links at all: nothing says we are nested.
    assert not pid_namespace_isolated(tmp_path / "empty")


def test_isolated_agent_never_attributes_a_host_pid_to_a_local_process() -> None:
    info = ProcInfo(CONTAINER)
    assert info.pid_namespace_isolated
    # PID 7 exists in the container's /proc, but NVML's PID 7 is a host process.
    facts = info.describe(7)
    assert (facts.visible, facts.alive, facts.name) == (False, True, None)


def unshare_prefix() -> list[str]:
    """An ``unshare`` invocation that can make a PID namespace here, or skip."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    for flags in (["--pid", "--fork"], ["--user", "--map-root-user", "--pid", "--fork"]):
        probe = subprocess.run(
            [unshare, *flags, "--mount-proc", "true"], capture_output=True, timeout=DEADLINE_SECONDS
        )
        if probe.returncode == 0:
            return [unshare, *flags]
    pytest.skip("this machine does not allow new PID namespaces")


@pytest.mark.parametrize(("mount_proc", "isolated"), [(True, True), (False, False)])
def test_namespace_detection_in_a_real_pid_namespace(mount_proc: bool, isolated: bool) -> None:
    # With its own /proc the child cannot see host PIDs; with the parent's /proc it can.
    command = [*unshare_prefix(), *(["--mount-proc"] if mount_proc else [])]
    code = "from gpuwatch.agent.procinfo import pid_namespace_isolated as f; print(f())"
    result = subprocess.run(
        [*command, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=DEADLINE_SECONDS,
        check=True,
    )
    assert result.stdout.strip() == str(isolated)


# --- the cache ------------------------------------------------------------------------------------


def test_cache_is_per_process_lifetime(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    shutil.copytree(HOST, root, symlinks=True)
    info = ProcInfo(root)
    assert info.describe(1400).command == "python train.py --epochs 90"

    # Same start time: the identity is not read again (a retitled process keeps its command).
    (root / "1400" / "cmdline").write_bytes(b"retitled\x00")
    assert info.describe(1400).command == "python train.py --epochs 90"

    # PID reuse: a new start time is a new process.
    stat = root / "1400" / "stat"
    stat.write_text(stat.read_text().replace(" 70000 ", " 123456 "))
    reused = info.describe(1400)
    assert reused.command == "retitled"
    assert reused.start_time == BTIME + 123456 / TICKS

    # A process that exits between polls is swept, and only once.
    shutil.rmtree(root / "1400")
    assert info.expire_dead() == 1
    assert info.expire_dead() == 0
    assert not info.describe(1400).alive


# --- real processes ----------------------------------------------------------------------------


def read_line(process: subprocess.Popen[str]) -> str:
    """One line from the child's stdout, or fail after a bounded wait (never hang the suite)."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=DEADLINE_SECONDS):
            pytest.fail("child did not report in time")
    return process.stdout.readline().strip()


@pytest.fixture
def live() -> ProcInfo:
    # Our children are in our own namespace, whatever namespace the suite runs in.
    return ProcInfo(isolated=False, subreapers=DEFAULT_SUBREAPERS | {"gw-test-reaper"})


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    code = "import sys; print('ready', flush=True); sys.stdin.read()"
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--marker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SLURM_JOB_ID": "777"},
    )
    assert read_line(process) == "ready"
    yield process
    process.kill()
    process.wait(timeout=DEADLINE_SECONDS)


def test_real_child_is_described(live: ProcInfo, child: subprocess.Popen[str]) -> None:
    facts = live.describe(child.pid)
    assert facts.alive and facts.visible
    assert facts.name == Path(sys.executable).name[:15]
    assert facts.command is not None and facts.command.endswith("--marker")
    assert facts.ppid == os.getpid()
    assert facts.uid == os.getuid()
    assert facts.user == pwd.getpwuid(os.getuid()).pw_name
    assert facts.start_time == pytest.approx(psutil.Process(child.pid).create_time(), abs=0.05)
    assert facts.owner.slurm_job_id == "777"
    assert not facts.orphaned
    assert not facts.jupyter_kernel


def test_killed_child_is_not_alive(live: ProcInfo, child: subprocess.Popen[str]) -> None:
    assert live.describe(child.pid).alive
    child.kill()
    child.wait(timeout=DEADLINE_SECONDS)
    assert not live.describe(child.pid).alive


def test_real_command_is_bounded(live: ProcInfo) -> None:
    long_arg = "x" * (3 * MAX_COMMAND_CHARS)
    code = "import sys; print('ready', flush=True); sys.stdin.read()"
    process = subprocess.Popen(
        [sys.executable, "-c", code, long_arg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert read_line(process) == "ready"
        command = live.describe(process.pid).command
        assert command is not None and len(command) == MAX_COMMAND_CHARS
    finally:
        process.kill()
        process.wait(timeout=DEADLINE_SECONDS)


# A subreaper standing in for tini or systemd --user, so the test does not depend on what PID 1
# of the machine running it is. It starts a direct child in its own session, and a "shell"
# (session leader) that starts a job and exits; the job is then reparented to the reaper.
REAPER = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) or libc.prctl(15, b"gw-test-reaper", 0, 0, 0):
        sys.exit("prctl failed")  # 36: PR_SET_CHILD_SUBREAPER, 15: PR_SET_NAME
    wait = [sys.executable, "-c", "import signal; signal.pause()"]
    direct = subprocess.Popen(wait)
    shell = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; "
         f"print(subprocess.Popen({wait!r}).pid, flush=True)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    job = int(shell.stdout.readline())
    shell.wait()
    print(direct.pid, job, flush=True)
    sys.stdin.read()
    for pid in (direct.pid, job):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    """
)


def test_real_orphan_via_an_intermediate_parent_that_exits(live: ProcInfo) -> None:
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a session leader, as container inits and systemd are
    )
    try:
        line = read_line(reaper)
        assert re.fullmatch(r"\d+ \d+", line), line
        direct, job = (int(pid) for pid in line.split())

        orphan = live.describe(job)
        assert orphan.alive
        assert orphan.ppid == reaper.pid
        assert orphan.orphaned

        kept = live.describe(direct)
        assert kept.ppid == reaper.pid
        assert not kept.orphaned  # the reaper's own child, in the reaper's session
    finally:
        assert reaper.stdin is not None
        reaper.stdin.close()
        try:
            reaper.wait(timeout=DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(reaper.pid, signal.SIGKILL)
            reaper.wait(timeout=DEADLINE_SECONDS)
