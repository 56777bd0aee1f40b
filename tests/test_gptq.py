"""GPTQ.py: the same int4 layout as round-to-nearest with lower output error on held-out data, layer by
layer on a random model and in perplexity on the real one; identities (H = I gives RTN exactly);
dead inputs; the checkpoint loads and generates."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import GPTQ
import quantize
import quantized
from conftest import save_tokenizer
from decode import generate
from load import load_model
from test_quantize import TINY, dequantized_model, load_without_kernels, logits, save_random_model

ROOT = Path(__file__).resolve().parent.parent


def random_tokens(n, T, seed, vocab=TINY["vocab_size"]):
    # Text-like: a skewed (Zipf) choice of tokens, so the layers' inputs are correlated as in real text.
    probs = 1 / torch.arange(1, vocab + 1, dtype=torch.float)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    return perm[torch.multinomial(probs, n * T, replacement=True, generator=g)].reshape(n, T)


def linear_inputs(model, tokens):
    """{linear name: its inputs [rows, K]} when the full-precision model reads tokens [n, T]."""
    inputs, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda m, args, name=name: inputs.setdefault(name, []).append(args[0].reshape(-1, m.in_features))))
    model.setup_caches(max_batch_size=1, max_seq_length=tokens.shape[1])
    with torch.no_grad():
        for row in tokens:
            model(row[None], torch.arange(tokens.shape[1]))
    for h in hooks:
        h.remove()
    return {name: torch.cat(x) for name, x in inputs.items()}


def output_error(x, w, approx):
    return float((x @ (w - approx).T).norm() / (x @ w.T).norm())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("groupsize", [32, 64])
def test_every_layer_beats_rtn_on_held_out_inputs(tmp_path, groupsize, act_order):
    # Tied output projection (the embedding its quantized rows) and q/k/v bias: the kept biases are exercised too;
    # w2's 160 inputs are padded to a multiple of the group size.
    path = save_random_model(tmp_path, tie_embeddings=True, attention_bias=True)
    original = load_model(path)
    held_out = linear_inputs(original, random_tokens(8, 64, seed=2))
    sd, layers, errors = GPTQ.gptq_model(load_model(path), random_tokens(16, 64, seed=1), groupsize,
                                         act_order=act_order)
    weights = original.state_dict()
    linears = [name for name, spec in layers.items() if spec["kind"] == "int4"]
    assert len(linears) == 2 * 5 + 1
    assert layers["tok_embeddings"] == {"kind": "tied"} and not any(k.startswith("tok_embeddings.") for k in sd)
    for name in linears:
        w = weights[f"{name}.weight"]
        rtn = quantized.dequantize_int4(*quantized.quantize_int4(w, groupsize), groupsize)[:, :w.shape[1]]
        packed, sz = sd[f"{name}.weight"], sd[f"{name}.scales_and_zeros"]
        assert packed.shape == (w.shape[0], quantized.padded_size(w.shape[1], groupsize) // 2)
        assert sz.shape == (quantized.padded_size(w.shape[1], groupsize) // groupsize, w.shape[0], 2)
        gptq = quantized.dequantize_int4(packed, sz, groupsize)[:, :w.shape[1]]
        x = held_out[name]
        assert output_error(x, w, gptq) < output_error(x, w, rtn), name
        assert errors[name][1] < errors[name][0], name  # the progress figures, on the calibration inputs


def test_identity_hessian_gives_rtn():
    # With uncorrelated inputs of equal power there is nothing to compensate: GPTQ is round-to-nearest.
    w = torch.randn(48, 100, generator=torch.Generator().manual_seed(0))
    for act_order in (False, True):
        packed, sz, deq = GPTQ.gptq_quantize(w, torch.eye(100), 32, act_order=act_order)
        rtn_packed, rtn_sz = quantized.quantize_int4(w, 32)
        assert torch.equal(packed, rtn_packed) and torch.equal(sz, rtn_sz)
        assert torch.equal(deq, quantized.dequantize_int4(packed, sz, 32)[:, :100])


@pytest.mark.parametrize("act_order", [False, True])
def test_dead_inputs_give_no_nans(act_order):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(512, 128, generator=g) @ torch.randn(128, 128, generator=g)  # correlated inputs
    x[:, 5] = 0  # one dead input in a live group
    x[:, 64:96] = 0  # a whole dead group
    H = 2 * x.T @ x / x.shape[0]
    packed, sz, deq = GPTQ.gptq_quantize(w, H, 32, act_order=act_order)
    assert torch.isfinite(sz.float()).all() and torch.isfinite(deq).all()
    rtn = quantized.dequantize_int4(*quantized.quantize_int4(w, 32), 32)
    assert output_error(x, w, deq) < output_error(x, w, rtn)
    assert (deq[:, 64:96] == 0).all()  # a dead input's weights are zero: nothing to spend bits on


def test_checkpoint_loads_and_generates(tmp_path, monkeypatch):
    path = save_random_model(tmp_path, vocab_size=320)
    save_tokenizer(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog. Paris is the capital of France."] * 40))
    qpath = quantize.quantize_checkpoint(path, "int4-gptq", 32, calibration_file=corpus, calibration_limit=4,
                                         calibration_seq_length=32, act_order=True)
    assert qpath.name == "model_int4-gptq.g32.pth"
    meta = torch.load(qpath, weights_only=True)["quantization"]
    assert meta["mode"] == "int4-gptq" and meta["bits"] == 4 and meta["groupsize"] == 32
    assert meta["gptq"]["act_order"] is True and meta["gptq"]["percdamp"] == GPTQ.DEFAULT_PERCDAMP
    assert meta["gptq"]["calibration"] == {"source": "file corpus.txt", "samples": 4, "seq_length": 32,
                                           "seed": GPTQ.DEFAULT_SEED}
    # The int4 runtime runs it as it runs RTN int4: equal to the model holding the dequantized weights.
    expected = logits(dequantized_model(path, qpath))
    torch.testing.assert_close(logits(load_without_kernels(qpath, monkeypatch)), expected, rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    out = generate(load_model(qpath), torch.tensor([5, 6, 7]), max_new_tokens=8)
    assert out.shape == (1, 11) and bool((out >= 0).all())


def run_quantize(*args, **env):
    return subprocess.run([sys.executable, "quantize.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def assert_clean_error(r, needle):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and needle in r.stderr, r.stderr


def test_cli_errors(tmp_path):
    path = save_random_model(tmp_path)
    for args, needle in [([], "--calibration_file"),
                         (["--calibration_file", str(tmp_path / "nope.txt")], "no such file"),
                         (["--calibration_file", str(path), "--calibration_seq_length", "4096"], "context")]:
        assert_clean_error(run_quantize("--checkpoint_path", str(path), "--mode", "int4-gptq", *args), needle)
    assert_clean_error(run_quantize("--checkpoint_path", str(path), "--mode", "int4", "--calibration_file", str(path)),
                       "applies to --mode int4-gptq only")


@pytest.mark.slow  # lm_eval indexes its task files for seconds
def test_unreachable_calibration_tasks(tmp_path):
    r = run_quantize("--checkpoint_path", str(save_random_model(tmp_path)), "--mode", "int4-gptq",
                     "--calibration_tasks", "wikitext", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert_clean_error(r, "--calibration_file")


GPL = Path("/usr/share/common-licenses/GPL-3")


@pytest.mark.slow
@pytest.mark.skipif(not GPL.is_file(), reason="needs a local English text (Debian's GPL-3)")
def test_real_model_perplexity(default_model, tmp_path):
    from eval import Scorer
    from tokenizer import load_tokenizer

    text = GPL.read_text()
    (tmp_path / "calibration.txt").write_text(text[:20000])
    held_out = load_tokenizer(default_model.parent).encode(text[20000:])[:1024]
    options = dict(calibration_file=tmp_path / "calibration.txt", calibration_limit=8, calibration_seq_length=256)
    out = default_model.parent  # beside config.json and the tokenizer; names no other test uses
    rtn = quantize.quantize_checkpoint(default_model, "int4", 64, output_path=out / "test_gptq_rtn.pth")
    gptq = quantize.quantize_checkpoint(default_model, "int4-gptq", 64, output_path=out / "test_gptq.pth", **options)

    def perplexity(path):
        model = load_model(path)
        return Scorer(model, load_tokenizer(default_model.parent), max_length=512).perplexity(held_out, 512)[0]

    full, rtn, gptq = perplexity(default_model), perplexity(rtn), perplexity(gptq)
    print(f"held-out perplexity: fp32 {full:.3f}, RTN int4 g64 {rtn:.3f}, GPTQ int4 g64 {gptq:.3f}")
    assert full < gptq < rtn
