"""``fit --config`` on a quantised checkpoint's config: without ``--dtype`` its weights
are weighed as the config's ``quantization_config`` stores them.

Before, every config was weighed in bf16: a 70B GPTQ model (36.8 GiB of int4 weights)
came out at 131 GiB and "does NOT fit" on an 80 GiB card it runs on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.architecture import quantised_in_part, stored_dtype
from tests.doctor.cli_run import model_config, run
from tests.doctor.published_configs import GPT_OSS_20B, LLAMA_33_70B

LLAMA_70B = LLAMA_33_70B
GPTQ_4BIT = {"bits": 4, "group_size": 128, "desc_act": True, "quant_method": "gptq"}


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [
        (GPTQ_4BIT, "int4"),
        ({**GPTQ_4BIT, "bits": 8}, "int8"),
        ({**GPTQ_4BIT, "bits": 3}, "int4"),  # weighed as 4: over, never under
        ({"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}, "int4"),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}, "int4"),  # AutoAWQ's
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "nf4"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8"),
        ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}, "int4"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "int4",
        ),
    ],
    ids=["gptq-4", "gptq-8", "gptq-3", "awq", "autoawq", "bnb-4", "bnb-8", "fp8", "mxfp4", "llm-compressor"],
)  # fmt: skip
def test_the_stored_size_is_read_from_each_quantisation_format(
    quantization: dict[str, Any], dtype: str
) -> None:
    found = stored_dtype(quantization)
    assert found is not None and found[0] == dtype


@pytest.mark.parametrize(
    "quantization",
    [None, "gptq", {}, {"quant_method": "somethingnew"}, {"bits": 16}, {"bits": True}],
)
def test_no_weight_size_said_is_no_guess(quantization: Any) -> None:
    assert stored_dtype(quantization) is None


GPTQ_70B = "Llama-3.1-70B-Instruct-GPTQ-INT4"


def test_cli_weighs_a_gptq_checkpoint_as_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, GPTQ_70B, {**LLAMA_70B, "quantization_config": GPTQ_4BIT})
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB"], capsys)
    assert code == 0, out
    assert "int4 (as the config stores it: gptq, 4-bit), inference" in out
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--json"], capsys)
    report = json.loads(out)
    assert (report["dtype"], report["dtype_source"]) == ("int4", "gptq, 4-bit")
    assert report["breakdown"]["weights_bytes"] < 40 * 2**30


def test_cli_an_explicit_dtype_and_full_training_are_not_overridden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, GPTQ_70B, {**LLAMA_70B, "quantization_config": GPTQ_4BIT})
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--dtype", "bf16"], capsys)
    assert code == 10 and "bf16, inference" in out  # does not fit: 131 GiB of weights
    code, out, _ = run(
        ["fit", "--config", path, "--gpu", "H100-80GB", "--mode", "full", "--json"], capsys
    )
    report = json.loads(out)
    assert (report["dtype"], report["dtype_source"]) == ("bf16", None)


# --- checkpoints quantised in part --------------------------------------------------------

GPT_OSS_120B: dict[str, Any] = {
    **GPT_OSS_20B,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}


@pytest.mark.parametrize(
    ("name", "config", "published_gib"),
    [("gpt-oss-20b", GPT_OSS_20B, 12.8), ("gpt-oss-120b", GPT_OSS_120B, 60.8)],
    ids=["gpt-oss-20b", "gpt-oss-120b"],
)
def test_cli_weighs_gpt_oss_as_its_checkpoint_stores_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    config: dict[str, Any],
    published_gib: float,
) -> None:
    # The model card's checkpoint sizes: 12.8 GiB and 60.8 GiB. Every linear layer at
    # 4-bit came to 11.6 and 57.7 (9 % and 5 % under); MXFP4 experts at 4.25 bits beside
    # bf16 attention, routers, embeddings and lm_head come within 0.2 %.
    path = model_config(tmp_path, name, config)
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--json"], capsys)
    report = json.loads(out)
    assert code == 0
    assert report["dtype"] == "int4" and report["dtype_source"] == "mxfp4, 4-bit"
    assert report["breakdown"]["weights_bytes"] / 2**30 == pytest.approx(published_gib, rel=0.005)
    unquantised = report["unquantised"]
    assert unquantised["groups"] == ["attention", "router", "embeddings", "lm_head"]
    assert unquantised["unplaced"] == [] and unquantised["quantised_bits"] == 4.25
    _, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB"], capsys)
    assert "note: weights: attention, router, embeddings, lm_head stay 16-bit" in out
    # Quantised another way (--dtype nf4: bitsandbytes over the bf16 weights), the
    # checkpoint's layout does not apply: only embeddings and lm_head stay 16-bit.
    _, out, _ = run(
        ["fit", "--config", path, "--gpu", "H100-80GB", "--dtype", "nf4", "--json"], capsys
    )
    report = json.loads(out)
    assert report["unquantised"] is None
    assert report["breakdown"]["weights_bytes"] < published_gib * 2**30 * 0.96


@pytest.mark.parametrize(
    ("quantization", "kept", "unplaced"),
    [
        (GPT_OSS_20B["quantization_config"], ("attention", "router", "embeddings", "lm_head"), ()),
        # llm-compressor: regexes in "ignore" (an MoE's router is mlp.gate).
        ({"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}, ("lm_head", "router"), ()),
        # ModelOpt: globs in exclude_modules.
        ({"quant_method": "fp8", "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]},
         ("lm_head", "attention"), ()),
        # AWQ on a vision-language model leaves its vision tower alone.
        ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["visual"]}, ("encoders",), ()),
        # One layer's MLP: fit cannot size it, and says so.
        ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp", "lm_head"]},
         ("lm_head",), ("model.layers.0.mlp",)),
    ],
    ids=["gpt-oss", "llm-compressor", "modelopt", "awq-visual", "unplaced"],
)  # fmt: skip
def test_the_groups_left_unquantised_are_read_from_each_format(
    quantization: dict[str, Any], kept: tuple[str, ...], unplaced: tuple[str, ...]
) -> None:
    _, found_kept, found_unplaced = quantised_in_part(quantization)
    assert (found_kept, found_unplaced) == (kept, unplaced)


def test_cli_a_module_left_unquantised_it_cannot_size_is_named_as_an_under_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quantization = {**GPTQ_4BIT, "modules_to_not_convert": ["model.layers.0.mlp"]}
    path = model_config(tmp_path, GPTQ_70B, {**LLAMA_70B, "quantization_config": quantization})
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB"], capsys)
    assert code == 0
    assert (
        "note: weights: quantization_config also leaves model.layers.0.mlp unquantised, which"
        " fit cannot size: weighed as quantised (an under-count)"
    ) in out


def test_cli_attention_left_unquantised_is_weighed_at_16_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Llama-3.1-70B's attention is 80 x 150,994,944 parameters: 1.0 GiB more at 16 bits
    # than at 4.125.
    kept = {**GPTQ_4BIT, "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    sizes = []
    for name, quantization in (("all", GPTQ_4BIT), ("kept", kept)):
        path = model_config(tmp_path, name, {**LLAMA_70B, "quantization_config": quantization})
        _, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--json"], capsys)
        sizes.append(json.loads(out)["breakdown"]["weights_bytes"])
    attention = 80 * (8192 * 64 * 128 * 2 + 8192 * 8 * 128 * 2)
    # GPTQ g128: an fp16 scale and a 4-bit zero (qzeros) per 128 weights.
    assert sizes[1] - sizes[0] == pytest.approx(attention * (2 - (4 + 20 / 128) / 8), abs=2)
