"""``gpuwatch server`` as a real process, for faults that need one: a kill, a restart.

Started from the CLI as deployed (migrations, uvicorn, the scheduler and alert engine
when the config asks), on an ephemeral port. Its stderr (the log) goes to a file the
test reads afterwards: a fault must never make the server log an ERROR.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

GPUWATCH = [sys.executable, "-m", "gpuwatch"]
# Generous: a fresh process imports, migrates and binds; a loaded 2-core CI machine
# may take several seconds. Waits end as soon as their condition holds.
DEADLINE_SECONDS = 60.0
T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], what: str, deadline: float = DEADLINE_SECONDS) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``deadline``."""
    end = time.monotonic() + deadline
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline:.0f} s waiting for {what}")
        time.sleep(0.02)


class ServerProcess:
    """One ``gpuwatch server`` process; :attr:`url` once it answers ``/healthz``."""

    def __init__(
        self,
        tmp: Path,
        database_url: str,
        *,
        name: str = "server",
        config: Path | None = None,
        log_level: str = "warning",
    ) -> None:
        self.database_url = database_url
        self.log_path = tmp / f"{name}.log"
        env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
        env |= {
            "GPUWATCH_CONFIG": str(config) if config is not None else "/dev/null",
            "GPUWATCH_SERVER_DATA_DIR": str(tmp / "data"),
        }
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [*GPUWATCH, "--log-level", log_level, "server",
                 "--listen", "127.0.0.1:0", "--database-url", database_url],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip
        self.pid = self.process.pid
        try:
            self.url = wait_for(self._banner, f"{name} to listen")
            wait_for(self._healthy, f"{name} health")
        except BaseException:
            self.kill()  # never leave a server behind a failed start
            raise

    def _banner(self) -> str | None:
        if self.process.poll() is not None:
            raise AssertionError(f"server exited ({self.process.returncode}): {self.log()}")
        match = re.search(r"listening on (http://\S+)", self.log())
        return match.group(1) if match else None

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"server exited ({self.process.returncode}): {self.log()}")
        return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def errors(self) -> list[str]:
        """Log lines at ERROR or above, and tracebacks: a fault handled never logs one."""
        return [
            line
            for line in self.log().splitlines()
            if re.search(r" (ERROR|CRITICAL) ", line) or line.startswith("Traceback")
        ]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the server's ``/metrics``, whatever its labels' order (0 when
        absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
            if dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == labels:
                return float(match.group(2))
        return 0.0

    def kill(self) -> None:
        """SIGKILL: no shutdown hook, no last commit, as the OOM killer or a power cut."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=DEADLINE_SECONDS)

    def stop(self) -> None:
        """SIGTERM and a bounded wait (then SIGKILL): the orderly end of a test."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
