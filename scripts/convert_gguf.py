# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Convert a GGUF file (llama.cpp's format) of a supported architecture into brisk's checkpoint dir.

Writes model.pth, config.json and the tokenizer (tokenizer.json, tokenizer_config.json,
generation_config.json) rebuilt from the GGUF metadata. Quantized tensors are dequantized to
float32; F32/F16/BF16 tensors keep their dtype (--dtype overrides both). llama.cpp stores the q/k
rows of architecture `llama` interleaved for its RoPE kernel; they are put back in the Hugging
Face half-split layout (the other architectures keep HF's). Gemma's norms are stored as 1 + weight.
"""
import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_output_dir, error_boundary  # noqa: E402
from load import atomic_save, atomic_write, atomic_write_text  # noqa: E402
from model import ModelArgs  # noqa: E402
from rope import rope_frequencies  # noqa: E402
from scripts.convert_hf_checkpoint import (check_against_model, gated_delta_net, latent_attention,  # noqa: E402
                                           mla_attention_scale, queries_and_gates, rope_halves, split_gate_up)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "olmo2", "exaone4",
                           "seed_oss", "glm4", "ernie4_5", "granite", "gpt-oss", "command-r", "cohere2", "glm4moe",
                           "dots1", "minimax-m2", "deepseek2", "qwen2moe", "olmoe", "granitemoe", "mistral3",
                           "qwen3next", "qwen35", "qwen35moe", "gemma4", "lfm2", "lfm2moe")
# DeepSeek V3's routing (sigmoid, a selection bias): llama.cpp's default for these where the file names none
SIGMOID_ROUTER = ("glm4moe", "dots1", "minimax-m2")
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
# HF's layout kept: RoPE on neighbouring pairs (llama.cpp's "norm" rope type)
INTERLEAVED_ROPE = ("glm4", "ernie4_5", "command-r", "cohere2")
COHERE = ("command-r", "cohere2")  # LayerNorm without a bias, attention and feed-forward side by side
POST_NORMS = ("olmo2", "exaone4")  # x + norm(f(x)); OLMo 3 is architecture olmo2 with a window
# llama.cpp's converter interleaves these architectures' q/k rows
PERMUTED = ("llama", "granite", "granitemoe", "mistral3")
# Top-k router weights used as the softmax gives them unless the file says otherwise (llama.cpp's rule)
UNNORMALISED_TOP_K = ("qwen2moe", "olmoe", "deepseek2")
GEMMA = ("gemma2", "gemma3")
# Gated DeltaNet beside gated attention (Qwen3-Next, Qwen3.5); llama.cpp orders Qwen3.5's value heads
# tiled ([K0's 1st, K1's 1st, ..., K0's 2nd, ...]) where HF groups them by key head
LINEAR_ATTENTION = ("qwen3next", "qwen35", "qwen35moe")
TILED_VALUE_HEADS = ("qwen35", "qwen35moe")
SHORT_CONV = ("lfm2", "lfm2moe")  # LFM2's convolution layers (those with no key/value heads) beside attention
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# GGUF name (layer index as {}) -> brisk name. q/k/v are fused into wqkv afterwards.
WEIGHT_MAP = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{}.attn_q.weight": "layers.{}.attention.wq.weight",
    "blk.{}.attn_k.weight": "layers.{}.attention.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attention.wv.weight",
    "blk.{}.attn_output.weight": "layers.{}.attention.wo.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attention_norm.weight",
    "blk.{}.ffn_norm.weight": "layers.{}.ffn_norm.weight",
    "blk.{}.ffn_gate.weight": "layers.{}.feed_forward.w1.weight",
    "blk.{}.ffn_up.weight": "layers.{}.feed_forward.w3.weight",
    "blk.{}.ffn_down.weight": "layers.{}.feed_forward.w2.weight",
    # Mixtral (architecture "llama" with llama.expert_count): experts stacked as [E, ...] like ours.
    "blk.{}.ffn_gate_inp.weight": "layers.{}.feed_forward.gate.weight",
    "blk.{}.ffn_gate_exps.weight": "layers.{}.feed_forward.w1",
    "blk.{}.ffn_up_exps.weight": "layers.{}.feed_forward.w3",
    "blk.{}.ffn_down_exps.weight": "layers.{}.feed_forward.w2",
    "blk.{}.attn_q.bias": "layers.{}.attention.wq.bias",  # Qwen2
    "blk.{}.attn_k.bias": "layers.{}.attention.wk.bias",
    "blk.{}.attn_v.bias": "layers.{}.attention.wv.bias",
    "blk.{}.attn_q_norm.weight": "layers.{}.attention.q_norm.weight",  # Qwen3, Gemma 3, OLMo 2
    "blk.{}.attn_k_norm.weight": "layers.{}.attention.k_norm.weight",
    "blk.{}.post_attention_norm.weight": "layers.{}.post_attention_norm.weight",  # Gemma 2/3, OLMo 2
    "blk.{}.post_ffw_norm.weight": "layers.{}.post_ffn_norm.weight",
    "blk.{}.attn_qkv.weight": "layers.{}.attention.wqkv.weight",  # Phi-3: q, k, v fused in our order
    "blk.{}.attn_output.bias": "layers.{}.attention.wo.bias",  # gpt-oss
    "blk.{}.attn_sinks.weight": "layers.{}.attention.sinks",
    "blk.{}.ffn_gate_inp.bias": "layers.{}.feed_forward.gate.bias",
    "blk.{}.ffn_gate_exps.bias": "layers.{}.feed_forward.w1_bias",
    "blk.{}.ffn_up_exps.bias": "layers.{}.feed_forward.w3_bias",
    "blk.{}.ffn_down_exps.bias": "layers.{}.feed_forward.w2_bias",
    "blk.{}.exp_probs_b.bias": "layers.{}.feed_forward.selection_bias",  # DeepSeek V3's router
    "blk.{}.ffn_gate_shexp.weight": "layers.{}.feed_forward.shared_expert.w1.weight",
    "blk.{}.ffn_up_shexp.weight": "layers.{}.feed_forward.shared_expert.w3.weight",
    "blk.{}.ffn_down_shexp.weight": "layers.{}.feed_forward.shared_expert.w2.weight",
    "blk.{}.ffn_gate_inp_shexp.weight": "layers.{}.feed_forward.shared_gate.weight",  # Qwen2-MoE: [dim] there
    # DeepSeek's latent attention (deepseek2: DeepSeek V2 / V3, GLM-4.7-Flash)
    "blk.{}.attn_q_a.weight": "layers.{}.attention.wq_a.weight",
    "blk.{}.attn_q_a_norm.weight": "layers.{}.attention.q_norm.weight",
    "blk.{}.attn_q_b.weight": "layers.{}.attention.wq_b.weight",
    "blk.{}.attn_kv_a_mqa.weight": "layers.{}.attention.wkv_a.weight",
    "blk.{}.attn_kv_a_norm.weight": "layers.{}.attention.kv_norm.weight",
    "blk.{}.attn_kv_b.weight": "layers.{}.attention.wkv_b.weight",
    "blk.{}.attn_k_b.weight": "layers.{}.attention.wk_b",  # [heads, latent, nope]: transposed on reading
    "blk.{}.attn_v_b.weight": "layers.{}.attention.wv_b",
}
# Phi-3 and GLM-4 keep gate and up fused in ffn_up as [2I, D]; llama.cpp names Seed-OSS's and gpt-oss's
# pre-feed-forward norm after its HF name (post_attention_layernorm).
ARCH_WEIGHT_MAP = {"phi3": {"blk.{}.ffn_up.weight": "layers.{}.feed_forward.w13.weight"},
                   "glm4": {"blk.{}.ffn_up.weight": "layers.{}.feed_forward.w13.weight"},
                   "seed_oss": {"blk.{}.post_attention_norm.weight": "layers.{}.ffn_norm.weight"},
                   "gpt-oss": {"blk.{}.post_attention_norm.weight": "layers.{}.ffn_norm.weight"},
                   "glm4moe": {"blk.{}.post_attention_norm.weight": "layers.{}.ffn_norm.weight"},
                   **{arch: {"blk.{}.post_attention_norm.weight": "layers.{}.ffn_norm.weight",
                             **{f"blk.{{}}.{ours}": f"layers.{{}}.attention.{theirs}" for ours, theirs in (
                                 ("attn_qkv.weight", "w_qkv"), ("attn_gate.weight", "w_z"), ("ssm_beta.weight", "w_b"),
                                 ("ssm_alpha.weight", "w_a"), ("ssm_ba.weight", "w_ba"), ("ssm_a", "A_log"),
                                 ("ssm_dt.bias", "dt_bias"), ("ssm_conv1d.weight", "conv"),
                                 ("ssm_norm.weight", "norm_weight"), ("ssm_out.weight", "wo.weight"))}}
                      for arch in LINEAR_ATTENTION}}
# Gemma 4: a scalar per layer; E2B / E4B's per-layer inputs; the 26B's experts beside the dense feed-forward
# (gate and up fused as HF's), their router (its input norm's scale) and norms.
ARCH_WEIGHT_MAP["gemma4"] = {
    "blk.{}.layer_output_scale.weight": "layers.{}.layer_scale",
    "per_layer_token_embd.weight": "per_layer_embeddings.weight",
    "per_layer_model_proj.weight": "per_layer_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_norm.weight",
    "blk.{}.inp_gate.weight": "layers.{}.per_layer_gate.weight",
    "blk.{}.proj.weight": "layers.{}.per_layer_out.weight",
    "blk.{}.post_norm.weight": "layers.{}.per_layer_out_norm.weight",
    "blk.{}.ffn_gate_up_exps.weight": "layers.{}.experts.w13",
    "blk.{}.ffn_down_exps.weight": "layers.{}.experts.w2",
    "blk.{}.ffn_gate_inp.weight": "layers.{}.experts.gate.weight",
    "blk.{}.ffn_gate_inp.scale": "layers.{}.experts.router_norm.weight",
    "blk.{}.ffn_down_exps.scale": "layers.{}.experts.expert_scales",
    "blk.{}.post_ffw_norm_1.weight": "layers.{}.post_mlp_norm.weight",
    "blk.{}.pre_ffw_norm_2.weight": "layers.{}.experts_norm.weight",
    "blk.{}.post_ffw_norm_2.weight": "layers.{}.post_experts_norm.weight",
}
# LFM2: its final norm (token_embd_norm, as llama.cpp names it) and its convolutions' projections
for _arch in SHORT_CONV:
    ARCH_WEIGHT_MAP[_arch] = {"token_embd_norm.weight": "norm.weight",
                              "blk.{}.shortconv.in_proj.weight": "layers.{}.attention.w_in.weight",
                              "blk.{}.shortconv.conv.weight": "layers.{}.attention.conv",
                              "blk.{}.shortconv.out_proj.weight": "layers.{}.attention.wo.weight"}
ROPE_FREQS = "rope_freqs.weight"  # LLaMA 3.1+ stores its rope scaling as per-frequency divisors
YARN_FIELDS = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "attention_factor": "yarn_attn_factor"}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope
NOT_WEIGHTS = (ROPE_FREQS, *ROPE_FACTORS)

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Byte-level BPE pre-tokenizers by the name llama.cpp gives them (tokenizer.ggml.pre), with the
# split regexes of llama.cpp's llama-vocab.cpp, which are those of each model's own tokenizer.json.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (split regex, digits one by one first, whole words in the vocab skip the merges)
PRE_TOKENIZERS = {
    "gpt2": (_GPT2, False, False),
    "default": (_GPT2, False, False),  # files that name none: GPT-2's, as transformers assumes
    "smollm": (_GPT2, True, False),
    "starcoder": (_GPT2, True, False),
    "refact": (_GPT2, True, False),
    "codeshell": (_GPT2, True, False),
    "llama-bpe": (_LLAMA3, False, True),
    "llama3": (_LLAMA3, False, True),
    "smaug-bpe": (_LLAMA3, False, False),
    "dbrx": (_LLAMA3, False, False),
    "qwen2": (_QWEN2, False, False),
    "qwen35": (_QWEN35, False, False),
    "lfm2": (_LLAMA3, False, True),
    "deepseek-r1-qwen": (_QWEN2, False, False),
    "tekken": (_TEKKEN, False, False),
    "gpt-4o": (_GPT4O, False, False),  # Phi-4-mini (o200k)
}


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if isinstance(value, float):  # stored as float32: take the shortest decimal for it (1e-05, not 9.99e-06)
        value = float(str(np.float32(value)))
    return value


def open_gguf(path: Path):
    import gguf
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # the reader fails with whatever numpy raises on a corrupt header
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); download it again") from None


def config_from_gguf(reader) -> ModelArgs:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    tensors = {t.name: t for t in reader.tensors}
    dim, n_head = get("embedding_length"), get("attention.head_count")
    n_local_heads = get("attention.head_count_kv", n_head)
    gemma4 = arch == "gemma4"  # (its shapes per kind of layer: gemma4_fields)
    short_conv = arch in SHORT_CONV  # (no key/value heads on its convolution layers)
    conv_layers = [i for i, h in enumerate(n_local_heads) if h == 0] if short_conv else []
    if short_conv:
        n_local_heads = max(n_local_heads) if isinstance(n_local_heads, list) else n_local_heads
    if not isinstance(n_local_heads, int) and not gemma4:
        raise ValueError(f"per-layer {arch}.attention.head_count_kv is not supported (one value for all layers)")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    # GLM-4.5's multi-token-prediction layers follow the model's own (convert_tensors leaves them out)
    n_layer = get("block_count") - field(reader, f"{arch}.nextn_predict_layers", 0)
    rope_dim = field(reader, f"{arch}.rope.dimension_count")
    mla = arch == "deepseek2"  # the key length is the latent's there (kv_lora_rank + rope_dim), the heads' is _mla's
    head_dim = get("attention.key_length_mla" if mla else "attention.key_length",
                   rope_dim if arch in PERMUTED and rope_dim else dim // n_head)
    rope_base = float(get("rope.freq_base", 10000.0))
    experts = get("expert_count", 0)
    # A MoE file whose layer has no router keeps the dense feed-forward there.
    dense = [i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" not in tensors] if experts else []
    window = field(reader, f"{arch}.attention.sliding_window")
    local_layers = sliding_layers(reader, arch, n_layer) if window else None
    rope_scaling = None if gemma4 else rope_scaling_from_gguf(reader, arch, tensors, rope_dim or head_dim, rope_base)
    rope_local_base = None
    if arch == "gemma3":
        rope_local_base = float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    elif arch == "olmo2" and window and (rope_scaling or field(reader, f"{arch}.rope.freq_base_swa")):
        # OLMo 3: the windowed layers keep plain RoPE where the global ones are scaled (llama.cpp does the same)
        rope_local_base = float(field(reader, f"{arch}.rope.freq_base_swa", rope_base))
    gemma, gpt_oss, cohere = arch in GEMMA, arch == "gpt-oss", arch in COHERE
    gating = field(reader, f"{arch}.expert_gating_func")
    if gating is not None and gating not in GATING:
        raise ValueError(f"unsupported {arch}.expert_gating_func {gating}; supported: 1 (softmax), 2 (sigmoid)")
    # Llama 4's query scaling (Ministral 3): past the YaRN original context unless the file names a length
    beta = field(reader, f"{arch}.attention.temperature_scale") or None
    length = field(reader, f"{arch}.attention.temperature_length") or field(
        reader, f"{arch}.rope.scaling.original_context_length") if beta else None
    sparse = next((i for i in range(n_layer) if i not in dense), 0)  # a layer with experts
    shared = tensors.get(f"blk.{sparse}.ffn_up_shexp.weight")
    selection_bias = f"blk.{sparse}.exp_probs_b.bias" in tensors
    # Without the key: sigmoid for the families that route so, and for a deepseek2 file with the selection
    # bias, which came with it (DeepSeek V3, GLM-4.7-Flash: llama.cpp's early files of it lack the key)
    router = GATING.get(gating, "sigmoid" if arch in SIGMOID_ROUTER or mla and selection_bias else "softmax")
    # DeepSeek V2 (softmax) ranks a group by its best expert, V3 (sigmoid) by its two best
    group_top = 1 if mla and router == "softmax" else 2
    routed_scale = field(reader, f"{arch}.expert_weights_scale")
    linear = arch in LINEAR_ATTENTION
    linear_layers = [i for i in range(n_layer) if f"blk.{i}.ssm_a" in tensors] if linear else conv_layers
    a = next(f"blk.{i}." for i in range(n_layer) if i not in linear_layers)  # an attention layer's tensors
    if gpt_oss and rope_scaling:  # its YaRN ramp is not rounded to whole dimensions (its HF config's truncate: false)
        rope_scaling["truncate"] = False
    args = dict(
        block_size=get("context_length"),
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml shapes are [cols, rows]
        n_layer=n_layer,
        n_head=n_head,
        dim=dim,
        # (Qwen3.5's MoE models: experts in every layer, no dense size)
        intermediate_size=get("feed_forward_length", field(reader, f"{arch}.expert_feed_forward_length")),
        n_local_heads=n_local_heads,
        head_dim=head_dim,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        norm_eps=float(get("attention.layer_norm_epsilon" if cohere else "attention.layer_norm_rms_epsilon", 1e-5)),
        attention_bias=a + "attn_q.bias" in tensors,
        attention_out_bias=a + "attn_output.bias" in tensors,
        attention_sinks=a + "attn_sinks.weight" in tensors,
        query_scale_beta=beta,
        query_scale_length=length,
        moe_bias="blk.0.ffn_gate_inp.bias" in tensors,
        # gpt-oss's clamped SwiGLU: llama.cpp's constants, which the file does not store
        swiglu_limit=7.0 if gpt_oss else None,
        swiglu_alpha=1.702 if gpt_oss else None,
        tie_embeddings="output.weight" not in tensors,
        sliding_window=window or None,
        num_experts=experts,
        num_activated_experts=get("expert_used_count", 2),
        moe_intermediate_size=field(reader, f"{arch}.expert_feed_forward_length"),
        shared_expert_size=int(shared.shape[1]) if shared is not None else None,
        shared_expert_gate=f"blk.{sparse}.ffn_gate_inp_shexp.weight" in tensors,
        router=router,
        expert_selection_bias=selection_bias,
        expert_groups=field(reader, f"{arch}.expert_group_count") or 1,
        expert_groups_used=field(reader, f"{arch}.expert_group_used_count") or 1,
        expert_group_top=group_top,
        routed_scale=float(routed_scale) if routed_scale not in (None, 0.0, 1.0) else None,
        norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", arch not in UNNORMALISED_TOP_K)),
        dense_layers=dense or None,
        qk_norm=("all" if arch in ("olmo2", "olmoe", "minimax-m2") else "head" if a + "attn_q_norm.weight" in tensors
                 else None),
        norm_offset=1.0 if gemma or linear else 0.0,
        norm_centered=cohere,
        block_norms=("sandwich" if gemma or arch == "glm4" else "post" if arch in POST_NORMS else
                     "parallel" if cohere else "pre"),
        hidden_act="gelu_tanh" if gemma else "silu",
        # Granite's multipliers: llama.cpp's names, absent where the file leaves them out.
        embedding_scale=dim ** 0.5 if gemma else field(reader, f"{arch}.embedding_scale"),
        attention_scale=(gemma_attention_scale(arch, n_layer, dim, n_head, head_dim) if gemma
                         else mla_attention_scale(head_dim, rope_scaling) if mla
                         else field(reader, f"{arch}.attention.scale")),
        residual_scale=field(reader, f"{arch}.residual_scale"),
        # logit_scale divides Granite's logits and multiplies Cohere's (llama.cpp reads it so)
        logit_divisor=1 / field(reader, f"{arch}.logit_scale") if cohere else field(reader, f"{arch}.logit_scale"),
        attn_logit_softcap=field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=field(reader, f"{arch}.final_logit_softcapping"),
        sliding_window_layers=local_layers,
        rope_local_base=rope_local_base,
        rope_dim=rope_dim or head_dim,
        # A windowed EXAONE 4 or Cohere2 rotates its local layers only.
        no_rope_layers=[i for i in range(n_layer) if i not in (local_layers or range(n_layer))] or None
        if arch in ("exaone4", "cohere2") and window else None,
        kv_lora_rank=get("attention.kv_lora_rank") if mla else None,
        q_lora_rank=field(reader, f"{arch}.attention.q_lora_rank") or None if mla else None,
        v_head_dim=get("attention.value_length_mla") if mla else None,
        linear_attention_layers=linear_layers or None,
        # (llama.cpp's Mamba names: groups the key heads, the time-step rank the value heads, the state a key head)
        **(dict(linear_key_heads=get("ssm.group_count"), linear_value_heads=get("ssm.time_step_rank"),
                linear_key_dim=get("ssm.state_size"),
                linear_value_dim=get("ssm.inner_size") // get("ssm.time_step_rank"),
                linear_conv_kernel=get("ssm.conv_kernel"), attention_output_gate=True) if linear else {}),
        **(dict(linear_attention="short_conv", linear_conv_kernel=get("shortconv.l_cache")) if short_conv else {}),
    )
    return ModelArgs(**{**args, **(gemma4_fields(reader, get, tensors, n_layer, local_layers) if gemma4 else {})})


def gemma4_fields(reader, get, tensors: dict, n_layer: int, local_layers: list) -> dict:
    """Gemma 4's fields where they differ from the other architectures': llama.cpp writes the global
    layers' head size and key/value heads (and E2B's doubled feed-forward) per kind of layer, its
    proportional RoPE as rope_freqs (1 where a pair turns, 1e30 where it stands still)."""
    local = local_layers[0] if local_layers else 0
    own = [i for i in range(n_layer - get("attention.shared_kv_layers", 0)) if i not in (local_layers or ())]
    heads, widths = get("attention.head_count_kv"), get("feed_forward_length")
    heads = heads if isinstance(heads, list) else [heads] * n_layer
    widths = widths if isinstance(widths, list) else [widths]
    keys_as_values = bool(own) and f"blk.{own[0]}.attn_v.weight" not in tensors
    scaling = None
    if ROPE_FREQS in tensors:
        factors = dequantize(tensors[ROPE_FREQS])
        turning = factors[factors < 1e10]
        scaling = {"rope_type": "proportional", "partial_rotary_factor": len(turning) / len(factors),
                   **({"factor": float(turning[0])} if len(turning) and turning[0] != 1.0 else {})}
    per_layer = field(reader, "gemma4.embedding_length_per_layer_input") or None
    experts = bool(field(reader, "gemma4.expert_count"))
    return dict(
        n_local_heads=heads[local], head_dim=get("attention.key_length_swa"),
        global_head_dim=get("attention.key_length"), global_kv_heads=heads[own[0]] if keys_as_values else None,
        global_values_are_keys=keys_as_values, intermediate_size=widths[0], double_wide_mlp=widths[-1] > widths[0],
        rope_scaling=scaling, rope_dim=get("rope.dimension_count_swa"),
        rope_local_base=float(get("rope.freq_base_swa", 10000.0)),
        kv_shared_layers=get("attention.shared_kv_layers", 0), per_layer_input_size=per_layer,
        per_layer_vocab_size=int(tensors["per_layer_token_embd.weight"].shape[1]) if per_layer else None,
        experts_beside_mlp=experts, router_input_norm=experts, value_norm=True, layer_scale=True,
        norm_offset=0.0, block_norms="sandwich", hidden_act="gelu_tanh", embedding_scale=get("embedding_length") ** 0.5,
        attention_scale=1.0, qk_norm="head")


def gemma_attention_scale(arch: str, n_layer: int, dim: int, n_head: int, head_dim: int) -> float:
    """llama.cpp's rule (it stores no query_pre_attn_scalar): the 27B Gemma 2 (46 layers) and Gemma 3
    (62 layers) scale by dim / n_head, the others by head_dim, as their HF configs say."""
    big = n_layer == (46 if arch == "gemma2" else 62)
    return (dim // n_head if big else head_dim) ** -0.5


def sliding_layers(reader, arch: str, n_layer: int):
    """Layers with the sliding window: llama.cpp's pattern of n is n - 1 local layers, then a global
    one (Gemma 2 and gpt-oss: 2, Gemma 3: 6, OLMo 3, EXAONE 4 and Cohere2: 4, unless the file lists them); others
    window every layer."""
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern",
                    {"gemma2": 2, "gemma3": 6, "olmo2": 4, "exaone4": 4, "gpt-oss": 2, "cohere2": 4}.get(arch))
    if pattern is None:
        return None
    if isinstance(pattern, list):  # one flag per layer
        return [i for i, local in enumerate(pattern) if local]
    return [i for i in range(n_layer) if (i + 1) % pattern]


def rope_scaling_from_gguf(reader, arch, tensors, head_dim, rope_base):
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":  # llama.cpp's names for the keys of transformers' YaRN
        scaling = {"rope_type": "yarn", "factor": float(field(reader, f"{arch}.rope.scaling.factor")),
                   "original_max_position_embeddings": field(reader, f"{arch}.rope.scaling.original_context_length")}
        for key, name in YARN_FIELDS.items():
            if (value := field(reader, f"{arch}.rope.scaling.{name}")) is not None:
                scaling[key] = value
        if log_mul := field(reader, f"{arch}.rope.scaling.yarn_log_multiplier"):  # DeepSeek's mscale_all_dim (mscale 1)
            if arch == "deepseek2":  # a tenth of it there, and DeepSeek's mscale equal to it (llama.cpp reads it so)
                scaling.update(mscale=round(10 * log_mul, 6), mscale_all_dim=round(10 * log_mul, 6))
            else:
                scaling.update(mscale=1.0, mscale_all_dim=log_mul)
        return scaling
    if kind != "none":
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}; supported: linear, yarn, LLaMA 3 rope_freqs")
    if ROPE_FACTORS[0] in tensors:
        # Phi-3 128k: llama.cpp stores longrope's two factor sets as tensors.
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "longrope", "long_factor": dequantize(tensors[ROPE_FACTORS[0]]).tolist(),
                "short_factor": dequantize(tensors[ROPE_FACTORS[1]]).tolist(),
                "original_max_position_embeddings": original,
                "factor": field(reader, f"{arch}.context_length") / original,
                "attention_factor": field(reader, f"{arch}.rope.scaling.attn_factor")}
    if ROPE_FREQS not in tensors:
        return None
    divisors = torch.from_numpy(dequantize(tensors[ROPE_FREQS]).copy()).double()
    return llama3_scaling(divisors, head_dim, rope_base)


def llama3_scaling(divisors: torch.Tensor, head_dim: int, rope_base: float) -> dict:
    """LLaMA 3.1 rope scaling from the per-frequency divisors llama.cpp stores instead of its parameters.

    Between the two cut-offs a frequency is divided by 1 / ((1 - s) / factor + s), where s is linear
    in 1 / wavelength; only that line matters, so low_freq_factor is fixed to 1 (as in every LLaMA 3.x)
    and the line gives the other two; a single frequency between the cut-offs (small heads) fixes
    high_freq_factor to LLaMA's 4 too. The result is checked against the file either way.
    """
    inv_freq = rope_frequencies(head_dim, rope_base, None)
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # LLaMA 3.1's, kept when the line is underdetermined
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor) if factor > 1 else torch.zeros_like(divisors)
    inner = (s > 1e-4) & (s < 1 - 1e-4)
    if inner.sum() >= 2:
        x = inv_freq[inner] / (2 * math.pi)  # 1 / wavelength
        a, b = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], dim=1), s[inner, None]).solution.flatten()
        high = 1 - 1 / float(b)
        scaling.update(high_freq_factor=round(high, 6), original_max_position_embeddings=round(float(a) * (high - 1)))
    elif inner.sum() == 1:  # s = (original * x - 1) / (high - 1) with high = 4
        x = float(inv_freq[inner][0]) / (2 * math.pi)
        scaling.update(original_max_position_embeddings=round((float(s[inner][0]) * 3 + 1) / x))
    expected = inv_freq / rope_frequencies(head_dim, rope_base, scaling)
    if expected.shape != divisors.shape or not torch.allclose(expected, divisors, rtol=1e-4):
        raise ValueError(f"unsupported {ROPE_FREQS} tensor: not the LLaMA 3.1 rope scaling rule")
    return scaling


def dequantize(tensor):
    """A GGUF tensor as a numpy array in PyTorch's [rows, cols] order (float32 when quantized)."""
    import gguf
    shape = tuple(int(n) for n in reversed(tensor.shape))
    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F16:
        return tensor.data.view(np.float16).reshape(shape)
    if kind == gguf.GGMLQuantizationType.BF16:
        return tensor.data.view(np.uint16).reshape(shape)  # the caller views these bits as bfloat16
    try:
        return gguf.quants.dequantize(tensor.data, kind).reshape(shape)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {kind.name} ({tensor.name}): the gguf package cannot "
                         "dequantize it; use a file quantized as e.g. Q8_0, Q4_K or F16") from None


def to_torch(tensor, dtype) -> torch.Tensor:
    import gguf
    array = dequantize(tensor)
    t = torch.from_numpy(array.copy())  # copy: the reader's arrays are read-only views of the file
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        t = t.view(torch.bfloat16)
    return t if dtype is None else t.to(dtype)


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's two rotary halves (rows i, i + hd/2 -> 2i, 2i+1);
    # this is its inverse, giving the rotate_half layout of HF checkpoints that model.py uses.
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rename(gguf_name: str, weight_map: dict = WEIGHT_MAP) -> str:
    numbers = re.findall(r"\.(\d+)\.", gguf_name)
    pattern = re.sub(r"\.\d+\.", ".{}.", gguf_name)
    if pattern not in weight_map:
        raise ValueError(f"unmapped GGUF tensor {gguf_name!r}: this architecture variant is not supported")
    return weight_map[pattern].format(*numbers)


def convert_tensors(reader, config: ModelArgs, dtype=None) -> dict:
    arch = field(reader, "general.architecture")
    weight_map = {**WEIGHT_MAP, **ARCH_WEIGHT_MAP.get(arch, {})}
    groups = {}  # -1: embeddings, final norm, output; then one group per layer
    for t in reader.tensors:
        group = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        if t.name not in NOT_WEIGHTS and group < config.n_layer:  # not a multi-token-prediction layer
            groups.setdefault(group, []).append(t)
    state = {}
    for k, group in enumerate(sorted(groups), 1):
        tensors = groups[group]
        kinds = Counter(t.tensor_type.name for t in tensors)
        label = f"layer {group}" if group >= 0 else "embeddings, norm, output"
        print(f"[{k}/{len(groups)}] {label}: " + ", ".join(f"{n} {name}" for name, n in kinds.items()),
              file=sys.stderr, flush=True)
        for t in tensors:
            w = to_torch(t, dtype)
            if config.norm_offset and t.name.endswith("norm.weight") and not t.name.endswith("ssm_norm.weight"):
                # llama.cpp stores Gemma's norms as 1 + weight; brisk keeps weight (model.RMSNorm adds the 1).
                w = (w.float() - config.norm_offset).to(w.dtype)
            name = rename(t.name, weight_map)
            if name.endswith("attention.wk_b"):
                w = w.transpose(1, 2).contiguous()
            elif name.endswith("shared_gate.weight"):  # one output: [dim] in the file
                w = w.reshape(1, -1)
            elif name.endswith("attention.A_log"):  # the file keeps -exp(A_log)
                w = torch.log(-w.float()).to(w.dtype)
            state[name] = w
    for i in range(config.n_layer):
        p = f"layers.{i}.attention."
        f = f"layers.{i}.feed_forward."
        if config.is_linear(i):
            if arch in TILED_VALUE_HEADS:
                grouped_value_heads(state, p, config)
            if config.linear_attention == "gated_deltanet":  # (LFM2's convolution is stored as brisk keeps it)
                gated_delta_net(state, p, config)
            continue
        if config.attention_output_gate:  # attn_q: each head's query, then its gate (HF's q_proj)
            state[p + "wq.weight"], gate = queries_and_gates(state.pop(p + "wq.weight"), config)
        if config.kv_lora_rank:  # llama.cpp keeps DeepSeek's RoPE on neighbouring pairs (its "norm" rope type)
            latent_attention(state, p, config, interleaved=True)
            continue
        if f + "w13.weight" in state:  # Phi-3's fused gate and up
            state[f + "w1.weight"], state[f + "w3.weight"] = split_gate_up(state.pop(f + "w13.weight"))
        e = f"layers.{i}.experts."
        if e + "w13" in state:  # Gemma 4's experts beside the feed-forward: HF's fused [E, 2I, D]
            state[e + "w1"], state[e + "w3"] = (w.contiguous() for w in state.pop(e + "w13").chunk(2, dim=1))
            # its router's input scale times 1 / sqrt(dim), as transformers (and llama.cpp's graph) apply it
            state[e + "router_norm.weight"] = state[e + "router_norm.weight"] * config.dim ** -0.5
        if p + "wqkv.weight" in state:
            continue
        # (Gemma 4: a layer on an earlier one's cache has queries alone, a global one's values may be its keys)
        names = "q" if config.kv_source(i) is not None else "qk" if config.attention_shape(i)[2] else "qkv"
        if not all(p + f"w{x}.weight" in state for x in names):
            raise ValueError(f"layer {i}: q/k/v weights are incomplete in the GGUF file")
        head_dim, kv_heads, _ = config.attention_shape(i)
        for x, heads in (("q", config.n_head), ("k", kv_heads))[:len(names)]:
            rows = state[p + f"w{x}.weight"].shape[0]
            if rows != heads * head_dim:
                raise ValueError(f"blk.{i}.attn_{x}.weight has {rows} rows but the metadata says {heads} heads of "
                                 f"{head_dim}: the GGUF file is inconsistent")
        if names != "qkv":
            state[p + "wqkv.weight"] = torch.cat([state.pop(p + f"w{x}.weight") for x in names])
            continue
        q, k = state.pop(p + "wq.weight"), state.pop(p + "wk.weight")
        if arch in PERMUTED:
            q, k = unpermute(q, config.n_head), unpermute(k, config.n_local_heads)
        if arch in INTERLEAVED_ROPE:
            q, k = rope_halves(q, config.n_head, config), rope_halves(k, config.n_local_heads, config)
            for x, heads in (("q", config.n_head), ("k", config.n_local_heads)):
                if p + f"w{x}.bias" in state:
                    state[p + f"w{x}.bias"] = rope_halves(state[p + f"w{x}.bias"], heads, config)
        state[p + "wqkv.weight"] = torch.cat([q, k, state.pop(p + "wv.weight")] + (
            [gate] if config.attention_output_gate else []))
        if config.attention_bias:
            state[p + "wqkv.bias"] = torch.cat([state.pop(p + f"w{x}.bias") for x in "qkv"])
    return state


