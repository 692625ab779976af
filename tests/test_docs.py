"""The generated reference docs match the code, and every exported metric is declared."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel
from support.snapshots import sample_snapshot

from gpuwatch import docs
from gpuwatch.agent.collectors import agent, dcgm, gpu, process
from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.state import AgentState
from gpuwatch.snapshot import MigInstance


def test_generated_docs_are_current() -> None:
    assert docs.main(["--check"]) == 0, "run: .venv/bin/python -m gpuwatch.docs"


def test_every_family_a_collector_yields_is_declared() -> None:
    state = AgentState()
    state.record_poll(sample_snapshot())
    state.nvml_errors.add("nvmlDeviceGetPowerUsage", "not_supported")
    source = lambda: state.latest  # noqa: E731
    # The sample has no GPU in MIG mode: one more GPU with an instance, for its series.
    sample = sample_snapshot()
    mig_gpu = sample.gpus[0].model_copy(
        update={
            "index": 1,
            "uuid": "GPU-11111111-1111-1111-1111-111111111111",
            "mig_instances": [
                MigInstance(
                    index=0,
                    uuid="MIG-1",
                    gpu_instance_id=1,
                    profile="3g.40gb",
                    memory_total_bytes=40 * 2**30,
                    memory_used_bytes=2**30,
                )
            ],
        }
    )
    with_mig = sample.model_copy(update={"gpus": [*sample.gpus, mig_gpu]})
    cases = [
        (gpu.GpuCollector(lambda: with_mig), gpu.METRICS),
        (process.ProcessCollector(source, enabled=True, max_series=1), process.METRICS),
        (dcgm.DcgmCompatCollector(source), dcgm.METRICS),
        (
            agent.AgentCollector(
                state,
                push_stats=lambda: PushStats({"ok": 1}, {"spool_full": 1}, 1, 1.0, {"accepted": 1}),
            ),
            agent.METRICS,
        ),
    ]
    for collector, specs in cases:
        declared = {spec.name for spec in specs}
        yielded = {family.name for family in collector.collect()}
        assert yielded <= declared, f"{collector.name}: undeclared {yielded - declared}"
        # And the sample snapshot exercises every declared family (so the docs list is real).
        assert yielded == declared, f"{collector.name}: never yielded {declared - yielded}"


def test_metrics_reference_lists_the_fixed_names() -> None:
    text = docs.metrics_markdown()
    for name in (
        "gpuwatch_gpu_memory_total_bytes",
        "gpuwatch_gpu_memory_used_bytes",
        "gpuwatch_gpu_memory_free_bytes",
        "DCGM_FI_DEV_FB_USED",
        "gpuwatch_nvml_errors_total",
    ):
        assert f"`{name}`" in text


# --- Hand-written pages checked against the code they describe -----------------------

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _section(page: str, heading: str) -> str:
    """The text under ``heading`` (a whole line) of docs/``page``, to the next heading."""
    text = (DOCS / page).read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"^#{1,6} ", text[start:], flags=re.MULTILINE)
    return text[start : start + following.start()] if following else text[start:]


def _models_by_section() -> list[tuple[str, tuple[type[BaseModel], ...]]]:
    from gpuwatch.server.events.schemas import EventOut, IdleHolderOut
    from gpuwatch.server.fleet.schemas import FleetOut
    from gpuwatch.server.hosts.schemas import GpuOut, HostDetail, HostOut
    from gpuwatch.server.processes.schemas import ProcessOut, ProcessSampleOut

    return [
        ("### `GET /api/v1/hosts`", (HostOut,)),
        ("### `GET /api/v1/hosts/{hostname}`", (HostDetail, GpuOut)),
        ("### `GET /api/v1/processes`", (ProcessOut,)),
        ("### `GET /api/v1/processes/{id}/samples?since=&until=&limit=`", (ProcessSampleOut,)),
        ("### `GET /api/v1/events`", (EventOut,)),
        ("### `GET /api/v1/events/top-idle?since=&until=&limit=`", (IdleHolderOut,)),
        ("### `GET /api/v1/fleet`", (FleetOut,)),
    ]


def test_api_md_names_every_field_of_each_answer() -> None:
    """A field the API answers with (its OpenAPI schema is built from these models) and
    api.md does not name is one no reader knows about (``retired_at`` was one)."""
    from gpuwatch.server.hosts.schemas import HostOut

    for heading, models in _models_by_section():
        text = _section("api.md", heading)
        fields = {name for model in models for name in model.model_fields}
        if "The same plus" in text:  # the detail page names only what it adds
            fields -= set(HostOut.model_fields)
        missing = sorted(name for name in fields if f"`{name}`" not in text)
        assert not missing, f"api.md, {heading}: {missing}"


def test_server_md_lists_every_scheduled_job() -> None:
    from gpuwatch.server.alerts.engine import AlertEngine
    from gpuwatch.server.scheduler import job_specs
    from gpuwatch.settings import ServerSettings

    # The server always gives the scheduler its alert engine (server/app.py).
    specs = job_specs(ServerSettings(), AlertEngine(receivers={}))
    text = _section("server.md", "## Scheduled jobs, and why they run inside the server")
    listed = re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE)
    assert sorted(listed) == sorted(spec.name for spec in specs)
    count = {3: "Three", 4: "Four", 5: "Five"}[len(specs)]
    assert f"{count} jobs run on timers" in text


def test_scenarios_md_gives_the_ghost_pid_range_the_loader_takes() -> None:
    from gpuwatch.nvml.fake.scenario_values import MAX_PID

    text = (DOCS / "scenarios.md").read_text(encoding="utf-8")
    ghost = text[text.index("* **`ghost = PID`**") :].split("\n* ")[0]
    assert f"1..{MAX_PID}" in ghost
    # Advice above that bound could not be followed: the loader refuses such a PID.
    for number in re.findall(r"\b\d{5,}\b", ghost):
        assert int(number) <= MAX_PID, number


def test_configuration_reference_says_which_variables_take_json() -> None:
    from gpuwatch.settings import AgentSettings, ServerSettings, is_structured

    text = docs.configuration_markdown()
    for cls in (AgentSettings, ServerSettings):
        for name, field in cls.model_fields.items():
            variable = f"`{cls.env_prefix}{name.upper()}`"
            row = next(
                line for line in text.splitlines() if line.startswith(f"| `{name}` | {variable}")
            )
            assert ("(JSON)" in row) is is_structured(field.annotation), row
    assert "no environment variables" not in text


def test_receivers_given_as_configuration_md_shows_load_and_merge_as_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example (for the root-only server.env) loads; the variable replaces the file's
    receivers, and GPUWATCH_SERVER_ALERTS is merged key by key with [server.alerts]."""
    from gpuwatch.settings import ServerSettings, load

    assert docs.RECEIVERS_EXAMPLE in docs.configuration_markdown()
    variable, value = docs.RECEIVERS_EXAMPLE.split("=", 1)
    config = tmp_path / "gpuwatch.toml"
    config.write_text(
        '[[server.receivers]]\nname = "from-file"\ntype = "slack"\nurl = "https://h.example/x"\n'
        '[server.alerts]\ngroup_wait = "7s"\nteams = { alice = "nlp" }\n'
        '[[server.alerts.routes]]\nreceiver = "oncall"\n',
        encoding="utf-8",
    )
    for name in os.environ:
        if name.startswith("GPUWATCH_SERVER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    monkeypatch.setenv(variable, shlex.split(value)[0])
    monkeypatch.setenv("GPUWATCH_SERVER_ALERTS", '{"teams": {"bob": "vision"}}')
    settings = load(ServerSettings)
    assert [r.name for r in settings.receivers] == ["oncall", "gpu-users"]
    assert settings.alerts.group_wait_seconds == 7.0
    assert settings.alerts.teams == {"alice": "nlp", "bob": "vision"}
    assert [r.receiver for r in settings.alerts.routes] == ["oncall"]


def test_every_result_an_agent_exports_is_described_in_its_help() -> None:
    """Counters are exported with every result and reason from the first scrape; each of
    those values must be in the help text, which is /metrics' HELP and metrics.md."""
    collector = agent.AgentCollector(AgentState(), push_stats=lambda: PushStats())
    specs = {spec.name: spec for spec in agent.METRICS}
    for family in collector.collect():
        for sample in family.samples:
            for label in ("result", "reason", "outcome"):
                value = sample.labels.get(label)
                if value is not None:
                    assert re.search(rf"\b{value}\b", specs[family.name].help), (
                        f"{family.name}: {label}={value!r} is exported but not described"
                    )


def _classified(code: int) -> str:
    from gpuwatch.server.notifications.receivers.base import Redactor, Reply, classify

    return classify(
        Reply(code, httpx.Headers(), b""), label="r", redact=Redactor([]), now=0.0
    ).outcome


def _parenthesis_after(text: str, word: str) -> str:
    match = re.search(rf"\b{word} \(([^()]*)\)", text)
    assert match is not None, f"no '{word} (...)' in {text!r}"
    return match.group(1)


def test_notification_outcomes_help_says_which_answers_are_broken_as_classify_decides() -> None:
    """The receivers' one rule (receivers/base.py: classify): 2xx sent, 408/425/429/5xx
    retry, every other status broken. The help text (and so metrics.md) must say so."""
    from gpuwatch.server.metrics import SERVER_NOTIFICATIONS

    retry = _parenthesis_after(SERVER_NOTIFICATIONS.help, "retry")
    broken = _parenthesis_after(SERVER_NOTIFICATIONS.help, "broken")
    retried_4xx = [code for code in range(400, 500) if _classified(code) == "retry"]
    assert retried_4xx and all(str(code) in retry for code in retried_4xx), retry
    assert all(_classified(code) == "retry" for code in range(500, 600)) and "5xx" in retry
    assert all(_classified(code) == "broken" for code in range(300, 400)) and "3xx" in broken
    assert "4xx" in broken
    # A code named as broken is broken (the old text's 400/403/404/410 was only a few).
    for code in re.findall(r"\b[1-5]\d\d\b", broken):
        assert _classified(int(code)) == "broken", code


@pytest.mark.parametrize("page", ["alerts.md", "alerts-webhook.md"])
def test_alert_pages_say_which_answers_are_broken_as_classify_decides(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    assert "3xx" in text
    for code in (c for c in range(400, 500) if _classified(c) == "retry"):
        assert str(code) in text, f"{page} does not say {code} is retried"
    # No list of "the" broken codes that leaves most of them out.
    assert "400, 403, 404 and 410" not in text and "400/403/404/410" not in text
