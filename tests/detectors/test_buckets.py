"""bucketize: the server's downsampling rule (apply.py, ``_observe`` and ``_busiest``)."""

from __future__ import annotations

import random

import pytest

from gpuwatch.detectors import Sample, bucketize

GIB = 2**30
T0 = 1_700_000_040.0  # a multiple of 60: the first bucket starts here


def test_a_bucket_keeps_its_start_lowest_highest_and_busiest() -> None:
    polls = [
        Sample(T0 + 5, 6 * GIB, 0.0),
        Sample(T0 + 20, 4 * GIB, 0.7),
        Sample(T0 + 35, 9 * GIB, 0.2),
        Sample(T0 + 61, 5 * GIB, 0.0),
    ]
    assert bucketize(polls, 60) == [
        Sample(T0, 4 * GIB, 0.7, 9 * GIB),
        Sample(T0 + 60, 5 * GIB, 0.0, 5 * GIB),
    ]


def test_buckets_are_left_closed_and_empty_ones_are_absent() -> None:
    polls = [Sample(T0 + 60, 1, 0.1), Sample(T0 + 300, 2, 0.1)]
    assert [b.t for b in bucketize(polls, 60)] == [T0 + 60, T0 + 300]


@pytest.mark.parametrize(
    ("ratios", "busiest"),
    [
        ([0.0, 0.0], 0.0),  # idle only when every poll was seen idle
        ([0.0, None], None),  # one unknown poll makes the bucket unknown...
        ([None, 0.3, 0.0], 0.3),  # ...unless there was activity, which always wins
        ([None, None], None),
    ],
)
def test_sm_activity_wins_and_unknown_is_never_idle(
    ratios: list[float | None], busiest: float | None
) -> None:
    polls = [Sample(T0 + i, GIB, r) for i, r in enumerate(ratios)]
    assert bucketize(polls, 60)[0].sm_ratio == busiest


def test_unknown_memory_never_counts_as_zero() -> None:
    polls = [Sample(T0, None, 0.1), Sample(T0 + 10, 3 * GIB, 0.1), Sample(T0 + 20, None, 0.1)]
    assert bucketize(polls, 60) == [Sample(T0, 3 * GIB, 0.1, 3 * GIB)]
    assert bucketize([Sample(T0, None, None)], 60) == [Sample(T0, None, None, None)]


def test_a_polls_own_peak_counts_so_buckets_can_be_rebucketed() -> None:
    fine = [Sample(T0, 2 * GIB, 0.1, 7 * GIB), Sample(T0 + 30, 3 * GIB, 0.4, 4 * GIB)]
    start = T0 - 240  # the 300 s bucket holding T0 and T0 + 30
    assert bucketize(fine, 300) == [Sample(start, 2 * GIB, 0.4, 7 * GIB)]


def test_with_now_only_closed_buckets_are_returned() -> None:
    polls = [Sample(T0 + s, GIB, 0.1) for s in (0, 30, 60, 90, 130)]
    assert [b.t for b in bucketize(polls, 60, now=T0 + 125)] == [T0, T0 + 60]
    # The poll that opens a new bucket closes the one before it, as on the server.
    assert [b.t for b in bucketize(polls, 60, now=T0 + 120)] == [T0, T0 + 60]
    assert [b.t for b in bucketize(polls, 60, now=T0 + 119.9)] == [T0]
    assert [b.t for b in bucketize(polls, 60)] == [T0, T0 + 60, T0 + 120]


def test_input_order_does_not_matter() -> None:
    rng = random.Random(3)
    polls = [Sample(T0 + rng.uniform(0, 900), rng.randrange(GIB), rng.random()) for _ in range(200)]
    shuffled = polls[:]
    rng.shuffle(shuffled)
    assert bucketize(shuffled, 60) == bucketize(sorted(polls), 60)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        bucketize([], 0)


def test_the_same_rule_as_ingest() -> None:
    # Fold the server's own accumulators over random polls, as ``_observe`` does.
    from gpuwatch.server.ingest.apply import _busiest, _max, _min

    rng = random.Random(11)
    for _ in range(200):
        polls = [
            Sample(
                T0 + rng.uniform(0, 59),
                rng.choice([None, rng.randrange(8 * GIB)]),
                rng.choice([None, 0.0, 0.0, rng.random()]),
            )
            for _ in range(rng.randint(1, 6))
        ]
        low = high = polls[0].used_bytes
        busiest = polls[0].sm_ratio
        for poll in polls[1:]:
            low, high = _min(low, poll.used_bytes), _max(high, poll.used_bytes)
            busiest = _busiest(busiest, poll.sm_ratio)
        assert bucketize(polls, 60) == [Sample(T0, low, busiest, high)]
