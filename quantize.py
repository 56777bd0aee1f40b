# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Weight-only int8 / int4 quantization of a brisk checkpoint, applied to the model from outside.

    python quantize.py --checkpoint_path checkpoints/X/model.pth --mode int8
    python quantize.py --checkpoint_path checkpoints/X/model.pth --mode int4 --groupsize 32

int8: symmetric, one scale per output channel. int4: asymmetric, a scale and a zero point per
group of `groupsize` input channels, dequantized as (q - 8) * scale + zero like PyTorch's int4
kernels. Every linear layer is quantized, the output projection included; the token embedding
becomes int8 (one scale per row), which also unties a tied output projection. A mixture-of-
experts feed-forward quantizes its experts and keeps its small router in full precision.

The file holds a device-independent layout (int8 rows; int4 as two nibbles per byte, the input
of CUDA's packing op) and `finalize_model` repacks it at load time for the device's kernel:
PyTorch's CPU int8/int4 pack-mm ops, its CUDA int4 op, or a plain dequantize + F.linear where
neither applies (MPS, shapes the kernels refuse). The checkpoint is
{"quantization": metadata, "state_dict": ...}; the metadata names every module and what was done
to it, and generate.load_model reads it (never the file name).
"""
import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from model import ModelArgs, MoEFeedForward, Transformer

FORMAT_VERSION = 1
# Each mode fills one of the layouts below; "int4-gptq" (GPTQ.py) writes the same int4 layout with
# integers chosen against calibration data, so loading needs nothing new.
MODES = ("int8", "int4", "int4-gptq")
GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's int4 kernels accept
DEFAULT_GROUPSIZE = 32
# The CPU pack-mm kernels are fast only with bf16 activations and scales (5-12x slower in fp32),
# and CUDA's int4 kernel takes bf16 only: activations are cast around them.
KERNEL_DTYPE = torch.bfloat16
ROUTER_NOTE = "expert router: tiny, and expert choice is sensitive to it (llama.cpp keeps it too)"


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


def quantize_int4(w: Tensor, groupsize: int) -> tuple:
    """w [N, K] -> (uint8 packed [N, Kp/2], bf16 scales_and_zeros [Kp/g, N, 2]), Kp = K padded to g.

    Per group: w ~= (q - 8) * scale + zero with q in 0..15 and |error| <= scale / 2. Columns added
    by padding are zero (the matching activations are zero-padded too). Byte k//2 holds column k in
    its high nibble when k is even.
    """
    N, K = w.shape
    w = F.pad(w.float(), (0, padded_size(K, groupsize) - K))
    groups = w.reshape(N, -1, groupsize)  # (N, G, g)
    scales, zeros = int4_group_params(groups)  # (N, G) each
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


def int4_codes(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """The nearest codes 0..15 (uint8) of w on the grid (q - 8) * scales + zeros (broadcast against w)."""
    return (torch.round((w - zeros.float()) / scales.float()) + 8).clamp(0, 15).to(torch.uint8)


def pack_int4_codes(q: Tensor) -> Tensor:
    """Codes 0..15 [N, Kp] -> uint8 [N, Kp/2], column k in the high nibble of byte k//2 when k is even."""
    return q[:, ::2] << 4 | q[:, 1::2]


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., N, K/2] -> integers 0..15 [..., N, K] (uint8)."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)


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


def int8_kernel(device: torch.device, in_features: int) -> str:
    # The CPU kernel needs in_features % 16 == 0: otherwise it returns garbage or crashes (torch 2.13).
    return "cpu" if device.type == "cpu" and in_features % 16 == 0 else "dequant"


def int4_kernel(device: torch.device, out_features: int) -> str:
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

