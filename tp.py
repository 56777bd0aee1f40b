# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Tensor parallelism: shard a built single-device Transformer across torchrun's ranks.

Megatron's split, applied from outside the model: every rank keeps a slice of the attention heads
(query heads with their GQA key/value heads) and of the feed-forward hidden dimension (of every
expert, for MoE), so each layer needs two all-reduces per step, after the attention and after
the feed-forward. The vocab projection is split by rows and its logits all-gathered. Weights are
sliced in place and the collectives added as forward hooks, through functional collectives so
torch.compile(fullgraph=True) captures them.

    torchrun --standalone --nproc_per_node=2 generate.py --checkpoint_path checkpoints/X/model.pth

A script opts in with three lines (generate.py, eval.py): `dist = maybe_init_dist(device)` (None
outside torchrun), `load_model(..., tp=dist)` on `dist.device`, and `with rank0_output():` around
its main. Every rank then runs the same program on the same inputs: an all-reduce or all-gather
hands every rank the same bits, and all that runs after it is the same deterministic computation
on every rank, so the logits are identical and, with the same seed, so are the sampled tokens (no
broadcast of the token needed). A draft model for speculative decoding can be sharded the same way
or loaded whole on every rank (tp=None); a whole one computes the same drafts everywhere too.
"""
import atexit
import contextlib
import math
import os
from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from model import MoEFeedForward, Transformer
from quantize import GROUP_SIZES, Int4Linear, Int8Linear, QuantizedMoEFeedForward


class Dist(NamedTuple):
    rank: int
    world_size: int
    device: str  # this rank's device: cuda:LOCAL_RANK on GPUs


def maybe_init_dist(device: str) -> Optional[Dist]:
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU); None when not run by torchrun."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = torch.device(device).type
    if kind == "cuda":
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if local_world > torch.cuda.device_count():
            raise ValueError(f"launched with {local_world} ranks on this node but only {torch.cuda.device_count()} "
                             f"CUDA devices are visible; use --nproc_per_node={torch.cuda.device_count()} or fewer")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=torch.device(device))
    elif kind == "cpu":
        dist.init_process_group("gloo")
    else:
        raise ValueError(f"tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {kind}; pass --device cpu")
    atexit.register(dist.destroy_process_group)
    return Dist(rank, world_size, device)


@contextlib.contextmanager
def rank0_output():
    """Silence stdout and stderr on every torchrun rank but 0, so text and logs appear once."""
    if int(os.environ.get("RANK", "0")) == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def check_divisible(config, world_size: int):
    sizes = {"n_head": config.n_head, "n_local_heads (key/value heads)": config.n_local_heads,
             "intermediate_size" + (" (of each expert)" if config.num_experts else ""): config.intermediate_size}
    for name, size in sizes.items():
        if size % world_size:
            common = math.gcd(*sizes.values())
            valid = " or ".join(str(n) for n in range(1, common + 1) if common % n == 0)
            raise ValueError(f"{name} = {size} does not split across {world_size} tensor-parallel ranks; this model "
                             f"splits across {valid} ranks (--nnodes x --nproc_per_node)")


# Where each stored tensor of a linear layer keeps its (output, input) features; None: it has no such
# dim and stays whole. int4 packs two input columns per byte: its input splits fall on group bounds.
LINEAR_LAYOUTS = {
    nn.Linear: {"weight": (0, 1), "bias": (0, None)},
    Int8Linear: {"weight": (0, 1), "scales": (0, None), "bias": (0, None)},
    Int4Linear: {"weight": (0, 1), "scales_and_zeros": (1, 0), "bias": (0, None)},
}
# Stacked experts: the dim of the expert hidden size I in each tensor; the rest (w2's scales) stays whole.
MOE_LAYOUTS = {
    (MoEFeedForward, None): {"w1": 1, "w3": 1, "w2": 2},  # (E, I, D), (E, I, D), (E, D, I)
    (QuantizedMoEFeedForward, 8): {"w1": 1, "w1_scales": 1, "w3": 1, "w3_scales": 1, "w2": 2},
    (QuantizedMoEFeedForward, 4): {"w1": 1, "w1_scales_and_zeros": 2, "w3": 1, "w3_scales_and_zeros": 2,
                                   "w2": 2, "w2_scales_and_zeros": 1},  # (E, Kp/g, N, 2) scales
}


def apply_tp(model: Transformer, rank: int, world_size: int) -> Transformer:
    """Keep this rank's shard of every weight and add the collectives that join the shards.

    Call it before quantize.finalize_model (load_model(..., tp=...) does): it slices the stored
    layout, and on memory-mapped CPU weights, so only the shard is ever copied to the device.
    """
    c = model.config
    check_divisible(c, world_size)
    group = dist.group.WORLD
    shard = dict(rank=rank, world_size=world_size)
    for layer in model.layers:
        attn = layer.attention
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
        # Contiguous blocks of query heads and of kv heads: each rank's query heads keep their GQA kv heads.
        _shard_linear(attn.wqkv, "out", parts=[q_dim, kv_dim, kv_dim], **shard)
        _shard_linear(attn.wo, "in", **shard)
        attn.n_head, attn.n_local_heads = c.n_head // world_size, c.n_local_heads // world_size
        attn.register_forward_hook(_all_reduce_output(group))

        ff = layer.feed_forward
        if isinstance(ff, (MoEFeedForward, QuantizedMoEFeedForward)):
            _shard_experts(ff, **shard)  # the router (ff.gate) stays whole: every rank picks the same experts
        else:
            _shard_linear(ff.w1, "out", **shard)
            _shard_linear(ff.w3, "out", **shard)
            _shard_linear(ff.w2, "in", **shard)
        ff.register_forward_hook(_all_reduce_output(group))

    # The vocab projection is ~20% of a small model's bytes per token (SmolLM2, LLaMA-3.2-1B): split it
    # by rows and gather the logits. A tied tok_embeddings stays whole (a lookup reads only B*T rows),
    # so the output shard becomes its own Parameter, a view of the embedding's rows where it can be.
    _shard_linear(model.output, "out", pad=True, **shard)
    model.output.register_forward_hook(_all_gather_logits(group, c.vocab_size))

    # setup_caches sizes the KV cache from the config: it must describe this rank's shard.
    model.config = replace(c, n_head=c.n_head // world_size, n_local_heads=c.n_local_heads // world_size,
                           intermediate_size=c.intermediate_size // world_size)
    return model


def _shard_linear(linear: nn.Module, side: str, rank: int, world_size: int, parts=None, pad=False):
    """side "out": split the output features (no collective needed); "in": split the input features,
    leaving partial sums that an all-reduce adds up."""
    layout = LINEAR_LAYOUTS.get(type(linear))
    assert layout is not None, f"no tensor-parallel layout for {type(linear).__name__}"
    assert getattr(linear, "kernel", None) is None, "apply_tp slices the stored layout: call it before finalize"
    if side == "in" and isinstance(linear, Int4Linear):
        _check_int4_split(linear.in_features, linear.scales_and_zeros.shape[0], linear.groupsize, world_size)
    for name, (out_dim, in_dim) in layout.items():
        t = getattr(linear, name)
        dim = out_dim if side == "out" else in_dim
        if t is None or dim is None:
            assert t is None or name != "bias", "a bias on an input-split linear would be added once per rank"
            continue
        _replace(linear, name, _take(t, dim, rank, world_size, parts, pad))
    if side == "out":
        linear.out_features = -(-linear.out_features // world_size)  # padded up when pad=True
    else:
        linear.in_features //= world_size


def _shard_experts(ff: nn.Module, rank: int, world_size: int):
    bits = getattr(ff, "bits", None)
    assert not getattr(ff, "kernels", None), "apply_tp slices the stored layout: call it before finalize"
    if bits == 4:
        _check_int4_split(ff.w1.shape[1], ff.w2_scales_and_zeros.shape[1], ff.groupsize, world_size)
    for name, dim in MOE_LAYOUTS[type(ff), bits].items():
        _replace(ff, name, _take(getattr(ff, name), dim, rank, world_size))


def _check_int4_split(in_features: int, groups: int, groupsize: int, world_size: int):
    if groups * groupsize != in_features or groups % world_size:
        valid = [str(g) for g in GROUP_SIZES if in_features // world_size % g == 0]
        fix = f"re-quantize with --groupsize {' or '.join(valid)}" if valid else "use int8 or fewer ranks"
        raise ValueError(f"an int4 layer with {in_features} input features in groups of {groupsize} does not split "
                         f"into whole groups across {world_size} ranks; {fix}")


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
    # A row slice stays a view (of the mmap'd checkpoint, until it moves to the device); columns are copied.
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)).contiguous()


def _all_reduce_output(group):
    def hook(module, inputs, output: Tensor) -> Tensor:
        return funcol.all_reduce(output, "sum", group)
    return hook


def _all_gather_logits(group, vocab: int):
    def hook(module, inputs, logits: Tensor) -> Tensor:
        gathered = funcol.all_gather_single(logits, logits.dim() - 1, group)
        return gathered[..., :vocab]  # (B, T, vocab), the same on every rank
    return hook
