"""gpuwatch_nvml_errors_total counts failures, not the answers a MIG GPU gives every poll.

An H100 or A100 in MIG mode answers NOT_FOUND for each empty instance slot the agent
probes, and NOT_SUPPORTED for the GPU-wide and per-process utilization NVML has no
figure for in MIG mode. Counted, they made a steady "error rate" on every MIG host on
the agents dashboard, indistinguishable from a real fault. The real pynvml runs over the
bundled fake MIG GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

# Calls whose MIG-mode answers are not failures.
MIG_ANSWERS = {
    ("nvmlDeviceGetMigDeviceHandleByIndex", "not_found"),
    ("nvmlDeviceGetUtilizationRates", "not_supported"),
    ("nvmlDeviceGetProcessUtilization", "not_supported"),
}


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[object]:
    hosts = []

    def install(name: str, extra: str = "") -> None:
        source = Path(fake.__file__).parent / "scenarios" / f"{name}.toml"
        path = tmp_path / f"{name}.toml"
        path.write_text(source.read_text() + extra)
        hosts.append(fake.install(path, runtime_dir=tmp_path / "runtime", at=0.0))

    yield install
    fake.uninstall()
    for host in hosts:
        host.stop()


@pytest.mark.parametrize("name", ["h100-mig", "a100-mig"])
def test_mig_probing_counts_no_errors(scenario, name: str) -> None:
    scenario(name)
    with NvmlSession.open() as session:
        for _ in range(3):  # every poll probes the slots again
            readings = [session.read_device(i) for i in range(session.device_count())]
        errors = session.errors.snapshot()
    assert any(r.mig for r in readings)  # the scenario is in MIG mode, with empty slots
    assert not MIG_ANSWERS & set(errors), errors


def test_a_real_failure_of_the_same_calls_is_still_counted(scenario) -> None:
    scenario(
        "h100-mig",
        '\n[[fault]]\ngpu = 0\nat = "0s"\nkind = "unknown"\n'
        'function = "nvmlDeviceGetUtilizationRates"\n',
    )
    with NvmlSession.open() as session:
        session.read_device(0)
        errors = session.errors.snapshot()
    assert errors[("nvmlDeviceGetUtilizationRates", "unknown")] == 1