class Int8Linear(nn.Module):
    """y = x @ (weight * scales[:, None]).T + bias with an int8 weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.kernel = None  # set by finalize()

    def finalize(self, device: torch.device, precision: torch.dtype):
        self.kernel = int8_kernel(device, self.in_features)
        self.scales = self.scales.to(KERNEL_DTYPE if self.kernel == "cpu" else precision)

    def forward(self, x: Tensor) -> Tensor:
        y = int8_matmul(x.reshape(-1, self.in_features), self.weight, self.scales, self.kernel)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W stored as 4-bit groups of `groupsize` input channels (see quantize_int4)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, groupsize: int, padded_in_features: int):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.register_buffer("weight", torch.empty(out_features, padded_in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(padded_in_features // groupsize, out_features, 2,
                                                             dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.kernel = None  # set by finalize(), which also repacks the weight for that kernel

    def finalize(self, device: torch.device, precision: torch.dtype):
        assert self.kernel is None, "finalize() repacks the weight: call it once"
        self.kernel = int4_kernel(device, self.out_features)
        self.weight = pack_int4(self.weight, self.kernel)
        self.scales_and_zeros = self.scales_and_zeros.to(precision if self.kernel == "dequant" else KERNEL_DTYPE)

    def forward(self, x: Tensor) -> Tensor:
        y = int4_matmul(x.reshape(-1, self.in_features), self.weight, self.scales_and_zeros, self.groupsize,
                        self.kernel)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


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


class QuantizedMoEFeedForward(nn.Module):
    """MoEFeedForward with int8 or int4 experts (w1, w3: [E, I, D], w2: [E, D, I]) and a full-precision router."""

    def __init__(self, config: ModelArgs, bits: int, groupsize: Optional[int] = None,
                 padded_in_features: Optional[dict] = None):
        super().__init__()
        E, D, I = config.num_experts, config.dim, config.intermediate_size
        self.top_k, self.num_experts, self.bits, self.groupsize = config.num_activated_experts, E, bits, groupsize
        self.gate = nn.Linear(D, E, bias=False)
        self.kernels = {}  # projection name -> kernel, set by finalize()
        for name, (n, k) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            if bits == 8:
                self.register_buffer(name, torch.empty(E, n, k, dtype=torch.int8))
                self.register_buffer(f"{name}_scales", torch.empty(E, n, dtype=torch.bfloat16))
            else:
                kp = padded_in_features[name]
                self.register_buffer(name, torch.empty(E, n, kp // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scales_and_zeros",
                                     torch.empty(E, kp // groupsize, n, 2, dtype=torch.bfloat16))

    def finalize(self, device: torch.device, precision: torch.dtype):
        assert not self.kernels, "finalize() repacks the weights: call it once"
        for name in ("w1", "w3", "w2"):
            if self.bits == 8:
                kernel = int8_kernel(device, getattr(self, name).shape[2])
                suffix = "_scales"
            else:
                kernel = int4_kernel(device, getattr(self, name).shape[1])
                setattr(self, name, pack_int4(getattr(self, name), kernel))
                suffix = "_scales_and_zeros"
            self.kernels[name] = kernel
            scales = getattr(self, name + suffix)
            setattr(self, name + suffix, scales.to(precision if kernel == "dequant" else KERNEL_DTYPE))

    def linear(self, x: Tensor, name: str, e) -> Tensor:
        """x [M, in] through projection `name` of expert e."""
        if self.bits == 8:
            return int8_matmul(x, getattr(self, name)[e], getattr(self, f"{name}_scales")[e], self.kernels[name])
        return int4_matmul(x, getattr(self, name)[e], getattr(self, f"{name}_scales_and_zeros")[e], self.groupsize,
                           self.kernels[name])

    def expert(self, x: Tensor, e: int) -> Tensor:
        return self.linear(F.silu(self.linear(x, "w1", e)) * self.linear(x, "w3", e), "w2", e)

    def expert_weights(self, experts: Tensor):
        """int8: the selected experts' weights, dequantized; compiled, gather and scaling fuse into the matmuls."""
        dtype = self.gate.weight.dtype
        return tuple(getattr(self, n)[experts].to(dtype) * getattr(self, n + "_scales")[experts][..., None].to(dtype)
                     for n in ("w1", "w3", "w2"))

    # Routing and the eager / compiled paths are MoEFeedForward's: only the expert weights differ.
    route = MoEFeedForward.route
    all_experts = MoEFeedForward.all_experts

    def forward(self, x: Tensor) -> Tensor:
        if self.bits == 4 and torch.compiler.is_compiling():
            # The int4 kernels' packed layout cannot be gathered per token: every expert runs.
            weights, experts = self.route(x.reshape(-1, x.shape[-1]))
            return self.all_experts(x.reshape(-1, x.shape[-1]), weights, experts).reshape(x.shape)
        return MoEFeedForward.forward(self, x)


QUANTIZED = (Int8Linear, Int4Linear, Int8Embedding, QuantizedMoEFeedForward)


