"""Fixtures shared by every test area, and how ``pytest -n`` shares the tests out."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

# Fakes started by name (``--fake-gpus workstation``, ``fake-nvml stop workstation``) are
# found through the user's runtime dir, so a developer's own demo or a second test run
# as the same user could share them, or stop them under a running test. Each pytest
# process (each xdist worker) gets a runtime dir of its own.
_RUNTIME_DIR = tempfile.mkdtemp(prefix="gw-rt-")
os.environ["XDG_RUNTIME_DIR"] = _RUNTIME_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_RUNTIME_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests where there is no NVIDIA driver; everything else must run."""
    has_driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    if has_driver:
        return
    skip = pytest.mark.skip(reason="no NVIDIA driver on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- sharing the tests out among xdist workers (``./dev test``, ``pytest -n N``) --------
#
# xdist's default ("load") deals tests out in file order. That splits a module's tests
# between workers, so a module-scoped fixture (the Prometheus stack of test_grafana.py,
# the dashboard's site) is built once per worker, and it leaves the slowest modules
# (test_demo.py, near the end of the order) running alone at the end while the other
# workers idle. Instead each test module is one unit of work, handed out biggest first,
# each unit to whichever worker runs out of work first (longest-processing-time first).
#
# Seconds each of the slowest modules takes (setup, call and teardown, summed over its
# tests, on a 2-core VM). Only the order of the work depends on these figures; a
# module not listed counts a tenth of a second a test. ``--dist`` named explicitly
# (loadfile, worksteal, ...) keeps xdist's own schedulers.
MODULE_SECONDS = {
    "tests/faults/test_schemathesis.py": 67,
    "tests/server/test_hostile.py": 50,
    "tests/fake/test_fake_tools.py": 54,
    "tests/server/test_alerts_cli.py": 40,
    "tests/reaper/test_reap_cli.py": 35,
    "tests/server/test_cli.py": 35,
    "tests/test_demo.py": 32,
    "tests/faults/test_server_killed.py": 28,
    "tests/deploy/test_packaging.py": 27,
    "tests/server/test_alerts_timeline.py": 25,
    "tests/test_cli_hostile.py": 24,
    "tests/doctor/test_doctor_cli.py": 20,
    "tests/faults/test_agent_killed.py": 18,
    "tests/deploy/test_grafana.py": 15,
    "tests/e2e/test_agent_to_server.py": 13,
    "tests/deploy/test_agent_identity.py": 12,
    "tests/server/test_silence_limits.py": 10,
    "tests/server/test_detection_events.py": 10,
    "tests/server/test_database_writable.py": 9,
    "tests/reaper/test_reap_safety.py": 9,
    "tests/reaper/test_reap_server.py": 9,
    "tests/web/test_pages.py": 9,
    "tests/detectors/test_properties.py": 9,
    "tests/faults/test_server_outage.py": 8,
    "tests/fake/test_fake_exec.py": 8,
}
SECONDS_PER_UNLISTED_TEST = 0.1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # These are xdist's own (private) hooks: on a version without them, its default.
    if not all(
        hasattr(LoadScopeScheduling, name) for name in ("_split_scope", "_assign_work_unit")
    ):
        return None

    class BiggestModuleFirst(LoadScopeScheduling):
        """xdist's loadscope, a unit being a whole module, biggest unit first."""

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: Any) -> None:
            def seconds(module: str) -> float:
                listed = MODULE_SECONDS.get(module)
                if listed is not None:
                    return listed
                return SECONDS_PER_UNLISTED_TEST * len(self.workqueue[module])

            queue = getattr(self, "workqueue", None)
            if queue:
                queue.move_to_end(max(queue, key=seconds), last=False)
            super()._assign_work_unit(node)

    return BiggestModuleFirst(config, log)
