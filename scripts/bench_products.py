# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""kernels.cpp's products alone: GB/s of weights read at 1..N rows of x, per precision.

    python scripts/bench_products.py --model llama-3.2-1b --rows 1,4,8,16,32

A decode step is one row; a batch of streams, a speculative check or a short prompt is a few.
The weights are random, in the shapes of as many layers of --model as make --gb of each
precision (more than the last-level cache holds, so they come from memory as a real model's
do), packed as the command lines pack them. Each row count runs every product once, best of
--repeats; "x 1 row" is the time against one row's, so a product that reads its weights
once for all rows stays near 1. --peer times torch's own product (F.linear: oneDNN / MKL) on the
same weights unpacked beside it (fp32, bf16), the ratio its time over ours: a prompt's rows are
where those libraries' large-matrix kernels are at their best.

    python scripts/bench_products.py --precisions fp32,bf16 --rows 1,32,256,1024 --peer
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from errors import error_boundary, finite_float, positive_int  # noqa: E402
from model import ModelArgs  # noqa: E402
from quantized import Int4Linear, Int8Linear, padded_size, quantize_int4, quantize_int8  # noqa: E402
from scripts.bench import INT4_GROUPSIZE, TORCH_DTYPES, cpu_isa, cpu_name  # noqa: E402


def layer_shapes(config: ModelArgs) -> list:
    """(out, in) of a layer's products as pack_for_cpu fuses them: q/k/v, the output, gate/up, down."""
    qkv = (config.n_head + 2 * config.n_local_heads) * config.head_dim
    return [(qkv, config.dim), (config.dim, config.n_head * config.head_dim),
            (2 * config.intermediate_size, config.dim), (config.dim, config.intermediate_size)]


def activations(precision: str) -> torch.dtype:
    """fp32 and bf16 models run in their weights' dtype; quantized ones in fp32 on the CPU."""
    return getattr(torch, TORCH_DTYPES.get(precision, "float32"))


def packed_layer(precision: str, n: int, k: int, peer: bool = False) -> tuple:
    """A layer of random weights [n, k] as the command lines run it on this CPU: a PackedLinear
    (fp32, bf16), or quantize.py's int8 / int4-sym (groups of 32) finalized into kernels.cpp's
    layout; and with peer, the weights unpacked (fp32, bf16; else None)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.02
    if precision in ("fp32", "bf16"):
        dense = w.to(activations(precision))
        linear = nn.Linear(k, n, bias=False, device="meta")
        linear.weight = nn.Parameter(dense, requires_grad=False)  # packed into a copy of its own
        return kernels.PackedLinear(linear, kernels.best_isa()), dense if peer else None
    if precision == "int8":
        layer = Int8Linear(k, n, bias=False)
        layer.weight, layer.scales = quantize_int8(w)
    else:
        layer = Int4Linear(k, n, False, INT4_GROUPSIZE, padded_size(k, INT4_GROUPSIZE))
        layer.weight, layer.scales_and_zeros = quantize_int4(w, INT4_GROUPSIZE, symmetric=True)
    layer.finalize(torch.device("cpu"), torch.float32)
    return layer, None


def best_time(products: list, xs: dict, repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs of every product (after one that warms up)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for product, k in products:
            product(xs[k])
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def measure(config: ModelArgs, gb: float, precision: str, rows: list, repeats: int, peer: bool = False) -> list:
    layers = []
    while not layers or sum(nbytes for _, nbytes, _ in layers) < gb * 1e9:  # whole layers
        for n, k in layer_shapes(config):
            layer, dense = packed_layer(precision, n, k, peer)
            layers.append((layer, sum(b.nbytes for b in layer.buffers()), dense))
    gb = sum(nbytes for _, nbytes, _ in layers) / 1e9
    flop = 2 * sum(layer.in_features * layer.out_features for layer, _, _ in layers)  # a row's
    ours = [(layer, layer.in_features) for layer, _, _ in layers]
    torchs = [(functools.partial(F.linear, weight=dense), dense.shape[1]) for _, _, dense in layers
              if dense is not None]
    results, one = [], None
    with torch.no_grad():
        for m in rows:
            xs = {k: torch.randn(m, k).to(activations(precision)) for _, k in layer_shapes(config)}
            best = best_time(ours, xs, repeats)
            one = one or best
            vs_torch = best_time(torchs, xs, repeats) / best if torchs else None
            results.append({"precision": precision, "rows": m, "gb": gb, "ms": best * 1e3, "gbps": gb / best,
                            "tflops": m * flop / best / 1e12, "vs_one_row": best / one, "vs_torch": vs_torch})
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a preset of model.py (its layers' shapes)")
    p.add_argument("--gb", type=finite_float(0, low_open=True), default=1.5,
                   help="GB of weights per precision, in whole layers (beyond the last-level cache)")
    p.add_argument("--precisions", default="fp32,bf16,int8,int4-sym",
                   help="comma-separated: fp32, bf16, int8, int4-sym")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated rows of x")
    p.add_argument("--repeats", type=positive_int, default=5, help="runs of every product per row count (best kept)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--peer", action="store_true",
                   help="also time torch's F.linear on the unpacked weights (fp32, bf16)")
    args = p.parse_args(argv)
    with error_boundary():
        precisions = args.precisions.split(",")
        unknown = set(precisions) - {"fp32", "bf16", "int8", "int4-sym"}
        if unknown:
            raise ValueError(f"--precisions: unknown {sorted(unknown)}; choose from fp32, bf16, int8, int4-sym")
        try:
            rows = [int(r) for r in args.rows.split(",")]
        except ValueError:
            raise ValueError(f"--rows: comma-separated whole numbers, not {args.rows!r}") from None
        if min(rows) < 1:
            raise ValueError("--rows: each at least 1")
        isa = kernels.best_isa()
        if not isa:
            raise ValueError("this CPU has neither AVX2 nor AVX-512: kernels.cpp has no products for it")
        if args.threads:
            torch.set_num_threads(args.threads)
        config = ModelArgs.from_name(args.model)
        print(f"{cpu_name()} ({cpu_isa()}), kernels.cpp {isa}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, {args.gb} GB of {args.model}'s layers per precision")
        print(f"{'precision':<10}{'rows':>5}{'GB':>7}{'ms':>9}{'GB/s':>7}{'TFLOP/s':>9}{'x 1 row':>9}"
              + (f"{'vs torch':>10}" if args.peer else ""))
        for precision in precisions:
            for r in measure(config, args.gb, precision, rows, args.repeats, args.peer):
                peer = f"{r['vs_torch']:>9.2f}x" if r["vs_torch"] else f"{'-':>10}"
                print(f"{r['precision']:<10}{r['rows']:>5}{r['gb']:>7.2f}{r['ms']:>9.1f}{r['gbps']:>7.1f}"
                      f"{r['tflops']:>9.2f}{r['vs_one_row']:>9.2f}" + (peer if args.peer else ""), flush=True)


if __name__ == "__main__":
    main()
