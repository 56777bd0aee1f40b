"""gemv.py's Triton matrix-vector kernel against float64 products and against the model's own
F.linear path: on a GPU where there is one, else in Triton's interpreter (TRITON_INTERPRET=1) on
the CPU. Skipped where triton is not installed: it comes with PyTorch's CUDA builds, and
`pip install triton` adds it to a CPU one (not in requirements-dev.txt: with triton installed,
every torch.compile on the CPU imports it, ~80 MB more resident memory in the benchmark's runs)."""
import os

import pytest
import torch

import quantized
from conftest import run_test_file
from model import ModelArgs, Transformer

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton reads TRITON_INTERPRET as it imports (its own jit functions, tl.sum among them, are
# decorated then), and torch may have imported it before this file: on a CPU the tests run in a
# process of their own that sets it from the start.
CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.skipif(not CHILD, reason="runs the tests below in Triton's interpreter")
def test_in_triton_interpreter():
    run = run_test_file(__file__, TRITON_INTERPRET="1")
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.fixture(scope="module")
def gemv():
    if CHILD:
        pytest.skip("run by test_in_triton_interpreter")
    import gemv
    gemv.register()
    return gemv


def reference(x, weight, scales=None):
    y = x.double() @ weight.double().T
    return y if scales is None else y * scales.double()


def rel_error(got, expected):
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("N, K", [(37, 300), (64, 1024), (5, 2048)])  # spare rows, K not a whole slice
def test_every_config_matches_float64(gemv, N, K):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(1, K, generator=g).to(DEVICE)
    w8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(N, generator=g) + 0.5).to(DEVICE)
    w16 = torch.randn(N, K, generator=g).to(DEVICE, torch.bfloat16)
    for config in gemv.CONFIGS:
        y = gemv.launch(gemv.gemv_kernel, x, w8, scales, config)
        assert y.dtype == torch.float32 and rel_error(y, reference(x, w8, scales)) < 1e-5, config
        xb = x.to(torch.bfloat16)  # 16-bit activations and weights, no scales: one bf16 rounding at the end
        y = gemv.launch(gemv.gemv_kernel, xb, w16, None, config)
        assert y.dtype == torch.bfloat16 and rel_error(y, reference(xb, w16)) < 8e-3, config


def test_op_eager_and_compiled(gemv):
    x = torch.randn(1, 96, device=DEVICE)
    w = torch.randint(-127, 128, (40, 96), dtype=torch.int8, device=DEVICE)
    scales = torch.rand(40, device=DEVICE) + 0.5
    expected = reference(x, w, scales)
    assert rel_error(gemv.gemv(x, w, scales), expected) < 1e-5
    compiled = torch.compile(lambda x: gemv.gemv(x, w, scales) * 2, fullgraph=True)
    assert rel_error(compiled(x), 2 * expected) < 1e-5
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv.gemv(torch.randn(2, 96, device=DEVICE), w, scales)
    with pytest.raises(ValueError, match="scales must be"):
        gemv.gemv(x, w, scales[:3])


def test_int8_layer_takes_gemv_for_one_row(gemv):
    """An int8 layer with the GPU's "fused" kernel, switched by use_gemv: one row through gemv,
    several through the fused form, both equal to the dequantized weights' product."""
    layer = quantized.Int8Linear(64, 48, bias=True)
    w = torch.randn(48, 64)
    layer.weight, layer.scales = quantized.quantize_int8(w)
    layer.bias = torch.randn(48)
    layer.kernel = "fused"  # what finalize picks on CUDA
    layer = torch.nn.Sequential(layer).to(DEVICE)
    dequantized = quantized.dequantize_int8(layer[0].weight.cpu(), layer[0].scales.cpu()).to(DEVICE)
    gemv.use_gemv(layer)
    assert layer[0].kernel == "gemv"
    for rows in (1, 3):
        x = torch.randn(rows, 64, device=DEVICE)
        expected = reference(x, dequantized) + layer[0].bias.double()
        assert rel_error(layer(x), expected) < 1e-5, rows


def test_model_steps_equal_with_gemv(gemv):
    """A random model's prefill (several rows: F.linear) and decode steps (one row: gemv) give the
    logits they give without gemv, fp32 throughout."""
    torch.manual_seed(0)
    config = ModelArgs(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=96)
    model = Transformer(config).to(DEVICE)
    model.setup_caches(1, 16)
    prompt = torch.tensor([[3, 1, 4, 1, 5]], device=DEVICE)

    def logits(m):
        with torch.no_grad():
            out = [m(prompt, torch.arange(5, device=DEVICE))[:, -1]]
            for pos, token in zip(range(5, 8), (7, 2, 9)):
                out.append(m(torch.tensor([[token]], device=DEVICE), torch.tensor([pos], device=DEVICE))[:, -1])
        return torch.cat(out)
    expected = logits(model)
    swapped = gemv.use_gemv(model)
    assert sum(isinstance(m, gemv.GemvLinear) for m in swapped.modules()) == 2 * 5 + 1
    assert not any(type(m) is torch.nn.Linear for m in swapped.modules())
    torch.testing.assert_close(logits(swapped), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="a compiled step with CUDA graphs (the interpreter's CPU step is eager)")
def test_compiled_generation_with_gemv_equals_eager(gemv, tmp_path):
    """Greedy tokens of the compiled decode step (a CUDA graph calling gemv's op) equal eager ones
    with gemv, fp32 weights and int8 ones (fp32 throughout, as test_accelerator's compiled == eager:
    16-bit rounding would let the fused kernels around the products pick other tokens)."""
    import quantize
    from compiling import compile_step
    from decode import decode_one_token, generate
    from load import load_model
    from test_quantize import MODELS, save_random_model
    path = save_random_model(tmp_path, **MODELS["llama"])
    prompt = torch.tensor([5, 17, 99, 3, 42, 7], device=DEVICE)
    for checkpoint in (path, quantize.quantize_checkpoint(path, "int8", None)):
        model = gemv.use_gemv(load_model(checkpoint, DEVICE, torch.float32))
        assert any(isinstance(m, gemv.GemvLinear) or getattr(m, "kernel", None) == "gemv" for m in model.modules())
        decode_fn = compile_step(decode_one_token, DEVICE)
        eager = generate(model, prompt, 16)
        assert generate(model, prompt, 16, decode_fn=decode_fn).tolist() == eager.tolist(), checkpoint
