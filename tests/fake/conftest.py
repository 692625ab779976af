"""Fixtures for the fake GPUs: a private runtime dir, scenario files, an injected clock.

Every test that boots stand-ins does so in its own runtime dir, and the fixture stops
every scenario recorded there afterwards, so no stand-in outlives its test. Scenario
files written by tests also set a short ``lifetime`` as a second line of defence.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from gpuwatch.nvml import fake
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.procfs import ProcessIdentity, is_alive

REPO_ROOT = Path(__file__).resolve().parents[2]


class ManualClock:
    """A wall clock (Unix seconds) that moves only when a test says so."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "runtime"
    yield directory
    fake.uninstall()
    if directory.exists():
        stop_all(directory)


@pytest.fixture
def write_scenario(tmp_path: Path) -> Callable[[str], Path]:
    """Write a scenario file; a ``[fake]`` table with a 2-minute lifetime is prepended."""
    count = 0

    def write(body: str, *, name: str = "test") -> Path:
        nonlocal count
        count += 1
        path = tmp_path / f"{name}-{count}.toml"
        header = f'[fake]\nname = "{name}"\nlifetime = "2m"\n'
        path.write_text(header + textwrap.dedent(body), encoding="utf-8")
        return path

    return write


@pytest.fixture
def nvml() -> Iterator[None]:
    """nvmlInit / nvmlShutdown around a test (after the test installed a fake)."""
    pynvml.nvmlInit()
    yield
    pynvml.nvmlShutdown()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _wait_until_dead(identity: ProcessIdentity, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while is_alive(identity):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {identity.pid} did not exit")
        time.sleep(0.01)


@pytest.fixture
def wait_until_dead() -> Callable[..., None]:
    """Block until a process we signalled is gone (bounded polling, not a fixed sleep)."""
    return _wait_until_dead


def _run_gpuwatch(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


@pytest.fixture
def gpuwatch_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real ``gpuwatch`` CLI in a child process: ``gpuwatch_cli("fake-nvml", ...)``."""
    return _run_gpuwatch
