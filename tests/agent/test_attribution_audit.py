"""Attribution audit: what other users name (cgroup directories, user names) never costs
the poll, names are retried for running processes, and delegated subtrees (a user's
manager, a system container, a container's own directory) are read as their owner's word.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import FakeClock

from gpuwatch.agent.cgroup import parse_cgroup, undelegated
from gpuwatch.agent.identity import NAME_RETRY_SECONDS, UidMap, UserNames
from gpuwatch.agent.procinfo import ProcessFacts, ProcInfo
from gpuwatch.agent.render import process_flags
from gpuwatch.agent.sampler import DESCRIBE_FAILURE_LOG_SECONDS, HostIdentity, Sampler
from gpuwatch.containers import shown_container_id
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession
from gpuwatch.snapshot import GpuProcess, ProcessOwner

from .fakeproc import make_root, write_process

ID = "0123456789abcdef" * 4
POD = "1f2e3d4c-5b6a-4978-8a9b-0c1d2e3f4a5b"
POD_ = POD.replace("-", "_")
HOST_USERS = {0: "root", 1000: "ubuntu", 1001: "alice"}


def host_lookup(uid: int) -> str:
    return HOST_USERS[uid]


def procinfo(
    root: Path,
    etc: Path,
    lookup: Callable[[int], str] = host_lookup,
    clock: FakeClock | None = None,
) -> ProcInfo:
    names = UserNames(etc=etc, lookup=lookup, clock=clock or FakeClock(100.0))
    return ProcInfo(root, isolated=False, uid_map=UidMap(), user_names=names)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "proc")


# --- H1: no name a user chooses fails the snapshot's validation ------------------------------

# What a user may name a directory in its delegated subtree, as long as kernfs takes it
# (a component up to a page, far past NAME_MAX), in the forms each rule reads.
_NAME_CHARS = st.sampled_from("a0_-.:@\\é")
_LONG = st.integers(min_value=240, max_value=4096)


@st.composite
def hostile_component(draw: st.DrawFn) -> str:
    length = draw(_LONG)
    stem = draw(st.text(_NAME_CHARS, min_size=1, max_size=8)) * length
    stem = stem[:length]
    form = draw(
        st.sampled_from(
            [
                "{}.service",
                "{}.scope",
                "lxc.payload.{}",
                "machine-{}.scope",
                "kubepods-pod{}.slice",
                "user@{}.service",
                "job_{}",
                "{}",
            ]
        )
    )
    return form.format(stem)


@settings(max_examples=60, deadline=None)
@given(
    parents=st.sampled_from(
        [
            "/user.slice/user-1000.slice/user@1000.service/app.slice",
            "/lxc",
            "/system.slice/slurmstepd.scope",
            "/kubepods.slice",
            "",
        ]
    ),
    names=st.lists(hostile_component(), min_size=1, max_size=3),
)
def test_no_cgroup_directory_name_can_fail_a_describe(
    tmp_path_factory: pytest.TempPathFactory, parents: str, names: list[str]
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    root = make_root(tmp / "proc")
    cgroup = parents + "/" + "/".join(names)
    write_process(root, 4321, uid=1000, cgroup=f"0::{cgroup}\n4:memory:{cgroup}\n")
    facts = procinfo(root, tmp).describe(4321)
    # Validated as the snapshot validates it: the owner and the row built from it.
    ProcessOwner.model_validate(facts.owner.model_dump())
    GpuProcess(pid=4321, **facts.to_gpu_process_fields())
    assert facts.alive and facts.visible and facts.user == "ubuntu"


def test_a_257_character_unit_is_no_unit_and_the_process_is_still_described(root: Path) -> None:
    # The audit's case: <249 chars>.service, below the user's own manager.
    unit = "a" * 249 + ".service"
    cgroup = f"0::/user.slice/user-1000.slice/user@1000.service/app.slice/{unit}\n"
    write_process(root, 4321, uid=1000, cgroup=cgroup)
    facts = procinfo(root, root.parent).describe(4321)
    assert facts.owner.systemd_unit == "user@1000.service"  # the innermost unit there is
    assert facts.user == "ubuntu"


def test_a_256_character_unit_is_still_a_unit(root: Path) -> None:
    unit = "a" * 248 + ".service"
    write_process(root, 4321, cgroup=f"0::/system.slice/{unit}\n")
    assert procinfo(root, root.parent).describe(4321).owner.systemd_unit == unit


@pytest.mark.parametrize("name", ["x" * 300, "x" * 5000])
def test_a_user_name_longer_than_the_bound_is_cut(root: Path, name: str) -> None:
    write_process(root, 4321, uid=1000)
    facts = procinfo(root, root.parent, lookup=lambda uid: name).describe(4321)
    assert facts.user == facts.owner.user == "x" * 256


def test_a_declared_user_with_a_nul_or_over_the_bound_is_made_valid(root: Path) -> None:
    write_process(root, 4321, uid=1000)
    info = ProcInfo(
        root,
        isolated=False,
        uid_map=UidMap(),
        user_names=UserNames(etc=root.parent, lookup=host_lookup),
        declared_users={(4321, 1_000_000): "bob\x00" + "y" * 400},
    )
    facts = info.describe(4321)
    assert facts.owner.user is not None and len(facts.owner.user) == 256
    assert "\x00" not in facts.owner.user
    GpuProcess(pid=4321, **facts.to_gpu_process_fields())


# --- H1: the sampler never dies of one process ----------------------------------------------

SCENARIO = """
[fake]
name = "two"
lifetime = "2m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
ghost = 4100001
memory = "12GiB"

