"""Who a uid is: the host's name for it, its subuid owner's, or a number; never "nobody"
for a uid a user namespace cannot map, never another account's name, and never a
number for good because the directory was down once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.clock import FakeClock

from agent.fakeproc import CONTAINER_ID, make_root, write_process
from gpuwatch.agent.identity import NAME_RETRY_SECONDS, UidMap, UserNames, read_uid_map
from gpuwatch.agent.procinfo import ProcInfo

DEADLINE_SECONDS = 10.0
ROOTLESS = f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CONTAINER_ID}.scope/container\n"
LXD = "0::/lxc.payload.c1/system.slice/jupyter.service\n"


class Directory:
    """An NSS stand-in: names by uid, and an outage switch (sssd restarting)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.down = False

    def __call__(self, uid: int) -> str:
        if self.down:
            raise KeyError(f"getpwuid(): uid not found: {uid}")  # what NSS says when UNAVAIL
        return self.names[uid]


def etc(tmp_path: Path, *, subuid: str = "", passwd: str = "root:x:0:0::/root:/bin/sh\n") -> Path:
    path = tmp_path / "etc"
    path.mkdir()
    (path / "passwd").write_text(passwd)
    if subuid:
        (path / "subuid").write_text(subuid)
    return path


# --- subuids -----------------------------------------------------------------------------------


def test_a_subuid_is_its_range_owners(tmp_path: Path) -> None:
    """jovyan (uid 1000) in alice's rootless Podman is host uid 100999; an unprivileged
    LXD container's root is 1000000, whose range /etc/subuid gives by uid."""
    root = make_root(tmp_path / "proc")
    write_process(root, 5001, uid=100999, cgroup=ROOTLESS)
    write_process(root, 5002, uid=1000000, cgroup=LXD)
    names = UserNames(
        etc=etc(tmp_path, subuid="alice:100000:65536\n1001:1000000:1000000000\n"),
        lookup=Directory({1000: "alice", 1001: "bob"}),
    )
    info = ProcInfo(root, isolated=False, user_names=names)

    alice, bob = info.describe(5001), info.describe(5002)

    assert (alice.user, alice.uid) == ("alice", 100999)  # the uid stays the kernel's
    assert (bob.user, bob.uid) == ("bob", 1000000)
    assert alice.owner.container_id == CONTAINER_ID


def test_a_subuid_outside_any_range_is_owned_by_the_user_manager_running_it(
    tmp_path: Path,
) -> None:
    root = make_root(tmp_path / "proc")
    write_process(root, 5001, uid=100999, cgroup=ROOTLESS)
    write_process(root, 5003, uid=100999, cgroup=LXD)  # no user manager on its path
    names = UserNames(etc=etc(tmp_path), lookup=Directory({1000: "alice"}))
    info = ProcInfo(root, isolated=False, user_names=names)

    assert info.describe(5001).user == "alice"
    assert info.describe(5003).user == "100999"


# --- the container image's passwd file -----------------------------------------------------


def test_the_images_own_passwd_names_nobody(tmp_path: Path) -> None:
    """The image's passwd names uid 10001 "gpuwatch"; a host user with that uid is not."""
    image = "root:x:0:0::/root:/bin/sh\ngpuwatch:x:10001:10001::/var/lib/gpuwatch:/bin/false\n"
    copy = tmp_path / "image-passwd"
    copy.write_text(image)
    root = make_root(tmp_path / "proc")
    write_process(root, 5001, uid=10001)
    lookup = Directory({10001: "gpuwatch"})  # what NSS answers from the image's file
    in_image = ProcInfo(
        root,
        isolated=False,
        user_names=UserNames(etc=etc(tmp_path, passwd=image), image_passwd=copy, lookup=lookup),
    )
    host_file = tmp_path / "host"
    host_file.mkdir()
    (host_file / "passwd").write_text("carol:x:10001:10001::/home/carol:/bin/bash\n")
    mounted = ProcInfo(
        root,
        isolated=False,
        user_names=UserNames(etc=host_file, image_passwd=copy, lookup=Directory({10001: "carol"})),
    )

    assert in_image.describe(5001).user == "10001"
    assert any("/etc/passwd is the container image's" in note for note in in_image.reader_notes)
    assert mounted.describe(5001).user == "carol"
    assert mounted.reader_notes == []


# --- user namespaces ---------------------------------------------------------------------------


def test_uids_a_user_namespace_cannot_map_are_unknown_not_nobody(tmp_path: Path) -> None:
    """Rootless Docker with --pid=host maps host uid 1000 to 0 inside; every other host
    uid reads as the overflow uid."""
    root = make_root(tmp_path / "proc")
    write_process(root, 5001, uid=65534)  # someone else's job, unmappable
    write_process(root, 5002, uid=0)  # the namespace owner's own process
    names = UserNames(
        etc=etc(tmp_path), lookup=Directory({0: "root", 1000: "alice", 65534: "nobody"})
    )
    info = ProcInfo(root, isolated=False, uid_map=UidMap(((0, 1000, 1),)), user_names=names)

    other, own = info.describe(5001), info.describe(5002)

    assert (other.user, other.uid) == (None, None)
    assert (own.user, own.uid) == ("alice", 1000)
    assert any("user namespace" in note for note in info.reader_notes)


def test_the_uid_map_is_read_from_the_readers_procfs(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "self" / "uid_map").write_text("         0       1000          1\n")
    (tmp_path / "sys" / "kernel" / "overflowuid").write_text("65534\n")
    assert read_uid_map(tmp_path) == UidMap(((0, 1000, 1),), 65534)
    (tmp_path / "self" / "uid_map").write_text("         0          0 4294967295\n")
    assert not read_uid_map(tmp_path).nested


USERNS_READER = textwrap.dedent(
    """
    import json, sys
    from gpuwatch.agent.procinfo import ProcInfo
    info = ProcInfo(isolated=False)
    facts = info.describe(int(sys.argv[1]))
    print(json.dumps([facts.user, facts.uid, bool(info.reader_notes)]))
    """
)


def test_a_real_user_namespace_reports_another_users_process_as_unknown() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv")
    job = subprocess.Popen(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "30"]
    )
    try:
        result = subprocess.run(
            ["unshare", "-U", "--map-root-user", sys.executable, "-c", USERNS_READER, str(job.pid)],
            capture_output=True,
            text=True,
            timeout=DEADLINE_SECONDS,
            check=True,
        )
    finally:
        job.kill()
        job.wait()
    assert json.loads(result.stdout) == [None, None, True]


# --- failed lookups ------------------------------------------------------------------------


def test_a_failed_lookup_is_retried_after_a_while_not_kept_for_ever(tmp_path: Path) -> None:
    directory = Directory({1000: "alice"})
    clock = FakeClock(100.0)
    names = UserNames(etc=etc(tmp_path), lookup=directory, clock=clock)

    directory.down = True
    assert names.name(1000) == "1000"
    directory.down = False
    clock.advance(NAME_RETRY_SECONDS - 1)
    assert names.name(1000) == "1000"  # not asked again at once: NSS may go to LDAP
    clock.advance(1)
    assert names.name(1000) == "alice"
    directory.down = True
    assert names.name(1000) == "alice"  # a name found is kept
