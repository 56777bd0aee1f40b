"""Speculative decoding: exactly greedy at temperature 0, exactly the target's distribution when sampling."""
import pytest
import torch

from conftest import make_hf_model, save_and_convert
import quantize
from decode import generate
from generate import cli
from load import load_model
from speculative import accept_draft, ngram_draft, speculative_generate

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7])
CHI2_4DOF = 18.47  # chi-square critical value for 4 degrees of freedom at p = 0.001


def write_tokenizer(directory, prefix="t", size=256):
    """A word-level tokenizer.json: token i is the word f"{prefix}{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(size)}, unk_token=f"{prefix}0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: thread synchronisation costs more than the arithmetic (20x on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Target, an unrelated draft with the same vocabulary, and one with another vocabulary."""
    out = {}
    for name, family, seed, overrides in [("target", "llama31", 0, {}), ("other", "qwen2", 1, {}),
                                          ("vocab300", "llama2", 2, dict(vocab_size=300))]:
        root = tmp_path_factory.mktemp(name)
        out[name] = save_and_convert(make_hf_model(family, seed=seed, **overrides), root)
        write_tokenizer(root, size=overrides.get("vocab_size", 256))
    return out


@pytest.fixture(scope="module")
def models(paths):
    # The self-draft is a second instance: each model owns its KV cache.
    return {"target": load_model(paths["target"]), "self": load_model(paths["target"]),
            "int8": load_model(quantize.quantize_checkpoint(paths["target"], "int8")),
            "other": load_model(paths["other"])}


def speculate(models, drafter, k, max_new_tokens, **kwargs):
    accepted = []
    draft = dict(ngram=3) if drafter == "ngram" else dict(draft_model=models[drafter])
    out = speculative_generate(models["target"], PROMPT, max_new_tokens, k=k, accepted=accepted, **draft, **kwargs)
    return out[0].tolist(), accepted


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("drafter", ["self", "int8", "other", "ngram"])
def test_greedy_equals_plain_greedy(models, drafter, k):
    target = models["target"]
    plain = generate(target, PROMPT, 40)[0].tolist()
    spec, accepted = speculate(models, drafter, k, 40)
    assert spec == plain
    if drafter == "self":  # the same model drafts exactly what the target picks
        assert accepted == [k] * len(accepted)
    elif drafter == "int8":
        assert sum(accepted) > 0.7 * k * len(accepted), "the quantized twin should agree mostly"
    elif drafter == "other":
        assert sum(accepted) < k * len(accepted), "the unrelated draft was never rejected"
    else:
        assert sum(accepted) > 0, "prompt lookup never proposed a right token: a vacuous test"

    # Self-drafting emits blocks of k + 1 tokens after the prefill's token: new tokens 1..k+1, k+2..2k+2, ...
    mid_block = 2 + 2 * (k + 1)  # the first token of the third block
    assert speculate(models, drafter, k, mid_block)[0] == plain[:len(PROMPT) + mid_block]

    # EOS: the first occurrence of a token that self-drafting emits as a draft token (not the bonus).
    new = plain[len(PROMPT):]
    j = next(j for j in range(2, len(new)) if new[j] not in new[:j] and (j - 1) % (k + 1) != k)
    expected = generate(target, PROMPT, 40, eos_ids=[new[j]])[0].tolist()
    assert len(expected) == len(PROMPT) + j + 1
    assert speculate(models, drafter, k, 40, eos_ids=[new[j]])[0] == expected


def test_accept_draft_reproduces_target_distribution():
    torch.manual_seed(0)
    # k = 3 draft positions (+ the bonus position), 5 tokens; zeros where p or q rules a token out.
    p = torch.tensor([[0.4, 0.3, 0.15, 0.15, 0.0], [0.05, 0.05, 0.1, 0.3, 0.5],
                      [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.6, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.5, 0.2, 0.1, 0.1, 0.1], [0.0, 0.0, 0.5, 0.5, 0.0]])
    B = 20000
    draft = torch.multinomial(q, B, replacement=True).T  # (B, 3), row i of q drafts position i
    n, next_token = accept_draft(draft, q.expand(B, -1, -1), p.expand(B, -1, -1))
    emitted = torch.cat([draft, torch.full((B, 1), -1)], dim=1)
    emitted[torch.arange(B), n] = next_token  # the accepted drafts, then the resampled or bonus token

    def chi2(tokens, probs):
        counts = torch.bincount(tokens, minlength=5).double()
        assert counts[probs == 0].sum() == 0, "emitted a token the target rules out"
        expected = probs.double() * len(tokens)
        return float(((counts - expected) ** 2 / expected)[probs > 0].sum())

    for i in range(4):  # position i is emitted when the first i drafts were accepted
        tokens = emitted[n >= i, i]
        assert len(tokens) > 1000
        assert chi2(tokens, p[i]) < CHI2_4DOF, f"position {i}"
    # Test of the test: "always accept" would emit the drafts, distributed as q.
    with pytest.raises(AssertionError):
        assert chi2(draft[:, 0], p[0]) < CHI2_4DOF
    assert chi2(draft[:, 1], p[1]) > 10 * CHI2_4DOF


