"""The central server's memory of a GPU: what happened there in the last hour.

``gpuwatch explain`` asks the server (when one is configured: ``--server`` or the
agent's ``server_url`` setting) for the events on this host's GPU over the last hour:
idle holders, orphans, leaks, earlier OOMs. A forgotten notebook that has held 20 GiB
since this morning, or a leak that has been climbing for forty minutes, is the
context that tells "your batch is too big" apart from "somebody else's job ate it".
Like the live agent view, this is best effort: no server, or no answer, means no
history, never an error.
"""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuwatch.wire import EVENTS_PATH

log = logging.getLogger(__name__)

WINDOW_SECONDS = 3600.0
MAX_EVENTS = 20


class PastEvent(BaseModel):
    """One server event on the GPU, as ``explain`` reports it."""

    model_config = ConfigDict(extra="ignore")  # the server's event has more fields

    kind: str
    reason: str
    pid: int | None = None
    user: str | None = None
    held_bytes: int | None = None
    summary: str
    started_at: float
    ended_at: float | None = None


def fetch_gpu_history(
    server_url: str,
    *,
    hostname: str,
    gpu_index: int,
    now: float,
    read_token: str | None = None,
    timeout: float = 2.0,
    transport: httpx.BaseTransport | None = None,
) -> list[PastEvent] | None:
    """Events on ``hostname`` GPU ``gpu_index`` open or ended in the last hour.

    ``None`` when the server cannot be asked (unreachable, refused, or an answer that
    is not an event page); an empty list when it answered and nothing happened.
    """
    params: dict[str, str | int | float] = {
        "host": hostname,
        "gpu": gpu_index,
        "since": now - WINDOW_SECONDS,
        "limit": MAX_EVENTS,
    }
    headers = {"Authorization": f"Bearer {read_token}"} if read_token else {}
    try:
        with httpx.Client(transport=transport, timeout=timeout) as client:
            response = client.get(
                server_url.rstrip("/") + EVENTS_PATH, params=params, headers=headers
            )
    except httpx.HTTPError as err:
        log.debug("no history from %s: %s", server_url, type(err).__name__)
        return None
    if not response.is_success:
        log.debug("no history from %s: HTTP %s", server_url, response.status_code)
        return None
    try:
        items = response.json().get("items", [])
        return [PastEvent.model_validate(item) for item in items]
    except (ValueError, AttributeError, TypeError, ValidationError):  # not the shape we asked for
        return None
