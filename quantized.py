# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""The modules of an int8 / int4 quantized model: storage format, kernels, and how they load.

int8: symmetric, one scale per output channel. int4: asymmetric, a scale and a zero point per
group of `groupsize` input channels, dequantized as (q - 8) * scale + zero like PyTorch's int4
kernels. A checkpoint (written by quantize.py or GPTQ.py) is {"quantization": metadata,
"state_dict": ...}; the metadata names every module and what was done to it, and load.py reads
it (never the file name): `prepare_model` swaps in empty quantized modules before loading,
`finalize_model` picks each one's kernel for the device after.

The file holds a device-independent layout (int8 rows; int4 as two nibbles per byte, the input
of CUDA's packing op) that `finalize` repacks for the device's kernel: kernels.cpp's on a CPU it
has code for ("packed"), PyTorch's CPU int8/int4 pack-mm ops, its CUDA int4 op, or a plain
dequantize + F.linear where none applies (MPS, shapes the kernels refuse).

Each module also says what other files need to know about it, so they need not know its class:
`tp_layout` (where its stored tensors keep their output and input features, for tp.py) and
`inductor_hints` (which of inductor's kernels suit it, for compiling.py).
"""
import math
import sys
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

import kernels
from model import ModelArgs, MoEFeedForward, Transformer

FORMAT_VERSION = 1
GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's int4 kernels accept
# The CPU pack-mm kernels are fast only with bf16 activations and scales, and CUDA's int4 kernel
# takes bf16 only: activations are cast around them.
KERNEL_DTYPE = torch.bfloat16

# ---------------------------------------------------------------------------------------------
# Quantizing one weight matrix

def bf16_at_least(x: Tensor) -> Tensor:
    """The smallest bf16 value >= x, so that a grid built on a stored scale still covers the weights."""
    b = x.to(torch.bfloat16)
    return torch.where(b.float() < x, torch.nextafter(b, torch.full_like(b, math.inf)), b)


def quantize_int8(w: Tensor) -> tuple:
    """w [N, K] -> (int8 q [N, K], bf16 scales [N]) with w ~= q * scales[:, None], |error| <= scale / 2."""
    w = w.float()
    scales = bf16_at_least(w.abs().amax(dim=1).clamp(min=1e-8) / 127)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales.float()[..., None]


def padded_size(in_features: int, groupsize: int) -> int:
    return -(-in_features // groupsize) * groupsize


def quantize_int4(w: Tensor, groupsize: int, symmetric: bool = False) -> tuple:
    """w [N, K] -> (uint8 packed [N, Kp/2], bf16 scales_and_zeros [Kp/g, N, 2]), Kp = K padded to g.

    Per group: w ~= (q - 8) * scale + zero with q in 0..15 and |error| <= scale / 2. Columns added
    by padding are zero (the matching activations are zero-padded too). Byte k//2 holds column k in
    its high nibble when k is even. symmetric: every zero is 0 (llama.cpp's Q4_0 grid), a coarser
    grid whose zeros kernels.py need not store: 4.5 bits a weight instead of 5.
    """
    N, K = w.shape
    w = F.pad(w.float(), (0, padded_size(K, groupsize) - K))
    groups = w.reshape(N, -1, groupsize)  # (N, G, g)
    scales, zeros = (int4_symmetric_params if symmetric else int4_group_params)(groups)  # (N, G) each
    q = int4_codes(groups, scales[..., None], zeros[..., None]).reshape(N, -1)  # (N, Kp)
    return pack_int4_codes(q), torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def int4_group_params(groups: Tensor) -> tuple:
    """groups [..., g] -> bf16 (scales, zeros) [...] of a grid (q - 8) * scale + zero covering each group."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    # The zero sits at q = 8: round it to bf16 first, then widen the step until the grid
    # zero - 8 * scale .. zero + 7 * scale still covers [lo, hi] despite that rounding.
    zeros = (lo + 8 * (hi - lo) / 15).to(torch.bfloat16)
    z = zeros.float()
    scales = bf16_at_least(torch.maximum((z - lo) / 8, (hi - z) / 7).clamp(min=1e-8))
    return scales, zeros


def int4_symmetric_params(groups: Tensor) -> tuple:
    """groups [..., g] -> bf16 (scales, zeros = 0) [...] of a grid (q - 8) * scale covering each group."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = bf16_at_least(torch.maximum(-lo / 8, hi / 7).clamp(min=1e-8))
    return scales, torch.zeros_like(scales)


def int4_codes(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """The nearest codes 0..15 (uint8) of w on the grid (q - 8) * scales + zeros (broadcast against w)."""
    return (torch.round((w - zeros.float()) / scales.float()) + 8).clamp(0, 15).to(torch.uint8)


def pack_int4_codes(q: Tensor) -> Tensor:
    """Codes 0..15 [N, Kp] -> uint8 [N, Kp/2], column k in the high nibble of byte k//2 when k is even."""
    return q[:, ::2] << 4 | q[:, 1::2]


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., N, K/2] -> integers 0..15 [..., N, K] (uint8)."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)


def pack_stored_int4(stored: Tensor, isa: str, rows: int = 4096) -> Tensor:
    """kernels.pack_int4's weight of the stored codes (uint8 [N, Kp / 2]), unpacked and packed
    `rows` rows at a time into the result: unpacked whole, an output projection of 50 MB held
    250 MB more at once, the highest point of a first start's memory."""
    N, half = stored.shape
    n = 4 if isa in kernels.INTEGER_ISAS else 1
    packed = torch.empty(-(-N // kernels.BLOCK), 2 * half // n, kernels.BLOCK // 2, n, dtype=torch.uint8)
    for i in range(0, N, rows):  # rows: whole blocks of BLOCK
        kernels.pack_int4_weight(unpack_int4(stored[i:i + rows]), isa,
                                 out=packed[i // kernels.BLOCK:(i + rows) // kernels.BLOCK])
    return packed.flatten(-2) if n == 1 else packed


def dequantize_int4(packed: Tensor, scales_and_zeros: Tensor, groupsize: int) -> Tensor:
    """The fp32 weight [N, Kp] of the portable int4 layout."""
    q = unpack_int4(packed).float()
    N, K = q.shape
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (N, G) each
    return ((q.reshape(N, -1, groupsize) - 8) * scales[..., None] + zeros[..., None]).reshape(N, K)


# ---------------------------------------------------------------------------------------------
# Matrix products: the device's kernel, or dequantize + F.linear

def int8_matmul(x: Tensor, weight: Tensor, scales: Tensor, kernel: str) -> Tensor:
    """x [M, K] @ (weight * scales).T -> [M, N] in x's dtype."""
    if kernel == "cpu":
        return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE).contiguous(), weight, scales).to(x.dtype)
    if kernel == "gemv" and x.shape[0] == 1:  # gemv.use_gemv (a GPU): its Triton kernel, one row
        return torch.ops.brisk.gemv(x.contiguous(), weight, scales)
    # gpt-fast's form: torch.compile fuses the cast into the matmul on CUDA.
    return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)


def int4_matmul(x: Tensor, weight: Tensor, scales_and_zeros: Tensor, groupsize: int, kernel: str) -> Tensor:
    """x [M, K] @ dequantized weight [N, Kp].T -> [M, N] in x's dtype; x is zero-padded to Kp."""
    padded = scales_and_zeros.shape[-3] * groupsize
    xp = F.pad(x, (0, padded - x.shape[-1])) if x.shape[-1] != padded else x
    if kernel == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp.to(KERNEL_DTYPE).contiguous(), weight, groupsize,
                                                       scales_and_zeros)
    elif kernel == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(xp.to(KERNEL_DTYPE).contiguous(), weight, groupsize,
                                               scales_and_zeros)
    else:
        return F.linear(xp, dequantize_int4(weight, scales_and_zeros, groupsize).to(x.dtype))
    return y.to(x.dtype)


def int8_kernel(device: torch.device, in_features: int, packable: bool = True) -> str:
    """packable: the layer can take kernels.cpp's packed layout (a stack of experts cannot)."""
    if device.type == "cpu" and packable and kernels.best_isa():
        return "packed"
    if device.type == "cuda":
        return "fused"  # int8_matmul's form, which a compiled step fuses into one product
    # ATen's CPU kernel needs in_features % 16 == 0: otherwise it returns garbage or crashes.
    return "cpu" if device.type == "cpu" and in_features % 16 == 0 else "dequant"


def int4_kernel(device: torch.device, out_features: int, packable: bool = True) -> str:
    if device.type == "cpu" and packable and kernels.best_isa():
        return "packed"
    if device.type == "cpu" and out_features % 16 == 0:
        return "cpu"
    if device.type == "cuda" and out_features % 8 == 0 and torch.cuda.get_device_capability(device) >= (8, 0):
        return "cuda"
    return "dequant"


def pack_int4(packed: Tensor, kernel: str) -> Tensor:
    """The portable layout [..., N, Kp/2] repacked for `kernel` (stacked experts packed one by one)."""
    if packed.dim() == 3:
        return torch.stack([pack_int4(p, kernel) for p in packed])
    if kernel == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed).int(), 2)
    if kernel == "cuda":
        # K must split into innerKTiles tiles of 16; Kp is a multiple of 32, so 2 always fits.
        inner_k_tiles = next(t for t in (8, 4, 2) if packed.shape[1] * 2 % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), inner_k_tiles)
    return packed


