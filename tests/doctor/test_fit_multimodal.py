"""``fit --config`` on configs whose weights are not all the language model's: vision and
audio towers beside it, Llama 4's interleaved experts and shared expert, and the
families fit does not model (encoder-decoders), which must be refused, not miscounted.

Expected counts are the published ones (the model cards' totals); the encoder estimate
leaves out biases and second projector layers, so a tolerance of 1 % is allowed where
a tower is counted. Configs are the published config.json files, trimmed to the keys
that matter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.architecture import from_model_config
from gpuwatch.errors import ConfigError
from tests.doctor.cli_run import model_config, run
from tests.doctor.published_configs import GEMMA3_4B, LLAMA4_SCOUT_PUBLISHED, LLAVA_15_7B_HF

# The language model at the top level, the ViT's width under embed_dim and the language
# model's under hidden_size, in the same nested config.
QWEN2_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 3584,
        "in_chans": 3,
        "mlp_ratio": 4,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
LLAVA_15_7B: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "vocab_size": 32064,
    },
    "vision_config": LLAVA_15_7B_HF["vision_config"],
}
_LLAMA4_VISION = LLAMA4_SCOUT_PUBLISHED["vision_config"]
_LLAMA4_TEXT = {
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "model_type": "llama4_text",
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "vocab_size": 202048,
}
LLAMA4_SCOUT: dict[str, Any] = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {**_LLAMA4_TEXT, "interleave_moe_layer_step": 1, "num_local_experts": 16},
    "vision_config": _LLAMA4_VISION,
}
LLAMA4_MAVERICK: dict[str, Any] = {
    **LLAMA4_SCOUT,
    "text_config": {**_LLAMA4_TEXT, "interleave_moe_layer_step": 2, "num_local_experts": 128},
}
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
T5_BASE: dict[str, Any] = {
    "architectures": ["T5ForConditionalGeneration"],
    "d_ff": 3072,
    "d_kv": 64,
    "d_model": 768,
    "is_encoder_decoder": True,
    "model_type": "t5",
    "num_decoder_layers": 12,
    "num_heads": 12,
    "num_layers": 12,
    "vocab_size": 32128,
}


@pytest.mark.parametrize(
    ("config", "published"),
    [
        (GEMMA3_4B, 4.30e9),  # SigLIP-400M beside a 3.88B language model
        (QWEN2_VL_7B, 8.29e9),
        (LLAVA_15_7B, 7.06e9),
        (LLAMA4_SCOUT, 108.6e9),  # 16 experts in every layer, each with a shared expert
        (LLAMA4_MAVERICK, 401.6e9),  # 128 experts in every second layer
        (GPT_OSS_120B, 116.83e9),
    ],
    ids=["gemma3-4b", "qwen2-vl-7b", "llava-1.5-7b", "llama4-scout", "llama4-maverick", "gpt-oss"],
)
def test_every_weight_that_loads_is_counted(config: dict[str, Any], published: float) -> None:
    arch = from_model_config(config)
    assert arch.params == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize(
    ("config", "tower"),
    [(GEMMA3_4B, 0.42e9), (QWEN2_VL_7B, 0.63e9), (LLAVA_15_7B, 0.31e9), (LLAMA4_SCOUT, 0.81e9)],
    ids=["siglip", "qwen2-vit", "clip-l", "llama4-vision"],
)
def test_a_vision_tower_is_counted_not_zero(config: dict[str, Any], tower: float) -> None:
    # Left out, it was the whole tower too few: 10 % of Gemma 3 4B, fits that did not.
    arch = from_model_config(config)
    assert arch.encoder_params == pytest.approx(tower, rel=0.05)
    language_only = from_model_config({k: v for k, v in config.items() if k != "vision_config"})
    assert arch.params == language_only.params + arch.encoder_params


def test_an_encoder_it_cannot_size_is_refused() -> None:
    config = {**LLAVA_15_7B, "vision_config": {"model_type": "clip_vision_model"}}
    with pytest.raises(ConfigError, match="vision_config describes an encoder"):
        from_model_config(config)


def test_an_audio_encoder_counts_like_a_vision_tower() -> None:
    audio = {"d_model": 1280, "encoder_layers": 32, "encoder_ffn_dim": 5120}  # Whisper's
    with_audio = from_model_config({**QWEN2_VL_7B, "audio_config": audio})
    alone = from_model_config(QWEN2_VL_7B)
    assert with_audio.encoder_params - alone.encoder_params == pytest.approx(0.63e9, rel=0.05)


def test_quantization_and_rope_settings_are_not_encoders() -> None:
    config = {
        **LLAVA_15_7B["text_config"],
        "quantization_config": {"bits": 4, "group_size": 128, "quant_method": "gptq"},
        "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    }
    assert from_model_config(config).encoder_params == 0


def test_maverick_dense_layers_are_intermediate_size_mlp_wide() -> None:
    # Every layer read as an expert layer counted Maverick at 780B: half of its layers
    # are dense, 16384 wide; the other half have 128 experts and a shared one, 8192 wide.
    arch = from_model_config(LLAMA4_MAVERICK)
    assert sorted(arch.mlps) == [(8192, 24), (8192, 24 * 128), (16384, 24)]


def test_an_explicit_moe_layers_list_wins_over_the_interleave_step() -> None:
    text = {**LLAMA4_MAVERICK["text_config"], "moe_layers": [1, 3, 5]}
    arch = from_model_config({**LLAMA4_MAVERICK, "text_config": text})
    assert (8192, 3 * 128) in arch.mlps and (16384, 45) in arch.mlps


def test_an_unread_layout_field_of_a_moe_model_is_refused() -> None:
    # Read experts, unread layout: which layers have them would be guessed.
    config = {**GPT_OSS_120B, "moe_every_n_layers": 2}
    with pytest.raises(ConfigError, match="moe_every_n_layers"):
        from_model_config(config)


@pytest.mark.parametrize(
    "config",
    [
        T5_BASE,
        {**T5_BASE, "model_type": "bart", "is_encoder_decoder": None},
        {"model_type": "whisper"},
    ],
    ids=["t5", "bart", "whisper"],
)
def test_encoder_decoders_are_refused_by_name(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="encoder-decoder"):
        from_model_config(config)


def test_a_missing_field_names_the_family_and_the_way_out() -> None:
    dbrx = {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40}
    with pytest.raises(ConfigError, match=r"\(dbrx\): fit reads .*use --params"):
        from_model_config(dbrx)


# --- through the command line -----------------------------------------------------------


def test_cli_names_the_encoders_in_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model_config(tmp_path, "gemma-3-4b-it", GEMMA3_4B)
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB"], capsys)
    assert code == 0
    assert "gemma-3-4b-it: 4.30B parameters (0.42B of them its encoders)" in out
    code, out, _ = run(["fit", "--config", path, "--gpu", "H100-80GB", "--json"], capsys)
    model = json.loads(out)["model"]
    assert model["params"] == pytest.approx(4.30e9, rel=0.01)
    assert model["encoder_params"] == pytest.approx(0.42e9, rel=0.05)


def test_cli_refuses_an_encoder_decoder_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["fit", "--config", model_config(tmp_path, "t5-base", T5_BASE)], capsys)
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and "encoder-decoder model (t5)" in err


# --- layers that are not attention ------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        # Jamba: a Mamba layer in every 8 but one attention layer.
        {**LLAVA_15_7B["text_config"], "model_type": "jamba", "attn_layer_period": 8,
         "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_expand": 2},
        # Qwen3-Next: gated DeltaNet (linear attention) in 3 of every 4 layers.
        {**LLAVA_15_7B["text_config"], "model_type": "qwen3_next",
         "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
         "linear_num_value_heads": 32},
        # Nemotron-H: its hybrid pattern string (M: Mamba-2, *: attention, -: MLP).
        {**LLAVA_15_7B["text_config"], "model_type": "nemotron_h",
         "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-", "ssm_state_size": 128},
        # LFM2: short convolutions in most layers.
        {**LLAVA_15_7B["text_config"], "model_type": "lfm2",
         "layer_types": ["conv", "conv", "full_attention"], "conv_L_cache": 3},
    ],
    ids=["jamba", "qwen3-next", "nemotron-h", "lfm2"],
)  # fmt: skip
def test_state_space_and_hybrid_layers_are_refused_not_counted_as_attention(
    config: dict[str, Any],
) -> None:
    with pytest.raises(ConfigError, match="layers that are not attention"):
        from_model_config(config)


def test_sliding_and_full_attention_layers_are_still_counted() -> None:
    # Gemma 3 lists its layers as sliding or full attention: both are attention.
    text = {
        **GEMMA3_4B["text_config"],
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    }
    assert from_model_config({**GEMMA3_4B, "text_config": text}).params == (
        from_model_config(GEMMA3_4B).params
    )
