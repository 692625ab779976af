"""The generated reference docs match the code, and every exported metric is declared."""

from __future__ import annotations

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
