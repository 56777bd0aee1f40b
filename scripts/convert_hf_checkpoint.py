# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Convert a Hugging Face LLaMA-family checkpoint into brisk's model.pth + config.json.

Reads safetensors (single file or sharded index) or pytorch_model*.bin from CHECKPOINT_DIR/hf
(where scripts/download.py puts them) or CHECKPOINT_DIR itself, and writes model.pth,
config.json and the tokenizer files into CHECKPOINT_DIR. Every HF tensor must be consumed.
"""
import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

from typing import Optional

import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_output_dir, error_boundary  # noqa: E402
from load import atomic_save, atomic_write  # noqa: E402
from model import ModelArgs  # noqa: E402
from rope import ROPE_TYPES, rope_type  # noqa: E402

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3",
             "smollm3", "olmo2", "olmo3", "exaone4", "granite", "seed_oss", "glm", "glm4", "gpt_oss", "ernie4_5",
             "ministral3", "cohere", "cohere2", "olmoe", "granitemoe", "qwen2_moe", "glm4_moe", "dots1", "minimax_m2",
             "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral4", "gemma4_text", "qwen3_5_text",
             "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm2_moe", "lfm3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")

# HF name (layer index as {}) -> brisk name. q/k/v are fused into wqkv afterwards.
WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",  # Qwen3, Gemma 3, OLMo 2
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    # Qwen2-MoE's shared expert and its gate.
    "model.layers.{}.mlp.shared_expert.gate_proj.weight": "layers.{}.feed_forward.shared_expert.w1.weight",
    "model.layers.{}.mlp.shared_expert.up_proj.weight": "layers.{}.feed_forward.shared_expert.w3.weight",
    "model.layers.{}.mlp.shared_expert.down_proj.weight": "layers.{}.feed_forward.shared_expert.w2.weight",
    "model.layers.{}.mlp.shared_expert_gate.weight": "layers.{}.feed_forward.shared_gate.weight",
    # DeepSeek V3's (GLM-4.5's, dots.llm1's): shared experts as one feed-forward, the router's selection bias.
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.feed_forward.shared_expert.w1.weight",
    "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.feed_forward.shared_expert.w3.weight",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.feed_forward.shared_expert.w2.weight",
    "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.feed_forward.selection_bias",
    "model.layers.{}.block_sparse_moe.e_score_correction_bias": "layers.{}.feed_forward.selection_bias",  # MiniMax
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    # Mixtral, hub layout: one tensor per expert, stacked into [E, ...] afterwards.
    "model.layers.{}.block_sparse_moe.gate.weight": "layers.{}.feed_forward.gate.weight",
    "model.layers.{}.block_sparse_moe.experts.{}.w1.weight": "layers.{}.feed_forward.w1.{}",
    "model.layers.{}.block_sparse_moe.experts.{}.w2.weight": "layers.{}.feed_forward.w2.{}",
    "model.layers.{}.block_sparse_moe.experts.{}.w3.weight": "layers.{}.feed_forward.w3.{}",
    # Qwen3-MoE, hub layout.
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.feed_forward.w1.{}",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.feed_forward.w3.{}",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.feed_forward.w2.{}",
    # Mixtral and Qwen3-MoE, transformers 5 in-memory layout: experts stacked, gate and up fused as [E, 2I, D].
    "model.layers.{}.mlp.gate.weight": "layers.{}.feed_forward.gate.weight",
    "model.layers.{}.mlp.experts.gate_up_proj": "layers.{}.feed_forward.w13",
    "model.layers.{}.mlp.experts.down_proj": "layers.{}.feed_forward.w2",
    # Phi-3: q/k/v already fused in our order; gate and up fused as [2I, D].
    "model.layers.{}.self_attn.qkv_proj.weight": "layers.{}.attention.wqkv.weight",
    "model.layers.{}.mlp.gate_up_proj.weight": "layers.{}.feed_forward.w13.weight",
}
# Where a family's norms sit otherwise: Gemma's post_attention_layernorm follows the attention
# (its pre-feed-forward norm has its own name); OLMo 2 has post-norms only.
_SANDWICH = {
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.post_ffn_norm.weight",
}
_POST = {k: v for k, v in _SANDWICH.items() if "pre_feedforward" not in k}
# LFM2: its norms and attention named its own way, the short convolution's projections
_LFM2 = {"model.embedding_norm.weight": "norm.weight",
         "model.layers.{}.operator_norm.weight": "layers.{}.attention_norm.weight",
         "model.layers.{}.ffn_norm.weight": "layers.{}.ffn_norm.weight",
         **{f"model.layers.{{}}.feed_forward.{w}.weight": f"layers.{{}}.feed_forward.{w}.weight"
            for w in ("w1", "w2", "w3")},
         "model.layers.{}.self_attn.out_proj.weight": "layers.{}.attention.wo.weight",
         "model.layers.{}.self_attn.q_layernorm.weight": "layers.{}.attention.q_norm.weight",
         "model.layers.{}.self_attn.k_layernorm.weight": "layers.{}.attention.k_norm.weight",
         "model.layers.{}.conv.in_proj.weight": "layers.{}.attention.w_in.weight",
         "model.layers.{}.conv.conv.weight": "layers.{}.attention.conv",
         "model.layers.{}.conv.out_proj.weight": "layers.{}.attention.wo.weight",
         # LFM2-MoE's experts (the hub's one tensor each, or transformers 5's gate and up fused as
         # [E, 2I, D]), router and its selection bias
         **{f"model.layers.{{}}.feed_forward.experts.{{}}.{w}.weight": f"layers.{{}}.feed_forward.{w}.{{}}"
            for w in ("w1", "w2", "w3")},
         "model.layers.{}.feed_forward.gate.weight": "layers.{}.feed_forward.gate.weight",
         "model.layers.{}.feed_forward.experts.gate_up_proj": "layers.{}.feed_forward.w13",
         "model.layers.{}.feed_forward.experts.down_proj": "layers.{}.feed_forward.w2",
         "model.layers.{}.feed_forward.expert_bias": "layers.{}.feed_forward.selection_bias"}
FAMILY_WEIGHT_MAP = {
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
    "gemma4_text": {**_SANDWICH, "model.layers.{}.layer_scalar": "layers.{}.layer_scale",
                    # E2B / E4B: each layer's own input
                    "model.embed_tokens_per_layer.weight": "per_layer_embeddings.weight",
                    "model.per_layer_model_projection.weight": "per_layer_projection.weight",
                    "model.per_layer_projection_norm.weight": "per_layer_norm.weight",
                    "model.layers.{}.per_layer_input_gate.weight": "layers.{}.per_layer_gate.weight",
                    "model.layers.{}.per_layer_projection.weight": "layers.{}.per_layer_out.weight",
                    "model.layers.{}.post_per_layer_input_norm.weight": "layers.{}.per_layer_out_norm.weight",
                    # the 26B's experts beside the dense feed-forward, their router and norms
                    "model.layers.{}.experts.gate_up_proj": "layers.{}.experts.w13",
                    "model.layers.{}.experts.down_proj": "layers.{}.experts.w2",
                    "model.layers.{}.router.proj.weight": "layers.{}.experts.gate.weight",
                    "model.layers.{}.router.scale": "layers.{}.experts.router_norm.weight",
                    "model.layers.{}.router.per_expert_scale": "layers.{}.experts.expert_scales",
                    "model.layers.{}.post_feedforward_layernorm_1.weight": "layers.{}.post_mlp_norm.weight",
                    "model.layers.{}.pre_feedforward_layernorm_2.weight": "layers.{}.experts_norm.weight",
                    "model.layers.{}.post_feedforward_layernorm_2.weight": "layers.{}.post_experts_norm.weight"},
    "olmo2": _POST,
    "olmo3": _POST,
    "exaone4": _POST,
    # gpt-oss: experts as [E, D, 2I] with gate and up interleaved, [E, I, D] (transposed below), or
    # the hub's MXFP4 blocks and scales of [E, 2I, D] and [E, D, I] (dequantized below).
    "gpt_oss": {"model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
                "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks",
                "model.layers.{}.mlp.router.weight": "layers.{}.feed_forward.gate.weight",
                "model.layers.{}.mlp.router.bias": "layers.{}.feed_forward.gate.bias",
                **{f"model.layers.{{}}.mlp.experts.{hf}{suffix}": f"layers.{{}}.feed_forward.{ours}{suffix}"
                   for hf, ours in (("gate_up_proj", "w13"), ("down_proj", "w2")) for suffix in
                   ("", "_bias", "_blocks", "_scales")}},
    # DeepSeek's latent attention: kv_b (both up-projections) is split into wk_b and wv_b below.
    **{family: {f"model.layers.{{}}.self_attn.{hf}.weight": f"layers.{{}}.attention.{ours}.weight" for hf, ours in (
        ("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b"), ("q_proj", "wq"),
        ("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"))}
       for family in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral4")},
    # Granite 3's MoE: gate and up stacked per expert as [E, 2I, D], down as [E, D, I].
    "granitemoe": {"model.layers.{}.block_sparse_moe.input_linear.weight": "layers.{}.feed_forward.w13",
                   "model.layers.{}.block_sparse_moe.output_linear.weight": "layers.{}.feed_forward.w2",
                   "model.layers.{}.block_sparse_moe.router.layer.weight": "layers.{}.feed_forward.gate.weight"},
    # Qwen3.5 / Qwen3-Next: Gated DeltaNet layers, their input projections fused into w_in below
    **{family: {f"model.layers.{{}}.linear_attn.{hf}": f"layers.{{}}.attention.{ours}" for hf, ours in (
        ("in_proj_qkv.weight", "w_qkv"), ("in_proj_z.weight", "w_z"), ("in_proj_b.weight", "w_b"),
        ("in_proj_a.weight", "w_a"), ("in_proj_qkvz.weight", "w_qkvz"), ("in_proj_ba.weight", "w_ba"),
        ("conv1d.weight", "conv"), ("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm.weight", "norm_weight"),
        ("out_proj.weight", "wo.weight"))} for family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")},
    **{family: _LFM2 for family in ("lfm2", "lfm2_moe")},
    # LFM3: LFM2's convolutions, norms and feed-forward; Qwen3's attention names, a gate per head; norms
    # after each sublayer too
    "lfm3": {**_LFM2,
             # (the hub's files name the gate gate_proj, transformers' module g_proj)
             **{f"model.layers.{{}}.self_attn.{g}.weight": "layers.{}.attention.wgate.weight"
                for g in ("gate_proj", "g_proj")},
             "model.layers.{}.post_operator_norm.weight": "layers.{}.post_attention_norm.weight",
             "model.layers.{}.post_ffn_norm.weight": "layers.{}.post_ffn_norm.weight"},
    # GLM-4: norms after each sublayer too, named its own way.
    "glm4": {"model.layers.{}.post_self_attn_layernorm.weight": "layers.{}.post_attention_norm.weight",
             "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
             "model.layers.{}.post_mlp_layernorm.weight": "layers.{}.post_ffn_norm.weight"},
}
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# A multimodal checkpoint's language model (Gemma 3 from 4B, Mistral Small 3.1 / 3.2, LLaVA-style
# models): its tensors under these prefixes, as text-only checkpoints name them; the rest (the vision
# tower, the projector) is left out.
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("model.lm_head.", "lm_head."))

_LINEAR_ATTENTION = dict(head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
                         rms_norm_eps=1e-6)
_GRANITE = dict(embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0)
# transformers' defaults for the keys a hub config.json of the family may leave out.
HF_DEFAULTS = {
    "gemma2": dict(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    # (the hub's multimodal Gemma 3 configs leave out of text_config all that equals these)
    "gemma3_text": dict(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                        sliding_window=4096, sliding_window_pattern=6, rope_local_base_freq=10_000.0,
                        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6),
    "gemma4_text": dict(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", sliding_window=512,
                        rms_norm_eps=1e-6, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
                        attention_k_eq_v=False),
    "smollm3": dict(tie_word_embeddings=True, no_rope_layer_interval=4),
    "qwen2": dict(max_window_layers=28),
    "lfm2": dict(tie_word_embeddings=True, norm_eps=1e-5, conv_L_cache=3),
    "lfm2_moe": dict(tie_word_embeddings=True, norm_eps=1e-5, conv_L_cache=3, use_expert_bias=True,
                     norm_topk_prob=True, num_dense_layers=2),
    "lfm3": dict(tie_word_embeddings=True, norm_eps=1e-5, conv_L_cache=7, head_dim=128, sliding_window=256,
                 use_sandwich_norm=True, use_attention_gate=True, rope_parameters={
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                        "partial_rotary_factor": 0.5}}),
    "qwen3": dict(max_window_layers=28),
    "qwen3_moe": dict(max_window_layers=28, norm_topk_prob=False, decoder_sparse_step=1),
    "qwen2_moe": dict(max_window_layers=28, norm_topk_prob=False, decoder_sparse_step=1, qkv_bias=True),
    "olmo3": dict(sliding_window=4096),
    "exaone4": dict(sliding_window=4096, sliding_window_pattern=4),
    "seed_oss": dict(attention_bias=True),
    "glm": dict(attention_bias=True, head_dim=128),
    "glm4": dict(attention_bias=True, head_dim=128),
    "ernie4_5": dict(tie_word_embeddings=True, head_dim=128),
    "cohere": dict(tie_word_embeddings=True, logit_scale=0.0625, layer_norm_eps=1e-5),
    "cohere2": dict(tie_word_embeddings=True, logit_scale=0.0625, layer_norm_eps=1e-5, sliding_window=4096),
    "gpt_oss": dict(attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    "granite": _GRANITE,
    "granitemoe": _GRANITE,
    "glm4_moe": dict(attention_bias=False, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
    "dots1": dict(norm_topk_prob=False, first_k_dense_replace=0, max_window_layers=62),
    "minimax_m2": dict(norm_topk_prob=True),
    "deepseek_v3": dict(n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True, rope_interleave=True),
    "deepseek_v2": dict(n_shared_experts=2, first_k_dense_replace=0, topk_method="greedy",
                        rope_interleave=True),  # (V2 has no switch: it always rotates neighbouring pairs)
    "glm4_moe_lite": dict(n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True),
    "mistral4": dict(n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=True, rope_interleave=True),
    **{family: dict(_LINEAR_ATTENTION, **extra) for family, extra in (
        ("qwen3_5_text", {}), ("qwen3_5_moe_text", dict(norm_topk_prob=True)),
        ("qwen3_next", dict(norm_topk_prob=True, decoder_sparse_step=1)))},
}
# LFM2's hub configs use their own names for two of transformers' keys
HF_ALIASES = {family: {"tie_embedding": "tie_word_embeddings", "block_ff_dim": "intermediate_size"}
              for family in ("lfm2", "lfm2_moe")}
DEFAULT_ROPE_BASE = {"gemma3_text": 1_000_000.0, "olmo3": 500_000.0, "ernie4_5": 500_000.0, "cohere": 500_000.0,
                     "minimax_m2": 5_000_000.0, "lfm2": 1_000_000.0, "lfm2_moe": 1_000_000.0}
# Qwen3.5 / Qwen3-Next: Gated DeltaNet on 3 layers in 4, a gate on the others' attention output, Gemma's
# (1 + weight) norms but for the one inside Gated DeltaNet
LINEAR_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# transformers' defaults where a config leaves it out
PARTIAL_ROTARY = {"glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5, **{family: 0.25 for family in LINEAR_ATTENTION}}
# RoPE on pairs (0, 1), (2, 3), ...: the converter reorders q/k rows to halves
INTERLEAVED_ROPE = ("glm", "glm4", "ernie4_5", "cohere", "cohere2")
COHERE = ("cohere", "cohere2")  # one LayerNorm (no bias) before attention and feed-forward, side by side
# families whose attention_bias puts a bias on q/k/v only
QKV_BIAS = ("qwen2", "qwen2_moe", "seed_oss", "glm", "glm4", "glm4_moe")
POST_NORMS = ("olmo2", "olmo3", "exaone4")  # x + norm(f(x))
# HF activation name -> ModelArgs.hidden_act
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
GEMMA = ("gemma2", "gemma3_text")
# DeepSeek's multi-head latent attention (kv_lora_rank)
MLA = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral4")
# DeepSeek's mixture of experts: groups, shared experts, dense first layers; V3's sigmoid routing with a
# selection bias (V2 and Mistral 4 route by softmax)
DEEPSEEK_MOE = ("glm4_moe", "dots1") + MLA
SIGMOID_ROUTER = ("glm4_moe", "dots1", "minimax_m2", "deepseek_v3", "glm4_moe_lite", "lfm2_moe")
# LFM2's short convolutions (linear_attention "short_conv") beside attention; LFM3's too
LFM2 = ("lfm2", "lfm2_moe", "lfm3")
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "olmoe", "granitemoe", "minimax_m2", "qwen3_5_moe_text",
       "qwen3_next", "lfm2_moe") + DEEPSEEK_MOE
# Checkpoints that keep multi-token-prediction layers after the last (GLM-4.5's, DeepSeek V3's): brisk
# does not run them
MTP_LAYERS = ("glm4_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite")


def text_model(hf: dict) -> dict:
    """A multimodal checkpoint's config.json (one with a text_config) -> its language model's;
    another config as it is."""
    if not isinstance(hf.get("text_config"), dict):
        return hf
    text = hf["text_config"]
    if text.get("model_type") not in SUPPORTED:
        raise ValueError(f"the {hf.get('model_type')!r} checkpoint's language model has model_type "
                         f"{text.get('model_type')!r}; supported: {', '.join(SUPPORTED)}")
    # The wrapper's tie_word_embeddings is the one transformers applies (and saves the weights by).
    return {**text, **{k: hf[k] for k in ("tie_word_embeddings", "quantization_config") if k in hf}}


def text_tensor_name(name: str) -> Optional[str]:
    """A multimodal checkpoint's tensor -> its text-only name, None for the vision tower's and the
    projector's (TEXT_PREFIXES)."""
    for prefix, replacement in TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name if name.startswith("lm_head.") else None


