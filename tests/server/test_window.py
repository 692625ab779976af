"""The packed recent window the trend detectors read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.detectors import Sample
from gpuwatch.server.processes import window

samples = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=2**50) | st.none(),
        st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.none(),
    ),
    max_size=60,
).map(lambda xs: [Sample(t=60.0 * i, used_bytes=u, sm_ratio=s) for i, (u, s) in enumerate(xs)])


@given(samples, st.floats(min_value=-60, max_value=4000))
def test_appending_keeps_the_newest_samples_exactly(history: list[Sample], keep: float) -> None:
    blob = b""
    for sample in history:
        blob = window.append(blob, sample, keep_after=-1.0)

    assert window.samples_since(blob, float("-inf")) == history
    assert window.samples_since(blob, keep) == [s for s in history if s.t >= keep]
    known = [s.used_bytes for s in history if s.t >= keep and s.used_bytes is not None]
    assert window.floor_since(blob, keep) == (min(known) if known else None)


def test_append_trims_the_old_end_and_replaces_a_repeated_time() -> None:
    blob = b""
    for i in range(10):
        blob = window.append(blob, Sample(t=i * 60.0, used_bytes=i, sm_ratio=0.0), keep_after=300)

    blob = window.append(blob, Sample(t=540.0, used_bytes=99, sm_ratio=None), keep_after=300)

    assert [s.t for s in window.samples_since(blob, 0)] == [300.0, 360.0, 420.0, 480.0, 540.0]
    assert window.samples_since(blob, 540)[0] == Sample(t=540.0, used_bytes=99, sm_ratio=None)


def test_a_window_is_bounded() -> None:
    blob = b""
    for i in range(window.MAX_SAMPLES + 10):
        blob = window.append(blob, Sample(t=float(i), used_bytes=1, sm_ratio=0.0), keep_after=0)

    kept = window.samples_since(blob, 0)
    assert len(kept) == window.MAX_SAMPLES and kept[-1].t == window.MAX_SAMPLES + 9
