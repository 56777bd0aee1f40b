# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""One decoder-only Transformer for the LLaMA family, with a static KV cache.

Plain single-device PyTorch: quantize.py swaps its linears and tp.py shards it from outside.
Variants (GQA, q/k/v bias, tied embeddings, rope scaling, mixture of experts) come from
`ModelArgs`, which the converters write as config.json beside the weights.
"""
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F


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
    tie_embeddings: bool = False  # output projection shares tok_embeddings.weight
    sliding_window: Optional[int] = None  # Mistral v0.1: attend to the last N positions only
    num_experts: int = 0  # > 0 selects the mixture-of-experts feed-forward (Mixtral)
    num_activated_experts: int = 2

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
        self.check_values()

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
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_base and norm_eps must be positive, got {self.rope_base}, {self.norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be null or positive, got {self.sliding_window}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_activated_experts <= self.num_experts):
            raise ValueError(f"num_experts {self.num_experts} must be 0 (no experts) or at least "
                             f"num_activated_experts ({self.num_activated_experts}, at least 1)")
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
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor):
        # input_pos: [T], k/v: [B, H, T, D]. Rows past the batch keep stale values and are never read.
        B = k.shape[0]
        self.k_cache[:B, :, input_pos] = k
        self.v_cache[:B, :, input_pos] = v
        return self.k_cache[:B], self.v_cache[:B]


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None, device=None):
        """Allocate the static KV cache and the RoPE table for up to max_seq_length positions."""
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} is longer than the model's context "
                             f"({self.config.block_size} tokens)")
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        c = self.config
        weight = self.norm.weight  # the model dtype, also when quantize.py made the embedding int8
        dtype = dtype or weight.dtype
        device = device or weight.device
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, c.n_local_heads, c.head_dim,
                                               dtype).to(device)
        # RoPE tables stay in fp32: bf16 angles lose whole positions past a few thousand tokens.
        self.register_buffer("rope_cos_sin", precompute_rope(max_seq_length, c.head_dim, c.rope_base,
                                                             c.rope_scaling).to(device), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, last_only: bool = False, from_start: bool = False) -> Tensor:
        """idx: [B, T] token ids at positions input_pos [T]; returns logits [B, T, vocab].

        A prompt's prefill says what it knows: last_only computes logits for the last position only
        ([B, 1, vocab]; the output projection over a whole prompt is a large part of a small model's
        prefill), and from_start says that input_pos is arange(T), so attention needs nothing from
        the cache and runs as SDPA's causal kernel over the prompt, cheaper than a mask over the cache.
        """
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before the forward pass")
        rope = self.rope_cos_sin[input_pos]  # (T, head_dim, 2)
        window = self.config.sliding_window
        mask = None  # None: causal within idx
        if not (from_start and (window is None or idx.shape[1] <= window)):
            # Key position j is visible from query position i when j <= i (and within the window).
            k_pos = torch.arange(self.max_seq_length, device=idx.device)
            mask = k_pos[None, :] <= input_pos[:, None]  # (T, S)
            if window is not None:
                mask = mask & (k_pos[None, :] > input_pos[:, None] - window)
            mask = mask.repeat(self.config.n_head // self.config.n_local_heads, 1)  # rows per query head of a group
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, rope, mask)
        return self.output(self.norm(x[:, -1:] if last_only else x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = MoEFeedForward(config) if config.num_experts > 0 else FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor]) -> Tensor:
        h = x + self.attention(self.attention_norm(x), input_pos, rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        # q, k and v in one projection: one matrix-vector product per layer instead of three.
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.attention_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, input_pos: Tensor, rope: Tensor, mask: Optional[Tensor]) -> Tensor:
        """mask: (n_head // n_local_heads * T, S), True where a query row may see a cache position;
        None when x is the whole sequence so far (from position 0): causal attention within x."""
        B, T, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_local_heads, self.head_dim)
        v = v.view(B, T, self.n_local_heads, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        if mask is None:
            self.kv_cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            return self.wo(y.transpose(1, 2).reshape(B, T, q_dim))
        k, v = self.kv_cache.update(input_pos, k, v)  # (B, n_kv, S, hd)
        # GQA: the query heads that share a key/value head become rows of one attention over it.
        # SDPA's own enable_gqa gives the same result but runs far slower in bf16 on the CPU at long
        # contexts (README, How it works).
        rep = self.n_head // self.n_local_heads
        q = q.reshape(B, self.n_local_heads, rep * T, self.head_dim)
        if T == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
            y = decode_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, n_kv, rep * T, hd)
        # reshape, not view: CUDA's attention kernels return y in another memory layout.
        return self.wo(y.reshape(B, self.n_head, T, self.head_dim).transpose(1, 2).reshape(B, T, q_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Mixtral's sparse feed-forward: each token runs its top-k experts, weighted by the router.

    Subclasses (quantize's int8 / int4 experts) change how experts are stored and applied:
    `make_experts`, `expert`, `expert_weights`, and `gathers` (whether a compiled decode step can
    gather the selected experts' weights); routing and the paths below stay the same.
    """
    gathers = True

    def __init__(self, config: ModelArgs):
        super().__init__()
        E, D, I = config.num_experts, config.dim, config.intermediate_size
        self.top_k = config.num_activated_experts
        self.gate = nn.Linear(D, E, bias=False)
        self.make_experts(E, D, I)

    def make_experts(self, E: int, D: int, I: int):
        # Experts stacked so a token gathers only its selected experts' weights.
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w3 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def route(self, x: Tensor):
        """x: (N, D) -> weights, experts (N, k): softmax over all experts, top-k, renormalised (Mixtral)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (N, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), experts

    def expert(self, x: Tensor, e: int) -> Tensor:
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def expert_weights(self, experts: Tensor):
        """w1, w3 (N, k, I, D), w2 (N, k, D, I) of the selected experts; compiled, the gather fuses into the matmuls."""
        return self.w1[experts], self.w3[experts], self.w2[experts]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        weights, experts = self.route(x)
        E = self.num_experts
        if not torch.compiler.is_compiling():
            # Eager: each expert runs on the tokens routed to it (data-dependent shapes, no copies).
            out = torch.zeros_like(x)
            for e in range(E):
                token, slot = torch.where(experts == e)
                if len(token):  # CUDA's int4 kernel refuses an empty batch
                    out.index_add_(0, token, weights[token, slot, None] * self.expert(x[token], e))
            return out.reshape(shape)
        if self.gathers and x.shape[0] * self.top_k <= E:
            # Compiled decode: only the selected experts' weights are read.
            w1, w3, w2 = self.expert_weights(experts)
            h = F.silu(torch.einsum("nd,nkid->nki", x, w1)) * torch.einsum("nd,nkid->nki", x, w3)  # (N, k, I)
            y = torch.einsum("nki,nkdi->nkd", h, w2)  # (N, k, D)
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


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA for a few query rows, written as products and sums that inductor fuses into loops over
    the cache. In a compiled CPU decode step the SDPA op's fixed cost per layer is a visible part of
    a small quantized model's step; fused, it is gone."""
    scores = (q[..., :, None, :].float() * k[..., None, :, :].float()).sum(-1) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, rows, S)
    return (probs[..., None] * v[..., None, :, :].float()).sum(-2).to(q.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the reference implementations, then scale in the model dtype.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(head_dim: int, base: float, scaling: Optional[dict]) -> Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # LLaMA 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def precompute_rope(seq_len: int, head_dim: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """(seq_len, head_dim, 2) table of cos and sin, in the half-split layout of HF checkpoints."""
    inv_freq = rope_frequencies(head_dim, base, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (S, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hd)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # x: (B, T, nh, hd); rope: (T, hd, 2). Rotates dimension i with i + hd/2 (rotate_half).
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)
