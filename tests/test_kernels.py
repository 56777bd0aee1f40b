"""kernels.cpp's packed fp32 product against float64 matrix products and transformers' models."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kernels
from conftest import make_hf_model, save_and_convert
from load import load_model


def isas() -> list:
    """Every instruction set kernels.cpp has code for that this CPU runs (AVX-512 CPUs run both)."""
    best = kernels.best_isa()
    return {"avx512": ["avx512", "avx2"], "avx2": ["avx2"], "": []}[best]


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    if request.param not in isas():
        pytest.skip(f"this CPU has no {request.param}")
    return request.param


@pytest.mark.parametrize("n,k", [(576, 576), (100, 64), (33, 7), (1, 5), (64, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_float64_product(isa, n, k, bias):
    """Every row count around the register tiles (6 rows for AVX2, 8 for AVX-512), output columns
    that are no multiple of the 32-column block, 3-D inputs."""
    torch.manual_seed(n + k)
    linear = nn.Linear(k, n, bias=bias)
    packed = kernels.PackedLinear(linear, isa)
    for rows in (1, 2, 5, 6, 7, 8, 9, 13, 16, 17, 40):
        x = torch.randn(2, rows, k)
        expected = (x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)).float()
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)


def test_packed_embedding_reads_the_packed_rows(isa):
    emb = nn.Embedding(100, 24)
    out = nn.Linear(24, 100, bias=False)
    out.weight = emb.weight
    idx = torch.tensor([[0, 5, 31, 32, 63, 64, 99]])
    torch.testing.assert_close(kernels.PackedEmbedding(kernels.PackedLinear(out, isa))(idx), emb(idx), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama31", "qwen2", "gemma2"])
def test_packed_model_matches_transformers(family, isa, tmp_path):
    """Packed in place: no nn.Linear left, a tied embedding reads the output's packed weight (one
    copy), and the logits are still transformers' (q/k/v biases, soft-capping, tied or not)."""
    hf = make_hf_model(family, seed=5)
    model = kernels.pack_linears(load_model(save_and_convert(hf, tmp_path)), isa)
    assert not any(type(m) is nn.Linear for m in model.modules())
    if hf.config.tie_word_embeddings:
        assert model.tok_embeddings.packed is model.output.packed
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    model.setup_caches(max_batch_size=2, max_seq_length=40)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(40)), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_hooks_move_with_the_module(isa):
    """tp.py's collectives are forward hooks on the projections: packing keeps them."""
    linear = nn.Linear(8, 4)
    linear.register_forward_hook(lambda module, inputs, output: output * 2)
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.PackedLinear(linear, isa)(x), linear(x))


def test_no_compiler_means_pytorch_products(tmp_path):
    """Without a working C++ compiler the model is left as it is, with one line saying why."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = ("import torch, kernels; from model import ModelArgs, Transformer; "
            "m = Transformer(ModelArgs(n_layer=1, dim=32, n_head=2, vocab_size=64, intermediate_size=64)); "
            "print(repr(kernels.best_isa()), type(kernels.pack_for_cpu(m).output).__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["''", "Linear"]
    assert "kernels.cpp could not be built" in done.stderr and "Traceback" not in done.stderr
