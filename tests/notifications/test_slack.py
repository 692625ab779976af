"""The Slack receiver against a local HTTP server that answers the way Slack does."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gpuwatch.server.alerts.rules import Candidate, describe
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.model import Culprit
from gpuwatch.server.notifications.receivers import build_receiver
from gpuwatch.server.notifications.receivers.slack import SlackReceiver

HOOK = "/services/T0000/B0000/XXXXXXXXXXXXXXXXXXXXXXXX"


def slack(url: str, client: httpx.Client, **extra: object) -> SlackReceiver:
    config = ReceiverConfig(name="team-a", type="slack", url=url, **extra)  # type: ignore[arg-type]
    receiver = build_receiver(config, client=client)
    assert isinstance(receiver, SlackReceiver)
    return receiver


def test_rate_limited_then_failing_then_ok_attempt_by_attempt(
    receiver_server, client, notification
) -> None:
    receiver_server.answer(
        429, '{"retry_after":1,"ok":false,"error":"rate_limited"}', Retry_After="3"
    )
    receiver_server.answer(500, "rollup_error")
    receiver_server.answer(503, "")
    receiver_server.answer(200, "ok")
    receiver = slack(receiver_server.url(HOOK), client)
    note = notification()

    first = receiver.attempt(note)
    assert (first.outcome, first.retry_after, first.status_code) == ("retry", 3.0, 429)
    assert first.detail == "slack receiver 'team-a': HTTP 429 rate_limited (retry after 3s)"
    second = receiver.attempt(note)
    assert (second.outcome, second.retry_after, second.status_code) == ("retry", None, 500)
    assert second.detail == "slack receiver 'team-a': HTTP 500 rollup_error"
    assert receiver.attempt(note).outcome == "retry"
    last = receiver.attempt(note)
    assert (last.outcome, last.status_code) == ("sent", 200)

    # Every attempt sent the same message, to the webhook's path.
    bodies = {r.body for r in receiver_server.received}
    assert len(receiver_server.received) == 4 and len(bodies) == 1
    assert {r.path for r in receiver_server.received} == {HOOK}
    assert receiver_server.received[0].headers["content-type"] == "application/json"


def test_retry_after_from_the_body_when_the_header_is_missing(
    receiver_server, client, notification
) -> None:
    receiver_server.answer(429, '{"retry_after":2,"ok":false,"error":"rate_limited"}')
    attempt = slack(receiver_server.url(HOOK), client).attempt(notification())
    assert (attempt.outcome, attempt.retry_after) == ("retry", 2.0)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, "invalid_payload"),
        (400, "user_not_found"),
        (403, "action_prohibited"),
        (403, "invalid_token"),
        (404, "channel_not_found"),
        (404, "no_team"),
        (410, "channel_is_archived"),
    ],
)
def test_permanent_failures_are_broken(
    receiver_server, client, notification, status: int, error: str
) -> None:
    receiver_server.answer(status, error)
    attempt = slack(receiver_server.url(HOOK), client).attempt(notification())
    assert attempt.outcome == "broken"
    assert attempt.status_code == status
    assert attempt.retry_after is None
    assert attempt.detail == f"slack receiver 'team-a': HTTP {status} {error}"


@pytest.mark.parametrize("body", ["", "not ok", '{"ok":true}', "<html>proxy login</html>"])
def test_a_200_whose_body_is_not_ok_is_broken(
    receiver_server, client, notification, body: str
) -> None:
    receiver_server.answer(200, body)
    attempt = slack(receiver_server.url(HOOK), client).attempt(notification())
    assert attempt.outcome == "broken"
    assert "the answer is not 'ok'" in attempt.detail


def test_a_redirect_is_not_followed(receiver_server, client, notification) -> None:
    receiver_server.answer(301, "", Location="http://elsewhere.invalid/")
    attempt = slack(receiver_server.url(HOOK), client).attempt(notification())
    assert attempt.outcome == "broken"
    assert len(receiver_server.received) == 1


def test_a_server_that_never_answers_times_out_into_a_retry(
    hanging_url, client, notification
) -> None:
    receiver = slack(hanging_url, client, timeout_seconds=0.3)
    started = time.monotonic()
    attempt = receiver.attempt(notification())
    assert time.monotonic() - started < 5
    assert attempt.outcome == "retry"
    assert attempt.detail.startswith("slack receiver 'team-a': timed out")


def test_a_refused_connection_is_a_retry(refused_url, client, notification) -> None:
    attempt = slack(refused_url, client).attempt(notification())
    assert attempt.outcome == "retry"
    assert attempt.detail == "slack receiver 'team-a': connection failed (ConnectError)"


def test_the_message_names_the_culprits_and_the_prediction(
    receiver_server, client, notification
) -> None:
    note = notification(external_url="https://gpuwatch.example.org/alerts")
    assert slack(receiver_server.url(HOOK), client).attempt(note).outcome == "sent"
    message = json.loads(receiver_server.received[0].body)

    text = message["text"]
    for fact in ("Firing: gpu_filling_up", "full in 18m", "alice", "python train.py", "bob"):
        assert fact in text

    blocks = message["blocks"]
    assert blocks[0]["type"] == "header"
    assert blocks[0]["text"] == {"type": "plain_text", "text": "🔥 Firing: gpu_filling_up"}
    sections = [b["text"]["text"] for b in blocks if b["type"] == "section"]
    assert "*GPU 3 on gpu-node-7 will be full in 18m*" in sections[0]
    assert "predicted full in 18m" in sections[0]
    culprits = sections[1]
    assert culprits.startswith("*Culprits*\n")
    alice = culprits.splitlines()[1]
    for fact in (
        "*alice*",
        "`python train.py --batch 512`",
        "61.0 GiB",
        "+1.2 GiB/min",
        "pid 48121",
        "Slurm job 918273",
        "container 4b8c1de2f3a4",
    ):
        assert fact in alice
    assert "*bob*" in culprits.splitlines()[2]
    context = next(b for b in blocks if b["type"] == "context")["elements"][0]["text"]
    assert "`hostname=gpu-node-7`" in context and "`gpu=3`" in context
    assert "<!date^1787000000^" in context
    assert blocks[-1]["elements"][0]["url"] == "https://gpuwatch.example.org/alerts"
    assert len(blocks) <= 50


def test_block_kit_limits_hold_for_a_large_group(receiver_server, client, notification, alert):
    many = [alert(fingerprint=f"f{i}", summary="x" * 400) for i in range(30)]
    note = notification(*many)
    assert slack(receiver_server.url(HOOK), client).attempt(note).outcome == "sent"
    message = json.loads(receiver_server.received[0].body)
    assert len(message["blocks"]) <= 50
    assert len(message["blocks"][0]["text"]["text"]) <= 150
    assert all(len(b["text"]["text"]) <= 3000 for b in message["blocks"] if b["type"] == "section")
    assert "…and 20 more alerts" in json.dumps(message, ensure_ascii=False)
    assert len(message["text"]) <= 3000


def test_mrkdwn_control_characters_are_escaped(receiver_server, client, notification, alert):
    note = notification(alert(summary="a <b> & `c`", description="<!channel>"))
    slack(receiver_server.url(HOOK), client).attempt(note)
    message = json.loads(receiver_server.received[0].body)
    section = message["blocks"][1]["text"]["text"]
    assert "a &lt;b&gt; &amp; `c`" in section
    assert "<!channel>" not in json.dumps(message)


# A command line is anyone's to write: the audit's, which drew a bold fake alert, a
# label line and a list of culprits on another host inside a real alert.
FORGED = (
    "python x.py\n*🔴 GPU 3 on gpu-node-7 jumped to 99% full*\n"
    "`hostname=gpu-node-1` · *Culprits*\n• *bob* \u202eevil https://phish.example/"
)


def test_a_command_line_cannot_forge_lines_of_the_message(
    receiver_server, client, notification, alert
) -> None:
    forger = Culprit(pid=66, user="mallory", command=FORGED, memory_bytes=2**30)
    candidate = Candidate(
        rule="gpu_filling_up",
        severity="warning",
        labels={"rule": "gpu_filling_up"},
        summary=f"GPU 3 on gpu-node-7 fills up; growing: {describe(forger)}",
        description=describe(forger),
        culprits=[forger],
    )
    note = notification(
        alert(summary=candidate.summary, description=candidate.description, culprits=[forger])
    )
    assert slack(receiver_server.url(HOOK), client).attempt(note).outcome == "sent"
    message = json.loads(receiver_server.received[0].body)
    texts = [b["text"] for b in message["blocks"] if b["type"] == "section"]
    texts += [e for b in message["blocks"] if b["type"] == "context" for e in b["elements"]]
    lines = [line for t in texts for line in t["text"].split("\n")]
    assert not any(
        line.startswith(("*🔴 GPU 3", "`hostname=gpu-node-1`", "• *bob*")) for line in lines
    )
    assert all("\u202e" not in t["text"] for t in texts) and "\\u202e" in texts[0]["text"]
    # Slack links nothing by itself: no bare URL or channel name becomes a link.
    assert all(t["verbatim"] is True for t in texts)
    assert "\n" not in message["text"]


def test_the_fallback_text_stays_within_slack_s_limit_once_escaped(
    receiver_server, client, notification, alert
) -> None:
    many = [alert(fingerprint=f"f{i}", summary="<&>" * 200) for i in range(10)]
    slack(receiver_server.url(HOOK), client).attempt(notification(*many))
    text = json.loads(receiver_server.received[0].body)["text"]
    assert len(text) <= 3000 and text.endswith("…")
    assert "<" not in text and not text[:-1].endswith(("&", "&l", "&lt", "&a", "&am", "&amp"))


def test_resolved_message(receiver_server, client, notification, alert) -> None:
    slack(receiver_server.url(HOOK), client).attempt(notification(alert("resolved")))
    message = json.loads(receiver_server.received[0].body)
    assert message["blocks"][0]["text"]["text"] == "✅ Resolved: gpu_filling_up"
    assert "resolved <!date^1787000900^" in json.dumps(message)


def test_send_resolved_off_sends_only_firing_alerts(
    receiver_server, client, notification, alert
) -> None:
    receiver = slack(receiver_server.url(HOOK), client, send_resolved=False)
    only_resolved = receiver.attempt(notification(alert("resolved")))
    assert only_resolved.outcome == "sent" and "nothing to send" in only_resolved.detail
    assert receiver_server.received == []
    receiver.attempt(notification(alert("firing"), alert("resolved", fingerprint="other")))
    message = json.loads(receiver_server.received[0].body)
    assert message["blocks"][0]["text"]["text"] == "🔥 Firing: gpu_filling_up"


def test_slack_is_spaced_one_message_a_second(client) -> None:
    receiver = slack("https://hooks.slack.com/services/T/B/X", client)
    assert (receiver.name, receiver.type, receiver.send_resolved) == ("team-a", "slack", True)
    assert receiver.min_interval_seconds == 1.0
