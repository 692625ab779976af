"""Published config.json files (Hugging Face model repositories) the fit tests share,
trimmed to the keys fit reads."""

from __future__ import annotations

from pathlib import Path
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


# --- `gpuwatch fit` accuracy audit: published configs as fit met them -----------------
# Each was copied from a public GitHub copy of the file the comment names, trimmed of
# fields no count reads (token ids, dropout, norms' epsilons, rope).
# https://huggingface.co/THUDM/glm-4-9b-chat/blob/main/config.json (ChatGLM remote code)
GLM_4_9B_CHAT: dict[str, Any] = {
    "add_bias_linear": False,
    "add_qkv_bias": True,
    "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False,
    "architectures": ["ChatGLMModel"],
    "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True,
    "classifier_dropout": None,
    "ffn_hidden_size": 13696,
    "fp32_residual_connection": False,
    "hidden_size": 4096,
    "kv_channels": 128,
    "model_type": "chatglm",
    "multi_query_attention": True,
    "multi_query_group_num": 2,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_layers": 40,
    "original_rope": True,
    "padded_vocab_size": 151552,
    "post_layer_norm": True,
    "rmsnorm": True,
    "rope_ratio": 500,
    "seq_length": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 151552,
}
# https://huggingface.co/bigcode/starcoder2-3b/blob/main/config.json
STARCODER2_3B: dict[str, Any] = {
    "architectures": ["Starcoder2ForCausalLM"],
    "model_type": "starcoder2",
    "vocab_size": 49152,
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "num_hidden_layers": 30,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "sliding_window": 4096,
    "use_bias": True,
    "hidden_act": "gelu_pytorch_tanh",
}
# https://huggingface.co/bigcode/starcoder2-15b/blob/main/config.json
STARCODER2_15B: dict[str, Any] = {
    "architectures": ["Starcoder2ForCausalLM"],
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "max_position_embeddings": 16384,
    "mlp_type": "default",
    "model_type": "starcoder2",
    "num_attention_heads": 48,
    "num_hidden_layers": 40,
    "num_key_value_heads": 4,
    "sliding_window": 4096,
    "use_bias": True,
    "vocab_size": 49152,
}
# https://huggingface.co/nvidia/Nemotron-Mini-4B-Instruct/blob/main/config.json
NEMOTRON_MINI_4B: dict[str, Any] = {
    "architectures": ["NemotronForCausalLM"],
    "hidden_act": "relu2",
    "hidden_size": 3072,
    "intermediate_size": 9216,
    "max_position_embeddings": 4096,
    "model_type": "nemotron",
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.5,
    "tie_word_embeddings": False,
    "vocab_size": 256000,
    "kv_channels": 128,
}
# https://huggingface.co/Qwen/Qwen-7B-Chat/blob/main/config.json (Qwen v1 remote code)
QWEN_7B_CHAT: dict[str, Any] = {
    "architectures": ["QWenLMHeadModel"],
    "bf16": False,
    "fp16": False,
    "fp32": False,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "kv_channels": 128,
    "layer_norm_epsilon": 1e-06,
    "max_position_embeddings": 32768,
    "model_type": "qwen",
    "no_bias": True,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "onnx_safe": None,
    "rotary_emb_base": 10000,
    "rotary_pct": 1.0,
    "scale_attn_weights": True,
    "seq_length": 8192,
    "tie_word_embeddings": False,
    "tokenizer_class": "QWenTokenizer",
    "use_dynamic_ntk": True,
    "use_flash_attn": "auto",
    "use_logn_attn": True,
    "vocab_size": 151936,
}
# https://huggingface.co/llava-hf/llava-1.5-7b-hf/blob/main/config.json: as published, its
# text_config leaves every field equal to LlamaConfig's default out
LLAVA_15_7B_HF: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}
# https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}
# https://huggingface.co/bartowski/magnum-12b-v2.5-kto-exl2/blob/4_25/config.json
# (its quantization_config; the model fields are Mistral-Nemo-12B's)
MAGNUM_12B_EXL2_425: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 40,
    "vocab_size": 131072,
    "max_position_embeddings": 1024000,
    "head_dim": 128,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "model_type": "mistral",
    "quantization_config": {
        "quant_method": "exl2",
        "version": "0.1.8",
        "bits": 4.25,
        "head_bits": 6,
    },
}
# https://huggingface.co/BlackSamorez/Llama-2-7b-AQLM-2Bit-1x16-hf/blob/main/config.json
LLAMA2_7B_AQLM_1X16: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "quantization_config": {
        "in_group_size": 8,
        "nbits_per_codebook": 16,
        "num_codebooks": 1,
        "out_group_size": 1,
        "quant_method": "aqlm",
        "linear_weights_not_to_quantize": ["model.embed_tokens.weight", "lm_head.weight"],
    },
}
# https://huggingface.co/MiniMaxAI/MiniMax-M1-80k/blob/main/config.json (attn_type_list:
# seven lightning-attention layers, then one softmax layer, ten times)
MINIMAX_M1_80K: dict[str, Any] = {
    **{
        "architectures": ["MiniMaxM1ForCausalLM"],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 6144,
        "intermediate_size": 9216,
        "max_position_embeddings": 10240000,
        "model_type": "minimax_m1",
        "num_attention_heads": 64,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "postnorm": True,
        "rotary_dim": 64,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "shared_intermediate_size": 0,
        "shared_moe_mode": "sigmoid",
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 200064,
    },
    "attn_type_list": ([0] * 7 + [1]) * 10,
}
# https://huggingface.co/nvidia/Llama-3_3-Nemotron-Super-49B-v1/blob/main/config.json, as
# NVIDIA's Megatron-Bridge tests copy it (all 80 block_configs): a fixture file.
NEMOTRON_SUPER_49B_PATH = (
    Path(__file__).parent / "fixtures" / "nemotron-super-49b-v1" / "config.json"
)

