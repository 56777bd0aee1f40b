# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Weight-only int8 / int4 quantization of a brisk checkpoint (round to nearest; GPTQ.py for int4-gptq).

    python quantize.py --checkpoint_path checkpoints/X/model.pth --mode int8
    python quantize.py --checkpoint_path checkpoints/X/model.pth --mode int4 --groupsize 32
    python quantize.py --checkpoint_path checkpoints/X/model.pth --mode int4-sym   # Q4_0's grid, 4.5 bits

Every linear layer is quantized, the output projection included. The token embedding of a tied
model is the quantized output's rows (stored once, as the full-precision model stores them); an
untied one becomes int8, one scale per row. A mixture-of-experts
feed-forward quantizes its experts and keeps its small router in full precision. The format,
the kernels and the modules that load it are quantized.py's.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

import GPTQ
from errors import SEED, check_output_file, error_boundary, finite_float, int_in, positive_int
from load import atomic_save, check_state_dict, checkpoint_config, read_checkpoint, with_tied_output
from model import ModelArgs, MoEFeedForward, Transformer
from quantized import (FORMAT_VERSION, GROUP_SIZES, dequantize_int4, dequantize_int8, padded_size, prepare_model,
                       quantize_int4, quantize_int8)

# Each mode fills one of quantized.py's layouts; "int4-gptq" (GPTQ.py) writes the same int4 layout
# with integers chosen against calibration data, and "int4-sym" with every zero 0 (llama.cpp's
# Q4_0 grid: less exact, and kernels.py packs its scales alone, ~10% fewer bytes to read), so
# loading needs nothing new.
MODES = ("int8", "int4", "int4-sym", "int4-gptq")
DEFAULT_GROUPSIZE = 32
ROUTER_NOTE = "expert router: tiny, and expert choice is sensitive to it (llama.cpp keeps it too)"

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
    weights = dict(with_tied_output(state_dict, config))  # the output projection is quantized apart: untied
    routers = {f"{n}.{gate}" for n, m in model.named_modules() if isinstance(m, MoEFeedForward)
               for gate in ("gate", "shared_gate") if getattr(m, gate) is not None}
    todo = [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding, MoEFeedForward)) and n not in routers]
    out, layers = {}, {name: {"kind": "none", "reason": ROUTER_NOTE} for name in sorted(routers)}
    if config.tie_embeddings:  # the embedding reads the quantized output's rows: the matrix is stored once
        todo = [(n, m) for n, m in todo if n != "tok_embeddings"]
        del weights["tok_embeddings.weight"]
        layers["tok_embeddings"] = {"kind": "tied"}
    t0 = time.perf_counter()
    for i, (name, module) in enumerate(todo, 1):
        kind = "int8" if isinstance(module, nn.Embedding) else mode.removesuffix("-sym")
        scales = "scales" if kind == "int8" else "scales_and_zeros"
        if isinstance(module, MoEFeedForward):  # stacked experts: "w1" -> "w1_scales"
            keys = {f"{name}.{p}": f"{name}.{p}_{scales}" for p in ("w1", "w3", "w2")}
        else:
            keys = {f"{name}.weight": f"{name}.{scales}"}
        spec, errors, padded, notes = {"kind": kind}, [], {}, []
        for key, scales_key in keys.items():
            w = weights.pop(key)
            out[key], out[scales_key], err = quantize_weight(w, kind, groupsize, symmetric=mode == "int4-sym")
            errors.append(err)
            if kind == "int4":
                proj, k = key.rpartition(".")[2], w.shape[-1]
                padded[proj] = padded_size(k, groupsize)
                if padded[proj] != k:
                    notes.append(f"in_features {k} padded to {padded[proj]}")
        if kind == "int4":
            spec.update(groupsize=groupsize, padded_in_features=padded.get("weight", padded))
        layers[name] = spec
        label = (mode if kind == "int4" else kind) + (f" g{groupsize}" if kind == "int4" else "")
        detail = "; ".join(["x".join(map(str, w.shape)), *sorted(set(notes))])
        log(f"[{i:3d}/{len(todo)}] {name:32s} {label:8s} relative error {max(errors):.4f}  ({detail})")
    out.update(weights)  # what is left (norms, biases, routers) is kept as it is
    log(f"quantized {len(todo)} modules in {time.perf_counter() - t0:.1f} s")
    return out, layers


