"""The generated reference docs match the code, and every exported metric is declared."""

from __future__ import annotations

from support.snapshots import sample_snapshot

from gpuwatch import docs
from gpuwatch.agent.collectors import agent, dcgm, gpu, process
from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.state import AgentState


def test_generated_docs_are_current() -> None:
    assert docs.main(["--check"]) == 0, "run: .venv/bin/python -m gpuwatch.docs"


def test_every_family_a_collector_yields_is_declared() -> None:
    state = AgentState()
    state.record_poll(sample_snapshot())
    state.nvml_errors.add("nvmlDeviceGetPowerUsage", "not_supported")
    source = lambda: state.latest  # noqa: E731
    cases = [
        (gpu.GpuCollector(source), gpu.METRICS),
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
