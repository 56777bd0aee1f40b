"""The serving engine against single-stream generation: ragged batches, continuous batching,
chunked prefill, slot reuse, seeded sampling, stop strings and bad requests."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model, save_and_convert, save_tokenizer
from decode import generate
from engine import Engine, Request, held_back
from load import load_model
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = (1, 5, 17, 40, 100, 3, 300, 9)  # very different prompt lengths, a slot's later occupant shorter


class IdTokenizer:
    """Token ids as text: the engine's detokenizing and stop strings without a trained tokenizer."""
    eos_ids = []

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> a loaded tiny model whose context fits the longest prompt plus its answer."""
    cache = {}

    def get(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            hf = make_hf_model(family, max_position_embeddings=384, **overrides)
            cache[key] = load_model(save_and_convert(hf, tmp_path_factory.mktemp(family)))
        return cache[key]
    return get


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


_ALONE = {}


def alone(model, prompt, n, eos_ids=()):
    """Greedy single-stream generation (decode.generate), up to the first EOS; memoised."""
    key = (id(model), tuple(prompt), n, tuple(eos_ids))
    if key not in _ALONE:
        out = generate(model, torch.tensor(prompt), n, eos_ids=eos_ids, temperature=0.0)[0, len(prompt):].tolist()
        _ALONE[key] = out[:min([out.index(e) for e in eos_ids if e in out], default=len(out))]
    return _ALONE[key]


@pytest.mark.parametrize("prefill_chunk", [512, 8])
def test_prompt_cache(tiny, prefill_chunk):
    """A request that shares a prefix with what a free slot holds prefills only the rest, and
    answers what it answers alone: the same prompt again (one token prefilled), one that shares a
    system prompt, and one whose first 20 tokens only another slot's row holds (copied from it:
    _share), prefilled together from different positions (or in chunks from there), after their
    slots sat free while another request decoded (writing garbage past what they keep)."""
    model = tiny("llama31")
    system = prompts((60,), seed=2)[0]
    q = prompts((5, 9, 14, 3), seed=3)
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=340, prefill_chunk=prefill_chunk)
    first = [system + q[0], system + q[1], prompts((30,), seed=4)[0]]
    engine.generate([Request(p, n) for p, n in zip(first, (4, 6, 40))])
    later = [system + q[0], system + q[2], system[:20] + q[3]]
    cached = {}

    def on_output(out):
        cached[out.request_id] = out.cached_tokens
    ids = [engine.next_id + i for i in range(len(later))]
    results = engine.generate([Request(p, 12, on_output=on_output) for p in later])
    assert [cached[i] for i in ids] == [len(later[0]) - 1, len(system), 20]
    assert [r.token_ids for r in results] == [alone(model, p, 12) for p in later]


def test_prompt_cache_evicts_the_slot_unused_longest(tiny):
    """A prompt that shares nothing goes to a slot never used, then to the one unused longest: the
    conversations served last keep their prefixes (three slots, four unrelated prompts, then the
    second and the first again)."""
    model = tiny("llama31")
    a, b, c, d = prompts((25, 30, 12, 18), seed=5)
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=340)
    cached = []
    for p in (a, b, c, d, b, a):
        seen = []
        result, = engine.generate([Request(p, 5, on_output=lambda out: seen.append(out.cached_tokens))])
        assert result.token_ids == alone(model, p, 5)
        cached.append(seen[0])
    # d took a's slot (the one unused longest); b's prefix survived both c and d.
    assert cached == [0, 0, 0, 0, len(b) - 1, 0]


@pytest.mark.parametrize("prefill_chunk", [512, 7])
def test_prompt_logprobs_equal_transformers(tmp_path, prefill_chunk):
    """Scoring prompts (prompt_logprobs, what the server's echo gives lm-eval): each prompt token's
    log-probability and the 3 most likely are transformers' for the same ids, whether the prompt
    loads at once or in chunks, beside a request that scores nothing, and again when a slot holds
    the prompt already (computed whole: a cached position has no logits)."""
    hf = make_hf_model("llama31", max_position_embeddings=384)
    model = load_model(save_and_convert(hf, tmp_path))
    ps = prompts((23, 1, 40), seed=7)
    with torch.no_grad():
        want = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in ps]
    engine = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=340, prefill_chunk=prefill_chunk)
    for _ in range(2):  # four slots: the second time, each prompt finds its own
        results = engine.generate([Request(p, 4, prompt_logprobs=3) for p in ps] + [Request(prompts((30,))[0], 4)])
        for p, r, lp in zip(ps, results, want):
            assert len(r.prompt_logprobs) == len(p) - 1
            assert [t for t, _, _ in r.prompt_logprobs] == p[1:]
            got = torch.tensor([v for _, v, _ in r.prompt_logprobs])
            want_lp = lp[torch.arange(len(p) - 1), torch.tensor(p[1:], dtype=torch.long)]
            torch.testing.assert_close(got, want_lp, atol=1e-4, rtol=1e-4)
            for row, (_, _, top) in zip(lp, r.prompt_logprobs):
                torch.testing.assert_close(torch.tensor([v for _, v in top]), row.topk(3).values, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(torch.tensor([v for _, v in top]), row[[t for t, _ in top]])
            assert r.token_ids == alone(model, p, 4)
        assert results[-1].prompt_logprobs == []


def test_logprobs_score_the_eos_that_ends(tiny):
    """The EOS that ends a request is neither text nor a token of the answer, but it is scored: a
    continuation's probability (lm-eval's loglikelihood through the server) includes it."""
    model = tiny("llama31")
    p = prompts((12,), seed=9)[0]
    third = alone(model, p, 3)[2]
    r, = Engine(model, IdTokenizer(), max_batch_size=2, max_seq_length=340).generate(
        [Request(p, 8, eos_ids=[third], logprobs=1)])
    assert r.finish_reason == "stop" and r.token_ids == alone(model, p, 2)
    assert [t for t, _, _ in r.logprobs] == r.token_ids + [third]
    assert all(top[0][0] == t and top[0][1] == pytest.approx(v) for t, v, top in r.logprobs)  # greedy: the likeliest


@pytest.mark.parametrize("max_batch_size,prefill_chunk", [(8, 512), (3, 512), (4, 48), (1, 64)])
def test_greedy_batch_equals_alone(tiny, max_batch_size, prefill_chunk):
    """8 prompts of 1 to 300 tokens with different max tokens: every answer is what it is alone,
    whether they fit the slots at once, queue for them (slots reused by shorter prompts), or load
    in chunks while others decode."""
    model = tiny("llama31")
    ps = prompts()
    max_new = [20, 7, 33, 12, 5, 28, 16, 9]
    engine = Engine(model, IdTokenizer(), max_batch_size=max_batch_size, max_seq_length=340,
                    prefill_chunk=prefill_chunk)
    results = engine.generate([Request(p, n) for p, n in zip(ps, max_new)])
    for p, n, r in zip(ps, max_new, results):
        assert r.token_ids == alone(model, p, n)
        assert r.finish_reason == "length" and r.text == IdTokenizer().decode(r.token_ids)
    assert not engine.has_work() and all(s is None for s in engine.slots)


def test_eos_ends_some_rows_and_frees_their_slots(tiny):
    model = tiny("llama31")
    ps = prompts()
    expected = [alone(model, p, 24) for p in ps]
    # Each request's own EOS: the 6th token it would generate (so it stops there), or one it never makes.
    eos = [[e[5]] if i % 2 else [999] for i, e in enumerate(expected)]
    results = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=340).generate(
        [Request(p, 24, eos_ids=e) for p, e in zip(ps, eos)])
    for p, e, r in zip(ps, eos, results):
        assert r.token_ids == alone(model, p, 24, e)
        assert r.finish_reason == ("stop" if e != [999] else "length")


def test_staggered_arrivals(tiny):
    """Requests join while others decode and leave at different times."""
    model = tiny("llama31")
    ps = prompts()
    engine = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=340, prefill_chunk=32)
    got, pending = {}, list(zip(ps, [15, 3, 22, 8, 11, 6, 9, 14]))
    ids = {}
    steps = 0
    while pending or engine.has_work():
        if pending and steps % 3 == 0:  # a new request every third step
            p, n = pending.pop(0)
            ids[engine.add(Request(p, n))] = (p, n)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    assert len(got) == len(ps)
    for request_id, (p, n) in ids.items():
        assert got[request_id] == alone(model, p, n)


@pytest.mark.parametrize("family", ["mistral", "mixtral", "gemma2", "gemma3", "qwen3_moe", "phi3", "olmo2", "gpt_oss",
                                    "ministral3", "cohere2", "qwen2_moe", "glm4_moe", "deepseek_v3",
                                    "mistral4", "gemma4", "gemma4_moe", "gemma4_e2b", "qwen3_5", "qwen3_next",
                                    "lfm2", "lfm2_moe", "lfm3"])
def test_sliding_window_and_moe(tiny, family):
    """Windows far shorter than the prompts (on alternating layers for Gemma, with soft-capping for
    Gemma 2), experts, q/k norms, fused projections, gpt-oss's sinks and biased experts through the engine."""
    model = tiny(family)
    ps = prompts((3, 40, 7, 90))
    results = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=200, prefill_chunk=32).generate(
        [Request(p, 20) for p in ps])
    for p, r in zip(ps, results):
        assert r.token_ids == alone(model, p, 20)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "lfm3"])