# ---------------------------------------------------------------------------------------------
# Modules swapped into the model

def check_int4_split(in_features: int, groups: int, groupsize: int, world_size: int):
    """int4 packs two input columns per byte in groups: an input split must fall on group bounds."""
    if groups * groupsize != in_features or groups % world_size:
        valid = [str(g) for g in GROUP_SIZES if in_features // world_size % g == 0]
        fix = f"re-quantize with --groupsize {' or '.join(valid)}" if valid else "use int8 or fewer ranks"
        raise ValueError(f"an int4 layer with {in_features} input features in groups of {groupsize} does not split "
                         f"into whole groups across {world_size} ranks; {fix}")


class Int8Linear(nn.Module):
    """y = x @ (weight * scales[:, None]).T + bias with an int8 weight [out, in]."""

    # tp.py: the (output, input) feature dims of each stored tensor; None: no such dim, kept whole.
    tp_layout = {"weight": (0, 1), "scales": (0, None), "bias": (0, None)}

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.kernel = None  # set by finalize()

    @property
    def finalized(self) -> bool:
        return self.kernel is not None

    @property
    def inductor_hints(self) -> dict:
        """compiling.py: inductor's int8 template reads these faster than ATen's kernel, which
        max-autotune would otherwise pick; the C++ wrapper is slower around inductor's own kernels."""
        return kernels.INDUCTOR_HINTS if self.kernel == "packed" else {"gemm_backends": ("CPP",), "cpp_wrapper": False}

    def finalize(self, device: torch.device, precision: torch.dtype):
        self.kernel = int8_kernel(device, self.in_features)
        if self.kernel == "packed":
            self.isa = kernels.best_isa()
            kernels.register_fake()
            stored = self.weight
            self.weight, self.scales = kernels.pack_int8(stored, self.scales, self.isa)
            kernels.release_pages(stored)
        else:
            self.scales = self.scales.to(KERNEL_DTYPE if self.kernel == "cpu" else precision)

    def concat(self, other: "Int8Linear") -> Optional["Int8Linear"]:
        """kernels.fuse_feed_forwards: one layer for self's and other's outputs (the same input),
        where both are packed by kernels.cpp and self's outputs fill whole blocks of 32."""
        if not packed_side_by_side(self, other):
            return None
        with torch.device("meta"):
            fused = Int8Linear(self.in_features, self.out_features + other.out_features, bias=False)
        fused.weight, fused.scales = torch.cat([self.weight, other.weight]), torch.cat([self.scales, other.scales])
        fused.kernel, fused.isa = "packed", self.isa
        return fused

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "packed":
            y = torch.ops.brisk.packed_linear_int8(x.float(), self.weight, self.scales, self.out_features,
                                                   kernels.ISA_CODES[self.isa]).to(x.dtype)
        else:
            y = int8_matmul(x.reshape(-1, self.in_features), self.weight, self.scales, self.kernel)
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W stored as 4-bit groups of `groupsize` input channels (see quantize_int4)."""

    tp_layout = {"weight": (0, 1), "scales_and_zeros": (1, 0), "bias": (0, None)}

    def __init__(self, in_features: int, out_features: int, bias: bool, groupsize: int, padded_in_features: int):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.register_buffer("weight", torch.empty(out_features, padded_in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(padded_in_features // groupsize, out_features, 2,
                                                             dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.kernel = None  # set by finalize(), which also repacks the weight for that kernel

    @property
    def finalized(self) -> bool:
        return self.kernel is not None

    def check_tp_split(self, side: str, world_size: int):
        if side == "in":
            check_int4_split(self.in_features, self.scales_and_zeros.shape[0], self.groupsize, world_size)

    @property
    def inductor_hints(self) -> dict:
        """Some int4 shapes have no template: ATen's kernel stays a candidate."""
        return kernels.INDUCTOR_HINTS if self.kernel == "packed" else {"gemm_backends": ("CPP", "ATEN"),
                                                                        "cpp_wrapper": False}

    def finalize(self, device: torch.device, precision: torch.dtype):
        assert self.kernel is None, "finalize() repacks the weight: call it once"
        self.kernel = int4_kernel(device, self.out_features)
        if self.kernel == "packed":
            self.isa = kernels.best_isa()
            kernels.register_fake()
            stored = self.weight
            self.weight = pack_stored_int4(stored, self.isa)
            self.scales_and_zeros = kernels.pack_int4_scales(self.scales_and_zeros)
            kernels.release_pages(stored)
            return
        self.weight = pack_int4(self.weight, self.kernel)
        self.scales_and_zeros = self.scales_and_zeros.to(precision if self.kernel == "dequant" else KERNEL_DTYPE)

    def concat(self, other: "Int4Linear") -> Optional["Int4Linear"]:
        """As Int8Linear.concat (the same groups of input features)."""
        if not packed_side_by_side(self, other) or other.groupsize != self.groupsize \
                or other.scales_and_zeros.shape[1:] != self.scales_and_zeros.shape[1:]:
            return None
        padded_in_features = self.scales_and_zeros.shape[1] * self.groupsize  # packed [N / 32, groups, 2, 32]
        with torch.device("meta"):
            fused = Int4Linear(self.in_features, self.out_features + other.out_features, False, self.groupsize,
                               padded_in_features)
        fused.weight = torch.cat([self.weight, other.weight])
        fused.scales_and_zeros = torch.cat([self.scales_and_zeros, other.scales_and_zeros])
        fused.kernel, fused.isa = "packed", self.isa
        return fused

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "packed":
            y = torch.ops.brisk.packed_linear_int4(x.float(), self.weight, self.scales_and_zeros, self.out_features,
                                                   kernels.ISA_CODES[self.isa]).to(x.dtype)
        else:
            y = int4_matmul(x.reshape(-1, self.in_features), self.weight, self.scales_and_zeros, self.groupsize,
                            self.kernel)
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def packed_side_by_side(a: nn.Module, b: nn.Module) -> bool:
    """Whether two quantized layers packed by kernels.cpp for one ISA can be one (kernels.concatenable)."""
    return a.kernel == b.kernel == "packed" and a.isa == b.isa and kernels.concatenable(a, b, a.weight, b.weight)


class Int8Embedding(nn.Module):
    """Rows of an int8 table times one scale per row; the scales follow the model's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.bfloat16))

    def finalize(self, device: torch.device, precision: torch.dtype):
        self.scales = self.scales.to(precision)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight).to(self.scales.dtype) * F.embedding(idx, self.scales[:, None])


class QuantizedMoEFeedForward(MoEFeedForward):
    """MoEFeedForward with int8 or int4 experts (w1, w3: [E, I, D], w2: [E, D, I]) and a full-precision router."""

    def __init__(self, config: ModelArgs, bits: int, groupsize: Optional[int] = None,
                 padded_in_features: Optional[dict] = None):
        # Plain attributes, set before nn.Module's init because MoEFeedForward's calls make_experts.
        self.bits, self.groupsize, self.padded_in_features = bits, groupsize, padded_in_features
        super().__init__(config)
        self.kernels = {}  # projection name -> kernel, set by finalize()
        # tp.py: the dim of the expert hidden size I in each tensor; w2's int8 scales (E, D) stay whole.
        self.tp_layout = ({"w1": 1, "w1_scales": 1, "w3": 1, "w3_scales": 1, "w2": 2} if bits == 8 else
                          {"w1": 1, "w1_scales_and_zeros": 2, "w3": 1, "w3_scales_and_zeros": 2,
                           "w2": 2, "w2_scales_and_zeros": 1})
        # (compiling.py compiles every mixture-of-experts step without autotuning: inductor's
        # templates misread experts that are slices of one stacked tensor.)
        self.inductor_hints = {"cpp_wrapper": False}

    def make_experts(self, E: int, D: int, I: int):
        for name, (n, k) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            if self.bits == 8:
                self.register_buffer(name, torch.empty(E, n, k, dtype=torch.int8))
                self.register_buffer(f"{name}_scales", torch.empty(E, n, dtype=torch.bfloat16))
            else:
                kp = self.padded_in_features[name]
                self.register_buffer(name, torch.empty(E, n, kp // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scales_and_zeros",
                                     torch.empty(E, kp // self.groupsize, n, 2, dtype=torch.bfloat16))

    @property
    def gathers(self) -> bool:
        return self.bits == 8  # the int4 kernels' packed layout cannot be gathered per token

    @property
    def finalized(self) -> bool:
        return bool(self.kernels)

    def check_tp_split(self, side: str, world_size: int):
        if self.bits == 4:  # w2's input is the split hidden size
            check_int4_split(self.w1.shape[1], self.w2_scales_and_zeros.shape[1], self.groupsize, world_size)

    def finalize(self, device: torch.device, precision: torch.dtype):
        assert not self.kernels, "finalize() repacks the weights: call it once"
        for name in ("w1", "w3", "w2"):
            if self.bits == 8:
                kernel = int8_kernel(device, getattr(self, name).shape[2], packable=False)
                suffix = "_scales"
            else:
                kernel = int4_kernel(device, getattr(self, name).shape[1], packable=False)
                setattr(self, name, pack_int4(getattr(self, name), kernel))
                suffix = "_scales_and_zeros"
            self.kernels[name] = kernel
            scales = getattr(self, name + suffix)
            setattr(self, name + suffix, scales.to(precision if kernel in ("dequant", "fused") else KERNEL_DTYPE))

    def linear(self, x: Tensor, name: str, e) -> Tensor:
        """x [M, in] through projection `name` of expert e."""
        if self.bits == 8:
            y = int8_matmul(x, getattr(self, name)[e], getattr(self, f"{name}_scales")[e], self.kernels[name])
        else:
            y = int4_matmul(x, getattr(self, name)[e], getattr(self, f"{name}_scales_and_zeros")[e], self.groupsize,
                            self.kernels[name])
        bias = getattr(self, f"{name}_bias")
        return y if bias is None else y + bias[e]

    def expert_weights(self, experts: Tensor):
        """int8: the selected experts' weights, dequantized; compiled, gather and scaling fuse into the matmuls."""
        dtype = self.gate.weight.dtype
        return tuple(getattr(self, n)[experts].to(dtype) * getattr(self, n + "_scales")[experts][..., None].to(dtype)
                     for n in ("w1", "w3", "w2"))


class TiedEmbedding(nn.Module):
    """The token embedding of a tied model whose output projection is quantized: the output's rows,
    dequantized, so that the matrix is held once, as in the full-precision model (quantize.py
    writes it once). Where kernels.cpp packed the output whole, rows are gathered from its packed
    weight (kernels.cpp); elsewhere from the stored layout, which this module keeps whole (`tie`):
    the output's own tensors where its kernel reads that layout too (int8 everywhere, int4
    dequantized), a 4-bit copy beside them where the output is repacked for ATen's int4 kernels or
    is one tensor-parallel rank's shard."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits = self.groupsize = self.packed_weight = self.packed_scales = None
        self.dtype = torch.float32

    def tie(self, output: nn.Module):
        """After load_state_dict: hold the output's stored tensors (non-persistent: the checkpoint
        has them once, under output.*), which to_device then moves as one with the output's."""
        assert isinstance(output, (Int8Linear, Int4Linear)) and not output.finalized
        self.bits = 8 if isinstance(output, Int8Linear) else 4
        self.groupsize = getattr(output, "groupsize", None)
        self.register_buffer("weight", output.weight, persistent=False)
        scales = "scales" if self.bits == 8 else "scales_and_zeros"
        self.register_buffer(scales, getattr(output, scales), persistent=False)

    def finalize(self, output: nn.Module, precision: torch.dtype):
        """After the output's finalize: read its packed weight where it is the whole vocabulary."""
        self.dtype = precision
        if output.kernel == "packed" and output.out_features == self.num_embeddings:
            self.packed_weight = output.weight  # plain attributes, as PackedEmbedding's: one copy
            self.packed_scales = output.scales if self.bits == 8 else output.scales_and_zeros
            for name in list(self._buffers):
                self._buffers[name] = None  # the stored layout, mapped: let go

    def forward(self, idx: Tensor) -> Tensor:
        if self.packed_weight is not None:
            op = torch.ops.brisk.packed_embedding_int8 if self.bits == 8 else torch.ops.brisk.packed_embedding_int4
            return op(idx, self.packed_weight, self.packed_scales, self.embedding_dim).to(self.dtype)
        if self.bits == 8:
            return dequantize_int8(self.weight[idx], self.scales[idx]).to(self.dtype)
        ids = idx.reshape(-1)  # the gathered rows alone, dequantized as the output's weight is
        rows = dequantize_int4(self.weight[ids], self.scales_and_zeros[:, ids], self.groupsize)
        return rows[:, :self.embedding_dim].reshape(*idx.shape, -1).to(self.dtype)


