"""Scenario files: sizes, durations, timelines as pure functions, and one-line errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.errors import ScenarioError
from gpuwatch.nvml.fake import bundled_scenario_names, load_scenario
from gpuwatch.nvml.fake.library import is_implemented
from gpuwatch.nvml.fake.scenario import Attach, Ghost, Spawn
from gpuwatch.nvml.fake.timeline import Constant, Linear, Sawtooth, Steps, parse_timeline
from gpuwatch.quantities import parse_bytes, parse_seconds

GPU = '[[gpu]]\nmemory_total = "80GiB"\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        (4096, 4096),
    ],
)
def test_sizes_parse_binary_and_decimal_units(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["80Gb", "-1GiB", "lots", True, None])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("text", "expected"), [("90s", 90), ("10m", 600), ("1h30m", 5400), ("1d", 86400), (2.5, 2.5)]
)
def test_durations_parse(text: object, expected: float) -> None:
    assert parse_seconds(text) == expected


@pytest.mark.parametrize("bad", ["10 minutes", "m", "", "-5s", "5s10"])
def test_bad_durations_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_seconds(bad)


def test_linear_ramps_then_holds() -> None:
    ramp = parse_timeline(
        {"linear": ["2GiB", "6GiB"], "over": "4m"}, lambda v: float(parse_bytes(v))
    )
    assert ramp == Linear(2 * 2**30, 6 * 2**30, 240)
    assert [ramp.at(t) for t in (0, 120, 240, 10_000)] == [
        2 * 2**30,
        4 * 2**30,
        6 * 2**30,
        6 * 2**30,
    ]


def test_sawtooth_rises_each_period_then_drops() -> None:
    saw = Sawtooth(10, 90, 60)
    assert [saw.at(t) for t in (0, 30, 59.999, 60, 90)] == pytest.approx(
        [10, 50, 90, 10, 50], abs=0.01
    )


def test_steps_hold_each_value_from_its_time() -> None:
    steps = parse_timeline({"steps": [["0s", 1], ["5m", 2], ["10m", 3]]}, float)
    assert steps == Steps((0, 300, 600), (1, 2, 3))
    assert [steps.at(t) for t in (0, 299, 300, 599, 600, 1e9)] == [1, 1, 2, 2, 3, 3]


@given(
    st.floats(0, 1e12),
    st.floats(0, 1e12),
    st.floats(1, 1e6),
    st.floats(0, 1e7),
)
def test_every_shape_stays_within_its_bounds(a: float, b: float, span: float, t: float) -> None:
    for timeline in (
        Constant(a),
        Linear(a, b, span),
        Sawtooth(a, b, span),
        Steps((0.0, span), (a, b)),
    ):
        low, high = timeline.bounds()
        value = timeline.at(t)
        assert low - 1e-6 * max(1, abs(low)) <= value <= high + 1e-6 * max(1, abs(high))
        assert timeline.at(t) == value  # pure: same t, same value
        assert math.isfinite(value)


def test_every_bundled_scenario_loads() -> None:
    names = bundled_scenario_names()
    assert {"workstation", "h100x8", "leak", "gpu-lost", "big"} <= set(names)
    for name in names:
        scenario = load_scenario(name, known_symbols=is_implemented)
        assert scenario.gpus and scenario.description


def test_big_scenario_has_200_processes_per_gpu_with_few_real_standins() -> None:
    big = load_scenario("big")
    assert len(big.gpus) == 8
    assert all(len(big.processes_on(gpu.index)) == 200 for gpu in big.gpus)
    assert sum(isinstance(p.origin, Spawn) for p in big.processes) == 16
    ghosts = [p.origin.pid for p in big.processes if isinstance(p.origin, Ghost)]
    assert len(ghosts) == len(set(ghosts)) == 8 * 198


def test_defaults_and_origins(write_scenario: Callable[..., Path]) -> None:
    path = write_scenario(
        GPU
        + """
        [[process]]
        gpu = 0
        spawn = ["python", "-c", "pass"]
        env = { SLURM_JOB_ID = "4242" }
        [[process]]
        gpu = 0
        attach = "self"
        [[process]]
        gpu = 0
        ghost = 4100000
        count = 3
        """
    )
    scenario = load_scenario(path)
    gpu = scenario.gpus[0]
    assert (
        gpu.memory_total == 80 * 2**30
        and gpu.uuid.startswith("GPU-")
        and gpu.pci_bus_id == "00000000:01:00.0"
    )
    spawn, attach, *ghosts = scenario.processes
    assert spawn.origin == Spawn(("python", "-c", "pass"), (("SLURM_JOB_ID", "4242"),), False)
    assert attach.origin == Attach("self")
    assert [g.origin for g in ghosts] == [Ghost(4100000), Ghost(4100001), Ghost(4100002)]
    assert [p.key for p in scenario.processes] == ["0.0", "1.0", "2.0", "2.1", "2.2"]


def test_uuid_is_stable_across_edits_of_the_file(write_scenario: Callable[..., Path]) -> None:
    first = load_scenario(write_scenario(GPU))
    second = load_scenario(write_scenario(GPU + 'name = "NVIDIA A100-SXM4-80GB"\n'))
    assert first.gpus[0].uuid == second.gpus[0].uuid
    assert first.content_hash != second.content_hash


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '[[gpu]]\nmemory_total = "80Gb"\n',
            "test-1.toml: gpu[0].memory_total: unknown size unit in '80Gb'",
        ),
        ("[[gpu]]\nname = 'x'\n", "test-1.toml: gpu[0].memory_total: is required"),
        # More than a snapshot can carry, or nothing: said here, not when polled.
        (
            '[[gpu]]\nmemory_total = "99999999999999TiB"\n',
            "test-1.toml: gpu[0].memory_total: must be more than 0 and at most 1 PiB",
        ),
        ('[[gpu]]\nmemory_total = "0B"\n', "gpu[0].memory_total: must be more than 0"),
        (GPU + "memroy = 1\n", "test-1.toml: gpu[0].memroy: unknown key"),
        (GPU + "[[process]]\ngpu = 1\nghost = 5\n", "test-1.toml: process[0].gpu: no GPU 1"),
        (GPU + "[[process]]\ngpu = 0\n", "test-1.toml: process[0]: needs exactly one of spawn"),
        (
            GPU + "[[process]]\ngpu = 0\nghost = 5\norphan = true\n",
            "process[0].orphan: only applies to spawn",
        ),
        (
            GPU + "[[process]]\ngpu = 0\nghost = 5\nsm_percent = 120\n",
            "sm_percent: values must stay within 0..100",
        ),
        (
            GPU + "[[process]]\ngpu = 0\nghost = 5\nmemory = { linear = [0, 1] }\n",
            "linear needs over = DURATION",
        ),
        (
            GPU + '[[fault]]\nkind = "unsupported"\nfunction = "nvmlDeviceGetPowerUsag"\n',
            "no NVML function",
        ),
        (
            GPU + '[[fault]]\nkind = "hang"\nfunction = "nvmlDeviceGetPowerUsage"\n',
            "fault[0].seconds: hang needs",
        ),
        (GPU + '[[fault]]\nkind = "gpu_lost"\n', "fault[0].gpu: gpu_lost needs the index"),
        # States no driver produces: MIG on a board without it, one GI id twice.
        (
            GPU
            + 'cuda_capability = "8.6"\n[[gpu.mig]]\nprofile = "1g.10gb"\nmemory_total = "10GiB"\n',
            "gpu[0].mig: this board has no MIG",
        ),
        (GPU + 'cuda_capability = "7.0"\nmig_capable = true\n', "no board before Ampere"),
        (
            GPU
            + '[[gpu.mig]]\nprofile = "1g.10gb"\nmemory_total = "10GiB"\ngpu_instance_id = 3\n'
            + '[[gpu.mig]]\nprofile = "1g.10gb"\nmemory_total = "10GiB"\ngpu_instance_id = 3\n',
            "gpu[0].mig: gpu_instance_id 3 is used more than once",
        ),
        ('driver_version = "banana"\n' + GPU, "fake.driver_version: expected e.g."),
        (GPU + 'pci_bus_id = "18-00"\n', "gpu[0].pci_bus_id: expected a PCI bus id"),
        # Fault scopes and the init kinds.
        (
            GPU + '[[fault]]\nmig = 0\nkind = "unknown"\nfunction = "nvmlDeviceGetName"\n',
            "fault[0].mig: needs gpu = N",
        ),
        (
            GPU
            + '[[fault]]\ngpu = 0\nmig = "parent"\nkind = "unknown"\nfunction = "nvmlDeviceGetName"\n',
            "fault[0].mig: GPU 0 is not in MIG mode",
        ),
        (
            GPU + '[[fault]]\ngpu = 0\nkind = "driver_not_loaded"\n',
            "fault[0].gpu: driver_not_loaded fails nvmlInit",
        ),
        ("[gpu]\nmemory_total = 1\n", "test-1.toml: gpu: must be an array of tables"),
        ("gpu = 3\n", "test-1.toml: fake.gpu: unknown key"),
        ("[[gpu]\n", "test-1.toml: not valid TOML"),
    ],
)
def test_bad_files_raise_one_line_scenario_errors(
    write_scenario: Callable[..., Path], body: str, message: str
) -> None:
    with pytest.raises(ScenarioError) as raised:
        load_scenario(write_scenario(body), known_symbols=is_implemented)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_unknown_scenario_name_lists_the_bundled_ones() -> None:
    with pytest.raises(ScenarioError, match=r"unknown scenario 'nope'.*workstation"):
        load_scenario("nope")
    with pytest.raises(ScenarioError, match="does not exist"):
        load_scenario("/no/such/file.toml")


def test_too_many_standins_points_at_ghosts(write_scenario: Callable[..., Path]) -> None:
    path = write_scenario(GPU + '[[process]]\ngpu = 0\nspawn = ["x"]\ncount = 65\n')
    with pytest.raises(ScenarioError, match=r"at most 64.*ghost"):
        load_scenario(path)


def test_cli_reports_a_bad_scenario_in_one_line_with_exit_code_3(
    write_scenario: Callable[..., Path], gpuwatch_cli: Callable[..., object], runtime_dir: Path
) -> None:
    path = write_scenario('[[gpu]]\nmemory_total = "lots"\n')
    for command in (["start"], ["exec"]):
        extra = ["--", "true"] if command == ["exec"] else []
        result = gpuwatch_cli(
            "fake-nvml", *command, "--runtime-dir", str(runtime_dir), str(path), *extra
        )
        assert result.returncode == 3, result.stderr  # type: ignore[attr-defined]
        assert result.stderr.strip().splitlines() == [  # type: ignore[attr-defined]
            f"gpuwatch: error: {path.name}: gpu[0].memory_total: expected a size such as 80GiB, got 'lots'"
        ]
