"""Dashboard benchmark: the fleet page at 1,000 hosts x 8 GPUs.

The fleet of the server benchmark's fleet step (``bench/server.py``: 1,000 hosts of 8
GPUs and 50 processes each, populated through ingest, with open idle and orphaned
events), served by ``gpuwatch server`` in its own process on a fresh SQLite file (and
Postgres when it is reachable). Reported, side by side in the same run:

* render: median latency of ``GET /`` (8,000 tiles, every one with its holders and
  flags) against ``GET /api/v1/fleet`` (the JSON summary of the same fleet) on the same
  server, requests alternating; also each one's time to the response headers, which
  the server sends once the whole page is rendered. Goal: <= 2x. With ``--compare
  REF``, a second server runs the dashboard's code (``gpuwatch/server/web``) as
  committed at git ``REF`` with the rest of this checkout (so both read the schema
  they share) on the same database, and its page and summary join the alternation:
  before and after, side by side, on the same fleet. The run also checks whether the
  two pages are byte for byte the same, whether chromium draws the same tiles on both
  (each one's classes, link and text: the page's script draws them) and whether they
  have the same header.
* breakdown: where the page's time goes, measured in this process with this
  checkout's code on the same database (medians, milliseconds): the page's queries
  with their rows fetched and the header's totals (and, beside them, each query
  alone, and for reference what the page no longer reads: one row of values per GPU,
  and the per-GPU aggregate over the open lifetimes: ingest keeps each host's tiles
  on its row), writing the HTML, encoding it; next to the whole summary (its queries
  and its JSON) measured the same way. Also the page's and the summary's CPU time in this process
  (``*_cpu_ms``), which other work on a shared machine disturbs less; on SQLite it
  includes the database's own work, on Postgres it does not.
* paint: headless chromium (Debian's, through Selenium and chromedriver) loading ``/``
  from that server: time to first contentful paint and to the largest contentful
  paint (Chrome's successor to "first meaningful paint"), DOMContentLoaded and load,
  medians of several loads with the stylesheet and script cached, as a returning user
  has them. Reported, no target; skipped (saying why) without chromium.

Run: ``./dev bench dashboard`` or ``.venv/bin/python -m bench dashboard``; before and
after: ``.venv/bin/python -m bench.dashboard --compare HEAD``.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.common import write_result
from bench.server import (
    FLEET_HOSTS,
    GPUS,
    PROCS,
    ROOT,
    Target,
    fresh_database,
    history_base,
    make_tokens,
    postgres_unavailable,
    pushes,
    running_server,
    send,
)

SNAPSHOTS = 3  # per host, as the server benchmark's fleet step
REQUESTS = 40  # of each page, alternating
BREAKDOWN_RUNS = 15
PAINT_LOADS = 7
# A short idle window (and buckets to match), so the few snapshots per host open idle
# events through ingest and tiles carry flags, as in bench/server.py's fleet step. Each
# host pushes once, while populating, so with the default silence (4 intervals: 60 s)
# hosts turned silent one after the other during the run (populating alone can take
# longer), and the page measured late showed grey tiles the early one did not: silence
# comes after 4 hours here, so every measurement sees the same, reporting, fleet.
SETTINGS = {"idle_window_seconds": 30, "sample_interval_seconds": 15, "agent_silent_intervals": 960}
ENV = {f"GPUWATCH_SERVER_{name.upper()}": str(value) for name, value in SETTINGS.items()}
PAINT_SCRIPT = """
const done = arguments[arguments.length - 1];
let lcp = 0;
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) lcp = Math.max(lcp, entry.startTime);
}).observe({type: "largest-contentful-paint", buffered: true});
setTimeout(() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const fcp = performance.getEntriesByName("first-contentful-paint")[0];
  done({
    first_contentful_paint_ms: fcp ? fcp.startTime : null,
    largest_contentful_paint_ms: lcp || null,
    response_start_ms: nav.responseStart,
    response_end_ms: nav.responseEnd,
    dom_content_loaded_ms: nav.domContentLoadedEventEnd,
    load_ms: nav.loadEventEnd,
    tiles: document.querySelectorAll(".fleet .t").length,
  });
}, 500);
"""


def _timed(client: httpx.Client, path: str) -> tuple[float, float, int]:
    """Seconds to the response headers, seconds to the whole body, body bytes."""
    started = time.perf_counter()
    with client.stream("GET", path) as response:
        headers_at = time.perf_counter()
        body = response.read()
        response.raise_for_status()
    return headers_at - started, time.perf_counter() - started, len(body)


def bench_render(clients: dict[str, httpx.Client]) -> dict[str, Any]:
    """``clients``: "after" (this checkout), and "before" when comparing."""
    paths = {"page": "/", "fleet_json": "/api/v1/fleet"}
    sides = {
        (f"{name}_{side}" if side == "before" else name): (client, path)
        for side, client in clients.items()
        for name, path in paths.items()
    }
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
    for client, path in sides.values():  # warm: imports, caches, the first connection
        _timed(client, path)
    began = _cpu_now()
    for _ in range(REQUESTS):
        for name, (client, path) in sides.items():
            samples[name].append(_timed(client, path))
    out: dict[str, Any] = {"others_share_of_one_core": _others_share(began, _cpu_now())}
    for name, values in samples.items():
        full = [v[1] for v in values]
        out[name] = {
            "median_ms": round(statistics.median(full) * 1e3, 2),
            "p90_ms": round(statistics.quantiles(full, n=10)[-1] * 1e3, 2),
            "headers_median_ms": round(statistics.median(v[0] for v in values) * 1e3, 2),
            "bytes": values[-1][2],
        }
    for suffix in [""] + (["_before"] if "before" in clients else []):
        page, summary = out[f"page{suffix}"], out[f"fleet_json{suffix}"]
        out[f"ratio_page_to_fleet_json{suffix}"] = round(
            page["median_ms"] / summary["median_ms"], 2
        )
        out[f"ratio_headers{suffix}"] = round(
            page["headers_median_ms"] / summary["headers_median_ms"], 2
        )
    return out


def _cpu_now() -> tuple[float, float, dict[int, float]]:
    """Wall clock, the machine's busy CPU seconds, and the CPU seconds of each process
    that is part of the measurement: this one, the servers it started, Postgres."""
    import psutil

    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    me = psutil.Process()
    ours = [me, *me.children(recursive=True)]
    ours += [
        p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("postgres")
    ]
    cpu = {}
    for process in ours:
        with contextlib.suppress(psutil.Error):
            used = process.cpu_times()
            cpu[process.pid] = used.user + used.system
    return time.monotonic(), busy, cpu


def _others_share(
    began: tuple[float, float, dict[int, float]], ended: tuple[float, float, dict[int, float]]
) -> float:
    """CPU of everything else on the machine (other work sharing its cores) during the
    measurement, in cores."""
    ours = sum(cpu - began[2].get(pid, 0.0) for pid, cpu in ended[2].items())
    return round(max(0.0, ended[1] - began[1] - ours) / (ended[0] - began[0]), 2)


def bench_breakdown(target: Target) -> dict[str, Any]:
    """Where the page's time goes, step by step, in this process (this checkout's code,
    its own engine on the server's database): medians of :data:`BREAKDOWN_RUNS`."""
    from gpuwatch.server.fleet.service import fleet_summary, gpus_by_fullness, held_bytes
    from gpuwatch.server.web import tiles
    from gpuwatch.server.web.templates.fleet import fleet_page
    from gpuwatch.server.web.templates.layout import Chrome
    from gpuwatch.settings import ServerSettings

    settings = ServerSettings.model_validate(
        {**SETTINGS, "database_url": target.url, "scheduler": False}
    )
    database = target.database()
    holders = _holders_aggregate(database.dialect)
    steps: dict[str, list[float]] = {}

    def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        value = fn(*args, **kwargs)
        steps.setdefault(name, []).append(time.perf_counter() - started)
        return value

    size = 0
    try:
        for run in range(BREAKDOWN_RUNS + 1):  # the first warms caches, and is dropped
            if run == 1:
                steps.clear()
            now = time.time()
            chrome = Chrome(root="", now=now, firing=0, sign_out=False)
            with database.reader() as session:
                started, cpu = time.perf_counter(), time.process_time()
                fleet = timed(
                    "sql_ms", tiles.fleet_tiles, session=session, settings=settings, now=now
                )
                html = timed("render_ms", fleet_page, chrome, fleet)
                size = len(timed("encode_ms", html.encode))
                steps.setdefault("page_ms", []).append(time.perf_counter() - started)
                steps.setdefault("page_cpu_ms", []).append(time.process_time() - cpu)
            with database.reader() as session:
                connection = session.connection()
                timed("sql_hosts_alone_ms", tiles._fetch, connection, tiles._HOSTS)
                timed("sql_flagged_alone_ms", tiles._fetch, connection, tiles._FLAGGED)
            with database.reader() as session:
                timed(
                    "sql_fullness_alone_ms",
                    gpus_by_fullness,
                    session=session,
                    settings=settings,
                    now=now,
                )
            with database.reader() as session:
                timed("sql_held_alone_ms", held_bytes, session=session)
            with database.reader() as session:
                timed("sql_gpu_rows_ms", lambda: session.execute(_GPU_ROWS).all())
            with database.reader() as session:
                timed("sql_holders_aggregate_ms", lambda: session.execute(holders).all())
            with database.reader() as session:
                started, cpu = time.perf_counter(), time.process_time()
                summary = fleet_summary(session=session, settings=settings, now=now)
                summary.model_dump_json()
                steps.setdefault("fleet_json_ms", []).append(time.perf_counter() - started)
                steps.setdefault("fleet_json_cpu_ms", []).append(time.process_time() - cpu)
    finally:
        database.dispose()
    out: dict[str, Any] = {
        name: round(statistics.median(values) * 1e3, 1) for name, values in steps.items()
    }
    out["page_bytes"] = size
    out["ratio_page_to_fleet_json"] = round(out["page_ms"] / out["fleet_json_ms"], 2)
    out["ratio_cpu"] = round(out["page_cpu_ms"] / out["fleet_json_cpu_ms"], 2)
    return out


