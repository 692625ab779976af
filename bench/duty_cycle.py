"""Idle gaps: the same work, back to back against paced as a server at 200 /s sees it,
side by side in one run and one process.

bench/load.py measures the server's CPU a snapshot at 200 pushes a second, where the
server idles between pushes; bench/writer.py measures the writer with pushes back to
back. On this VM the same work costs about twice the CPU after the thread has slept a
few milliseconds (caches and the vCPU going cold while idle), which is why the load
figures are about twice the in-process ones. Two measurements, rounds taking turns:

* **unit**: validating one load body (bench/load.py's 8-GPU x 50-process snapshot) with
  the published model, repeated back to back, and with a sleep of each gap between
  repetitions. This is gpuwatch's first step on every push, and nothing else runs.
* **writer**: the app's ingest writer (no HTTP, bench/writer.py's ``Side``) storing every
  host's push one per transaction, back to back, and paced one every 5 ms (200 /s), each
  answered before the next arrives. Two databases filled the same way, one per mode.

Reported: this thread's (unit) or this process's (writer) CPU per unit of work, the
median over rounds, and its ratio to back to back.

    .venv/bin/python -m bench.duty_cycle            # about a minute and a half
    .venv/bin/python -m bench.duty_cycle --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.load import Template, batch_pieces
from bench.writer import Side
from gpuwatch.server.ingest.body import Deadline
from gpuwatch.wire import IngestRequest

GAPS_MS = (0.0, 0.5, 2.0, 5.0, 20.0)
PACE_SECONDS = 0.005  # 200 pushes a second, the load benchmark's offered rate


def bench_unit(rounds: int, per_round: int) -> dict[str, Any]:
    body = b"".join(batch_pieces(Template(), "duty-host", [(1, 1_700_000_000.0)]))
    IngestRequest.model_validate_json(body)  # warm: the model's validator is built lazily
    cpu: dict[float, list[float]] = {gap: [] for gap in GAPS_MS}
    for _ in range(rounds):
        for gap in GAPS_MS:
            spent = 0.0
            for _ in range(per_round):
                began = time.thread_time()
                IngestRequest.model_validate_json(body)
                spent += time.thread_time() - began
                if gap:
                    time.sleep(gap / 1000)
            cpu[gap].append(spent / per_round)
    base = statistics.median(cpu[0.0])
    return {
        "work": "IngestRequest.model_validate_json of one 8-GPU x 50-process body",
        "body_bytes": len(body),
        "rounds": rounds,
        "per_round": per_round,
        "by_gap_ms": {
            str(gap): {
                "cpu_ms": round(1000 * statistics.median(cpu[gap]), 4),
                "ratio_to_back_to_back": round(statistics.median(cpu[gap]) / base, 2),
            }
            for gap in GAPS_MS
        },
    }


def bench_writer(tmp: Path, *, hosts: int, rounds: int, warm: int) -> dict[str, Any]:
    template = Template()
    # One push a transaction in both modes, no linger: only the idle gaps differ.
    sides = {
        mode: Side(f"sqlite:///{tmp / mode}.db", tmp / mode, hosts, 0.0)
        for mode in ("back_to_back", "paced_200_per_second")
    }
    cpu: dict[str, list[float]] = {mode: [] for mode in sides}

    async def one_round(mode: str, side: Side, sequence: int) -> None:
        side.now = 1_700_000_000.0 + 15.0 * sequence
        bodies = [
            (bytearray(b"".join(batch_pieces(template, c.identity.hostname, [(sequence, side.now)]))), c)
            for c in side.credentials
        ]  # fmt: skip
        began_cpu, began = time.process_time(), time.perf_counter()
        for n, (raw, credential) in enumerate(bodies):
            if mode != "back_to_back":
                delay = began + n * PACE_SECONDS - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await side.writer.store(
                raw, credential, Deadline.after(3600, clock=time.monotonic), True
            )
        if sequence >= warm:
            cpu[mode].append((time.process_time() - began_cpu) / hosts)

    async def run() -> None:
        for sequence in range(warm + rounds):
            for mode, side in sides.items():
                await one_round(mode, side, sequence)

    asyncio.run(run())
    for side in sides.values():
        side.close()
    base = statistics.median(cpu["back_to_back"])
    return {
        "work": "one 8-GPU x 50-process push stored through the ingest writer, one a transaction",
        "hosts": hosts,
        "rounds": rounds,
        **{
            mode: {
                "cpu_ms_per_push": round(1000 * statistics.median(values), 3),
                "ratio_to_back_to_back": round(statistics.median(values) / base, 2),
            }
            for mode, values in cpu.items()
        },
    }


def main(argv: Sequence[str] = ()) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.duty_cycle", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(list(argv))
    unit_rounds, per_round = (3, 40) if args.quick else (8, 100)
    hosts, rounds, warm = (50, 4, 2) if args.quick else (200, 8, 4)
    print("-- unit", flush=True)
    result: dict[str, Any] = {"unit": bench_unit(unit_rounds, per_round)}
    print(f"   {result['unit']['by_gap_ms']}", flush=True)
    print("-- writer", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-duty-") as tmp_dir:
        result["writer"] = bench_writer(Path(tmp_dir), hosts=hosts, rounds=rounds, warm=warm)
    print(f"   {result['writer']}", flush=True)
    path = write_result("duty_cycle-quick" if args.quick else "duty_cycle", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
