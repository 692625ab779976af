"""The test notification (`gpuwatch alerts test-receiver`) carries a ``group_key`` in the
format alerts-webhook.md documents for every notification, built from the server's own
``group_by``: a consumer that parses it is checked by the test meant to check it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server.harness import serve

from gpuwatch.server.app import create_app
from gpuwatch.server.database.core import create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import ServerSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "alerts-webhook.md"
# alerts-webhook.md: "the values of the grouping labels ..., as {rule='…',hostname='…'}".
DOCUMENTED_KEY = re.compile(r"\{(?:\w+='[^']*'(?:,\w+='[^']*')*)?\}")


def _documented_key(labels: dict[str, str]) -> str:
    return "{" + ",".join(f"{name}='{value}'" for name, value in labels.items()) + "}"


@pytest.fixture
def sent_test(
    tmp_path: Path, receiver_server: Any
) -> Iterator[Callable[[list[str] | None], dict[str, object]]]:
    """POST /api/v1/receivers/hook/test on a server whose alerts group by ``group_by``;
    the JSON body the webhook received."""

    def send(group_by: list[str] | None) -> dict[str, object]:
        url = f"sqlite:///{tmp_path / 'gpuwatch.db'}"
        database = create_database(url)
        upgrade(database)
        database.dispose()
        alerts = {} if group_by is None else {"group_by": group_by}
        settings = ServerSettings.model_validate(
            {
                "data_dir": tmp_path,
                "database_url": url,
                "scheduler": False,
                "receivers": [
                    {
                        "name": "hook",
                        "type": "webhook",
                        "url": receiver_server.url("/h"),
                        "secret": "k",
                    }
                ],
                "alerts": alerts,
            }
        )
        with serve(create_app(settings)) as url:
            answer = httpx.post(f"{url}/api/v1/receivers/hook/test", timeout=30, trust_env=False)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outcome"] == "sent"
        (received,) = receiver_server.received
        return json.loads(received.body)

    yield send


@pytest.mark.parametrize(
    ("group_by", "labels"),
    [
        (None, {"rule": "test", "hostname": "gpuwatch-test"}),
        (["rule", "hostname", "gpu"], {"rule": "test", "hostname": "gpuwatch-test", "gpu": "0"}),
    ],
    ids=["default-group-by", "configured-group-by"],
)
def test_the_test_notification_s_group_key_has_the_documented_format(
    sent_test: Callable[[list[str] | None], dict[str, object]],
    group_by: list[str] | None,
    labels: dict[str, str],
) -> None:
    body = sent_test(group_by)
    assert body["group_labels"] == labels
    assert body["group_key"] == _documented_key(labels)
    assert DOCUMENTED_KEY.fullmatch(str(body["group_key"]))


def test_the_documented_example_key_matches_the_format_checked_here() -> None:
    example = re.search(r'"group_key": "([^"]*)"', DOC.read_text(encoding="utf-8"))
    assert example is not None and DOCUMENTED_KEY.fullmatch(example.group(1))
