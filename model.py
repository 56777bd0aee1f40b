# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""One decoder-only Transformer for the LLaMA family and its relatives, with a static KV cache.

Plain single-device PyTorch: quantize.py swaps its linears and tp.py shards it from outside.
Variants (GQA, q/k/v bias, tied embeddings, rope scaling, mixture of experts, q/k norms, Gemma's
norms, GeGLU and soft-capping, Granite's multipliers, gpt-oss's sinks and biased experts, DeepSeek V3's
sigmoid routing, Cohere's parallel blocks, per-layer sliding windows and RoPE, Qwen3.5's linear attention
in linear_attention.py) come from `ModelArgs`, which the converters write as config.json beside the
weights; the defaults are LLaMA's.
"""
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from linear_attention import KINDS as LINEAR_ATTENTION, GatedDeltaNet, ShortConv
from rope import apply_rope, precompute_rope, rope_frequencies


@dataclass
class ModelArgs:
    block_size: int = 2048  # the longest context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1  # key/value heads; -1 means n_head (no GQA)
    head_dim: Optional[int] = None  # None means dim // n_head
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF form: {"rope_type": "llama3" | "linear", ...}
    norm_eps: float = 1e-5
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    attention_out_bias: bool = False  # the output projection too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head joins each softmax and attends to nothing (gpt-oss)
    # Queries times 1 + beta * log(1 + floor(position / length)): sharper attention past the original
    # context (Llama 4's and Ministral 3's long-context rule), 1 within it.
    query_scale_beta: Optional[float] = None
    query_scale_length: Optional[int] = None
    tie_embeddings: bool = False  # output projection shares tok_embeddings.weight
    sliding_window: Optional[int] = None  # Mistral v0.1: attend to the last N positions only
    num_experts: int = 0  # > 0 selects the mixture-of-experts feed-forward (Mixtral)
    num_activated_experts: int = 2
    moe_intermediate_size: Optional[int] = None  # each expert's hidden size; None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities (Mixtral; a Qwen3-MoE option)
    dense_layers: Optional[list] = None  # layers that keep the dense feed-forward in a MoE model (Qwen3-MoE)
    moe_bias: bool = False  # the router and each expert's projections carry biases (gpt-oss)
    shared_expert_size: Optional[int] = None  # a dense feed-forward of this size every token runs too (Qwen2-MoE)
    shared_expert_gate: bool = False  # its output times sigmoid of a learned projection of the input (Qwen2-MoE)
    # "softmax" over the experts (Mixtral, Qwen) or "sigmoid" of each expert's logit on its own (DeepSeek V3,
    # GLM-4.5, dots.llm1, MiniMax M2), where a learned bias per expert moves the choice but not the weights.
    router: str = "softmax"
    expert_selection_bias: bool = False
    # Experts in expert_groups groups; a token chooses among the expert_groups_used groups whose best
    # expert_group_top scores sum highest (DeepSeek V3's n_group / topk_group: 2; V2's: 1).
    expert_groups: int = 1
    expert_groups_used: int = 1
    expert_group_top: int = 2
    routed_scale: Optional[float] = None  # the routed experts' weights times this (routed_scaling_factor)
    # Gemma 4's 26B: routed experts beside the dense feed-forward (not instead of it), on their own
    # normalised input, their output normalised before the two are summed; its router reads the
    # RMS-normalised input times a learned scale, and each expert's weight has a learned scale too.
    experts_beside_mlp: bool = False
    router_input_norm: bool = False
    # gpt-oss's experts: gate <= limit and |up| <= limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: Optional[float] = None
    swiglu_alpha: Optional[float] = None
    # Per-family pieces; the defaults are LLaMA's.
    qk_norm: Optional[str] = None  # RMSNorm of q and k: "head" per head (Qwen3, Gemma 3), "all" over the projection (OLMo 2)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1.0 in Gemma
    norm_centered: bool = False  # the norms take out the mean first: LayerNorm without a bias (Cohere)
    # "pre": x + f(norm(x)); "sandwich": x + norm(f(norm(x))) (Gemma); "post": x + norm(f(x)) (OLMo 2);
    # "parallel": x + attention(norm(x)) + feed_forward(norm(x)), one norm (Cohere)
    block_norms: str = "pre"
    hidden_act: str = "silu"  # the feed-forward's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embedding_scale: Optional[float] = None  # embeddings times this, in the activation dtype (Gemma: sqrt(dim))
    attention_scale: Optional[float] = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: Optional[float] = None  # the same on the output logits (Gemma 2)
    residual_scale: Optional[float] = None  # each sublayer's output times this before the residual add (Granite)
    logit_divisor: Optional[float] = None  # the output logits divided by this (Granite's logits_scaling)
    sliding_window_layers: Optional[list] = None  # layers that use sliding_window; None: all of them
    rope_local_base: Optional[float] = None  # RoPE base of the sliding-window layers, unscaled (Gemma 3)
    rope_dim: Optional[int] = None  # leading dims of each head that RoPE rotates (partial rotary); None: head_dim
    # Multi-head latent attention (DeepSeek V2 / V3, GLM-4.7-Flash), on where kv_lora_rank is set:
    # keys and values come from one latent of kv_lora_rank features per position, which the cache keeps
    # beside the RoPE key all heads share (n_local_heads 1); queries through a q_lora_rank bottleneck
    # (None: one projection). Query and key heads are head_dim wide, their last rope_dim rotated; values
    # v_head_dim.
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    v_head_dim: Optional[int] = None
    no_rope_layers: Optional[list] = None  # layers without RoPE (SmolLM3)
    # Gemma 4: the full-attention layers' own head size and key/value heads where they differ from the
    # sliding-window layers' (head_dim, n_local_heads); there the values may be the keys' projection
    # (no v projection; taken before the keys' norm and RoPE). RoPE there spans the whole global head.
    global_head_dim: Optional[int] = None
    global_kv_heads: Optional[int] = None
    global_values_are_keys: bool = False
    value_norm: bool = False  # values RMS-normalised per head, without a weight (Gemma 4)
    layer_scale: bool = False  # each layer's output times a learned scalar (Gemma 4)
    # Gemma 4 E2B / E4B: each layer also adds a gated input of per_layer_input_size features of its own,
    # from a per-layer embedding of the token (per_layer_vocab_size rows) and a projection of its
    # embedding; the last kv_shared_layers layers attend to the keys and values of the last earlier layer
    # of their kind (no k/v projections of their own), their feed-forward twice as wide where
    # double_wide_mlp.
    per_layer_input_size: Optional[int] = None
    per_layer_vocab_size: Optional[int] = None
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # Qwen3-Next / Qwen3.5: these layers mix tokens by Gated DeltaNet (linear_attention.py), a state of
    # linear_value_heads matrices [linear_key_dim, linear_value_dim] per sequence instead of a KV cache,
    # with linear_key_heads query/key heads and a causal convolution of linear_conv_kernel taps; the
    # other layers' attention output is gated by sigmoid of a projection of the input. LFM2's layers
    # (linear_attention "short_conv") are a gated causal depthwise convolution of linear_conv_kernel taps
    # instead, their state its last inputs.
    linear_attention_layers: Optional[list] = None
    linear_attention: str = "gated_deltanet"
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    linear_conv_kernel: int = 4
    attention_output_gate: bool = False
    attention_head_gate: bool = False  # LFM3: each head's output times sigmoid of one projection of the input

    def __post_init__(self):
        self.check_types()
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            if self.n_head > 0 and self.dim % self.n_head:
                raise ValueError(f"dim {self.dim} is not a multiple of n_head {self.n_head}; set head_dim")
            self.head_dim = self.dim // max(self.n_head, 1)
        if self.intermediate_size is None:
            # LLaMA's rule: 2/3 of 4*dim, rounded up to a multiple of 256.
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.rope_dim is None:
            self.rope_dim = self.head_dim
        if self.num_experts and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        for name, value, valid in (("qk_norm", self.qk_norm, (None, "head", "all")),
                                   ("block_norms", self.block_norms, tuple(BLOCK_NORMS)),
                                   ("router", self.router, ("softmax", "sigmoid")),
                                   ("hidden_act", self.hidden_act, tuple(ACTIVATIONS))):
            if value not in valid:
                raise ValueError(f"unsupported {name} {value!r}; supported: {', '.join(map(str, valid))}")
        self.check_values()

    def is_linear(self, layer: int) -> bool:
        return layer in (self.linear_attention_layers or ())

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and (self.sliding_window_layers is None
                                                    or layer in self.sliding_window_layers)

    def attention_shape(self, layer: int) -> tuple:
        """(head_dim, key/value heads, values are keys) of a layer's attention."""
        if self.is_sliding(layer):
            return self.head_dim, self.n_local_heads, False
        return (self.global_head_dim or self.head_dim, self.global_kv_heads or self.n_local_heads,
                self.global_values_are_keys)

    def kv_source(self, layer: int) -> Optional[int]:
        """The earlier layer whose keys and values `layer` attends to (its own: None)."""
        first = self.n_layer - self.kv_shared_layers
        if layer < first:
            return None
        return max(i for i in range(first) if self.is_sliding(i) == self.is_sliding(layer))

    def local_rope(self) -> bool:
        """Whether the sliding-window layers have RoPE tables of their own (a base, or a head size, of their own)."""
        return self.rope_local_base is not None or self.global_head_dim is not None

    def check_types(self):
        """Every field holds its annotated type (JSON gives strings and nulls where numbers belong)."""
        for f in fields(self):
            value, kind = getattr(self, f.name), f.type
            optional = getattr(kind, "__origin__", None) is Union and type(None) in kind.__args__
            if optional:
                if value is None:
                    continue
                kind = next(a for a in kind.__args__ if a is not type(None))
            kind = getattr(kind, "__origin__", kind)  # dict[str, float] -> dict
            if kind is float:  # JSON writes 10000.0 as 10000 too
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif isinstance(kind, type):
                ok = isinstance(value, kind)
            else:
                continue
            if not ok:
                name = kind.__name__ if isinstance(kind, type) else str(kind)
                raise ValueError(f"{f.name} must be {'null or ' if optional else ''}a{'n' if name == 'int' else ''} "
                                 f"{name}, got {value!r}")

    def check_values(self):
        """Sizes the model can be built with; the message names the field."""
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "dim", "intermediate_size", "n_local_heads",
                     "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_local_heads {self.n_local_heads} "
                             "(each key/value head serves a whole group of query heads)")
        if self.head_dim % 2 or (self.global_head_dim or 0) % 2:
            raise ValueError(f"head_dim {self.head_dim} and global_head_dim {self.global_head_dim} must be even "
                             "(RoPE rotates pairs of dimensions)")
        if self.global_kv_heads is not None and (self.global_kv_heads < 1 or self.n_head % self.global_kv_heads):
            raise ValueError(f"n_head {self.n_head} is not a multiple of global_kv_heads {self.global_kv_heads}")
        first = self.n_layer - self.kv_shared_layers
        if not 0 <= self.kv_shared_layers < self.n_layer or self.kv_shared_layers and {
                self.is_sliding(i) for i in range(first, self.n_layer)} - {self.is_sliding(i) for i in range(first)}:
            raise ValueError(f"kv_shared_layers {self.kv_shared_layers} must leave, before them, a layer of each "
                             f"kind they have (windowed or not) among the model's {self.n_layer}")
        if self.kv_lora_rank is not None and not (self.n_local_heads == 1 and self.v_head_dim and self.rope_dim
                                                  < self.head_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"latent attention (kv_lora_rank {self.kv_lora_rank}) needs n_local_heads 1 (got "
                             f"{self.n_local_heads}), a v_head_dim (got {self.v_head_dim}) and an even rope_dim "
                             f"below head_dim (got {self.rope_dim} of {self.head_dim})")
        if self.linear_attention_layers and (self.linear_value_heads % self.linear_key_heads
                                             or self.linear_conv_kernel < 1 or self.kv_shared_layers):
            raise ValueError(f"linear_value_heads {self.linear_value_heads} must be a multiple of linear_key_heads "
                             f"{self.linear_key_heads} and linear_conv_kernel {self.linear_conv_kernel} positive "
                             "(and no kv_shared_layers beside linear attention)")
        if self.linear_attention not in LINEAR_ATTENTION:
            raise ValueError(f"unknown linear_attention {self.linear_attention!r}; known: "
                             f"{', '.join(LINEAR_ATTENTION)}")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_base and norm_eps must be positive, got {self.rope_base}, {self.norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be null or positive, got {self.sliding_window}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_activated_experts <= self.num_experts):
            raise ValueError(f"num_experts {self.num_experts} must be 0 (no experts) or at least "
                             f"num_activated_experts ({self.num_activated_experts}, at least 1)")
        groups, used = self.expert_groups, self.expert_groups_used
        top = self.expert_group_top
        if groups > 1 and not (self.num_experts % groups == 0 and 1 <= top <= self.num_experts // groups
                               and 1 <= used <= groups and self.num_activated_experts <= used * self.num_experts
                               // groups):
            raise ValueError(f"expert_groups {groups} must divide num_experts {self.num_experts} into groups of at "
                             f"least expert_group_top ({top}, at least 1), and expert_groups_used ({used}, 1 to "
                             f"{groups}) must hold num_activated_experts ({self.num_activated_experts})")
        try:  # the one place that knows the rope types and their keys (any head_dim tells)
            rope_frequencies(2, self.rope_base, self.rope_scaling)
        except KeyError as e:
            raise ValueError(f"rope_scaling {self.rope_scaling} lacks the key {e}") from None
        except TypeError as e:
            raise ValueError(f"rope_scaling {self.rope_scaling} holds a value of the wrong type ({e})") from None

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in PRESETS:
            raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(sorted(PRESETS))}")
        return cls(**PRESETS[name])

    @classmethod
    def from_json(cls, path) -> "ModelArgs":
        fix = "fix the field or re-run the conversion (scripts/convert_hf_checkpoint.py writes config.json)"
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object of ModelArgs fields; {fix}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown config keys {unknown}; is this a brisk config.json "
                             "(written by scripts/convert_hf_checkpoint.py)?")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}; {fix}") from None

    def to_json(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


# Exact names only; the converters write the real config of a checkpoint beside its weights,
# so these serve to build random models of a known shape (benchmarks, tests).
PRESETS = {
    "CodeLlama-7b-Python-hf": dict(block_size=16384, vocab_size=32000, n_layer=32, dim=4096, rope_base=1000000),
    "7B": dict(n_layer=32, n_head=32, dim=4096),
    "13B": dict(n_layer=40, n_head=40, dim=5120),
    "30B": dict(n_layer=60, n_head=52, dim=6656),
    "34B": dict(n_layer=48, n_head=64, dim=8192, vocab_size=32000, n_local_heads=8, intermediate_size=22016,
                rope_base=1000000),  # CodeLlama-34B-Python-hf
    "70B": dict(n_layer=80, n_head=64, dim=8192, n_local_heads=8, intermediate_size=28672),
    "Mistral-7B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=32000),
    "stories15M": dict(n_layer=6, n_head=6, dim=288),
    "stories42M": dict(n_layer=8, n_head=8, dim=512),
    "stories110M": dict(n_layer=12, n_head=12, dim=768),
    "llama-3-8b": dict(block_size=8192, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                       vocab_size=128256, rope_base=500000),
    "llama-3-70b": dict(block_size=8192, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                        vocab_size=128256, rope_base=500000),
}
_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)
PRESETS.update({
    "llama-3.1-8b": dict(PRESETS["llama-3-8b"], block_size=131072, rope_scaling=_LLAMA31_ROPE),
    "llama-3.1-70b": dict(PRESETS["llama-3-70b"], block_size=131072, rope_scaling=_LLAMA31_ROPE),
    "llama-3.1-405b": dict(block_size=131072, n_layer=126, n_head=128, n_local_heads=8, dim=16384,
                           intermediate_size=53248, vocab_size=128256, rope_base=500000, rope_scaling=_LLAMA31_ROPE),
    "llama-3.2-1b": dict(block_size=131072, n_layer=16, n_head=32, n_local_heads=8, dim=2048, intermediate_size=8192,
                         vocab_size=128256, rope_base=500000, rope_scaling=_LLAMA32_ROPE, tie_embeddings=True),
    "llama-3.2-3b": dict(block_size=131072, n_layer=28, n_head=24, n_local_heads=8, dim=3072, intermediate_size=8192,
                         vocab_size=128256, rope_base=500000, rope_scaling=_LLAMA32_ROPE, tie_embeddings=True),
    "SmolLM2-135M": dict(block_size=8192, n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536,
                         vocab_size=49152, rope_base=100000, tie_embeddings=True),
    "Mixtral-8x7B-v0.1": dict(block_size=32768, n_layer=32, n_head=32, n_local_heads=8, dim=4096,
                              intermediate_size=14336, vocab_size=32000, rope_base=1000000, num_experts=8,
                              num_activated_experts=2),
})


