"""OOM incidents cannot use up the budget of the reaper's warnings.

Any local user can make a host's agent forward OOM incidents; the server gives the
host's ``reaped`` events (warnings, withdrawals, stops) a bucket of their own, so a
flood of OOMs that is answered 429 leaves the warning an owner is owed unrefused.
Real HTTP against the app on a fake clock.
"""

from __future__ import annotations

from typing import Any

import pytest

from server.harness import T0, Live


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _event(kind: str, n: int) -> dict[str, Any]:
    return {
        "kind": kind,
        "hostname": "host-a",
        "pid": n,
        "summary": "CUDA out of memory" if kind == "oom" else "will be stopped in 30m",
        "evidence": {"stage": "warning"} if kind == "reaped" else {},
        "occurred_at": T0,
    }


def test_a_flood_of_oom_events_leaves_the_reapers_budget_whole(live: Live) -> None:
    token = live.token("host-a")

    def post(kind: str, n: int) -> int:
        response = live.client.post("/api/v1/events", json=_event(kind, n), headers=bearer(token))
        return response.status_code

    answers = [post("oom", n) for n in range(70)]
    assert answers[:60] == [200] * 60 and set(answers[60:]) == {429}
    # The host's OOM bucket is empty; its warning still goes through, every one of a
    # burst of them.
    assert [post("reaped", 1000 + n) for n in range(5)] == [200] * 5
    assert post("oom", 2000) == 429


def test_reaped_events_have_a_limit_of_their_own(live: Live) -> None:
    token = live.token("host-a")
    answers = [
        live.client.post(
            "/api/v1/events", json=_event("reaped", n), headers=bearer(token)
        ).status_code
        for n in range(62)
    ]
    assert answers[:60] == [200] * 60 and answers[60:] == [429, 429]
    # ...and using it up leaves the other kinds theirs.
    oom = live.client.post("/api/v1/events", json=_event("oom", 99), headers=bearer(token))
    assert oom.status_code == 200