# For reference: what the page read until each host's tiles were kept on its row, one
# row of values per GPU (sorted by host and index).
_GPU_ROWS = text(
    "SELECT host_id, gpu_index, memory_total_bytes, memory_used_bytes, holder_user,"
    " holder_bytes, holder_processes, holder_users, open_flags FROM gpus"
    " ORDER BY host_id, gpu_index"
)


def _holders_aggregate(dialect: str) -> Any:
    """The per-GPU aggregate over the open lifetimes that the page ran until ingest kept
    each GPU's holders on its row (round 1's: on SQLite the largest's owner as a bare
    column of ``max()``, on Postgres the first of the owners ordered by size): what
    keeping them saves each request, for reference."""
    from sqlalchemy import func, select
    from sqlalchemy.dialects.postgresql import aggregate_order_by, array_agg

    from gpuwatch.server.hosts.models import Host
    from gpuwatch.server.processes.models import ProcessLifetime as Life

    owner: Any = Life.user
    if dialect != "sqlite":
        owner = array_agg(
            aggregate_order_by(Life.user, Life.current_bytes.desc().nulls_last(), Life.id)
        )[1]
    return (
        select(Life.gpu_id, owner, func.max(Life.current_bytes), func.count(),
               func.count(Life.user.distinct()))
        .where(Life.host_id.in_(select(Host.id)), Life.ended_at.is_(None))
        .group_by(Life.gpu_id)
    )  # fmt: skip


