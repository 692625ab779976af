"""Retiring a decommissioned host (``gpuwatch token revoke HOST --retire``).

A host taken out of the fleet stops pushing, and without this it would stay
``agent_silent`` for ever: its event refreshed, its ``gpuwatch_fleet_agent_silent``
series at 1 (the shipped alert firing), its tiles greyed on the fleet page. Retiring
it, in one transaction: revokes its tokens, ends its open process lifetimes (at their
last sighting) and every open event (now, each with its ``closed`` change, so alerts
resolve), and sets ``hosts.retired_at``. From then on the silence job, the fleet
summary, the fleet page and the fleet metrics leave it out. Its history (lifetimes,
samples, events) stays until retention removes it, and ``/api/v1/hosts`` still lists
it, with ``retired_at``. A new token for the host (``gpuwatch token create``) brings
it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpuwatch.server.auth.service import revoke_tokens
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.ingest.apply import end_all_lifetimes
from gpuwatch.server.ingest.state import HostState


@dataclass(frozen=True)
class Retired:
    """What retiring a host did."""

    tokens: int
    lifetimes: int
    events: int


def retire_host(*, session: Session, dialect: str, hostname: str, now: float) -> Retired | None:
    """Retire ``hostname`` (see the module); ``None`` if no such host. The caller commits.

    Retiring a host already retired revokes any token made since, ends nothing new
    and keeps its ``retired_at``: the host left the fleet when it was first retired.

    Tokens are revoked before the host row is locked: the order every writer takes
    those locks in (gpuwatch/server/deps.py, ``confirm_push``), so that on Postgres a
    push in flight either commits first or, once this commits, finds its token revoked.
    """
    host_id = session.scalar(select(Host.id).where(Host.hostname == hostname))
    if host_id is None:
        return None
    tokens = revoke_tokens(session=session, hostname=hostname, now=now)
    # Locks the host row (Postgres) against a push in flight, as ingest does.
    state = HostState.load(session=session, dialect=dialect, host_id=host_id)
    events = len(state.events.open_keys(""))
    lifetimes = end_all_lifetimes(state)  # ends their process events too
    for key in state.events.open_keys(""):
        state.events.clear(key, at=now)
    state.flush()  # bumps state_version: every server's cached copy is stale
    session.execute(
        update(Host)
        .where(Host.id == host_id)
        .values(retired_at=func.coalesce(Host.retired_at, now))
    )
    return Retired(tokens=tokens, lifetimes=lifetimes, events=events)
