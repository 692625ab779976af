"""Who the scenario says owns each stand-in: the ``USER`` of its ``env``.

Stand-ins are started by whoever boots the scenario, so ``/proc`` shows them all as
one Unix user (root in a container). A scenario of a shared box names its people
instead: ``env = { USER = "alice" }``. :func:`declared_users` gives the agent those
names, keyed by PID *and* start time, so a PID reused by another process after a
stand-in exits is never given a declared name. The agent asks only on simulated GPUs
(``HostSnapshot.fake``); the uid it reports stays the real one from ``/proc``.
"""

from __future__ import annotations

from gpuwatch.nvml.fake.host import FakeHost
from gpuwatch.nvml.fake.scenario import Spawn


def declared_users(host: FakeHost) -> dict[tuple[int, int], str]:
    """``(pid, start ticks) -> user name`` for each stand-in whose scenario env has a
    non-empty ``USER`` (else ``LOGNAME``). Attached and ghost PIDs are not stand-ins:
    they are left out."""
    standins = set(host.state.standins)
    names: dict[tuple[int, int], str] = {}
    for process in host.scenario.processes:
        identity = host.state.processes.get(process.key)
        if (
            process.key not in standins
            or identity is None
            or identity.start_ticks is None
            or not isinstance(process.origin, Spawn)
        ):
            continue
        env = dict(process.origin.env)
        user = env.get("USER") or env.get("LOGNAME")
        if user:
            names[(identity.pid, identity.start_ticks)] = user
    return names
