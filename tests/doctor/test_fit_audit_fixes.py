"""``gpuwatch fit`` audit: advice that still "cannot tell", MIG, the JSON, driver totals.

Each test names the audit item it covers and fails on the code before the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from doctor.cli_run import run
from doctor.fake_agent_server import FakeAgent
from gpuwatch.doctor.architecture import Architecture, load_hf_config
from gpuwatch.doctor.fit import (
    COMPONENTS,
    FITS_HEADROOM,
    Breakdown,
    Option,
    Workload,
    breakdown_verdict,
    estimate,
    max_context,
    options,
    verdict,
)
from gpuwatch.doctor.fit_report import run_fit
from gpuwatch.doctor.gpus import catalogue_target, local_targets, smallest_fitting
from gpuwatch.doctor.units import GIB, MIB
from gpuwatch.snapshot import Gpu, MigInstance

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_PATH = FIXTURES / "llama-3.1-8b" / "config.json"
LLAMA = load_hf_config(LLAMA_PATH)
B8 = Architecture(params=8_000_000_000)
B70 = Architecture(params=70_000_000_000)


def _applied(workload: Workload, change: str) -> Workload:
    """The workload an option's change describes (single and stacked changes)."""
    changed = workload
    if dtype := re.search(r"--dtype (\w+)", change):
        changed = replace(changed, dtype=dtype[1])  # type: ignore[arg-type]
    if kv := re.search(r"--kv-cache-dtype (\w+)", change):
        changed = replace(changed, kv_cache_dtype=kv[1])  # type: ignore[arg-type]
    if mode := re.search(r"--mode (\w+)", change):
        changed = replace(changed, mode=mode[1])  # type: ignore[arg-type]
    if context := re.search(r"--context (\d+)", change):
        changed = replace(changed, context=int(context[1]))
    if "--batch 1" in change or "batch 1" in change.split(" + "):
        changed = replace(changed, batch=1)
    if "checkpointing" in change:
        changed = replace(changed, checkpointing=True)
    if change.startswith("QLoRA +"):
        changed = replace(changed, mode="qlora", dtype="nf4")
    if change.startswith("4-bit weights"):
        changed = replace(changed, dtype="nf4")
    return changed


def _assert_whole_range_fits(workload: Workload, capacity: int, option: Option) -> None:
    budget = (1 - FITS_HEADROOM) * capacity
    if option.change.startswith("offload"):
        kept = re.search(r'max_memory=\{0: "(\d+)GiB"', option.change)
        assert kept is not None
        b = estimate(workload)
        rest = b.overhead + sum(b.worst_part(n) for n in COMPONENTS if n != "weights")
        assert int(kept[1]) * GIB + rest <= budget, option.change
        return
    after = estimate(_applied(workload, option.change))
    assert breakdown_verdict(after, capacity) == "fits", option.change
    assert max(after.total, after.high_total or 0) <= budget, option.change
    assert option.high_bytes == after.high_total


# --- 1. "makes it fit" only when the whole range fits ---------------------------------

# (workload, card): the audit's cases, and one per kind of option.
CASES = [
    (Workload(B8, context=32768), 24 * GIB),
    (Workload(B70, dtype="nf4", context=16384), 48 * GIB),
    (Workload(B8, context=131072, batch=2), 80 * GIB),
    (Workload(B8, dtype="fp32", context=8192), 40 * GIB),
    (Workload(B70, context=4096), 48 * GIB),
    (Workload(B8, mode="full", context=1024, batch=8), 24 * GIB),
    (Workload(B8, mode="full", context=4096, batch=8), 16 * GIB),
    (Workload(B8, mode="lora", context=1024, batch=2), 32 * GIB),
    (Workload(B8, mode="full", context=2048, batch=2), 160 * GIB),
    (Workload(B8, context=8192, batch=8), 40 * GIB),
    (Workload(B8, dtype="nf4", mode="qlora", context=16384, batch=2), 24 * GIB),
    (Workload(LLAMA, context=32768), 24 * GIB),
]


@pytest.mark.parametrize(("workload", "capacity"), CASES)
def test_every_option_fits_over_the_whole_range(workload: Workload, capacity: int) -> None:
    for option in options(workload, capacity):
        _assert_whole_range_fits(workload, capacity, option)


def test_audit_8b_32k_on_24gib_offers_no_change_that_still_cannot_tell(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["fit", "--params", "8B", "--context", "32768", "--gpu", "24GiB"], capsys)
    assert code == 11
    # int8 is 13.23-29.96 GiB, nf4 9.73-26.45, --context 21760 18.72-30.05: all unknown.
    assert "int8" not in out and "nf4" not in out and "--context 21760" not in out
    assert "offload" not in out  # the KV cache's top (18.98 GiB) leaves no room for weights
    context = re.search(r"--context (\d+)\) -> .* \(up to ([\d.]+) GiB over typical shapes\)", out)
    assert context is not None and float(context[2]) <= 0.85 * 24
    assert "a bigger GPU (L40S)" in out


