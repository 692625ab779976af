"""``python -m bench.reliability``: render docs/reliability.md from the benchmarks' results.

What gpuwatch promises, the figure each benchmark last measured, the target, whether it
was met, and how it was tested. The figures come from ``bench/results/<name>.json``
(load, server, agent, detection, alerts, reaper, dashboard: whichever exist) and the
fault matrix from ``tests/faults/MATRIX.md``; nothing in the document is typed by hand,
so regenerating it after a benchmark run is the only way it changes::

    ./dev bench load                # or any benchmark, then:
    .venv/bin/python -m bench.reliability

A result file in a shape this module does not know (a benchmark that changed) gives a
row that says so rather than stopping the document.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS
from gpuwatch.server_settings import ServerSettings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
MATRIX = ROOT / "tests" / "faults" / "MATRIX.md"
MIB = 2**20
NAMES = {"sqlite": "SQLite", "postgres": "Postgres"}


@dataclass(frozen=True)
class Promise:
    """One line of the promises table. ``met`` is None for a figure with no target."""

    area: str
    promise: str
    figure: str
    target: str
    met: bool | None
    how: str


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "reported"}[met]


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _rate(value: float) -> str:
    return f"{value:,.0f} /s"


# --- one reader per result file ------------------------------------------------------------


def load_promises(r: dict[str, Any]) -> list[Promise]:
    how = "`bench/load.py`: simulated agents over loopback, one server process"
    out: list[Promise] = []
    for kind in ("sqlite", "postgres"):
        error = r.get(kind, {}).get("error")
        if error:
            out.append(
                Promise(
                    "Ingest under load",
                    f"The {NAMES[kind]} phases ran to the end",
                    f"stopped: {error}",
                    "every phase measured",
                    False,
                    how,
                )
            )
    sqlite = r.get("sqlite", {}).get("one_server")
    if sqlite:
        out.append(
            Promise(
                "Ingest under load",
                f"One SQLite server holds {sqlite['hosts']:,} hosts at the 15 s push interval",
                f"{_rate(sqlite['snapshots_per_second'])} of "
                f"{_rate(sqlite['offered_snapshots_per_second'])} offered, "
                f"p99 {_ms(sqlite['p99_ms'])}, {sqlite['statuses'].get('503', 0):,} answered 503"
                f" (`state_cache_hosts` = {r['state_cache_hosts']:,})",
                "≥ 200 /s at p99 < 250 ms",
                r["verdicts"]["sqlite_3000_hosts"]["met"],
                how,
            )
        )
    default = r.get("sqlite", {}).get("one_server_default_cache")
    if default:
        out.append(
            Promise(
                "Ingest under load",
                "The same, at the server's default `state_cache_hosts`"
                f" ({ServerSettings.model_fields['state_cache_hosts'].default:,} hosts)",
                f"{_rate(default['snapshots_per_second'])}, p99 {_ms(default['p99_ms'])}, "
                f"{default['statuses'].get('503', 0):,} answered 503",
                "≥ 200 /s at p99 < 250 ms",
                r["verdicts"]["sqlite_3000_hosts_default_cache"]["met"],
                how,
            )
        )
    for kind in ("sqlite", "postgres"):
        one = r.get(kind, {}).get("one_server", {})
        if "cpu_ratio_to_floor" in one:
            out.append(
                Promise(
                    "Ingest under load",
                    f"Server CPU per snapshot, {NAMES[kind]}",
                    f"{one['server_cpu_ms_per_snapshot']:.2f} ms, "
                    f"{one['cpu_ratio_to_floor']:.1f}× the HTTP floor",
                    "≤ 4× the HTTP floor",
                    one["cpu_ratio_to_floor"] <= r["targets"]["cpu_ratio_to_floor"],
                    how + ", against `bench/http_floor.py` in the same run",
                )
            )
    two = r.get("postgres", {}).get("two_replicas")
    if two:
        out.append(
            Promise(
                "Ingest under load",
                "Postgres with two replicas at least as fast as one SQLite server",
                f"{_rate(two['snapshots_per_second'])}, p99 {_ms(two['p99_ms'])}",
                "≥ the SQLite figure, p99 < 250 ms",
                r["verdicts"].get("postgres_two_replicas_at_least_sqlite", {}).get("met"),
                "`bench/load.py`: simulated agents over loopback, split between two server"
                " processes on one Postgres",
            )
        )
    storm = r.get("sqlite", {}).get("storm")
    if storm:
        total = storm["agents"] * storm["spooled_per_agent"]
        drained = storm["drain_seconds"]
        statuses = sorted({*storm["storm_requests"]["statuses"], *storm["live"]["statuses"]})
        out.append(
            Promise(
                "Ingest under load",
                f"A reconnect storm ({storm['agents']:,} agents × "
                f"{storm['spooled_per_agent']} spooled = {total:,} snapshots) drains",
                (f"{drained:,.0f} s" if drained is not None else
                 f"not drained in {storm['cap_seconds']:,.0f} s "
                 f"({storm['drained_agents']:,} of {storm['agents']:,} agents)")
                + f"; live p99 {_ms(storm['live']['p99_ms'])}; statuses {', '.join(statuses)}",
                "≤ 600 s; only 200 and 503",
                r["verdicts"]["storm_drain"]["met"],
                how + f"; {storm['live_hosts']:,} live hosts push throughout",
            )
        )  # fmt: skip
    rss = r.get("agent_rss")
    if rss:
        out.append(
            Promise(
                "Agent",
                "Agent RSS without the fake library, flat over scrapes",
                f"{rss['rss_end_without_fake_estimate_bytes'] / MIB:.1f} MiB after "
                f"{rss['scrapes']:,} scrapes; "
                f"{rss['slope_bytes_per_1000_scrapes_second_half'] / 1024:+.0f} KiB "
                "per 1,000 scrapes",
                "≤ 40 MiB, flat (< 16 KiB per 1,000 scrapes, second half)",
                r["verdicts"]["agent_rss"]["met"],
                "`bench/load.py`: a real `gpuwatch agent` (on the fake GPUs, whose share is "
                "measured and taken off), RSS sampled every 100 scrapes",
            )
        )
    return out


def server_promises(r: dict[str, Any]) -> list[Promise]:
    how = "`bench/server.py`: `gpuwatch server` over loopback, one agent at a time"
    out = []
    single = r["ingest"]["sqlite"]["batch_1"]["snapshots_per_second"]
    out.append(
        Promise(
            "Server",
            "Single-snapshot pushes from one agent, SQLite",
            _rate(single),
            f"≥ {r['targets']['sqlite_batch_1_snapshots_per_second']} /s",
            single >= r["targets"]["sqlite_batch_1_snapshots_per_second"],
            how,
        )
    )
    for kind, fleet in r["fleet"].items():
        out.append(
            Promise(
                "Server",
                f"Fleet summary at {fleet['hosts']:,} hosts, {NAMES[kind]}",
                f"median {_ms(fleet['median_ms']['fleet'])}",
                f"≤ {r['targets']['fleet_median_ms']} ms",
                fleet["median_ms"]["fleet"] <= r["targets"]["fleet_median_ms"],
                "`bench/server.py`: `GET /api/v1/fleet`, populated through ingest",
            )
        )
    for kind, storage in r["storage"].items():
        out.append(
            Promise(
                "Server",
                f"Database growth per host per day, {NAMES[kind]}",
                f"{storage['mib_per_host_per_day']:.1f} MiB",
                "—",
                None,
                "`bench/server.py`: one measured hour of pushes, extrapolated",
            )
        )
    return out


def agent_promises(r: dict[str, Any]) -> list[Promise]:
    poll, scrape = r["poll"], r["scrape"]
    return [
        Promise(
            "Agent",
            "One poll of 8 GPUs × 200 processes, against the bare NVML calls it makes",
            f"{poll['ratio_poll_to_bare']:.2f}×",
            f"≤ {poll['targets']['ratio_poll_to_bare']}×",
            poll["ratio_poll_to_bare"] <= poll["targets"]["ratio_poll_to_bare"],
            "`bench/agent.py`: interleaved rounds on the fake GPUs, the baseline replaying the calls one poll made",
        ),
        Promise(
            "Agent",
            "`GET /metrics`, against node_exporter's on the same machine",
            f"{scrape['ratio_scrape_to_node_exporter']:.2f}×",
            "≤ 1×",
            scrape["ratio_scrape_to_node_exporter"] <= 1.0,
            "`bench/agent.py`: both over loopback, requests alternating",
        ),
    ]


def detection_promises(r: dict[str, Any]) -> list[Promise]:
    within = r["false_positives"]["within_guarantee"]
    delays = r["detection_delay"]["window_540s"]
    fast = [v for k, v in delays.items() if not k.startswith("leak_0.5")]  # >= 1 GiB/min
    median = max(v["delay_minutes_median"] for v in fast)
    worst = max(v["delay_minutes_max"] for v in fast)
    return [
        Promise(
            "Detection",
            "No leak or filling-up verdict on non-growing memory (within the guarantee)",
            f"{within['leak'] + within['filling']} of {within['traces']:,} traces",
            "0",
            within["leak"] + within["filling"] == 0,
            "`bench/detection.py`: synthetic corpus (periodic, flat, steps, warm-ups)",
        ),
        Promise(
            "Detection",
            "Leaks of ≥ 1 GiB/min found, at a 9 min window",
            f"median {median:.1f} min, worst {worst:.1f} min",
            "median ≤ 10 min",
            median <= 10,
            "`bench/detection.py`: 200 traces per rate, from the first poll and after history",
        ),
    ]


def alerts_promises(r: dict[str, Any]) -> list[Promise]:
    quality = r["quality"]["user"]
    ratios = [
        rule["ratio_min"]
        for by_rule in quality["fill_summary"].values()
        for name, rule in by_rule.items()
        if name.startswith("gpu_filling_up")
    ]
    non_growing = quality["non_growing_summary"]
    notified = sum(v["traces_notified"] for v in non_growing.values())
    traces = sum(v["traces"] for v in non_growing.values())
    cost = [v["share_of_interval_max"] for v in r["cost"].values()]
    return [
        Promise(
            "Alerts",
            "Filling-up notification lead, against a perfect oracle",
            f"≥ {min(ratios):.2f}× at every rate",
            "≥ 0.8×",
            min(ratios) >= 0.8,
            "`bench/alerts.py`: fake-GPU fills through ingest, rules and a real webhook",
        ),
        Promise(
            "Alerts",
            "No notification on memory that does not grow",
            f"{notified} of {traces} traces notified",
            "0",
            notified == 0,
            "`bench/alerts.py`: saw-tooth, warm-up and full-but-flat traces",
        ),
        Promise(
            "Alerts",
            "One evaluation over 8,000 GPUs, worst round",
            f"{max(cost):.1%} of the 15 s interval",
            "< 10%",
            max(cost) < 0.10,
            "`bench/alerts.py`: `AlertEngine.evaluate`, SQLite and Postgres",
        ),
    ]


def reaper_promises(r: dict[str, Any]) -> list[Promise]:
    t, history = r["time_to_freed"], r["history_memory"]
    return [
        Promise(
            "Reaper",
            "An uncooperative process is killed right after its grace period",
            f"{t['uncooperative']['ratio_to_grace_median']:.2f}× the grace "
            f"({t['grace_seconds']:.0f} s)",
            "—",
            None,
            "`bench/reaper.py`: real processes, SIGTERM ignored",
        ),
        Promise(
            "Reaper",
            "The agent's local history stays bounded",
            f"{history['rss_growth_mib']:.1f} MiB over {history['polls']:,} polls",
            f"≤ {history['goal_mib']} MiB",
            history["rss_growth_mib"] <= history["goal_mib"],
            "`bench/reaper.py`: 8 GPUs × 200 processes, a day of polls",
        ),
    ]


def dashboard_promises(r: dict[str, Any]) -> list[Promise]:
    target = r["targets"]["ratio_page_to_fleet_json"]
    out = []
    for kind in ("sqlite", "postgres"):
        render = r.get(kind, {}).get("render")
        if render:
            out.append(
                Promise(
                    "Dashboard",
                    f"Fleet page at {r[kind]['hosts']:,} hosts, {NAMES[kind]}",
                    f"{_ms(render['page']['median_ms'])}, "
                    f"{render['ratio_page_to_fleet_json']:.1f}× the JSON summary",
                    f"≤ {target}×",
                    render["ratio_page_to_fleet_json"] <= target,
                    "`bench/dashboard.py`: `GET /` against `GET /api/v1/fleet`",
                )
            )
    return out


READERS: dict[str, Callable[[dict[str, Any]], list[Promise]]] = {
    "load": load_promises,
    "server": server_promises,
    "agent": agent_promises,
    "detection": detection_promises,
    "alerts": alerts_promises,
    "reaper": reaper_promises,
    "dashboard": dashboard_promises,
}


def read_promises(name: str, result: dict[str, Any]) -> list[Promise]:
    try:
        return READERS[name](result)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        # A benchmark whose results changed shape: say so in the document, go on.
        return [
            Promise(
                name, f"results/{name}.json", f"not read: {type(err).__name__} {err}", "—",
                None, f"`bench/{name}.py`",
            )
        ]  # fmt: skip


# --- the document --------------------------------------------------------------------------


def _cpu_budget(r: dict[str, Any]) -> list[str]:
    """What the CPU target leaves for gpuwatch's own work, from the floor phase's two
    unavoidable parts (bench/load.py, ``bench_floor``)."""
    floor, one = r.get("floor", {}), r.get("sqlite", {}).get("one_server")
    validation = floor.get("validation")
    if not validation or not one or "raw_write_cpu_ms_per_snapshot" not in floor:
        return []
    per_request = floor["server_cpu_ms_per_request"]
    checked = validation["server_cpu_ms_per_request"]
    raw = floor["raw_write_cpu_ms_per_snapshot"]
    target = r["targets"]["cpu_ratio_to_floor"]
    left = target * per_request - checked - raw
    spent = one["server_cpu_ms_per_snapshot"] - checked - raw
    return [
        "",
        f"What the CPU target leaves, in the same run: the floor that also validates "
        f"each body with the published model (`bench/http_floor.py --validate`) took "
        f"{checked:.2f} ms a request ({checked / per_request:.1f}× the floor), and "
        f"writing a snapshot's rows with nothing else (its key, GPU and process rows; "
        f"stdlib sqlite3, {floor['raw_write_snapshots_per_transaction']} snapshots a "
        f"transaction) {raw:.2f} ms: together "
        f"{floor['unavoidable_ratio_to_floor']:.1f}× the floor. ≤ {target:g}× therefore "
        f"leaves {left:.2f} ms a snapshot for everything else the SQLite server does "
        f"(state, detectors, events, idempotency, transactions); it spent {spent:.2f} ms.",
        *_by_thread(one, per_request),
    ]


def _by_thread(one: dict[str, Any], per_request: float) -> list[str]:
    """The SQLite server's CPU split between its event loop and its other threads
    (the ingest writer above all), where the run measured it."""
    loop = one.get("server_event_loop_cpu_ms_per_snapshot")
    if loop is None:
        return []
    rest = one["server_cpu_ms_per_snapshot"] - loop
    return [
        "",
        f"By thread: the event loop (HTTP, routing, the token check, reading the body) "
        f"spent {loop:.2f} ms a snapshot ({loop / per_request:.1f}× the floor, which is "
        f"all event loop); the other threads, the ingest writer above all (validation, "
        f"state, detectors, the database), {rest:.2f} ms.",
    ]


def _load_tables(r: dict[str, Any]) -> list[str]:
    """The load benchmark's phases in full, with what limited them."""
    lines = [
        "### Ingest under load, phase by phase",
        "",
        f"Each simulated agent pushes one 8-GPU × 50-process snapshot "
        f"({r['body_bytes_per_snapshot'] / 1024:.0f} KiB of JSON) per push interval on a "
        "new connection, backing off on 503 as the real reporter does. CPU is measured "
        "with psutil on the server processes; *floor* is `bench/http_floor.py` (the same "
        "uvicorn, an app that reads the body and answers) driven by the same agents in "
        "the same run. *Others* is CPU used by everything else on the machine. Why the "
        "targets are missed, and where the server's time goes: "
        "[bench/README.md](../bench/README.md#load-benchloadpy).",
        "",
        # Provenance added to a results file after its run (which code it measured,
        # what was re-run since), shown as written.
        *[f"- {note}" for note in r.get("notes", [])],
        *([""] if r.get("notes") else []),
        "| Phase | Hosts | Offered | Accepted | p50 | p99 | Statuses | Server CPU / snapshot "
        "| × floor | Postgres CPU / snapshot | Generator | Others |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    phases = [("HTTP floor", r.get("floor"))]
    for kind in ("sqlite", "postgres"):
        for key, label in (
            ("one_server_default_cache", "one server, default state cache"),
            ("one_server", "one server"),
            ("two_replicas", "two replicas"),
        ):
            phases.append((f"{NAMES[kind]}, {label}", r.get(kind, {}).get(key)))
    for label, p in phases:
        if not p:
            continue
        settled = p.get("settled_first")
        if settled:  # what an earlier phase left spooled, drained before this one began
            spooled, seconds = settled["spooled_snapshots"], settled["seconds"]
            label += (
                f" (first drained {spooled:,} spooled snapshots in {seconds:,.0f} s)"
                if settled["drained"]
                else f" (began with {spooled:,} spooled snapshots not drained in {seconds:,.0f} s)"
            )
        cpu = p.get("server_cpu_ms_per_snapshot", p.get("server_cpu_ms_per_request"))
        share = p["cpu_share_of_one_core"]
        statuses = ", ".join(f"{k}: {v:,}" for k, v in p["statuses"].items())
        lines.append(
            f"| {label} | {p['hosts']:,} | {_rate(p['offered_snapshots_per_second'])} "
            f"| {_rate(p['snapshots_per_second'])} | {_ms(p['p50_ms'])} | {_ms(p['p99_ms'])} "
            f"| {statuses} | {cpu:.2f} ms | {p.get('cpu_ratio_to_floor', '—')} "
            f"| {p['postgres_cpu_ms_per_snapshot']:.2f} ms | {share['generator']:.2f} core "
            f"| {p.get('others_share_of_one_core', '—')} core |"
        )
    lines += _cpu_budget(r)
    storm = r.get("sqlite", {}).get("storm")
    if storm:
        s, live = storm["storm_requests"], storm["live"]
        drain = storm["drain_seconds"]
        lines += [
            "",
            f"Reconnect storm (SQLite): {storm['agents']:,} agents return at once with "
            f"{storm['spooled_per_agent']} spooled snapshots each while "
            f"{storm['live_hosts']:,} hosts keep pushing. Drained in "
            + (f"**{drain:,.0f} s**" if drain is not None else
               f"**not within {storm['cap_seconds']:,.0f} s** "
               f"({storm['drained_agents']:,} of {storm['agents']:,} agents)")
            + f" (half the agents within {storm['drain_seconds_p50_agent']} s); drain "
            f"requests {', '.join(f'{k}: {v:,}' for k, v in s['statuses'].items())}; live "
            f"pushes p50 {_ms(live['p50_ms'])}, p99 {_ms(live['p99_ms'])}, "
            f"{', '.join(f'{k}: {v:,}' for k, v in live['statuses'].items())}."
            + _unanswered(s, live),
        ]  # fmt: skip
    return lines


def _unanswered(*phases: dict[str, Any]) -> str:
    """Requests with no answer within the agent's 10 s (status -1), by how far they got."""
    stages: Counter[str] = Counter()
    for phase in phases:
        stages.update(phase.get("unanswered_by_stage", {}))
    if not stages:
        return ""
    said = ", ".join(f"{n:,} {stage}" for stage, n in sorted(stages.items()))
    return f" Status -1 is no answer within the agent's 10 s timeout: {said}."


def render(results: dict[str, dict[str, Any]], matrix: str | None) -> str:
    promises = [
        p for name in READERS if name in results for p in read_promises(name, results[name])
    ]
    lines = [
        "# Reliability: what gpuwatch promises, and how it was tested",
        "",
        "<!-- Generated by `python -m bench.reliability` from bench/results/*.json and",
        "     tests/faults/MATRIX.md. Do not edit: rerun the benchmarks, then regenerate. -->",
        "",
        "Every figure below was measured by a benchmark in `bench/` (see "
        "[bench/README.md](../bench/README.md) for the method and the findings) on the "
        "machine named with its results: 2 shared cores, so compare ratios rather than "
        "absolute times. A target marked **missed** is one gpuwatch does not meet yet.",
        "",
        "## Promises",
        "",
        "| Area | Promise | Measured | Target | Status | How it was tested |",
        "|---|---|---|---|---|---|",
    ]
    for p in promises:
        lines.append(
            f"| {p.area} | {p.promise} | {p.figure} | {p.target} | {_mark(p.met)} | {p.how} |"
        )
    met = sum(p.met is True for p in promises)
    missed = sum(p.met is False for p in promises)
    lines += ["", f"{met} targets met, {missed} missed.", ""]
    if "load" in results:
        lines += [*_load_tables(results["load"]), ""]
    lines += ["## Faults", ""]
    if matrix:
        lines += [_demote(matrix), ""]
    else:
        lines += ["The fault matrix (`tests/faults/MATRIX.md`) is not written yet.", ""]
    lines += ["## Where the figures come from", "", "| Result | Date | Machine |", "|---|---|---|"]
    for name, result in results.items():
        lines.append(f"| `bench/results/{name}.json` | {result.get('date', '?')} "
                     f"| {result.get('machine', '?')} |")  # fmt: skip
    lines += [
        "",
        "Regenerate: `./dev bench` (or one benchmark, `./dev bench load`), then "
        "`./dev bench reliability` (`.venv/bin/python -m bench.reliability`).",
        "",
    ]
    return "\n".join(lines)


def _demote(markdown: str) -> str:
    """The matrix's headings two levels down, under this document's ``## Faults``."""
    return "\n".join(
        "##" + line if line.startswith("#") else line for line in markdown.strip().splitlines()
    )


def read_results(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        path = RESULTS / f"{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def main(argv: Sequence[str] = ()) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reliability", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=DOC, help=f"default {DOC.relative_to(ROOT)}")
    args = parser.parse_args(list(argv))
    results = read_results(list(READERS))
    matrix = MATRIX.read_text() if MATRIX.exists() else None
    args.out.write_text(render(results, matrix))
    print(f"wrote {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
