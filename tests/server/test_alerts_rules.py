"""The pure parts of the alert engine: rules over facts, the life cycle, dispatch timers."""

from __future__ import annotations

from gpuwatch.server.alerts import dispatch, lifecycle, rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.facts import EventFact, Facts, GpuFact, Holder

GIB = 2**30
T = 1_800_000_000.0


def settings(**alerts: object) -> AlertSettings:
    return AlertSettings.model_validate(alerts)


def filling(free_gib: float, ttf: float, *, user: str = "erin") -> Facts:
    holder = Holder(31, user, "python train.py", int(60 * GIB), slurm_job_id="4242")
    gpu = GpuFact("host-1", 0, 80 * GIB, int((80 - free_gib) * GIB), 0, True, (holder,))
    event = EventFact(
        kind="filling_up",
        reason="filling_up",
        hostname="host-1",
        gpu=0,
        pid=None,
        user=None,
        held_bytes=None,
        started_at=T,
        summary="filling",
        evidence={
            "time_to_full_seconds": ttf,
            "culprits": [{"pid": 31, "slope_bytes_per_second": GIB / 60}],
        },
    )
    return Facts(gpus=[gpu], events=[event])


def test_filling_up_names_the_culprit_and_needs_both_conditions() -> None:
    config = settings(teams={"erin": "vision"})

    found = {c.rule: c for c in rules.evaluate(filling(12, 600), config, now=T)}
    assert set(found) == {"gpu_filling_up_warning"}  # 15% free: below 25%, not below 10%
    warning = found["gpu_filling_up_warning"]
    assert warning.labels == {
        "rule": "gpu_filling_up_warning",
        "severity": "warning",
        "hostname": "host-1",
        "gpu": "0",
    }
    (culprit,) = warning.culprits
    assert (culprit.pid, culprit.user, culprit.slurm_job_id) == (31, "erin", "4242")
    assert "erin's pid 31" in warning.summary and "Slurm job 4242" in warning.summary
    assert "+1.0 GiB/min" in warning.summary

    both = {c.rule for c in rules.evaluate(filling(6, 600), config, now=T)}
    assert both == {"gpu_filling_up_warning", "gpu_filling_up_critical"}
    # Plenty free, or full far beyond the horizon: nothing.
    assert rules.evaluate(filling(40, 600), config, now=T) == []
    assert rules.evaluate(filling(12, 3 * 3600), config, now=T) == []


def test_idle_holder_only_on_a_gpu_others_need() -> None:
    alice = Holder(9, "alice", "jupyter kernel", 11 * GIB)
    bob = Holder(10, "bob", "python train.py", 20 * GIB)
    idle = EventFact(
        "idle", "idle", "host-1", 1, 9, "alice", 11 * GIB, T - 2 * 3600, "holds 11 GiB", {}, alice
    )
    lonely = GpuFact("host-1", 1, 80 * GIB, 11 * GIB, 0, True, (alice,))
    shared = GpuFact("host-1", 1, 80 * GIB, 31 * GIB, 0, True, (bob, alice))
    config = settings(teams={"alice": "nlp"})

    assert rules.evaluate(Facts([lonely], [idle]), config, now=T) == []
    (alert,) = rules.evaluate(Facts([shared], [idle]), config, now=T)
    assert alert.labels["team"] == "nlp" and alert.labels["pid"] == "9"


def candidate(rule: str = "gpu_lost") -> rules.Candidate:
    return rules.Candidate(rule, "critical", {"rule": rule, "hostname": "h"}, "lost")


def test_life_cycle_pending_for_firing_keep_firing_for_resolved() -> None:
    config = settings(rules={"runaway_process": {"for": "5m", "keep_firing_for": "2m"}})
    c = candidate("runaway_process")

    (a,) = lifecycle.advance({}, [c], config, now=T)
    assert a.state == "pending"
    (a,) = lifecycle.advance({a.fingerprint: a}, [c], config, now=T + 299)
    assert a.state == "pending"
    (a,) = lifecycle.advance({a.fingerprint: a}, [c], config, now=T + 300)
    assert (a.state, a.fired_at) == ("firing", T + 300)
    assert lifecycle.advance({a.fingerprint: a}, [], config, now=T + 400) == []  # kept firing
    (a,) = lifecycle.advance({a.fingerprint: a}, [], config, now=T + 420)
    assert (a.state, a.resolved_at) == ("resolved", T + 420)


def test_a_pending_alert_whose_condition_ends_is_dropped_unheard() -> None:
    config = settings(rules={"runaway_process": {"for": "5m"}})
    c = candidate("runaway_process")
    (a,) = lifecycle.advance({}, [c], config, now=T)
    (gone,) = lifecycle.advance({a.fingerprint: a}, [], config, now=T + 60)
    assert gone.dropped


