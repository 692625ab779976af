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

from gpuwatch.doctor.architecture import stored_dtype
from tests.doctor.cli_run import model_config, run

LLAMA_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
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
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "int8"),
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
