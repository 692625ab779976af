"""Owner attribution against forms found on real hosts, beyond the per-runtime fixtures.

Each case is a real layout (its source in a comment); ids and UIDs are made up. The cases
marked "regression" already passed; the others failed before the fix named beside them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gpuwatch.agent.procinfo as procinfo
from gpuwatch.agent.cgroup import CgroupOwner, parse_cgroup
from gpuwatch.agent.procinfo import ProcInfo

ID = "0123456789abcdef" * 4
OUTER = "a" * 64
UID = "1f2e3d4c-5b6a-4978-8a9b-0c1d2e3f4a5b"
UID_ = UID.replace("-", "_")


# --- /proc/<pid>/cgroup ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Fix: <nodename>_slurmstepd.scope, Slurm built for multiple slurmd per host.
        # Source: GVSU-Advanced-Research-Computing/jobstats_cgroup_exporter README
        # ("/sys/fs/cgroup/system.slice/<nodename>_slurmstepd.scope"); the node name may be an
        # FQDN (a "rocky9.ar.jontk.com_slurmstepd.scope/job_222" path seen in another exporter).
        (
            "0::/system.slice/gx10-ac12_slurmstepd.scope/job_12/step_batch/user/task_0\n",
            {"slurm_job_id": "12", "systemd_unit": "gx10-ac12_slurmstepd.scope"},
        ),
        (
            "0::/system.slice/rocky9.ar.jontk.com_slurmstepd.scope/job_222/step_0/user/task_0\n",
            {"slurm_job_id": "222"},
        ),
        # Regression: step_extern (pam_slurm_adopt), task_special; slurm.schedmd.com/cgroup_v2.html.
        (
            "0::/system.slice/slurmstepd.scope/job_4242/step_extern/user/task_special\n",
            {"slurm_job_id": "4242"},
        ),
        # Regression: v1 multiple-slurmd root "slurm_<node>" (collectd/collectd PR #1198).
        ("4:memory:/slurm_node01/uid_1000/job_4242/step_0/task_0\n", {"slurm_job_id": "4242"}),
        # Regression: kind's node is a Docker container; the inner (pod) container wins.
        # Source: kind's systemd-driver layout (kubelet.slice/kubelet-kubepods.slice/...).
        (
            f"0::/system.slice/docker-{OUTER}.scope/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{ID}.scope\n",
            {"container_runtime": "containerd", "container_id": ID, "pod_uid": UID},
        ),
        # Regression: static pods have a 32-hex UID (a hash of the manifest), no dashes.
        (
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-"
            f"pod5f1e7d3c0a8b9c2d4e6f7a8b9c0d1e2f.slice/cri-containerd-{ID}.scope\n",
            {"pod_uid": "5f1e7d3c0a8b9c2d4e6f7a8b9c0d1e2f", "pod_qos": "burstable"},
        ),
        # Regression: cri-o's conmon, and crun's "container" sub-cgroup (OpenShift).
        (
            f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{ID}.scope\n",
            {"container_runtime": "cri-o", "container_id": ID, "pod_qos": "guaranteed"},
        ),
        # Regression: rootless Docker (systemd driver under the user's manager), Docker-in-Docker.
        (
            f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{ID}.scope\n",
            {"container_runtime": "docker", "container_id": ID},
        ),
        (f"0::/docker/{OUTER}/docker/{ID}\n", {"container_runtime": "docker", "container_id": ID}),
        # Regression: a Podman pod's slice is not a unit; Proxmox LXC is /lxc/<vmid>/ns.
        (
            f"0::/machine.slice/machine-libpod_pod_{OUTER}.slice/libpod-{ID}.scope/container\n",
            {"container_runtime": "podman", "container_id": ID, "systemd_unit": None},
        ),
        (
            "0::/lxc/101/ns/user.slice/user-0.slice/session-2.scope\n",
            {"container_runtime": "lxc", "container_id": "101"},
        ),
        # Regression: read from inside a cgroup namespace, ancestors show as "..".
        (
            f"0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{ID}.scope\n",
            {"container_id": ID, "pod_uid": UID},
        ),
        # Fix: the cgroupfs driver read from the agent pod's own cgroup namespace (cgroup
        # v2 gives non-privileged containers one: containerd/cri#1371, cri-o#3098). The
        # agent sits in another QoS class, so the pod's shows; in the same one it does not.
        (
            f"0::/../../../burstable/pod{UID}/{ID}\n",
            {"container_id": ID, "pod_uid": UID, "pod_qos": "burstable"},
        ),
        (f"0::/../../pod{UID}/{ID}\n", {"container_id": ID, "pod_uid": UID, "pod_qos": None}),
        # Fix: a static pod's 32-hex UID, the same way.
        (
            f"0::/../../besteffort/pod5f1e7d3c0a8b9c2d4e6f7a8b9c0d1e2f/{ID}\n",
            {"pod_uid": "5f1e7d3c0a8b9c2d4e6f7a8b9c0d1e2f", "pod_qos": "besteffort"},
        ),
        # Regression: without "kubepods" above it, anything else named pod<hex> is no pod.
        ("0::/srv/pod12ab/worker\n", {"pod_uid": None}),
        ("0::/../app/pod0123abcd\n", {"pod_uid": None}),
        # Fix: cgroup v1 with Slurm's proctrack/cgroup: name=systemd stays at slurmd.service,
        # which does not own the job's task.
        (
            "12:memory:/slurm/uid_1000/job_777/step_0/task_0\n"
            "4:freezer:/slurm/uid_1000/job_777/step_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n",
            {"slurm_job_id": "777", "systemd_unit": None},
        ),
        # Regression: a unit on the identifying path itself is kept.
        (
            f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n",
            {"systemd_unit": "user@1000.service", "user_manager_uid": 1000},
        ),
    ],
)
def test_real_forms(text: str, expected: dict[str, str | None]) -> None:
    owner = parse_cgroup(text)
    assert {key: getattr(owner, key) for key in expected} == expected


@pytest.mark.parametrize(
    "path",
    [
        # systemd delegates user@<uid>.service to that user (systemd.io/CGROUP_DELEGATION), who
        # may create directories with any name: slurmstepd never runs there.
        "/user.slice/user-1000.slice/user@1000.service/app.slice/slurm/uid_2000/job_77/step_0",
        "/user.slice/user-1000.slice/user@1000.service/fake/slurmstepd.scope/job_77/step_0",
    ],
)
def test_a_users_own_cgroup_subtree_cannot_claim_a_slurm_job(path: str) -> None:
    assert parse_cgroup(f"0::{path}\n").slurm_job_id is None


def test_the_user_manager_is_the_outermost_one() -> None:
    # The user names directories below user@1000.service at will, "user@0.service" too.
    owner = parse_cgroup(
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/user@0.service\n"
    )
    assert owner.user_manager_uid == 1000


@pytest.mark.parametrize(
    "cgroup",
    [
        # proctrack/cgroup on cgroup v1: the job's own hierarchies, slurmd.service in name=systemd.
        "12:memory:/slurm/uid_1000/job_777/step_0/task_0\n1:name=systemd:/system.slice/slurmd.service\n",
        # cgroup v2.
        "0::/system.slice/slurmstepd.scope/job_777/step_0/user/task_0\n",
        # proctrack/pgid or linuxproc: no job cgroup at all, the job id from the environment.
        "0::/system.slice/slurmd.service\n",
    ],
)
def test_a_slurm_task_left_by_its_step_is_orphaned_whatever_the_cgroup_layout(
    proc: Path, cgroup: str
) -> None:
    write_proc(
        proc, 510, comm="python", ppid=1, session=480, argv=("python", "train.py"),
        environ={"SLURM_JOB_ID": "777"},
    )  # fmt: skip
    (proc / "510" / "cgroup").write_text(cgroup)
    facts = info(proc).describe(510)
    assert (facts.orphaned, facts.owner.slurm_job_id) == (True, "777")


def test_a_daemon_owned_by_its_service_unit_is_still_not_orphaned(proc: Path) -> None:
    write_proc(proc, 510, comm="python", ppid=1, session=480, argv=("python", "serve.py"))
    (proc / "510" / "cgroup").write_text("0::/system.slice/inference.service\n")
    assert not info(proc).describe(510).orphaned


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x1c", "\x0c"])
def test_a_directory_name_cannot_forge_a_line(separator: str) -> None:
    # A delegated user names a directory "x<separator>4:memory:" and nests /slurm/... in it.
    # Only "\n" ends a line in /proc/<pid>/cgroup; str.splitlines() would split here too.
    real = (
        "/user.slice/user-1000.slice/user@1000.service/app.slice/"
        f"x{separator}4:memory:/slurm/uid_2000/job_77/step_0"
    )
    owner = parse_cgroup(f"0::{real}\n")
    assert owner.cgroup == real
    assert owner.slurm_job_id is None


def test_a_trailing_space_is_part_of_the_path() -> None:
    assert parse_cgroup("0::/system.slice/odd \n") == CgroupOwner(cgroup="/system.slice/odd ")


# --- /proc/<pid> --------------------------------------------------------------------------


def write_proc(
    root: Path,
    pid: int,
    *,
    comm: str,
    ppid: int,
    session: int,
    argv: tuple[str, ...],
    state: str = "S",
    nspid: str | None = None,
    environ: dict[str, str] | None = None,
    threads: int = 1,
    start: int = 5000,
) -> None:
    """A minimal real-format /proc/<pid>: stat, status, cmdline, cgroup, environ."""
    base = root / str(pid)
    base.mkdir(parents=True)
    # Fields after comm: state ppid pgrp session ... starttime is the 20th.
    rest = [state, ppid, session, session, 0, -1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 20, 0, threads, 0]
    (base / "stat").write_text(f"{pid} ({comm}) {' '.join(map(str, rest))} {start} 0 0\n")
    (base / "status").write_text(
        f"Name:\t{comm}\nState:\t{state}\nUid:\t1000\t1000\t1000\t1000\n"
        f"NSpid:\t{nspid or pid}\nThreads:\t{threads}\n"
    )
    (base / "cmdline").write_bytes(b"\x00".join(a.encode() for a in argv) + b"\x00")
    (base / "cgroup").write_text(f"0::/system.slice/docker-{ID}.scope\n")
    env = {"PATH": "/usr/bin", **(environ or {})}
    (base / "environ").write_bytes(b"".join(f"{k}={v}\x00".encode() for k, v in env.items()))


KERNEL = ("/opt/conda/bin/python", "-m", "ipykernel_launcher", "-f", "/r/kernel-3f0c1d2e.json")
WORKER_ENV = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0", "RANK": "0"}
WORKER = ("/usr/bin/python", "-u", "train.py")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "stat").write_text("btime 1700000000\n")
    return tmp_path


def info(root: Path) -> ProcInfo:
    return ProcInfo(root, isolated=False)


# (launcher, its NSpid, child argv, child env, child session is its own (else the launcher's),
#  expected (orphaned, jupyter_server_alive)).
LAUNCHED = {
    # Fix (supervised child, namespace init): `CMD ["jupyter", "lab"]` makes the server its
    # container's PID 1; jupyter_client still starts kernels with start_new_session=True.
    "kernel under a server that is PID 1": (
        ("jupyter-lab", ("/usr/bin/python3", "/usr/local/bin/jupyter-lab", "--ip=0.0.0.0")),
        "500\t1",
        KERNEL,
        {},
        True,
        (False, True),
    ),
    # Fix: papermill as a Kubernetes Job's entrypoint runs its kernel the same way.
    "kernel under papermill that is PID 1": (
        ("papermill", ("/usr/bin/python3", "/usr/local/bin/papermill", "in.ipynb", "out.ipynb")),
        "500\t1",
        KERNEL,
        {},
        True,
        (False, None),
    ),
    # Fix: `docker run --init img python -m ipykernel_launcher -f ...` (a remote kernel):
    # tini's own child in tini's session was never reparented, and has no server to lose.
    "kernel started by tini itself": (
        ("tini", ("/sbin/tini", "--", *KERNEL)),
        "500\t1",
        KERNEL,
        {},
        False,
        (False, None),
    ),
    # Fix: Jupyter Kernel Gateway / Enterprise Gateway are kernel servers too.
    "kernel under kernel gateway": (
        ("jupyter", ("/usr/bin/python3", "/usr/local/bin/jupyter", "kernelgateway")),
        None,
        KERNEL,
        {},
        True,
        (False, True),
    ),
    # Regression: torchrun as a pod's entrypoint (PID 1) with live workers.
    "worker under torchrun that is PID 1": (
        ("torchrun", ("/usr/bin/python", "/usr/local/bin/torchrun", "--nproc-per-node=8", "t.py")),
        "500\t1",
        WORKER,
        WORKER_ENV,
        True,
        (False, None),
    ),
    # Fix (supervised child): torchrun died, its worker was adopted by tini / systemd --user.
    # torch's SubprocessHandler starts workers with start_new_session=True (pytorch/pytorch,
    # torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py).
    "worker adopted by tini after torchrun died": (
        ("tini", ("/sbin/tini", "--", "bash")),
        "500\t1",
        WORKER,
        WORKER_ENV,
        True,
        (True, None),
    ),
    # Regression: the same adoption without the worker environment is a deliberate daemon.
    "setsid daemon adopted by tini": (
        ("tini", ("/sbin/tini", "--", "bash")),
        "500\t1",
        WORKER,
        {},
        True,
        (False, None),
    ),
}


@pytest.mark.parametrize("case", LAUNCHED, ids=list(LAUNCHED))
def test_supervised_children(proc: Path, case: str) -> None:
    (comm, argv), nspid, child_argv, env, own_session, expected = LAUNCHED[case]
    write_proc(proc, 500, comm=comm, ppid=490, session=500, argv=argv, nspid=nspid)
    session = 510 if own_session else 500
    write_proc(proc, 510, comm="python", ppid=500, session=session, argv=child_argv, environ=env)
    facts = info(proc).describe(510)
    assert (facts.orphaned, facts.jupyter_server_alive) == expected


def test_worker_whose_torchrun_died_under_host_init_is_orphaned(proc: Path) -> None:
    write_proc(proc, 510, comm="python", ppid=1, session=510, argv=WORKER, environ=WORKER_ENV)
    assert info(proc).describe(510).orphaned


@pytest.mark.parametrize(
    ("argv", "kernel"),
    [
        # Fix: Google Colab's launcher (/usr/local/lib/python3.*/dist-packages/
        # colab_kernel_launcher.py, as its tracebacks show) with the standard runtime dir.
        (
            (
                "/usr/bin/python3",
                "-m",
                "colab_kernel_launcher",
                "-f",
                "/root/.local/share/jupyter/runtime/kernel-2e5eaa6b-dafe-49de-82ba-43fbde79da98.json",
            ),
            True,
        ),
        # Fix: any kernel spec (here xeus-python) gets "-f {connection_file}" from jupyter_client.
        (("/opt/conda/bin/xpython", "-f", "/run/jupyter/kernel-77ab90c1.json"), True),
        # Regression: VS Code's "--f=" form.
        (("python", "-m", "ipykernel_launcher", "--f=/r/kernel-v2-1250abc.json"), True),
        # A training script's config file is not a connection file.
        (("python", "train.py", "-f", "configs/kernel-sizes.json"), False),
        (("python", "train.py", "/r/kernel-3f0c1d2e.json"), False),
    ],
)
def test_kernel_is_recognised_by_its_launch(
    proc: Path, argv: tuple[str, ...], kernel: bool
) -> None:
    write_proc(proc, 510, comm="python", ppid=1, session=510, argv=argv)
    assert info(proc).describe(510).jupyter_kernel is kernel


@pytest.mark.parametrize(("threads", "alive"), [(3, True), (1, False)])
def test_zombie_leader_with_live_threads_is_alive(proc: Path, threads: int, alive: bool) -> None:
    # The main thread called pthread_exit while workers run on (ps shows "Zl"): NVML lists
    # the leader's PID for the context the other threads hold. proc(5): "Threads".
    write_proc(proc, 510, comm="python", ppid=400, session=400, argv=(), state="Z", threads=threads)
    assert info(proc).describe(510).alive is alive


def test_pid_reused_while_its_files_are_read(proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_proc(proc, 510, comm="python", ppid=400, session=400, argv=("python", "old.py"))
    real_parse = procinfo.parse_cgroup

    def exit_and_reuse(text: str) -> object:
        # While its files are being read, the process exits and its PID is reused.
        write_new = {"comm": "bash", "ppid": 400, "session": 400, "argv": ("bash",)}
        for name in ("stat", "status", "cmdline", "cgroup", "environ"):
            (proc / "510" / name).unlink()
        (proc / "510").rmdir()
        write_proc(proc, 510, start=9000, **write_new)  # type: ignore[arg-type]
        monkeypatch.setattr(procinfo, "parse_cgroup", real_parse)
        return real_parse(text)

    monkeypatch.setattr(procinfo, "parse_cgroup", exit_and_reuse)
    described = info(proc)
    first = described.describe(510)
    assert not first.alive  # never "old.py" with bash's files, or bash with old.py's start
    second = described.describe(510)
    assert (second.alive, second.command, second.name) == (True, "bash", "bash")
