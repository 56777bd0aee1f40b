# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Rotary position embeddings: the frequency rules of each family's `rope_scaling`, the cos / sin
table model.py keeps per cache, and its application to q and k.

Tables stay in fp32: bf16 angles lose whole positions past a few thousand tokens.
"""
import math
from typing import Optional

import torch
from torch import Tensor

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")


def rope_type(scaling: Optional[dict]) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_frequencies(rope_dim: int, base: float, scaling: Optional[dict], seq_len: int = 0) -> Tensor:
    """Inverse frequencies (rope_dim / 2,) in fp64. seq_len matters to longrope only (see below)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    kind = rope_type(scaling)
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
    if kind == "longrope":
        # Phi-3 128k: per-frequency divisors, the long set once the sequence outgrows the
        # original context. transformers switches by the current length; a static cache cannot
        # re-rotate the keys it holds, so brisk chooses once per cache from its length (as
        # llama.cpp does from n_ctx): equal to transformers while everything fits the original context.
        long = seq_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        return inv_freq / factors
    if kind == "yarn":
        # YaRN (Qwen3 and gpt-oss long contexts, DeepSeek): frequencies that turn fewer than beta_slow
        # times over the original context are interpolated (divided by `factor`), those that turn more
        # than beta_fast times are kept, with a linear ramp between the two (in dimension index).
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

        def dim_of(turns):  # the (fractional) dimension index whose frequency turns `turns` times over old_len
            return rope_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low or 0.001)).clamp(0, 1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)
    if kind == "proportional":
        # Gemma 4's global layers: the first partial_rotary_factor of the head's pairs turn at the whole
        # head's frequencies, the others not at all (partial rotary that keeps the full head's schedule).
        turning = int(scaling["partial_rotary_factor"] * rope_dim // 2)
        inv_freq = torch.cat([inv_freq[:turning], torch.zeros(rope_dim // 2 - turning, dtype=torch.float64)])
        return inv_freq / scaling.get("factor", 1.0)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """What longrope and YaRN multiply cos and sin by, so attention logits keep their scale at long contexts."""
    kind = rope_type(scaling)
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    if kind == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):  # DeepSeek's form
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


def precompute_rope(seq_len: int, rope_dim: int, base: float, scaling: Optional[dict] = None) -> Tensor:
    """(seq_len, rope_dim, 2) table of cos and sin, in the half-split layout of HF checkpoints."""
    inv_freq = rope_frequencies(rope_dim, base, scaling, seq_len)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (S, rd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, rd)
    return (torch.stack([angles.cos(), angles.sin()], dim=-1) * rope_attention_factor(scaling)).float()


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    # x: (B, T, nh, hd); rope: (T, rd, 2), or (B, T, rd, 2) for per-row positions, with rd <= hd.
    # Rotates dimension i with i + rd/2 (rotate_half); partial rotary (rd < hd) leaves the last
    # hd - rd dimensions as they are.
    rd = rope.shape[-2]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], rope), x[..., rd:]], dim=-1)
    rope = rope.expand(x.shape[0], *rope.shape[-3:])  # (B, T, rd, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)
