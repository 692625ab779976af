"""The agent's spooling half, run as a process of its own so a test can SIGKILL it.

    python killed_agent.py spool SPOOL_DIR FIRST_SEQUENCE
    python killed_agent.py reporter SPOOL_DIR FIRST_SEQUENCE SERVER_URL TOKEN

``spool``: appends snapshots of ~100 KB for ever, and every third append takes the
oldest three and acknowledges them, as the push thread does after a 2xx. ``reporter``:
the real reporter against a real server, offering and draining in a loop. Each step
is announced on stdout once it has returned (``A <seq>`` appended, ``k <seqs>`` before
an acknowledgement, ``K <seqs>`` after it), so the test knows what was durable when
the kill came. ``ready`` is printed once the spool is open.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import SecretStr

from gpuwatch.agent.reporter import Reporter
from gpuwatch.agent.spool import Spool
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

T0 = 1_800_000_000.0


def snapshot(sequence: int, *, processes: int) -> HostSnapshot:
    procs = [
        GpuProcess(
            pid=1000 + i, used_bytes=2**30, command=f"python train.py --rank {i} " + "x" * 3900
        )
        for i in range(processes)
    ]
    return HostSnapshot(
        agent_id="agent-host-1",
        hostname="host-1",
        boot_id="boot-1",
        sequence=sequence,
        collected_at=T0 + sequence,
        gpus=[Gpu(index=0, uuid="GPU-0", processes=procs)],
    )


def say(*words: object) -> None:
    print(*words, flush=True)


def run_spool(directory: Path, sequence: int) -> None:
    spool = Spool(directory, max_bytes=2**30)
    say("ready")
    while True:
        spool.append(snapshot(sequence, processes=25))  # ~100 KB: a write worth cutting
        say("A", sequence)
        sequence += 1
        if sequence % 3 == 0:
            batch = spool.peek_batch(3, 2**30)
            seqs = [json.loads(r.body)["sequence"] for r in batch]
            say("k", *seqs)
            spool.ack(batch)
            say("K", *seqs)


def run_reporter(directory: Path, sequence: int, url: str, token: str) -> None:
    settings = AgentSettings(
        server_url=url, token=SecretStr(token), spool_dir=directory, push_interval_seconds=1
    )
    reporter = Reporter(settings)
    say("ready")
    while True:
        reporter.offer(snapshot(sequence, processes=2))
        say("A", sequence)
        sequence += 1
        reporter.drain_once()


if __name__ == "__main__":
    mode, directory, first = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "spool":
        run_spool(directory, first)
    else:
        run_reporter(directory, first, sys.argv[4], sys.argv[5])
