"""kernels.cpp's packed products against float64 matrix products (fp32, and int8 / int4 against
their dequantized weights) and transformers' models."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
import quantized
from conftest import huge_page_memory, kernel_isas, make_hf_model, save_and_convert
from load import load_model
from model import RMSNorm


@pytest.fixture(params=["avx512vnni", "avx512", "avx2"])
def isa(request):
    if request.param not in kernel_isas():
        pytest.skip(f"this CPU has no {request.param}")
    return request.param


def inputs(rows, k):
    """`rows` rows of x: 2-D for odd counts (a 1-row product tested as itself), 3-D for even ones."""
    return torch.randn(rows, k) if rows % 2 else torch.randn(2, rows // 2, k)


@pytest.mark.parametrize("n,k", [(576, 576), (100, 64), (33, 7), (1, 5), (64, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_float64_product(isa, n, k, bias):
    """Every row count around the register tiles (6 rows for AVX2, 8 for AVX-512), AVX2's 30 rows
    and AVX-512's panel of 32 a call (40), k around the chunks of 32 that more rows than a tile go
    over in turn (7, 64, 300, 576), output columns that are no multiple of the 32-column block, 3-D
    inputs."""
    torch.manual_seed(n + k)
    linear = nn.Linear(k, n, bias=bias)
    packed = kernels.PackedLinear(linear, isa)
    for rows in (1, 2, 5, 6, 7, 8, 9, 13, 16, 17, 40):
        x = inputs(rows, k)
        expected = (x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)).float()
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(70, 8192), (667, 1024)])
def test_a_long_prompt_goes_over_the_blocks_in_groups(isa, n, k):
    """300 rows, x beyond half of L2: every tile of rows goes over a group of blocks (half of L2 of
    weights: kernels.cpp's block_group_bytes) before the next group. k = 8192: rows in groups of 4 MB
    (ROW_GROUP_BYTES: 128 rows, so two whole groups and a partial one), one 1 MB fp32 block a group
    or more; k = 1024: 21 blocks of 128 KB, in whole groups and a partial one a thread."""
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False)
    x = torch.randn(300, k)
    expected = (x.double() @ linear.weight.double().T).float()
    torch.testing.assert_close(kernels.PackedLinear(linear, isa)(x), expected, rtol=1e-5, atol=1e-4)


def rounded_activations(x, isa):
    """x as the integer products (VNNI, AVX2) see it: rounded to int8 steps of max |x| / 127 per 32
    columns (AVX-512's FMA products take x as it is)."""
    if isa not in kernels.INTEGER_ISAS:
        return x.double()
    K = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -K % 32)).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0)
    return (torch.round(blocks * inv).double() * (amax.double() / 127)).flatten(-2)[..., :K]


# Around the tiles: AVX2 int8 / int4 4 rows (fp32: 2 for decode, else 6), VNNI 4, AVX-512 FMA 8;
# AVX-512's panels of 32 rows, over a block in chunks (40: two panels).
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 40)


@pytest.mark.parametrize("n,k", [(576, 576), (100, 64), (33, 7), (1, 5), (64, 300)])
def test_packed_int8_equals_float64_product(isa, n, k):
    """int8 weights times their scales; with integer products (VNNI, AVX2), x rounded per 32 columns as documented."""
    torch.manual_seed(n + k)
    m = quantized.Int8Linear(k, n, bias=True)
    q, scales = m.weight, m.scales = quantized.quantize_int8(torch.randn(n, k))
    m.bias = torch.randn(n)
    m.finalize(torch.device("cpu"), torch.float32)  # packed for the best ISA: repacked for `isa`
    assert m.kernel == "packed"
    m.isa, (m.weight, m.scales) = isa, kernels.pack_int8(q, scales, isa)
    deq = quantized.dequantize_int8(q, scales).double()
    for rows in ROWS:
        x = inputs(rows, k)
        expected = (rounded_activations(x, isa) @ deq.T + m.bias.double()).float()
        torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-4)  # |y| ~ sqrt(k)