@contextlib.contextmanager
def _chromium() -> Iterator[Any]:
    """Headless Debian chromium through Selenium and chromedriver; None (saying why in
    :data:`_NO_CHROMIUM`) when either is missing."""
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        binary = None
    if binary is None or driver_path is None:
        yield None
        return
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1440,1000", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


_NO_CHROMIUM = "chromium, chromedriver or selenium not installed"


def bench_paint(url: str) -> dict[str, Any]:
    with _chromium() as driver:
        if driver is None:
            return {"skipped": _NO_CHROMIUM}
        driver.get(url)  # the first load fetches the stylesheet and script
        loads = []
        for _ in range(PAINT_LOADS):
            driver.get("about:blank")
            driver.get(url)
            loads.append(driver.execute_async_script(PAINT_SCRIPT))
        version = driver.capabilities.get("browserVersion")
    out: dict[str, Any] = {"browser": f"chromium {version}", "loads": PAINT_LOADS}
    for key in loads[0]:
        values = [load[key] for load in loads if load[key] is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    return out


def dashboard_at(ref: str, into: Path) -> Path:
    """This checkout's ``gpuwatch`` package, its ``server/web`` as committed at ``ref``."""
    shutil.copytree(
        ROOT / "gpuwatch", into / "gpuwatch", ignore=shutil.ignore_patterns("__pycache__")
    )
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "gpuwatch/server/web"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _page(client: httpx.Client) -> str:
    """The fleet page, less the time it was rendered at (in the footer)."""
    response = client.get("/")
    response.raise_for_status()
    return re.sub(r"Rendered [^(]*\(UTC\)", "Rendered", response.text)


_SUMMARY = re.compile(r'<section class="summary">.*?</section>', re.S)
_HOST_TILES = re.compile(r' data-t="([^"]*)"')


def _tile_count(page: str) -> int:
    """How many tiles the page has: in its host cards' data (drawn by its script), or,
    as older pages had them, in its markup."""
    cards = _HOST_TILES.findall(page)
    if cards:
        return sum(len(json.loads(html.unescape(tiles))) for tiles in cards)
    return page.count('<a class="t ')


def _drawn_tiles(url: str) -> list[tuple[str, str, str]] | None:
    """Every tile as chromium shows the page at ``url`` once its script ran (classes,
    link, text), to compare two versions of the page whose markup differs; None
    without chromium."""
    with _chromium() as driver:
        if driver is None:
            return None
        driver.get(url)
        tiles: list[list[str]] = driver.execute_script(
            "return Array.from(document.querySelectorAll('.fleet a.t'), function (t) {"
            " return [t.className, t.getAttribute('href'), t.textContent]; });"
        )
    return [(css, href, label) for css, href, label in tiles]


def bench_kind(kind: str, tmp: Path, before: Path | None) -> dict[str, Any]:
    with fresh_database(kind, tmp, "dashboard") as target, contextlib.ExitStack() as stack:
        tokens = make_tokens(target, [f"fleet-{i}" for i in range(FLEET_HOSTS)])
        client = stack.enter_context(running_server(target, tmp, env=ENV))
        began = time.perf_counter()
        send(
            client,
            pushes(tokens, first=0, per_host=1, batch=SNAPSHOTS, base=history_base(SNAPSHOTS)),
        )
        populate_seconds = time.perf_counter() - began
        summary = client.get("/api/v1/fleet").json()
        if summary["hosts"] != FLEET_HOSTS or summary["gpus"] != FLEET_HOSTS * GPUS:
            raise RuntimeError(f"the fleet is not what was ingested: {summary}")
        clients = {"after": client}
        if before is not None:  # the same database, read by the code at REF
            clients["before"] = stack.enter_context(
                running_server(target, tmp, code=before, env=ENV)
            )
        pages = {side: _page(each) for side, each in clients.items()}
        tiles = _tile_count(pages["after"])
        if tiles != FLEET_HOSTS * GPUS:
            raise RuntimeError(f"the page shows {tiles} tiles, not {FLEET_HOSTS * GPUS}")
        render = bench_render(clients)
        silent = client.get("/api/v1/fleet").json()["silent_hosts"]
        if silent:
            raise RuntimeError(f"{len(silent)} hosts turned silent during the measurement")
        result: dict[str, Any] = {
            "hosts": summary["hosts"],
            "gpus": summary["gpus"],
            "tiles": tiles,
            "populate_seconds": round(populate_seconds, 1),
            "render": render,
            "breakdown": bench_breakdown(target),
        }
        if before is not None:
            result["same_page_before_and_after"] = pages["before"] == pages["after"]
            drawn = {side: _drawn_tiles(str(each.base_url) + "/") for side, each in clients.items()}
            result["same_tiles_before_and_after"] = (
                None if drawn["after"] is None else drawn["before"] == drawn["after"]
            )
            headers = {side: _SUMMARY.search(page) for side, page in pages.items()}
            result["same_header_before_and_after"] = all(headers.values()) and (
                headers["before"].group(0) == headers["after"].group(0)  # type: ignore[union-attr]
            )
        if kind == "sqlite":
            result["paint"] = bench_paint(str(client.base_url) + "/")
    return result


def main(compare: str | None = None) -> dict[str, Any]:
    kinds = ["sqlite"]
    skipped = postgres_unavailable()
    if skipped is None:
        kinds.append("postgres")
    else:
        print(f"skipping Postgres: {skipped}", flush=True)
    result: dict[str, Any] = {"shape": {"hosts": FLEET_HOSTS, "gpus": GPUS, "processes": PROCS}}
    if skipped:
        result["postgres_skipped"] = skipped
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-dashboard-") as tmp_dir:
        tmp = Path(tmp_dir)
        before = None
        if compare:
            before = dashboard_at(compare, tmp / "before")
            commit = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", compare],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            result["compare"] = {"ref": compare, "commit": commit}
        for kind in kinds:
            started = time.monotonic()
            print(f"-- dashboard on {kind}", flush=True)
            result[kind] = bench_kind(kind, tmp, before)
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
    result["targets"] = {"ratio_page_to_fleet_json": 2.0}
    path = write_result("dashboard", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compare", metavar="REF", help="also serve the page with the code at git REF (before)"
    )
    main(compare=parser.parse_args().compare)