def with_defaults(hf: dict) -> dict:
    """A config.json with transformers' defaults for the keys its family lets it leave out (HF_DEFAULTS),
    and its keys under the names transformers reads them by (HF_ALIASES)."""
    aliases = HF_ALIASES.get(hf.get("model_type"), {})
    return {**HF_DEFAULTS.get(hf.get("model_type"), {}), **{aliases.get(k, k): v for k, v in hf.items()}}


def config_from_hf(hf: dict) -> ModelArgs:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture {model_type!r} ({hf.get('architectures')}); "
                         f"supported model_type values: {', '.join(SUPPORTED)}")
    quantized = hf.get("quantization_config") or {}
    if quantized and not (model_type == "gpt_oss" and quantized.get("quant_method") == "mxfp4"
                          or fp8_block(hf) is not None):
        raise ValueError(f"this checkpoint's weights are quantized ({quantized.get('quant_method')!r} in "
                         "quantization_config); convert the full-precision (bf16) release of the model, then "
                         "quantize it with quantize.py")
    hf = with_defaults(hf)
    n_layer, n_head = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    rope_base, rope_scaling, rope_local_base, partial = rope_from_hf(hf, model_type)
    act_key = "hidden_activation" if model_type in GEMMA + ("gemma4_text",) else "hidden_act"
    act = hf.get(act_key, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported {act_key} {act!r}; supported: {', '.join(ACTIVATIONS)}")
    gemma4, lfm3 = model_type == "gemma4_text", model_type == "lfm3"
    if gemma4 and hf.get("use_bidirectional_attention") == "all":  # ("vision" concerns image tokens only)
        raise ValueError('unsupported use_bidirectional_attention="all" in the gemma4_text config.json')
    for key in ("mlp_bias", "attention_out_bias", "use_bias", "clip_qkv") + (
            ("use_bidirectional_attention",) if not gemma4 else ()) + (
            ("use_qk_norm",) if model_type not in ("glm4_moe", "minimax_m2") else ()) + (
            ("attention_bias",) if model_type not in QKV_BIAS + ("gpt_oss",) else ()):
        if hf.get(key):  # (attention_bias: these families put a bias on o_proj too)
            raise ValueError(f"unsupported {key}={json.dumps(hf[key])} in the {model_type} config.json")
    window, window_layers = sliding_window_from_hf(hf, model_type)
    # Qwen3-MoE's hub configs say num_experts, transformers 5 writes num_local_experts as Mixtral's do.
    experts = (hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
               if model_type in MOE or model_type == "gemma4_text" and hf.get("enable_moe_block") else 0)
    dense, shared = None, None
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        dense = [i for i in range(n_layer) if i in (hf.get("mlp_only_layers") or [])
                 or (i + 1) % hf["decoder_sparse_step"]] or None
    if model_type in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_next"):
        shared = hf.get("shared_expert_intermediate_size") or None
    linear = model_type in LINEAR_ATTENTION
    linear_layers = None
    if linear:
        types = hf.get("layer_types") or ["full_attention" if (i + 1) % hf["full_attention_interval"] == 0
                                          else "linear_attention" for i in range(n_layer)]
        linear_layers = [i for i, t in enumerate(types) if t == "linear_attention"] or None
    if model_type in LFM2:
        if hf.get("conv_bias"):
            raise ValueError(f"unsupported conv_bias=true in the {model_type} config.json")
        types = lfm_layer_types(hf, model_type)
        linear_layers = [i for i, t in enumerate(types) if t == "conv"] or None
        if model_type == "lfm2_moe":
            dense = list(range(min(hf["num_dense_layers"], n_layer))) or None
    if model_type in DEEPSEEK_MOE:
        types = hf.get("mlp_layer_types")  # GLM-4.7-Flash's form
        dense = ([i for i, t in enumerate(types) if t == "dense"] if types
                 else list(range(min(hf["first_k_dense_replace"], n_layer)))) or None
        shared = hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0) or None
    groups = (hf.get("n_group") or 1, hf.get("topk_group") or 1) if model_type in DEEPSEEK_MOE else (1, 1)
    if model_type == "deepseek_v2" and hf["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {hf['topk_method']!r}; supported: greedy, group_limited_greedy")
    if model_type == "deepseek_v2" and hf["topk_method"] == "greedy":
        groups = (1, 1)
    mla = model_type in MLA
    if mla:  # queries and keys of nope + rope dims, the rotated ones last; one latent for every head
        head_dim, n_kv_heads = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], 1
    else:
        n_kv_heads = hf.get("num_key_value_heads") or n_head
    routed_scale = (float(hf.get("routed_scaling_factor") or 1.0) if model_type in DEEPSEEK_MOE + ("lfm2_moe",)
                    else 1.0)
    no_rope = None
    if model_type == "smollm3":  # HF lists 1 for the layers that use RoPE
        uses_rope = hf.get("no_rope_layers") or [int((i + 1) % hf["no_rope_layer_interval"] != 0)
                                                 for i in range(n_layer)]
        no_rope = [i for i, rope in enumerate(uses_rope) if not rope] or None
    # RoPE on the windowed layers only: a windowed EXAONE 4's, every Cohere2 (without a window, none)
    if model_type == "cohere2" or (model_type == "exaone4" and window is not None):
        no_rope = [i for i in range(n_layer) if window is None or i not in (window_layers or range(n_layer))] or None
    gemma, granite, gpt_oss = model_type in GEMMA, model_type in ("granite", "granitemoe"), model_type == "gpt_oss"
    beta, length = query_scale_from_hf(hf)
    global_head_dim, global_kv_heads = gemma4_global_attention(hf, window_layers, n_layer) if gemma4 else (None, None)
    return ModelArgs(
        block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        n_layer=n_layer,
        n_head=n_head,
        dim=hf["hidden_size"],
        # (Qwen3.5's MoE models have experts in every layer and no dense size)
        intermediate_size=(hf["moe_intermediate_size"] if model_type == "qwen3_5_moe_text" else lfm2_mlp_size(hf)
                           if model_type == "lfm2" else hf["intermediate_size"]),
        n_local_heads=n_kv_heads,
        head_dim=head_dim,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm_eps=hf["layer_norm_eps" if model_type in COHERE else "norm_eps" if model_type in LFM2 else "rms_norm_eps"],
        attention_bias=(model_type in QKV_BIAS or gpt_oss) and bool(
            hf.get("qkv_bias" if model_type == "qwen2_moe" else "attention_bias", True)),
        attention_out_bias=gpt_oss and bool(hf.get("attention_bias", True)),
        attention_sinks=gpt_oss,
        query_scale_beta=beta,
        query_scale_length=length,
        moe_bias=gpt_oss,
        swiglu_limit=hf["swiglu_limit"] if gpt_oss else None,
        swiglu_alpha=hf["swiglu_alpha"] if gpt_oss else None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        num_experts=experts,
        num_activated_experts=hf.get("top_k_experts" if gemma4 else "num_experts_per_tok") or 2,
        moe_intermediate_size=(hf.get("moe_intermediate_size") if model_type in (
            "qwen3_moe", "qwen2_moe", "gemma4_text", "qwen3_5_moe_text", "qwen3_next", "lfm2_moe") + DEEPSEEK_MOE
            else None),
        shared_expert_size=shared,
        shared_expert_gate=model_type in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_next") and shared is not None,
        router="sigmoid" if model_type in SIGMOID_ROUTER else "softmax",
        expert_selection_bias=model_type in SIGMOID_ROUTER and bool(hf.get("use_expert_bias", True)),
        expert_groups=groups[0],
        expert_groups_used=groups[1],
        expert_group_top=1 if model_type == "deepseek_v2" else 2,  # V2 ranks a group by its best expert
        routed_scale=routed_scale if routed_scale != 1.0 else None,
        # (MiniMax M2 renormalises whatever its config says, DeepSeek V2 never, as transformers does)
        norm_topk_prob=(model_type == "minimax_m2"
                        or model_type != "deepseek_v2" and bool(hf.get("norm_topk_prob", True))),
        dense_layers=dense,
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "gemma4_text": "head", "exaone4": "head",
                 "dots1": "head", "glm4_moe": "head" if hf.get("use_qk_norm") else None,
                 **{family: "head" for family in LINEAR_ATTENTION + LFM2},
                 "olmo2": "all", "olmo3": "all", "olmoe": "all", "minimax_m2": "all"}.get(model_type),
        norm_offset=1.0 if gemma or linear else 0.0,
        norm_centered=model_type in COHERE,
        block_norms=("sandwich" if gemma or gemma4 or model_type == "glm4" or lfm3 and hf["use_sandwich_norm"] else
                     "post" if model_type in POST_NORMS else "parallel" if model_type in COHERE else "pre"),
        hidden_act=ACTIVATIONS[act],
        embedding_scale=(hf["hidden_size"] ** 0.5 if gemma or gemma4 else hf["embedding_multiplier"] if granite
                         else None),
        attention_scale=(hf["query_pre_attn_scalar"] ** -0.5 if gemma else hf["attention_multiplier"] if granite
                         else mla_attention_scale(head_dim, rope_scaling) if mla else 1.0 if gemma4 else None),
        residual_scale=hf["residual_multiplier"] if granite else None,
        logit_divisor=hf["logits_scaling"] if granite else 1 / hf["logit_scale"] if model_type in COHERE else None,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if gemma or gemma4 else None,
        sliding_window_layers=window_layers,
        rope_local_base=rope_local_base,
        rope_dim=hf["qk_rope_head_dim"] if mla else int(head_dim * partial),
        no_rope_layers=no_rope,
        kv_lora_rank=hf["kv_lora_rank"] if mla else None,
        q_lora_rank=hf.get("q_lora_rank") or None if mla else None,
        v_head_dim=hf["v_head_dim"] if mla else None,
        global_head_dim=global_head_dim,
        global_kv_heads=global_kv_heads,
        global_values_are_keys=gemma4 and bool(hf["attention_k_eq_v"]),
        per_layer_input_size=hf["hidden_size_per_layer_input"] or None if gemma4 else None,
        per_layer_vocab_size=hf.get("vocab_size_per_layer_input") if gemma4 and hf["hidden_size_per_layer_input"]
        else None,
        kv_shared_layers=hf.get("num_kv_shared_layers") or 0 if gemma4 else 0,
        double_wide_mlp=gemma4 and bool(hf.get("use_double_wide_mlp")) and bool(hf.get("num_kv_shared_layers")),
        experts_beside_mlp=gemma4 and bool(experts),
        router_input_norm=gemma4 and bool(experts),
        value_norm=gemma4,
        layer_scale=gemma4,
        linear_attention_layers=linear_layers,
        **(dict(linear_key_heads=hf["linear_num_key_heads"], linear_value_heads=hf["linear_num_value_heads"],
                linear_key_dim=hf["linear_key_head_dim"], linear_value_dim=hf["linear_value_head_dim"],
                linear_conv_kernel=hf["linear_conv_kernel_dim"], attention_output_gate=True) if linear else {}),
        **(dict(linear_attention="short_conv", linear_conv_kernel=hf["conv_L_cache"]) if model_type in LFM2 else {}),
        attention_head_gate=lfm3 and bool(hf["use_attention_gate"]),
    )


