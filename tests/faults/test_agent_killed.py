"""The agent SIGKILLed at random points while spooling and while pushing, many times.

A real process (``killed_agent.py``) runs the real spool (and, in the second test, the
real reporter against the real server), and is SIGKILLed after a random delay, then
started again on the same directory. It announces each step once it has returned, so
after every kill the test knows what was durable. The promise, checked after each
kill: the spool opens, every record in it is a whole snapshot, a write the kill cut
short is discarded and counted (at most one per kill), nothing confirmed is missing,
and nothing is there twice; across the pushes, the server stores nothing twice.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from support.clock import FakeClock

from faults.central import T0, central, reporter
from gpuwatch.agent.spool import Spool
from gpuwatch.snapshot import HostSnapshot

CHILD = Path(__file__).with_name("killed_agent.py")
KILLS = 25


@dataclass
class Log:
    """What the killed process said it had done, over all its lives."""

    appended: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    acking: set[int] = field(default_factory=set)  # an ack begun, maybe cut short

    def read(self, lines: list[str]) -> None:
        for line in lines:
            word, *numbers = line.split()
            seqs = {int(n) for n in numbers}
            if word == "A":
                self.appended |= seqs
            elif word == "k":
                self.acking |= seqs
            elif word == "K":
                self.acked |= seqs
                self.acking -= seqs

    @property
    def newest(self) -> int:
        return max(self.appended, default=-1)


def live_once(args: list[str], rng: random.Random) -> list[str]:
    """Start the child, let it run a random while after it is ready, SIGKILL it;
    everything it printed."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL, "the child died on its own"
        return child.stdout.read().splitlines()
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()


def test_killed_while_spooling_the_spool_always_opens_whole(tmp_path: Path) -> None:
    rng = random.Random(20260)
    spool_dir = tmp_path / "spool"
    log = Log()
    torn_total = 0
    for _ in range(KILLS):
        log.read(live_once(["spool", str(spool_dir), str(log.newest + 2)], rng))
        torn = sorted(p.name for p in spool_dir.glob("*.tmp"))
        assert len(torn) <= 1  # one append at a time: at most one cut short

        spool = Spool(spool_dir, max_bytes=2**30)  # what the restarted agent does first
        batch = spool.peek_batch(100_000, 2**40)
        spool.release(batch)
        present = [HostSnapshot.model_validate_json(r.body).sequence for r in batch]

        assert spool.dropped() == ({"corrupt": len(torn)} if torn else {})
        assert not list(spool_dir.glob("*.tmp"))
        assert len(present) == len(set(present)), "a snapshot spooled twice"
        assert present == sorted(present), "the spool is no longer first in, first out"
        missing = log.appended - log.acked - log.acking - set(present)
        assert not missing, f"confirmed appends lost: {sorted(missing)}"
        unconfirmed = set(present) - log.appended
        assert len(unconfirmed) <= 1  # written whole, killed before it said so
        assert not set(present) & log.acked, "an acknowledged record came back"
        spool.close()  # one agent per directory: the next child takes the lock
        torn_total += len(torn)
        log.appended |= unconfirmed
    assert len(log.appended) > KILLS * 2  # the kills came at many points, not at start-up
    # Some kills landed mid-write (about a third do): the torn-tail path was exercised.
    assert torn_total >= 1


def test_killed_while_pushing_the_server_stores_each_snapshot_once(tmp_path: Path) -> None:
    rng = random.Random(4242)
    spool_dir = tmp_path / "spool"
    clock = FakeClock(T0)
    with central(f"sqlite:///{tmp_path / 'central.db'}", tmp_path, clock) as server:
        clock.now = T0 + 10**6  # every snapshot the child makes is in the server's past
        token = server.token()
        log = Log()
        kills = 20
        for _ in range(kills):
            first = log.newest + 2
            log.read(live_once(["reporter", str(spool_dir), str(first), server.url, token], rng))
            assert len(list(spool_dir.glob("*.tmp"))) <= 1

        # The agent's next life drains what the killed ones left.
        final = reporter(server.url, token, spool_dir, clock)
        try:
            for _ in range(10):
                result = final.drain_once()
                if result.stopped_by is None:
                    break
                clock.advance(result.retry_in_seconds or 1)
            stats = final.stats()
        finally:
            final.close()
        stored = server.stored()

    sequences = {key[2] for key in stored}
    assert stats.pending == 0
    assert max(stored.values()) == 1, "a snapshot stored twice"
    assert log.appended <= sequences, f"lost: {sorted(log.appended - sequences)}"
    # Stored but never confirmed: appended whole just before a kill (one per kill at most).
    assert len(sequences - log.appended) <= kills
    # Torn tails were counted by the agent that found them, not silently swept.
    assert set(stats.dropped_total) <= {"corrupt"}
    assert len(log.appended) > kills