def grouped_value_heads(state: dict, p: str, config: ModelArgs):
    """Qwen3.5's Gated DeltaNet tensors (names under prefix p) with their value heads in llama.cpp's tiled
    order (each key head's first value head, then each one's second, ...) put back grouped by key head
    (HF's, which model.py's repeat_interleave of the key heads expects): v's rows of w_qkv and its
    channels of the convolution, z's and b's and a's rows, A_log and dt_bias, the output's columns."""
    kh, vh, dk, dv = config.linear_key_heads, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim

    def grouped(t: torch.Tensor, width: int, dim: int = 0) -> torch.Tensor:
        t = t.movedim(dim, 0)
        t = t.reshape(vh // kh, kh, width, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return t.movedim(0, dim).contiguous()

    keys = 2 * kh * dk
    for name in ("w_qkv", "conv"):
        t = state[p + name]
        state[p + name] = torch.cat([t[:keys], grouped(t[keys:], dv)])
    state[p + "w_z"] = grouped(state[p + "w_z"], dv)
    for name in ("w_b", "w_a", "A_log", "dt_bias"):
        state[p + name] = grouped(state[p + name], 1)
    state[p + "wo.weight"] = grouped(state[p + "wo.weight"], dv, dim=1)


def convert_gguf(gguf_path: Path, output_dir: Path, dtype: str = None) -> Path:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    output_dir = check_output_dir(output_dir, "--output_dir")
    reader = open_gguf(gguf_path)
    try:
        config = config_from_gguf(reader)
    except (TypeError, ArithmeticError, IndexError) as e:  # metadata of the wrong type or a zero head count
        raise ValueError(f"{gguf_path}: inconsistent model metadata ({type(e).__name__}: {e}); download it again") from None
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    try:
        state = convert_tensors(reader, config, DTYPES.get(dtype))
        check_against_model(state, config)
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    tokenizer_files = tokenizer_from_gguf(reader)

    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / "model.pth"
    print(f"writing {out}", file=sys.stderr, flush=True)
    atomic_save(state, out)
    atomic_write(output_dir / "config.json", config.to_json)
    (output_dir / "chat_template.jinja").unlink(missing_ok=True)  # a stale one would override ours
    for name, content in tokenizer_files.items():
        atomic_write_text(output_dir / name, content)
    print(f"done: {out} ({sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters)", file=sys.stderr)
    return out


# --- tokenizer -----------------------------------------------------------------------------------

def tokenizer_from_gguf(reader) -> dict:
    """file name -> text of tokenizer.json, tokenizer_config.json and generation_config.json."""
    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model / tokens); brisk needs one to generate text")
    types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tok = byte_level_bpe(tokens, field(reader, "tokenizer.ggml.merges") or [],
                             field(reader, "tokenizer.ggml.pre", "default"))
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", False)
    elif kind == "llama":
        tok = sentencepiece_bpe(tokens, field(reader, "tokenizer.ggml.scores"), types,
                                field(reader, "tokenizer.ggml.unknown_token_id"),
                                field(reader, "tokenizer.ggml.add_space_prefix", True))
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for these
    elif kind == "gemma4":
        tok = sentencepiece_style_bpe(tokens, field(reader, "tokenizer.ggml.merges") or [])
        add_bos = True  # (llama.cpp adds it to a gemma4 vocabulary whatever the file says)
    else:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), "
                         "llama (SentencePiece), gemma4 (BPE on SentencePiece's pieces)")
    add_special_tokens(tok, tokens, types)

    def token(key):
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    if add_bos and bos is not None:  # as in the hub's tokenizer.json, so transformers adds it too
        from tokenizers import processors
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": token("unknown"), "pad_token": token("padding"), "add_bos_token": bool(add_bos),
              "clean_up_tokenization_spaces": False}
    template = field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    # Chat models end a turn with EOT (LLaMA 3's <|eot_id|>) or EOM; generation stops at any of them.
    eos_ids = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
    generation = {"bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
                  "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    return {"tokenizer.json": tok.to_str(pretty=False),
            "tokenizer_config.json": json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}


