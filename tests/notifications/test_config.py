"""Receiver configuration: what is accepted, and the one clear line for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from gpuwatch.errors import ConfigError
from gpuwatch.server.notifications.config import (
    ReceiverConfig,
    ReceiverList,
    check_unique_names,
)
from gpuwatch.settings import ServerSettings, load

SLACK = "https://hooks.slack.com/services/T0000/B0000/XXXXXXXX"


def first_message(**values: object) -> str:
    with pytest.raises(ValidationError) as caught:
        ReceiverConfig(**values)  # type: ignore[arg-type]
    error = caught.value.errors()[0]
    return str(error["msg"]).removeprefix("Value error, ")


def test_the_three_types_with_defaults() -> None:
    slack = ReceiverConfig(name="team-a", type="slack", url=SLACK)  # type: ignore[arg-type]
    assert slack.url.get_secret_value() == SLACK
    assert (slack.secret, slack.send_resolved, slack.timeout_seconds) == (None, True, 10.0)
    hook = ReceiverConfig(
        name="ops.hook_1", type="webhook", url="http://10.0.0.5:8080/x", secret="k"
    )  # type: ignore[arg-type]
    assert hook.secret is not None and hook.secret.get_secret_value() == "k"
    am = ReceiverConfig(
        name="am",
        type="alertmanager",
        url="http://am:9093",
        send_resolved=False,
        timeout_seconds=60,
    )  # type: ignore[arg-type]
    assert am.public() == {
        "name": "am",
        "type": "alertmanager",
        "send_resolved": False,
        "timeout_seconds": 60.0,
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"type": "slack", "url": SLACK, "channel": "#x"}, "Extra inputs are not permitted"),
        (
            {"type": "webhook", "url": "https://example.com/hook"},
            "webhook receiver 'team-a': a webhook receiver needs a secret (the HMAC key)",
        ),
        (
            {"type": "webhook", "url": "https://example.com/hook", "secret": ""},
            "webhook receiver 'team-a': a webhook receiver needs a secret (the HMAC key)",
        ),
        (
            {"type": "slack", "url": SLACK, "secret": "k"},
            "slack receiver 'team-a': secret is only for webhook receivers",
        ),
        (
            {"type": "alertmanager", "url": "http://am:9093", "secret": "k"},
            "alertmanager receiver 'team-a': secret is only for webhook receivers",
        ),
        (
            {"type": "slack", "url": "ftp://hooks.slack.com/x"},
            "slack receiver 'team-a': url must start with http:// or https://",
        ),
        (
            {"type": "slack", "url": "hooks.slack.com/services/x"},
            "slack receiver 'team-a': url must start with http:// or https://",
        ),
        ({"type": "slack", "url": "https:///x"}, "slack receiver 'team-a': url has no host"),
        (
            {"type": "slack", "url": "https://hooks.slack.com:99999/x"},
            "slack receiver 'team-a': url is not a valid URL",
        ),
        (
            {"type": "slack", "url": "https://hooks.slack.com/a b"},
            "slack receiver 'team-a': url contains whitespace",
        ),
        ({"type": "teams", "url": SLACK}, "Input should be 'slack', 'webhook' or 'alertmanager'"),
        ({"type": "slack"}, "Field required"),
        ({"type": "slack", "url": SLACK, "timeout_seconds": 0}, "Input should be greater than 0"),
        (
            {"type": "slack", "url": SLACK, "timeout_seconds": 61},
            "Input should be less than or equal to 60",
        ),
    ],
)
def test_bad_config_has_a_clear_first_error(values: dict[str, object], message: str) -> None:
    assert first_message(name="team-a", **values) == message


@pytest.mark.parametrize("name", ["", "a" * 65, "team a", "team/a", "tëam"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ReceiverConfig(name=name, type="slack", url=SLACK)  # type: ignore[arg-type]
    assert caught.value.errors()[0]["loc"] == ("name",)


def test_duplicate_names() -> None:
    a = ReceiverConfig(name="a", type="slack", url=SLACK)  # type: ignore[arg-type]
    b = ReceiverConfig(name="b", type="slack", url=SLACK)  # type: ignore[arg-type]
    assert check_unique_names([a, b]) == [a, b]
    with pytest.raises(ValueError, match="duplicate receiver name 'a'"):
        check_unique_names([a, b, a])

    class Settings(BaseModel):
        receivers: ReceiverList = []

    with pytest.raises(ValidationError) as caught:
        Settings(receivers=[a, b, a])
    error = caught.value.errors()[0]
    assert error["loc"] == ("receivers",)
    assert error["msg"] == "Value error, duplicate receiver name 'a'"


RECEIVERS_TOML = f"""\
[server]
listen = "127.0.0.1:9403"

[[server.receivers]]
name = "team-a"
type = "slack"
url = "{SLACK}"

[[server.receivers]]
name = "ops-hook"
type = "webhook"
url = "https://ops.example.com/gpuwatch"
secret = "shared-secret"
timeout_seconds = 5
"""


def test_receivers_load_from_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(RECEIVERS_TOML)
    monkeypatch.setenv("GPUWATCH_CONFIG", str(path))
    settings = load(ServerSettings)
    receivers = settings.receivers  # type: ignore[attr-defined]
    assert [(r.name, r.type) for r in receivers] == [("team-a", "slack"), ("ops-hook", "webhook")]
    assert receivers[1].timeout_seconds == 5.0
    assert SLACK not in repr(settings)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ('secret = "shared-secret"\n', ""),
            "receivers.1: webhook receiver 'ops-hook': a webhook receiver needs a secret",
        ),
        (('name = "ops-hook"', 'name = "team-a"'), "duplicate receiver name 'team-a'"),
        (('type = "slack"', 'type = "slack"\ncolour = "red"'), "receivers.0.colour: Extra inputs"),
        (("https://ops.example.com", "ops.example.com"), "url must start with http://"),
        (
            ("timeout_seconds = 5", "timeout_seconds = 40"),
            "alerts.delivery_lease (120s) must exceed 3 x the timeout_seconds of receiver(s) ops-hook",
        ),
    ],
)
def test_bad_receivers_in_the_config_file_stop_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str], message: str
) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(RECEIVERS_TOML.replace(*edit))
    monkeypatch.setenv("GPUWATCH_CONFIG", str(path))
    with pytest.raises(ConfigError) as caught:
        load(ServerSettings)
    text = str(caught.value)
    assert "\n" not in text and message in text
    assert SLACK not in text and "shared-secret" not in text