def tie_embedding(model: Transformer) -> None:
    """load.build_model, after load_state_dict: a TiedEmbedding holds the output's stored tensors."""
    if isinstance(model.tok_embeddings, TiedEmbedding):
        model.tok_embeddings.tie(model.output)


QUANTIZED = (Int8Linear, Int4Linear, Int8Embedding, QuantizedMoEFeedForward)


# ---------------------------------------------------------------------------------------------
# Loader hooks (load.load_model)

def quantized_module(module: nn.Module, spec: dict, config: ModelArgs) -> nn.Module:
    """The empty quantized replacement of `module` described by its metadata entry."""
    kind = spec["kind"]
    if isinstance(module, nn.Linear) and kind == "int8":
        return Int8Linear(module.in_features, module.out_features, module.bias is not None)
    if isinstance(module, nn.Linear) and kind == "int4":
        return Int4Linear(module.in_features, module.out_features, module.bias is not None, spec["groupsize"],
                          spec["padded_in_features"])
    if isinstance(module, nn.Embedding) and kind == "int8":
        return Int8Embedding(module.num_embeddings, module.embedding_dim)
    if isinstance(module, nn.Embedding) and kind == "tied":
        return TiedEmbedding(module.num_embeddings, module.embedding_dim)
    if isinstance(module, MoEFeedForward) and kind in ("int8", "int4"):
        return QuantizedMoEFeedForward(config, 8 if kind == "int8" else 4, spec.get("groupsize"),
                                       spec.get("padded_in_features"))
    raise ValueError(f"the checkpoint's quantization metadata asks for {kind!r} on a {type(module).__name__}; "
                     "it was written by another version of quantize.py: re-quantize the model")