def lfm_layer_types(hf: dict, model_type: str) -> list:
    """LFM2's / LFM3's layer_types, as transformers makes them where config.json leaves them out."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return hf["layer_types"]
    if model_type == "lfm3":  # attention on layers 2, 6, 10, ... and windowed on 4, 8, ...
        return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
                for i in range(n)]
    return ["full_attention" if i in hf.get("full_attn_idxs", range(n)) else "conv" for i in range(n)]


def lfm2_mlp_size(hf: dict) -> int:
    """LFM2's feed-forward width as transformers derives it from intermediate_size (two thirds of it,
    times block_ffn_dim_multiplier, rounded up to block_multiple_of)."""
    size = hf["intermediate_size"]
    if hf.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            size = int(hf["block_ffn_dim_multiplier"] * size)
            multiple = hf.get("block_multiple_of", 256)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def gemma4_global_attention(hf: dict, window_layers: Optional[list], n_layer: int) -> tuple:
    """(global_head_dim, global_kv_heads) of Gemma 4's full-attention layers: transformers writes them per
    layer (per_layer_config), hub configs as global_head_dim / num_global_key_value_heads (the latter
    where attention_k_eq_v), as transformers reads them."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        heads = hf.get("num_global_key_value_heads") if hf["attention_k_eq_v"] else None
        return hf.get("global_head_dim", 512), heads
    global_layers = [i for i in range(n_layer) if window_layers is not None and i not in window_layers]
    shapes = {(v.get("head_dim"), v.get("num_key_value_heads")) for v in per_layer.values()}
    if sorted(int(i) for i in per_layer) != global_layers or len(shapes) != 1:
        raise ValueError(f"unsupported per_layer_config {json.dumps(per_layer)}: brisk gives the full-attention "
                         "layers one shape of their own")
    return next(iter(shapes))


