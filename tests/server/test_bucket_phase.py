"""Each host's downsampling buckets have their own phase, so a fleet's buckets do not all
close in the same push interval (the heavy part of ingest; bench/README.md, load)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.server.ingest.apply import bucket_phase, host_bucket

T0 = 1_800_000_000.0  # a whole minute


def test_a_fleet_of_consecutive_host_ids_spreads_evenly_over_the_minute() -> None:
    phases = Counter(bucket_phase(host_id, 60.0) for host_id in range(1, 3001))

    # 3,000 hosts over 60 whole-second phases: 50 each, give or take a few.
    assert set(phases) == {float(s) for s in range(60)}
    assert max(phases.values()) - min(phases.values()) <= 4
    # So the hosts whose bucket closes in any 15 s push interval are a quarter, not all.
    closing = sum(phases[float(s)] for s in range(15))
    assert 700 <= closing <= 800


def test_the_phase_is_the_hosts_own_and_whole_seconds() -> None:
    assert bucket_phase(7, 60.0) == bucket_phase(7, 60.0)
    assert len({bucket_phase(host_id, 60.0) for host_id in range(1, 6)}) == 5
    assert all(bucket_phase(h, 60.0).is_integer() for h in range(1, 100))
    assert bucket_phase(3, 0.5) == 0.0  # under a second: no phase


@given(
    at=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    host_id=st.integers(min_value=1, max_value=2**31),
    interval=st.sampled_from([1.0, 2.0, 5.0, 60.0, 300.0, 0.25]),
)
def test_a_bucket_holds_its_time_and_follows_the_hosts_phase(
    at: float, host_id: int, interval: float
) -> None:
    start = host_bucket(at, host_id=host_id, interval=interval)

    assert start <= at < start + interval
    phase = bucket_phase(host_id, interval)
    assert 0 <= phase < max(interval, 1.0)
    assert (start - phase) / interval == round((start - phase) / interval)


def test_buckets_close_at_the_hosts_phase_not_the_minute() -> None:
    phase = bucket_phase(1, 60.0)
    assert phase > 0  # host 1 is not on the minute
    before = T0 + phase - 1
    assert host_bucket(before, host_id=1, interval=60.0) == T0 + phase - 60
    assert host_bucket(T0 + phase, host_id=1, interval=60.0) == T0 + phase