def test_audit_70b_nf4_16k_on_48gib_offers_no_shorter_context() -> None:
    workload = Workload(B70, dtype="nf4", context=16384)
    # --context 4096 is 37.25-50.04 GiB: still "cannot tell" on 48 GiB.
    assert breakdown_verdict(estimate(replace(workload, context=4096)), 48 * GIB) == "unknown"
    assert max_context(workload, 48 * GIB) is None
    assert not any("--context" in o.change for o in options(workload, 48 * GIB))


def test_max_context_is_the_longest_whose_whole_range_fits() -> None:
    workload = Workload(B8, context=32768)
    longest = max_context(workload, 24 * GIB)
    assert longest is not None
    budget = 0.85 * 24 * GIB

    def top(context: int) -> int:
        b = estimate(replace(workload, context=context))
        return max(b.total, b.high_total or 0)

    assert top(longest) <= budget < top(longest + 256)


def test_stacked_changes_stop_only_when_the_whole_range_fits() -> None:
    # QLoRA + checkpointing fits at the central shape (old answer), not at the top.
    workload = Workload(B8, mode="full", context=1024, batch=8)
    changes = [o.change for o in options(workload, 24 * GIB)]
    assert changes == ["QLoRA + gradient checkpointing + batch 1"]
    # Here even all three leave the top of the range past the card: nothing is offered.
    assert options(Workload(B8, mode="full", context=4096, batch=8), 16 * GIB) == []


def test_option_json_carries_the_top_of_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--params", "8B", "--context", "32768", "--gpu", "24GiB", "--json"]
    _, out, _ = run(args, capsys)
    option = json.loads(out)["gpus"][0]["options"][0]
    assert option["change"].startswith("shorter context")
    assert option["total_bytes"] <= option["total_high_bytes"] <= 0.85 * 24 * GIB


# --- 2. --gpu local on a MIG GPU: one target per instance ---------------------------------


def _mig_gpu() -> Gpu:
    instances = [
        MigInstance(
            index=i,
            uuid=f"MIG-{i}",
            name="NVIDIA A100-SXM4-80GB MIG 1g.10gb",
            gpu_instance_id=gi,
            profile="1g.10gb",
            memory_total_bytes=9984 * MIB,
            memory_used_bytes=13 * MIB,
        )
        for i, gi in enumerate((7, 8))
    ]
    return Gpu(
        index=0,
        uuid="GPU-0",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=81920 * MIB,
        memory_used_bytes=26 * MIB,
        memory_free_bytes=81894 * MIB,
        mig_instances=instances,
    )


def test_local_targets_split_a_mig_gpu_into_its_instances(agent: FakeAgent) -> None:
    assert not isinstance(agent.snapshot, (bytes, int))
    snapshot = agent.snapshot.model_copy(update={"gpus": [_mig_gpu()]})
    targets = local_targets(snapshot)
    assert [t.name for t in targets] == [
        "GPU 0 MIG 1g.10gb (instance 7)",
        "GPU 0 MIG 1g.10gb (instance 8)",
    ]
    assert all(t.total_bytes == 9984 * MIB for t in targets)
    assert all(t.free_bytes == (9984 - 13) * MIB for t in targets)


