"""``fit --config`` on real Hugging Face configs whose fields go beyond Llama's.

Each config is the model's published config.json (unused keys trimmed where long). The
expected counts are worked by hand in the comments: per layer attention
``2*h*n*d + 2*h*k*d``, MLP ``m*h*i`` (m = 3 gated, 2 GPT-style), norms ``2*h``; then
embeddings ``V*h`` (twice when untied) and the final norm ``h``. Published figures
include biases and learned position tables, which the formula leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.architecture import from_hf_config
from gpuwatch.doctor.fit import Workload, estimate, kv_bytes_per_token, options
from gpuwatch.doctor.fit_report import FitReport, run_fit
from gpuwatch.doctor.gpus import catalogue_target, smallest_fitting
from gpuwatch.doctor.units import GIB
from gpuwatch.errors import ConfigError

FALCON_7B: dict[str, Any] = {
    "alibi": False,
    "apply_residual_connection_post_layernorm": False,
    "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0,
    "bias": False,
    "bos_token_id": 11,
    "eos_token_id": 11,
    "hidden_dropout": 0.0,
    "hidden_size": 4544,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon",
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 65024,
}
FALCON_40B: dict[str, Any] = {
    **FALCON_7B,
    "hidden_size": 8192,
    "new_decoder_architecture": True,
    "num_attention_heads": 128,
    "num_hidden_layers": 60,
    "num_kv_heads": 8,
}
# Falcon-40B as first published (remote code, before transformers had FalconConfig).
REFINED_WEB_40B: dict[str, Any] = {
    "alibi": False,
    "architectures": ["RWForCausalLM"],
    "bias": False,
    "hidden_size": 8192,
    "model_type": "RefinedWeb",
    "n_head": 128,
    "n_head_kv": 8,
    "n_layer": 60,
    "parallel_attn": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 65024,
}
STARCODER: dict[str, Any] = {
    "activation_function": "gelu_pytorch_tanh",
    "architectures": ["GPTBigCodeForCausalLM"],
    "model_type": "gpt_bigcode",
    "multi_query": True,
    "n_embd": 6144,
    "n_head": 48,
    "n_inner": 24576,
    "n_layer": 40,
    "n_positions": 8192,
    "vocab_size": 49152,
}
QWEN15_MOE_A27B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
DEEPSEEK_MOE_16B: dict[str, Any] = {
    "architectures": ["DeepseekForCausalLM"],
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "model_type": "deepseek",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "vocab_size": 102400,
}
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "tie_word_embeddings": False,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
GPT2: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}
GEMMA_2B: dict[str, Any] = {
    "architectures": ["GemmaForCausalLM"],
    "head_dim": 256,
    "hidden_act": "gelu",
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "model_type": "gemma",
    "num_attention_heads": 8,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "vocab_size": 256000,
}
# LLaMA-7B as converted in early 2023: no tie_word_embeddings key; LlamaConfig says untied.
LLAMA_7B_NO_TIE_KEY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 32000,
}


# --- 1. multi-query and grouped KV heads (Falcon, GPT-BigCode) ------------------------


def test_falcon_7b_multi_query_has_one_kv_head() -> None:
    arch = from_hf_config(FALCON_7B)
    assert arch.kv_heads == 1
    # Attention 2*4544^2 + 2*4544*1*64 = 41,877,504; MLP 2*4544*18176 = 165,183,488;
    # norms 9,088: 207,070,080 per layer, x32 = 6,626,242,560. Embeddings tied
    # (FalconConfig keeps PretrainedConfig's default; vLLM and transformers share the
    # lm_head): 65024*4544 = 295,469,056; + 4,544. The published 7.22B counts the
    # lm_head the checkpoint stores a second copy of.
    assert arch.params == 6_921_716_160
    assert kv_bytes_per_token(arch, "bf16") == 2 * 32 * 1 * 64 * 2 == 8192


def test_falcon_7b_audit_case_is_tight_on_a_4090_not_71x_too_big() -> None:
    # The audit's case: --context 2048 --batch 32 said 35.50 GiB of KV cache, no fit.
    breakdown = estimate(Workload(from_hf_config(FALCON_7B), context=2048, batch=32))
    assert breakdown.kv_cache == 8192 * 2048 * 32 == GIB // 2
    assert 20 * GIB < breakdown.total < 22 * GIB  # ~21.1 GiB: tight on 24 GiB


def test_falcon_multi_query_is_the_default_for_falcon_configs() -> None:
    # FalconConfig(multi_query=True) is the class default, so a config without the key
    # still has one KV head.
    config = {k: v for k, v in FALCON_7B.items() if k != "multi_query"}
    assert from_hf_config(config).kv_heads == 1


@pytest.mark.parametrize("config", [FALCON_40B, REFINED_WEB_40B], ids=["falcon", "refinedweb"])
def test_falcon_40b_reads_its_8_kv_heads(config: dict[str, Any]) -> None:
    # new_decoder_architecture uses num_kv_heads even with multi_query true; the
    # original RefinedWeb config calls it n_head_kv.
    arch = from_hf_config(config)
    assert arch.kv_heads == 8 and arch.head_dim == 64
    # Attention 2*8192^2 + 2*8192*8*64 = 142,606,336; MLP 2*8192*32768 = 536,870,912;
    # norms 16,384: 679,493,632 x 60 = 40,769,617,920; tied embeddings 532,676,608;
    # + 8,192 = 41,302,302,720 (published 41.8B counts the stored lm_head copy).
    assert arch.params == 41_302_302_720
    assert kv_bytes_per_token(arch, "bf16") == 2 * 60 * 8 * 64 * 2


def test_starcoder_multi_query_kv_cache() -> None:
    arch = from_hf_config(STARCODER)
    assert arch.kv_heads == 1
    assert kv_bytes_per_token(arch, "bf16") == 2 * 40 * 1 * 128 * 2 == 20_480
    assert arch.params == pytest.approx(15.5e9, rel=0.01)  # published 15.5B


# --- 2. mixture of experts ---------------------------------------------------------------


def test_qwen15_moe_counts_expert_and_shared_expert_sizes(tmp_path: Path) -> None:
    arch = from_hf_config(QWEN15_MOE_A27B)
    # Per layer: attention 4*2048^2 = 16,777,216; 60 experts 60*3*2048*1408 = 519,045,120;
    # shared expert 3*2048*5632 = 34,603,008 and its gate 2,048; router 2048*60 = 122,880;
    # norms 4,096: 570,554,368 x 24 = 13,693,304,832. Untied embeddings 2*151936*2048 =
    # 622,329,856; + 2,048 = 14,315,636,736. Published 14.3B (with 147,456 q/k/v biases).
    assert arch.params == 14_315_636_736
    report = _fit(tmp_path, QWEN15_MOE_A27B, gpu="A100-80GB")
    assert report.verdict == "fits"  # was 50.86B, 94.73 GiB: "does NOT fit"


def test_qwen3_moe_without_a_shared_expert() -> None:
    arch = from_hf_config(QWEN3_30B_A3B)
    # Attention 2*2048*4096 + 2*2048*512 = 18,874,368 (head_dim 128, not 2048/32);
    # 128 experts 128*3*2048*768 = 603,979,776; router 262,144; norms 4,096:
    # 623,120,384 x 48 = 29,909,778,432; + 622,329,856 + 2,048 = 30,532,110,336.
    # Published 30,532,122,624 (with 12,288 q/k-norm weights).
    assert arch.params == 30_532_110_336


def test_deepseek_moe_dense_first_layer_and_shared_experts() -> None:
    arch = from_hf_config(DEEPSEEK_MOE_16B)
    # Attention 4*2048^2 x 28 = 469,762,048. Layer 0 is dense (first_k_dense_replace 1):
    # 3*2048*10944 = 67,239,936. Layers 1-27: 64 experts 64*3*2048*1408 = 553,648,128,
    # 2 shared experts as one MLP of 2*1408: 3*2048*2816 = 17,301,504, router 131,072:
    # 571,080,704 x 27 = 15,419,179,008. Norms 4096 x 28 = 114,688; embeddings
    # 2*102400*2048 = 419,430,400; + 2,048 = 16,375,728,128 (published 16.4B).
    assert arch.params == 16_375_728_128


def test_lora_on_moe_adapts_every_expert_at_its_own_size() -> None:
    arch = from_hf_config(QWEN15_MOE_A27B)
    attention = 16 * ((2048 + 2048) * 2 + (2048 + 2048) * 2)
    experts = 16 * 3 * (60 * (2048 + 1408) + (2048 + 5632))
    assert arch.lora_params(16) == (attention + experts) * 24


def test_multi_head_latent_attention_is_counted_from_its_latent_shapes() -> None:
    # Was refused; now DeepSeek-V3's published 671B and its compressed latent cache
    # (kv_lora_rank + qk_rope_head_dim a token a layer, as vLLM keeps it).
    arch = from_hf_config(DEEPSEEK_V3)
    assert arch.params == 671_026_404_352
    assert arch.kv_elements == 61 * (512 + 64)


def test_expert_fields_it_cannot_read_are_refused() -> None:
    # An expert count under a name fit does not know would be counted as one dense MLP.
    config = {**LLAMA_7B_NO_TIE_KEY, "moe_num_experts": 16, "num_experts_per_tok": 4}
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        from_hf_config(config)


# --- 3. tie_word_embeddings defaults -----------------------------------------------------


def test_gpt2_without_the_key_is_tied() -> None:
    arch = from_hf_config(GPT2)
    assert arch.tied_embeddings
    # (4*768^2 + 2*768*3072 + 1536) x 12 = 84,953,088; + 50257*768 = 38,597,376; + 768.
    assert arch.params == 123_551_232
    # Published 124,439,808 adds the 786,432 position table and 102,144 biases.
    assert arch.params == pytest.approx(124_439_808, rel=0.01)


def test_gemma_without_the_key_is_tied() -> None:
    # Attention 2*2048*2048 + 2*2048*256 = 9,437,184; MLP 3*2048*16384 = 100,663,296;
    # norms 4,096: 110,104,576 x 18 = 1,981,882,368; + 256000*2048 + 2048.
    assert from_hf_config(GEMMA_2B).params == 2_506_172_416  # published 2,506,172,416


def test_llama_without_the_key_keeps_llamaconfigs_untied_default() -> None:
    arch = from_hf_config(LLAMA_7B_NO_TIE_KEY)
    assert not arch.tied_embeddings
    assert arch.params == 6_738_415_616  # LLaMA-7B's published count


def test_an_explicit_key_wins_over_the_default() -> None:
    assert not from_hf_config({**GPT2, "tie_word_embeddings": False}).tied_embeddings
    assert from_hf_config({**LLAMA_7B_NO_TIE_KEY, "tie_word_embeddings": True}).tied_embeddings


# --- shapes that would give nonsense ----------------------------------------------------


def test_more_heads_than_hidden_units_is_refused() -> None:
    with pytest.raises(ConfigError, match="head"):
        from_hf_config({**LLAMA_7B_NO_TIE_KEY, "num_attention_heads": 8192})


def test_an_absurd_config_is_refused_like_an_absurd_params() -> None:
    with pytest.raises(ConfigError, match="beyond any model"):
        from_hf_config({**LLAMA_7B_NO_TIE_KEY, "num_hidden_layers": 10**9})


def test_falcon_7b_config_file_is_tight_on_a_4090(tmp_path: Path) -> None:
    report = _fit(tmp_path, FALCON_7B, gpu="RTX4090", context=2048, batch=32)
    assert report.workload.arch.name == "model"
    assert report.gpus[0].verdict == "tight"  # was "does NOT fit", exit 10


def _fit(
    tmp_path: Path, config: dict[str, Any], *, gpu: str, context: int = 4096, batch: int = 1
) -> FitReport:
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config), encoding="utf-8")
    return run_fit(
        params=None,
        config=path,
        dtype=None,
        mode="inference",
        context=context,
        batch=batch,
        gpu=[gpu],
        agent="",
    )


# --- 4. "a bigger GPU" is bigger, and holds the whole range -----------------------------


@pytest.mark.parametrize(
    ("gpu", "context", "verdict", "expected"),
    [
        # Audit M1: these said "a bigger GPU (V100-32GB)", "(A10G)" (24 GiB as well) and
        # "(V100-32GB)" although the range topped out past 85 % of 32 GiB. (Contexts and
        # cards as the corrected training activations put them: the range tops out at
        # 30.19 GiB at 2,048 tokens, 34.93 at 2,560, 49.13 at 4,096.)
        ("V100-32GB", 2048, "unknown", "A100-40GB"),
        ("24GiB", 2560, "unknown", "L40S"),
        ("24GiB", 4096, "does_not_fit", "H100-80GB"),
    ],
)
def test_bigger_gpu_is_strictly_bigger_and_fits_the_top_of_the_range(
    gpu: str, context: int, verdict: str, expected: str
) -> None:
    report = run_fit(
        params="8B",
        config=None,
        dtype=None,
        mode="qlora",
        context=context,
        batch=1,
        gpu=[gpu],
        agent="",
        checkpointing=False,  # the figures above are without it
    )
    fit = report.gpus[0]
    assert fit.verdict == verdict
    assert fit.bigger_gpu == expected
    bigger = catalogue_target(expected).total_bytes
    assert bigger > fit.target.total_bytes
    assert report.breakdown.high_total is not None
    assert report.breakdown.high_total <= 0.85 * bigger


def test_no_bigger_gpu_when_the_largest_card_is_the_target() -> None:
    report = run_fit(
        params="400B",
        config=None,
        dtype="fp32",
        mode="inference",
        context=4096,
        batch=1,
        gpu=["B200"],
        agent="",
    )
    assert report.gpus[0].bigger_gpu is None
    largest = catalogue_target("B200").total_bytes
    assert smallest_fitting(GIB, headroom=0.15, larger_than=largest) is None


# --- 5. what GB means in --gpu ----------------------------------------------------------


@pytest.mark.parametrize("size", ["24GB", "24 GB", "24GiB", "24gb"])
def test_gb_in_gpu_is_the_binary_size_cards_are_sold_with(size: str) -> None:
    # An RTX 4090 "24 GB" has 24 GiB: its driver reports 24,564 MiB, 12 MiB short of
    # 24 GiB, where a decimal 24 GB would be 22.35 GiB (7 % short).
    assert catalogue_target(size).total_bytes == 24 * GIB
    card = catalogue_target("RTX4090").total_bytes
    assert card == 24_564 * 2**20
    assert 0 < catalogue_target(size).total_bytes - card <= 12 * 2**20


def test_fit_help_says_what_gb_means(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwatch.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    help_text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "GB means GiB" in help_text


def test_inference_options_do_not_mention_gradient_accumulation() -> None:
    # Audit L6: Falcon-7B at batch 32 on a 16 GiB card offered gradient accumulation.
    workload = Workload(from_hf_config(FALCON_7B), dtype="int8", context=2048, batch=32)
    changes = [o.change for o in options(workload, catalogue_target("T4").total_bytes)]
    assert "batch 1 (--batch 1)" in changes
    assert not any("accumulation" in change for change in changes)
    trained = Workload(from_hf_config(FALCON_7B), dtype="nf4", mode="qlora", batch=32)
    changes = [o.change for o in options(trained, catalogue_target("A100-80GB").total_bytes)]
    assert any("gradient accumulation" in change for change in changes)
