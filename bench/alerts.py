"""Alert benchmark: notifications that come early enough, none that should not, and what
one evaluation of the fleet costs.

**Quality.** Fake-GPU scenarios are replayed end to end: the raw polls an agent would
push every 15 s (one host, two 80 GiB GPUs, processes with users and commands, ±3%
poll jitter, memory noise) go through the real ``ingest_snapshots`` on a fresh SQLite
file, and every 15 s of simulated time the real :class:`AlertEngine` runs (rules, life
cycle, dispatch, delivery) with a real signed webhook receiver posting over loopback
HTTP to a local sink, which stamps each arrival with the fake clock. Detection windows
are set as a user could set them (:data:`USER_SETTINGS`: a 9 min evidence window, so a
verdict can come within 10 min). Scenarios:

* linear fills at 0.5, 1 and 2 GiB/min from 10-20 GiB used, beside a flat job, until
  the GPU is full. Lead time = the GPU full minus the first ``gpu_filling_up_*``
  notification; it is compared with what an oracle evaluating the same rule condition
  (free below ``free_ratio`` and true time to full within ``within``) with perfect
  knowledge would get. Goal: at least 0.8 of the oracle's lead.
* saw-tooth training loops (periods 60 s, 5 and 8 min, amplitudes up to 40 GiB, some
  peaking near full), warm-ups that load a model and level off, and full-but-flat GPUs.
  Goal: no notification of any rule.

Everything runs twice: at :data:`USER_SETTINGS` and at :data:`TUNED_SETTINGS` (the
filling-up rules' ``for`` shortened, to see what the lead-time goal needs). The peer's
rule ("GPU memory grew 10% in 10 minutes", evaluated on every raw poll) runs on the
same polls.

**Cost.** 1,000 hosts x 8 GPUs x 4 processes are ingested (one snapshot each) into a
fresh database, with a few hundred open orphaned, runaway, idle and filling-up events
and nearly full GPUs, and :meth:`AlertEngine.evaluate` (facts, rules, life cycle,
dispatch to one receiver) is timed over 23 rounds 15 s apart, until every alert fires,
on SQLite and on Postgres, step by step, beside the limit (the same reads as plain
tuples and one ``executemany`` of ``last_true_at``). Goal: under 10% of the 15 s
evaluation interval.

Run: ``./dev bench alerts`` (2.5-3 min on 2 cores); results in
``bench/results/alerts.json``.
"""

from __future__ import annotations

import cProfile
import io
import multiprocessing
import pstats
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import write_result
from tests.support.sink import sink

GIB, MIB, MINUTE = 2**30, 2**20, 60.0
TOTAL = 80 * GIB
PUSH = 15.0
# The engine runs this long after each poll (the push and ingest happen in between).
ENGINE_LAG = 1.0
T0 = 1_800_000_000.0
HOST = "bench-host"
SECRET = "bench-secret"
JITTER = 0.03  # polls at n x 15 s +- 3% of the interval
NOISE = 64 * MIB  # standard deviation of each process's memory, per poll
PEER_GROWTH, PEER_WINDOW = 0.10, 600.0
RATES = (0.5, 1.0, 2.0)
FILL_SEEDS = (1, 2, 3)
GOAL_RATIO = 0.8
FILLING_RULES = ("gpu_filling_up_warning", "gpu_filling_up_critical")