class KVCache(nn.Module):
    """K/V of max_batch_size rows ("slots"), each up to max_seq_length positions."""

    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype, values: bool = True):
        """values False: keys only (latent attention, whose values are part of its keys)."""
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype) if values else None, persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Optional[Tensor], rows: Optional[Tensor] = None):
        """Write k/v [B, H, T, D] (v None where the keys hold the values) at positions input_pos ([T],
        or [B, T]: each row its own) of cache rows `rows` [B] (default 0..B-1). Positions past what a
        row has written hold stale values (an earlier occupant's, or padding): the mask never lets a
        query see them."""
        pairs = [(self.k_cache, k)] + ([(self.v_cache, v)] if self.v_cache is not None else [])
        for cache, x in pairs:
            x = x.to(cache.dtype)  # a bf16 cache under fp32 activations
            if rows is None and input_pos.dim() == 1:
                cache[:x.shape[0], :, input_pos] = x
            else:
                B, _, T, _ = x.shape
                index = torch.arange(B, device=x.device) if rows is None else rows
                cache[index[:, None], :, input_pos.expand(B, T)] = x.transpose(1, 2)  # indexed (B, T, H, D)

    def copy_positions(self, src: int, dst: int, start: int, end: int):
        """Row dst's positions [start, end) become row src's (a prompt prefix both rows share)."""
        for cache in (self.k_cache, self.v_cache):
            if cache is not None:
                cache[dst, :, start:end] = cache[src, :, start:end]

    def read(self, B: int, rows: Optional[Tensor] = None, length: Optional[int] = None):
        """K/V [B, H, S, D] of cache rows `rows` (default: a view of rows 0..B-1), S = the first
        `length` positions (default all); V None where the cache holds keys only."""
        def read(cache):
            if cache is None:
                return None
            cache = cache[:B] if rows is None else cache[rows]
            return cache if length is None else cache[:, :, :length]
        return read(self.k_cache), read(self.v_cache)


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        if config.per_layer_input_size:  # Gemma 4 E2B / E4B: every layer's own input, all layers' in one row
            width = config.n_layer * config.per_layer_input_size
            self.per_layer_embeddings = nn.Embedding(config.per_layer_vocab_size or config.vocab_size, width)
            self.per_layer_projection = nn.Linear(config.dim, width, bias=False)
            self.per_layer_norm = RMSNorm(config.per_layer_input_size, config.norm_eps, config.norm_offset)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset, config.norm_centered)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1
        # The KV cache's dtype, set before setup_caches (None: the model's). A bf16 cache under fp32
        # activations halves the bytes a long context's decode step reads, as llama.cpp's F16 cache.
        self.kv_cache_dtype: Optional[torch.dtype] = None
        self.register_buffer("rope_cos_sin", None, persistent=False)  # setup_caches makes it

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None, device=None):
        """Allocate the static KV cache and the RoPE tables for up to max_seq_length positions."""
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} is longer than the model's context "
                             f"({self.config.block_size} tokens)")
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        c = self.config
        weight = self.norm.weight  # the model dtype, also when quantize.py made the embedding int8
        dtype = dtype or self.kv_cache_dtype or weight.dtype
        device = device or weight.device
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        for i, layer in enumerate(self.layers):
            if c.is_linear(i):  # (Qwen3.5) a state per row, not per position; tiny: in the model's dtype
                layer.attention.state = layer.attention.make_state(max_batch_size, weight.dtype).to(device)
                continue
            if c.kv_source(i) is not None:  # (Gemma 4 E2B / E4B: an earlier layer's cache, read, not written)
                layer.attention.kv_cache = self.layers[c.kv_source(i)].attention.kv_cache
                continue
            # Sliding-window layers keep every position too: the mask hides the old ones.
            if c.kv_lora_rank:  # one latent and its RoPE key per position; the values are the latent
                cache = KVCache(max_batch_size, max_seq_length, 1, c.kv_lora_rank + c.rope_dim, dtype, values=False)
            else:
                cache = KVCache(max_batch_size, max_seq_length, layer.attention.n_local_heads,
                                layer.attention.head_dim, dtype)
            layer.attention.kv_cache = cache.to(device)
        # RoPE tables stay in fp32: bf16 angles lose whole positions past a few thousand tokens.
        self.register_buffer("rope_cos_sin", precompute_rope(max_seq_length, c.global_head_dim or c.rope_dim,
                                                             c.rope_base, c.rope_scaling).to(device), persistent=False)
        if c.local_rope():  # Gemma 3's, Gemma 4's sliding-window layers: their own base (and size), no scaling
            self.register_buffer("rope_local_cos_sin", precompute_rope(
                max_seq_length, c.rope_dim, c.rope_base if c.rope_local_base is None else c.rope_local_base)
                .to(device), persistent=False)

    def embed(self, idx: Tensor) -> Tensor:
        x = self.tok_embeddings(idx)
        if self.config.embedding_scale is not None:
            # Gemma rounds sqrt(dim) to the activation dtype before multiplying, as transformers does.
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype, device=x.device)
        return x

    def per_layer_inputs(self, idx: Tensor, x: Tensor) -> Tensor:
        """Gemma 4 E2B / E4B: each layer's input [B, T, n_layer, per_layer_input_size], the mean (over
        sqrt 2) of the token's per-layer embedding and the normalised projection of its embedding x."""
        c = self.config
        shape = (*idx.shape, c.n_layer, c.per_layer_input_size)
        token = self.per_layer_embeddings(idx)
        token = token * torch.tensor(c.per_layer_input_size ** 0.5, dtype=token.dtype, device=token.device)
        projected = self.per_layer_norm((self.per_layer_projection(x) * c.dim ** -0.5).reshape(shape))
        return (projected + token.reshape(shape).to(x.dtype)) * 2 ** -0.5

    def forward(self, idx: Tensor, input_pos: Tensor, last_only: bool = False, from_start: bool = False,
                cache_rows: Optional[Tensor] = None, logits_at: Optional[Tensor] = None,
                kv_len: Optional[int] = None, lengths: Optional[Tensor] = None) -> Tensor:
        """idx: [B, T] token ids at positions input_pos, [T] (every row the same) or [B, T] (each
        row its own: a batch of independent sequences); returns logits [B, T, vocab].

        cache_rows [B]: the KV cache rows (slots) the batch's rows read and write (default 0..B-1).
        kv_len: attend to the first kv_len cache positions only (default: the whole cache); every
        query must lie below it.

        A prompt's prefill says what it knows: last_only computes logits for the last position only
        and logits_at [B] for one position per row ([B, 1, vocab]; the output projection over a
        whole prompt is a large part of a small model's prefill); from_start says that every row's
        positions are arange(T), so attention needs nothing from the cache and runs as SDPA's
        causal kernel over the prompt, cheaper than a mask over the cache.

        lengths [B]: how many of its T tokens each row really has (default all); the rest are padding
        (a right-padded batch of prompts) or the whole row is (lengths 0: a row that rides along in a
        step of fixed shape). Attention needs no telling (its mask keeps real tokens from seeing later
        positions); linear attention's state must not take them in.
        """
        if self.rope_cos_sin is None:  # not the int: a compiled step would be specialised to its value
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before the forward pass")
        c = self.config
        rope = self.rope_cos_sin[input_pos]  # (T, rope_dim, 2) or (B, T, rope_dim, 2)
        local_rope = self.rope_local_cos_sin[input_pos] if c.local_rope() else rope
        # One mask for the full-attention layers and one for the sliding-window layers (per GQA group
        # size, where the two kinds differ: Gemma 4), each built only when some layer needs it.
        masks = {}
        for layer in self.layers:
            if layer.mask_kind in masks:
                continue
            if layer.mask_kind == "tokens":  # (linear attention) which tokens are real
                masks["tokens"] = None if lengths is None else (
                    torch.arange(idx.shape[1], device=idx.device) < lengths[:, None])
            else:
                masks[layer.mask_kind] = self.attention_mask(input_pos, idx.shape[1], from_start,
                                                             c.sliding_window if layer.sliding else None, kv_len,
                                                             layer.mask_kind[1])
        x = self.embed(idx)
        per_layer = self.per_layer_inputs(idx, x) if c.per_layer_input_size else None
        for i, layer in enumerate(self.layers):
            x = layer(x, input_pos, local_rope if layer.sliding else rope, masks[layer.mask_kind], cache_rows,
                      None if per_layer is None else per_layer[:, :, i])
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at][:, None]  # (B, 1, D)
        elif last_only:
            x = x[:, -1:]
        logits = self.output(self.norm(x))
        if c.logit_divisor is not None:
            logits = logits / c.logit_divisor
        if c.final_logit_softcap is not None:
            logits = c.final_logit_softcap * torch.tanh(logits / c.final_logit_softcap)
        return logits

    def attention_mask(self, input_pos: Tensor, T: int, from_start: bool, window: Optional[int],
                       kv_len: Optional[int] = None, rep: Optional[int] = None) -> Optional[Tensor]:
        """True where a query row may see a cache position: (n_head // n_local_heads * T, S) for
        positions [T], (B, 1, that, S) for per-row positions [B, T]; S = kv_len or the whole cache.
        None for causal attention within idx (a prompt from position 0 that fits the window, and
        SDPA's causal kernel computes the scores: not with soft-capping or sinks)."""
        c = self.config
        if from_start and (window is None or T <= window) and c.attn_logit_softcap is None and not c.attention_sinks:
            return None
        # Key position j is visible from query position i when j <= i (and within the window).
        # The cache's length read from a tensor, not the int attribute: a compiled step may leave it dynamic.
        k_pos = torch.arange(kv_len or self.rope_cos_sin.shape[0], device=input_pos.device)
        q_pos = input_pos[..., None]  # (T, 1) or (B, T, 1)
        mask = k_pos <= q_pos  # (T, S) or (B, T, S)
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        # Rows per query head of a GQA group, as Attention folds them.
        rep = rep or c.n_head // c.n_local_heads
        return mask.repeat(rep, 1) if mask.dim() == 2 else mask.repeat(1, rep, 1)[:, None]


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, layer_id: int):
        super().__init__()
        self.sliding = config.is_sliding(layer_id)  # Transformer.forward hands it the window's mask (and local RoPE)
        c = config
        self.linear = c.is_linear(layer_id)  # a recurrent state, no KV cache (Qwen3.5's Gated DeltaNet, LFM2's)
        self.attention = (ShortConv(c.dim, c.linear_conv_kernel) if self.linear and c.linear_attention == "short_conv"
                          else GatedDeltaNet(c.dim, c.linear_key_heads, c.linear_value_heads, c.linear_key_dim,
                                             c.linear_value_dim, c.linear_conv_kernel, c.norm_eps) if self.linear
                          else LatentAttention(c) if c.kv_lora_rank else Attention(c, layer_id))
        moe = config.num_experts > 0 and not config.experts_beside_mlp and layer_id not in (config.dense_layers or ())
        wide = config.double_wide_mlp and config.kv_source(layer_id) is not None  # (Gemma 4 E2B / E4B)
        self.feed_forward = (MoEFeedForward(config) if moe else
                             FeedForward(replace(config, intermediate_size=2 * config.intermediate_size) if wide
                                         else config))
        # Norms before and/or after each sublayer (BLOCK_NORMS); the missing ones are identities.
        pre, post = BLOCK_NORMS[config.block_norms]
        self.parallel = config.block_norms == "parallel"
        norm = lambda on: (RMSNorm(config.dim, config.norm_eps, config.norm_offset, config.norm_centered) if on
                           else nn.Identity())
        self.attention_norm, self.ffn_norm = norm(pre), norm(pre and not self.parallel)
        self.post_attention_norm, self.post_ffn_norm = norm(post), norm(post)
        self.residual_scale = config.residual_scale
        self.register_buffer("layer_scale", torch.ones(1) if config.layer_scale else None)
        beside = config.experts_beside_mlp and config.num_experts > 0 and layer_id not in (config.dense_layers or ())
        self.experts = MoEFeedForward(config) if beside else None
        if beside:  # the dense output's norm, the experts' input and output norms
            self.post_mlp_norm, self.experts_norm, self.post_experts_norm = (norm(True) for _ in range(3))
        if config.per_layer_input_size:  # its per-layer input, gated by the hidden state, added back normalised
            self.per_layer_gate = nn.Linear(config.dim, config.per_layer_input_size, bias=False)
            self.per_layer_out = nn.Linear(config.per_layer_input_size, config.dim, bias=False)
            self.per_layer_out_norm = norm(True)
            self.act = ACTIVATIONS[config.hidden_act]

    @property
    def mask_kind(self):
        """(windowed, query heads per key/value head): the layers that share an attention mask;
        "tokens" for linear attention's, which says which tokens are real."""
        if self.linear:
            return "tokens"
        return self.sliding, self.attention.n_head // self.attention.n_local_heads

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor],
                cache_rows: Optional[Tensor] = None, per_layer_input: Optional[Tensor] = None) -> Tensor:
        if self.parallel:
            h = self.attention_norm(x)
            out = x + self.attention(h, input_pos, rope, mask, cache_rows) + self.feed_forward(h)
        else:
            h = x + self.scaled(self.post_attention_norm(self.attention(self.attention_norm(x), input_pos, rope,
                                                                        mask, cache_rows)))
            y = self.feed_forward(self.ffn_norm(h))
            if self.experts is not None:  # (Gemma 4's 26B) routed from h itself
                y = self.post_mlp_norm(y) + self.post_experts_norm(self.experts(self.experts_norm(h), route_from=h))
            out = h + self.scaled(self.post_ffn_norm(y))
        if per_layer_input is not None:
            gated = self.act(self.per_layer_gate(out)) * per_layer_input
            out = out + self.per_layer_out_norm(self.per_layer_out(gated))
        return out if self.layer_scale is None else out * self.layer_scale

    def scaled(self, y: Tensor) -> Tensor:
        return y if self.residual_scale is None else y * self.residual_scale