@pytest.mark.parametrize("n,k,groupsize", [(576, 576, 32), (100, 64, 64), (33, 7, 32), (64, 300, 128), (96, 576, 256)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_packed_int4_equals_float64_product(isa, n, k, groupsize, symmetric):
    """(q - 8) * scale + zero per group (padded past k), with integer products times x rounded per 32 columns.
    symmetric: every zero 0 (as in a Q4_0-style checkpoint), packed as the scales alone."""
    torch.manual_seed(n + k)
    w, sz = quantized.quantize_int4(torch.randn(n, k), groupsize)
    if symmetric:
        sz[..., 1] = 0
    deq = quantized.dequantize_int4(w, sz, groupsize)[:, :k].double()
    packed, packed_sz = kernels.pack_int4(quantized.unpack_int4(w), sz, isa)
    assert packed_sz.dim() == (3 if symmetric else 4)
    for rows in ROWS:
        x = inputs(rows, k)
        expected = (rounded_activations(x, isa) @ deq.T).float()
        got = torch.ops.brisk.packed_linear_int4(x, packed, packed_sz, n, kernels.ISA_CODES[isa])
        # fp32 sums of terms up to 15 s |x| (the codes are not centred): a few 1e-4 off at |y| ~ 20.
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=5e-4)


@pytest.fixture
def packs():
    if not kernels.best_isa():
        pytest.skip("kernels.cpp has no products for this CPU")


@pytest.mark.parametrize("n,k", [(576, 576), (100, 64), (33, 7), (1, 5)])
def test_packed_bf16_equals_float64_product(isa, n, k):
    """bf16 products are exact in fp32: sums in fp32, rounded once to bf16 (the bias added in bf16);
    with vdpbf16ps (AVX-512 BF16) or widened to fp32 (AVX2, and AVX-512 CPUs without BF16)."""
    torch.manual_seed(n + k)
    linear = nn.Linear(k, n).bfloat16()
    packed = kernels.PackedLinear(linear, isa)
    for rows in ROWS:
        x = inputs(rows, k).bfloat16()
        got = packed(x)
        assert got.dtype == torch.bfloat16
        expected = x.double() @ linear.weight.double().T + linear.bias.double()
        torch.testing.assert_close(got.double(), expected, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("n,k", [(576, 576), (100, 200), (33, 7), (70, 8191)])
@pytest.mark.parametrize("rows", [16, 45, 96])
def test_packed_bf16_prompt_equals_its_rows_alone(isa, n, k, rows):
    """A prompt's bf16 product (on AMX's tiles where the CPU has them: 16 rows or more, padded to
    whole tiles of 32 rows and 32 k; else tiles of up to 8 rows over the k-pairs in chunks) against
    each of its rows alone and float64: sums of the same exact products in another order, so equal
    but for a few values one bf16 step apart. k = 8191: an odd k whose last 16 k-pairs are short of
    a whole tile, over a long sum."""
    torch.manual_seed(rows + k)
    linear = nn.Linear(k, n, bias=False).bfloat16()
    packed = kernels.PackedLinear(linear, isa)
    x = torch.randn(rows, k).bfloat16()
    whole, alone = packed(x), torch.cat([packed(row) for row in x.split(1)])
    assert bf16_ulps(whole, alone) <= 1.0 and (whole != alone).float().mean() < 0.02
    expected = x.double() @ linear.weight.double().T
    torch.testing.assert_close(whole.double(), expected, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("family", ["llama31", "gemma2"])
def test_packed_bf16_model_matches_unpacked(packs, family, tmp_path):
    """A bf16 model packed (tied embedding gathered from bf16 pairs) against the same model on
    PyTorch's bf16 products: both round to bf16 after every product, in different orders."""
    path = save_and_convert(make_hf_model(family, seed=5), tmp_path)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    logits = []
    for pack in (False, True):
        model = load_model(path, precision=torch.bfloat16)
        model = kernels.pack_linears(model) if pack else model
        model.setup_caches(max_batch_size=2, max_seq_length=40)
        with torch.no_grad():
            logits.append(model(ids, torch.arange(40)).float())
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert float((logits[1] - logits[0]).norm() / logits[0].norm()) < 2e-2


@pytest.mark.skipif(not kernels.huge_pages_available(), reason="this OS backs no memory with huge pages")
def test_into_huge_pages_moves_every_tensor_and_keeps_what_shares_one():
    """Values, parameters (the same objects), a view of a weight, a parameter held twice (a plain
    attribute too: PackedEmbedding holds the output's packed weight so): all in one block that starts
    on a 2 MB boundary and asks for huge pages; the outputs unchanged."""
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 3))
    model.register_buffer("rows", model[0].weight.detach()[2:5])
    model.alias = model.rows  # a plain attribute, as PackedEmbedding's
    model[1].shared = model[0].bias  # one parameter in two modules
    weight, x = model[0].weight, torch.randn(2, 1000)
    with torch.no_grad():
        before = model(x)
        kernels.into_huge_pages(model)
        assert torch.equal(model(x), before)
    assert model[0].weight is weight and isinstance(weight, nn.Parameter) and model[1].shared is model[0].bias
    assert model.rows.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert torch.equal(model.rows, weight[2:5])
    assert "alias" in vars(model) and model.alias.data_ptr() == model.rows.data_ptr() and huge_page_memory(model.alias)
    starts = sorted(t.untyped_storage().data_ptr() for t in model.state_dict().values())
    assert starts[0] % kernels.HUGE_PAGE == 0
    assert starts[-1] - starts[0] < 5 << 20  # one block
    assert all(huge_page_memory(t) for t in model.state_dict().values())


def test_pack_for_cpu_packs_what_kernels_cpp_multiplies():
    """fp32 and bf16 wherever kernels.cpp builds; float16 never."""
    from model import ModelArgs, Transformer
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")

    def packed(dtype):
        model = Transformer(ModelArgs(n_layer=1, dim=32, n_head=2, vocab_size=64, intermediate_size=64)).to(dtype)
        return isinstance(kernels.pack_for_cpu(model).output, kernels.PackedLinear)
    assert packed(torch.float32) and packed(torch.bfloat16) and not packed(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_embedding_reads_the_packed_rows(isa, dtype):
    emb = nn.Embedding(100, 23).to(dtype)  # an odd width: bf16 pairs padded
    out = nn.Linear(23, 100, bias=False)
    out.weight = emb.weight
    idx = torch.tensor([[0, 5, 31, 32, 63, 64, 99]])
    torch.testing.assert_close(kernels.PackedEmbedding(kernels.PackedLinear(out, isa))(idx), emb(idx), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_fused_feed_forward_is_its_two_products(isa, kind):
    """w1 and w3 packed as one product (kernels.fuse_feed_forwards) give exactly what the two give
    (int8 / int4: the same rounding of x), for every row count around the tiles; a hidden size that
    ends inside a block of 32 stays two products. A prompt's rows go through it a block at a time,
    with the same result (up to the order of a sum: the products pick their tiles by the rows they get)."""
    from model import FeedForward, ModelArgs
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    torch.manual_seed(3)

    def packed_layer(linear):
        if kind in ("fp32", "bf16"):
            return kernels.PackedLinear(linear.to(dtype), isa)
        m = quantized.Int8Linear(64, linear.out_features, bias=False) if kind == "int8" else \
            quantized.Int4Linear(64, linear.out_features, False, 32, 64)
        if kind == "int8":
            m.weight, m.scales = quantized.quantize_int8(linear.weight.detach())
        else:
            m.weight, m.scales_and_zeros = quantized.quantize_int4(linear.weight.detach(), 32)
        m.finalize(torch.device("cpu"), torch.float32)
        if kind == "int8":  # repacked for `isa`, as the product tests do
            m.isa, (m.weight, m.scales) = isa, kernels.pack_int8(*quantized.quantize_int8(linear.weight.detach()), isa)
        else:
            w, sz = quantized.quantize_int4(linear.weight.detach(), 32)
            m.isa, (m.weight, m.scales_and_zeros) = isa, kernels.pack_int4(quantized.unpack_int4(w), sz, isa)
        return m

    for hidden, fused in ((96, True), (80, False)):
        ff = FeedForward(ModelArgs(dim=64, intermediate_size=hidden, n_head=4))
        for name in ("w1", "w3", "w2"):
            setattr(ff, name, packed_layer(getattr(ff, name)))
        model = nn.Module()
        model.layers = nn.ModuleList([nn.Module()])
        model.layers[0].feed_forward = ff
        kernels.fuse_feed_forwards(model)
        assert isinstance(model.layers[0].feed_forward, kernels.PackedFeedForward) == fused, hidden
        for rows in ROWS:
            x = torch.randn(2, rows, 64).to(dtype)
            assert torch.equal(model.layers[0].feed_forward(x), ff(x)), (hidden, rows)
        if fused:  # a prompt's rows a block at a time: all of them at once, but for the order of a sum
            packed = model.layers[0].feed_forward
            x = torch.randn(2, 21, 64).to(dtype)
            whole = packed(x)  # 42 rows: one block of the default size
            packed.rows_at_once, blocks = 8, []
            packed.w13.register_forward_pre_hook(lambda m, args: blocks.append(args[0].shape[:-1]))
            torch.testing.assert_close(packed(x), whole)
            assert blocks == [(8,)] * 5 + [(2,)], blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_weights_are_the_packed_weights_one_after_another(dtype):
    """pack_stacked packs each weight straight into its place in one tensor: the same bytes as
    packing each (also where a weight's rows or k need padding, and in the int32 moves of the bf16
    pairs) and concatenating."""
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    torch.manual_seed(5)
    for k in (64, 37):
        linears = [nn.Linear(k, n, bias=False).to(dtype) for n in (96, 64, 50)]
        stacked = kernels.pack_stacked(linears, kernels.best_isa())
        assert torch.equal(stacked.packed, torch.cat([kernels.PackedLinear(m, "avx2").packed for m in linears]))
        assert stacked.packed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).unique().numel() > 2
        x = torch.randn(3, k).to(dtype)
        torch.testing.assert_close(stacked(x), torch.cat([m(x) for m in linears], dim=-1), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("family", ["llama31", "qwen2", "gemma2"])
def test_packed_model_matches_transformers(family, isa, tmp_path):
    """Packed in place: no nn.Linear left, a tied embedding reads the output's packed weight (one
    copy), and the logits are still transformers' (q/k/v biases, soft-capping, tied or not)."""
    hf = make_hf_model(family, seed=5)
    model = kernels.pack_linears(load_model(save_and_convert(hf, tmp_path)), isa)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(isinstance(layer.feed_forward, kernels.PackedFeedForward) for layer in model.layers)
    if hf.config.tie_word_embeddings:
        assert model.tok_embeddings.packed is model.output.packed
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    model.setup_caches(max_batch_size=2, max_seq_length=40)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(40)), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_packed_model_compiles_once_and_loads_on_a_second_start(tmp_path, capfd, monkeypatch):
    """A packed model's compiled step runs unfrozen (its products gain nothing from freezing) and is
    saved to a file that a second start loads instead of tracing and compiling (compiling.precompiled),
    with the eager model's logits; also when the second run's cache has another length (another
    prompt or --max_new_tokens). A model of another structure (another instruction set) compiles a
    file of its own."""
    from compiling import compile_step, needs_freezing
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    monkeypatch.setenv("BRISK_COMPILE_CACHE", str(tmp_path / "compiled"))
    path = save_and_convert(make_hf_model("llama31", seed=5), tmp_path)
    model = load_model(path)
    assert needs_freezing(model)
    model = kernels.pack_linears(model)
    assert not needs_freezing(model)
    step = lambda m, x, p: m(x, p)  # noqa: E731
    x, pos = torch.tensor([[3]]), torch.tensor([4], dtype=torch.int)
    with torch.no_grad():
        for start, cache_length in (("compiled", 16), ("loaded", 40)):
            model.setup_caches(max_batch_size=1, max_seq_length=cache_length)  # zeros: the same cache contents
            eager = model(x, pos)
            compiled = compile_step(step, "cpu")(model, x, pos)  # a new process's compile_step
            torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
            assert f"compiling: {start} " in capfd.readouterr().err, start
        others = [isa for isa in kernel_isas() if isa != kernels.best_isa()][:1]
        for isa in others:
            other = kernels.pack_linears(load_model(path), isa)
            other.setup_caches(max_batch_size=1, max_seq_length=16)
            torch.testing.assert_close(compile_step(step, "cpu")(other, x, pos), other(x, pos), atol=1e-4, rtol=1e-4)
            assert "compiling: compiled " in capfd.readouterr().err
    assert len(list((tmp_path / "compiled").glob("*.pt2"))) == 1 + len(others)


LOAD_IN_A_NEW_PROCESS = """
import subprocess, sys, torch
spawned = []
popen = subprocess.Popen.__init__
subprocess.Popen.__init__ = lambda self, args, *a, **k: (spawned.append(str(args)), popen(self, args, *a, **k))[1]
import kernels
from compiling import compile_step
from decode import decode_one_token, generate
from packed_cache import load_packed
model = load_packed(sys.argv[1])  # as generate.py: the second run maps what the first packed
with torch.no_grad():
    tokens = generate(model, torch.tensor([3, 4, 5]), 8, decode_fn=compile_step(decode_one_token, "cpu"))
    assert tokens.tolist() == generate(model, torch.tensor([3, 4, 5]), 8).tolist()
print(spawned, file=sys.stderr)
print(len(spawned), int("torch._dynamo" in sys.modules), int("torch._inductor" in sys.modules),
      int(kernels.from_file(model.output.packed)))
"""


def test_a_saved_step_loads_without_dynamo_or_inductor(tmp_path):
    """A second process, as a second run of generate.py, maps the packed model the first kept
    (packed_cache.py) and decodes with the compiled step the first saved, as eager does, without
    importing dynamo or inductor and without starting a single subprocess (a compiler, a probe of
    the CPU's instruction sets): the start of a warm run is loading two files."""
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    env = dict(os.environ, BRISK_COMPILE_CACHE=str(tmp_path / "compiled"), BRISK_PACKED_CACHE=str(tmp_path / "packed"),
               PYTHONPATH=str(Path(kernels.__file__).parent))
    path = save_and_convert(make_hf_model("llama31", seed=5), tmp_path)
    runs = [subprocess.run([sys.executable, "-c", LOAD_IN_A_NEW_PROCESS, str(path)], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert "compiling: compiled " in runs[0].stderr and "compiling: loaded " in runs[1].stderr
    cold, warm = [list(map(int, r.stdout.split()[-4:])) for r in runs]
    assert cold[0] > 0 and cold[1:3] == [1, 1] and cold[3] == 0, cold  # the first run compiled, and packed
    assert warm == [0, 0, 0, 1], (runs[1].stderr[-3000:] + f"warm run: {warm[0]} subprocesses, dynamo {warm[1]}, "
                                  f"inductor {warm[2]}, mapped {warm[3]}")


@pytest.mark.parametrize("family", ["llama31", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_packed_model_decodes_any_cache_length_with_one_graph(tmp_path, capfd, family):
    """Generations whose caches differ in length (prompt + new tokens) share the compiled step's one
    package, token for token as eager, also after a cache grows (qwen3_5: linear attention's state
    among the package's inputs, as the caches are)."""
    from compiling import compile_step
    from decode import decode_one_token, generate
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    model = kernels.pack_for_cpu(load_model(save_and_convert(make_hf_model(family, seed=6), tmp_path)))
    decode_fn = compile_step(decode_one_token, "cpu")
    capfd.readouterr()
    for prompt_len, new_tokens in ((4, 6), (9, 12), (3, 30)):
        prompt = torch.arange(5, 5 + prompt_len)
        eager = generate(model, prompt, new_tokens)
        compiled = generate(model, prompt, new_tokens, decode_fn=decode_fn)
        assert compiled.tolist() == eager.tolist(), (prompt_len, new_tokens)
    err = capfd.readouterr().err
    assert err.count("compiling: compiled ") + err.count("compiling: loaded ") == 1, err


def test_compiled_sampling_draws_as_eager_does(tmp_path, monkeypatch):
    """A packed model's compiled step samples from torch's generator (compiling.export_and_package:
    fallback_random), so under the same seed it picks the same tokens as eager, with top-k and
    top-p too; a damaged package compiles again, with a message, and decodes the same."""
    from compiling import compile_step
    from decode import decode_one_token, generate
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    monkeypatch.setenv("BRISK_COMPILE_CACHE", str(tmp_path / "compiled"))
    model = kernels.pack_for_cpu(load_model(save_and_convert(make_hf_model("llama31", seed=7), tmp_path)))
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95)

    def run(decode_fn=decode_one_token):
        torch.manual_seed(11)
        return generate(model, torch.arange(5, 12), 24, decode_fn=decode_fn, **sampling).tolist()
    eager = run()
    assert run(compile_step(decode_one_token, "cpu")) == eager
    assert eager != generate(model, torch.arange(5, 12), 24).tolist(), "sampled as greedy: the test would prove nothing"
    (package,) = (tmp_path / "compiled").glob("*.pt2")
    package.write_bytes(b"not a package")
    proc = subprocess.run([sys.executable, "-c", SAMPLE_IN_A_NEW_PROCESS, str(tmp_path / "model.pth")],
                          env=dict(os.environ, PYTHONPATH=str(Path(kernels.__file__).parent)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "does not load (RuntimeError); compiling again" in proc.stderr and "compiling: compiled" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == eager


def test_a_step_that_does_not_export_compiles_through_dynamo(tmp_path, capfd):
    """A step whose code branches on the caches' length cannot be exported for caches of any
    length: it says so in one line and runs through dynamo instead, with the eager model's logits."""
    from compiling import compile_step
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU")
    model = kernels.pack_for_cpu(load_model(save_and_convert(make_hf_model("llama31", seed=8), tmp_path)))
    model.setup_caches(max_batch_size=1, max_seq_length=24)
    step = lambda m, x, p: m(x, p) * (2 if m.rope_cos_sin.shape[0] == 24 else 1)  # noqa: E731
    x, pos = torch.tensor([[3]]), torch.tensor([4], dtype=torch.int)
    with torch.no_grad():
        torch.testing.assert_close(compile_step(step, "cpu")(model, x, pos), 2 * model(x, pos), atol=1e-4, rtol=1e-4)
    err = capfd.readouterr().err
    assert "could not be compiled ahead of time (" in err and "; compiling it through dynamo" in err, err


SAMPLE_IN_A_NEW_PROCESS = """
import json, sys, torch
import kernels
from compiling import compile_step
from decode import decode_one_token, generate
from load import load_model
from model import RMSNorm
model = kernels.pack_for_cpu(load_model(sys.argv[1]))
torch.manual_seed(11)
print(json.dumps(generate(model, torch.arange(5, 12), 24, decode_fn=compile_step(decode_one_token, "cpu"),
                          temperature=0.9, top_k=40, top_p=0.95).tolist()))
"""


def test_hooks_move_with_the_module(isa):
    """tp.py's collectives are forward hooks on the projections: packing keeps them."""
    linear = nn.Linear(8, 4)
    linear.register_forward_hook(lambda module, inputs, output: output * 2)
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.PackedLinear(linear, isa)(x), linear(x))


def test_kernels_build_here():
    """With AVX2 and a C++ compiler, kernels.cpp must build: a compile error fails here rather than
    skipping every test above."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or " avx2 " not in cpuinfo.read_text() or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no AVX2 or no C++ compiler here")
    assert kernels.best_isa() != ""


UNDER_AVX2 = """
import json, sys, torch
import kernels, quantized
from compiling import compile_step
from decode import decode_one_token, generate
from load import load_model
out = dict(isa=kernels.best_isa(), bf16_dot=kernels.bf16_dot(), attention=kernels.avx512_attention(),
           logits={}, kernels={})
products = (torch.nn.Linear, kernels.PackedLinear, quantized.Int8Linear, quantized.Int4Linear)
for name, path, precision in json.loads(sys.argv[1]):
    model = kernels.pack_for_cpu(load_model(path, "cpu", getattr(torch, precision)))
    out["kernels"][name] = sorted({getattr(m, "isa", type(m).__name__) for m in model.modules()
                                   if isinstance(m, products)})
    attention = [layer.attention for layer in model.layers]
    out["prompt_attention"] = all(a.attend_prompt is kernels.prompt_attention and
                                  a.attend_cache.func is kernels.cache_attention for a in attention)
    with torch.no_grad():
        model.setup_caches(max_batch_size=1, max_seq_length=16)
        model(torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5), from_start=True)  # prefill's prompt kernel
        out["logits"][name] = model(torch.tensor([[9]]), torch.tensor([5], dtype=torch.int))[0, -1].float().tolist()
    if name in ("fp32", "bf16", "int4"):  # inductor's AVX2 code around kernels.cpp's: token for token as eager
        prompt = torch.tensor([3, 1, 4, 1, 5])
        assert generate(model, prompt, 6, decode_fn=compile_step(decode_one_token, "cpu")).tolist() == \\
            generate(model, prompt, 6).tolist(), name
print(json.dumps(out))
"""


def test_an_avx2_cpu_runs_what_it_has(tmp_path):
    """Under PyTorch's cap on its CPU kernels (ATEN_CPU_CAPABILITY=avx2) an AVX-512 machine runs what
    a CPU with AVX2 alone (AMD Zen 3) runs: kernels.cpp's AVX2 products for fp32, bf16 (widened to
    fp32), int8 and int4 (integer products), attention (prompts, decode steps) on attention.cpp's AVX2
    code. Their logits after a prompt equal the
    unpacked fp32 model's (int8 / int4: with the weights dequantized, within the int8 rounding of
    the activations) and the compiled step (inductor's AVX2 code around them) decodes as eager, so
    the paths of a whole AVX2 model are tested here, not only its kernels."""
    import quantize
    from test_quantize import KERNEL_ERRORS, dequantized_model, rel_error
    if "avx2" not in kernel_isas():
        pytest.skip("this CPU has no AVX2")
    path = save_and_convert(make_hf_model("llama31", seed=4), tmp_path)
    int8, int4 = quantize.quantize_checkpoint(path, "int8"), quantize.quantize_checkpoint(path, "int4", 32)
    cases = [("fp32", str(path), "float32"), ("bf16", str(path), "bfloat16"), ("int8", str(int8), "float32"),
             ("int4", str(int4), "float32")]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=str(Path(kernels.__file__).parent))
    done = subprocess.run([sys.executable, "-c", UNDER_AVX2, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert (got["isa"], got["bf16_dot"], got["attention"], got["prompt_attention"]) == ("avx2", False, False, True)
    assert got["kernels"] == {"fp32": ["avx2"], "bf16": ["avx2"], "int8": ["avx2"], "int4": ["avx2"]}
    bounds = {"fp32": 1e-5, "bf16": 2e-2, "int8": KERNEL_ERRORS["avx2"], "int4": KERNEL_ERRORS["avx2"]}
    for name, checkpoint, _ in cases:
        reference = load_model(path) if name in ("fp32", "bf16") else dequantized_model(path, checkpoint)
        with torch.no_grad():  # as the child steps
            reference.setup_caches(max_batch_size=1, max_seq_length=16)
            reference(torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5), from_start=True)
            expected = reference(torch.tensor([[9]]), torch.tensor([5], dtype=torch.int))[0, -1]
        assert rel_error(torch.tensor(got["logits"][name]), expected) < bounds[name], name


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


def test_release_pages_of_a_mapped_checkpoint(tmp_path):
    """Packing copies each weight: the checkpoint's memory-mapped original gives its pages back at
    once (read again from the file if touched, so its values stay), while a tensor in anonymous
    memory is left alone (there the kernel would zero the pages)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("madvise on Linux only")

    def resident_file_mb():
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status["RssFile"].split()[0]) / 1024

    torch.save({"w": torch.randn(64, 2**18)}, tmp_path / "w.pth")  # 64 MiB
    w = torch.load(tmp_path / "w.pth", mmap=True, weights_only=True)["w"]
    total = w.sum().item()  # reads every page
    before = resident_file_mb()
    kernels.release_pages(w)
    assert before - resident_file_mb() > 60
    assert w.sum().item() == total
    anonymous = torch.randn(2**20)
    total = anonymous.sum().item()
    kernels.release_pages(anonymous)
    assert anonymous.sum().item() == total


@pytest.mark.parametrize("into", ["new", "out"])
def test_copy_out_of_a_mapped_checkpoint(tmp_path, into):
    """An untied embedding table copied out of the checkpoint (or a kept packed weight into memory
    of huge pages: out=) a part at a time: the same values, none of the file's pages left resident
    (a whole copy leaves all of them, beside the copy), and at no point more than a part of them
    beside the copy (a whole copy released after it peaks at both)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("madvise on Linux only")

    def status_mb(field):
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status[field].split()[0]) / 1024

    torch.save({"w": torch.randn(64, 2**18)}, tmp_path / "w.pth")  # 64 MiB: four parts of 16
    w = torch.load(tmp_path / "w.pth", mmap=True, weights_only=True)["w"]
    out = torch.zeros_like(w) if into == "out" else None  # its pages resident before the copy
    before = status_mb("RssFile")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident memory now
    base = status_mb("VmHWM")
    copy = kernels.copy_out(w, out=out)
    assert status_mb("RssFile") - before < 8
    assert status_mb("VmHWM") - base < (16 if into == "out" else 64 + 16) + 8
    assert copy.data_ptr() != w.data_ptr() and torch.equal(copy, w)
    assert out is None or copy is out


def test_int4_packed_in_parts_equals_whole(isa):
    """quantized.pack_stored_int4 (a few rows at a time, as a first start loads an int4 output
    projection) writes what pack_int4 of the whole unpacked weight does, a partial last block too."""
    torch.manual_seed(0)
    stored, sz = quantized.quantize_int4(torch.randn(200, 96), 32)
    whole, _ = kernels.pack_int4(quantized.unpack_int4(stored), sz, isa)
    assert torch.equal(quantized.pack_stored_int4(stored, isa, rows=64), whole)


needs_cache_attention = pytest.mark.skipif(not kernels.best_isa(), reason="attention.cpp's kernels need AVX2")


def attention_reference(q, k_cache, v_cache, rows, mask, scale):
    """softmax(q k^T scale, masked) v in float64, the cache rows gathered."""
    B = q.shape[0]
    picked = rows if rows is not None else torch.arange(B)
    k, v = (c[picked][:, :, :mask.shape[-1]].double() for c in (k_cache, v_cache))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    return (torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v).to(q.dtype)


@needs_cache_attention
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("B,H,R,D", [(1, 3, 3, 64), (1, 1, 1, 12), (2, 2, 4, 24), (3, 8, 4, 128), (1, 2, 16, 256),
                                     (2, 3, 40, 64), (1, 2, 100, 80)])
@pytest.mark.parametrize("S", [1, 17, 64, 300])
def test_cache_attention_equals_float64_reference(simd_isa, dtype, cache_dtype, B, H, R, D, S):
    """attention.cpp's decode attention: one mask for all sequences or one each, cache rows picked
    out of a larger cache, positions past the mask's length (stale values) never read, contexts
    shorter than the cache, and lengths that split into several chunks per head; fp32 query rows
    over a bf16 cache too (--kv_cache_dtype bfloat16), exact to fp32 arithmetic on the cache's
    values; more than 16 rows a head (40, 100: a prompt's chunk) through the tiled path. AVX-512 and
    AVX2 (features past whole vectors of 8: 12, 24)."""
    torch.manual_seed(B * 1000 + D + S)
    rows_total, cache_S = B + 2, S + 5
    k_cache = torch.randn(rows_total, H, cache_S, D).to(cache_dtype)
    v_cache = torch.randn(rows_total, H, cache_S, D).to(cache_dtype)
    k_cache[:, :, S:] = v_cache[:, :, S:] = float("nan")  # past S: never read
    q = torch.randn(B, H, R, D).to(dtype)
    rows = torch.randperm(rows_total)[:B]
    # Random masks, and causal ones of a context shorter than the cache (each sequence's own length).
    lengths = torch.randint(1, S + 1, (B, 1, 1, 1))
    causal = torch.arange(S) < lengths - torch.arange(R)[:, None].clamp(max=lengths.min() - 1)
    for mask in (torch.rand(R, S) < 0.7, torch.rand(B, 1, R, S) < 0.7, causal[0, 0], causal):
        mask[..., 0] = True  # every query row sees a position
        for picked in (None, rows):
            got = kernels.cache_attention(q, k_cache, v_cache, picked, mask, D ** -0.5, simd_isa)
            expected = attention_reference(q, k_cache, v_cache, picked, mask, D ** -0.5)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got, expected, **tol)


@needs_cache_attention
@pytest.mark.parametrize("R", [3, 40])
def test_cache_attention_reads_the_visible_span(simd_isa, R):
    """Each row sees one stretch of a long mask (an engine's slot of 1000 positions, of which a
    sequence sees a few), starting and ending on either side of the kernel's 64-position scan
    blocks, one row seeing nothing (its output is not compared: softmax over nothing): a span cut
    short by one position at either end drops a position some row sees. The cache outside every
    row's stretch is NaN (never added in)."""
    torch.manual_seed(R)
    B, H, D, S = 3, 2, 64, 1000
    bounds = [(0, 1), (63, 64), (64, 129), (5, 999), (130, 1000), (700, 700)]
    starts = torch.tensor([bounds[(b + r) % len(bounds)][0] for b in range(B) for r in range(R)]).view(B, 1, R, 1)
    ends = torch.tensor([bounds[(b + r) % len(bounds)][1] for b in range(B) for r in range(R)]).view(B, 1, R, 1)
    mask = (torch.arange(S) >= starts) & (torch.arange(S) < ends)
    k_cache, v_cache = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    for b in range(B):
        seen = mask[b, 0].any(0)
        first, last = seen.nonzero().min(), seen.nonzero().max() + 1
        k_cache[b, :, :first] = v_cache[b, :, :first] = float("nan")
        k_cache[b, :, last:] = v_cache[b, :, last:] = float("nan")
    q = torch.randn(B, H, R, D)
    got = kernels.cache_attention(q, k_cache, v_cache, None, mask, D ** -0.5, simd_isa)
    expected = attention_reference(q, k_cache.nan_to_num(), v_cache.nan_to_num(), None, mask, D ** -0.5)
    sees = mask.any(-1)[:, 0]  # [B, R]
    torch.testing.assert_close(got.transpose(1, 2)[sees], expected.transpose(1, 2)[sees], rtol=1e-5, atol=1e-5)


@needs_cache_attention
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_cache_attention_over_sliding_windows(simd_isa, cache_dtype, per_sequence):
    """A sliding window's layer (Gemma 3's local layers, Mistral's): the kernel reads from the first
    position any query row sees, its chunks offset from there; equal to the reference, one window for
    all sequences or each sequence its own."""
    torch.manual_seed(1)
    B, H, R, D, S, W = 2, 2, 4, 64, 700, 150
    k_cache, v_cache = (torch.randn(B, H, S, D).to(cache_dtype) for _ in range(2))
    q = torch.randn(B, H, R, D)
    lengths = torch.tensor([700, 520] if per_sequence else [700, 700]).view(B, 1, 1, 1)
    before = lengths - torch.arange(R)[:, None]  # row r: the token r before the last
    mask = (torch.arange(S) < before) & (torch.arange(S) >= before - W)
    mask = mask if per_sequence else mask[0, 0]
    got = kernels.cache_attention(q, k_cache, v_cache, None, mask, D ** -0.5, simd_isa)
    torch.testing.assert_close(got, attention_reference(q, k_cache, v_cache, None, mask, D ** -0.5),
                               rtol=1e-5, atol=1e-5)


@needs_cache_attention
@pytest.mark.parametrize("family,kv_cache_dtype", [("llama31", None), ("mistral", None), ("gemma3", None),
                                                   ("head_dim", None), ("llama31", torch.bfloat16),
                                                   ("gemma3", torch.bfloat16)])
def test_cache_attention_in_the_model(family, kv_cache_dtype, tmp_path):
    """A packed model's prompt and decode steps on the kernels against the same model on model.py's
    own attention: logits of the prompt and of every step, and the engine's ragged batch (per-row
    positions, cache rows, prompts in chunks; the sliding windows and local RoPE of mistral / gemma3;
    head_dim 24, which keeps SDPA for prompts, and 32) token for token; also with a bf16 cache under
    fp32 activations, which model.py's attention reads cast to fp32."""
    from decode import generate
    from engine import Engine, Request
    model = kernels.pack_for_cpu(load_model(save_and_convert(make_hf_model(family, max_position_embeddings=384),
                                                            tmp_path)))
    model.kv_cache_dtype = kv_cache_dtype
    attention = [layer.attention for layer in model.layers]
    assert all(a.attend_cache.func is kernels.cache_attention for a in attention)
    whole_vectors = attention[0].head_dim % 16 == 0  # prompt_attention's condition
    assert all(a.attend_prompt is (kernels.prompt_attention if whole_vectors else None) for a in attention)

    def model_py_attention(on: bool):
        for a in attention:
            a.attend_cache = None if on else kernels.cache_attention
            a.attend_prompt = None if on or not whole_vectors else kernels.prompt_attention

    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    steps = []
    for on in (True, False):
        model_py_attention(on)
        model.setup_caches(max_batch_size=1, max_seq_length=80)
        with torch.no_grad():
            prompt = model(ids[:, :20], torch.arange(20), from_start=True)  # as prefill runs it
            steps.append(torch.cat([prompt[0]] + [model(ids[:, t:t + 1], torch.tensor([t]))[0] for t in range(20, 60)]))
    assert attention[0].kv_cache.k_cache.dtype == (kv_cache_dtype or torch.float32)
    # Both sum in fp32 in their own order (the kernel within 1e-5 of float64: the tests above); over a
    # bf16 cache Gemma 3's 40 steps drift apart by up to 2e-4 on AVX2 (8-lane sums).
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-4, atol=3e-4 if kv_cache_dtype else 1e-4)

    class Ids:
        eos_ids = []

        def decode(self, ids):
            return " ".join(map(str, ids))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 50, 17, 120)]
    model_py_attention(True)
    alone = [generate(model, torch.tensor(p), 12)[0, len(p):].tolist() for p in prompts]
    model_py_attention(False)
    # Whole prompts from position 0 (the prompt kernel), and chunks of 24 tokens: later chunks and
    # ragged groups read the cache through the cache kernel's tiled rows.
    for chunk in (512, 24):
        engine = Engine(model, Ids(), max_batch_size=3, max_seq_length=200, prefill_chunk=chunk)
        assert not engine.kv_buckets  # every decode step over the whole cache, the kernel reading what rows see
        results = engine.generate([Request(p, 12) for p in prompts])
        assert [r.token_ids for r in results] == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,KV,D", [(1, 9, 3, 64), (2, 4, 4, 16), (1, 8, 2, 128), (1, 4, 1, 256), (2, 6, 2, 80)])
@pytest.mark.parametrize("T", [1, 31, 33, 64, 130])
def test_prompt_attention_equals_float64_reference(simd_isa, dtype, B, H, KV, D, T):
    """attention.cpp's prompt attention (causal, from position 0), AVX-512 and AVX2: GQA groups of
    1-4 heads, feature counts of 1 to 16 vectors of 16 (80: AVX-512's tiles of 4 vectors and 1),
    prompts shorter than a block and across blocks of queries (32) and keys (64; AVX2 scores only the
    keys some row sees: 16 at a time), inputs as the model hands them (views of [B, T, heads, D]
    transposed), against SDPA's causal attention in float64."""
    torch.manual_seed(B * 1000 + D + T)
    q, k, v = (torch.randn(B, T, n, D).to(dtype).transpose(1, 2) for n in (H, KV, KV))
    got = kernels.prompt_attention(q, k, v, D ** -0.5, simd_isa)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=D ** -0.5,
                                              enable_gqa=True).transpose(1, 2).reshape(B, T, H * D)
    assert got.dtype == dtype and got.shape == (B, T, H * D)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.double(), expected, **tol)