@pytest.mark.parametrize("max_batch_size,prefill_chunk", [(3, 48), (8, 512)])
def test_linear_attention_batch_equals_alone(tiny, max_batch_size, prefill_chunk, family):
    """Qwen3.5's Gated DeltaNet state (LFM2's convolution's) through the engine: right-padded prompts
    prefilled together (the padding must not enter a row's state), prompts in chunks, slots taken over by
    shorter prompts (the state starts again at position 0), rows decoding while others prefill."""
    model = tiny(family)
    ps = prompts()
    max_new = [20, 7, 33, 12, 5, 28, 16, 9]
    results = Engine(model, IdTokenizer(), max_batch_size=max_batch_size, max_seq_length=340,
                     prefill_chunk=prefill_chunk).generate([Request(p, n) for p, n in zip(ps, max_new)])
    assert [r.token_ids for r in results] == [alone(model, p, n) for p, n in zip(ps, max_new)]


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "lfm3"])
def test_linear_attention_prompt_cache(tiny, family):
    """A slot's state stands at the last position its request consumed: a next turn that goes on from
    all of it (a chat's earlier turns and answer) prefills only its new tokens; a prompt that shares
    only part of it is computed whole, and none is copied from another slot's row (two prompts with
    one system prompt at once)."""
    model = tiny(family)
    system, first, other = prompts((40, 9, 30), seed=6)
    engine = Engine(model, IdTokenizer(), max_batch_size=2, max_seq_length=200)
    answer, = engine.generate([Request(system + first, 8)])
    turn = system + first + answer.token_ids[:-1]  # what the slot holds: the last token sampled is not in it
    cached = []
    for batch in ([turn + [5, 6, 7]], [system + [3, 4]], [other + [1, 2], other + [8, 9]]):
        results = engine.generate([Request(p, 10, on_output=lambda out: cached.append(out.cached_tokens))
                                   for p in batch])
        assert [r.token_ids for r in results] == [alone(model, p, 10) for p in batch]
    assert sorted(set(cached)) == [0, len(turn)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "lfm3"])
