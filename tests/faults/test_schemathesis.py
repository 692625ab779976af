"""Schemathesis over the live server's OpenAPI schema: every operation, every kind of
caller, valid and invalid data.

The real server runs under uvicorn on SQLite with ``read_token`` and ``admin_token``
set. Each operation is generated from ``/openapi.json`` and sent four ways: with no
token, the read token, the admin token, and an agent token whose host is the one the
generated bodies name (a hook puts it into every ``hostname`` that is valid, so ingest
really stores what passes validation rather than refusing it as another host's).
Positive and negative data both; the checks are the two the issue asks for:

* ``not_a_server_error``: no 5xx, for anything;
* ``negative_data_rejection``: a body or parameter the schema says is invalid is never
  answered 2xx (413 counts as a rejection too: a body past the size limit).

Bounded: a few examples per operation and mode, no deadline; the run takes well under
a minute.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from pydantic import SecretStr
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection
from server.conftest import fresh_postgres_schema
from server.harness import make_token, serve

from gpuwatch.server.app import create_app
from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import ServerSettings

READ_TOKEN = "read-" + "r" * 40
ADMIN_TOKEN = "admin-" + "a" * 40
AGENT_HOST = "st-host"
MAX_EXAMPLES = 8
_VALID_HOSTNAME = re.compile(r"[^\x00]{0,256}")

CONFIG = {
    # Callers set Authorization themselves; generating (or negating) it too would make
    # a "missing token" case that our header then supplies.
    "generation": {
        "mode": "all",
        "max-examples": MAX_EXAMPLES,
        "deterministic": True,
        "with-security-parameters": False,
    },
    "phases": {
        "examples": {"enabled": True},
        "coverage": {"enabled": False},
        "fuzzing": {"enabled": True},
        "stateful": {"enabled": False},
    },
    "checks": {
        "negative_data_rejection": {
            # 429: a host past its event rate is refused before its body is read.
            "expected-statuses": [
                "400",
                "401",
                "403",
                "404",
                "405",
                "409",
                "413",
                "415",
                "422",
                "429",
            ]
        }
    },
    "suppress-health-check": ["all"],
}

statuses: Counter[tuple[str, str, int]] = Counter()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp: Path = tmp_path_factory.mktemp("schemathesis")
    with _serving(f"sqlite:///{tmp / 'central.db'}", tmp) as served:
        yield served


@pytest.fixture(scope="module")
def live_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The same server on a fresh schema of the real Postgres: some inputs are fine for
    SQLite and a 500 there (a NUL in a query filter was)."""
    tmp: Path = tmp_path_factory.mktemp("schemathesis-postgres")
    with fresh_postgres_schema() as url, _serving(url, tmp) as served:
        yield served


@contextlib.contextmanager
def _serving(url: str, tmp: Path) -> Iterator[dict[str, str]]:
    database = create_database(url)
    upgrade(database)
    settings = ServerSettings(
        data_dir=tmp,
        database_url=url,
        scheduler=False,
        read_token=SecretStr(READ_TOKEN),
        admin_token=SecretStr(ADMIN_TOKEN),
    )
    agent = make_token(database, AGENT_HOST)
    try:
        with serve(create_app(settings, engine=database.engine)) as base:
            yield {
                "url": base,
                "none": "",
                "read": READ_TOKEN,
                "admin": ADMIN_TOKEN,
                "agent": agent,
            }
    finally:
        database.dispose()


@pytest.fixture(scope="module")
def api_schema(live: dict[str, str]) -> Any:
    schema = schemathesis.openapi.from_url(
        f"{live['url']}/openapi.json", config=schemathesis.Config.from_dict(CONFIG)
    )

    @schema.hook
    def map_body(context: Any, body: Any) -> Any:
        _claim_hostnames(body)
        return body

    return schema


def _claim_hostnames(body: Any) -> None:
    """Put the agent token's host in every *valid* ``hostname`` of an ingest body (a
    snapshot batch or an event), leaving invalid ones invalid."""
    if not isinstance(body, dict):
        return
    items = body.get("snapshots") if isinstance(body.get("snapshots"), list) else [body]
    for item in items:
        if isinstance(item, dict) and _is_valid_hostname(item.get("hostname")):
            item["hostname"] = AGENT_HOST


def _is_valid_hostname(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) <= 256
        and _VALID_HOSTNAME.fullmatch(value) is not None
    )


CALLERS = ["none", "read", "admin", "agent"]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


def exercise(
    operation: Any, mode: GenerationMode, live: dict[str, str], caller: str, *, label: str = ""
) -> None:
    """Up to MAX_EXAMPLES generated requests of one operation; raises on the first
    failed check (after Hypothesis has shrunk it). ``label`` names the server in
    ``statuses``."""
    token = live[caller]
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        response = case.call(base_url=live["url"], headers=headers, timeout=30)
        statuses[(f"{case.method} {case.path}", caller + label, response.status_code)] += 1
        case.validate_response(
            response, checks=[not_a_server_error, negative_data_rejection], headers=headers
        )

    check()


