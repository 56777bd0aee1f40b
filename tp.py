# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Tensor parallelism: shard a built single-device Transformer across torchrun's ranks.

Megatron's split, applied from outside the model: every rank keeps a slice of the attention heads
(query heads with their GQA key/value heads; with DeepSeek's latent attention, a whole latent) and
of the feed-forward hidden dimension (of every expert, for MoE), so each layer needs two all-reduces
per step, after the attention and after the feed-forward. The vocab projection is split by rows and its logits all-gathered. Weights are
sliced in place and the collectives added as forward hooks, through functional collectives so
torch.compile(fullgraph=True) captures them.

    torchrun --standalone --nproc_per_node=2 generate.py --checkpoint_path checkpoints/X/model.pth

A script opts in with three lines of load.py (generate.py, eval.py, server.py): `device, dtype, dist =
placement(device, precision)` (dist None outside torchrun; the device this rank's),
`load_model(..., tp=dist)`, and `with rank0_output():` around its main. Every rank then runs the same program on the same inputs: an all-reduce or all-gather
hands every rank the same bits, and all that runs after it is the same deterministic computation
on every rank, so the logits are identical and, with the same seed, so are the sampled tokens (no
broadcast of the token needed). A draft model for speculative decoding can be sharded the same way
or loaded whole on every rank (tp=None); a whole one computes the same drafts everywhere too.
"""
import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from linear_attention import GatedDeltaNet, ShortConv
from model import LatentAttention, MoEFeedForward, Transformer

# Where the model's own layers keep their (output, input) features in each stored tensor; None: no
# such dim, kept whole. Modules that store weights otherwise (quantized.py's) declare `tp_layout`.
LINEAR_LAYOUT = {"weight": (0, 1), "bias": (0, None)}
# Stacked experts: the dim of the expert hidden size I in each tensor.
MOE_LAYOUT = {"w1": 1, "w3": 1, "w2": 2}  # (E, I, D), (E, I, D), (E, D, I)


def check_divisible(config, world_size: int):
    sizes = {"n_head": config.n_head}
    if not config.kv_lora_rank:  # (latent attention's one latent stays whole on every rank)
        sizes["n_local_heads (key/value heads)"] = config.n_local_heads
    if config.linear_attention_layers and config.linear_attention == "gated_deltanet":
        sizes["linear_key_heads (of Gated DeltaNet)"] = config.linear_key_heads
    if config.linear_attention_layers and config.linear_attention == "short_conv":
        sizes["dim (LFM2's convolution channels)"] = config.dim
    if config.global_kv_heads:
        sizes["global_kv_heads (key/value heads of the full-attention layers)"] = config.global_kv_heads
    if not config.num_experts or config.dense_layers:
        sizes["intermediate_size"] = config.intermediate_size
    if config.num_experts:
        sizes["moe_intermediate_size (of each expert)"] = config.moe_intermediate_size
    if config.shared_expert_size:
        sizes["shared_expert_size"] = config.shared_expert_size
    for name, size in sizes.items():
        if size % world_size:
            common = math.gcd(*sizes.values())
            valid = " or ".join(str(n) for n in range(1, common + 1) if common % n == 0)
            raise ValueError(f"{name} = {size} does not split across {world_size} tensor-parallel ranks; this model "
                             f"splits across {valid} ranks (--nnodes x --nproc_per_node)")


def apply_tp(model: Transformer, rank: int, world_size: int) -> Transformer:
    """Keep this rank's shard of every weight and add the collectives that join the shards.

    Call it before quantized.finalize_model (load.load_model(..., tp=...) does): it slices the stored
    layout, and on memory-mapped CPU weights, so only the shard is ever copied to the device.
    """
    c = model.config
    check_divisible(c, world_size)
    group = dist.group.WORLD
    shard = dict(rank=rank, world_size=world_size)
    for layer in model.layers:
        attn = layer.attention
        if isinstance(attn, LatentAttention):
            _shard_latent_attention(attn, **shard)
        elif isinstance(attn, GatedDeltaNet):
            _shard_linear_attention(attn, **shard)
        elif isinstance(attn, ShortConv):
            _shard_short_conv(attn, **shard)
        else:
            _shard_attention(attn, c.qk_norm, group, **shard)
        attn.register_forward_hook(_all_reduce_output(group))
        for ff in (layer.feed_forward, layer.experts):  # (experts: Gemma 4's 26B, beside the dense feed-forward)
            if ff is not None:
                _shard_feed_forward(ff, group, **shard)

    # The vocab projection is a large share of a small model's bytes per token: split it
    # by rows and gather the logits. A tied tok_embeddings stays whole (a lookup reads only B*T rows),
    # so the output shard becomes its own Parameter, a view of the embedding's rows where it can be.
    _shard_linear(model.output, "out", pad=True, **shard)
    model.output.register_forward_hook(_all_gather_logits(group, c.vocab_size))

    # setup_caches sizes the KV cache from the config: it must describe this rank's shard.
    model.config = replace(c, n_head=c.n_head // world_size,
                           n_local_heads=c.n_local_heads if c.kv_lora_rank else c.n_local_heads // world_size,
                           global_kv_heads=c.global_kv_heads // world_size if c.global_kv_heads else None,
                           intermediate_size=c.intermediate_size // world_size,
                           moe_intermediate_size=c.moe_intermediate_size // world_size if c.num_experts else None,
                           linear_key_heads=c.linear_key_heads // world_size,
                           linear_value_heads=c.linear_value_heads // world_size)
    return model


def _shard_feed_forward(ff: nn.Module, group, rank: int, world_size: int):
    shard = dict(rank=rank, world_size=world_size)
    if isinstance(ff, MoEFeedForward):
        _shard_experts(ff, **shard)  # the router (ff.gate) stays whole: every rank picks the same experts
        if ff.shared_expert is not None:  # split as a dense feed-forward; its gate (one output) stays whole
            _shard_linear(ff.shared_expert.w1, "out", **shard)
            _shard_linear(ff.shared_expert.w3, "out", **shard)
            _shard_linear(ff.shared_expert.w2, "in", **shard)
    else:
        _shard_linear(ff.w1, "out", **shard)
        _shard_linear(ff.w3, "out", **shard)
        _shard_linear(ff.w2, "in", **shard)
    ff.register_forward_hook(_all_reduce_output(group))


def _shard_attention(attn: nn.Module, qk_norm, group, rank: int, world_size: int):
    shard = dict(rank=rank, world_size=world_size)
    q_dim, kv_dim = attn.n_head * attn.head_dim, attn.n_local_heads * attn.head_dim
    # Contiguous blocks of query heads and of kv heads: each rank's query heads keep their GQA kv heads.
    kv_parts = 0 if attn.reads_kv else 1 if attn.values_are_keys else 2  # (Gemma 4)
    gate = [attn.gate_dim] if attn.gate_dim else []  # (Qwen3.5's per query output, LFM3's per head; last)
    _shard_linear(attn.wqkv, "out", parts=[q_dim] + [kv_dim] * kv_parts + gate, **shard)
    _shard_linear(attn.wo, "in", **shard)
    if attn.sinks is not None:  # gpt-oss: one per query head, which split by blocks as wqkv's rows
        _replace(attn, "sinks", _take(attn.sinks, 0, rank, world_size))
    attn.n_head, attn.n_local_heads = attn.n_head // world_size, attn.n_local_heads // world_size
    attn.gate_dim //= world_size
    if qk_norm == "all":  # OLMo 2 normalises q (k) over all heads, which now span the ranks
        attn.q_norm = ShardedRMSNorm(attn.q_norm, group, **shard)
        attn.k_norm = ShardedRMSNorm(attn.k_norm, group, **shard)


def _shard_latent_attention(attn: LatentAttention, rank: int, world_size: int):
    """Each rank keeps a block of the heads: their queries, their slices of the latent's up-projections
    and of the output; the latent and its RoPE key (and the query bottleneck) are computed whole
    by every rank, so each rank's cache holds the same latent."""
    shard = dict(rank=rank, world_size=world_size)
    _shard_linear(attn.wq_b if hasattr(attn, "wq_b") else attn.wq, "out", **shard)
    for name in ("wk_b", "wv_b"):
        _replace(attn, name, _take(getattr(attn, name), 0, rank, world_size))
    _shard_linear(attn.wo, "in", **shard)
    attn.n_head //= world_size


def _shard_linear_attention(attn: GatedDeltaNet, rank: int, world_size: int):
    """Each rank keeps a block of Gated DeltaNet's key heads and the value heads they serve: their rows
    of each kind in the input projection and the convolution, their decay parameters, their columns of
    the output (all-reduced as attention's); its state holds those heads only."""
    shard = dict(rank=rank, world_size=world_size)
    keys, values, heads = attn.key_heads * attn.key_dim, attn.value_heads * attn.value_dim, attn.value_heads
    _shard_linear(attn.w_in, "out", parts=[keys, keys, values, values, heads, heads], **shard)
    _replace(attn, "conv", _take(attn.conv, 0, rank, world_size, parts=[keys, keys, values]))
    for name in ("A_log", "dt_bias"):
        _replace(attn, name, _take(getattr(attn, name), 0, rank, world_size))
    _shard_linear(attn.wo, "in", **shard)
    attn.key_heads, attn.value_heads = attn.key_heads // world_size, attn.value_heads // world_size
    attn.channels //= world_size


def _shard_short_conv(conv: ShortConv, rank: int, world_size: int):
    """LFM2's convolution is per channel: each rank keeps a block of channels, their rows of B, C and x
    in the input projection and of the convolution, their columns of the output (all-reduced)."""
    shard = dict(rank=rank, world_size=world_size)
    _shard_linear(conv.w_in, "out", parts=[conv.dim] * 3, **shard)
    _replace(conv, "conv", _take(conv.conv, 0, rank, world_size))
    _shard_linear(conv.wo, "in", **shard)
    conv.dim //= world_size


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over features split across the ranks (OLMo 2's q/k norm over every head): the
    mean of squares is summed over the ranks, the weight is this rank's slice."""

    def __init__(self, norm: nn.Module, group, rank: int, world_size: int):
        super().__init__()
        self.eps, self.offset, self.group = norm.eps, norm.offset, group
        self.full_dim = norm.weight.shape[0]
        self.weight = nn.Parameter(_take(norm.weight.detach(), 0, rank, world_size))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        sum_sq = funcol.all_reduce(xf.pow(2).sum(-1, keepdim=True), "sum", self.group)
        normed = xf * torch.rsqrt(sum_sq / self.full_dim + self.eps)
        return (normed * (self.offset + self.weight.float())).type_as(x) if self.offset else \
            normed.type_as(x) * self.weight


def _shard_linear(linear: nn.Module, side: str, rank: int, world_size: int, parts=None, pad=False):
    """side "out": split the output features (no collective needed); "in": split the input features,
    leaving partial sums that an all-reduce adds up."""
    assert not getattr(linear, "finalized", False), "apply_tp slices the stored layout: call it before finalize"
    if hasattr(linear, "check_tp_split"):
        linear.check_tp_split(side, world_size)
    for name, (out_dim, in_dim) in getattr(linear, "tp_layout", LINEAR_LAYOUT).items():
        t = getattr(linear, name)
        dim = out_dim if side == "out" else in_dim
        if t is not None and name == "bias" and side == "in":  # gpt-oss's o_proj: added once, by rank 0
            _replace(linear, name, t if rank == 0 else torch.zeros_like(t))
            continue
        if t is None or dim is None:
            continue
        _replace(linear, name, _take(t, dim, rank, world_size, parts, pad))
    if side == "out":
        linear.out_features = -(-linear.out_features // world_size)  # padded up when pad=True
    else:
        linear.in_features //= world_size


def _shard_experts(ff: nn.Module, rank: int, world_size: int):
    assert not getattr(ff, "finalized", False), "apply_tp slices the stored layout: call it before finalize"
    if hasattr(ff, "check_tp_split"):
        ff.check_tp_split("in", world_size)
    for name, dim in getattr(ff, "tp_layout", MOE_LAYOUT).items():
        _replace(ff, name, _take(getattr(ff, name), dim, rank, world_size))
    if ff.w1_bias is not None:  # gpt-oss: the gate and up biases split with I; down's is added once, by rank 0
        for name in ("w1_bias", "w3_bias"):
            _replace(ff, name, _take(getattr(ff, name), 1, rank, world_size))
        _replace(ff, "w2_bias", ff.w2_bias if rank == 0 else torch.zeros_like(ff.w2_bias))


def _replace(module: nn.Module, name: str, t: Tensor):
    setattr(module, name, nn.Parameter(t) if isinstance(getattr(module, name), nn.Parameter) else t)


def _take(t: Tensor, dim: int, rank: int, world_size: int, parts=None, pad: bool = False) -> Tensor:
    """This rank's 1/world_size of each of `parts` (sizes along dim; default: the whole), contiguous.

    pad: zero-pad to a multiple of world_size first (the vocab); the padding lands at the end.
    """
    if pad and t.shape[dim] % world_size:
        widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, -t.shape[dim] % world_size]
        t = nn.functional.pad(t, widths)
    pieces = t.split(parts or [t.shape[dim]], dim=dim)
    for p in pieces:
        assert p.shape[dim] % world_size == 0, (t.shape, dim, parts, world_size)
    chunks = [p.chunk(world_size, dim=dim)[rank] for p in pieces]
    # Copied, also a row slice that could stay a view: a shard that owns its storage from offset 0.
    # (inductor's frozen GEMM template reads a weight that is a view at an offset from the wrong
    # place; the copy is the shard's size, which the device needs anyway.)
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)).clone(memory_format=torch.contiguous_format)


def _all_reduce_output(group):
    def hook(module, inputs, output: Tensor) -> Tensor:
        return funcol.all_reduce(output, "sum", group)
    return hook


def _all_gather_logits(group, vocab: int):
    def hook(module, inputs, logits: Tensor) -> Tensor:
        gathered = funcol.all_gather_single(logits, logits.dim() - 1, group)
        return gathered[..., :vocab]  # (B, T, vocab), the same on every rank
    return hook