def test_compiled_engine_with_linear_attention(tiny, family):
    """Compiled, every slot decodes in the one [max_batch_size, 1] shape: the rows that only ride along
    (free, or prefilling) must leave their state as it was (lengths 0); prompts run eagerly."""
    from compiling import rows_vary
    model = tiny(family)
    torch._dynamo.reset()
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=340, prefill_chunk=48, compile=True)
    assert not engine.live_rows_only and not rows_vary(model, "cpu")
    ps = prompts()
    results = engine.generate([Request(p, 10) for p in ps])
    assert [r.token_ids for r in results] == [alone(model, p, 10) for p in ps]


def test_chunked_prefill_equals_whole(tiny):
    """A prompt prefilled in chunks into a slot gives the logits of one whole prefill."""
    model = tiny("llama31")
    prompt = torch.tensor([prompts((150,))[0]])
    model.setup_caches(3, 200)
    whole = model(prompt, torch.arange(150), from_start=True)[:, -1]
    row = torch.tensor([2])
    for start in range(0, 150, 40):
        end = min(150, start + 40)
        last = model(prompt[:, start:end], torch.arange(start, end), from_start=start == 0, cache_rows=row,
                     kv_len=end, last_only=True)[:, -1]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)


def test_per_row_positions_equal_separate_sequences(tiny):
    """model.py with input_pos [B, T]: rows at different positions decode as they would alone."""
    model = tiny("llama31")
    a, b = prompts((30, 11))
    model.setup_caches(2, 64)
    model(torch.tensor([a]), torch.arange(30), from_start=True, cache_rows=torch.tensor([0]))
    model(torch.tensor([b]), torch.arange(11), from_start=True, cache_rows=torch.tensor([1]))
    x = torch.tensor([[7], [9]])
    both = model(x, torch.tensor([[30], [11]]))[:, -1]
    for row, p in enumerate((a, b)):
        model.setup_caches(1, 64)
        ref = model(torch.tensor([p + [int(x[row])]]), torch.arange(len(p) + 1), from_start=True)[:, -1]
        torch.testing.assert_close(both[row], ref[0], atol=1e-4, rtol=1e-4)


