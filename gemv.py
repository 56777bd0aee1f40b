# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""One-row matrix products for GPU decode steps, in Triton: y [1, N] = x [1, K] @ W.T (* scales).

A batch-1 decode step is matrix-vector products, bound by reading the weights. Inductor turns a
compiled `F.linear` of one row into a reduction kernel of its own and fuses an int8 weight's cast
into it (`quantized.int8_matmul`); this kernel is the hand-written alternative: each program
reads BLOCK_N whole rows of W in BLOCK_K-wide slices (int8 or 16-bit, the weights streamed once
and evicted first), multiplies by x in fp32 registers, and sums each row once at the end. Its
tile sizes are autotuned per shape on the device, since no one size reads every shape fastest.

Requires triton (it comes with PyTorch's CUDA builds). Without a GPU the kernel runs in Triton's
interpreter (`TRITON_INTERPRET=1`), as the tests do.
"""
import functools
import inspect
import os
from typing import Optional

import torch
import torch.nn as nn
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

from quantized import Int8Linear

# (BLOCK_N, BLOCK_K, warps, stages). The fp32 accumulator [BLOCK_N, BLOCK_K] stays at 32-64
# registers a thread; a program keeps stages x BLOCK_N x BLOCK_K weight bytes in flight.
CONFIGS = [(2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 3), (8, 512, 4, 4), (8, 1024, 8, 3),
           (16, 256, 4, 4), (16, 512, 8, 3), (16, 1024, 8, 2), (32, 256, 8, 3), (32, 512, 8, 2)]


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, HAS_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows = tl.where(row_ok, rows, 0)  # the last program's spare rows read row 0: no mask on its loads
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=cols[None, :] < K, other=0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_SCALES:
        y = y * tl.load(s_ptr + rows).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def launch(kernel, x: Tensor, weight: Tensor, scales: Optional[Tensor], config: Optional[tuple] = None) -> Tensor:
    """Run `kernel` (gemv_kernel, or the autotuned one when config is None) into a new [1, N]."""
    N, K = weight.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    args = (x, weight, weight if scales is None else scales, y, N, K)
    flags = dict(HAS_SCALES=scales is not None)
    if config is None:
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
    else:
        block_n, block_k, warps, stages = config
        kernel[(triton.cdiv(N, block_n),)](*args, **flags, EVEN_K=K % block_k == 0, BLOCK_N=block_n,
                                           BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def check(x: Tensor, weight: Tensor, scales: Optional[Tensor]):
    if x.shape != (1, weight.shape[1]) or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"gemv takes a contiguous x [1, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if scales is not None and scales.shape != weight.shape[:1]:
        raise ValueError(f"gemv's scales must be [N] = [{weight.shape[0]}], got {tuple(scales.shape)}")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"  # as triton reads it


@functools.cache
def register():
    """Register torch.ops.brisk.gemv(x, weight, scales) (once; before a step that uses it is traced).

    A custom op that torch.compile keeps whole: the step calls it as it calls any ATen kernel, and
    its autotuning runs at its first call, in a CUDA-graph step's warm-up runs before the capture.
    """
    # A second run reads the timings from Triton's cache, where this triton keeps them (3.3 on).
    cached = dict(cache_results=True) if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    tuned = triton.autotune(
        configs=[triton.Config(dict(BLOCK_N=n, BLOCK_K=k), num_warps=w, num_stages=s) for n, k, w, s in CONFIGS],
        key=["N", "K"], **cached,
        # The interpreter (TRITON_INTERPRET=1, no GPU) has no device to time the configs on: one will do.
        prune_configs_by=dict(early_config_prune=lambda configs, *_, **__: configs[:1] if interpreting() else configs),
    )(triton.heuristics(dict(EVEN_K=lambda a: a["K"] % a["BLOCK_K"] == 0))(gemv_kernel))

    @torch.library.custom_op("brisk::gemv", mutates_args=())
    def gemv_op(x: Tensor, weight: Tensor, scales: Optional[Tensor]) -> Tensor:
        return launch(tuned, x, weight, scales)

    @gemv_op.register_fake
    def _(x, weight, scales):
        return x.new_empty(1, weight.shape[0])


def gemv(x: Tensor, weight: Tensor, scales: Optional[Tensor] = None) -> Tensor:
    """x [1, K] @ (weight [N, K] * scales [N, 1]).T -> [1, N] in x's dtype; weight int8 or x's dtype.
    Call register() first (outside a compiled region)."""
    check(x, weight, scales)
    return torch.ops.brisk.gemv(x, weight, scales)


class GemvLinear(nn.Module):
    """An nn.Linear whose one-row products are gemv's (the same weight and bias tensors)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() != x.shape[-1]:  # several rows (a prompt, a batch): the usual product
            return F.linear(x, self.weight, self.bias)
        y = gemv(x.reshape(1, -1).contiguous(), self.weight).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def use_gemv(model: nn.Module) -> nn.Module:
    """Route the model's one-row products through gemv, from outside as quantize.py does: 16-bit
    nn.Linear layers become GemvLinear, int8 layers on the GPU take the "gemv" kernel. In place."""
    register()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, GemvLinear(child))
            elif isinstance(child, Int8Linear) and child.kernel == "fused":
                child.kernel = "gemv"
    return model
