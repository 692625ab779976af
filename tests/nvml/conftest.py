"""Fixtures for NVML-layer tests: the real pynvml over the fake GPUs beneath it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.nvml import fake


@pytest.fixture
def fake_gpus(tmp_path: Path) -> Iterator[Callable[..., fake.FakeHost]]:
    """``fake_gpus(toml_text, at=seconds)`` installs a scenario; cleaned up afterwards."""
    runtime = tmp_path / "runtime"
    installed: list[tuple[Path, fake.FakeHost]] = []

    def install(text: str, *, at: float | None = 0.0, name: str = "scenario") -> fake.FakeHost:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        host = fake.install(path, runtime_dir=runtime, at=at)
        installed.append((path, host))
        return host

    yield install
    fake.uninstall()
    for _, host in installed:
        host.stop()