def test_fit_local_on_mig_judges_the_instance_not_the_card(
    agent: FakeAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not isinstance(agent.snapshot, (bytes, int))
    agent.snapshot = agent.snapshot.model_copy(update={"gpus": [_mig_gpu()]})
    args = ["fit", "--config", str(LLAMA_PATH), "--gpu", "local", "--agent", agent.url, "--json"]
    code, out, _ = run(args, capsys)
    result = json.loads(out)
    # 16 GiB of bf16 weights: fits 80 GiB, not a 9.75 GiB slice.
    assert code == 10 and result["verdict"] == "does_not_fit"
    assert [g["total_bytes"] for g in result["gpus"]] == [9984 * MIB, 9984 * MIB]
    assert result["gpus"][0]["name"] == "GPU 0 MIG 1g.10gb (instance 7)"


def test_a_gpu_without_mig_is_still_one_target(agent: FakeAgent) -> None:
    assert not isinstance(agent.snapshot, (bytes, int))
    targets = local_targets(agent.snapshot)
    assert [(t.name, t.total_bytes) for t in targets] == [
        ("GPU 0 (NVIDIA GeForce RTX 4090)", 24 * GIB)
    ]


# --- 3. the JSON says what the text says --------------------------------------------------


def test_json_has_the_per_token_kv_and_each_parts_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["fit", "--params", "8B", "--context", "32768", "--gpu", "24GiB"]
    _, text, _ = run(args, capsys)
    _, out, _ = run([*args, "--json"], capsys)
    result = json.loads(out)
    # The typical 8B shape is Llama-3.1-8B's: 128 KiB per token, as kv_cache_bytes uses.
    assert result["kv_cache_bytes_per_token"] == 131_072
    assert result["breakdown"]["kv_cache_bytes"] == 131_072 * 32768
    assert set(result["spread"]) == set(result["estimated"]) == {"kv_cache", "activations"}
    low, high = result["spread"]["kv_cache"]
    b = estimate(Workload(B8, context=32768))
    assert (low, high) == b.spread["kv_cache"]
    assert low < result["breakdown"]["kv_cache_bytes"] < high
    assert "KV cache                        4.00 GiB   (range 1.62 GiB - 18.98 GiB)" in text


def test_json_with_a_config_has_no_spread(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(["fit", "--config", str(LLAMA_PATH), "--gpu", "H100-80GB", "--json"], capsys)
    result = json.loads(out)
    assert result["kv_cache_bytes_per_token"] == 131_072
    assert result["spread"] == {} and result["estimated"] == []


# --- 4. --params and --config together ----------------------------------------------------


def test_params_and_config_together_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--params", "8B", "--config", str(LLAMA_PATH), "--gpu", "RTX4090"]
    code, out, err = run(args, capsys)
    assert code == 3 and out == ""
    assert err == "gpuwatch: error: give one of --params or --config\n"


# --- 5. catalogue cards are what the driver reports --------------------------------------


@pytest.mark.parametrize(
    ("card", "mib"),
    [
        ("T4", 15_360),
        ("A10G", 23_028),
        ("L4", 23_034),
        ("L40S", 46_068),
        ("H100-80GB", 81_559),
        ("H200", 143_771),
        ("A100-80GB", 81_920),
        ("A100-40GB", 40_960),
        ("RTX4090", 24_564),
    ],
)
def test_catalogue_totals_are_the_drivers(card: str, mib: int) -> None:
    assert catalogue_target(card).total_bytes == mib * MIB


def test_a_t4s_ecc_loss_moves_a_workload_into_the_tight_band() -> None:
    # 13.4 GiB: 16 % headroom on a nominal 16 GiB ("fits"), 10.7 % on the T4's 15 GiB.
    assert verdict(int(13.4 * GIB), 16 * GIB) == "fits"
    assert verdict(int(13.4 * GIB), catalogue_target("T4").total_bytes) == "tight"


# --- 6. nits ----------------------------------------------------------------------------


def _report(dtype: str | None, context: int, gpu: str, *, params: str | None = None) -> str:
    report = run_fit(
        params=params,
        config=None if params else LLAMA_PATH,
        dtype=dtype,
        mode="inference",
        context=context,
        batch=1,
        gpu=[gpu],
        agent="",
    )
    return report.render()


def test_no_bigger_gpu_without_bf16_for_a_bf16_workload() -> None:
    # Llama-3.1-8B at 32k needs ~22.6 GiB: past an RTX 4090's 85 %, within a 32 GiB card's.
    assert "a bigger GPU (RTX5090)" in _report(None, 32768, "RTX4090")
    assert "V100" not in _report(None, 32768, "RTX4090")
    # fp16 runs on a V100: the smallest card that holds it is still offered.
    assert "a bigger GPU (V100-32GB)" in _report("fp16", 32768, "RTX4090")
    assert smallest_fitting(10 * GIB, headroom=0.15) == "T4"
    assert smallest_fitting(10 * GIB, headroom=0.15, dtype="bf16") == "RTX4080"


def test_inference_that_fits_nowhere_is_told_tensor_parallelism() -> None:
    text = _report("bf16", 2_000_000, "B200", params="2000B")
    assert "tensor parallelism (e.g. vLLM --tensor-parallel-size)" in text
    assert "FSDP" not in text and "ZeRO" not in text
    training = run_fit(
        params="13B",
        config=None,
        dtype=None,
        mode="full",
        context=8192,
        batch=4,
        gpu=["24GiB"],
        agent="",
    ).render()
    assert "shard across GPUs (FSDP, ZeRO-3)" in training


def test_fp32_training_counts_fp32_logits() -> None:
    tokens, hidden, layers, vocab, mlp = 1024, 4096, 32, 128_256, 14_336
    # Llama-3.1-8B's layer saves 45h a token (fit.py's table), its backward 4i more.
    per_layer = tokens * (12 * hidden + 4 * (hidden + hidden // 4) + 8 * mlp)
    backward = tokens * 4 * mlp
    bf16 = estimate(Workload(LLAMA, dtype="bf16", mode="full", context=tokens)).activations
    fp32 = estimate(Workload(LLAMA, dtype="fp32", mode="full", context=tokens)).activations
    # 16-bit: bf16 logits + three fp32 tensors of their size (14 B); fp32: the logits are
    # the upcast, so three fp32 tensors (12 B). The per-layer terms double.
    assert bf16 == per_layer * layers + backward + tokens * vocab * 14
    assert fp32 == 2 * (per_layer * layers + backward) + tokens * vocab * 12


def test_breakdown_worst_part_is_the_top_of_its_range() -> None:
    b = estimate(Workload(B8, context=32768))
    assert b.worst_part("kv_cache") == b.spread["kv_cache"][1]
    assert b.worst_part("weights") == b.weights  # not estimated for bf16 8B
    assert Breakdown(1, None, 0, 0, None).worst_part("kv_cache") == 0