def test_seeded_sampling_same_alone_and_in_a_full_batch(tiny):
    model = tiny("llama31")
    ps = prompts()
    sampled = Request(ps[3], 24, temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    alone_out = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=340).generate([sampled])[0]
    others = [Request(p, 16, temperature=1.0, seed=i) for i, p in enumerate(ps[:3] + ps[4:])]
    batch = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=340).generate(others[:3] + [sampled]
                                                                                         + others[3:])
    assert batch[3].token_ids == alone_out.token_ids
    assert alone_out.token_ids != alone(model, ps[3], 24)  # it did sample
    other_seed = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=340).generate(
        [Request(ps[3], 24, temperature=0.8, top_k=40, top_p=0.9, seed=99)])[0]
    assert other_seed.token_ids != alone_out.token_ids


def test_sample_rows_draws_from_the_filtered_distribution():
    """Each row's tokens follow logits_to_probs of its own settings (a chi-square bound over 4000
    draws), greedy rows take the argmax, and top-k / top-p never pick a token they removed."""
    from decode import logits_to_probs, sample_rows
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 4)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 2, 1.0), (1.3, 0, 0.8)]
    temps, ks, ps = (list(s) for s in zip(*settings))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    counts = torch.zeros(4, 5)
    for _ in range(4000):
        for row, token in enumerate(sample_rows(logits, temps, ks, ps, gens)):
            counts[row, token] += 1
    assert counts[0, 0] == 4000
    for row in (1, 2, 3):
        expected = 4000 * logits_to_probs(logits[row:row + 1], temps[row], ks[row], ps[row])[0]
        assert (counts[row][expected == 0] == 0).all()
        seen = expected > 0
        chi2 = ((counts[row][seen] - expected[seen]) ** 2 / expected[seen]).sum()
        assert chi2 < 20, (row, counts[row], expected)  # 4 degrees of freedom: p < 0.001


def penalized_reference(model, prompt, n, frequency=0.0, presence=0.0, bias=None):
    """Greedy decoding with OpenAI's penalties and logit bias, as its documentation writes them, each
    step's logits from the whole sequence so far without a cache."""
    tokens = list(prompt)
    for _ in range(n):
        model.setup_caches(1, len(tokens))
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)), from_start=True)[0, -1].double()
        for j, b in (bias or {}).items():
            logits[j] += b
        generated = tokens[len(prompt):]
        for j in set(generated):
            logits[j] -= generated.count(j) * frequency + presence
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_penalties_and_logit_bias_equal_a_reference(tiny):
    """frequency / presence penalties and logit_bias, greedy, in one batch beside plain requests:
    each equals the uncached reference above, and each changed what plain greedy picks."""
    model = tiny("llama31")
    ps = prompts((7, 30, 12, 3), seed=5)
    plain = [alone(model, p, 24) for p in ps]
    favourite = max(set(plain[2]), key=plain[2].count)
    cases = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.5),
             dict(logit_bias={favourite: -100, 7: 4.5})]
    requests = [Request(p, 24, **kw) for p, kw in zip(ps, cases)] + [Request(ps[3], 24)]
    results = Engine(model, IdTokenizer(), max_batch_size=4, max_seq_length=64).generate(requests)
    for p, kw, result, greedy in zip(ps, cases, results, plain):
        expected = penalized_reference(model, p, 24, kw.get("frequency_penalty", 0.0),
                                       kw.get("presence_penalty", 0.0), kw.get("logit_bias"))
        assert result.token_ids == expected, kw
        assert expected != greedy, kw
    assert favourite not in results[2].token_ids
    assert results[3].token_ids == plain[3]
    # Logprobs stay the model's own: the first token's logprob as without the bias.
    forced = Engine(model, IdTokenizer(), max_batch_size=1, max_seq_length=64).generate(
        [Request(ps[0], 3, logit_bias={9: 100}, logprobs=1)])[0]
    free = Engine(model, IdTokenizer(), max_batch_size=1, max_seq_length=64).generate(
        [Request(ps[0], 1, logprobs=1)])[0]
    assert forced.token_ids == [9, 9, 9]
    assert forced.logprobs[0][2] == free.logprobs[0][2]  # the model's most likely tokens, unchanged