def test_sampling_end_to_end_matches_target(tmp_path):
    """Tokens 2 and 3 (drafted, verified, maybe resampled) follow the target's exact marginals."""
    target = load_model(save_and_convert(make_hf_model("llama2", seed=5, vocab_size=8), tmp_path / "t"))
    draft = load_model(save_and_convert(make_hf_model("qwen2", seed=6, vocab_size=8), tmp_path / "d"))
    prompt = torch.tensor([1, 2, 3])
    with torch.no_grad():  # exact marginals by enumerating every continuation
        target.setup_caches(64, 5)
        conts = torch.cartesian_prod(torch.arange(8), torch.arange(8))  # (64, 2)
        ids = torch.cat([prompt.expand(64, -1), conts], dim=1)
        probs = torch.softmax(target(ids, torch.arange(5)).double(), dim=-1)  # (64, 5, 8)
        p1 = probs[0, 2]  # (8,) next-token probabilities after the prompt
        p12 = p1[:, None] * probs[::8, 3]  # (8, 8): P(x1, x2)
        p3 = (p12.reshape(64, 1) * probs[:, 4]).sum(0)  # (8,)
    torch.manual_seed(0)
    N, accepted = 1500, []
    samples = torch.stack([speculative_generate(target, prompt, 3, draft_model=draft, k=2, temperature=1.0,
                                                accepted=accepted)[0, 4:] for _ in range(N)])
    assert 0 < sum(accepted) < 2 * N, "the draft was always or never accepted: a weak test"
    for tokens, probs in [(samples[:, 0], p12.sum(0)), (samples[:, 1], p3)]:
        counts = torch.bincount(tokens, minlength=8).double()
        keep = probs * N >= 5  # chi-square needs expected counts of a few at least
        expected = probs * N
        stat = float(((counts - expected) ** 2 / expected)[keep].sum())
        assert stat < 24.32, counts.tolist()  # 7 degrees of freedom at p = 0.001 (fewer cells only lower it)


def test_ngram_draft():
    t = torch.tensor
    assert ngram_draft(t([1, 2, 3, 4, 1, 2]), 2, 3).tolist() == [3, 4, 1]
    assert ngram_draft(t([1, 2, 9, 5, 2, 8, 1, 2]), 2, 3).tolist() == [9, 5, 2]  # the longest match wins
    assert ngram_draft(t([1, 2, 9, 5, 2, 8, 1, 2]), 1, 2).tolist() == [8, 1]  # then the latest
    assert ngram_draft(t([5, 6, 5, 6]), 2, 5).tolist() == [5, 6, 5, 6, 5]  # extends past the end periodically
    assert ngram_draft(t([1, 2, 3]), 2, 2).tolist() == [3, 3]  # no match: repeat the last token
    assert ngram_draft(t([4]), 3, 2).tolist() == [4, 4]


def test_batch_refused(models):
    with pytest.raises(ValueError, match="batch_size 1"):
        speculative_generate(models["target"], PROMPT, 8, ngram=2, batch_size=2)


def test_cli(paths, capsys):
    base = ["--checkpoint_path", str(paths["target"]), "--synthetic_prompt_len", "8", "--temperature", "0",
            "--max_new_tokens", "30", "--device", "cpu"]
    cli(base)
    plain = capsys.readouterr().out
    for extra in [["--speculate_ngram", "2", "--speculate_k", "3"], ["--draft_checkpoint_path", str(paths["other"])]]:
        cli(base + extra)
        out, err = capsys.readouterr()
        assert out == plain
        assert "mean accepted" in err


@pytest.mark.parametrize("problem", ["vocab_size", "tokenizer", "both"])
def test_cli_refuses_mismatched_draft(paths, tmp_path, capsys, problem):
    base = ["--checkpoint_path", str(paths["target"]), "--synthetic_prompt_len", "8", "--max_new_tokens", "4"]
    if problem == "vocab_size":
        draft, message = paths["vocab300"], "vocab_size 300"
    elif problem == "tokenizer":
        draft, message = tmp_path / "model.pth", "decode to different text"
        for f in ("model.pth", "config.json"):
            (tmp_path / f).write_bytes((paths["other"].parent / f).read_bytes())
        write_tokenizer(tmp_path, prefix="w")
    else:
        draft, message = paths["other"], "pass one"
        base += ["--speculate_ngram", "2"]
    with pytest.raises(SystemExit) as e:
        cli(base + ["--draft_checkpoint_path", str(draft)])
    assert message in str(e.value) and str(e.value).startswith("error: ")


@pytest.mark.slow
def test_compiled_equals_eager(models):
    import torch._dynamo
    from compiling import compile_step
    from decode import decode_one_token
    from speculative import verify
    plain = generate(models["target"], PROMPT, 20)[0].tolist()
    torch._dynamo.reset()
    decode_fn = compile_step(decode_one_token, "cpu")
    verify_fn = compile_step(verify, "cpu")
    # One graph per compiled step: a second one would be compiled mid-generation, and with the
    # guards skipped after the first round it raises. "self" accepts every draft, so its extra
    # draft step runs too; prompt lookup then reuses the same verify graph.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for drafter in ["self", "ngram"]:
            spec, _ = speculate(models, drafter, 3, 20, verify_fn=verify_fn, draft_fn=decode_fn)
            assert spec == plain, drafter


@pytest.mark.slow
def test_real_model(default_model):
    """SmolLM2: prompt lookup and an int4 self-draft give greedy's tokens, with drafts accepted."""
    from tokenizer import load_tokenizer
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i + 1}\n" for i in range(8))
    tokenizer = load_tokenizer(default_model.parent)
    prompt = torch.tensor(tokenizer.encode_chat([{"role": "user", "content": "Add type hints:\n" + code}]))
    target = load_model(default_model)
    plain = generate(target, prompt, 48)[0].tolist()
    int4 = load_model(quantize.quantize_checkpoint(default_model, "int4", 32))
    for draft in [dict(ngram=3, k=6), dict(draft_model=int4, k=4)]:
        accepted = []
        assert speculative_generate(target, prompt, 48, accepted=accepted, **draft)[0].tolist() == plain
        assert sum(accepted) > len(accepted), f"fewer than one accepted draft token per step: {accepted}"