def test_casting_a_checkpoint_never_holds_both_copies(tmp_path):
    """bf16 from an fp32 checkpoint: each weight's memory-mapped pages go as soon as its bf16 copy
    exists (load.to_device), so the fp32 file never sits in memory beside the bf16 model (the
    peak of loading was the fp32 file plus the bf16 copy, 3x the bf16 weights; 1.4x now). In a fresh
    process, whose memory peak is that of loading alone."""
    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM and madvise on Linux only")
    from model import ModelArgs, Transformer
    config = ModelArgs(n_layer=8, dim=1024, n_head=8, vocab_size=8192, intermediate_size=2048)  # 384 MiB in fp32
    config.to_json(tmp_path / "config.json")
    torch.save(Transformer(config).state_dict(), tmp_path / "model.pth")
    # Building the model on the meta device imports torch._dynamo (nn.init's meta kernels), and with
    # it triton where installed (CUDA builds of torch): 80-160 MB of code, not the weights counted here.
    code = ("import torch, torch._dynamo, load\n"
            "def kb(key): return int(dict(l.split(':', 1) for l in open('/proc/self/status'))[key].split()[0])\n"
            "before = kb('VmRSS')\n"
            f"m = load.load_model({str(tmp_path / 'model.pth')!r}, precision=torch.bfloat16)\n"
            "print((kb('VmHWM') - before) / 1024, load.model_bytes(m) / 2**20)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peak_mb, bf16_mb = map(float, done.stdout.split())
    assert peak_mb < 2 * bf16_mb, f"loading peaked {peak_mb:.0f} MB above the start for {bf16_mb:.0f} MB of weights"


def bf16_ulps(a, b):
    """The largest difference of a and b in units of b's bf16 spacing (0: equal)."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@pytest.fixture(params=["avx512", "avx2"])
def simd_isa(request):
    """The instruction sets of rowwise.cpp's and attention.cpp's prompt kernels this CPU runs."""
    if request.param not in kernel_isas() or request.param == "avx512" and not kernels.avx512_attention():
        pytest.skip(f"this CPU has no {request.param}")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_rowwise_kernels_equal_model_code(simd_isa, dtype, rows):
    """rowwise.cpp's RMSNorm (with and without Gemma's offset), RoPE (a strided slice of a qkv
    projection; whole and partial rotary; one table for all rows, as [T, ...] or [1, T, ...], and one
    per row) and SwiGLU gate, AVX-512 and AVX2,
    against model.py's own PyTorch code: fp32 within float rounding, bf16 equal but for a few
    values one bf16 step apart (where sums in another order round the other way; a result not
    rounded where model.py rounds it differs in many). Features that are no multiple of 16 (and
    of 8) exercise the masked tails."""
    from rope import apply_rope, precompute_rope
    g = torch.Generator().manual_seed(rows)

    def close(got, expected):
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
        else:
            assert got.dtype == torch.bfloat16 and bf16_ulps(got, expected) <= 1.0
            assert (got != expected).float().mean().item() < 0.01

    for dim, offset in ((36, 0.0), (576, 0.0), (36, 1.0)):
        norm = RMSNorm(dim, 1e-6, offset).to(dtype)
        norm.weight.data = torch.randn(dim, generator=g).to(dtype)
        x = (torch.randn(2, rows, dim, generator=g) * 3).to(dtype)
        close(kernels.rms_norm(x, norm.weight, norm.eps, norm.offset, simd_isa), norm(x))
    for hidden in (20, 1536):
        gate_up = (torch.randn(2, rows, 2 * hidden, generator=g) * 4).to(dtype)
        gate, up = gate_up.split(hidden, dim=-1)
        close(kernels.silu_mul(gate_up, hidden, simd_isa), F.silu(gate) * up)
    heads, head_dim = 3, 24
    qkv = torch.randn(2, rows, (heads + 4) * head_dim, generator=g).to(dtype)
    q = qkv[..., :heads * head_dim].view(2, rows, heads, head_dim)  # strided, as Attention splits it
    for rope_dim in (24, 16):
        table = precompute_rope(400, rope_dim, 10000.0)
        for rope in (table[torch.arange(rows) + 300], table[torch.randint(0, 400, (2, rows), generator=g)],
                     table[torch.arange(rows)[None] + 5]):  # [T, rd, 2], [B, T, rd, 2], [1, T, rd, 2]
            got = kernels.rotate(q, rope)
            assert got.is_contiguous()
            close(got, apply_rope(q, rope))


@pytest.mark.skipif(not kernels.best_isa(), reason="kernels.cpp has no code for this CPU (or no compiler)")
@pytest.mark.parametrize("family", ["llama31", "gemma3", "qwen3", "olmo2", "phi4_longrope", "smollm3"])
def test_rowwise_kernels_in_the_model_match_transformers(family, tmp_path):
    """A packed model (pack_for_cpu: rowwise.cpp's norms, RoPE and gates attached) against
    transformers: a prompt's logits and 24 greedy tokens decoded a step at a time. The families
    cover Gemma's offset norms and GeGLU (no gate kernel), q/k norms per head (Qwen3) and over the
    projection (OLMo 2), partial rotary (Phi-4), layers without RoPE (SmolLM3)."""
    from decode import generate
    hf = make_hf_model(family, seed=9)
    model = kernels.pack_for_cpu(load_model(save_and_convert(hf, tmp_path)))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is kernels.rms_norm for m in norms)
    assert all(layer.attention.rotate is kernels.rotate for layer in model.layers)
    gated = [layer.feed_forward for layer in model.layers if isinstance(layer.feed_forward, kernels.PackedFeedForward)]
    assert gated and all((m.gate_kernel is kernels.silu_mul) == (m.act is F.silu) for m in gated)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    model.setup_caches(max_batch_size=1, max_seq_length=64)
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(model(ids, torch.arange(12), from_start=True), expected, atol=1e-4, rtol=1e-4)
        ours = generate(model, ids[0], 24)
        theirs = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0]
    assert ours[0].tolist() == theirs.tolist()
    assert len(set(ours[0, 12:].tolist())) > 3, "degenerate test: the model repeats one token"