def mla_attention_scale(head_dim: int, rope_scaling: Optional[dict]) -> Optional[float]:
    """DeepSeek's softmax scale: 1 / sqrt(head_dim), times YaRN's mscale (over mscale_all_dim) squared
    where the context is stretched (transformers' yarn_apply_mscale); None where that is 1 / sqrt(head_dim)."""
    scaling = rope_scaling or {}
    if not scaling.get("mscale_all_dim") or scaling.get("factor", 1) <= 1:
        return None
    mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
    return head_dim ** -0.5 * mscale * mscale


YARN_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def rope_from_hf(hf: dict, model_type: str) -> tuple:
    """(rope_base, rope_scaling, rope_local_base, partial_rotary_factor) from either config form:
    hub checkpoints carry rope_theta / rope_scaling, transformers 5 writes rope_parameters (per
    layer type for Gemma 3: {"full_attention": ..., "sliding_attention": ...})."""
    params = dict(hf.get("rope_parameters") or {})
    local = None
    if "full_attention" in params:
        params, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    # (transformers 5 writes rope_theta / partial_rotary_factor: null beside rope_parameters for some families)
    theta, params_partial = params.pop("rope_theta", None), params.pop("partial_rotary_factor", None)
    rope_base = float(hf.get("rope_theta") or theta or DEFAULT_ROPE_BASE.get(model_type, 10000.0))
    partial = float(hf.get("partial_rotary_factor") or params_partial or PARTIAL_ROTARY.get(model_type, 1.0))
    if hf.get("rotary_dim") and not (hf.get("partial_rotary_factor") or params_partial):
        # MiniMax M2's released configs name the rotated dimensions instead
        partial = hf["rotary_dim"] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    scaling = dict(hf.get("rope_scaling") or params)
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = rope_type(scaling)
    if kind in ("su", "yarn") and model_type == "phi3":  # transformers reads Phi-3's old names as longrope
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling rope_type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "longrope":
        orig = scaling.get("original_max_position_embeddings") or hf["original_max_position_embeddings"]
        scaling = {"rope_type": "longrope", "short_factor": scaling["short_factor"],
                   "long_factor": scaling["long_factor"], "original_max_position_embeddings": orig,
                   # Phi-3 derives the attention factor from the context's growth (transformers does the same).
                   "factor": scaling.get("factor") or hf["max_position_embeddings"] / orig,
                   "attention_factor": scaling.get("attention_factor")}
    if kind == "proportional":  # Gemma 4's global layers: the whole head turns, some of its pairs at speed 0
        scaling = {"rope_type": "proportional", "partial_rotary_factor": params_partial or 1.0,
                   **({"factor": scaling["factor"]} if scaling.get("factor", 1.0) != 1.0 else {})}
        partial = 1.0
    if kind == "yarn":  # transformers' defaults written out, so config.json says what runs
        orig = (scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                or hf["max_position_embeddings"])
        scaling = {"rope_type": "yarn", "factor": scaling.get("factor") or hf["max_position_embeddings"] / orig,
                   "original_max_position_embeddings": orig,
                   **{k: scaling[k] for k in YARN_KEYS if scaling.get(k) is not None}}
    rope_local_base = None
    if local is not None and rope_type(local) != "default":  # Gemma 3, OLMo 3: the local layers are unscaled
        raise ValueError(f"unsupported rope_parameters.sliding_attention rope_type {rope_type(local)!r}; "
                         "supported: default")
    if model_type == "gemma3_text":
        rope_local_base = float((local or {}).get("rope_theta", hf["rope_local_base_freq"]))
    if model_type in ("gemma4_text", "lfm3"):
        rope_local_base = float((local or {}).get("rope_theta", 10_000.0))
    if model_type == "olmo3":  # a hub config's rope_scaling applies to the full-attention layers only
        local_base = float((local or {}).get("rope_theta", rope_base))
        rope_local_base = local_base if kind != "default" or local_base != rope_base else None
    return rope_base, scaling if kind != "default" else None, rope_local_base, partial


