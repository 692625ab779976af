"""parse_cgroup against real-format /proc/<pid>/cgroup files, one per runtime and layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.agent.cgroup import MAX_PATH_CHARS, CgroupOwner, parse_cgroup

FIXTURES = Path(__file__).parent.parent / "fixtures" / "cgroup"

DOCKER_ID = "3f4c1a2b9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a29180706f5e4d3c2b1a090"
K8S_ID = "9b2d3c4e5f60718293a4b5c6d7e8f90112233445566778899aabbccddeeff001"
CRIO_ID = "e1c2a3b4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f80"
PODMAN_ID = "5d1e8a7c6b5a49382716f5e4d3c2b1a0f9e8d7c6b5a4938271605f4e3d2c1b0a"


def parse_fixture(name: str) -> CgroupOwner:
    return parse_cgroup((FIXTURES / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "docker-cgroupfs-v1.txt",
            CgroupOwner(
                cgroup=f"/docker/{DOCKER_ID}", container_runtime="docker", container_id=DOCKER_ID
            ),
        ),
        (
            "docker-systemd-v2.txt",
            CgroupOwner(
                cgroup=f"/system.slice/docker-{DOCKER_ID}.scope",
                container_runtime="docker",
                container_id=DOCKER_ID,
            ),
        ),
        (
            "k8s-containerd-burstable-v2.txt",
            CgroupOwner(
                cgroup="/kubepods.slice/kubepods-burstable.slice/"
                "kubepods-burstable-pod7c0d3e5a_8f1b_4c2d_9e6f_a1b2c3d4e5f6.slice/"
                f"cri-containerd-{K8S_ID}.scope",
                container_runtime="containerd",
                container_id=K8S_ID,
                pod_uid="7c0d3e5a-8f1b-4c2d-9e6f-a1b2c3d4e5f6",
                pod_qos="burstable",
            ),
        ),
        (
            "k8s-besteffort-cgroupfs-v1.txt",
            CgroupOwner(
                cgroup=f"/kubepods/besteffort/pod2e4f6a8c-1b3d-4e5f-8a9b-0c1d2e3f4a5b/{K8S_ID}",
                # A bare id: containerd or dockershim, the path cannot say which.
                container_runtime=None,
                container_id=K8S_ID,
                pod_uid="2e4f6a8c-1b3d-4e5f-8a9b-0c1d2e3f4a5b",
                pod_qos="besteffort",
            ),
        ),
        (
            "slurm-v2.txt",
            CgroupOwner(
                cgroup="/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",
                slurm_job_id="4242",
                systemd_unit="slurmstepd.scope",
            ),
        ),
        (
            "user-session-v2.txt",
            CgroupOwner(
                cgroup="/user.slice/user-1000.slice/session-3.scope", systemd_unit="session-3.scope"
            ),
        ),
        (
            "systemd-service-v2.txt",
            CgroupOwner(cgroup="/system.slice/jupyter.service", systemd_unit="jupyter.service"),
        ),
    ],
)
def test_parses_every_field_of_a_real_cgroup_file(fixture: str, expected: CgroupOwner) -> None:
    assert parse_fixture(fixture) == expected


def test_guaranteed_pod_has_no_qos_level_in_its_slice_name() -> None:
    owner = parse_fixture("k8s-containerd-guaranteed-v2.txt")
    assert (owner.pod_uid, owner.pod_qos) == ("0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", "guaranteed")
    assert (owner.container_runtime, owner.container_id) == ("containerd", K8S_ID)


def test_kind_nested_kubelet_prefix_still_names_the_pod() -> None:
    owner = parse_fixture("k8s-kind-nested-v2.txt")
    assert (owner.pod_uid, owner.pod_qos) == ("1d2e3f40-5162-7384-95a6-b7c8d9e0f1a2", "besteffort")
    assert owner.container_id == K8S_ID


def test_crio_container() -> None:
    owner = parse_fixture("crio-v2.txt")
    assert (owner.container_runtime, owner.container_id) == ("cri-o", CRIO_ID)
    assert owner.pod_uid == "6f7e8d9c-0b1a-4c3d-8e5f-6a7b8c9d0e1f"


def test_podman_payload_subgroup_keeps_the_container() -> None:
    owner = parse_fixture("podman-v2.txt")
    assert (owner.container_runtime, owner.container_id) == ("podman", PODMAN_ID)
    assert owner.cgroup == f"/machine.slice/libpod-{PODMAN_ID}.scope/container"
    assert owner.systemd_unit is None  # the container's own scope is not reported as a unit


def test_rootless_podman_names_the_users_service_manager() -> None:
    owner = parse_fixture("podman-rootless-v2.txt")
    assert (owner.container_runtime, owner.container_id) == ("podman", PODMAN_ID)
    assert owner.systemd_unit == "user@1000.service"


def test_lxc_container_and_the_unit_inside_it() -> None:
    owner = parse_fixture("lxc-v2.txt")
    assert (owner.container_runtime, owner.container_id) == ("lxc", "web01")
    assert owner.systemd_unit == "nginx.service"


def test_slurm_v1_job_comes_from_the_controller_lines_and_owns_the_task() -> None:
    owner = parse_fixture("slurm-v1.txt")
    assert owner.slurm_job_id == "4242"
    assert owner.cgroup == "/slurm/uid_1000/job_4242/step_0/task_0"
    # proctrack/cgroup leaves name=systemd at slurmd.service: that unit is not the job's
    # owner (it would make a leftover task "owned by its service", never orphaned).
    assert owner.systemd_unit is None


def test_hybrid_host_prefers_the_unified_line() -> None:
    owner = parse_fixture("user-session-hybrid.txt")
    assert owner == CgroupOwner(
        cgroup="/user.slice/user-1000.slice/session-3.scope", systemd_unit="session-3.scope"
    )


def test_user_service_is_the_innermost_unit() -> None:
    assert parse_fixture("systemd-user-service-v2.txt").systemd_unit == "jupyter.service"


def test_job_directories_outside_slurm_are_not_jobs() -> None:
    owner = parse_cgroup("0::/system.slice/cron.service/job_12\n")
    assert owner.slurm_job_id is None
    assert owner.systemd_unit == "cron.service"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", CgroupOwner()),
        ("not a cgroup file\n\x00\xff", CgroupOwner()),
        ("0::/\n", CgroupOwner(cgroup="/")),
        ("0::/weird/place\n", CgroupOwner(cgroup="/weird/place")),
        ("0::/docker/not-an-id\n", CgroupOwner(cgroup="/docker/not-an-id")),
    ],
)
def test_unknown_input_gives_only_the_raw_path(text: str, expected: CgroupOwner) -> None:
    assert parse_cgroup(text) == expected


def test_overlong_path_is_cut_to_the_schema_bound() -> None:
    owner = parse_cgroup("0::/" + "a" * 10_000 + "\n")
    assert owner.cgroup is not None
    assert len(owner.cgroup) == MAX_PATH_CHARS


@given(st.text())
def test_never_raises_on_arbitrary_text(text: str) -> None:
    assert isinstance(parse_cgroup(text), CgroupOwner)


@given(st.lists(st.text(alphabet="abcdef0123456789_-.@/:", max_size=80), max_size=6))
def test_never_raises_on_cgroup_shaped_lines(paths: list[str]) -> None:
    text = "".join(f"{i}:memory:/{p}\n" for i, p in enumerate(paths))
    assert isinstance(parse_cgroup(text), CgroupOwner)
