"""Published config.json files (Hugging Face model repositories) the fit tests share,
trimmed to the keys fit reads."""

from __future__ import annotations

from typing import Any

# google/gemma-3-4b-it: the text config names no sliding_window_pattern (Gemma3TextConfig's
# default, 6, applies) and leaves heads, head_dim and vocab_size at the class defaults,
# written out here (test_fit_sliding_window.py reads the file as published too).
GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 256,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