def query_scale_from_hf(hf: dict) -> tuple:
    """(beta, length) of Llama 4's / Ministral 3's query scaling, which Ministral 3 keeps among its rope
    parameters as llama_4_scaling_beta over original_max_position_embeddings; (None, None) without."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    beta = params.get("llama_4_scaling_beta") if isinstance(params, dict) else None
    return (float(beta), int(params["original_max_position_embeddings"])) if beta else (None, None)


def sliding_window_from_hf(hf: dict, model_type: str) -> tuple:
    """(sliding_window, sliding_window_layers): the window and the layers it applies to (None: all).

    transformers lists the layer types in config.json; where a hub config predates that, the
    family's rule as transformers applies it."""
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    qwen = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
    if model_type in qwen and not hf.get("use_sliding_window", False):
        window = None
    if window is None or model_type in ("mistral", "mixtral", "phi3", "ministral3"):
        return window, None
    types = hf.get("layer_types")
    if types is None:
        if model_type in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        elif model_type == "gemma3_text":
            types = ["sliding_attention" if (i + 1) % hf["sliding_window_pattern"] else "full_attention"
                     for i in range(n)]
        elif model_type in ("olmo3", "exaone4", "cohere2"):  # n - 1 local layers, then a global one
            types = ["sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 4) else "full_attention"
                     for i in range(n)]
        elif model_type == "gemma4_text":  # 5 local layers, then a global one
            types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        elif model_type == "lfm3":
            types = lfm_layer_types(hf, model_type)
        elif model_type == "smollm3":
            raise ValueError("smollm3 with use_sliding_window=true needs layer_types in config.json")
        else:  # Qwen2 / Qwen3: the layers from max_window_layers on
            types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention" for i in range(n)]
    if model_type == "gemma4_text":  # its last layer is global whatever the list says (as transformers makes it)
        types = [*types[:-1], "full_attention"]
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not layers:
        return None, None
    return window, None if len(layers) == n else layers


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object; download it again")
    return data