def count_prefill(engine) -> list:
    """Wraps engine's prefill step to record the prompt tokens each call computes (padding not counted)."""
    counts, step = [], engine.prefill_fn

    def counting(model, x, input_pos, rows, logits_at, *args):
        counts.append(int((logits_at + 1).sum()))
        return step(model, x, input_pos, rows, logits_at, *args)
    engine.prefill_fn = counting
    return counts


def test_shared_prefix_is_copied_from_a_running_request(tiny):
    """A prompt whose start another slot's row already holds (a request still decoding) copies those
    positions instead of computing them, and decodes as it would alone; a prompt that only shares
    a few tokens computes its own."""
    model = tiny("llama31")
    (common,) = prompts([90], seed=11)
    a, b, c = common + [5, 6, 7], common + [9], common[:10] + [1, 2, 3]
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=160)
    prefilled = count_prefill(engine)
    first = engine.add(Request(a, 30))
    outs = []
    while len(outs) < 3:  # a is decoding
        outs += engine.step()
    second, third = engine.add(Request(b, 20)), engine.add(Request(c, 20))
    while engine.has_work():
        outs += engine.step()
    tokens = {i: [t for o in outs if o.request_id == i for t in o.token_ids] for i in (first, second, third)}
    assert tokens == {first: alone(model, a, 30), second: alone(model, b, 20), third: alone(model, c, 20)}
    cached = {o.request_id: o.cached_tokens for o in outs}
    assert cached[second] == 90 and cached[third] == 0
    assert sum(prefilled) == len(a) + len(c)  # b's 90 copied, its last token decoded


@pytest.mark.parametrize("prefill_chunk", [512, 24])
def test_identical_prompts_are_prefilled_once(tiny, prefill_chunk):
    """n choices of one prompt (arriving together): the first is prefilled (at once, or in chunks
    that the others copy as they come), the others wait and copy its row; each equals what it
    gives alone (greedy and seeded sampling)."""
    model = tiny("llama31")
    (p,) = prompts([120], seed=12)
    requests = [Request(p, 12), Request(p, 12, temperature=0.9, seed=5), Request(p, 12, temperature=0.9, seed=6)]
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=160, prefill_chunk=prefill_chunk)
    prefilled = count_prefill(engine)
    together = engine.generate(requests)
    assert sum(prefilled) == len(p)
    for r, result in zip(requests, together):
        single = Engine(model, IdTokenizer(), max_batch_size=1, max_seq_length=160).generate([r])[0]
        assert result.token_ids == single.token_ids
    assert together[0].token_ids == alone(model, p, 12)
    assert together[1].token_ids != together[2].token_ids  # sampled, each its own seed

