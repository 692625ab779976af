"""Who owns a process, as its cgroup path says: container, Kubernetes pod, Slurm job, systemd unit.

:func:`parse_cgroup` reads the text of ``/proc/<pid>/cgroup``. Two formats exist:

* cgroup v1 (and "hybrid" hosts): one line per hierarchy, ``ID:CONTROLLERS:PATH``, e.g.
  ``8:memory:/docker/<id>`` and ``1:name=systemd:/system.slice/slurmd.service``. Different
  hierarchies can say different things (Slurm's ``proctrack/cgroup`` uses only freezer, cpuset,
  memory and devices), so every line is read and the facts are merged.
* cgroup v2: a single ``0::PATH`` line.

The path names the owner by convention, not by any kernel API, so each runtime is recognised
by the directory names it creates (systemd cgroup driver / cgroupfs driver)::

    docker        /system.slice/docker-<id>.scope        /docker/<id>
    containerd    .../cri-containerd-<id>.scope          .../nerdctl-<id>.scope
    cri-o         .../crio-<id>.scope                    .../crio-<id>
    podman        .../libpod-<id>.scope[/container]      /libpod_parent/libpod-<id>
    lxc           /lxc.payload.<name>                    /lxc/<name>
    Kubernetes    .../kubepods-burstable-pod<uid_with_underscores>.slice   /kubepods/burstable/pod<uid>
    Slurm         /system.slice/[<node>_]slurmstepd.scope/job_<n>/...   /slurm[_<node>]/uid_<u>/job_<n>/...

(``<node>_`` appears when Slurm is built for several slurmd per host: real hosts show
``gx10-ac12_slurmstepd.scope``.)

**Delegated subtrees.** Some directories hand the subtree below them to someone other than the
host's own managers, who may then create and name directories there at will:

* ``user@<uid>.service``: systemd delegates it to that user. Nothing below it is taken for a
  Slurm job (slurmstepd never runs there); container and pod names there are still read,
  because rootless Podman, Docker and Kubernetes (kind, k3s) legitimately live there.
* A *system container*: LXC/LXD/Incus (``lxc.payload.<name>``, ``/lxc/<name>``) and
  systemd-nspawn or libvirt-lxc machines (``machine-<name>.scope``), whose root runs its own
  init and owns its cgroup. The host's runtime knows the container and nothing in it, so the
  container reported is that one (nspawn's is not named: no runtime of ours), and no inner
  container, pod or Slurm job below it is read; units still are.
* Any container's own directory: a container with a writable cgroupfs (privileged, systemd
  in a container, a kind node) names what is below it. Inner containers and pods there are
  read (kind, Docker-in-Docker) and are that container's word.

``user_manager_uid`` (whose service manager runs the process) is trusted only at the host's
own position, ``/user.slice/user-<uid>.slice/user@<uid>.service``: the same directories inside
a container name the container's uid, not the host's. :func:`undelegated` is the part of a
path that no tenant named, the only part the reaper's protections read.

Read from inside a private cgroup namespace (an agent container on cgroup v2, which
containerd, CRI-O and Docker give every non-privileged container), the ancestors of the
reader's own cgroup show as ``..``: the cgroupfs driver's ``/kubepods/burstable/pod<uid>/<id>``
reads as ``/../../../burstable/pod<uid>/<id>``. A ``pod<uid>`` directory whose ancestors are
only ``..`` (and a QoS directory) is still taken for a pod when ``<uid>`` has a pod UID's
form (a 36-character UUID, or the 32-hex UID of a static pod); its QoS is the
``burstable``/``besteffort`` directory right above it, and unknown when ``..`` hides it (the
pod shares the reader's QoS level, which may be any of the three).

On cgroup v1 the hierarchies can disagree: Slurm's ``proctrack/cgroup`` never moves a task in
the ``name=systemd`` hierarchy, so a job's task reads ``/system.slice/slurmd.service`` there.
When one path names a container, pod or job, the unit reported is the one on *that* path (or
none): a ``.service`` from another hierarchy would make the job's task look owned by the
slurmd daemon.

A bare 64-hex directory (the cgroupfs driver under ``/kubepods``) is a container id whose
runtime the path cannot tell (containerd, or Docker via the old dockershim), so the runtime is
left ``None`` rather than guessed. Input that matches none of this yields an owner with only
the raw path; this module never raises on what a kernel, or a fixture, might hand it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ContainerRuntime = Literal["docker", "containerd", "podman", "cri-o", "lxc"]

# Bounds of gpuwatch.snapshot.ProcessOwner (LongStr / ShortStr): longer values are cut here,
# once, instead of failing validation later.
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 256

_HEX64 = r"[0-9a-f]{64}"

# systemd-driver scopes and cgroupfs-driver directories that hold exactly one container id.
_CONTAINER_DIRS: tuple[tuple[re.Pattern[str], ContainerRuntime], ...] = (
    (re.compile(rf"docker-({_HEX64})\.scope"), "docker"),
    (re.compile(rf"cri-containerd-({_HEX64})\.scope"), "containerd"),
    (re.compile(rf"nerdctl-({_HEX64})\.scope"), "containerd"),
    # conmon is the runtime's per-container monitor; it belongs to the same container.
    (re.compile(rf"crio-(?:conmon-)?({_HEX64})(?:\.scope)?"), "cri-o"),
    (re.compile(rf"libpod-(?:conmon-)?({_HEX64})(?:\.scope)?"), "podman"),
    (re.compile(r"lxc\.payload\.([\w.-]{1,255})"), "lxc"),
)
_BARE_ID = re.compile(_HEX64)
# Kubernetes systemd driver: kubepods-pod<uid>.slice (Guaranteed QoS has no QoS level in the
# name) or kubepods-<qos>-pod<uid>.slice; kind and minikube add a "kubelet-" prefix.
_POD_SLICE = re.compile(
    r"(?:[\w-]+-)?kubepods(?:-(besteffort|burstable))?-pod([0-9a-f_]{1,64})\.slice"
)
_POD_DIR = re.compile(r"pod([0-9a-f-]{1,64})")
# A pod UID's own forms: a UUID, or a static pod's 32-hex hash (accepted without a visible
# "kubepods" ancestor, where "pod" plus any hex would be too loose).
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_QOS_DIRS = ("besteffort", "burstable")
_SLURM_ROOT = re.compile(r"slurm(?:_[\w.-]+)?|(?:[\w.-]+_)?slurmstepd\.scope")
# A user's own systemd instance: everything below it is delegated to that user.
_USER_MANAGER = re.compile(r"user@(\d{1,10})\.service")
_SLURM_JOB = re.compile(r"job_(\d{1,20})")
# systemd's own bound on a unit name (UNIT_NAME_MAX) is MAX_NAME_CHARS, so a longer name is
# no unit, and a kernfs directory name may be far longer than NAME_MAX (up to a page).
_SYSTEMD_UNIT = re.compile(r"[\w:.@\\-]{1,248}\.(?:service|scope)")
# A systemd-nspawn or libvirt-lxc machine (module docstring, "Delegated subtrees").
_MACHINE_SCOPE = re.compile(r"machine-[^/]{1,240}\.scope")
_LXC_NAME = re.compile(r"[\w.-]{1,255}")
_LINE = re.compile(r"(\d+):([^:]*):(/.*)")


@dataclass(frozen=True, slots=True)
class CgroupOwner:
    """What one process's cgroup says about its owner. ``None`` means the path does not say.

    ``cgroup`` is the raw path the other fields came from (on v1, the most telling hierarchy).
    ``pod_uid`` has its dashes restored; ``pod_qos`` is ``guaranteed``, ``burstable`` or
    ``besteffort``; ``systemd_unit`` is the innermost service or scope that is not itself a
    container's scope (``jupyter.service``, ``session-3.scope``, ``user@1000.service``).
    ``user_manager_uid`` is the uid of the outermost ``user@<uid>.service`` on the path: the
    user whose own service manager started the process (rootless containers live there).
    """

    cgroup: str | None = None
    container_runtime: ContainerRuntime | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    pod_qos: str | None = None
    slurm_job_id: str | None = None
    systemd_unit: str | None = None
    user_manager_uid: int | None = None

    @property
    def identified(self) -> bool:
        """True when the path names a container, pod or job (not just a unit or nothing)."""
        return any((self.container_id, self.pod_uid, self.slurm_job_id))


def parse_cgroup(text: str) -> CgroupOwner:
    """Parse the contents of ``/proc/<pid>/cgroup`` (v1, hybrid or v2) into a :class:`CgroupOwner`.

    Never raises: unknown layouts give an owner with only ``cgroup`` set, and text with no
    ``ID:CONTROLLERS:PATH`` line at all gives an empty owner.
    """
    paths = _paths_by_priority(text)
    found = [_parse_path(path) for path in paths]
    if not found:
        return CgroupOwner()
    # The raw path reported is the one that identified a container/pod/job, else the first
    # non-root path in priority order: that is the path a person would look up.
    source = next((f for f in found if f.identified), None) or next(
        (f for f in found if f.cgroup != "/"), found[0]
    )

    def first(attr: str) -> str | None:
        return next((getattr(f, attr) for f in found if getattr(f, attr) is not None), None)

    runtime_source = next((f for f in found if f.container_id is not None), None)
    # A path that names a container, pod or job owns the process; a unit from another
    # v1 hierarchy (slurmd.service for a Slurm task) does not (module docstring).
    unit = source.systemd_unit if source.identified else first("systemd_unit")
    return CgroupOwner(
        cgroup=source.cgroup,
        container_runtime=runtime_source.container_runtime if runtime_source else None,
        container_id=runtime_source.container_id if runtime_source else None,
        pod_uid=first("pod_uid"),
        pod_qos=first("pod_qos"),
        slurm_job_id=first("slurm_job_id"),
        systemd_unit=unit,
        user_manager_uid=next(
            (f.user_manager_uid for f in found if f.user_manager_uid is not None), None
        ),
    )


def _paths_by_priority(text: str) -> list[str]:
    """The paths of all well-formed lines: v2 first, then v1 ``name=systemd``, then the rest.

    The unified (v2) line is what the kernel uses on modern hosts; on v1 hosts the
    ``name=systemd`` hierarchy carries the unit names. Controller lines follow in file order.
    """
    unified: list[str] = []
    systemd: list[str] = []
    others: list[str] = []
    # Only "\n" ends a line: str.splitlines() also splits at \x1c-\x1e, \x85 and U+2028/9,
    # which may appear in a directory name, and would let a name forge a line of its own.
    # Nor is the path stripped: a directory name may end in a space.
    for line in text.split("\n"):
        match = _LINE.fullmatch(line.removesuffix("\r"))
        if match is None:
            continue
        hierarchy, controllers, path = match.groups()
        if hierarchy == "0" and controllers == "":
            unified.append(path)
        elif controllers == "name=systemd":
            systemd.append(path)
        else:
            others.append(path)
    return unified + systemd + others


def _parse_path(path: str) -> CgroupOwner:
    """Facts from one cgroup path. Inner (later) directories win (Docker-in-Docker, kind),
    except below a system container, which stays the container (module docstring)."""
    parts = [p for p in path.split("/") if p]
    runtime: ContainerRuntime | None = None
    container_id: str | None = None
    container_parts: set[int] = set()
    pod_uid: str | None = None
    pod_qos: str | None = None
    slurm_job: str | None = None
    unit: str | None = None
    manager_uid: int | None = None
    in_slurm = False
    delegated = False
    sealed = False  # below a system container: only units are read

    for i, part in enumerate(parts):
        previous = parts[i - 1] if i else ""
        if sealed:
            if _is_unit(part):
                unit = part
            continue
        match_runtime = _container_dir(part, previous)
        system = _system_container(part, previous)
        if match_runtime is not None:
            container_parts.add(i)
            # LXC run inside another container is that container's doing: the outer stays.
            if not (system and container_id is not None):
                runtime, container_id = match_runtime
        if system:
            # The host knows this container and nothing inside it: what its root names
            # below is not read (a forged pod, job or container would hide it).
            sealed, in_slurm = True, False
            if _is_unit(part) and i not in container_parts:
                unit = part
            continue
        if pod := _POD_SLICE.fullmatch(part):
            pod_qos = pod.group(1) or "guaranteed"
            pod_uid = pod.group(2).replace("_", "-")
        elif (pod := _POD_DIR.fullmatch(part)) and "kubepods" in parts[:i]:
            pod_qos = previous if previous in _QOS_DIRS else "guaranteed"
            pod_uid = pod.group(1)
        elif (pod := _POD_DIR.fullmatch(part)) and _beyond_namespace_root(parts[:i], pod.group(1)):
            pod_qos = previous if previous in _QOS_DIRS else None
            pod_uid = pod.group(1)
        if manager := _USER_MANAGER.fullmatch(part):
            # Only the host's own user manager says whose it is; one anywhere else is
            # named by a container or by the user (user@0.service below user@1000).
            if not delegated and _host_user_manager(parts, i, manager.group(1)):
                manager_uid = int(manager.group(1))
            delegated, in_slurm = True, False
        elif not delegated and _SLURM_ROOT.fullmatch(part):
            in_slurm = True
        elif in_slurm and (job := _SLURM_JOB.fullmatch(part)):
            slurm_job = job.group(1)
        if i not in container_parts and _is_unit(part):
            unit = part

    return CgroupOwner(
        cgroup=path[:MAX_PATH_CHARS],
        container_runtime=runtime,
        container_id=container_id,
        pod_uid=pod_uid,
        pod_qos=pod_qos,
        slurm_job_id=slurm_job,
        systemd_unit=unit,
        user_manager_uid=manager_uid,
    )


def undelegated(path: str) -> str:
    """The part of cgroup ``path`` that no tenant named: all of it, or up to and including
    the first delegated directory (``user@<uid>.service``, a system container, any
    container's own directory), below which a user or a container's root names directories
    at will, a protected pod's or job's included (module docstring)."""
    end = 0
    previous = ""
    for part in path.split("/"):
        end += len(part) + 1
        if part and (
            _USER_MANAGER.fullmatch(part)
            or _system_container(part, previous)
            or _container_dir(part, previous) is not None
        ):
            return path[: end - 1]
        if part:
            previous = part
    return path


def _is_unit(part: str) -> bool:
    return len(part) <= MAX_NAME_CHARS and _SYSTEMD_UNIT.fullmatch(part) is not None


def _system_container(part: str, previous: str) -> bool:
    """An LXC/LXD/Incus container or a systemd-nspawn/libvirt machine: its own init, its
    own cgroup subtree (module docstring)."""
    if previous == "lxc" and _LXC_NAME.fullmatch(part):
        return True
    return part.startswith("lxc.payload.") or _MACHINE_SCOPE.fullmatch(part) is not None


def _host_user_manager(parts: list[str], index: int, uid: str) -> bool:
    """``parts[index]`` (``user@<uid>.service``) is at the host's own place for it:
    ``/user.slice/user-<uid>.slice/user@<uid>.service``, the reader's ``..`` aside."""
    start = 0
    while start < len(parts) and parts[start] == "..":
        start += 1
    return (
        index == start + 2
        and parts[start] == "user.slice"
        and parts[start + 1] == f"user-{uid}.slice"
    )


def _beyond_namespace_root(ancestors: list[str], uid: str) -> bool:
    """A cgroupfs-driver pod directory seen from a private cgroup namespace: only ``..``
    above it (at least one), or ``..`` and then its QoS directory (module docstring)."""
    if not _POD_UID.fullmatch(uid) or not ancestors or ancestors[0] != "..":
        return False
    above = ancestors[:-1] if ancestors[-1] in _QOS_DIRS else ancestors
    return all(part == ".." for part in above)


def _container_dir(part: str, previous: str) -> tuple[ContainerRuntime | None, str] | None:
    """``(runtime, id)`` when this one directory name is a container's cgroup, else ``None``."""
    for pattern, runtime in _CONTAINER_DIRS:
        if match := pattern.fullmatch(part):
            return runtime, match.group(1)
    if previous == "docker" and _BARE_ID.fullmatch(part):
        return "docker", part
    if previous == "lxc" and _LXC_NAME.fullmatch(part):
        return "lxc", part
    if _BARE_ID.fullmatch(part):
        return None, part
    return None
