"""Dashboard benchmark: the fleet page at 1,000 hosts x 8 GPUs.

The fleet of the server benchmark's fleet step (``bench/server.py``: 1,000 hosts of 8
GPUs and 50 processes each, populated through ingest, with open idle and orphaned
events), served by ``gpuwatch server`` in its own process on a fresh SQLite file (and
Postgres when it is reachable). Reported, side by side in the same run:

* render: median latency of ``GET /`` (8,000 tiles, every one with its holders and
  flags) against ``GET /api/v1/fleet`` (the JSON summary of the same fleet) on the same
  server, requests alternating; also each one's time to the response headers, which
  the server sends once the whole page is rendered. Goal: <= 2x.
* paint: headless chromium (Debian's, through Selenium and chromedriver) loading ``/``
  from that server: time to first contentful paint and to the largest contentful
  paint (Chrome's successor to "first meaningful paint"), DOMContentLoaded and load,
  medians of several loads with the stylesheet and script cached, as a returning user
  has them. Reported, no target; skipped (saying why) without chromium.

Run: ``./dev bench dashboard`` or ``.venv/bin/python -m bench dashboard``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_result
from bench.server import (
    FLEET_HOSTS,
    GPUS,
    PROCS,
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
PAINT_LOADS = 7
# A short idle window (and buckets to match), so the few snapshots per host open idle
# events through ingest and tiles carry flags, as in bench/server.py's fleet step.
ENV = {"GPUWATCH_SERVER_IDLE_WINDOW_SECONDS": "30", "GPUWATCH_SERVER_SAMPLE_INTERVAL_SECONDS": "15"}
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


def bench_render(client: httpx.Client) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float, int]]] = {"page": [], "fleet_json": []}
    paths = {"page": "/", "fleet_json": "/api/v1/fleet"}
    for path in paths.values():  # warm: imports, caches, the first connection
        _timed(client, path)
    for _ in range(REQUESTS):
        for name, path in paths.items():
            samples[name].append(_timed(client, path))
    out: dict[str, Any] = {}
    for name, values in samples.items():
        full = [v[1] for v in values]
        out[name] = {
            "median_ms": round(statistics.median(full) * 1e3, 2),
            "p90_ms": round(statistics.quantiles(full, n=10)[-1] * 1e3, 2),
            "headers_median_ms": round(statistics.median(v[0] for v in values) * 1e3, 2),
            "bytes": values[-1][2],
        }
    out["ratio_page_to_fleet_json"] = round(
        out["page"]["median_ms"] / out["fleet_json"]["median_ms"], 2
    )
    out["ratio_headers"] = round(
        out["page"]["headers_median_ms"] / out["fleet_json"]["headers_median_ms"], 2
    )
    return out


def bench_paint(url: str) -> dict[str, Any]:
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver_path is None:
        return {"skipped": "chromium or chromedriver not installed"}
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return {"skipped": "selenium not installed"}
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1440,1000", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.set_script_timeout(30)
        driver.get(url)  # the first load fetches the stylesheet and script
        loads = []
        for _ in range(PAINT_LOADS):
            driver.get("about:blank")
            driver.get(url)
            loads.append(driver.execute_async_script(PAINT_SCRIPT))
        version = driver.capabilities.get("browserVersion")
    finally:
        driver.quit()
    out: dict[str, Any] = {"browser": f"chromium {version}", "loads": PAINT_LOADS}
    for key in loads[0]:
        values = [load[key] for load in loads if load[key] is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    return out


def bench_kind(kind: str, tmp: Path) -> dict[str, Any]:
    with fresh_database(kind, tmp, "dashboard") as target:
        tokens = make_tokens(target, [f"fleet-{i}" for i in range(FLEET_HOSTS)])
        with running_server(target, tmp, env=ENV) as client:
            began = time.perf_counter()
            send(
                client,
                pushes(tokens, first=0, per_host=1, batch=SNAPSHOTS, base=history_base(SNAPSHOTS)),
            )
            populate_seconds = time.perf_counter() - began
            summary = client.get("/api/v1/fleet").json()
            if summary["hosts"] != FLEET_HOSTS or summary["gpus"] != FLEET_HOSTS * GPUS:
                raise RuntimeError(f"the fleet is not what was ingested: {summary}")
            page = client.get("/").text
            tiles = page.count('<a class="t ')
            if tiles != FLEET_HOSTS * GPUS:
                raise RuntimeError(f"the page shows {tiles} tiles, not {FLEET_HOSTS * GPUS}")
            result: dict[str, Any] = {
                "hosts": summary["hosts"],
                "gpus": summary["gpus"],
                "tiles": tiles,
                "populate_seconds": round(populate_seconds, 1),
                "render": bench_render(client),
            }
            if kind == "sqlite":
                result["paint"] = bench_paint(str(client.base_url) + "/")
    return result


def main() -> dict[str, Any]:
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
        for kind in kinds:
            started = time.monotonic()
            print(f"-- dashboard on {kind}", flush=True)
            result[kind] = bench_kind(kind, Path(tmp_dir))
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
    result["targets"] = {"ratio_page_to_fleet_json": 2.0}
    path = write_result("dashboard", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