def weight_files(source: Path) -> list:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (source / index).is_file():
            weight_map = read_json(source / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{source / index} has no weight_map; download it again")
            shards = [source / s for s in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise FileNotFoundError(f"{source / index} lists shards that are missing: {missing[:3]}; "
                                        "the download is incomplete: run scripts/download.py again")
            return shards
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (source / single).is_file():
            return [source / single]
    raise FileNotFoundError(f"no weights in {source}: expected model.safetensors, a sharded "
                            "model.safetensors.index.json, or pytorch_model*.bin")


def load_shard(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except SafetensorError as e:  # truncated or not safetensors at all
            raise ValueError(f"{path} is not a readable safetensors file ({e}); the download may be "
                             "incomplete: run scripts/download.py again") from None
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise ValueError(f"{path} is not a readable PyTorch file ({type(e).__name__}: {e}); the download may be "
                         "incomplete: run scripts/download.py again") from None


def rename(hf_name: str, weight_map: dict = WEIGHT_MAP) -> str:
    numbers = re.findall(r"\.(\d+)\.", hf_name)
    pattern = re.sub(r"\.\d+\.", ".{}.", hf_name)
    if pattern not in weight_map:
        raise ValueError(f"unmapped HF tensor {hf_name!r}: this architecture variant is not supported")
    return weight_map[pattern].format(*numbers)


def rope_halves(w: torch.Tensor, heads: int, config: ModelArgs) -> torch.Tensor:
    """q or k rows (weight or bias) of a model that rotates pairs of neighbouring dimensions (GLM),
    reordered per head to the halves brisk rotates (dimension i with i + rope_dim / 2): dimension 2j
    goes to j, 2j + 1 to j + rope_dim / 2. q and k move alike, so their products do not change."""
    rd, hd = config.rope_dim, config.head_dim
    order = torch.cat([torch.arange(0, rd, 2), torch.arange(1, rd, 2), torch.arange(rd, hd)])
    return w.reshape(heads, hd, *w.shape[1:])[:, order].reshape(w.shape)


def convert_state_dict(hf_state: dict, config: ModelArgs, model_type: str = "llama",
                       multimodal: bool = False, hf_rope_interleave: bool = False) -> dict:
    """multimodal: the checkpoint holds more than the language model, whose tensors alone are kept.
    hf_rope_interleave: DeepSeek V3's rope_interleave (RoPE on neighbouring pairs of the rotated dims)."""
    weight_map = {**WEIGHT_MAP, **FAMILY_WEIGHT_MAP.get(model_type, {})}
    state, mtp = {}, set()
    for name, tensor in hf_state.items():
        name = text_tensor_name(name) if multimodal else name
        layer = re.match(r"model\.layers\.(\d+)\.", name or "")
        if model_type in MTP_LAYERS and layer and int(layer[1]) >= config.n_layer:
            mtp.add(int(layer[1]))
        elif model_type in LINEAR_ATTENTION and (name or "").startswith("mtp."):  # (Qwen3-Next's, Qwen3.5's)
            mtp.add(0)
        elif name is not None and not IGNORED.fullmatch(name):
            state[rename(name, weight_map)] = tensor
    if mtp:
        print(f"left out the multi-token-prediction layer{'s' * (len(mtp) > 1)} {sorted(mtp)}: brisk runs the "
              f"model's {config.n_layer} layers", file=sys.stderr)
    if config.tie_embeddings:
        state.pop("output.weight", None)  # the loader ties it to tok_embeddings
    for i in range(config.n_layer):
        p = f"layers.{i}.attention."
        linear = config.is_linear(i)
        if linear and config.linear_attention == "short_conv":  # (LFM2) the convolution's [channels, 1, kernel]
            state[p + "conv"] = state[p + "conv"].squeeze(1)
        elif linear:
            gated_delta_net(state, p, config)
        elif config.attention_output_gate:  # (the gates go last in wqkv)
            state[p + "wq.weight"], state[p + "wgate.weight"] = queries_and_gates(state.pop(p + "wq.weight"), config)
        if config.kv_lora_rank:
            latent_attention(state, p, config, interleaved=hf_rope_interleave)
        for kind in ("weight", "bias") if not (config.kv_lora_rank or linear) else ():
            names = "q" if config.kv_source(i) is not None else "qk" if config.attention_shape(i)[2] else "qkv"
            parts = [state.pop(p + f"w{x}.{kind}", None) for x in names]
            if (config.attention_output_gate or config.attention_head_gate) and kind == "weight":
                parts.append(state.pop(p + "wgate.weight", None))
            if all(t is not None for t in parts):
                state[p + f"wqkv.{kind}"] = torch.cat(parts)
            elif any(t is not None for t in parts):
                raise ValueError(f"layer {i}: q/k/v {kind}s are incomplete in the HF checkpoint")
            if model_type in INTERLEAVED_ROPE and p + f"wqkv.{kind}" in state:  # fused here or in the checkpoint
                q_dim, kv_dim = config.n_head * config.head_dim, config.n_local_heads * config.head_dim
                q, k, v = state[p + f"wqkv.{kind}"].split([q_dim, kv_dim, kv_dim])
                state[p + f"wqkv.{kind}"] = torch.cat([rope_halves(q, config.n_head, config),
                                                       rope_halves(k, config.n_local_heads, config), v])
        f = f"layers.{i}.feed_forward."
        if f + "w13.weight" in state:  # Phi-3's gate_up_proj
            state[f + "w1.weight"], state[f + "w3.weight"] = split_gate_up(state.pop(f + "w13.weight"))
        moe = config.num_experts and i not in (config.dense_layers or ())
        if config.experts_beside_mlp:  # Gemma 4's 26B: the experts apart from the dense feed-forward
            f, moe = f"layers.{i}.experts.", moe and f"layers.{i}.experts.w13" in state
            if moe:  # its router's input scale times 1 / sqrt(dim), as transformers applies it
                state[f + "router_norm.weight"] = state[f + "router_norm.weight"] * config.dim ** -0.5
        if model_type == "gpt_oss":
            gpt_oss_experts(state, f)
        elif moe and f + "w13" in state:
            w1, w3 = state.pop(f + "w13").chunk(2, dim=1)
            state[f + "w1"], state[f + "w3"] = w1.contiguous(), w3.contiguous()
        elif moe:
            for w in ("w1", "w2", "w3"):
                experts = [state.pop(f + f"{w}.{e}", None) for e in range(config.num_experts)]
                if any(t is None for t in experts):
                    raise ValueError(f"layer {i}: {w} is missing experts in the HF checkpoint")
                state[f + w] = torch.stack(experts)
    return state


def queries_and_gates(w: torch.Tensor, config: ModelArgs) -> tuple:
    """A gated attention's q_proj rows (Qwen3.5, Qwen3-Next: each head's query, then its output gate) ->
    (the queries' rows, the gates' rows)."""
    heads = w.view(config.n_head, 2, config.head_dim, -1).unbind(1)
    return tuple(t.reshape(config.n_head * config.head_dim, -1) for t in heads)


def gated_delta_net(state: dict, p: str, config: ModelArgs):
    """Gated DeltaNet's weights (names under prefix p): its input projections fused into w_in as
    [q, k, v, z, b, a] (Qwen3.5 keeps four of them; Qwen3-Next two, [q, k, v, z] and [b, a] per key head,
    whose rows are regrouped by kind), the depthwise convolution's [channels, 1, kernel] as [channels, kernel]."""
    kh, vh, dk, dv = config.linear_key_heads, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    r = vh // kh  # value heads per key head
    if p + "w_qkvz" in state:
        qkvz = state.pop(p + "w_qkvz").view(kh, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], 1)
    else:
        qkvz = [state.pop(p + "w_qkv"), state.pop(p + "w_z")]
    # (llama.cpp's Qwen3-Next files keep [b, a] per key head as Qwen3-Next does)
    ba = state.pop(p + "w_ba").view(kh, 2 * r, -1).split([r, r], 1) if p + "w_ba" in state else [
        state.pop(p + "w_b"), state.pop(p + "w_a")]
    state[p + "w_in.weight"] = torch.cat([t.reshape(-1, t.shape[-1]) for t in [*qkvz, *ba]])
    conv = state[p + "conv"]
    state[p + "conv"] = conv.squeeze(1) if conv.dim() == 3 else conv


def latent_attention(state: dict, p: str, config: ModelArgs, interleaved: bool):
    """DeepSeek's attention weights (names under prefix p): kv_b [heads * (nope + v), latent] split into
    wk_b [heads, nope, latent] and wv_b [heads, v, latent]; where RoPE rotates neighbouring pairs, the
    rotated rows of the queries (each head's last rope_dim) and of the shared key (wkv_a's last) are
    reordered to the halves model.py rotates (q and k move alike: the scores do not change)."""
    H, hd, rd = config.n_head, config.head_dim, config.rope_dim
    if p + "wkv_b.weight" in state:  # (llama.cpp's newer GGUF files keep the two apart)
        kv_b = state.pop(p + "wkv_b.weight").view(H, hd - rd + config.v_head_dim, config.kv_lora_rank)
        state[p + "wk_b"], state[p + "wv_b"] = kv_b[:, :hd - rd].contiguous(), kv_b[:, hd - rd:].contiguous()
    if interleaved:
        pairs = torch.cat([torch.arange(0, rd, 2), torch.arange(1, rd, 2)])
        q = p + ("wq_b.weight" if config.q_lora_rank else "wq.weight")
        order = torch.cat([torch.arange(hd - rd), hd - rd + pairs])
        state[q] = state[q].view(H, hd, -1)[:, order].reshape(H * hd, -1)
        kv_a = state[p + "wkv_a.weight"]
        state[p + "wkv_a.weight"] = kv_a[torch.cat([torch.arange(config.kv_lora_rank), config.kv_lora_rank + pairs])]


def gpt_oss_experts(state: dict, f: str):
    """gpt-oss's experts (names under prefix f) -> w1, w3 [E, I, D], w2 [E, D, I] and their biases.
    transformers keeps gate_up [E, D, 2I] and down [E, I, D] (x @ w), the hub MXFP4 blocks of the
    transposes; gate and up alternate along 2I."""
    if f + "w13_blocks" in state:
        w13 = mxfp4_dequantize(state.pop(f + "w13_blocks"), state.pop(f + "w13_scales"))  # [E, 2I, D]
        w2 = mxfp4_dequantize(state.pop(f + "w2_blocks"), state.pop(f + "w2_scales"))  # [E, D, I]
    else:
        w13, w2 = state.pop(f + "w13").transpose(1, 2), state.pop(f + "w2").transpose(1, 2)
    b13 = state.pop(f + "w13_bias")
    state[f + "w1"], state[f + "w3"] = w13[:, 0::2].contiguous(), w13[:, 1::2].contiguous()
    state[f + "w1_bias"], state[f + "w3_bias"] = b13[:, 0::2].contiguous(), b13[:, 1::2].contiguous()
    state[f + "w2"], state[f + "w2_bias"] = w2.contiguous(), state.pop(f + "w2_bias")


# The 16 values of a 4-bit E2M1 float (OCP microscaling), by code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """MXFP4 weights [..., rows, G, 16] uint8 (two 4-bit codes a byte, the low nibble first) with one
    power-of-two scale per 32 values [..., rows, G] (biased exponent, 127 = 1) -> [..., rows, G * 32]."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    for i in range(blocks.shape[0]):  # an expert at a time: the codes as int32 are 8 bytes a weight
        codes = torch.stack([blocks[i] & 0x0F, blocks[i] >> 4], dim=-1).flatten(-2).int()  # [rows, G, 32]
        out[i] = torch.ldexp(lut[codes], scales[i].to(torch.int32)[..., None] - 127).flatten(-2).to(dtype)
    return out


def fp8_block(hf: dict) -> Optional[tuple]:
    """The (rows, cols) block of a block-wise FP8 checkpoint (DeepSeek V3's format: Qwen3-FP8, MiniMax M2,
    GLM-4.5-FP8), transformers' default where its config names none; None for any other checkpoint."""
    quantized = hf.get("quantization_config") or {}
    if quantized.get("quant_method") != "fp8" or quantized.get("activation_scheme", "dynamic") != "dynamic":
        return None
    return tuple(quantized.get("weight_block_size") or (128, 128))


def fp8_dequantized(hf_state: dict, block: tuple) -> dict:
    """hf_state with each FP8 weight times its scale per block (`NAME_scale_inv`: [ceil(rows / block[0]),
    ceil(cols / block[1])]), in the dtype of the checkpoint's other weights (bf16 in the hub's)."""
    dtype = next((t.dtype for t in hf_state.values() if t.is_floating_point() and t.element_size() > 1),
                 torch.bfloat16)
    out = {}
    for name, t in hf_state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = hf_state.get(name + "_scale_inv")
        if scale is not None:
            rows, cols = t.shape[-2:]
            scale = scale.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
            t = (t.float() * scale[..., :cols]).to(dtype)
        elif t.element_size() == 1 and t.is_floating_point():
            raise ValueError(f"FP8 tensor {name!r} has no {name}_scale_inv beside it; download the checkpoint again")
        out[name] = t
    return out


def split_gate_up(w13: torch.Tensor) -> tuple:
    """Phi-3's fused [gate; up] rows as w1, w3, each in its own storage: torch.save would keep two
    views of one, and inductor's frozen CPU GEMM template then reads the second at the wrong offset."""
    return tuple(w.clone() for w in w13.chunk(2))


def check_against_model(state: dict, config: ModelArgs):
    """Every tensor must have the exact name and shape the model expects."""
    from model import Transformer
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    if config.tie_embeddings:
        expected.pop("output.weight")
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"converted weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(state[name].shape)}, "
                             f"config expects {tuple(t.shape)}")


def find_source(checkpoint_dir: Path) -> Path:
    for source in (checkpoint_dir / "hf", checkpoint_dir):
        if (source / "config.json").is_file() and "model_type" in read_json(source / "config.json"):
            return source
    raise FileNotFoundError(f"no Hugging Face config.json in {checkpoint_dir}/hf or {checkpoint_dir}; "
                            f"download one with: python scripts/download.py --repo_id ORG/NAME")


def convert_hf_checkpoint(checkpoint_dir: Path, output_dir: Path = None) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    source = find_source(checkpoint_dir)
    output_dir = Path(output_dir or checkpoint_dir)
    if source.resolve() == output_dir.resolve():
        raise ValueError(f"{source} holds the HF files, whose config.json would be overwritten by brisk's; "
                         f"move them into {source / 'hf'} or pass --output_dir")
    check_output_dir(output_dir, "--output_dir")
    outer = read_json(source / "config.json")
    hf_config = text_model(outer)
    if hf_config is not outer:
        print(f"converting the language model ({hf_config['model_type']}) of this {outer.get('model_type')} "
              "checkpoint; the vision tower is left out", file=sys.stderr)
    try:
        config = config_from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"{source / 'config.json'} lacks {e}, which {hf_config.get('model_type')} models "
                         "need; download the model's config.json again") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source / 'config.json'}: {e}; download the model's config.json again") from None
    files = weight_files(source)
    hf_state = {}
    for k, path in enumerate(files, 1):
        print(f"[{k}/{len(files)}] reading {path.name}", file=sys.stderr, flush=True)
        hf_state.update(load_shard(path))
    if (block := fp8_block(hf_config)) is not None:
        print(f"dequantizing the FP8 weights ({block[0]}x{block[1]} blocks)", file=sys.stderr, flush=True)
        hf_state = fp8_dequantized(hf_state, block)
    state = convert_state_dict(hf_state, config, hf_config["model_type"], multimodal=hf_config is not outer,
                               hf_rope_interleave=bool(with_defaults(hf_config).get("rope_interleave")))
    check_against_model(state, config)

    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / "model.pth"
    print(f"writing {out}", file=sys.stderr, flush=True)
    atomic_save(state, out)
    atomic_write(output_dir / "config.json", config.to_json)
    copy_tokenizer(source, output_dir)
    print(f"done: {out} ({sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters)", file=sys.stderr)
    return out


def copy_tokenizer(source: Path, output_dir: Path):
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in found:
        atomic_write(output_dir / name, lambda tmp: shutil.copyfile(source / name, tmp))
    # Meta's LLaMA 3 repos keep the tiktoken file under original/.
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        meta = source / "original" / "tokenizer.model"
        if meta.is_file():
            atomic_write(output_dir / "tokenizer.model", lambda tmp: shutil.copyfile(meta, tmp))
        else:
            print(f"warning: no tokenizer.json or tokenizer.model in {source}; generate.py will need one",
                  file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True,
                   help="folder holding the HF files (or their hf/ subfolder)")
    p.add_argument("--output_dir", type=Path, default=None, help="where to write (default: --checkpoint_dir)")
    args = p.parse_args(argv)
    with error_boundary():
        convert_hf_checkpoint(args.checkpoint_dir, args.output_dir)


if __name__ == "__main__":
    main()