# ---------------------------------------------------------------------------------------------
# Loader hooks (generate.load_model)

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
            if "dequant" in (getattr(module, "kernel", None), *getattr(module, "kernels", {}).values()):
                slow.append(name)
    if slow:
        print(f"quantize: {len(slow)} layers have no {quantization['mode']} kernel on {device.type} for their "
              f"shape and dequantize on every call (slower): {', '.join(slow[:5])}{' ...' if len(slow) > 5 else ''}",
              file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Quantizing a checkpoint

def output_name(checkpoint_path: Path, mode: str, groupsize: Optional[int]) -> Path:
    suffix = f"_{mode}.pth" if groupsize is None else f"_{mode}.g{groupsize}.pth"
    return checkpoint_path.with_name(checkpoint_path.stem + suffix)


def check_options(mode: str, groupsize: Optional[int]) -> Optional[int]:
    """The effective group size (None for int8), or a ValueError naming the valid choices."""
    if mode not in MODES:
        raise ValueError(f"unknown --mode {mode!r}; valid modes: {', '.join(MODES)}")
    if mode == "int8":
        if groupsize is not None:
            raise ValueError("--groupsize applies to int4 only (int8 has one scale per output channel)")
        return None
    groupsize = DEFAULT_GROUPSIZE if groupsize is None else groupsize
    if groupsize not in GROUP_SIZES:
        raise ValueError(f"--groupsize {groupsize} is not supported by the int4 kernels; use one of "
                         f"{', '.join(map(str, GROUP_SIZES))}")
    return groupsize


def quantize_state_dict(state_dict: dict, config: ModelArgs, mode: str, groupsize: Optional[int],
                        log=lambda *a: None) -> tuple:
    """(quantized state dict, per-module metadata), one weight at a time so memory stays near one copy."""
    with torch.device("meta"):
        model = Transformer(config)
    weights = dict(state_dict)
    if config.tie_embeddings and "output.weight" not in weights:
        weights["output.weight"] = weights["tok_embeddings.weight"]  # quantized apart: untied
    routers = {f"{n}.gate" for n, m in model.named_modules() if isinstance(m, MoEFeedForward)}
    todo = [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding, MoEFeedForward)) and n not in routers]
    out, layers = {}, {name: {"kind": "none", "reason": ROUTER_NOTE} for name in sorted(routers)}
    t0 = time.perf_counter()
    for i, (name, module) in enumerate(todo, 1):
        kind = "int8" if isinstance(module, nn.Embedding) else mode
        scales = "scales" if kind == "int8" else "scales_and_zeros"
        if isinstance(module, MoEFeedForward):  # stacked experts: "w1" -> "w1_scales"
            keys = {f"{name}.{p}": f"{name}.{p}_{scales}" for p in ("w1", "w3", "w2")}
        else:
            keys = {f"{name}.weight": f"{name}.{scales}"}
        spec, errors, padded, notes = {"kind": kind}, [], {}, []
        for key, scales_key in keys.items():
            w = weights.pop(key)
            out[key], out[scales_key], err = quantize_weight(w, kind, groupsize)
            errors.append(err)
            if kind == "int4":
                proj, k = key.rpartition(".")[2], w.shape[-1]
                padded[proj] = padded_size(k, groupsize)
                if padded[proj] != k:
                    notes.append(f"in_features {k} padded to {padded[proj]}")
        if kind == "int4":
            spec.update(groupsize=groupsize, padded_in_features=padded.get("weight", padded))
        layers[name] = spec
        label = kind + (f" g{groupsize}" if kind == "int4" else "")
        detail = "; ".join(["x".join(map(str, w.shape)), *sorted(set(notes))])
        log(f"[{i:3d}/{len(todo)}] {name:32s} {label:8s} relative error {max(errors):.4f}  ({detail})")
    out.update(weights)  # what is left (norms, biases, routers) is kept as it is
    log(f"quantized {len(todo)} modules in {time.perf_counter() - t0:.1f} s")
    return out, layers


def quantize_weight(w: Tensor, kind: str, groupsize: Optional[int]) -> tuple:
    """w [N, K], or stacked experts [E, N, K] -> (weight, scales or scales_and_zeros, relative error)."""
    if w.dim() == 3:
        parts = [quantize_weight(we, kind, groupsize) for we in w]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), max(p[2] for p in parts)
    if kind == "int8":
        q, s = quantize_int8(w)
        return q, s, rel_error(w, dequantize_int8(q, s))
    q, s = quantize_int4(w, groupsize)
    return q, s, rel_error(w, dequantize_int4(q, s, groupsize)[:, :w.shape[1]])


def rel_error(w: Tensor, approx: Tensor) -> float:
    """||W - W_q|| / ||W||, a per-layer sanity figure printed as progress."""
    w = w.float()
    return float((w - approx).norm() / w.norm().clamp(min=1e-12))


