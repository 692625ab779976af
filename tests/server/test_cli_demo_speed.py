"""``gpuwatch demo --speed``: every speed it takes gives settings the server and the
agents take too. Below :data:`MIN_SPEED` the scaled windows leave their bounds (at
``1e-9`` the demo died on its own settings: "unexpected ValidationError (a bug)")."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.cli.demo_plan import MAX_SPEED, MIN_SPEED, Timings, server_settings
from gpuwatch.settings import AgentSettings


@pytest.mark.parametrize("speed", [MIN_SPEED, 0.01, 1.0, MAX_SPEED])
def test_every_speed_the_demo_takes_gives_valid_server_and_agent_settings(
    speed: float, tmp_path: Path
) -> None:
    timings = Timings.at(speed)

    server_settings(
        timings,
        listen="127.0.0.1:0",
        data_dir=tmp_path,
        sink_url="http://127.0.0.1:1/hook",
        sink_secret="s" * 32,
        dashboard="http://127.0.0.1:0/",
    )
    AgentSettings(poll_interval_seconds=timings.poll, push_interval_seconds=timings.push)


@pytest.mark.parametrize(
    "speed", [MIN_SPEED * 0.99, 1e-9, 0.0, -1.0, MAX_SPEED * 1.01, float("nan")]
)
def test_a_speed_outside_the_range_is_refused_naming_it(speed: float) -> None:
    with pytest.raises(ValueError, match=f"--speed must be at least {MIN_SPEED:g} and at most 4"):
        Timings.at(speed)


def test_the_help_states_the_range_the_demo_takes() -> None:
    from gpuwatch.cli.demo import LIFETIME_MARGIN_SECONDS
    from gpuwatch.nvml.fake.scenario_file import MAX_LIFETIME_SECONDS

    source = (Path(__file__).parents[2] / "gpuwatch" / "cli" / "demo.py").read_text()
    assert f"({MIN_SPEED:g} to {MAX_SPEED:g})" in source
    assert f"at most {MAX_LIFETIME_SECONDS - LIFETIME_MARGIN_SECONDS:.0f}" in source