def byte_level_bpe(tokens: list, merges: list, pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                         f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    split, digits, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                               ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: list, scores: list, types: list, unk_id, add_space_prefix: bool):
    """SentencePiece BPE as a tokenizers BPE: merges ranked by the score of the piece they make."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    if scores is None:
        raise ValueError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: s for t, s, kind in zip(tokens, scores, types) if kind == NORMAL}
    merges = []
    for piece, score in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-score, vocab[piece], left, right))
    merges.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # Like sentencepiece and llama.cpp, prefix every run of text with a space, even one that starts
    # with a space (tokenizers' Metaspace would not) and one after a special token (llama.cpp does).
    space = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(space + [normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def sentencepiece_style_bpe(tokens: list, merges: list):
    """Gemma 4's: BPE with its merges over the text with spaces as ▁ (no prefix), split only at
    runs of newlines (llama.cpp's gemma4 pre-tokenizer), bytes it lacks as <0xXX> pieces."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def add_special_tokens(tok, tokens: list, types: list):
    # Control tokens (<|im_end|>, <s>) are matched whole and skipped when decoding; user-defined
    # ones (<think>) are matched whole but decoded as text. Both keep their GGUF ids.
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True, help="the .gguf file to convert")
    p.add_argument("--output_dir", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="store every weight in this dtype (default: float32 for quantized tensors, "
                        "the file's own dtype for F32/F16/BF16 ones)")
    args = p.parse_args(argv)
    with error_boundary():
        convert_gguf(args.gguf, args.output_dir, args.dtype)


if __name__ == "__main__":
    main()
