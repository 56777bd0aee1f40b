"""Smoke test of scripts/bench_products.py: every precision's products run at a few row counts on
tiny layer shapes, and bad arguments are one line. Never a timing assertion."""
import pytest

import kernels
from model import ModelArgs
from scripts import bench_products

pytestmark = pytest.mark.skipif(kernels.best_isa() == "", reason="kernels.cpp needs AVX2 or AVX-512")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4-sym"])
def test_products_at_each_row_count(precision):
    config = ModelArgs(n_layer=1, n_head=4, n_local_heads=2, dim=64, intermediate_size=96, vocab_size=128)
    results = bench_products.measure(config, 1e-6, precision, [1, 3, 40], 1, peer=True)
    assert [r["rows"] for r in results] == [1, 3, 40] and results[0]["vs_one_row"] == 1
    # torch's own product beside ours where it has one (fp32, bf16), never on quantized weights
    assert all((r["vs_torch"] is None) == (precision in ("int8", "int4-sym")) for r in results)
    assert all(r["tflops"] > 0 for r in results)
    # one layer (the fewest whole layers over 1 KB): q/k/v 128 x 64, output 64 x 64, gate/up 192 x 64, down 64 x 96
    weights = 128 * 64 + 64 * 64 + 192 * 64 + 64 * 96
    per_weight = {"fp32": 4, "bf16": 2, "int8": 1, "int4-sym": 0.5}[precision]
    assert all(round(r["gb"] * 1e9) >= weights * per_weight and r["gbps"] > 0 for r in results)


@pytest.mark.parametrize("argv,needle", [(["--rows", "1,x"], "--rows"), (["--rows", "0"], "at least 1"),
                                         (["--precisions", "fp8"], "fp8"), (["--model", "nope"], "valid names")])
def test_bad_arguments(argv, needle):
    with pytest.raises(SystemExit) as e:
        bench_products.main(argv + ["--gb", "0.001"])
    message = str(e.value.code)
    assert message.startswith("error:") and needle in message and "\n" not in message