# What a user who wants a verdict within 10 min could set: a 9 min evidence window
# (periods up to 9 min ruled out), buckets of a minute, Alertmanager's usual timers.
USER_SETTINGS: dict[str, Any] = {
    "agent_push_interval_seconds": 15,
    "sample_interval_seconds": 60,
    "leak_min_duration_seconds": 540,
    "alerts": {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"},
}
# The same, with the filling-up rules' ``for`` shortened: what the lead-time goal needs
# (measured on the same scenarios below).
TUNED_SETTINGS: dict[str, Any] = {
    **USER_SETTINGS,
    "alerts": {
        **USER_SETTINGS["alerts"],
        "rules": {
            "gpu_filling_up_warning": {"for": "1m"},
            "gpu_filling_up_critical": {"for": "0s"},
        },
    },
}


# --- the local webhook sink (tests/support/sink.py, trimmed) ----------------------------


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- scenarios --------------------------------------------------------------------------

Memory = Callable[[float], float]  # bytes at t seconds into the scenario


@dataclass(frozen=True)
class Proc:
    pid: int
    user: str
    command: str
    used: Memory
    sm: float = 0.9
    appears_at: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str  # fill, sawtooth, warmup, full_flat
    seed: int
    minutes: float
    gpus: tuple[tuple[Proc, ...], ...]
    rate_gib_per_min: float | None = None
    onset: float | None = None  # when growth starts (s)
    full_at: float | None = None  # when the GPU is full (s), for fills


def flat(gib: float) -> Memory:
    return lambda t: gib * GIB


def saw(low_gib: float, high_gib: float, period: float, phase: float) -> Memory:
    """A training loop: memory climbs from low to high over a step, then drops."""
    return lambda t: (low_gib + (high_gib - low_gib) * (((t + phase) % period) / period)) * GIB


def ramp(start: float, seconds: float, to_gib: float) -> Memory:
    """A warm-up: 0.5 GiB at start, rising linearly to ``to_gib`` over ``seconds``."""
    return lambda t: (0.5 + (to_gib - 0.5) * min(max(t - start, 0.0) / seconds, 1.0)) * GIB


def _other_gpu(rng: random.Random) -> tuple[Proc, ...]:
    return (Proc(7001, "carol", "python serve.py --model mistral-7b", flat(rng.uniform(18, 24))),)


def fill(rate: float, seed: int) -> Scenario:
    """10 min steady, then one process grows at ``rate`` GiB/min until the GPU is full."""
    rng = random.Random(seed * 1000 + int(rate * 10))
    neighbour = rng.uniform(4, 8)
    start = rng.uniform(10, 20) - neighbour
    onset = 600.0
    full_at = onset + (TOTAL / GIB - neighbour - start) / rate * MINUTE
    growing = Proc(
        5001,
        "alice",
        "python finetune.py --model llama-13b --no-grad-accum-reset",
        lambda t: (start + rate * max(t - onset, 0.0) / MINUTE) * GIB,
    )
    job = Proc(5002, "bob", "python train.py --config resnet50.yaml", flat(neighbour))
    return Scenario(
        f"fill_{rate:g}GiB_per_min_seed{seed}",
        "fill",
        seed,
        full_at / MINUTE,
        ((growing, job), _other_gpu(rng)),
        rate_gib_per_min=rate,
        onset=onset,
        full_at=full_at,
    )


def steady(seed: int) -> list[Scenario]:
    """Every non-growing scenario; ``seed`` sets phases, levels and noise."""
    rng = random.Random(seed)
    train = "python train.py --config {}.yaml"
    out = []
    for period, low, high, tag in (
        (60.0, 10, 30, "20GiB"),
        (300.0, 10, 50, "40GiB"),
        (480.0, 10, 50, "40GiB"),
        (60.0, 36, 76, "40GiB_near_full"),
        (480.0, 36, 76, "40GiB_near_full"),
    ):
        loop = Proc(
            6001, "dave", train.format("gpt2"), saw(low, high, period, rng.uniform(0, period))
        )
        helper = Proc(6002, "dave", "python dataloader_worker.py", flat(2.0), sm=0.2)
        out.append(
            Scenario(
                f"sawtooth_{period / MINUTE:g}min_{tag}_seed{seed}",
                "sawtooth",
                seed,
                60,
                ((loop, helper), _other_gpu(rng)),
            )
        )
    for to_gib, neighbour, tag in (
        (60, 0.0, "alone"),
        (60, 5.0, "beside_5GiB"),
        (70, 4.0, "to_70GiB"),
    ):
        loader = Proc(
            6101, "erin", train.format("llama-7b"), ramp(600.0, 300.0, to_gib), appears_at=600.0
        )
        procs = (
            (loader,)
            if not neighbour
            else (loader, Proc(6102, "frank", "python eval.py", flat(neighbour)))
        )
        out.append(
            Scenario(
                f"warmup_0_to_{to_gib}GiB_{tag}_seed{seed}",
                "warmup",
                seed,
                60,
                (procs, _other_gpu(rng)),
            )
        )
    out.append(
        Scenario(
            f"full_flat_78GiB_one_process_seed{seed}",
            "full_flat",
            seed,
            120,
            ((Proc(6201, "grace", train.format("llama-70b-shard"), flat(78.0)),), _other_gpu(rng)),
        )
    )
    out.append(
        Scenario(
            f"full_flat_78GiB_two_processes_seed{seed}",
            "full_flat",
            seed,
            120,
            (
                (
                    Proc(6301, "heidi", train.format("vit-huge"), flat(70.0)),
                    Proc(6302, "ivan", "python infer.py --batch 64", flat(8.0)),
                ),
                _other_gpu(rng),
            ),
        )
    )
    return out


def snapshot(scenario: Scenario, n: int, rng: random.Random) -> tuple[Any, float, list[int]]:
    """Poll ``n`` of ``scenario``: the HostSnapshot, its scenario time, used bytes per GPU."""
    from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

    t = n * PUSH + rng.uniform(-JITTER, JITTER) * PUSH
    gpus, used_per_gpu = [], []
    for index, procs in enumerate(scenario.gpus):
        # A poll belongs to its slot: jitter never hides a process that is there.
        present = [p for p in procs if n * PUSH >= p.appears_at]
        values = [max(0, int(p.used(t) + rng.gauss(0, NOISE))) for p in present]
        used = min(sum(values), TOTAL)
        used_per_gpu.append(used)
        gpus.append(
            Gpu(
                index=index,
                uuid=f"GPU-{index:08d}-bench-0000-000000000000",
                name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=TOTAL,
                memory_used_bytes=used,
                memory_free_bytes=TOTAL - used,
                unattributed_bytes=0,
                utilization_ratio=0.8,
                processes=[
                    GpuProcess(
                        pid=p.pid,
                        used_bytes=v,
                        sm_ratio=p.sm,
                        name="python",
                        command=p.command,
                        start_time=T0 + p.appears_at - 30,
                        ppid=900,
                        owner=ProcessOwner(user=p.user, uid=1000 + p.pid % 50),
                    )
                    for p, v in zip(present, values, strict=True)
                ],
            )
        )
    snap = HostSnapshot(
        agent_id="agent-bench",
        hostname=HOST,
        boot_id="boot-1",
        sequence=n + 1,
        collected_at=T0 + t,
        driver_version="550.54.15",
        gpus=gpus,
    )
    return snap, t, used_per_gpu


# --- the replay -------------------------------------------------------------------------


def replay(scenario: Scenario, settings_values: dict[str, Any]) -> dict[str, Any]:
    """Push ``scenario`` through ingest and the engine every 15 s; what arrived, when."""
    import httpx
    from sqlalchemy import select

    from gpuwatch.server.alerts.engine import AlertEngine
    from gpuwatch.server.alerts.models import AlertRow
    from gpuwatch.server.auth import service as auth_service
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade
    from gpuwatch.server.events.models import Event
    from gpuwatch.server.hosts.models import Host
    from gpuwatch.server.ingest.service import ingest_snapshots
    from gpuwatch.server.notifications.config import ReceiverConfig
    from gpuwatch.server.notifications.receivers.base import build_receiver
    from gpuwatch.settings import ServerSettings
    from gpuwatch.wire import IngestRequest

    rng = random.Random(f"{scenario.name}")
    steps = int(scenario.minutes * MINUTE // PUSH)
    if scenario.full_at is not None:  # the last poll before the GPU is full
        steps = int((scenario.full_at - ENGINE_LAG) // PUSH) + 1
    polls: list[list[tuple[float, int]]] = [[] for _ in scenario.gpus]
    with tempfile.TemporaryDirectory() as tmp:
        settings = ServerSettings.model_validate(
            {**settings_values, "data_dir": tmp, "scheduler": False}
        )
        database = create_database(settings.resolved_database_url())
        upgrade(database)
        with database.writer() as session, session.begin():
            auth_service.create_token(session=session, hostname=HOST, now=T0)
        with database.reader() as session:
            host_id = session.scalar(select(Host.id).where(Host.hostname == HOST))
        assert host_id is not None
        clock = FakeClock(T0)
        with sink(clock) as hook, httpx.Client() as client:
            config = ReceiverConfig.model_validate(
                {"name": "hook", "type": "webhook", "url": hook.url, "secret": SECRET}
            )
            receiver = build_receiver(config, client=client, clock=clock)
            engine = AlertEngine(receivers={"hook": receiver}, clock=clock, sleep=clock.advance)
            for n in range(steps):
                snap, t, used = snapshot(scenario, n, rng)
                for series, value in zip(polls, used, strict=True):
                    series.append((t, value))
                with database.writer() as session, session.begin():
                    ingest_snapshots(
                        session=session,
                        dialect=database.dialect,
                        host_id=host_id,
                        request=IngestRequest(snapshots=[snap]),
                        settings=settings,
                        now=T0 + t + 0.3,
                    )
                clock.now = T0 + n * PUSH + ENGINE_LAG
                engine.run(database=database, settings=settings, now=clock.now)
            deliveries = [(d.at, d.body) for d in hook.deliveries]
        with database.reader() as session:
            alerts = [
                (
                    a.rule,
                    a.labels.get("gpu"),
                    a.active_since - T0,
                    None if a.fired_at is None else a.fired_at - T0,
                )
                for a in session.scalars(select(AlertRow).order_by(AlertRow.id))
            ]
            events = [
                (
                    e.kind,
                    e.reason,
                    e.gpu_index,
                    e.started_at - T0,
                    None if e.ended_at is None else e.ended_at - T0,
                )
                for e in session.scalars(select(Event).order_by(Event.id))
            ]
        database.dispose()
    return {
        "deliveries": [(at - T0, body) for at, body in deliveries],
        "alerts": alerts,
        "events": events,
        "polls": polls,
        "simulated_seconds": steps * PUSH,
    }


def peer(series: list[tuple[float, int]]) -> list[float]:
    """Times (s) at which "GPU memory grew 10% in 10 minutes" holds, on every raw poll:
    the used memory now against the newest poll at least 10 minutes older."""
    fired, ref = [], -1
    for t, used in series:
        while ref + 1 < len(series) and series[ref + 1][0] <= t - PEER_WINDOW:
            ref += 1
        if ref >= 0 and used > series[ref][1] * (1 + PEER_GROWTH):
            fired.append(t)
    return fired


def episodes(times: list[float]) -> int:
    """Separate firings: runs of consecutive polls count once."""
    return sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > 1.5 * PUSH)


def notifications_by_rule(deliveries: list[tuple[float, dict[str, Any]]]) -> dict[str, int]:
    """Notifications that announce a firing alert of each rule (one notification may
    carry several rules' alerts; resolved-only ones are counted as ``resolved``)."""
    counts: Counter[str] = Counter()
    for _, body in deliveries:
        rules = {a["rule"] for a in body["alerts"] if a["status"] == "firing"}
        counts.update(rules or {"resolved"})
    return dict(sorted(counts.items()))


# --- quality: the scenarios, judged -----------------------------------------------------


def oracle_lead(rule: dict[str, Any], rate: float) -> float:
    """Seconds before full when free first drops below ``free_ratio`` of the total with
    the true time to full within ``within``: the most lead the rule's condition allows."""
    slope = rate * GIB / MINUTE
    return min(rule["free_ratio"] * TOTAL, rule["within_seconds"] * slope) / slope


def judge_fill(scenario: Scenario, run: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
    assert scenario.full_at is not None and scenario.rate_gib_per_min is not None
    full = scenario.full_at
    out: dict[str, Any] = {
        "scenario": scenario.name,
        "rate_gib_per_min": scenario.rate_gib_per_min,
        "full_at_min": round(full / MINUTE, 2),
        "growth_from_min": round((scenario.onset or 0) / MINUTE, 2),
    }
    for rule in FILLING_RULES:
        arrivals = [at for at, body in run["deliveries"] if _fires(body, rule)]
        fired = [a for a in run["alerts"] if a[0] == rule and a[3] is not None]
        allowed = oracle_lead(rules[rule], scenario.rate_gib_per_min)
        lead = None if not arrivals else full - arrivals[0]
        out[rule] = {
            "oracle_condition_at_min": round((full - allowed) / MINUTE, 2),
            "pending_at_min": _minutes(
                min((a[2] for a in run["alerts"] if a[0] == rule), default=None)
            ),
            "fired_at_min": _minutes(fired[0][3] if fired else None),
            "notified_at_min": _minutes(arrivals[0] if arrivals else None),
            "lead_min": _minutes(lead),
            "oracle_lead_min": round(allowed / MINUTE, 2),
            "ratio": None if lead is None else round(lead / allowed, 3),
        }
    filling = [e for e in run["events"] if e[0] == "filling_up"]
    out["filling_up_verdict_at_min"] = _minutes(filling[0][3] if filling else None)
    out["notifications_by_rule"] = notifications_by_rule(run["deliveries"])
    fires = peer(run["polls"][0])
    out["peer"] = {
        "first_fire_at_min": _minutes(fires[0] if fires else None),
        "lead_min": _minutes(full - fires[0] if fires else None),
        "fired_before_growth": any(t < (scenario.onset or 0) for t in fires),
    }
    return out


def judge_steady(scenario: Scenario, run: dict[str, Any]) -> dict[str, Any]:
    firing = [(at, body) for at, body in run["deliveries"] if body["status"] == "firing"]
    fires = [peer(series) for series in run["polls"]]
    return {
        "scenario": scenario.name,
        "family": scenario.family,
        "minutes": scenario.minutes,
        "notifications": len(run["deliveries"]),
        "notifications_by_rule": notifications_by_rule(run["deliveries"]),
        "first_notification_at_min": _minutes(firing[0][0] if firing else None),
        "alerts_fired": sorted({a[0] for a in run["alerts"] if a[3] is not None}),
        "alerts_pending_only": sorted({a[0] for a in run["alerts"] if a[3] is None}),
        "events_opened": dict(Counter(f"{e[0]}/{e[1]}" for e in run["events"])),
        # The trend verdicts' events, [kind/reason, opened, closed] in minutes: how long
        # a verdict outlived the growth (a warm-up levels off at 15 min).
        "trend_events": [
            [f"{e[0]}/{e[1]}", _minutes(e[3]), _minutes(e[4])]
            for e in run["events"]
            if e[0] == "filling_up" or e[1] == "leak"
        ],
        "peer": {
            "fired": any(fires),
            "episodes": sum(episodes(f) for f in fires),
            "first_fire_at_min": _minutes(min((f[0] for f in fires if f), default=None)),
        },
    }


def _fires(body: dict[str, Any], rule: str) -> bool:
    return any(a["rule"] == rule and a["status"] == "firing" for a in body["alerts"])


def _minutes(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds / MINUTE, 2)


# A job names its scenario (the scenarios hold functions, which do not pickle):
# (settings label, "fill", rate, seed) or (settings label, "steady", seed, index).
Job = tuple[str, str, float, int]
SETTINGS_BY_LABEL = {"user": USER_SETTINGS, "tuned": TUNED_SETTINGS}


def scenario_of(job: Job) -> Scenario:
    _, kind, a, b = job
    return fill(a, b) if kind == "fill" else steady(int(a))[b]


def _replay_job(job: Job) -> dict[str, Any]:
    return replay(scenario_of(job), SETTINGS_BY_LABEL[job[0]])


def quality() -> dict[str, Any]:
    from gpuwatch.settings import ServerSettings

    jobs: list[Job] = []
    # The tuned settings change only the filling-up rules' ``for``: one seed of the
    # non-growing scenarios is enough to see what that costs.
    for label, seeds in (("user", (1, 2)), ("tuned", (1,))):
        jobs += [(label, "fill", rate, seed) for rate in RATES for seed in FILL_SEEDS]
        jobs += [(label, "steady", seed, i) for seed in seeds for i in range(len(steady(seed)))]
    jobs.sort(key=lambda j: -scenario_of(j).minutes)  # longest first: workers end together
    with multiprocessing.Pool(2) as pool:
        results = pool.map(_replay_job, jobs, chunksize=1)
    runs = [(job[0], scenario_of(job), run) for job, run in zip(jobs, results, strict=True)]
    out: dict[str, Any] = {}
    for label, values in (("user", USER_SETTINGS), ("tuned", TUNED_SETTINGS)):
        settings = ServerSettings.model_validate({**values, "scheduler": False})
        rules = {name: getattr(settings.alerts.rules, name).model_dump() for name in FILLING_RULES}
        fills = [
            judge_fill(s, r, rules) for lab, s, r in runs if lab == label and s.family == "fill"
        ]
        steady_runs = [
            judge_steady(s, r) for lab, s, r in runs if lab == label and s.family != "fill"
        ]
        fills.sort(key=lambda f: (f["rate_gib_per_min"], f["scenario"]))
        steady_runs.sort(key=lambda s: s["scenario"])
        out[label] = {
            "settings": values,
            "rules": {
                name: {k: rules[name][k] for k in ("for_seconds", "free_ratio", "within_seconds")}
                for name in FILLING_RULES
            },
            "fills": fills,
            "fill_summary": _fill_summary(fills),
            "non_growing": steady_runs,
            "non_growing_summary": _steady_summary(steady_runs),
        }
    return out


def _fill_summary(fills: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for rate in RATES:
        rows = [f for f in fills if f["rate_gib_per_min"] == rate]
        entry: dict[str, Any] = {}
        for rule in FILLING_RULES:
            ratios = [f[rule]["ratio"] for f in rows]
            leads = [f[rule]["lead_min"] for f in rows]
            entry[rule] = {
                "oracle_lead_min": rows[0][rule]["oracle_lead_min"],
                "lead_min": leads,
                "ratio_min": None if None in ratios else min(ratios),
                "ratio_median": None if None in ratios else statistics.median(ratios),
                "missed": sum(1 for r in ratios if r is None),
                "goal_met": None not in ratios and min(ratios) >= GOAL_RATIO,
                # The most the whole path may take from the oracle's moment on.
                "delay_budget_min": round((1 - GOAL_RATIO) * rows[0][rule]["oracle_lead_min"], 2),
                # Where the lead went (medians, minutes): the condition seen (polls,
                # evaluation ticks, noise), then ``for``, then ``group_wait``.
                "delay_min": {
                    step: _median_gap(rows, rule, start, end)
                    for step, start, end in (
                        ("condition_seen", "oracle_condition_at_min", "pending_at_min"),
                        ("for", "pending_at_min", "fired_at_min"),
                        ("group_wait_and_delivery", "fired_at_min", "notified_at_min"),
                    )
                },
            }
        entry["peer_lead_min"] = [f["peer"]["lead_min"] for f in rows]
        entry["peer_fires_after_growth_starts_min"] = [
            round(f["peer"]["first_fire_at_min"] - f["growth_from_min"], 2) for f in rows
        ]
        summary[f"{rate:g}"] = entry
    return summary


def _median_gap(rows: list[dict[str, Any]], rule: str, start: str, end: str) -> float | None:
    gaps = [
        f[rule][end] - f[rule][start]
        for f in rows
        if f[rule][end] is not None and f[rule][start] is not None
    ]
    return round(statistics.median(gaps), 2) if gaps else None


def _steady_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_family: dict[str, Any] = {}
    for run in runs:
        entry = by_family.setdefault(
            run["family"],
            {"traces": 0, "traces_notified": 0, "by_rule": Counter(), "peer_fired": 0},
        )
        entry["traces"] += 1
        entry["traces_notified"] += run["notifications"] > 0
        entry["by_rule"].update(run["notifications_by_rule"])
        entry["peer_fired"] += run["peer"]["fired"]
    for entry in by_family.values():
        entry["by_rule"] = dict(sorted(entry["by_rule"].items()))
    return by_family


# --- cost: one evaluation over a fleet of 8,000 GPUs ------------------------------------

FLEET_HOSTS, GPUS_PER_HOST = 1000, 8  # and 4 processes per GPU
FILLING_USED = 66 * GIB  # the GPUs given a filling_up event: 82% full
ROUNDS = 23  # 5.5 min of evaluations: every rule's ``for`` (at most 5 min) has passed


def fleet_snapshot(h: int, at: float) -> Any:
    """Host ``h``: 8 GPUs of 4 processes; some orphans, some hogs on shared GPUs, some
    nearly full GPUs, the rest half full."""
    from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

    gpus = []
    for g in range(GPUS_PER_HOST):
        if g == 7 and h % 10 == 0:  # a hog on a shared GPU (runaway/share), 95% full
            sizes = [74.0, 1.0, 0.5, 0.5]
        elif (h * GPUS_PER_HOST + g) % 40 == 1:  # nearly full
            sizes = [30.0, 30.0, 10.0, 7.0]
        elif (h * GPUS_PER_HOST + g) % 40 == 2:  # filling (an event is added below)
            sizes = [40.0, 20.0, 4.0, 2.0]  # FILLING_USED
        else:
            sizes = [12.0, 10.0, 8.0, 6.0]
        procs = [
            GpuProcess(
                pid=10_000 + g * 10 + i,
                used_bytes=int(size * GIB),
                sm_ratio=0.0 if i == 3 else 0.7,
                name="python",
                command=f"python train.py --run {h}-{g}-{i}",
                start_time=at - 7200,
                ppid=1 if (i == 2 and g == 0 and h % 5 == 0) else 900,
                orphaned=i == 2 and g == 0 and h % 5 == 0,
                owner=ProcessOwner(user=f"user{(h + g + i) % 40}", uid=1000 + (h + g + i) % 40),
            )
            for i, size in enumerate(sizes)
        ]
        used = sum(p.used_bytes or 0 for p in procs)
        gpus.append(
            Gpu(
                index=g,
                uuid=f"GPU-{h:05d}-{g:03d}-0000-0000-000000000000",
                name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=TOTAL,
                memory_used_bytes=used,
                memory_free_bytes=TOTAL - used,
                unattributed_bytes=0,
                utilization_ratio=0.7,
                processes=procs,
            )
        )
    return HostSnapshot(
        agent_id=f"agent-{h}",
        hostname=f"node{h:04d}",
        boot_id="boot-1",
        sequence=1,
        collected_at=at,
        driver_version="550.54.15",
        gpus=gpus,
    )


def build_fleet(database: Any, settings: Any, at: float) -> dict[str, int]:
    """Ingest one snapshot per host, then add what only a trend would open: idle holders
    (the idle process of every 5th host's GPU 1) and filling-up GPUs."""
    from sqlalchemy import func, select, update

    from gpuwatch.server.auth import service as auth_service
    from gpuwatch.server.events.models import Event
    from gpuwatch.server.hosts.models import Gpu, Host
    from gpuwatch.server.ingest.service import ingest_snapshots
    from gpuwatch.server.processes.models import ProcessLifetime
    from gpuwatch.wire import IngestRequest

    for h in range(FLEET_HOSTS):
        with database.writer() as session, session.begin():
            auth_service.create_token(session=session, hostname=f"node{h:04d}", now=at)
            host_id = session.scalar(select(Host.id).where(Host.hostname == f"node{h:04d}"))
            ingest_snapshots(
                session=session,
                dialect=database.dialect,
                host_id=host_id,
                request=IngestRequest(snapshots=[fleet_snapshot(h, at)]),
                settings=settings,
                now=at,
            )
    with database.writer() as session, session.begin():
        # Held long enough for the orphaned and idle rules (30 min, 1 h).
        session.execute(update(Event).where(Event.ended_at.is_(None)).values(started_at=at - 7200))
        idle = session.execute(
            select(
                ProcessLifetime.id,
                ProcessLifetime.host_id,
                ProcessLifetime.pid,
                ProcessLifetime.user,
                ProcessLifetime.current_bytes,
                Gpu.gpu_index,
                Gpu.uuid,
            )
            .join(Gpu, Gpu.id == ProcessLifetime.gpu_id)
            .where(
                Gpu.gpu_index == 1, ProcessLifetime.sm_ratio == 0, ProcessLifetime.host_id % 5 == 0
            )
        ).all()
        for row in idle:
            session.add(
                Event(
                    kind="idle",
                    reason="idle",
                    host_id=row.host_id,
                    dedup_key=f"idle:lt{row.id}",
                    gpu_uuid=row.uuid,
                    gpu_index=row.gpu_index,
                    lifetime_id=row.id,
                    pid=row.pid,
                    user=row.user,
                    held_bytes=row.current_bytes,
                    summary="idle for 2h",
                    evidence={"idle_seconds": 7200.0},
                    started_at=at - 7200,
                    last_seen_at=at,
                )
            )
        filling = session.execute(
            select(Gpu.id, Gpu.host_id, Gpu.gpu_index, Gpu.uuid, Gpu.memory_free_bytes).where(
                Gpu.memory_used_bytes == FILLING_USED
            )
        ).all()
        for row in filling:
            slope = 0.5 * GIB / MINUTE
            session.add(
                Event(
                    kind="filling_up",
                    reason="filling_up",
                    host_id=row.host_id,
                    dedup_key=f"filling_up:gpu{row.id}",
                    gpu_uuid=row.uuid,
                    gpu_index=row.gpu_index,
                    held_bytes=TOTAL - row.memory_free_bytes,
                    summary="GPU memory grew 512 MiB/min",
                    evidence={
                        "slope_bytes_per_second": slope,
                        "time_to_full_seconds": row.memory_free_bytes / slope,
                        "culprits": [
                            {
                                "pid": 10_000 + row.gpu_index * 10,
                                "slope_bytes_per_second": slope,
                                "growth_bytes": 4 * GIB,
                                "growth_share": 1.0,
                            }
                        ],
                    },
                    started_at=at - 1200,
                    last_seen_at=at,
                )
            )
    with database.reader() as session:
        counts = dict(
            session.execute(
                select(Event.kind, func.count())
                .where(Event.ended_at.is_(None))
                .group_by(Event.kind)
            ).all()
        )
        lifetimes = session.scalar(select(func.count()).select_from(ProcessLifetime))
        gpus = session.scalar(select(func.count()).select_from(Gpu))
    return {"gpus": gpus, "open_lifetimes": lifetimes, "open_events": dict(sorted(counts.items()))}


# The functions AlertEngine.evaluate calls, by module of gpuwatch.server.alerts.
EVALUATE_STEPS: dict[str, tuple[str, ...]] = {
    "engine": (
        "read_facts",
        "_load",
        "_store_alerts",
        "_load_groups",
        "_load_silences",
        "_store_groups",
        "_insert_notifications",
        "_purge",
    ),
    "rules": ("evaluate",),
    "lifecycle": ("advance",),
    "dispatch": ("plan",),
}
ROWS_ARGUMENT = {"_store_alerts": 1, "_store_groups": 1}  # which argument holds the rows


class Stages:
    """Times the steps of :meth:`AlertEngine.evaluate` by wrapping the functions it calls
    (as bench/detection_share.py wraps the detectors), and counts the rows each write
    step was given. What is left over is the session: begin, flush and commit."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.rows: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Stages:
        import importlib

        for module_name, names in EVALUATE_STEPS.items():
            module = importlib.import_module(f"gpuwatch.server.alerts.{module_name}")
            for name in names:
                original = getattr(module, name)
                self._saved.append((module, name, original))
                label = name if module_name == "engine" else f"{module_name}.{name}"
                setattr(module, name, self._wrap(label, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        counted = ROWS_ARGUMENT.get(label)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
                if counted is not None:
                    self.rows[label] += len(args[counted])

        return timed


RAW_READS = (
    "SELECT id, gpu_id, pid, user, command, name, current_bytes, container_id, pod_uid,"
    " slurm_job_id FROM process_lifetimes WHERE ended_at IS NULL",
    "SELECT g.*, h.hostname, h.last_received_at FROM gpus g JOIN hosts h ON h.id = g.host_id",
    "SELECT e.*, h.hostname FROM events e JOIN hosts h ON h.id = e.host_id"
    " WHERE e.ended_at IS NULL AND e.kind IN"
    " ('orphaned', 'runaway', 'idle', 'filling_up', 'gpu_lost', 'agent_silent')",
    "SELECT * FROM alerts WHERE state IN ('pending', 'firing')",
    "SELECT * FROM alert_groups",
)


def raw_round(database: Any, now: float) -> None:
    """The limit: the rows an evaluation must read (the same queries, fetched as tuples)
    and the one column each active alert must change (``last_true_at``), written in one
    ``executemany``, in one write transaction."""
    from sqlalchemy import text

    with database.begin_write() as conn:
        fetched = [conn.execute(text(query)).all() for query in RAW_READS]
        active = [{"id": row[0], "t": now} for row in fetched[3]]
        if active:
            conn.execute(text("UPDATE alerts SET last_true_at = :t WHERE id = :id"), active)


def time_evaluations(database: Any, settings: Any, at: float) -> dict[str, Any]:
    """Time :meth:`AlertEngine.evaluate` every 15 s of simulated time; the hosts are kept
    current (as their pushes would) between rounds, untimed. One profile of the last round."""
    import httpx
    from sqlalchemy import func, select, update

    from gpuwatch.server.alerts.engine import AlertEngine
    from gpuwatch.server.alerts.models import AlertRow, NotificationRow
    from gpuwatch.server.hosts.models import Host
    from gpuwatch.server.notifications.config import ReceiverConfig
    from gpuwatch.server.notifications.receivers.base import build_receiver

    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    config = ReceiverConfig.model_validate(
        {"name": "hook", "type": "webhook", "url": "http://hook.invalid/", "secret": SECRET}
    )
    clock = FakeClock(at)
    engine = AlertEngine(
        receivers={"hook": build_receiver(config, client=client, clock=clock)}, clock=clock
    )
    seconds: list[float] = []
    raw: list[float] = []
    changed = []
    stages = Stages()
    for r in range(ROUNDS + 1):
        now = at + 30 + r * PUSH
        clock.now = now
        with database.writer() as session, session.begin():
            session.execute(update(Host).values(last_received_at=now - 5))
        if r == ROUNDS:  # one more, profiled (and not timed: the profiler slows it)
            profile = cProfile.Profile()
            profile.runcall(engine.evaluate, database=database, settings=settings, now=now)
            break
        # Rounds take turns at going first (bench/README.md, server: order bias).
        if r % 2:
            raw.append(_timed(raw_round, database, now))
        with stages:
            started = time.perf_counter()
            result = engine.evaluate(database=database, settings=settings, now=now)
            seconds.append(time.perf_counter() - started)
        if not r % 2:
            raw.append(_timed(raw_round, database, now))
        changed.append(result.written)
    client.close()
    with database.reader() as session:
        alerts = dict(
            session.execute(select(AlertRow.state, func.count()).group_by(AlertRow.state)).all()
        )
        notifications = session.scalar(select(func.count()).select_from(NotificationRow))
    steady = seconds[ROUNDS // 2 :]
    total = sum(seconds)
    known = sum(stages.seconds.values())
    return {
        "rounds": ROUNDS,
        "seconds_per_round": [round(s, 4) for s in seconds],
        "first_round_s": round(seconds[0], 4),
        "median_s": round(statistics.median(seconds), 4),
        "max_s": round(max(seconds), 4),
        "steady_median_s": round(statistics.median(steady), 4),
        "share_of_interval_median": round(statistics.median(seconds) / PUSH, 4),
        "share_of_interval_max": round(max(seconds) / PUSH, 4),
        "goal_met": max(seconds) / PUSH < 0.10,
        "raw_sql_median_s": round(statistics.median(raw), 4),
        "x_raw_sql_median": round(
            statistics.median(s / b for s, b in zip(seconds, raw, strict=True)), 2
        ),
        "alerts_by_state": alerts,
        "notifications_planned": notifications,
        "changed_per_round": changed,
        "stages_ms_per_round": {
            **{
                name: round(1000 * value / ROUNDS, 1)
                for name, value in sorted(stages.seconds.items(), key=lambda kv: -kv[1])
            },
            "session (begin, flush, commit)": round(1000 * (total - known) / ROUNDS, 1),
        },
        "stages_share": {
            **{
                name: round(value / total, 3)
                for name, value in sorted(stages.seconds.items(), key=lambda kv: -kv[1])
            },
            "session (begin, flush, commit)": round((total - known) / total, 3),
        },
        "rows_written_per_round": {
            name: round(count / ROUNDS, 1) for name, count in stages.rows.items()
        },
        "profile_one_more_round": _profile_top(profile),
    }


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _profile_top(profile: cProfile.Profile, n: int = 14) -> list[str]:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(n)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return [line for line in lines[start:] if line]


def cost_on(kind: str) -> dict[str, Any]:
    from bench.server import fresh_database
    from gpuwatch.settings import ServerSettings

    at = T0 + 86400
    with tempfile.TemporaryDirectory() as tmp, fresh_database(kind, Path(tmp), "alerts") as target:
        settings = ServerSettings.model_validate(
            {**USER_SETTINGS, "data_dir": tmp, "database_url": target.url, "scheduler": False}
        )
        database = target.database()
        try:
            started = time.perf_counter()
            fleet: dict[str, Any] = build_fleet(database, settings, at)
            fleet["build_s"] = round(time.perf_counter() - started, 1)
            timing = time_evaluations(database, settings, at)
        finally:
            database.dispose()
    return {"fleet": fleet, **timing}


def cost() -> dict[str, Any]:
    from bench.server import postgres_unavailable

    out: dict[str, Any] = {"sqlite": cost_on("sqlite")}
    why = postgres_unavailable()
    out["postgres"] = {"skipped": why} if why else cost_on("postgres")
    return out


# --- many groups: the first evaluation of a large incident ------------------------------

GROUPS = 10_000
# One of each kind: 10,000 groups are 30,000 notifications and 30,000 group rows.
GROUP_RECEIVERS = ("alertmanager", "slack", "webhook")
# No group_wait (all due at once), a day of keep_firing_for (the alerts are written as
# rows, without facts).
GROUP_SETTINGS: dict[str, Any] = {
    "alerts": {
        "group_wait": "0s",
        "group_interval": "5m",
        "repeat_interval": "4h",
        "rules": {"gpu_throttled": {"keep_firing_for": "1d"}},
    }
}


def fire_groups(database: Any, groups: int, at: float) -> None:
    """``groups`` firing alerts, each in a group of its own (one host each)."""
    from sqlalchemy import insert

    from gpuwatch.server.alerts.models import AlertRow
    from gpuwatch.server.alerts.rules import fingerprint

    rows = []
    for h in range(groups):
        labels = {"rule": "gpu_throttled", "severity": "warning", "hostname": f"host-{h:05d}"}
        rows.append(
            {
                "fingerprint": fingerprint(labels),
                "rule": "gpu_throttled",
                "labels": labels,
                "severity": "warning",
                "state": "firing",
                "summary": f"{labels['hostname']} GPU 0 is throttled: hw_slowdown",
                "description": "hardware slowdown since 12:00",
                "culprits": [],
                "active_since": at,
                "fired_at": at,
                "last_true_at": at,
                "resolved_at": None,
            }
        )
    with database.writer() as session, session.begin():
        session.execute(insert(AlertRow), rows)


def _timed_evaluation(engine: Any, database: Any, settings: Any, now: float) -> dict[str, Any]:
    """Wall and this process's CPU for one ``evaluate`` (the database server's own CPU,
    on Postgres, is not counted), with its steps."""
    with Stages() as stages:
        wall, cpu = time.perf_counter(), time.process_time()
        result = engine.evaluate(database=database, settings=settings, now=now)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "share_of_interval": round(wall / PUSH, 3),
        "planned": result.planned,
        "stages_s": {
            name: round(value, 3)
            for name, value in sorted(stages.seconds.items(), key=lambda kv: -kv[1])
        },
    }


def groups_on(kind: str) -> dict[str, Any]:
    """The first evaluation of :data:`GROUPS` firing groups (every notification and
    group row new), and the one a minute later (Alertmanager's resend: 10,000 more,
    each superseding the undelivered one before it)."""
    import httpx

    from bench.server import fresh_database
    from gpuwatch.server.alerts.engine import AlertEngine
    from gpuwatch.server.notifications.config import ReceiverConfig
    from gpuwatch.server.notifications.receivers.base import build_receiver
    from gpuwatch.settings import ServerSettings

    at = T0 + 86400
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    clock = FakeClock(at)
    receivers = {}
    for kind_of in GROUP_RECEIVERS:
        config = ReceiverConfig.model_validate(
            {
                "name": kind_of,
                "type": kind_of,
                "url": f"http://{kind_of}.invalid/",
                **({"secret": SECRET} if kind_of == "webhook" else {}),
            }
        )
        receivers[kind_of] = build_receiver(config, client=client, clock=clock)
    engine = AlertEngine(receivers=receivers, clock=clock)
    with tempfile.TemporaryDirectory() as tmp, fresh_database(kind, Path(tmp), "groups") as target:
        settings = ServerSettings.model_validate(
            {**GROUP_SETTINGS, "data_dir": tmp, "database_url": target.url, "scheduler": False}
        )
        database = target.database()
        try:
            fire_groups(database, GROUPS, at)
            first = _timed_evaluation(engine, database, settings, at)
            clock.now = at + 60
            resend = _timed_evaluation(engine, database, settings, at + 60)
        finally:
            database.dispose()
            client.close()
    return {"groups": GROUPS, "receivers": list(GROUP_RECEIVERS), "first": first, "resend": resend}


def many_groups() -> dict[str, Any]:
    from bench.server import postgres_unavailable

    out: dict[str, Any] = {"sqlite": groups_on("sqlite")}
    why = postgres_unavailable()
    out["postgres"] = {"skipped": why} if why else groups_on("postgres")
    return out


def main() -> None:
    started = time.perf_counter()
    result: dict[str, Any] = {"quality": quality()}
    result["quality_seconds"] = round(time.perf_counter() - started, 1)
    result["cost"] = cost()
    result["groups"] = many_groups()
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    path = write_result("alerts", result)
    print(f"wrote {path} in {result['total_seconds']} s")


if __name__ == "__main__":
    main()
