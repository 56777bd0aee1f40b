# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""fp32 products on the CPU that read each weight once for all the rows of a step (kernels.cpp).

    from kernels import pack_for_cpu
    model = pack_for_cpu(model)  # a CPU fp32 model: every nn.Linear -> PackedLinear, in place

A decode step of B streams multiplies B rows by every weight. PyTorch's products (MKL, oneDNN,
inductor's GEMM template) are tuned for other shapes and at 8 rows take 2-4x the time it takes
to read the weights from memory; kernels.cpp's take about that time (README, Benchmarks). The
packed weight replaces the original, so eager code, compiled graphs and a tied embedding all read
one copy. The C++ is built by torch's extension loader on first use (~30 s, cached after) and
picks AVX-512 or AVX2 at run time.
"""
import functools
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from load import log
from model import Transformer

@functools.cache
def extension():
    from torch.utils.cpp_extension import load
    log("kernels.cpp: building or loading the compiled extension (the first build takes ~30 s)")
    return load("brisk_kernels", [str(Path(__file__).with_name("kernels.cpp"))],
                extra_cflags=["-O3", "-fopenmp"], verbose=False)


@functools.cache
def best_isa() -> str:
    """"avx512", "avx2", or "" where kernels.cpp has nothing for this CPU or cannot be built
    (no C++ compiler: the model then runs PyTorch's own products)."""
    try:
        return extension().best_isa()
    except Exception as e:  # torch's loader raises several kinds for a missing or failing compiler
        reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
        log(f"kernels.cpp could not be built ({reason}); fp32 products stay PyTorch's")
        return ""


@functools.cache
def register_fake():
    """torch.ops.brisk.packed_linear (defined by kernels.cpp) with the shape function torch.compile traces."""
    extension()

    @torch.library.register_fake("brisk::packed_linear")
    def _(x, packed, out_features, isa):
        return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """nn.Linear over a weight packed [N / 32, K, 32] by kernels.cpp (bias, if any, added after)."""

    def __init__(self, linear: nn.Linear, isa: str):
        super().__init__()
        register_fake()  # before any call, which may be inside torch.compile's tracing
        self.in_features, self.out_features, self.isa = linear.in_features, linear.out_features, isa
        self.register_buffer("packed", extension().pack(linear.weight.detach()))
        self.bias = linear.bias
        self._forward_pre_hooks, self._forward_hooks = linear._forward_pre_hooks, linear._forward_hooks  # tp.py's

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.brisk.packed_linear(x, self.packed, self.out_features, self.isa)
        return y if self.bias is None else y + self.bias


class PackedEmbedding(nn.Module):
    """The embedding tied to a packed output projection: rows gathered from the packed weight."""

    def __init__(self, output: PackedLinear):
        super().__init__()
        self.packed = output.packed  # the same tensor: one copy

    def forward(self, idx: Tensor) -> Tensor:
        block = self.packed.shape[-1]  # output columns per packed block
        return self.packed.transpose(1, 2)[idx // block, idx % block]


def can_pack(model: Transformer) -> bool:
    """A CPU model in fp32 on a CPU kernels.cpp has code for."""
    w = model.norm.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and best_isa() != ""


def pack_for_cpu(model: Transformer) -> Transformer:
    """What the command lines call after loading: the model packed where kernels.cpp serves it."""
    return pack_linears(model) if can_pack(model) else model


def pack_linears(model: Transformer, isa: Optional[str] = None) -> Transformer:
    """Every fp32 nn.Linear of the model -> PackedLinear (in place); isa None: the CPU's best."""
    isa = isa or best_isa()
    tied = model.output.weight is model.tok_embeddings.weight
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, child_name, PackedLinear(child, isa))
    if tied and isinstance(model.output, PackedLinear):
        model.tok_embeddings = PackedEmbedding(model.output)
    # load_model maps the checkpoint file into memory, and the mapping stays while any tensor of it
    # lives: copy out the few left (norms, an untied embedding) so that the file's pages, the
    # unpacked weights among them, leave the process.
    with torch.no_grad():
        for module in model.modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None and t.device.type == "cpu" and not name.endswith("_cache"):
                    t.data = t.data.clone()
    return model