BLOCK_NORMS = {"pre": (True, False), "sandwich": (True, True), "post": (False, True),  # (before, after)
               "parallel": (True, False)}


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, layer_id: int = 0):
        super().__init__()
        head_dim, kv_heads, self.values_are_keys = config.attention_shape(layer_id)
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, kv_heads, head_dim
        # Gemma 4 E2B / E4B: a layer that attends to an earlier one's keys and values projects queries only.
        self.reads_kv = config.kv_source(layer_id) is not None
        kv_projections = 0 if self.reads_kv else 1 if self.values_are_keys else 2
        # q, k and v in one projection: one matrix-vector product per layer instead of three. Last in
        # it, where the model gates the heads' outputs: a gate per output (Qwen3.5's full-attention
        # layers) or one per head (LFM3).
        self.head_gate = config.attention_head_gate
        self.gate_dim = (config.n_head * head_dim if config.attention_output_gate else
                         config.n_head if self.head_gate else 0)
        qkv_dim = (config.n_head + kv_projections * kv_heads) * head_dim + self.gate_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.attention_bias)
        self.wo = nn.Linear(config.n_head * head_dim, config.dim, bias=config.attention_out_bias)
        self.sinks = nn.Parameter(torch.empty(config.n_head)) if config.attention_sinks else None
        self.kv_cache: Optional[KVCache] = None
        # A kernel for decode steps that reads the KV cache in place, attached from outside (kernels.py):
        # f(q [B, n_kv, rows, hd], k_cache, v_cache, cache_rows, mask, scale) -> y like q, reading only
        # the positions from the first any row sees to the last.
        self.attend_cache: Optional[Callable] = None
        # And one for a prompt from position 0 (causal within it): f(q [B, nh, T, hd], k, v [B, n_kv,
        # T, hd], scale) -> y [B, T, nh * hd].
        self.attend_prompt: Optional[Callable] = None
        # apply_rope in one op for eager steps (kernels.py): f(x [B, T, heads, hd], rope) -> x rotated.
        self.rotate: Optional[Callable] = None
        self.scale = config.attention_scale or head_dim ** -0.5
        self.softcap = config.attn_logit_softcap
        self.value_norm_eps = config.norm_eps if config.value_norm else None
        self.use_rope = layer_id not in (config.no_rope_layers or ())
        self.query_scale = (config.query_scale_beta, config.query_scale_length) if config.query_scale_beta else None
        self.qk_norm = config.qk_norm
        if config.qk_norm is not None:
            # "head": one norm over head_dim shared by the heads; "all": over the whole q (k) projection.
            q_size, k_size = ((head_dim, head_dim) if config.qk_norm == "head" else
                              (config.n_head * head_dim, kv_heads * head_dim))
            self.q_norm = RMSNorm(q_size, config.norm_eps, config.norm_offset)
            if not self.reads_kv:
                self.k_norm = RMSNorm(k_size, config.norm_eps, config.norm_offset)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor],
                cache_rows: Optional[Tensor] = None) -> Tensor:
        """mask: (n_head // n_local_heads * T, S), or (B, 1, that, S) with per-row positions, True
        where a query row may see a cache position; None when x is the whole sequence so far (from
        position 0): causal attention within x."""
        B, T, _ = x.shape
        q_dim = self.n_head * self.head_dim
        qkv = self.wqkv(x)
        gate = None
        if self.gate_dim:
            qkv, gate = qkv[..., :-self.gate_dim], qkv[..., -self.gate_dim:]
        q = qkv[..., :q_dim]
        if self.qk_norm == "all":
            q = self.q_norm(q)
        q = q.view(B, T, self.n_head, self.head_dim)
        if self.qk_norm == "head":
            q = self.q_norm(q)
        if self.use_rope:
            q = self.rotated(q, rope)
        if self.query_scale is not None:
            q = q * long_context_query_scale(input_pos, *self.query_scale).to(q.dtype)[..., None, None]
        q = q.transpose(1, 2)  # (B, nh, T, hd)
        if self.reads_kv:  # (Gemma 4 E2B / E4B) the earlier layer wrote them, this pass's too
            k, v = (t.to(q.dtype).contiguous() for t in self.kv_cache.read(B, cache_rows, T)) if mask is None else (
                None, None)
        else:
            k, v = self.keys_values(qkv[..., q_dim:], rope)
            self.kv_cache.update(input_pos, k, v, cache_rows)
        if mask is None:
            if self.attend_prompt is not None:
                return self.out(self.attend_prompt(q, k, v, self.scale), gate)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=k.shape[1] != q.shape[1])
            return self.out(y.transpose(1, 2).reshape(B, T, q_dim), gate)
        # GQA: the query heads that share a key/value head become rows of one attention over it.
        # SDPA's own enable_gqa gives the same result but runs far slower in bf16 on the CPU at long
        # contexts (README, How it works).
        rep = self.n_head // self.n_local_heads
        q = q.reshape(B, self.n_local_heads, rep * T, self.head_dim)
        # The cache kernel (kernels.py) takes decode steps, and eager prompt chunks past position 0
        # where the prompt kernel's tiles fit the head (attend_prompt attached).
        if self.attend_cache is not None and (T == 1 or self.attend_prompt is not None
                                              and not torch.compiler.is_compiling()):
            y = self.attend_cache(q, self.kv_cache.k_cache, self.kv_cache.v_cache, cache_rows, mask, self.scale)
        else:
            k, v = self.kv_cache.read(B, cache_rows, mask.shape[-1])  # (B, n_kv, S, hd)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype than the activations
            # Each query row's sink: rows are (head of the group, position), as q was folded.
            sinks = None if self.sinks is None else self.sinks.view(self.n_local_heads, rep, 1).expand(
                -1, -1, T).reshape(self.n_local_heads, rep * T)
            if T == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
                y = decode_attention(q, k, v, mask, self.scale, self.softcap, sinks)
            elif self.softcap is not None or sinks is not None:  # what SDPA cannot do
                y = explicit_attention(q, k, v, mask, self.scale, self.softcap, sinks)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, n_kv, rep * T, hd)
        # reshape, not view: CUDA's attention kernels return y in another memory layout.
        return self.out(y.reshape(B, self.n_head, T, self.head_dim).transpose(1, 2).reshape(B, T, q_dim), gate)

    def out(self, y: Tensor, gate: Optional[Tensor]) -> Tensor:
        """The output projection of the heads' outputs y [B, T, n_head * head_dim], gated where the model is."""
        if gate is not None and self.head_gate:
            return self.wo((y.unflatten(-1, (-1, self.head_dim)) * torch.sigmoid(gate)[..., None]).flatten(-2))
        return self.wo(y if gate is None else y * torch.sigmoid(gate))

    def keys_values(self, kv: Tensor, rope: Tensor) -> tuple:
        """k, v [B, n_kv, T, hd] of the projection's key/value part [B, T, ...], normalised and rotated."""
        B, T, _ = kv.shape
        k, v = (kv, kv) if self.values_are_keys else kv.chunk(2, dim=-1)  # (Gemma 4's global layers)
        if self.qk_norm == "all":
            k = self.k_norm(k)
        k = k.view(B, T, self.n_local_heads, self.head_dim)
        v = v.view(B, T, self.n_local_heads, self.head_dim)
        if self.value_norm_eps is not None:  # RMS norm without a weight, in fp32 as the others
            vf = v.float()
            v = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + self.value_norm_eps)).type_as(v)
        if self.qk_norm == "head":
            k = self.k_norm(k)
        if self.use_rope:
            k = self.rotated(k, rope)
        return k.transpose(1, 2), v.transpose(1, 2)

    def rotated(self, x: Tensor, rope: Tensor) -> Tensor:
        rotate = self.rotate if self.rotate is not None and not torch.compiler.is_compiling() else apply_rope
        return rotate(x, rope)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, run as multi-query attention over the latent: the
    cache holds each position's normalised latent (kv_lora_rank) and shared RoPE key (rope_dim), and
    each head reaches the latent through its slices of the key/value up-projection, wk_b folded into
    its query, wv_b applied to its output (the weights of DeepSeek's "absorbed" inference). A
    position costs kv_lora_rank + rope_dim cache features, not heads * (head_dim + v_head_dim)."""

    # DeepSeek's latent norms use this epsilon whatever the config's (as transformers builds them).
    LATENT_NORM_EPS = 1e-6

    def __init__(self, config: ModelArgs):
        super().__init__()
        H, D, self.rope_dim = config.n_head, config.dim, config.rope_dim
        self.n_head, self.head_dim, self.v_head_dim = H, config.head_dim, config.v_head_dim
        self.n_local_heads = 1  # the latent, which every head reads
        self.kv_lora_rank, nope = config.kv_lora_rank, config.head_dim - config.rope_dim
        if config.q_lora_rank:
            self.wq_a = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, self.LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.q_lora_rank, H * config.head_dim, bias=False)
        else:
            self.wq = nn.Linear(D, H * config.head_dim, bias=False)
        self.wkv_a = nn.Linear(D, config.kv_lora_rank + config.rope_dim, bias=False)
        self.kv_norm = RMSNorm(config.kv_lora_rank, self.LATENT_NORM_EPS)
        # The up-projection of the latent to each head's keys (without RoPE) and values.
        self.wk_b = nn.Parameter(torch.empty(H, nope, config.kv_lora_rank))
        self.wv_b = nn.Parameter(torch.empty(H, config.v_head_dim, config.kv_lora_rank))
        self.wo = nn.Linear(H * config.v_head_dim, D, bias=False)
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.query_scale = (config.query_scale_beta, config.query_scale_length) if config.query_scale_beta else None
        self.kv_cache: Optional[KVCache] = None
        self.attend_cache = None  # (kernels.py's attention kernels take Attention's layout only)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor],
                cache_rows: Optional[Tensor] = None) -> Tensor:
        """As Attention.forward; mask rows are (head, position), all heads over the one latent."""
        B, T, _ = x.shape
        H, L, rd = self.n_head, self.kv_lora_rank, self.rope_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rot = q.view(B, T, H, self.head_dim).split([self.head_dim - rd, rd], dim=-1)
        latent, k_rot = self.wkv_a(x).split([L, rd], dim=-1)
        q_rot, k_rot = apply_rope(q_rot, rope), apply_rope(k_rot[:, :, None], rope)
        q = torch.cat([torch.einsum("bthn,hnl->bhtl", q_nope, self.wk_b), q_rot.transpose(1, 2)], dim=-1)
        if self.query_scale is not None:  # (Mistral 4)
            q = q * long_context_query_scale(input_pos, *self.query_scale).to(q.dtype)[..., None].unsqueeze(-3)
        k = torch.cat([self.kv_norm(latent)[:, None], k_rot.transpose(1, 2)], dim=-1)  # (B, 1, T, L + rd)
        self.kv_cache.update(input_pos, k, None, cache_rows)
        # The values are the latent, but SDPA's fused CPU kernel takes only values as wide as the keys
        # (its math fallback holds every score: 3.5 GB for a 4k prompt of 20 heads): attend with the whole
        # key as the value and keep the latent's part of the output.
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, k, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            k = self.kv_cache.read(B, cache_rows, mask.shape[-1])[0].to(q.dtype)
            y = F.scaled_dot_product_attention(q.reshape(B, 1, H * T, L + rd), k, k, attn_mask=mask,
                                               scale=self.scale).view(B, H, T, L + rd)
        return self.wo(torch.einsum("bhtl,hvl->bthv", y[..., :L], self.wv_b).reshape(B, T, H * self.v_head_dim))


def long_context_query_scale(input_pos: Tensor, beta: float, length: int) -> Tensor:
    """Llama 4's query scaling by position ([T] or [B, T]): 1 within the original context `length`."""
    return 1 + beta * torch.log1p(torch.floor(input_pos / length))


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# The feed-forward's gate activation: SwiGLU's SiLU, GeGLU's tanh-approximated GELU. Named functions,
# not lambdas: packed_cache.py pickles the model.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)  # down
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Sparse feed-forward (Mixtral, Qwen3-MoE): each token runs its top-k experts, weighted by the
    router, and where the config has one a shared expert (Qwen2-MoE).

    Subclasses (quantize's int8 / int4 experts) change how experts are stored and applied:
    `make_experts`, `linear` (one expert's projection), `expert_weights`, and `gathers` (whether a
    compiled decode step can gather the selected experts' weights); routing, biases, the gate
    function and the paths below stay the same.
    """
    gathers = True
    full_precision_buffers = ("selection_bias",)  # kept fp32 under a bf16 model (load.to_device): it picks experts

    def __init__(self, config: ModelArgs):
        super().__init__()
        E, D, I = config.num_experts, config.dim, config.moe_intermediate_size
        self.top_k = config.num_activated_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.sigmoid = config.router == "sigmoid"
        self.groups = ((config.expert_groups, config.expert_groups_used, config.expert_group_top)
                       if config.expert_groups > 1 else None)
        self.routed_scale = config.routed_scale
        self.register_buffer("selection_bias", torch.zeros(E) if config.expert_selection_bias else None)
        self.router_norm = RMSNorm(D, config.norm_eps) if config.router_input_norm else None
        self.expert_scales = nn.Parameter(torch.ones(E)) if config.router_input_norm else None
        self.act = ACTIVATIONS[config.hidden_act]
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        self.gate = nn.Linear(D, E, bias=config.moe_bias)
        self.make_experts(E, D, I)
        # Biases stay full precision whatever stores the weights (make_experts).
        biased = config.moe_bias
        self.w1_bias = nn.Parameter(torch.empty(E, I)) if biased else None
        self.w3_bias = nn.Parameter(torch.empty(E, I)) if biased else None
        self.w2_bias = nn.Parameter(torch.empty(E, D)) if biased else None
        shared = config.shared_expert_size
        self.shared_expert = FeedForward(replace(config, intermediate_size=shared)) if shared else None
        self.shared_gate = nn.Linear(D, 1, bias=False) if config.shared_expert_gate else None

    def make_experts(self, E: int, D: int, I: int):
        # Experts stacked so a token gathers only its selected experts' weights.
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w3 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def route(self, x: Tensor):
        """x: (N, D) -> weights, experts (N, k): the top-k of the softmax over all experts, or of
        each expert's sigmoid (chosen by score + selection bias, within the best groups where the
        config has groups); renormalised unless the config says otherwise (Qwen3-MoE's
        norm_topk_prob=false), then scaled where it says so."""
        logits = self.gate(x if self.router_norm is None else self.router_norm(x)).float()  # (N, E)
        scores = torch.sigmoid(logits) if self.sigmoid else F.softmax(logits, dim=-1)
        choice = scores if self.selection_bias is None else scores + self.selection_bias.float()
        if self.groups is not None:
            choice = best_groups(choice, *self.groups)
        experts = torch.topk(choice, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_scales is not None:
            weights = weights * self.expert_scales[experts].float()
        if self.routed_scale is not None:
            weights = weights * self.routed_scale
        return weights.to(x.dtype), experts

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return self.act(gate) * up
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(self.swiglu_alpha * gate)

    def linear(self, x: Tensor, name: str, e: int) -> Tensor:
        """x [M, in] through projection `name` of expert e (with its bias, where the model has them)."""
        bias = getattr(self, f"{name}_bias")
        return F.linear(x, getattr(self, name)[e], None if bias is None else bias[e])

    def expert(self, x: Tensor, e: int) -> Tensor:
        return self.linear(self.glu(self.linear(x, "w1", e), self.linear(x, "w3", e)), "w2", e)

    def expert_weights(self, experts: Tensor):
        """w1, w3 (N, k, I, D), w2 (N, k, D, I) of the selected experts; compiled, the gather fuses into the matmuls."""
        return self.w1[experts], self.w3[experts], self.w2[experts]

    def forward(self, x: Tensor, route_from: Optional[Tensor] = None) -> Tensor:
        """route_from: what the router reads where it is not x (Gemma 4's 26B)."""
        out = self.routed(x, x if route_from is None else route_from)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        return out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)

    def routed(self, x: Tensor, route_from: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        weights, experts = self.route(route_from.reshape(-1, shape[-1]))
        E = self.num_experts
        if not torch.compiler.is_compiling():
            # Eager: each expert runs on the tokens routed to it (data-dependent shapes, no copies).
            out = torch.zeros_like(x)
            for e in range(E):
                token, slot = torch.where(experts == e)
                if len(token):  # CUDA's int4 kernel refuses an empty batch
                    out.index_add_(0, token, weights[token, slot, None] * self.expert(x[token], e))
            return out.reshape(shape)
        # A token count the graph does not know (a compiled prefill's unbacked batch) takes the
        # all-experts path below, right for any count. (Imported here, while tracing: it imports
        # sympy, half a second of every start.)
        from torch.fx.experimental.symbolic_shapes import guard_or_false
        if self.gathers and guard_or_false(x.shape[0] * self.top_k <= E):
            # Compiled decode: only the selected experts' weights are read.
            w1, w3, w2 = self.expert_weights(experts)
            gate, up = torch.einsum("nd,nkid->nki", x, w1), torch.einsum("nd,nkid->nki", x, w3)  # (N, k, I)
            if self.w1_bias is not None:
                gate, up = gate + self.w1_bias[experts], up + self.w3_bias[experts]
            y = torch.einsum("nki,nkdi->nkd", self.glu(gate, up), w2)  # (N, k, D)
            if self.w2_bias is not None:
                y = y + self.w2_bias[experts]
            return torch.einsum("nkd,nk->nd", y, weights).reshape(shape)
        return self.all_experts(x, weights, experts).reshape(shape)

    def all_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Compiled, many tokens: static shapes, so every expert runs on all tokens; unselected ones weigh 0."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense = dense.scatter(1, experts, weights)  # (N, E)
        out = torch.zeros_like(x)
        for e in range(dense.shape[1]):
            out += dense[:, e, None] * self.expert(x, e)
        return out


def best_groups(choice: Tensor, groups: int, used: int, top: int) -> Tensor:
    """choice (N, E) with the experts outside each token's `used` best of `groups` groups at -inf;
    a group's score is the sum of its `top` best experts' (DeepSeek's group-limited routing)."""
    grouped = choice.view(choice.shape[0], groups, -1)  # (N, groups, E / groups)
    best = torch.topk(grouped.topk(top, dim=-1).values.sum(-1), used, dim=-1).indices  # (N, used)
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                     softcap: Optional[float] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """SDPA for a few query rows, written as products and sums that inductor fuses into loops over
    the cache. In a compiled CPU decode step the SDPA op's fixed cost per layer is a visible part of
    a small quantized model's step; fused, it is gone."""
    q = in_memory(q)
    scores = (q[..., :, None, :].float() * k[..., None, :, :].float()).sum(-1) * scale
    probs = attention_probs(scores, mask, softcap, sinks)  # (B, H, rows, S)
    return (probs[..., None] * v[..., None, :, :].float()).sum(-2).to(q.dtype)


def attention_probs(scores: Tensor, mask: Tensor, softcap: Optional[float], sinks: Optional[Tensor]) -> Tensor:
    """Softmax of fp32 scores (B, H, rows, S) over the visible positions; Gemma 2 soft-caps them
    first (cap * tanh(scores / cap)); gpt-oss's sinks (H, rows) take part in each row's sum as one
    more logit whose value is nothing, so a row may attend to less than all of it."""
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks.float().expand(scores.shape[:-1])[..., None]
    return torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]


def in_memory(x: Tensor) -> Tensor:
    """x computed once into memory by a compiled step. Inductor otherwise recomputes a cheap
    producer inside each loop that reads it: the query's RoPE, with its table lookup by position,
    once per cache position in the attention scores, where that indirect load keeps the loop scalar.
    (inductor's own prim, registered once inductor is imported: compiling.py does.)"""
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return x if force is None else force(x, x.contiguous().stride())


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: Optional[float],
                       sinks: Optional[Tensor], rows: int = 512) -> Tensor:
    """Attention written out, for the scores SDPA cannot change (attention_probs). Eager, a long
    prompt's query rows go `rows` at a time: its fp32 scores would otherwise take B * heads *
    length^2 * 4 bytes at once (17 GB for gpt-oss-20b's 64 heads at 8k tokens)."""
    if q.shape[-2] > rows and not torch.compiler.is_compiling():
        return torch.cat([explicit_attention(q[..., i:i + rows, :], k, v, mask[..., i:i + rows, :], scale, softcap,
                                             None if sinks is None else sinks[..., i:i + rows], rows)
                          for i in range(0, q.shape[-2], rows)], dim=-2)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, n_kv, rows, S)
    return (attention_probs(scores, mask, softcap, sinks) @ v.float()).to(q.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0, centered: bool = False):
        super().__init__()
        self.eps, self.offset, self.centered = eps, offset, centered
        self.weight = nn.Parameter(torch.ones(dim))
        # The same in one op for eager steps, attached from outside (kernels.py): f(x, weight, eps, offset).
        self.kernel: Optional[Callable] = None

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and not torch.compiler.is_compiling():
            return self.kernel(x, self.weight, self.eps, self.offset)
        # Normalise in fp32 like the reference implementations, then scale in the model dtype;
        # Gemma scales by (1 + weight) in fp32, as its checkpoints store weight - 1 to stay exact.
        xf = x.float()
        if self.centered:  # LayerNorm without a bias (Cohere), whose weight applies in fp32 too
            xf = xf - xf.mean(-1, keepdim=True)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset or self.centered:
            return (normed * (self.offset + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight
