"""The policy's cache over the server's history: kept answers, and a server that goes away.

The read API here is a stand-in at the protocol seam (``central.ReadApi``) that counts
calls and can be switched off; real HTTP is in ``test_auto_server.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from support.clock import FakeClock

from gpuwatch.agent.reaper.server_cache import CachedServerHistory
from gpuwatch.agent.reaper.server_reads import BucketRead, LifetimeRead, SamplesRead
from gpuwatch.errors import RemoteError

T0 = 1_800_000_000.0
START = T0 - 86400
LIFETIME = LifetimeRead(
    id=1,
    hostname="gpu-box",
    gpu_index=0,
    gpu_uuid="GPU-0",
    pid=4242,
    start_time=START,
    first_seen_at=T0 - 3 * 3600,
    last_seen_at=T0,
)


class Api:
    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    def processes(self, *, limit: int, **filters: Any) -> Sequence[LifetimeRead]:
        return self._answer([LIFETIME])

    def process_samples(
        self, lifetime_id: int, *, since: float | None = None, limit: int = 1440
    ) -> SamplesRead:
        buckets = [
            BucketRead(t=LIFETIME.first_seen_at + 60 * i, used_bytes=2**33, sm_ratio=0.0)
            for i in range(180)
        ]
        return self._answer(
            SamplesRead(lifetime=LIFETIME, sample_interval_seconds=60, samples=buckets)
        )

    def _answer(self, value: Any) -> Any:
        self.calls += 1
        if self.down:
            raise RemoteError("cannot reach the gpuwatch server at http://central: refused")
        return value


def _ask(cache: CachedServerHistory) -> list[Any] | None:
    lookup = cache.for_check("gpu-box")
    return lookup(gpu_index=0, gpu_uuid="GPU-0", pid=4242, start_time=START, since=T0 - 7200)


def test_answers_are_kept_for_the_refresh_period_then_asked_again() -> None:
    api, clock = Api(), FakeClock(T0)
    cache = CachedServerHistory(api, server_url="http://central", clock=clock)
    first = _ask(cache)
    assert first and first[0].activity == "idle" and api.calls == 2  # listing + samples
    for _ in range(9):
        clock.advance(60)
        assert _ask(cache) == first
    assert api.calls == 2 and cache.stats.cached == 9
    clock.advance(60)  # ten minutes on: asked again
    assert _ask(cache) == first and api.calls == 4


def test_a_server_that_goes_away_drops_what_it_said_and_is_asked_again_later() -> None:
    api, clock = Api(), FakeClock(T0)
    cache = CachedServerHistory(api, server_url="http://central", clock=clock)
    assert _ask(cache)
    clock.advance(600)  # the kept answer is stale: asked again, and the server is down
    api.down = True
    assert _ask(cache) is None and cache.stats.failures == 1 and len(cache) == 0
    calls = api.calls
    clock.advance(30)
    api.down = False
    assert _ask(cache) is None and api.calls == calls  # backing off: not asked, not idle
    clock.advance(30)
    assert _ask(cache) and cache.stats.failures == 1  # after a minute, asked again