# meta-llama/Llama-3.3-70B-Instruct (config.json, trimmed): Llama-3.1-8B's fields at 70B's
# sizes.
LLAMA_33_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

# meta-llama/Llama-4-Scout-17B-16E text config as published: chunked attention over
# 8,192-token chunks, and an empty no_rope_layers (Llama4TextConfig then makes every 4th
# layer a full-attention NoPE layer). The vision tower as test_fit_multimodal.py has it.
LLAMA4_SCOUT_TEXT: dict[str, Any] = {
    "attention_chunk_size": 8192,
    "head_dim": 128,
    "hidden_size": 5120,
    "interleave_moe_layer_step": 1,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760,
    "model_type": "llama4_text",
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "vocab_size": 202048,
}
LLAMA4_SCOUT_PUBLISHED: dict[str, Any] = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": LLAMA4_SCOUT_TEXT,
    "vision_config": {
        "hidden_act": "gelu",
        "hidden_size": 1408,
        "image_size": 336,
        "intermediate_size": 5632,
        "model_type": "llama4_vision_model",
        "num_channels": 3,
        "num_hidden_layers": 34,
        "patch_size": 14,
    },
}

# microsoft/Phi-4-multimodal-instruct (trimmed): the Phi-4-mini language model at the top
# level, its SigLIP and Conformer encoders under embd_layer and audio_processor (their
# sizes are in the modelling code, not the config), and the LoRA adapters that load with it.
PHI4_MULTIMODAL: dict[str, Any] = {
    "architectures": ["Phi4MMForCausalLM"],
    "audio_processor": {
        "config": {
            "attention_dim": 1024,
            "attention_heads": 16,
            "linear_units": 1536,
            "num_blocks": 24,
        },
        "name": "cascades",
    },
    "embd_layer": {
        "audio_embd_layer": {"embedding_cls": "audio", "projection_cls": "mlp"},
        "embedding_cls": "image_audio",
        "image_embd_layer": {"crop_size": 448, "embedding_cls": "tune_image"},
    },
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "model_type": "phi4mm",
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "speech_lora": {"dp": 0.01, "lora_alpha": 640, "r": 320},
    "tie_word_embeddings": True,
    "vision_lora": {"dp": 0.0, "lora_alpha": 512, "r": 256},
    "vocab_size": 200064,
}

# microsoft/Phi-3.5-vision-instruct (trimmed): its CLIP tower is named, not described.
PHI35_VISION: dict[str, Any] = {
    "architectures": ["Phi3VForCausalLM"],
    "embd_layer": {"embedding_cls": "image", "projection_cls": "mlp", "use_hd_transform": True},
    "hidden_size": 3072,
    "img_processor": {
        "image_dim_out": 1024,
        "model_name": "openai/clip-vit-large-patch14-336",
        "name": "clip_vision_model",
        "num_img_tokens": 144,
    },
    "intermediate_size": 8192,
    "model_type": "phi3_v",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
}

# microsoft/Phi-3-small-8k-instruct (trimmed): its MLP width is ff_intermediate_size (a
# gegelu up_proj 2 x that wide, then down_proj: a gated MLP of 14,336).
PHI3_SMALL_8K: dict[str, Any] = {
    "architectures": ["Phi3SmallForCausalLM"],
    "dense_attention_every_n_layers": 2,
    "ff_dim_multiplier": None,
    "ff_intermediate_size": 14336,
    "hidden_act": "gegelu",
    "hidden_size": 4096,
    "model_type": "phi3small",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 100352,
}

# google-bert/bert-base-uncased (config.json as published).
BERT_BASE_UNCASED: dict[str, Any] = {
    "architectures": ["BertForMaskedLM"],
    "attention_probs_dropout_prob": 0.1,
    "gradient_checkpointing": False,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0",
    "type_vocab_size": 2,
    "use_cache": True,
    "vocab_size": 30522,
}

# Qwen/Qwen2.5-72B-Instruct: 64 query heads over 8 KV heads, 32,768 positions.
QWEN25_72B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 70,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# Qwen/Qwen2.5-7B-Instruct: 28 query heads over 4 KV heads.
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}
