# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""kernels.cpp's products alone: GB/s of weights read at 1..N rows of x, per precision.

    python scripts/bench_products.py --model llama-3.2-1b --rows 1,4,8,16,32

A decode step is one row; a batch of streams, a speculative check or a short prompt is a few.
The weights are random, in the shapes of as many layers of --model as make --gb of each
precision (more than the last-level cache holds, so they come from memory as a real model's
do), packed as the command lines pack them. Each row count runs every product once, best of
--repeats; the last column is the time against one row's, so a product that reads its weights
once for all rows stays near 1.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402
from errors import error_boundary, finite_float, positive_int  # noqa: E402
from model import ModelArgs  # noqa: E402
from scripts.bench import cpu_isa, cpu_name  # noqa: E402


def layer_shapes(config: ModelArgs) -> list:
    """(out, in) of a layer's products as pack_for_cpu fuses them: q/k/v, the output, gate/up, down."""
    qkv = (config.n_head + 2 * config.n_local_heads) * config.head_dim
    return [(qkv, config.dim), (config.dim, config.n_head * config.head_dim),
            (2 * config.intermediate_size, config.dim), (config.dim, config.intermediate_size)]


def packed_product(precision: str, n: int, k: int, isa: str):
    """(a function of x, the packed weight's bytes) for random weights [n, k]."""
    code, g = kernels.ISA_CODES[isa], torch.Generator().manual_seed(n * k)
    if precision in ("fp32", "bf16"):
        w = kernels.pack_weight((torch.randn(n, k, generator=g) * 0.02).to(
            torch.float32 if precision == "fp32" else torch.bfloat16))
        if precision == "fp32":
            return lambda x: torch.ops.brisk.packed_linear(x, w, n, code), w.nbytes
        return lambda x: torch.ops.brisk.packed_linear_bf16(x.bfloat16(), w, n, code), w.nbytes
    if precision == "int8":
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        q, s = kernels.pack_int8(weight, torch.rand(n) / 100, isa)
        return lambda x: torch.ops.brisk.packed_linear_int8(x, q, s, n, code), q.nbytes + s.nbytes
    groups = -(-k // 32)  # int4, groups of 32, symmetric (quantize.py's int4-sym)
    codes = torch.randint(0, 16, (n, groups * 32), dtype=torch.uint8, generator=g)
    q, sz = kernels.pack_int4(codes, torch.stack([torch.rand(groups, n) / 100, torch.zeros(groups, n)], -1).bfloat16(),
                              isa)
    return lambda x: torch.ops.brisk.packed_linear_int4(x, q, sz, n, code), q.nbytes + sz.nbytes


def measure(config: ModelArgs, gb: float, precision: str, rows: list, repeats: int, isa: str) -> list:
    products = []
    while not products or sum(nbytes for _, _, nbytes in products) < gb * 1e9:  # whole layers
        products += [(k, *packed_product(precision, n, k, isa)) for n, k in layer_shapes(config)]
    gb = sum(nbytes for _, _, nbytes in products) / 1e9
    results, one = [], None
    for m in rows:
        xs = {k: torch.randn(m, k) for k, _, _ in products}
        times = []
        for _ in range(repeats + 1):  # the first one warms up
            t0 = time.perf_counter()
            for k, f, _ in products:
                f(xs[k])
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        one = one or best
        results.append({"precision": precision, "rows": m, "gb": gb, "ms": best * 1e3, "gbps": gb / best,
                        "vs_one_row": best / one})
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
        print(f"{'precision':<10}{'rows':>5}{'GB':>7}{'ms':>9}{'GB/s':>7}{'x 1 row':>9}")
        for precision in precisions:
            for r in measure(config, args.gb, precision, rows, args.repeats, isa):
                print(f"{r['precision']:<10}{r['rows']:>5}{r['gb']:>7.2f}{r['ms']:>9.1f}{r['gbps']:>7.1f}"
                      f"{r['vs_one_row']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