def quantize_weight(w: Tensor, kind: str, groupsize: Optional[int], symmetric: bool = False) -> tuple:
    """w [N, K], or stacked experts [E, N, K] -> (weight, scales or scales_and_zeros, relative error)."""
    if w.dim() == 3:
        parts = [quantize_weight(we, kind, groupsize, symmetric) for we in w]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), max(p[2] for p in parts)
    if kind == "int8":
        q, s = quantize_int8(w)
        return q, s, rel_error(w, dequantize_int8(q, s))
    q, s = quantize_int4(w, groupsize, symmetric)
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
    groupsize = check_options(mode, groupsize)
    if mode != "int4-gptq" and gptq_options:
        raise ValueError(f"--{sorted(gptq_options)[0]} applies to --mode int4-gptq only")
    checkpoint_path = Path(checkpoint_path)
    config = checkpoint_config(checkpoint_path)
    output_path = Path(output_path) if output_path else output_name(checkpoint_path, mode, groupsize)
    check_output_file(output_path, "output")  # before the minutes of quantizing
    state_dict, quantization = read_checkpoint(checkpoint_path)
    if quantization is not None:
        raise ValueError(f"{checkpoint_path} is already quantized ({quantization.get('mode')}); "
                         "quantize the full-precision model.pth instead")
    with torch.device("meta"):
        check_state_dict(Transformer(config), with_tied_output(state_dict, config), checkpoint_path)
    metadata = {"format": FORMAT_VERSION, "mode": mode, "bits": 8 if mode == "int8" else 4, "groupsize": groupsize}
    if mode == "int4-gptq":
        sd, layers, metadata["gptq"] = GPTQ.quantize_state_dict(state_dict, config, checkpoint_path.parent, groupsize,
                                                                log=log, **gptq_options)
    else:
        sd, layers = quantize_state_dict(state_dict, config, mode, groupsize, log)
    metadata["layers"] = layers
    check_loadable(config, metadata, sd)
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

    # Options left unset take GPTQ.py's defaults (and are errors with the other modes). `is`, not
    # `in (None, False)`: 0 == False, and a 0 given by the user must reach the check that refuses it.
    gptq_options = {k: v for k, v in gptq_options.items() if v is not None and v is not False}
    output = quantize_checkpoint(checkpoint_path, mode, groupsize, log=log, **gptq_options)
    log(f"wrote {output} ({output.stat().st_size / 1e6:.1f} MB; {checkpoint_path.stat().st_size / 1e6:.1f} MB before)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Weight-only int8 / int4 quantization of a brisk checkpoint; writes "
                                            "model_int8.pth or model_int4.gN.pth beside it.")
    p.add_argument("--checkpoint_path", type=Path, required=True,
                   help="the full-precision model.pth (config.json beside it)")
    p.add_argument("--mode", choices=MODES, required=True,
                   help="int8: per-channel symmetric; int4: group-wise asymmetric (smaller, faster, less exact); "
                        "int4-sym: group-wise symmetric, llama.cpp's Q4_0 grid (10%% fewer bytes than int4, "
                        "less exact); int4-gptq: int4 fitted to calibration text")
    p.add_argument("--groupsize", type=int, choices=GROUP_SIZES, default=None,
                   help=f"int4 modes only: input channels sharing a scale and zero (default {DEFAULT_GROUPSIZE}); "
                        "smaller is more exact")

    g = p.add_argument_group("int4-gptq", "GPTQ (GPTQ.py): int4 weights fitted to calibration text")
    g.add_argument("--calibration_file", type=Path, default=None,
                   help="a local text file to calibrate on (a few hundred KB of text like what the model will see)")
    g.add_argument("--calibration_tasks", nargs="+", default=None,
                   help="lm_eval tasks whose documents to calibrate on instead (e.g. wikitext; downloads their data)")
    g.add_argument("--calibration_limit", type=positive_int, default=None,
                   help=f"calibration sequences, sampled at random offsets (default {GPTQ.DEFAULT_CALIBRATION_LIMIT})")
    g.add_argument("--calibration_seq_length", type=int_in(2), default=None, help=f"tokens per sequence (default {GPTQ.DEFAULT_CALIBRATION_SEQ_LENGTH}, or the "
                        "model's context if shorter)")
    g.add_argument("--seed", type=SEED, default=None, help=f"seed of the sequence sampling (default {GPTQ.DEFAULT_SEED})")
    g.add_argument("--percdamp", type=finite_float(0, 1, low_open=True, high_open=True), default=None,
                   help=f"dampening added to the Hessian's diagonal, as a fraction of its mean (default {GPTQ.DEFAULT_PERCDAMP})")
    g.add_argument("--blocksize", type=positive_int, default=None, help=f"columns per lazy batch update (default {GPTQ.DEFAULT_BLOCKSIZE})")
    g.add_argument("--act_order", action="store_true",
                   help="quantize the most active input channels first (often better; same file layout)")
    g.add_argument("--device", default=None, help="where GPTQ runs (default: cuda if available, else cpu)")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    with error_boundary():
        main(**vars(args))


if __name__ == "__main__":
    cli()
