"""Growth in steps, and steps that are not growth, at spacings the first tests missed.

A detector audit (2026-12-07) found three classes, each at every alignment tried:

* flat workers (or an allocator's chunks) arriving every four minutes onto a GPU got no
  filling-up verdict at all: the chunk before always lay among the buckets whose rises
  ``stepped_now`` takes for noise, so no chunk stood out (spacings of 2, 5 and 8 minutes
  were tested, and pass either way);
* a staircase with steps 9 or 10 minutes apart (W/3, which the docs call growth)
  closed its leak and filling-up verdicts for a bucket after every step and opened new
  ones: 13 events in 150 minutes. The recent rate compared two stretches whose starts
  were 2W/9 apart, with no step between them;
* a warm-up that had levelled off, then one evaluation pass that took 3 GiB for a minute
  or three: the pass was a step in the newest bucket, the warm-up still held the
  window's line and recent rate up, and filling-up opened on a flat GPU minutes later.

Times are injected; polls go through ``bucketize`` and the detectors run at every bucket
close, as the server runs them.
"""

from __future__ import annotations

import pytest
from detectors.test_audit_classes import _filling_opened, _filling_replay
from detectors.test_properties import polls
from detectors.test_sparse_buckets import PHASES, _lapses, growth_verdicts, pushes

MIB, GIB, MINUTE = 2**20, 2**30, 60.0
TOTAL = 80 * GIB


@pytest.mark.parametrize("offset", [0.0, 13.0, 29.0, 41.0, 53.0])
@pytest.mark.parametrize(
    ("every_minutes", "chunk_gib"), [(3, 1.5), (3.5, 2), (4, 2), (4.5, 2), (6, 3), (9, 4)]
)
def test_chunks_a_few_minutes_apart_open_filling_up_once_and_hold_it(
    offset: float, every_minutes: float, chunk_gib: float
) -> None:
    def used(t: float) -> float:
        return 4 * GIB + chunk_gib * GIB * ((t + offset) // (every_minutes * MINUTE))

    full_at = (TOTAL - 4 * GIB) / (chunk_gib * GIB) * every_minutes  # minutes
    samples = polls(used, every=15.0, minutes=full_at - 2, seed=int(offset), noise=16 * MIB)
    replay = list(_filling_replay(samples, {1: samples}, total=TOTAL))
    opened = [minutes for minutes, _, opens in replay if opens]
    # It opens a bucket after a chunk (the chunk has held) once the GPU is full within
    # the two-hour horizon: at one of the next three chunks, since the window's slope
    # of a staircase moves by a tenth with the chunks' phase. Then it stays open.
    due = full_at - 120 + 3 * every_minutes + 2
    assert len(opened) == 1 and opened[0] <= max(due, 40.0), (opened, due)
    assert all(finding is not None for minutes, finding, _ in replay if minutes >= opened[0])


@pytest.mark.parametrize("phase", PHASES[::3])
@pytest.mark.parametrize("gap_minutes", [7.0, 8.5, 9.0, 9.5, 10.0])
def test_a_staircase_up_to_a_third_of_the_window_apart_is_one_event(
    phase: float, gap_minutes: float
) -> None:
    """4 GiB every ``gap_minutes``, never freed, pushed every 15 s: one leak and one
    filling-up event for the whole climb, no lapse between steps."""

    def used(t: float) -> float:
        return 2 * GIB + 4 * GIB * (1 + (t - 5 * MINUTE) // (gap_minutes * MINUTE))

    times = pushes(15.0, 130 * MINUTE, phase=phase)
    verdicts = list(growth_verdicts(times, used, bucket=60.0, window=1800.0))
    assert any(leak for _, leak, _ in verdicts) and any(fill for _, _, fill in verdicts)
    assert _lapses(verdicts) == {}, (gap_minutes, phase)


@pytest.mark.parametrize("offset", [0.0, 17.0, 38.0])
@pytest.mark.parametrize("ramp_minutes", [8, 12, 16])
@pytest.mark.parametrize(
    ("warm_up_gib", "pass_gib", "pass_seconds", "delay_minutes"),
    [(60, 3, s, d) for s in (40, 90, 180) for d in (4, 6, 8, 10)]
    + [(40, 8, 40, d) for d in (6, 8, 10)],
)
def test_an_evaluation_pass_after_a_warm_up_levelled_off_opens_no_filling_up(
    offset: float,
    ramp_minutes: int,
    warm_up_gib: int,
    pass_gib: int,
    pass_seconds: int,
    delay_minutes: int,
) -> None:
    """10 GiB held for an hour, a warm-up of ``warm_up_gib``, flat; ``delay_minutes`` later one
    pass takes ``pass_gib`` for ``pass_seconds`` and frees it. No verdict may open more
    than about three buckets after the memory stopped rising (docs/detection.md). The
    8 GiB passes opened when a step was judged in the bucket it came in; one that holds
    for over a bucket and matches the window's growth since is a known gap."""
    start = 60 * MINUTE + offset
    stop = start + ramp_minutes * MINUTE
    spike = stop + delay_minutes * MINUTE

    def used(t: float) -> float:
        level = 10 * GIB + warm_up_gib * GIB * min(max(t - start, 0.0) / (stop - start), 1.0)
        return level + (pass_gib * GIB if spike <= t < spike + pass_seconds else 0.0)

    samples = polls(used, every=15.0, minutes=(spike + 600) / MINUTE, seed=7, noise=8 * MIB)
    opened = _filling_opened(samples, window=1800.0, total=TOTAL)
    grace = (stop + 3.5 * MINUTE) / MINUTE
    assert [m for m in opened if m > grace] == [], (opened, grace)
