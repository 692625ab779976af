"""Files served over HTTP on 127.0.0.1 by a process running as another user: a local
user who bound a port while the agent was down, or who answers in its place."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served_by(uid: int, files: dict[str, bytes]) -> Iterator[str]:
    """``python -m http.server`` run as ``uid`` on 127.0.0.1, serving ``files`` (URL
    path -> body, e.g. ``{"reaper/history": b"..."}``): its base URL."""
    served = Path(tempfile.mkdtemp())
    served.chmod(0o755)
    for name, body in files.items():
        path = served / name
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.write_bytes(body)
        path.chmod(0o644)
    port = free_port()
    server = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(served)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(10)
        shutil.rmtree(served)