def test_stop_strings_and_streamed_text(tiny):
    """The text ends before the first stop string; the streamed pieces add up to the final text."""
    model = tiny("llama31")
    p = prompts((12,))[0]
    full = IdTokenizer().decode(alone(model, p, 30))
    stop = full[len(full) // 2:len(full) // 2 + 7]  # straddles token boundaries
    pieces = []
    engine = Engine(model, IdTokenizer(), max_batch_size=2, max_seq_length=64)
    result = engine.generate([Request(p, 30, stop=["never there", stop], on_output=pieces.append)])[0]
    assert result.finish_reason == "stop"
    assert result.text == full[:full.index(stop)]
    assert "".join(o.text for o in pieces) == result.text
    assert [o.finish_reason for o in pieces][-1] == "stop"


def test_kv_bucket():
    from engine import kv_bucket
    assert [kv_bucket(n, 4096) for n in (1, 256, 257, 1000, 2048, 2049, 4000)] == [256, 256, 512, 1024, 2048, None, None]
    assert kv_bucket(300, 340) is None and kv_bucket(200, 256) is None


def test_held_back():
    assert held_back("abc<1", ["<12>"]) == 2
    assert held_back("abc", ["<12>"]) == 0
    assert held_back("ab\ufffd", []) == 1


def test_abort_frees_the_slot(tiny):
    model = tiny("llama31")
    ps = prompts()
    engine = Engine(model, IdTokenizer(), max_batch_size=1, max_seq_length=340)
    first = engine.add(Request(ps[0], 200))
    second = engine.add(Request(ps[1], 5))
    engine.step()
    engine.abort(first)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [o.finish_reason for o in outs if o.request_id == first] == ["abort"]
    assert [t for o in outs if o.request_id == second for t in o.token_ids] == alone(model, ps[1], 5)


@pytest.mark.parametrize("request_kwargs,needle", [
    (dict(prompt=list(range(60)), max_new_tokens=8), "exceeds the context of 64"),
    (dict(prompt=[1, 2], max_new_tokens=63), "exceeds the context of 64"),
    (dict(prompt=[], max_new_tokens=4), "prompt is empty"),
    (dict(prompt=[1], max_new_tokens=0), "at least 1"),
    (dict(prompt=[1], max_new_tokens=4, temperature=float("nan")), "temperature"),
    (dict(prompt=[1], max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(prompt=[1], max_new_tokens=4, top_k=-1), "top_k"),
    (dict(prompt=[300], max_new_tokens=4), "outside the vocabulary"),
    (dict(prompt=[1], max_new_tokens=4, frequency_penalty=3), "frequency_penalty"),
    (dict(prompt=[1], max_new_tokens=4, presence_penalty=float("nan")), "presence_penalty"),
    (dict(prompt=[1], max_new_tokens=4, logit_bias={256: 1}), "outside the vocabulary"),
    (dict(prompt=[1], max_new_tokens=4, logit_bias={3: 101}), "between -100 and 100"),
])
def test_bad_requests_are_refused_before_queueing(tiny, request_kwargs, needle):
    engine = Engine(tiny("llama31"), IdTokenizer(), max_batch_size=2, max_seq_length=64)
    with pytest.raises(ValueError, match=needle):
        engine.add(Request(**request_kwargs))
    assert not engine.has_work()


def test_more_requests_than_slots_all_complete(tiny):
    model = tiny("llama31")
    ps = prompts([2] * 20, seed=3)
    results = Engine(model, IdTokenizer(), max_batch_size=2, max_seq_length=16).generate([Request(p, 4) for p in ps])
    assert [r.token_ids for r in results] == [alone(model, p, 4) for p in ps]


def test_int8_checkpoint(tmp_path, tiny):
    import quantize
    hf = make_hf_model("llama31", max_position_embeddings=384)
    path = quantize.quantize_checkpoint(save_and_convert(hf, tmp_path), "int8")
    model = load_model(path)
    ps = prompts((4, 50, 9))
    results = Engine(model, IdTokenizer(), max_batch_size=2, max_seq_length=80).generate([Request(p, 12) for p in ps])
    assert [r.token_ids for r in results] == [alone(model, p, 12) for p in ps]


@pytest.mark.parametrize("family,mode", [("llama31", None), pytest.param("llama31", "packed", marks=pytest.mark.slow),
                                         pytest.param("llama31", "packed-bf16", marks=pytest.mark.slow),
                                         pytest.param("llama31", "int8", marks=pytest.mark.slow),
                                         pytest.param("mixtral", None, marks=pytest.mark.slow),
                                         pytest.param("mixtral", "int8", marks=pytest.mark.slow)])
def test_compiled_engine_equals_eager(tiny, family, mode, tmp_path, capfd):
    """The compiled [max_batch_size, 1] step, one graph per attention-length bucket (here 256 and
    the whole cache of 340; one graph where attention.cpp reads only what each row sees; no
    recompile as requests come and go), decodes what single-stream eager generation does."""
    from torch._dynamo.utils import counters
    from compiling import needs_freezing
    model = tiny(family)
    if mode in ("packed", "packed-bf16"):  # kernels.cpp's products and attention.cpp's, called from the compiled graphs
        import kernels
        dtype = torch.bfloat16 if mode == "packed-bf16" else torch.float32
        if dtype not in kernels.packable_dtypes():
            pytest.skip(f"kernels.cpp has no {dtype} code for this CPU")
        hf = make_hf_model(family, max_position_embeddings=384, tie_word_embeddings=True)  # and PackedEmbedding
        model = kernels.pack_for_cpu(load_model(save_and_convert(hf, tmp_path), precision=dtype))  # attention.cpp too
    elif mode is not None:  # int8 llama31: kernels.cpp's; mixtral: a batch of 3 runs every expert on every token
        import quantize
        hf = make_hf_model(family, max_position_embeddings=384)
        model = load_model(quantize.quantize_checkpoint(save_and_convert(hf, tmp_path), mode))
    ps = prompts()
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, IdTokenizer(), max_batch_size=3, max_seq_length=340, prefill_chunk=64, compile=True)
    # First prompts of 2 and 32 tokens, as lengths that equal a dimension of a packed or quantized
    # weight ([N/32, K/2, 32, 2] in bf16) once pinned the prefill graph to that length.
    for first in prompts((2, 32), seed=1):
        engine.generate([Request(first, 2)])
    results = engine.generate([Request(p, 10) for p in ps])
    # Prompts found in the slots' cache: the rest of one prefilled from position 60 by the same
    # graph, one found whole (its last token joins the decode step).
    cached = []
    again = [ps[4][:60] + [7, 8, 9], ps[6]]
    results += engine.generate([Request(p, 10, on_output=lambda out: cached.append(out.cached_tokens))
                                for p in again])
    ps += again
    assert sorted(set(cached)) == [60, 299]
    # Two decode buckets (or the whole cache alone: engine.kv_buckets), and one prefill graph where the
    # model needs freezing (a packed model's prompts run eagerly: compiling.compile_prefill; its
    # decode steps are packages, not graphs of dynamo's).
    decode_graphs = 2 if engine.kv_buckets else 1
    import kernels
    assert engine.kv_buckets == (mode not in ("packed", "packed-bf16") or not kernels.best_isa())
    if needs_freezing(model):
        assert counters["stats"]["unique_graphs"] == decode_graphs + 1
    else:
        err = capfd.readouterr().err
        assert err.count("compiling: compiled ") + err.count("compiling: loaded ") == decode_graphs, err
    if mode in (None, "packed") or (family, mode) == ("llama31", "int8"):
        assert [r.token_ids for r in results] == [alone(model, p, 10) for p in ps]
        return
    # bf16, and int8 experts (ATen's kernel rounds their inputs to bf16, and a random tiny router
    # amplifies a flipped rounding): fused code rounds elsewhere than eager code, so near-ties may
    # flip. Every token chosen is eager's best next token on the same text, within bf16 rounding
    # of the logits.
    for p, r in zip(ps, results):
        seq = torch.tensor(p + r.token_ids)
        model.setup_caches(max_batch_size=1, max_seq_length=len(seq))
        with torch.no_grad():
            logits = model(seq[None, :-1], torch.arange(len(seq) - 1))[0, len(p) - 1:].float()
        chosen = logits.gather(-1, seq[len(p):, None])[:, 0]
        assert (logits.max(-1).values - chosen <= 2e-2 * logits.abs().max()).all()


# -- generate.py --prompts_file -----------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_cli")
    save_tokenizer(d / "hf")
    path = save_and_convert(make_hf_model("llama31", vocab_size=320, eos_token_id=0), d)
    return path


def run(args):
    return subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_prompts_file(checkpoint, tmp_path):
    """.jsonl with per-prompt settings through the engine: results in input order, each greedy one
    what generate.py --prompt gives alone."""
    lines = [{"prompt": "The quick brown fox", "max_new_tokens": 12},
             {"prompt": "Paris is", "max_new_tokens": 5, "stop": "never"},
             {"prompt": "She sells sea shells on the sea shore. " * 3, "max_new_tokens": 9},
             {"prompt": "One plus one", "temperature": 0.9, "seed": 7, "max_new_tokens": 8},
             {"prompt": "Paris is", "max_new_tokens": 3, "logit_bias": {"100": 100}, "presence_penalty": 0.5},
             {"prompt": "Paris is", "max_new_tokens": 60, "json_schema": {"enum": ["yes", "no"]}}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    r = run(["--checkpoint_path", str(checkpoint), "--prompts_file", str(f), "--output", str(out), "--no-chat",
             "--max_batch_size", "2", "--temperature", "0"])
    assert r.returncode == 0, r.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in results] == [x["prompt"] for x in lines]
    tokenizer = load_tokenizer(checkpoint.parent)
    model = load_model(checkpoint)
    for line, result in zip(lines[:3], results):
        ids = alone(model, tokenizer.encode(line["prompt"]), line["max_new_tokens"], tokenizer.eos_ids)
        assert result["text"] == tokenizer.decode(ids)
        assert result["tokens"] == len(ids)
        assert result["finish_reason"] == ("length" if len(ids) == line["max_new_tokens"] else "stop")
    assert results[4]["text"] == tokenizer.decode([100] * 3)  # a bias of 100 beats the presence penalty
    assert json.loads(results[5]["text"]) in ("yes", "no") and results[5]["finish_reason"] == "stop"
    # The same file as .txt (settings from the flags) prints JSONL on stdout.
    txt = tmp_path / "prompts.txt"
    txt.write_text("\n".join(x["prompt"] for x in lines[:2]) + "\n\n")
    r = run(["--checkpoint_path", str(checkpoint), "--prompts_file", str(txt), "--no-chat", "--max_new_tokens", "5",
             "--temperature", "0"])
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["prompt"] for x in r.stdout.splitlines()] == [x["prompt"] for x in lines[:2]]


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "hi", "max_new_tokens": "5"}\n', "prompts.jsonl:1: max_new_tokens has the wrong type"),
    ('{"prompt": "hi"}\n{"text": "no prompt"}\n', 'prompts.jsonl:2: each line must be a JSON object with a "prompt"'),
    ('{"prompt": "hi", "beam_width": 4}\n', "unknown setting 'beam_width'"),
    ("not json\n", "prompts.jsonl:1: not a JSON object"),
    ('{"prompt": "hi", "max_new_tokens": 100000}\n', "prompts.jsonl:1: the prompt"),
    ("\n\n", "holds no prompt"),
    ('{"prompt": "hi", "logit_bias": {"the": 1}}\n', "prompts.jsonl:1: logit_bias maps token ids"),
    ('{"prompt": "hi", "frequency_penalty": 5}\n', "prompts.jsonl:1: frequency_penalty must be"),
    ('{"prompt": "hi", "json_schema": {"type": "nonsense"}}\n', "prompts.jsonl:1: the JSON schema cannot be used"),
])
def test_prompts_file_errors(checkpoint, tmp_path, content, needle, capsys):
    from generate import cli
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli(["--checkpoint_path", str(checkpoint), "--prompts_file", str(f), "--no-chat", "--device", "cpu"])
    assert str(e.value.code).startswith("error: ") and needle in str(e.value.code), e.value.code
    out, err = capsys.readouterr()
    # The file's form is checked before the model loads; values against the model (check_request) after.
    assert out == "" and ("Loaded" not in err or "the prompt" in needle or "penalty" in needle or "JSON" in needle)