def test_alertmanager_receivers_get_firing_alerts_again_every_minute() -> None:
    config = settings()
    (alert,) = lifecycle.advance({}, [candidate()], config, now=T)
    am = dispatch.ReceiverInfo("am", True, dispatch.ALERTMANAGER_RESEND_SECONDS)
    groups: dict[tuple[str, str], dispatch.GroupState] = {}
    sent = []
    for t in range(0, 301, 15):
        result = dispatch.plan([alert], groups, [], [am], config, now=T + t)
        for group in result.groups:
            groups[(group.receiver, group.group_key)] = group
        sent += [t for _ in result.notifications]
    assert sent == [0, 60, 120, 180, 240, 300]


def test_a_regex_silence_mutes_only_what_it_matches() -> None:
    silence = dispatch.Silence(
        1, (dispatch.Matcher("hostname", "gpu-0[12]", regex=True),), T, T + 60
    )
    assert silence.mutes({"hostname": "gpu-01"}, T + 1)
    assert not silence.mutes({"hostname": "gpu-013"}, T + 1)
    assert not silence.mutes({"hostname": "gpu-01"}, T + 60)


def test_nearly_full_fires_on_a_jump_and_never_on_a_gpu_that_sits_full() -> None:
    config = settings()
    holder = Holder(5, "dave", "python big.py", int(70 * GIB))

    def full(was_gib: float | None) -> Facts:
        low = None if was_gib is None else int(was_gib * GIB)
        return Facts([GpuFact("host-1", 2, 80 * GIB, int(78 * GIB), 0, True, (holder,), low)])

    (jumped,) = rules.evaluate(full(40), config, now=T)
    assert jumped.rule == "gpu_nearly_full" and "jumped to 98% full (from 50%" in jumped.summary
    assert rules.evaluate(full(77), config, now=T) == []  # full, flat: its steady state
    assert rules.evaluate(full(None), config, now=T) == []  # no history: no claim


def test_health_rules_fire_on_what_nvml_reports_and_stay_quiet_on_everyday_states() -> None:
    from gpuwatch.server.alerts.facts import GpuHealth

    def gpu(health: GpuHealth) -> Facts:
        return Facts([GpuFact("host-1", 3, 80 * GIB, 10 * GIB, 0, True, (), None, health)])

    config = settings()
    sick = GpuHealth(
        ecc_uncorrected_volatile=2,
        xid_errors=1,
        xid_last_code=79,
        xid_seen_at=T - 60,
        throttle_reasons=frozenset({"hw_thermal_slowdown", "sw_power_cap"}),
        remap_pending=True,
    )
    found = {c.rule: c for c in rules.evaluate(gpu(sick), config, now=T)}
    assert set(found) == {"gpu_ecc_uncorrected", "gpu_xid", "gpu_throttled", "gpu_memory_repair"}
    assert "Xid 79" in found["gpu_xid"].summary
    assert found["gpu_throttled"].summary.endswith("slowed down: hw_thermal_slowdown")
    assert found["gpu_ecc_uncorrected"].labels["gpu"] == "3"

    everyday = GpuHealth(
        ecc_uncorrected_volatile=0,
        xid_errors=1,
        xid_last_code=79,
        xid_seen_at=T - 3600,  # an old Xid: not new
        throttle_reasons=frozenset({"sw_power_cap", "gpu_idle"}),
        remap_pending=False,
        remap_failure=False,
    )
    assert rules.evaluate(gpu(everyday), config, now=T) == []


def test_job_ended_tells_only_the_users_who_asked_once_and_says_if_memory_was_freed() -> None:
    from gpuwatch.server.alerts.facts import EndedProcess

    ran = Holder(77, "alice", "python train.py", int(30 * GIB))
    other = Holder(78, "bob", "python train.py", int(30 * GIB))
    gpu = GpuFact("host-1", 0, 80 * GIB, 0, 0, True)

    def ended(holder: Holder, busy: bool = True) -> EndedProcess:
        return EndedProcess("host-1", 0, holder, T - 7200, T - 60, 30 * GIB, busy)

    config = settings(rules={"job_ended": {"enabled": True, "users": ["alice"]}})
    facts = Facts([gpu], [], [ended(ran), ended(other), ended(ran, busy=False)])
    (alert,) = rules.evaluate(facts, config, now=T)
    assert alert.labels["user"] == "alice" and alert.labels["pid"] == "77"
    assert "ended after 2.0 h" in alert.summary and "its memory was freed" in alert.summary
    # Off unless asked for; and an old ending is not announced.
    assert rules.evaluate(facts, settings(), now=T) == []
    assert rules.evaluate(facts, config, now=T + 3600) == []
