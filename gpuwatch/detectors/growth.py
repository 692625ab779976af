"""Is memory growing, or only moving? The evidence behind the leak and filling-up verdicts.

Memory that breathes (training steps, evaluation phases, the caching allocator) can look
like growth on any short stretch, and sampling makes it worse: polls that are nearly in
step with a period walk slowly along the waveform, so per-bucket floors creep upward for
hours (a 60 s saw-tooth pushed every 15.002 s). What sampling cannot do is leave the
signal's envelope: every poll of a periodic signal lies in ``[lowest, highest]``. So
growth is shown here only as **the current floor standing above the peaks seen
earlier**, with the spans arranged so that no periodic signal can pass:

* C, the *current* span, is the newest ``c`` seconds of the window; its floor is the
  lowest bucket floor (``used_bytes``) in it.
* E, the *reference* span, runs from the window's start to ``2c`` before its end; its
  peak is the highest bucket peak (``peak_bytes``) in it.
* If the memory repeated with a period ``P <= c``, C holds a whole period and its floor
  is the signal's lowest value, which no peak is below. If ``c < P <= window``, every
  time ``u`` in C has ``u - P`` inside E, where the memory was the same: the floor of C
  is at most that value, hence at most E's peak. Either way ``floor(C) <= peak(E)``.
  So ``clearance = floor(C) - peak(E) > 0`` proves the window holds no signal that
  repeats within the window's length, at any phase, duty or waveform, provided the
  polls resolve it (a bucket spans at least two polls). A period shorter than twice the
  poll interval is seen as its alias, ``1 / |1/P - k/interval|``, which drift can make
  arbitrarily slow, and jitter that accumulates from poll to poll turns into a random
  walk along the waveform: the guarantee holds for the alias's period, with jitter
  around a schedule (docs/detection.md measures both cases outside it).

Every split ``c`` (up to half the window) is a proof of its own; the one with the most
clearance is reported. Clearance alone would also pass a single step (a second model
loaded), a ramp that has since levelled off, or noise; so the floors of :data:`SPANS`
equal spans of the window must also follow a rising line (Theil–Sen slope and its
``r²``: a single step explains at most 75% of the variance, so ``r²`` of at least
:data:`R_SQUARED_MIN` needs two steps or more), move upward far more than downward
(:data:`MONOTONIC_MIN`), and rise at least at the caller's minimum slope. A verdict is
given only when every one of these numbers says so; all are in the evidence, with
their thresholds.

Cost: O(n log n) to order the newest :data:`MAX_SAMPLES` samples (O(n) when already in
order), O(n) for the clearance and the span floors, and a constant for the fit over at
most :data:`SPANS` points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from gpuwatch.detectors.buckets import bucket_width
from gpuwatch.detectors.types import Sample

# Newest samples considered: far longer than any window the server asks about (17 h
# of 60 s buckets is its own cap), and it bounds the work on a hostile history.
MAX_SAMPLES = 10_000
# Fewer samples than this cannot show a trend worth naming.
MIN_SAMPLES = 8
# Spans for the fit: 16 spans of a 30 min window are ~2 min, so each span floor is
# the quiet moment of any cycle up to that long, and the line has 16 points at most.
SPANS = 16
# A single step fitted by a line leaves r² <= 0.75 (3a(1-a) for a step at fraction a);
# two steps or more, or steady growth, reach 0.8.
R_SQUARED_MIN = 0.8
# Upward share of the span floors' movement in bytes: 0.5 is a random walk, 1 a ramp.
MONOTONIC_MIN = 0.8
# The wider spans' fit (see _halved) must be nearly a line: half as many floors show a
# step that straddles a span, or noise, as a ramp more easily than the finer ones do.
WIDER_R_SQUARED_MIN = 0.95
WIDER_MONOTONIC_MIN = 0.95
# Below this, "above the earlier peaks" is NVML's rounding, not evidence.
CLEARANCE_MIN_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Growth:
    """What :func:`measure_growth` found in one window. Times are epoch seconds, sizes
    bytes, ``slope`` bytes per second."""

    window_start: float
    window_end: float
    samples: int
    newest_bytes: int
    slope: float
    r_squared: float
    monotonic_fraction: float
    current_floor_bytes: int
    current_seconds: float
    reference_peak_bytes: int
    reference_floor_bytes: int
    reference_end: float
    # How many span floors the line was fitted to: SPANS, or half as many wider ones
    # where those follow the line better (see _halved).
    spans: int = SPANS
    # The span floors that line was fitted to, oldest first (for failed_check's newer
    # half).
    floors: tuple[tuple[float, int], ...] = ()

    @property
    def window_seconds(self) -> float:
        return self.window_end - self.window_start

    @property
    def clearance_bytes(self) -> int:
        """How far the current floor stands above the reference span's highest peak."""
        return self.current_floor_bytes - self.reference_peak_bytes

    @property
    def net_growth_bytes(self) -> int:
        """How far the floor rose from the reference span to the current one."""
        return self.current_floor_bytes - self.reference_floor_bytes

    @property
    def envelope_bytes(self) -> int:
        """The reference span's spread, highest peak minus lowest floor."""
        return self.reference_peak_bytes - self.reference_floor_bytes

    @property
    def separation(self) -> float:
        """Clearance over net growth: the share of the rise that lies beyond the envelope."""
        net = self.net_growth_bytes
        return self.clearance_bytes / net if net > 0 else 0.0

    def failed_check(
        self, min_slope_bytes_per_second: float, *, already_open: bool = False
    ) -> str | None:
        """The first piece of evidence that speaks against growth, or None if none does.

        For a verdict ``already_open``, the shape (r², upward share) may hold over the
        newer half of the span floors instead of all of them. Growth that began inside
        the window is a hinge, flat then rising, and a line through a hinge fits it
        worse as the robust slope moves from the blend to the rise's own: r² dipped
        below its minimum for one bucket a third of the way through (0.80, 0.87, 0.80,
        0.91), closing a verdict on a steady 1 GiB/min leak and opening a second one a
        minute later. The newer half of such a window is all rise. Opening still needs
        the whole window's shape.
        """
        if self.clearance_bytes <= CLEARANCE_MIN_BYTES:
            return "clearance"
        if self.slope <= 0 or self.slope < min_slope_bytes_per_second:
            return "slope"
        failed = None
        if self.r_squared < R_SQUARED_MIN:
            failed = "r_squared"
        elif self.monotonic_fraction < MONOTONIC_MIN:
            failed = "monotonic_fraction"
        if failed and already_open and self._newer_half_holds(min_slope_bytes_per_second):
            return None
        return failed

    def _newer_half_holds(self, min_slope_bytes_per_second: float) -> bool:
        newer = list(self.floors[len(self.floors) // 2 :])
        if len(newer) < MIN_SAMPLES // 2:
            return False
        slope, r_squared, monotonic, _ = _fit(newer)
        return (
            slope > 0
            and slope >= min_slope_bytes_per_second
            and r_squared >= R_SQUARED_MIN
            and monotonic >= MONOTONIC_MIN
        )

    @property
    def confidence(self) -> float:
        """The weakest of three scores, each 0 at its threshold and 1 when perfect (0..1):
        the fit, ``(r² - R_SQUARED_MIN) / (1 - R_SQUARED_MIN)``; the order, likewise for
        the monotonic fraction; and the separation, the share of the floor's rise that
        lies beyond the reference envelope (clearance / net growth)."""
        scores = (
            (self.r_squared - R_SQUARED_MIN) / (1 - R_SQUARED_MIN),
            (self.monotonic_fraction - MONOTONIC_MIN) / (1 - MONOTONIC_MIN),
            self.separation,
        )
        return min(1.0, max(0.0, min(scores)))

    def evidence(self) -> dict[str, object]:
        """The numbers behind a verdict, with the thresholds each had to pass."""
        return {
            "slope_bytes_per_second": self.slope,
            "slope_mib_per_minute": self.slope * 60 / 2**20,
            "confidence": self.confidence,
            "r_squared": self.r_squared,
            "r_squared_min": R_SQUARED_MIN,
            "monotonic_fraction": self.monotonic_fraction,
            "monotonic_fraction_min": MONOTONIC_MIN,
            "spans": self.spans,
            "current_floor_bytes": self.current_floor_bytes,
            "current_seconds": self.current_seconds,
            "reference_peak_bytes": self.reference_peak_bytes,
            "reference_end": self.reference_end,
            "clearance_bytes": self.clearance_bytes,
            "clearance_min_bytes": CLEARANCE_MIN_BYTES,
            "net_growth_bytes": self.net_growth_bytes,
            "envelope_bytes": self.envelope_bytes,
            "separation": self.separation,
            "period_bound_seconds": self.window_seconds,
            "window_start": self.window_start,
            "window_end": self.window_end,
            "window_seconds": self.window_seconds,
            "samples": self.samples,
        }


# (t, floor, peak): one known sample, peak never below floor.
_Point = tuple[float, int, int]


def growth_of(
    samples: Sequence[Sample],
    *,
    now: float,
    min_duration_seconds: float,
    already_open: bool = False,
) -> Growth | None:
    """:func:`measure_growth` of the known ``samples`` up to ``now`` (epoch s); None when
    the window is too short, or cannot show the floor above an earlier peak."""
    # Most windows (flat or breathing memory) fail here, in one pass with no allocation.
    if len(samples) <= MAX_SAMPLES and not _newest_floor_clears_oldest_peak(samples, now):
        return None
    return measure_growth(
        points(samples, now=now),
        min_duration_seconds=min_duration_seconds,
        already_open=already_open,
    )


def passing_growth(
    samples: Sequence[Sample],
    *,
    now: float,
    min_duration_seconds: float,
    min_slope_bytes_per_second: float,
    already_open: bool = False,
) -> Growth | None:
    """:func:`growth_of`, or None where :meth:`Growth.failed_check` finds evidence
    against growth: the leak's and the filling-up verdict's shared first step."""
    growth = growth_of(
        samples, now=now, min_duration_seconds=min_duration_seconds, already_open=already_open
    )
    if growth is None or growth.failed_check(min_slope_bytes_per_second, already_open=already_open):
        return None
    return growth


# The longest dip (in buckets) that an open verdict looks through (:func:`without_dips`).
DIP_BUCKETS = 3
# ... and how many more buckets it may take to come back, each floor above the one
# before it (a reload spread over minutes: a job restarted under a new PID that loads
# its 25 GiB over 90 to 180 s left four or five low floors, and the verdict closed).
RAMP_BUCKETS = 3


def without_dips(samples: Sequence[Sample], *, now: float) -> list[Sample]:
    """The known ``samples`` up to ``now``, oldest first, less the dips an open verdict
    looks through: runs of samples whose floors lie below the floor before them by more
    than any sample's spread before them (its peak over its floor: the memory's breath
    and noise) and :data:`CLEARANCE_MIN_BYTES`, at most :data:`DIP_BUCKETS` of them plus
    up to :data:`RAMP_BUCKETS` more that each rise above the one before (coming back),
    that the next sample is back from (within that margin), or that are the newest (the memory may yet come back: a drop that lasts closes the verdict
    :data:`DIP_BUCKETS` buckets late).

    A leaking process that frees its cache and takes it back (``empty_cache()``), or a
    neighbour restarted under a new PID beside a GPU's grower, leaves one low floor in
    the window, which sinks the floors' upward share and r² until it leaves: one dip of
    20 s closed open leak and filling-up verdicts for 30 minutes, and the second event
    came 10 minutes before the GPU was full (the 2026-12-07 audit). The filling-up
    verdict also opens through such dips (not while one is at the window's end); the
    leak verdict opens judging every sample.

    Only a dip that comes back to the level before it is left out, so what remains is
    the memory bridged over the dip at its own level: a cycle whose rise resets below
    where it was (a saw-tooth) is never bridged, and memory that only dips and comes
    back is flat once bridged."""
    known = sorted(
        (s for s in samples if s.used_bytes is not None and s.t <= now), key=lambda s: s.t
    )
    floors = [s.used_bytes or 0 for s in known]
    # Deeper than the memory breathed before it (the widest spread of a bucket up to
    # the level, its peak over its floor): a breath's trough is the memory's own level.
    spreads = [max(0, (s.peak_bytes or 0) - (s.used_bytes or 0)) for s in known]
    # A dip's own buckets, and the one it came back in, spread by the dip: counted, a
    # restart's 25 GiB spread hid the next restart for the rest of the window (the
    # window's oldest bucket held the one before). So does an oldest bucket that came
    # back later (the oldest few, up to a dip's length, all below a later bucket's floor
    # by more than that one spreads).
    dropped: set[int] = set()
    unspread: set[int] = set()
    for k in range(min(DIP_BUCKETS + RAMP_BUCKETS, len(known) - 1), 0, -1):
        if max(floors[:k]) < floors[k] - CLEARANCE_MIN_BYTES - spreads[k]:
            unspread.update(range(k))
            break
    widest = 0
    i = 1
    while i < len(known):
        if i - 1 not in unspread:
            widest = max(widest, spreads[i - 1])
        depth = CLEARANCE_MIN_BYTES + widest
        level = floors[i - 1]
        end = i
        while (
            end < len(known)
            and floors[end] < level - depth
            and (
                end - i < DIP_BUCKETS
                or (end - i < DIP_BUCKETS + RAMP_BUCKETS and floors[end] > floors[end - 1])
            )
        ):
            end += 1
        if end == i:
            i += 1
            continue
        if end < len(known):
            back = floors[end] >= level - depth
        else:
            # Newest: it may yet come back. Past DIP_BUCKETS only while climbing back
            # fast enough to be back within the ramp's buckets: memory freed for good
            # and growing again (a saw-tooth's drop, a fixed leak) is no reload.
            left = DIP_BUCKETS + RAMP_BUCKETS - (end - i)
            pace = floors[end - 1] - floors[end - 2] if end - i > 1 else 0
            back = end - i <= DIP_BUCKETS or floors[end - 1] + left * pace >= level - depth
        if back:
            dropped.update(range(i, end))
            unspread.update(range(i, end + 1))
        i = end
    return [s for k, s in enumerate(known) if k not in dropped]


def through_dips(
    samples: Sequence[Sample], *, now: float, min_duration_seconds: float
) -> tuple[list[Sample], float]:
    """:func:`without_dips`, and the window an open verdict then needs: shorter by the
    dip at the window's end, if any (it is the newest buckets that are left out)."""
    kept = without_dips(samples, now=now)
    newest = max((s.t for s in samples if s.used_bytes is not None and s.t <= now), default=None)
    if not kept or newest is None:
        return kept, min_duration_seconds
    return kept, min_duration_seconds - (newest - kept[-1].t)


def _newest_floor_clears_oldest_peak(samples: Sequence[Sample], now: float) -> bool:
    """A necessary condition for any clearance: every split's floor(C) is at most the
    newest floor and its peak(E) at least the oldest peak (ties: the most favourable)."""
    first_t = last_t = -math.inf
    first_peak = last_floor = 0
    seen = False
    for s in samples:
        used, t = s.used_bytes, s.t
        if used is None or t > now:
            continue
        peak = used if s.peak_bytes is None or s.peak_bytes < used else s.peak_bytes
        if not seen or t < first_t or (t == first_t and peak < first_peak):
            first_t, first_peak = t, peak
        if not seen or t > last_t or (t == last_t and used > last_floor):
            last_t, last_floor = t, used
        seen = True
    return seen and last_floor - first_peak > CLEARANCE_MIN_BYTES


def points(samples: Sequence[Sample], *, now: float) -> list[_Point]:
    """Known samples up to ``now`` as ``(t, floor, peak)``, oldest first, newest
    :data:`MAX_SAMPLES` only. ``peak_bytes`` of ``None`` is the floor itself."""
    known = sorted(
        (
            s.t,
            s.used_bytes,
            s.used_bytes if s.peak_bytes is None else max(s.peak_bytes, s.used_bytes),
        )
        for s in samples
        if s.used_bytes is not None and s.t <= now
    )
    return known[-MAX_SAMPLES:]


def measure_growth(
    pts: list[_Point], *, min_duration_seconds: float, already_open: bool = False
) -> Growth | None:
    """The growth evidence of a window of ``pts`` (from :func:`points`), or None when
    the window is too short to judge or its floor never rose above an earlier peak
    (the cheap test that rules out most windows, so it runs first).

    For a verdict ``already_open``, when no split of the window clears, the newest
    bucket's floor above the oldest bucket's peak will do (the split at the window's
    two ends): the memory stands above every level it showed when the window began.
    A ripple nearly as high as the growth over a split's span sinks every split of a
    short window now and then (a 0.5 GiB/min leak under a 1 GiB ripple, judged over
    9 minutes, lapsed for a bucket in 1 trace of 20); opening still needs a split.

    An open verdict also tolerates a window one bucket short of ``min_duration_seconds``
    (:func:`~gpuwatch.detectors.buckets.bucket_width`): the server cuts the window at
    ``now - W - 2 B`` with ``now`` inside the open bucket, so a window with every bucket
    spans W exactly, and an empty
    oldest bucket (two pushes a bucket, two missed in a row) closed a steady leak's
    verdicts for a bucket and opened them again later. Opening still needs the whole W.
    """
    if len(pts) < MIN_SAMPLES:
        return None
    start, end = pts[0][0], pts[-1][0]
    if end - start <= 0:
        return None
    if end - start < min_duration_seconds and not (
        already_open and end - start + bucket_width(t for t, _, _ in pts) >= min_duration_seconds
    ):
        return None
    split = _best_split(pts)
    if split is None or split[0] - split[1] <= CLEARANCE_MIN_BYTES:
        if not already_open:
            return None
        split = (pts[-1][1], pts[0][2], pts[0][1], 0.0, start)
        if split[0] - split[1] <= CLEARANCE_MIN_BYTES:
            return None
    spans = _span_floors(pts)
    if not _quarters_covered(spans):
        return None
    # The finer fit when it holds (its slope is the closer estimate); the wider spans'
    # only where the finer ones fail the shape checks and the wider ones do better.
    floors = [f for f in spans if f is not None]
    fit = _fit(floors)
    if _fit_score(fit) < 0:
        halved = _halved(spans)
        wider = _fit(halved)
        if wider[1] >= WIDER_R_SQUARED_MIN and wider[2] >= WIDER_MONOTONIC_MIN:
            fit, floors = wider, halved
    slope, r_squared, monotonic, span_count = fit
    current_floor, reference_peak, reference_floor, current_seconds, reference_end = split
    return Growth(
        window_start=start,
        window_end=end,
        samples=len(pts),
        newest_bytes=pts[-1][1],
        slope=slope,
        r_squared=r_squared,
        monotonic_fraction=monotonic,
        spans=span_count,
        floors=tuple(floors),
        current_floor_bytes=current_floor,
        current_seconds=current_seconds,
        reference_peak_bytes=reference_peak,
        reference_floor_bytes=reference_floor,
        reference_end=reference_end,
    )


def _best_split(pts: list[_Point]) -> tuple[int, int, int, float, float] | None:
    """The split with the most clearance: ``(floor(C), peak(E), floor(E), c, end of E)``.

    C is the samples from index k on, c = end - t_k; E the samples at or before
    ``end - 2c``. Only splits with c at least twice the widest gap between samples
    count: a gap could otherwise hide the peak that u - P lands on.
    """
    n = len(pts)
    end = pts[-1][0]
    widest_gap = max(b[0] - a[0] for a, b in pairwise(pts))
    peak_so_far, floor_so_far = [], []
    peak, floor = pts[0][2], pts[0][1]
    for _, f, p in pts:
        peak, floor = max(peak, p), min(floor, f)
        peak_so_far.append(peak)
        floor_so_far.append(floor)
    best: tuple[int, int, int, float, float] | None = None
    current_floor = pts[-1][1]
    e = n - 1
    for k in range(n - 1, 0, -1):
        t_k, f_k, _ = pts[k]
        current_floor = min(current_floor, f_k)
        c = end - t_k
        while e >= 0 and (e >= k or pts[e][0] > end - 2 * c):
            e -= 1
        if e < 0:
            break
        if c < 2 * widest_gap:
            continue
        if best is None or current_floor - peak_so_far[e] > best[0] - best[1]:
            best = (current_floor, peak_so_far[e], floor_so_far[e], c, pts[e][0])
    return best


# The recent rate is judged over the newest third of the window (the newest half for
# a verdict already open, see recent_slope), and never over fewer than this many buckets.
RECENT_SHARE = 1 / 3
OPEN_RECENT_SHARE = 1 / 2
MIN_RECENT_POINTS = 4


def recent_slope(
    samples: Sequence[Sample], *, now: float, since: float, already_open: bool = False
) -> float:
    """How fast the floor rose over the newest third of the window that starts at
    ``since`` (bytes/s; at least :data:`MIN_RECENT_POINTS` buckets): the floor level at
    its end minus the level at its start, over the time between.

    A difference of levels rather than a fitted line, so an allocator that grows in
    steps (flat, jump, flat) counts at its average rate; each level is the lowest floor
    of the first or last third of those buckets, so noise and breathing move neither
    end up.

    For a verdict ``already_open`` the newest half of the window is judged instead. The
    two levels are each their stretch's lowest, which for growth in steps is the level
    at the stretch's start, so the rate sees only the steps between the two stretches'
    starts: two thirds of the span apart. Over a third of the window that is 2W/9, and a
    staircase with steps 9 or 10 minutes apart (W/3 at the defaults, which docs/
    detection.md calls a leak) showed no step there for a bucket after each step: its
    verdicts closed and opened again as a new event at every step, 13 times in 150
    minutes. Over half the window the starts are W/3 apart, and a step always lies
    between them. Opening keeps the third: a load that has stopped is not let in later.
    """
    pts = [p for p in points(samples, now=now) if p[0] >= since]
    if len(pts) < 2:
        return 0.0
    share = OPEN_RECENT_SHARE if already_open else RECENT_SHARE
    cutoff = pts[-1][0] - (pts[-1][0] - pts[0][0]) * share
    recent = [p for p in pts if p[0] >= cutoff]
    if len(recent) < MIN_RECENT_POINTS:
        recent = pts[-MIN_RECENT_POINTS:]
    edge = max(2, len(recent) // 3)
    start, end = recent[:edge], recent[-edge:]
    # Between the edges' middles: for steady growth each edge's lowest floor is its
    # first, and those lie exactly that far apart.
    elapsed = sum(t for t, _, _ in end) / edge - sum(t for t, _, _ in start) / edge
    if elapsed <= 0:
        return 0.0
    return (min(f for _, f, _ in end) - min(f for _, f, _ in start)) / elapsed


# A verdict opens only when the memory is seen rising now: the lowest floor of the
# newest stretch of the window (its last 1/SPANS, and at least MIN_NOW_POINTS samples)
# stands above the lowest floor of the stretch just before it, by half of what the
# slope adds between them. Floors against floors, never a peak against a floor: a
# bucket's spread is noise, or a training step's breathing, as often as growth, and
# with it any flat memory looked like it was rising (a staircase that had stopped
# opened a leak minutes later). The lowest of a stretch also holds the quiet moment
# of any cycle shorter than the stretch, so a leak under a fast saw-tooth still shows.
NOW_SHARE = 0.5
MIN_NOW_POINTS = 2


def growing_now(samples: Sequence[Sample], *, now: float, slope: float) -> bool:
    """Does the newest stretch of ``samples`` show the memory rising, at half of
    ``slope`` or more?

    This is what tells growth that goes on from a load that has finished: the window's
    evidence of growth lasts a while after a steep load stops (a model streamed in over
    a few minutes, or two allocations minutes apart, pass every other check for up to
    W/2 after), but the newest stretch of a load that stopped is no higher than the one
    before it. Once a verdict is open it does not need this (an allocator that grows in
    steps is flat between its steps; it opens when a stretch that follows a step is
    compared with one before it).
    """
    pts = points(samples, now=now)
    if len(pts) < 2 * MIN_NOW_POINTS:
        return False
    start = pts[-1][0] - (pts[-1][0] - pts[0][0]) / SPANS
    k = max(MIN_NOW_POINTS, sum(1 for p in pts if p[0] >= start))
    k = min(k, len(pts) // 2)
    newest, before = pts[-k:], pts[-2 * k : -k]
    rise = min(f for _, f, _ in newest) - min(f for _, f, _ in before)
    wanted = NOW_SHARE * slope * (newest[0][0] - before[0][0])
    return rise > 0 and rise >= wanted


# The share of the expected climb the poll at hand must show (:func:`climbing_at_poll`).
POLL_SHARE = 0.75
# The newest bucket's own rate counts up to this many times the window's slope.
OWN_RATE_CAP = 2.0


def climbing_at_poll(
    samples: Sequence[Sample],
    *,
    now: float,
    now_bytes: int | None,
    slope: float,
    buckets_back: int = 1,
) -> bool:
    """Whether the poll at hand (``now_bytes`` at ``now``, the first of a bucket not yet
    closed) stands above the newest bucket's floor by :data:`POLL_SHARE` of what growth
    would have added since that floor was polled: at the window's ``slope``, or at the
    newest bucket's own rate (its floor over the floor before it) where that is faster,
    up to twice the slope. None: unknown, and no objection.

    A rising bucket's floor is its first poll, which comes after the bucket's start by
    the same offset as the poll at hand after the open bucket's start (one agent's
    polls are periodic), so the time between them is whole buckets, not ``now`` minus
    the bucket's start. Counting from the start asked a bucket of two pushes whose first
    came late in it for more than two pushes of growth: the demo's filling-up verdict
    never opened in one run of three.

    Closed buckets lag: at a bucket close the newest one still holds the end of a load
    that stopped a minute ago, and for two or three buckets more the stretches that
    :func:`growing_now` compares still rise. A five-minute warm-up seen through a short
    window passed every check in the minutes after it levelled off, which a filling-up
    alert then announced. The poll at hand is already on the plateau, short of where
    the growth would have taken it; growth that goes on is there. Floors, not peaks: a
    bucket of many noisy polls has its peak well above its level. The own rate is what
    a warm-up steeper than the window's line climbed at; it is capped because noise, or
    a ripple the polls alias, moves two floors apart by more than growth does. A load
    that stops within the last quarter of that time cannot be told from one that goes
    on.

    The poll at hand is one poll, the floor the lowest of a bucket's: memory that
    breathes (a training step's activations, faster than a bucket) puts the poll
    anywhere from its floor to its top, so the poll is taken less the usual breath
    (:func:`breath`) before it is compared. Compared whole, a 1 or 2 GiB breath read as
    growth going on for minutes after a warm-up or a staircase levelled off, and
    filling-up opened on a GPU that had stopped filling (31 of 96 ramps under a breath
    of 20 to 45 s in the 2026-12-07 audit). Where the breath is wider than the poll's
    margin, growth is judged by the floors instead (:func:`_floors_climbing`), which
    the breath does not move: a bucket later, so there a load that stops in the last
    quarter of the bucket before the newest cannot be told from one that goes on.

    ``buckets_back`` 2 judges from the bucket before the newest instead: where a step
    came in (:func:`step_held`), which the newest bucket's floor is already past.
    """
    every = points(samples, now=now)
    pts = every[: len(every) - (buckets_back - 1)]
    if now_bytes is None or len(pts) < 2:
        return True
    (before, before_floor, _), (start, floor, _) = pts[-2], pts[-1]
    own = (floor - before_floor) / (start - before)
    rate = max(slope, min(own, OWN_RATE_CAP * slope))
    # The bucket width: the narrowest step between the newest buckets (a gap in the
    # polls only widens a step). Whole widths since the newest bucket began, never more
    # than the time itself.
    width = bucket_width(t for t, _, _ in pts[-1 - 2 * MIN_NOW_POINTS :])
    whole = math.floor((now - start) / width) if width > 0 else 0
    elapsed = width * whole if whole >= 1 else now - start
    breathing = breath(every)
    if now_bytes - breathing > floor + POLL_SHARE * rate * elapsed:
        return True
    hidden = breathing > (1 - POLL_SHARE) * rate * elapsed
    return hidden and _floors_climbing(every, buckets_back, slope)


# How many of the newest buckets (or stretches) the floors' wander and earlier rate are
# read from (:func:`_floor_wander`, :func:`_floors_climbing`).
BREATH_BUCKETS = 2 * MIN_NOW_POINTS


# Where the breath hides the poll at hand, growth must lift this many stretch floors in
# a row over the one before (:func:`_floors_climbing`): a chunk lifts one, and a chunk
# that a bucket's edge splits, seen through a breath's aliased polls, lifted two.
FLOOR_RISES = 3
# Stretches of one bucket, or of two or three where one-bucket floors do not show the
# growth (a breath of two or three buckets' period puts its trough in one bucket of two
# or three). The wider ones also need the newest floor to rise (_newest_floor_rose):
# their own floors lag by as many buckets, and under a breath the one-bucket floors
# resolve, they opened filling-up two minutes after a warm-up levelled off.
FLOOR_STRETCHES = (1, 2, 3)


def _floors_climbing(pts: list[_Point], buckets_back: int, slope: float) -> bool:
    """Whether the floors show growth up to the newest bucket, beyond how far they
    wander: what :func:`climbing_at_poll` falls back on where the breath hides the poll
    at hand. Stretches of one bucket (or of two or three, each's lowest floor, with the
    newest floor rising too: :func:`_newest_floor_rose`) must each stand above the
    stretch before by :data:`POLL_SHARE` of what growth adds between them,
    :data:`FLOOR_RISES` times in a row; ``buckets_back`` 2 (a step, which lifts one
    floor by design and is judged by :func:`step_held` and :func:`keeping_pace`) asks
    only that the newest floor stand so far above the floor two buckets before it.

    The rate: the window's ``slope``, or the median rate of the stretches before those
    judged where it is faster (a ramp steeper than the window's line). Not the judged
    stretches' own, at which any rise would pass. The floors lag the poll at hand by a
    bucket: a load that stops within the newest bucket cannot be told from one that goes
    on."""
    if buckets_back > 1:
        return _stretches_rise(pts, width=1, step=buckets_back, rises=1, slope=slope)
    for width in FLOOR_STRETCHES:
        rose = _stretches_rise(pts, width=width, step=width, rises=FLOOR_RISES, slope=slope)
        if rose and (width == 1 or _newest_floor_rose(pts, slope)):
            return True
    return False


def _newest_floor_rose(pts: list[_Point], slope: float) -> bool:
    """Whether the newest floor stands above the one before by :data:`POLL_SHARE` of
    what growth adds between them, beyond the floors' wander: at the window's ``slope``,
    or at the median rate of the floors before where that is faster. What growth under
    a breath of two or three buckets' period shows at one bucket in two or three, and
    memory that stopped in an older bucket of the newest wide stretch does not (that
    stretch's floor is from before the stop: a lag of two or three buckets)."""
    (before, before_floor, _), (newest, newest_floor, _) = pts[-2], pts[-1]
    earlier = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pairwise(pts[-2 - BREATH_BUCKETS : -1])]
    rate = max(slope, _median(earlier)) if earlier else slope
    rise = newest_floor - before_floor - _floor_wander(pts)
    return rise > POLL_SHARE * rate * (newest - before)


def _stretches_rise(pts: list[_Point], *, width: int, step: int, rises: int, slope: float) -> bool:
    """Stretches of ``width`` buckets, ``step`` apart from the newest back: each of the
    ``rises`` newest stands above the one before by POLL_SHARE of the growth between,
    beyond the stretches' wander (see :func:`_floors_climbing`). False where they wander
    by more than that growth (they cannot show it), or are too few."""
    count = min((len(pts) - width) // step + 1, rises + 1 + BREATH_BUCKETS)
    if count < rises + 2:
        return False
    stretches: list[_Point] = []  # newest first: (newest bucket's start, lowest floor, 0)
    for i in range(count):
        end = len(pts) - i * step
        lowest = min(f for _, f, _ in pts[end - width : end])
        stretches.append((pts[end - 1][0], lowest, 0))
    stretches.reverse()  # oldest first
    wander = _floor_wander(stretches)
    judged = stretches[-rises - 1 :]
    earlier = [
        (new - old) / (t_new - t_old)
        for (t_old, old, _), (t_new, new, _) in pairwise(stretches[:-rises])
    ]
    rate = max(slope, _median(earlier))
    if wander > POLL_SHARE * slope * (judged[-1][0] - judged[-2][0]):
        return False
    return all(
        new - old - wander > POLL_SHARE * rate * (t_new - t_old)
        for (t_old, old, _), (t_new, new, _) in pairwise(judged)
    )


def _floor_wander(pts: list[_Point]) -> int:
    """How far a floor of the newest :data:`BREATH_BUCKETS` + 1 of ``pts`` stood above a
    later one (bytes): growth never lowers a floor, so that is noise, or a breath the
    polls catch at other phases from bucket to bucket."""
    wander = 0
    lowest_after: int | None = None
    for _, f, _ in reversed(pts[-1 - BREATH_BUCKETS :]):
        if lowest_after is not None:
            wander = max(wander, f - lowest_after)
        lowest_after = f if lowest_after is None else min(lowest_after, f)
    return wander


def step_held(
    samples: Sequence[Sample], *, now: float, slope: float, now_bytes: int | None = None
) -> bool:
    """Whether the memory stepped up in the bucket before the newest (or between the
    two) and stayed up: the newest bucket's lowest poll, and the poll at hand
    (``now_bytes``), stand above that bucket's floor by more than what ``slope`` adds in
    a bucket plus twice the widest rise of the buckets before it that did not last
    (their noise, or their breathing), and :data:`CLEARANCE_MIN_BYTES`.

    An allocator that grows in chunks is flat between them, and the stretches
    :func:`growing_now` compares see a chunk only two or three buckets later, when the
    poll at hand is as flat as after a load that stopped; the chunk is where such growth
    shows as growth. But a step is also what a transient allocation looks like: an
    evaluation pass taking 8 GiB for 90 s, minutes after a warm-up levelled off, opened
    filling-up on a flat GPU when the step was judged in the bucket it came in. One that
    has held for a whole bucket, and still holds, is a chunk; a transient that lasts
    longer than that cannot be told from one until it ends. The memory must also have
    been flat in the bucket before the step's: a warm-up that stopped half a bucket ago
    passed for a held step.
    """
    pts = points(samples, now=now)
    if len(pts) < 2 + MIN_NOW_POINTS:
        return False
    (start, floor, _), (_, newest_floor, _) = pts[-2], pts[-1]
    before = pts[-2 - 2 * MIN_NOW_POINTS : -2]
    width = start - before[-1][0]
    held = newest_floor if now_bytes is None else min(newest_floor, now_bytes)
    bar = max(CLEARANCE_MIN_BYTES, slope * width + 2 * _usual_rise(before, floor))
    # Flat before it: the end of a climb (a warm-up's last bucket) is not a step, and
    # growing_now and the poll at hand judge a climb more closely.
    return held - floor > bar and floor - before[-1][1] <= bar


def _usual_rise(before: list[_Point], newest_floor: int) -> int:
    """The widest rise within the buckets ``before`` that did not last: each bucket's
    highest poll over its floor, less what the floors after it (through the newest
    bucket's, ``newest_floor``) kept of the rise.

    Noise and breathing come back down; a step that stayed up is the growth itself. With
    chunks four buckets apart, the chunk before always lay among the buckets before and
    counted as their noise, so no chunk stood out: a GPU filled by a 2 GiB worker every
    four minutes got no filling-up verdict at most alignments.
    """
    usual = 0
    kept = newest_floor  # the lowest floor after the bucket at hand
    for _, f, p in reversed(before):
        usual = max(usual, p - max(f, kept))
        kept = min(kept, f)
    return usual


def breath(pts: list[_Point]) -> int:
    """How far a poll can stand above its bucket's floor by breathing or noise alone
    (bytes): the widest rise of the window's buckets before the newest that did not
    last (:func:`_usual_rise`; a rise the floors after it kept is growth). 0 for fewer
    than two buckets.

    The whole window, not only the newest buckets: during a ramp steeper than the
    breath, the floors after a bucket keep most of its top, and the newest buckets
    showed half a 1.5 GiB breath, which let the poll at hand a minute after the ramp
    stopped pass for growth."""
    if len(pts) < 2:
        return 0
    return _usual_rise(pts[:-1], pts[-1][1])


def keeping_pace(
    samples: Sequence[Sample],
    *,
    now: float,
    now_bytes: int | None,
    slope: float,
    window_seconds: float,
) -> bool:
    """Whether the memory at hand (the highest poll of the newest stretch, or
    ``now_bytes``, the poll at hand, if higher) stands above every bucket floor of the
    W/3 before that stretch by at least :data:`NOW_SHARE` of what ``slope`` adds since
    (W: ``window_seconds``).

    What a step must show to open a filling-up verdict (:func:`step_held`). A warm-up
    that levelled off holds the window's line, its clearance and its recent rate up for
    many minutes after, and then a step reads as growth going on: an evaluation pass
    taking 3 GiB for two minutes opened filling-up minutes after the memory stopped
    rising. Growth in steps keeps pace with its line: steps at most W/3 apart (the
    staircase the docs call growth) put at least one step's rise, the line's slope
    times the spacing, between any of those floors and now. A plateau's pass is short
    of the minutes of growth the window's slope says should lie behind it once the
    plateau is a few buckets old.

    Tops less the usual breath (:func:`breath`): a top of memory that breathes stands
    above its floors by the breath alone. Taken whole, a 1 GiB breath carried the
    last step of a staircase that had stopped past this check, and filling-up opened
    two minutes after the GPU stopped filling (the 2026-12-07 audit).
    """
    pts = points(samples, now=now)
    if len(pts) < 2 * MIN_NOW_POINTS:
        return True
    # The level: the highest poll of the newest stretch (as growing_now cuts it), or
    # the poll at hand if higher, less the breath, timed (leniently) at the newest
    # bucket's start; never below the stretch's highest floor.
    start = pts[-1][0] - (pts[-1][0] - pts[0][0]) / SPANS
    k = max(MIN_NOW_POINTS, sum(1 for t, _, _ in pts if t >= start))
    top = max(max(peak for _, _, peak in pts[-k:]), now_bytes or 0)
    level = max(top - breath(pts), max(f for _, f, _ in pts[-k:]))
    at = pts[-1][0] if now_bytes is None else now
    # The floors before that stretch, back to W/3 before ``at``.
    return all(
        level - f >= NOW_SHARE * slope * (at - t)
        for t, f, _ in pts[:-k]
        if at - t <= window_seconds / 3
    )


# The current rate counts up to this many times the window's slope (:func:`current_rate`).
CURRENT_RATE_CAP = 2.0


def current_rate(growth: Growth, recent: float) -> float:
    """The rate to project the time to full at (bytes/s): the window's slope, or the
    ``recent`` one (:func:`recent_slope`) where that is faster, up to
    :data:`CURRENT_RATE_CAP` times the slope.

    Growth that began inside the window is a hinge, flat then rising, and the window's
    robust slope is a blend of the two: about half of the rise's own rate. Projected at
    the window's slope, a GPU full in 39 minutes was said to be full in 65, and the
    verdict opened three minutes late where the true time sat at the horizon (the
    2026-12-07 audit). Capped: the recent rate is a difference of two levels, and noise
    or a breath moves a level by more than the fitted line moves."""
    return max(growth.slope, min(recent, CURRENT_RATE_CAP * growth.slope))


def highest_floor(samples: Sequence[Sample]) -> int | None:
    """The highest known floor (``used_bytes``) of ``samples``: what a caller with
    history older than the detectors' window passes as ``held_before_bytes``."""
    return max((s.used_bytes for s in samples if s.used_bytes is not None), default=None)


def new_height(growth: Growth, held_before_bytes: int | None) -> bool:
    """Whether the current floor stands above the highest floor held before the window
    (``held_before_bytes``: None when there is no earlier history) by more than
    :data:`CLEARANCE_MIN_BYTES`.

    A cycle longer than the window rises for the whole window, and a window alone
    cannot tell its rise from a leak (a job that builds up for 40 minutes and frees at
    the end of each epoch). Its rise only climbs back to where the cycle before it
    already went: growth to a level the holder held an hour ago is a cycle, and a
    verdict opens only past every earlier floor. A leak under such a cycle still opens,
    once the floors of a rise pass the last cycle's top.
    """
    if held_before_bytes is None:
        return True
    return growth.current_floor_bytes - held_before_bytes > CLEARANCE_MIN_BYTES


def floor_slope(pts: list[_Point]) -> float:
    """Theil–Sen slope (bytes/s) of the span floors of ``pts``, however sparse; 0.0 for
    fewer than two distinct times."""
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return 0.0
    return _theil_sen_slope([f for f in _span_floors(pts) if f is not None])


def _quarters_covered(floors: list[tuple[float, int] | None]) -> bool:
    quarter = SPANS // 4
    return all(
        any(f is not None for f in floors[q : q + quarter]) for q in range(0, SPANS, quarter)
    )


def _span_floors(pts: list[_Point]) -> list[tuple[float, int] | None]:
    """The lowest floor of each of :data:`SPANS` equal time spans, as ``(t, bytes)``
    (None for a span without samples)."""
    start, end = pts[0][0], pts[-1][0]
    width = (end - start) / SPANS
    floors: list[tuple[float, int] | None] = [None] * SPANS
    for t, f, _ in pts:
        i = min(int((t - start) / width), SPANS - 1)
        current = floors[i]
        # Strictly lower only: on a tie the earliest sample stays, so input order is moot.
        if current is None or f < current[1]:
            floors[i] = (t, f)
    return floors


def _median(values: list[float]) -> float:
    values.sort()
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _theil_sen_slope(floors: list[tuple[float, int]]) -> float:
    """Median of the pairwise slopes (bytes/s): robust to a span that dipped or spiked."""
    slopes = [
        (b[1] - a[1]) / (b[0] - a[0])
        for i, a in enumerate(floors)
        for b in floors[i + 1 :]
        if b[0] > a[0]
    ]
    return _median(slopes) if slopes else 0.0


def _r_squared(floors: list[tuple[float, int]], slope: float) -> float:
    """Share of the floors' variance the Theil–Sen line explains (1.0 for a perfect line;
    at most the least-squares r², so a single step stays at or below 0.75).

    Values are taken relative to the first floor so that a constant offset in bytes
    changes nothing, not even rounding.
    """
    base_t, base_v = floors[0]
    xs = [t - base_t for t, _ in floors]
    ys = [float(v - base_v) for _, v in floors]
    intercept = _median([y - slope * x for x, y in zip(xs, ys, strict=True)])
    mean_y = sum(ys) / len(ys)
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return 1.0 - residual / total if total > 0 else 0.0


_Fit = tuple[float, float, float, int]


def _fit(floors: list[tuple[float, int]]) -> _Fit:
    """``(slope, r², upward share, number of floors)`` of one set of span floors."""
    slope = _theil_sen_slope(floors)
    return slope, _r_squared(floors, slope), _upward_share(floors), len(floors)


def _fit_score(fit: _Fit) -> float:
    """The weaker of the fit's two shape scores (each 0 at its threshold, 1 at best)."""
    _, r_squared, monotonic, _ = fit
    return min(
        (r_squared - R_SQUARED_MIN) / (1 - R_SQUARED_MIN),
        (monotonic - MONOTONIC_MIN) / (1 - MONOTONIC_MIN),
    )


def _halved(spans: list[tuple[float, int] | None]) -> list[tuple[float, int]]:
    """The floors of spans twice as wide: the lower of each pair of neighbours.

    Memory that dips for a moment every few minutes (a square wave, an evaluation pass)
    gives narrow spans that alternately hold a dip and miss it, so their floors saw up
    and down by the whole dip even while the memory beneath grows; spans twice as wide
    hold a dip each for any period up to their width. Where the finer floors fail the
    shape checks, the wider ones are used if they follow a line closely (r² and upward
    share of at least 0.95): periodic memory is still ruled out by the clearance alone,
    and a single step, which explains at most 75% of the variance of clean floors,
    stays far from that even where a span straddles it or noise blurs it.
    """
    halved = []
    for i in range(0, len(spans) - 1, 2):
        pair = [f for f in spans[i : i + 2] if f is not None]
        if pair:
            halved.append(min(pair, key=lambda f: f[1]))
    return halved


def _upward_share(floors: list[tuple[float, int]]) -> float:
    """Upward share of the span floors' total movement (bytes up / bytes moved), 0..1."""
    up = down = 0
    for (_, a), (_, b) in pairwise(floors):
        if b > a:
            up += b - a
        else:
            down += a - b
    return up / (up + down) if up + down else 0.0