def quantize_checkpoint(checkpoint_path, mode: str, groupsize: Optional[int] = None,
                        output_path: Optional[Path] = None, log=lambda *a: None, **gptq_options) -> Path:
    """Quantize model.pth (with config.json beside it) into model_int8.pth / model_int4.gN.pth.

    int4-gptq takes its calibration and GPTQ settings as keyword arguments (GPTQ.quantize_state_dict's).
    """
    from scripts.convert_hf_checkpoint import atomic_save

    groupsize = check_options(mode, groupsize)
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint_path} not found; convert one with "
                                "scripts/convert_hf_checkpoint.py first")
    config_path = checkpoint_path.parent / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: the converters write it beside model.pth")
    config = ModelArgs.from_json(config_path)
    state_dict = torch.load(checkpoint_path, mmap=True, weights_only=True, map_location="cpu")
    if "quantization" in state_dict:
        raise ValueError(f"{checkpoint_path} is already quantized ({state_dict['quantization']['mode']}); "
                         "quantize the full-precision model.pth instead")
    metadata = {"format": FORMAT_VERSION, "mode": mode, "bits": 8 if mode == "int8" else 4, "groupsize": groupsize}
    if mode == "int4-gptq":
        import GPTQ  # only GPTQ needs it (and the tokenizer)
        sd, layers, metadata["gptq"] = GPTQ.quantize_state_dict(state_dict, config, checkpoint_path.parent, groupsize,
                                                                log=log, **gptq_options)
    else:
        if gptq_options:
            raise ValueError(f"--{sorted(gptq_options)[0]} applies to --mode int4-gptq only")
        sd, layers = quantize_state_dict(state_dict, config, mode, groupsize, log)
    metadata["layers"] = layers
    check_loadable(config, metadata, sd)
    output_path = Path(output_path) if output_path else output_name(checkpoint_path, mode, groupsize)
    atomic_save({"quantization": metadata, "state_dict": sd}, output_path)
    return output_path


def check_loadable(config: ModelArgs, metadata: dict, state_dict: dict) -> None:
    """The state dict matches, key for key and shape for shape, what prepare_model builds."""
    with torch.device("meta"):
        model = Transformer(config)
    prepare_model(model, metadata)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    got = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    assert set(expected) == set(got), f"state dict keys differ: {sorted(set(expected) ^ set(got))[:5]}"
    bad = [k for k in expected if expected[k][0] != got[k][0]
           or (not expected[k][1].is_floating_point and expected[k][1] != got[k][1])]
    assert not bad, f"state dict shapes or dtypes differ: {bad[:5]}"


def main(checkpoint_path: Path, mode: str, groupsize: Optional[int], **gptq_options):
    def log(*args):
        print(*args, file=sys.stderr, flush=True)

    # Options left unset take GPTQ.py's defaults (and are errors with the other modes).
    gptq_options = {k: v for k, v in gptq_options.items() if v not in (None, False)}
    output = quantize_checkpoint(checkpoint_path, mode, groupsize, log=log, **gptq_options)
    log(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB; {checkpoint_path.stat().st_size / 1e6:.1f} MB before)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Weight-only int8 / int4 quantization of a brisk checkpoint; writes "
                                            "model_int8.pth or model_int4.gN.pth beside it.")
    p.add_argument("--checkpoint_path", type=Path, required=True,
                   help="the full-precision model.pth (config.json beside it)")
    p.add_argument("--mode", choices=MODES, required=True,
                   help="int8: per-channel symmetric; int4: group-wise asymmetric (smaller, faster, less exact)")
    p.add_argument("--groupsize", type=int, choices=GROUP_SIZES, default=None,
                   help=f"int4 only: input channels sharing a scale and zero (default {DEFAULT_GROUPSIZE}); "
                        "smaller is more exact")
    import GPTQ  # its defaults; imported here because it imports this file

    g = p.add_argument_group("int4-gptq", "GPTQ (GPTQ.py): int4 weights fitted to calibration text")
    g.add_argument("--calibration_file", type=Path, default=None,
                   help="a local text file to calibrate on (a few hundred KB of text like what the model will see)")
    g.add_argument("--calibration_tasks", nargs="+", default=None,
                   help="lm_eval tasks whose documents to calibrate on instead (e.g. wikitext; downloads their data)")
    g.add_argument("--calibration_limit", type=int, default=None,
                   help=f"calibration sequences, sampled at random offsets (default {GPTQ.DEFAULT_CALIBRATION_LIMIT})")
    g.add_argument("--calibration_seq_length", type=int, default=None, help=f"tokens per sequence (default {GPTQ.DEFAULT_CALIBRATION_SEQ_LENGTH}, or the "
                        "model's context if shorter)")
    g.add_argument("--seed", type=int, default=None, help=f"seed of the sequence sampling (default {GPTQ.DEFAULT_SEED})")
    g.add_argument("--percdamp", type=float, default=None,
                   help=f"dampening added to the Hessian's diagonal, as a fraction of its mean (default {GPTQ.DEFAULT_PERCDAMP})")
    g.add_argument("--blocksize", type=int, default=None, help=f"columns per lazy batch update (default {GPTQ.DEFAULT_BLOCKSIZE})")
    g.add_argument("--act_order", action="store_true",
                   help="quantize the most active input channels first (often better; same file layout)")
    g.add_argument("--device", default=None, help="where GPTQ runs (default: cuda if available, else cpu)")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    try:
        main(**vars(args))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