@pytest.mark.parametrize("caller", CALLERS)
def test_no_server_errors_and_no_invalid_data_accepted(
    api_schema: Any, live: dict[str, str], caller: str
) -> None:
    _exercise_all(api_schema, live, caller, label="")


# Without a token every operation is refused before the database: SQLite's run says that.
@pytest.mark.postgres
@pytest.mark.parametrize("caller", ["read", "admin", "agent"])
def test_no_server_errors_and_no_invalid_data_accepted_on_postgres(
    api_schema: Any, live_postgres: dict[str, str], caller: str
) -> None:
    # The cases are generated from the SQLite server's document (the same app) and sent
    # to this one.
    _exercise_all(api_schema, live_postgres, caller, label="@postgres")


def _exercise_all(api_schema: Any, live: dict[str, str], caller: str, *, label: str) -> None:
    failures = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            try:
                exercise(operation, mode, live, caller, label=label)
            except Unsatisfiable:
                continue  # nothing to make invalid: an operation with no inputs (/healthz)
            except Exception as err:  # every operation is run; failures reported together
                failures.append(f"{operation.label} [{mode.value}]: {err}")
    assert not failures, "\n\n".join(failures)
    if caller == "agent":
        # Generated batches were stored, not all refused: ingest was really exercised.
        stored = statuses[("POST /api/v1/snapshots", "agent" + label, 200)]
        assert stored > 0


def test_a_json_boolean_is_not_an_integer(live: dict[str, str]) -> None:
    event = {
        "kind": "oom",
        "hostname": AGENT_HOST,
        "gpu_index": False,
        "summary": "CUDA out of memory",
        "occurred_at": 1_800_000_000.0,
    }
    response = httpx.post(
        f"{live['url']}/api/v1/events",
        json=event,
        headers={"Authorization": f"Bearer {live['agent']}"},
        timeout=30,
    )
    assert response.status_code == 422


def _snapshot(sequence: int, **process: Any) -> dict[str, Any]:
    return {
        "agent_id": "agent-st",
        "hostname": AGENT_HOST,
        "boot_id": "boot-st",
        "sequence": sequence,
        "collected_at": 1_700_000_000.0 + sequence,  # the past: the server runs on real time
        "gpus": [{"index": 0, "uuid": "GPU-st-0", "processes": [{"pid": 7, **process}]}],
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", True),  # integer
        ("pid", "7"),
        ("pid", 7.5),
        ("used_bytes", False),  # nullable integer
        ("sm_ratio", True),  # number
        ("sm_ratio", "0.5"),
        ("orphaned", 1),  # boolean
        ("orphaned", "true"),
    ],
)
def test_a_snapshot_takes_only_its_schemas_types(
    live: dict[str, str], field: str, value: object
) -> None:
    headers = {"Authorization": f"Bearer {live['agent']}"}
    bad = {"snapshots": [_snapshot(1, **{field: value})]}

    response = httpx.post(f"{live['url']}/api/v1/snapshots", json=bad, headers=headers, timeout=30)

    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][-1] == field


def test_a_whole_number_is_an_integer_as_the_schema_says(live: dict[str, str]) -> None:
    # JSON Schema's integer is any number without a fractional part: 7.0 is 7.
    headers = {"Authorization": f"Bearer {live['agent']}"}
    body = {"snapshots": [_snapshot(2, used_bytes=1024.0)]}

    response = httpx.post(f"{live['url']}/api/v1/snapshots", json=body, headers=headers, timeout=30)

    assert response.status_code == 200, response.text
    assert response.json()["results"] == ["accepted"]


def test_a_silence_id_past_64_bits_is_422_not_500(live: dict[str, str]) -> None:
    # Found by the run above (admin caller): the id reached the driver unbounded.
    response = httpx.delete(
        f"{live['url']}/api/v1/silences/7314839670253611384832",
        headers={"Authorization": f"Bearer {live['admin']}"},
        timeout=30,
    )
    assert response.status_code == 422


def test_every_route_with_a_body_refuses_a_missing_token_before_reading_it(
    live: dict[str, str],
) -> None:
    # FastAPI reads and parses a body before it solves a route's dependencies: POST
    # /api/v1/silences read 8 MiB of JSON from anyone before its admin check said 401.
    document = httpx.get(f"{live['url']}/openapi.json", timeout=30).json()
    with_body = [
        (method.upper(), re.sub(r"\{[^}]+\}", "1", path))
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if "requestBody" in operation
    ]
    address, port = live["url"].removeprefix("http://").split(":")
    answers = {}
    for method, path in with_body:
        with socket.create_connection((address, int(port)), timeout=5) as conn:
            conn.sendall(
                f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                "Content-Length: 4194304\r\n\r\n".encode()
            )
            answers[(method, path)] = conn.recv(4096).split(b"\r\n", 1)[0]

    assert len(answers) >= 3  # snapshots, events, silences
    assert all(status == b"HTTP/1.1 401 Unauthorized" for status in answers.values()), answers