def prepare_model(model: Transformer, quantization: dict) -> None:
    """Swap in the quantized modules the metadata lists (on the meta device, before load_state_dict)."""
    if quantization.get("format") != FORMAT_VERSION:
        raise ValueError(f"quantized checkpoint format {quantization.get('format')!r} is not supported by this "
                         f"quantize.py (format {FORMAT_VERSION}); re-quantize the model")
    device = next(model.parameters()).device
    for name, spec in quantization["layers"].items():
        if spec["kind"] == "none":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        with torch.device(device):
            setattr(parent, attr, quantized_module(getattr(parent, attr), spec, model.config))


def finalize_model(model: Transformer, quantization: dict, device, precision: torch.dtype) -> None:
    """After model.to(device, precision): pick each module's kernel, repack int4 for it, set scale dtypes."""
    device = torch.device(device)
    slow = []
    for name, module in model.named_modules():
        if isinstance(module, QUANTIZED):
            module.finalize(device, precision)
            kernels.trim_heap()  # what repacking freed, before the next layer's
            if "dequant" in (getattr(module, "kernel", None), *getattr(module, "kernels", {}).values()):
                slow.append(name)
    if isinstance(model.tok_embeddings, TiedEmbedding):
        model.tok_embeddings.finalize(model.output, precision)
    if slow:
        print(f"quantize: {len(slow)} layers have no {quantization['mode']} kernel on {device.type} for their "
              f"shape and dequantize on every call (slower): {', '.join(slow[:5])}{' ...' if len(slow) > 5 else ''}",
              file=sys.stderr)
