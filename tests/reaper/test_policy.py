"""The pure policy: protections are absolute, filters narrow, idleness decides.

Property-based: over random candidates, protections and selections, no protected
process is ever chosen, and the same inputs always give the same decisions.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.agent.reaper.evidence import IdleEvidence
from gpuwatch.agent.reaper.policy import (
    PROTECTED_REASONS,
    Candidate,
    Holding,
    Protections,
    Selection,
    decide,
)
from gpuwatch.snapshot import ProcessOwner

GiB = 2**30
IDLE = IdleEvidence(
    True, "idle", "no GPU activity for 3h", idle_seconds=3 * 3600, coverage_ratio=1.0
)
BUSY = IdleEvidence(False, "active", "active now (SM 40%)")
SELECT = Selection(window_seconds=7200, min_memory_bytes=256 * 2**20)


def candidate(
    pid: int = 4242, *, uid: int | None = 4242, evidence: IdleEvidence = IDLE, **kw: object
) -> Candidate:
    holdings = kw.pop("holdings", (Holding(0, "GPU-0", 8 * GiB, evidence),))
    return Candidate(
        pid=pid,
        start_time=kw.pop("start_time", 1_700_000_000.0),  # type: ignore[arg-type]
        uid=uid,
        user=kw.pop("user", None if uid is None else f"u{uid}"),  # type: ignore[arg-type]
        name=kw.pop("name", "python"),  # type: ignore[arg-type]
        command=kw.pop("command", "python train.py"),  # type: ignore[arg-type]
        holdings=holdings,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def one(
    c: Candidate,
    selection: Selection = SELECT,
    protections: Protections = Protections(),
    caller_uid: int | None = None,
) -> tuple[str, str]:
    (d,) = decide([c], selection=selection, protections=protections, caller_uid=caller_uid)
    return d.verdict, d.reason


def test_an_idle_ordinary_process_is_reaped_and_a_busy_one_spared() -> None:
    assert one(candidate()) == ("reap", "idle")
    assert one(candidate(evidence=BUSY)) == ("spare", "active")


POD_A = "0f1e2d3c-aaaa-4bbb-8ccc-123456789abc"
POD_B = "9a8b7c6d-1111-4222-8333-444455556666"
# A user's own service manager: the user names every directory below it.
DELEGATED = "/user.slice/user-4242.slice/user@4242.service"
JOB_99 = "/system.slice/slurmstepd.scope/job_99/step_0"
IN_POD_A = f"/kubepods/burstable/pod{POD_A}/ctr"


def test_each_protection() -> None:
    p = Protections(
        system_uid_max=99,  # so that uid 500 reaches the display-server check
        users=frozenset({"u5000"}),
        commands=(re.compile(r"important\.py"),),
        cgroups=(re.compile(r"slurm/uid_\d+/job_77/"),),
        slurm_jobs=frozenset({"99"}),
        pods=frozenset({POD_A}),
        display_servers=frozenset({"Xorg"}),
        self_pids=frozenset({777}),
    )
    cases = {
        "protected_pid1": candidate(pid=1),
        "protected_self": candidate(pid=777),
        "protected_root": candidate(uid=0),
        "protected_system_user": candidate(uid=42),
        "protected_display_server": candidate(uid=500, name="Xorg"),
        "protected_user": candidate(uid=5000),
        "protected_command": candidate(command="python important.py"),
        "protected_cgroup": candidate(
            owner=ProcessOwner(cgroup="/system.slice/slurmstepd.scope/slurm/uid_1/job_77/step_0")
        ),
        "protected_job": candidate(owner=ProcessOwner(slurm_job_id="99", cgroup=JOB_99)),
    }
    for reason, c in cases.items():
        assert one(c, protections=p) == ("spare", reason), reason
    assert one(candidate(owner=ProcessOwner(pod_uid=POD_A, cgroup=IN_POD_A)), protections=p) == (
        "spare",
        "protected_job",
    )


def test_a_protection_an_ordinary_user_can_claim_protects_nothing() -> None:
    # Reaper audit findings 3 and 4: a name, the environment, or directories the user
    # creates below its own service manager are the user's to choose.
    p = Protections(
        cgroups=(re.compile(r"inference"),),
        slurm_jobs=frozenset({"99"}),
        pods=frozenset({POD_A}),
        display_servers=frozenset({"Xorg"}),
    )
    claims = [
        # SLURM_JOB_ID=99 in its own environment, outside any Slurm cgroup.
        candidate(owner=ProcessOwner(slurm_job_id="99", cgroup="/user.slice/user-4242.slice")),
        candidate(owner=ProcessOwner(slurm_job_id="99")),
        # A Slurm job's and a pod's cgroup names, made up below the user's manager.
        candidate(owner=ProcessOwner(slurm_job_id="99", cgroup=DELEGATED + JOB_99)),
        candidate(owner=ProcessOwner(pod_uid=POD_A, cgroup=DELEGATED + IN_POD_A)),
        candidate(owner=ProcessOwner(cgroup=DELEGATED + "/inference.service")),
        # An ordinary user's process named Xorg, where the executable is not known.
        candidate(uid=1000, name="Xorg"),
        candidate(uid=4242, name="Xorg"),
    ]
    for c in claims:
        assert one(c, protections=p) == ("reap", "idle"), c
    # What the user cannot name still protects: the manager itself, a system account.
    by_manager = Protections(cgroups=(re.compile(r"user@4242\.service$"),))
    assert one(candidate(owner=ProcessOwner(cgroup=DELEGATED)), protections=by_manager) == (
        "spare",
        "protected_cgroup",
    )
    assert one(
        candidate(owner=ProcessOwner(cgroup=DELEGATED + "/app.slice")), protections=by_manager
    ) == ("spare", "protected_cgroup")
    system = Protections(system_uid_max=99, display_servers=frozenset({"Xorg"}))
    assert one(candidate(uid=999, name="Xorg"), protections=system) == (
        "spare",
        "protected_display_server",
    )
    # UID_MIN from login.defs moves the line.
    high = Protections(system_uid_max=99, display_servers=frozenset({"Xorg"}), login_uid_min=500)
    assert one(candidate(uid=499, name="Xorg"), protections=high)[1] == "protected_display_server"
    assert one(candidate(uid=500, name="Xorg"), protections=high) == ("reap", "idle")


def test_force_does_not_act_on_a_gpu_that_cannot_be_read() -> None:
    lost = Holding(
        1,
        "GPU-1",
        None,
        IdleEvidence(False, "unknown", "it also held GPU 1, which cannot be read now"),
        readable=False,
    )
    two = (Holding(0, "GPU-0", 8 * GiB, BUSY), lost)
    forced = Selection(window_seconds=7200, min_memory_bytes=0, pid=4242, force=True)
    assert one(candidate(holdings=two), forced) == ("spare", "unknown")
    assert one(candidate(holdings=two[:1]), forced) == ("reap", "forced")
    # gpuwatch is protected by PID, never by a command line anyone can choose (audit
    # finding 9: these were protected_self before).
    for evasive in ("python /home/alice/gpuwatch train.py", "python -m gpuwatch.mytrain"):
        assert one(candidate(command=evasive)) == ("reap", "idle"), evasive


def test_force_skips_idleness_and_nothing_else() -> None:
    forced = Selection(window_seconds=7200, min_memory_bytes=0, pid=4242, force=True)
    assert one(candidate(evidence=BUSY), forced) == ("reap", "forced")
    assert one(candidate(uid=0, evidence=BUSY), forced) == ("spare", "protected_root")
    assert one(candidate(evidence=BUSY), forced, caller_uid=4343) == ("spare", "not_own_process")


def test_a_non_root_caller_reaps_only_its_own() -> None:
    assert one(candidate(uid=4242), caller_uid=4242) == ("reap", "idle")
    assert one(candidate(uid=4343), caller_uid=4242) == ("spare", "not_own_process")


def test_unknowns_are_spared() -> None:
    assert one(candidate(uid=None)) == ("spare", "unknown_owner")
    assert one(candidate(start_time=None)) == ("spare", "unknown_owner")
    assert one(candidate(alive=False)) == ("spare", "not_alive")
    assert one(candidate(visible=False)) == ("spare", "not_visible")


def test_filters() -> None:
    assert one(candidate(), Selection(7200, 0, users=frozenset({"bob"}))) == (
        "spare",
        "filtered_user",
    )
    assert one(candidate(), Selection(7200, 0, gpus=frozenset({3}))) == ("spare", "filtered_gpu")
    assert one(candidate(), Selection(7200, 0, match=re.compile("jupyter"))) == (
        "spare",
        "filtered_command",
    )
    assert one(candidate(), Selection(7200, 0, exclude=re.compile("train"))) == (
        "spare",
        "filtered_command",
    )
    assert one(candidate(), Selection(7200, 0, only_orphans=True)) == ("spare", "not_orphan")
    assert one(candidate(orphaned=True), Selection(7200, 0, only_orphans=True)) == ("reap", "idle")
    assert one(candidate(), Selection(7200, 16 * GiB)) == ("spare", "below_min_memory")


def test_busy_on_any_gpu_spares_the_process() -> None:
    two = (Holding(0, "GPU-0", 8 * GiB, IDLE), Holding(1, "GPU-1", 1 * GiB, BUSY))
    verdict, reason = one(candidate(holdings=two), Selection(7200, 0, gpus=frozenset({0})))
    assert (verdict, reason) == ("spare", "active")


# --- property: protections hold over random scenarios ------------------------------------

evidence = st.sampled_from(
    [IDLE, BUSY, IdleEvidence(False, "coverage", "gaps"), IdleEvidence(False, "no_history", "none")]
)
# cgroup -> (its Slurm job, its pod, the part of it the user cannot name): what may protect.
CGROUPS: dict[str | None, tuple[str | None, str | None, str]] = {
    None: (None, None, ""),
    IN_POD_A: (None, POD_A, IN_POD_A),
    f"/kubepods/burstable/pod{POD_B}/ctr": (None, POD_B, f"/kubepods/burstable/pod{POD_B}/ctr"),
    JOB_99: ("99", None, JOB_99),
    "/system.slice/slurmstepd.scope/job_100/step_0": (
        "100",
        None,
        "/system.slice/slurmstepd.scope/job_100/step_0",
    ),
    DELEGATED + JOB_99: (None, None, DELEGATED),
    DELEGATED + IN_POD_A: (None, None, DELEGATED),
    "/user.slice/user-4242.slice/session-1.scope": (
        None,
        None,
        "/user.slice/user-4242.slice/session-1.scope",
    ),
}
owners = st.builds(
    ProcessOwner,
    # The reported job and pod may be anything (the environment): only the cgroup counts.
    slurm_job_id=st.sampled_from([None, "99", "100"]),
    pod_uid=st.sampled_from([None, POD_A, POD_B]),
    cgroup=st.sampled_from(list(CGROUPS)),
)
candidates = st.builds(
    lambda pid, uid, name, command, ev, memory, owner, alive, orphaned: candidate(
        pid=pid,
        uid=uid,
        name=name,
        command=command,
        owner=owner,
        alive=alive,
        orphaned=orphaned,
        holdings=(Holding(0, "GPU-0", memory, ev),),
    ),
    st.sampled_from([1, 2, 777, 4100, 4242, 5000]),
    st.sampled_from([None, 0, 1, 120, 999, 1000, 4242, 4343, 5000, 65534]),
    st.sampled_from(["python", "Xorg", "gnome-shell", "sway", "jupyter"]),
    st.sampled_from(
        [
            "python train.py",
            "python important.py",
            "gpuwatch agent",
            "python -m gpuwatch status",
            "sleep 1",
        ]
    ),
    evidence,
    st.sampled_from([0, 2**20, 8 * GiB]),
    owners,
    st.booleans(),
    st.booleans(),
)
protection_sets = st.builds(
    Protections,
    system_uid_max=st.sampled_from([0, 999, 4242]),
    users=st.frozensets(st.sampled_from(["u4242", "u5000", "4343"])),
    commands=st.sampled_from([(), (re.compile("important"),)]),
    cgroups=st.sampled_from([(), (re.compile("kubepods"),)]),
    slurm_jobs=st.frozensets(st.sampled_from(["99", "100"])),
    pods=st.frozensets(st.sampled_from([POD_A, POD_B])),
    display_servers=st.just(frozenset({"Xorg", "gnome-shell", "sway"})),
    self_pids=st.frozensets(st.sampled_from([777, 4100])),
)
selections = st.builds(
    Selection,
    window_seconds=st.just(7200.0),
    min_memory_bytes=st.sampled_from([0, 256 * 2**20]),
    users=st.frozensets(st.sampled_from(["u4242", "u5000"])),
    gpus=st.frozensets(st.sampled_from([0, 1])),
    only_orphans=st.booleans(),
    pid=st.sampled_from([None, 4242]),
    force=st.booleans(),
)


def _protected(c: Candidate, p: Protections) -> bool:
    job, pod, undelegated = CGROUPS[c.owner.cgroup]
    return (
        c.pid == 1
        or c.pid in p.self_pids
        or (c.uid is not None and c.uid <= p.system_uid_max)
        # By name alone (no executable lookup here): only a system account's process.
        or (c.name in p.display_servers and c.uid is not None and c.uid < p.login_uid_min)
        or c.user in p.users
        or str(c.uid) in p.users
        or any(r.search(c.command or "") for r in p.commands)
        or any(r.search(undelegated) for r in p.cgroups)
        or job in p.slurm_jobs
        or pod in p.pods
    )


@settings(max_examples=400, deadline=None)
@given(
    st.lists(candidates, max_size=8),
    protection_sets,
    selections,
    st.sampled_from([None, 4242, 4343]),
)
def test_protected_processes_are_never_chosen(cs, protections, selection, caller_uid) -> None:
    decisions = decide(cs, selection=selection, protections=protections, caller_uid=caller_uid)
    assert len(decisions) == len(cs)
    for d in decisions:
        c = d.candidate
        # Protected exactly when something the user cannot choose says so: a display
        # server's name, the environment's job id, a pod or pattern named below the
        # user's own service manager protect nothing (reaper audit findings 3 and 4).
        assert (d.reason in PROTECTED_REASONS) == _protected(c, protections), (c, d)
        if _protected(c, protections):
            assert d.verdict == "spare", (c, d)
        if d.verdict == "reap":
            assert c.alive and c.uid is not None and c.uid > protections.system_uid_max
            assert caller_uid is None or c.uid == caller_uid
            assert selection.force or all(h.evidence.idle for h in c.holdings)
    # Deterministic: a dry run and a real run decide alike on the same inputs.
    again = decide(cs, selection=selection, protections=protections, caller_uid=caller_uid)
    assert [(d.verdict, d.reason) for d in again] == [(d.verdict, d.reason) for d in decisions]
