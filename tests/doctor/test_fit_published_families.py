"""``gpuwatch fit`` accuracy audit: published configs fit misread, and malformed ones it
failed on ("a bug", exit 1) or took silently.

Each count is checked against the model's published parameter count, and each verdict
the audit found flipped is checked through the command line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.architecture import MAX_CONFIG_BYTES, from_model_config, load_hf_config
from gpuwatch.doctor.fit import Workload, estimate, kv_bytes_per_token
from gpuwatch.errors import ConfigError
from tests.doctor.cli_run import model_config, run
from tests.doctor.published_configs import (
    DEEPSEEK_V2_LITE,
    GLM_4_9B_CHAT,
    LLAMA2_7B_AQLM_1X16,
    LLAVA_15_7B_HF,
    MAGNUM_12B_EXL2_425,
    MINIMAX_M1_80K,
    NEMOTRON_MINI_4B,
    NEMOTRON_SUPER_49B_PATH,
    QWEN_7B_CHAT,
    STARCODER2_3B,
    STARCODER2_15B,
)

GIB = 2**30
LLAMA_8B_PATH = Path(__file__).parent / "fixtures" / "llama-3.1-8b" / "config.json"
LLAMA_8B: dict[str, Any] = json.loads(LLAMA_8B_PATH.read_text(encoding="utf-8"))


def fit_json(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    config: dict[str, Any],
    *args: str,
) -> tuple[int, dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = model_config(tmp_path, name, config)
    code, out, err = run(["fit", "--config", path, "--json", *args], capsys)
    assert out, err
    return code, json.loads(out)


def refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, config: Any, *args: str
) -> str:
    """The one error line of a config fit refuses (exit 3)."""
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(config if isinstance(config, str) else json.dumps(config), encoding="utf-8")
    code, out, err = run(["fit", "--config", str(path), "--gpu", "H100-80GB", *args], capsys)
    assert code == 3 and not out, (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err and "a bug" not in err, err
    return err


# --- F1. ChatGLM / GLM-4: multi_query_group_num KV heads, ChatGLM's field names ----------


def test_glm4_9b_reads_its_two_kv_heads_and_is_its_published_9_4b() -> None:
    arch = from_model_config(GLM_4_9B_CHAT)
    assert arch.kv_heads == 2 and arch.head_dim == 128  # kv_channels
    assert arch.params == 9_399_767_040  # published 9.4B (was 10.66B, k/v at 32 heads)
    assert kv_bytes_per_token(arch, "bf16") == 2 * 40 * 2 * 128 * 2  # 40,960 (was 16x)


def test_chatglm3_6b_by_its_own_field_names_only() -> None:
    # ChatGLM3-6B names its sizes num_layers, padded_vocab_size, ffn_hidden_size and
    # kv_channels only (published 6.24B).
    config = {
        k: v for k, v in GLM_4_9B_CHAT.items() if k not in ("num_hidden_layers", "vocab_size")
    }
    config |= {"num_layers": 28, "padded_vocab_size": 65024}
    assert from_model_config(config).params == 6_243_454_976


def test_cli_glm4_fits_a_4090_and_an_h100_at_128k(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = fit_json(tmp_path, capsys, "glm-4-9b-chat", GLM_4_9B_CHAT, "--gpu", "RTX4090")
    assert code == 0 and report["verdict"] == "fits"  # was "does NOT fit", exit 10
    args = ("--gpu", "H100-80GB", "--context", "131072")
    code, report = fit_json(tmp_path / "b", capsys, "glm-4-9b-chat", GLM_4_9B_CHAT, *args)
    assert code == 0 and report["breakdown"]["kv_cache_bytes"] == 5 * GIB  # was 80 GiB


# --- F2. Two-matrix MLPs: StarCoder2, Nemotron and their class ----------------------------


@pytest.mark.parametrize(
    ("config", "params"),
    [
        (STARCODER2_3B, 3_029_523_456),  # published 3.03B (was 4.16B)
        (STARCODER2_15B, 15_653_640_192),  # published 16B: 15.65B tied (was 21.69B)
        (NEMOTRON_MINI_4B, 4_190_309_376),  # published 4.19B (was 5.10B)
    ],
    ids=["starcoder2-3b", "starcoder2-15b", "nemotron-mini-4b"],
)
def test_up_down_mlps_count_two_matrices(config: dict[str, Any], params: int) -> None:
    arch = from_model_config(config)
    assert not arch.gated_mlp and arch.params == params


@pytest.mark.parametrize(
    "family", ["codegen", "gpt_neo", "persimmon", "arcee", "apertus", "biogpt", "xglm"]
)
def test_every_up_down_family_is_two_matrices(family: str) -> None:
    config = {**LLAMA_8B, "model_type": family, "tie_word_embeddings": True}
    two = 32 * 2 * 4096 * 14336
    gated = from_model_config({**LLAMA_8B, "tie_word_embeddings": True})
    assert gated.params - from_model_config(config).params == 32 * 3 * 4096 * 14336 - two


def test_cli_starcoder2_15b_fits_an_a100_40gb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = fit_json(tmp_path, capsys, "sc2", STARCODER2_15B, "--gpu", "A100-40GB")
    assert code == 0 and report["verdict"] == "fits"  # was 42.28 GiB, exit 10


def test_lora_on_a_two_matrix_mlp_adapts_two_matrices() -> None:
    arch = from_model_config(STARCODER2_3B)
    attention = 30 * ((3072 + 3072) * 2 + (3072 + 256) * 2)
    assert arch.lora_params(1) == attention + 30 * 2 * (3072 + 12288)


# --- F3. Nulls, zeros and per-layer (DeciLM) configs -------------------------------------


def test_nemotron_super_49b_is_counted_layer_by_layer() -> None:
    arch = load_hf_config(NEMOTRON_SUPER_49B_PATH)
    assert arch.params == 49_867_145_216  # published 49.9B (was 88.00B)
    # 49 of its 80 layers have attention, each with 64 / 8 = 8 KV heads.
    assert arch.kv_layers == 49
    assert kv_bytes_per_token(arch, "bf16") == 2 * 49 * 8 * 128 * 2


def test_cli_nemotron_super_49b_fits_one_h200(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--config", str(NEMOTRON_SUPER_49B_PATH), "--gpu", "H200", "--json"]
    code, out, _ = run(args, capsys)
    assert code == 0 and json.loads(out)["verdict"] == "fits"  # was 175.67 GiB, exit 10


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_key_value_heads": 0}, "'num_key_value_heads' is 0"),
        ({"num_key_value_heads": -8}, "'num_key_value_heads' is -8"),
        ({"num_key_value_heads": 64}, "64 KV heads for 32 attention heads"),
        ({"num_key_value_heads": 3}, "3 KV heads for 32 attention heads"),
        ({"intermediate_size": None}, "'intermediate_size' is null"),
        ({"intermediate_size": 0}, "'intermediate_size' is 0"),
        ({"intermediate_size": -1}, "'intermediate_size' is -1"),
        ({"head_dim": 0}, "'head_dim' is 0"),
        ({"vocab_size": "128256"}, "'vocab_size' is \"128256\""),
        ({"block_configs": [{"attention": {}, "ffn": {}}]}, "1 blocks for 32 layers"),
    ],
    ids=lambda value: str(value)[:30],
)
def test_a_size_that_is_not_one_is_refused_not_defaulted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], says: str
) -> None:
    assert says in refusal(tmp_path, capsys, "llama", {**LLAMA_8B, **change})


def test_a_null_kv_head_count_is_one_per_head_and_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**LLAMA_8B, "num_key_value_heads": None}
    _, report = fit_json(tmp_path, capsys, "llama", config, "--gpu", "H100-80GB")
    assert any("num_key_value_heads is null" in note for note in report["notes"])


def test_a_decilm_block_fit_does_not_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads(NEMOTRON_SUPER_49B_PATH.read_text(encoding="utf-8"))
    config["block_configs"][0]["attention"]["window_length"] = 4096
    assert "window_length" in refusal(tmp_path, capsys, "decilm", config)


# --- F4. Quantised checkpoints whose bits are fractions, or unread ------------------------


def test_cli_exl2_is_weighed_at_its_4_25_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--gpu", "RTX4090", "--context", "16384")
    code, report = fit_json(tmp_path, capsys, "exl2", MAGNUM_12B_EXL2_425, *args)
    assert code == 0 and report["verdict"] == "fits"  # was bf16: 27.81 GiB, exit 10
    assert report["dtype_source"] == "exl2, 4.25 bits a weight"
    arch = from_model_config(MAGNUM_12B_EXL2_425)
    linear = arch.params - arch.embedding_params
    assert report["breakdown"]["weights_bytes"] == round(linear * 4.25 / 8) + (
        arch.embedding_params * 2
    )


def test_aqlm_bits_come_from_its_codebooks() -> None:
    arch = from_model_config(LLAMA2_7B_AQLM_1X16)
    # 1 codebook of 16-bit codes per 8 weights: 2 bits, plus a 2**16 x 8 fp16 codebook
    # (1 MiB) for each of the 224 linear layers.
    linear = arch.params - arch.embedding_params
    assert arch.stored_bits == pytest.approx(2 + 224 * 2**23 / linear)
    weights = estimate(Workload(arch, dtype="int4")).weights
    assert 2.1 * GIB < weights < 2.3 * GIB  # was 12.55 GiB at bf16


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4}}},
        {"quant_method": "eetq", "weights": "int8"},
        {"quant_method": "gptq", "bits": "4"},
        [1],
    ],
    ids=["hqq", "eetq", "bits-string", "not-an-object"],
)
def test_cli_a_quantisation_it_cannot_size_asks_for_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quantization: Any
) -> None:
    config = {**LLAMA_8B, "quantization_config": quantization}
    assert "pass --dtype" in refusal(tmp_path, capsys, "q", config)
    path = tmp_path / "q" / "config.json"
    code, out, _ = run(
        ["fit", "--config", str(path), "--gpu", "H100-80GB", "--dtype", "int4"], capsys
    )
    assert code == 0 and "int4" in out


# --- F5. Nested text configs that leave their class's defaults out -----------------------


def test_cli_llava_15_as_published_is_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = fit_json(tmp_path, capsys, "llava", LLAVA_15_7B_HF, "--gpu", "RTX4090")
    assert code == 0  # was exit 3: "lacks a positive integer 'num_hidden_layers' (llama)"
    assert report["model"]["params"] == 7_046_414_336  # published 7.06B


def test_a_nested_mistral_text_config_gets_mistral_defaults() -> None:
    # llava-v1.6-mistral-7b-hf's text_config: heads, layers and width left to MistralConfig.
    config = {
        "model_type": "llava_next",
        "text_config": {
            "intermediate_size": 14336,
            "model_type": "mistral",
            "num_key_value_heads": 8,
            "sliding_window": None,
            "vocab_size": 32064,
        },
    }
    arch = from_model_config(config)
    assert (arch.layers, arch.hidden, arch.heads, arch.kv_heads) == (32, 4096, 32, 8)
    assert arch.window is None  # null: no window, not MistralConfig's 4096


# --- F6. Multi-head latent attention is counted, its latent cache kept -------------------


def test_deepseek_v2_lite_is_its_published_15_7b_with_a_latent_cache() -> None:
    arch = from_model_config(DEEPSEEK_V2_LITE)
    assert arch.params == 15_706_484_224  # published 15.7B; q_lora_rank null: full q
    assert kv_bytes_per_token(arch, "bf16") == (512 + 64) * 27 * 2  # 31,104


def test_cli_deepseek_v2_lite_at_its_full_context_fits_an_h100(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--gpu", "H100-80GB", "--context", "163840")
    code, report = fit_json(tmp_path, capsys, "dsv2", DEEPSEEK_V2_LITE, *args)
    assert code == 0 and report["kv_cache_bytes_per_token"] == 31_104  # was refused


def test_a_hybrid_refusal_says_what_params_then_estimates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**LLAMA_8B, "layers_block_type": ["mamba", "attention"] * 16}
    err = refusal(tmp_path, capsys, "hybrid", config)
    assert "--params" in err and "over-count" in err and "--config" not in err


# --- F7. Linear-attention layers keep no KV cache; Qwen v1's halved MLP -------------------


def test_minimax_m1_caches_only_its_softmax_layers() -> None:
    arch = from_model_config(MINIMAX_M1_80K)
    assert arch.params == 456_089_655_296  # published 456B (was 446.4B)
    assert kv_bytes_per_token(arch, "bf16") == 2 * 10 * 8 * 128 * 2  # was 8x
    assert arch.state_bytes == 70 * 64 * 128 * 128 * 4


def test_cli_minimax_m1_reports_its_state_beside_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, "minimax", MINIMAX_M1_80K)
    _, out, _ = run(["fit", "--config", path, "--gpu", "H200", "--context", "1000000"], capsys)
    assert "70 linear-attention state" in out
    args = ("--gpu", "H200", "--context", "1000000")
    _, report = fit_json(tmp_path / "b", capsys, "m", MINIMAX_M1_80K, *args)
    kv = report["breakdown"]["kv_cache_bytes"]
    assert kv == 40_960 * 1_000_000 + 70 * 4 * 2**20  # was 305 GiB


def test_minimax_attn_type_list_of_the_wrong_length_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {**MINIMAX_M1_80K, "attn_type_list": [0, 1]}
    assert "attn_type_list" in refusal(tmp_path, capsys, "minimax", config)


def test_qwen_v1_mlp_matrices_are_half_its_intermediate_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert from_model_config(QWEN_7B_CHAT).params == 7_720_931_328  # published 7.72B
    code, report = fit_json(tmp_path, capsys, "qwen", QWEN_7B_CHAT, "--gpu", "RTX4090")
    assert code == 0 and report["verdict"] == "fits"  # was 25.91 GiB, exit 10


# --- F8. Malformed configs and options: one line, exit 3 -----------------------------------


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({**LLAMA_8B, "layer_types": [{"a": 1}] * 32}, "layer_types"),
        ({**LLAMA_8B, "layer_types": [["full_attention"]] * 32}, "layer_types"),
        ({**LLAMA_8B, "layer_types": "full_attention"}, "layer_types"),
        (
            {**LLAMA_8B, "num_experts": 8, "moe_intermediate_size": 1024, "mlp_only_layers": 3},
            "mlp_only_layers",
        ),
        ({**LLAMA_8B, "num_local_experts": 8, "moe_layers": "all"}, "moe_layers"),
        ({**LLAMA_8B, "n_routed_experts": 8, "moe_layer_freq": 0}, "moe_layer_freq"),
        (
            {**LLAMA_8B, "vision_config": {"hidden_size": 10**200, "num_hidden_layers": 10}},
            "beyond",
        ),
        (
            '{"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,'
            '"num_attention_heads":32,"vocab_size":1' + "0" * 400 + "}",
            "beyond any model",
        ),
        ('{"text_config":' * 100_000 + "{}" + "}" * 100_000, "nested too deeply"),
    ],
    ids=[
        "layer-types-objects",
        "layer-types-lists",
        "layer-types-string",
        "mlp-only-layers-int",
        "moe-layers-string",
        "moe-layer-freq-0",
        "vision-width-1e200",
        "vocab-400-digits",
        "nested-100000-deep",
    ],
)
def test_malformed_configs_are_one_line_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Any, says: str
) -> None:
    # Before: exit 1 "unexpected TypeError/OverflowError/RecursionError (a bug)".
    assert says in refusal(tmp_path, capsys, "bad", config)


def test_a_context_past_any_workload_is_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--config", str(LLAMA_8B_PATH), "--gpu", "H100-80GB", "--context", "9" * 400]
    code, _, err = run(args, capsys)
    assert code == 3 and "beyond any workload" in err and err.count("\n") == 1


@pytest.mark.parametrize("kind", ["fifo", "device", "oversized"])
def test_config_reads_only_a_bounded_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would wait for a writer for ever
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    code, _, err = run(["fit", "--config", str(path), "--gpu", "H100-80GB"], capsys)
    assert code == 3 and err.count("\n") == 1
    assert ("not a regular file" if kind != "oversized" else "larger than 16 MiB") in err


def test_a_null_expert_count_is_a_dense_model() -> None:
    # DeepseekV2Config's n_routed_experts=None: no experts.
    dense = from_model_config(LLAMA_8B)
    assert from_model_config({**LLAMA_8B, "n_routed_experts": None}).params == dense.params
    with pytest.raises(ConfigError, match="n_routed_experts"):
        from_model_config({**LLAMA_8B, "n_routed_experts": -4})