[[process]]
gpu = 0
ghost = 4100002
memory = "2GiB"
"""


class Exploding(ProcInfo):
    """A ProcInfo that meets something nobody foresaw for one PID."""

    boom: int | None = 4100001

    def describe(self, pid: int) -> ProcessFacts:
        if pid == self.boom:
            raise ValueError("first line\nsecond line")
        return super().describe(pid)


@pytest.fixture
def fake_gpus(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    host = fake.install(path, runtime_dir=tmp_path / "runtime")
    try:
        yield tmp_path
    finally:
        fake.uninstall()
        host.stop()


def test_a_process_that_cannot_be_described_costs_neither_the_poll_nor_the_others(
    fake_gpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_root(fake_gpus / "proc")
    for pid in (4100001, 4100002):
        write_process(root, pid, uid=1001, argv=["python", f"job{pid}.py"], start=100)
    names = UserNames(etc=fake_gpus, lookup=host_lookup)
    info = Exploding(root, isolated=False, uid_map=UidMap(), user_names=names)
    clock = FakeClock(1_700_001_000.0)
    identity = HostIdentity(agent_id="agent-1", hostname="gpu-box", boot_id="boot-1")
    sampler = Sampler(NvmlSession.open(), info, identity, timeout_seconds=10, clock=clock)

    info.boom = None  # first seen well: its owner is then known
    sampler.poll()
    info.boom = 4100001
    with caplog.at_level(logging.WARNING, logger="gpuwatch.agent.sampler"):
        polls = []
        for _ in range(3):
            polls.append(sampler.poll())
            clock.advance(10)
    by_pid = {p.pid: p for p in polls[-1].gpus[0].processes}
    broken, fine = by_pid[4100001], by_pid[4100002]
    # Unknown now (which no detector judges), still named as last seen alive.
    assert (broken.alive, broken.visible, broken.owner.user) == (True, False, "alice")
    assert (fine.alive, fine.visible, fine.command) == (True, True, "python job4100002.py")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # rate-limited: three failures, one line
    assert "cannot describe PID 4100001" in lines[0] and "ValueError: first line" in lines[0]
    assert "second line" not in lines[0]

    clock.advance(DESCRIBE_FAILURE_LOG_SECONDS)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.agent.sampler"):
        sampler.poll()
    # The two it held back, and this one.
    assert ["3 such failure(s)" in r.getMessage() for r in caplog.records] == [True]


# --- M1: a failed name lookup is retried for a running process -------------------------------


def test_a_name_that_failed_during_an_outage_appears_once_the_directory_is_back(
    root: Path,
) -> None:
    down = True

    def directory(uid: int) -> str:
        if down:
            raise KeyError(uid)
        return host_lookup(uid)

    clock = FakeClock(100.0)
    write_process(root, 4321, uid=1001)
    info = procinfo(root, root.parent, lookup=directory, clock=clock)
    first = info.describe(4321)
    assert (first.user, first.owner.user) == ("1001", "1001")
    down = False
    clock.advance(NAME_RETRY_SECONDS + 1)
    later = info.describe(4321)
    assert (later.user, later.owner.user, later.uid) == ("alice", "alice", 1001)
    # The owner is shared again poll after poll once the name holds.
    assert info.describe(4321).owner is info.describe(4321).owner


# --- M2: a user manager's uid only at the host's own position --------------------------------


@pytest.mark.parametrize(
    ("cgroup", "user"),
    [
        # LXD/Incus container running systemd: its uid 1000 is not the host's "ubuntu".
        ("/lxc.payload.c1/user.slice/user-1000.slice/user@1000.service/app.slice/j.service", None),
        # systemd-nspawn, and systemd in a Docker container.
        (
            "/machine.slice/machine-gpubox.scope/payload/user.slice/user-1000.slice/"
            "user@1000.service/app.slice/train.service",
            None,
        ),
        (f"/system.slice/docker-{ID}.scope/user.slice/user-1000.slice/user@1000.service", None),
        # A container root's forgery of root's or another user's manager.
        ("/lxc.payload.c1/user@0.service", None),
        ("/user.slice/user-1000.slice/user@1001.service", None),
        # The host's own: the subuid is named after that user.
        ("/user.slice/user-1000.slice/user@1000.service/user.slice/podman.scope", "ubuntu"),
        # Read from a private cgroup namespace: the reader's ancestors show as "..".
        ("/../../user.slice/user-1001.slice/user@1001.service/app.slice/x.service", "alice"),
    ],
)
def test_a_user_manager_names_the_owner_only_at_the_hosts_own_position(
    root: Path, cgroup: str, user: str | None
) -> None:
    write_process(root, 4321, uid=1001000, cgroup=f"0::{cgroup}\n")
    facts = procinfo(root, root.parent).describe(4321)
    assert facts.user == (user or "1001000")
    assert facts.uid == 1001000


# --- M3: a system container is the container, and what it names protects nothing -------------


@pytest.mark.parametrize(
    "inside",
    [
        "system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",
        f"kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{ID}.scope",
        f"system.slice/docker-{ID}.scope",
        f"kubepods/burstable/pod{POD}/{ID}",
    ],
)
@pytest.mark.parametrize("container", ["/lxc.payload.c1", "/lxc/c1"])
def test_what_a_system_container_names_inside_it_replaces_nothing(
    container: str, inside: str
) -> None:
    owner = parse_cgroup(f"0::{container}/{inside}\n")
    assert (owner.container_runtime, owner.container_id) == ("lxc", "c1")
    assert (owner.pod_uid, owner.slurm_job_id) == (None, None)
    assert undelegated(f"{container}/{inside}") == container


def test_an_nspawn_machine_bounds_what_is_read_without_being_named() -> None:
    path = "/machine.slice/machine-gpubox.scope/payload/system.slice/slurmstepd.scope/job_9"
    owner = parse_cgroup(f"0::{path}\n")
    assert (owner.container_id, owner.slurm_job_id) == (None, None)
    assert undelegated(path) == "/machine.slice/machine-gpubox.scope"


def test_lxc_inside_another_container_keeps_the_outer_one() -> None:
    owner = parse_cgroup(f"0::/system.slice/docker-{ID}.scope/lxc.payload.inner/init.scope\n")
    assert (owner.container_runtime, owner.container_id) == ("docker", ID)
    assert owner.systemd_unit == "init.scope"  # units inside are still read


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        # A container's own directory (kind's node, systemd in Docker): a pod below it is
        # its word, read for attribution but protecting nothing.
        (
            f"/system.slice/docker-{ID}.scope/kubepods/pod{POD}/{'b' * 64}",
            f"/system.slice/docker-{ID}.scope",
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_1",
            "/user.slice/user-1000.slice/user@1000.service",
        ),
        # The host's own pod and job paths are whole (the pod is above its container).
        (
            f"/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{ID}.scope",
            f"/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{ID}.scope",
        ),
        (
            "/system.slice/slurmstepd.scope/job_99/step_0/user/task_0",
            "/system.slice/slurmstepd.scope/job_99/step_0/user/task_0",
        ),
    ],
)
def test_undelegated_stops_at_the_first_delegated_directory(path: str, kept: str) -> None:
    assert undelegated(path) == kept
    assert parse_cgroup(f"0::{kept}\n").slurm_job_id in (None, "99")


# --- L1: an LXC container's name is shown whole ----------------------------------------------


def test_container_names_are_shown_whole_and_hex_ids_cut() -> None:
    assert shown_container_id(ID) == ID[:12]
    assert shown_container_id("student-gpu-01") == "student-gpu-01"
    assert shown_container_id("n" * 100) == "n" * 63 + "…"
    flags = [
        process_flags(
            GpuProcess(pid=1, owner=ProcessOwner(container_runtime="lxc", container_id=name)),
            isolated=False,
        )
        for name in ("student-gpu-01", "student-gpu-02")
    ]
    assert flags == [["lxc student-gpu-01"], ["lxc student-gpu-02"]]