def test_incremental_text_equals_whole_decode(tmp_path):
    """The engine's text of a growing generation, decoding only its last ids, equals decoding every
    id at every step: a byte-level BPE (characters of 2-4 bytes split between ids, ids that are
    bytes alone) and a SentencePiece model (each word's leading space, byte fallback)."""
    import shutil
    from engine import IncrementalText
    from tokenizer import load_tokenizer
    from test_gguf import sentencepiece_vocab
    save_tokenizer(tmp_path / "bpe")
    sentencepiece_vocab(tmp_path)
    (tmp_path / "sp").mkdir()
    shutil.copy(tmp_path / "sp.model", tmp_path / "sp" / "tokenizer.model")
    g = torch.Generator().manual_seed(0)
    text = "naïve café — 東京 🙂 text, ünïcode; the end. " * 3
    for tok, vocab in ((load_tokenizer(tmp_path / "bpe"), 300), (load_tokenizer(tmp_path / "sp"), 400)):
        ids = tok.encode(text)
        for seq in (ids, torch.randint(0, vocab, (200,), generator=g).tolist()):  # real text, and any ids
            inc = IncrementalText()
            for n in range(1, len(seq) + 1):
                assert inc.of(tok, seq[:n]) == tok.decode(seq[:n]), (type(tok).__name__, n)
