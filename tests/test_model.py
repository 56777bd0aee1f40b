"""model.py + the HF converter against transformers, family by family."""
import pytest
import torch
import torch._dynamo

from conftest import FAMILIES, make_hf_model, save_and_convert
from decode import decode_one_token, generate
from load import load_model
from model import ModelArgs


def our_logits(model, ids):
    model.setup_caches(max_batch_size=ids.shape[0], max_seq_length=ids.shape[1])
    return model(ids, torch.arange(ids.shape[1]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, converted):
    hf, path = converted(family)
    model = load_model(path, "cpu", torch.float32)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = our_logits(model, ids)
        # What prefill asks for: causal attention within the prompt instead of a mask over the cache
        # (for Mistral only up to its 16-token window), and the last position's logits.
        short = hf(ids[:, :12]).logits
        from_start = [model(x, torch.arange(x.shape[1]), from_start=True) for x in (ids, ids[:, :12])]
        last = model(ids, torch.arange(ids.shape[1]), last_only=True, from_start=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(from_start[0], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(from_start[1], short, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last, expected[:, -1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(family, converted):
    hf, path = converted(family)
    model = load_model(path, "cpu", torch.float32)
    prompt = torch.tensor([5, 17, 99, 3, 42, 7])
    expected = hf.generate(prompt[None], max_new_tokens=40, min_new_tokens=40, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0]
    got = generate(model, prompt, 40, temperature=0.0)[0]
    assert got.tolist() == expected.tolist()
    assert len(set(got[6:].tolist())) > 3, "degenerate test: the model repeats one token"


def test_sharded_safetensors(tmp_path):
    hf = make_hf_model("llama31", seed=3)
    path = save_and_convert(hf, tmp_path, max_shard_size="50KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    model = load_model(path)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_pytorch_bin(tmp_path):
    hf = make_hf_model("llama2", seed=4)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=False) if "safe_serialization" in \
        hf.save_pretrained.__code__.co_varnames else pytest.skip("transformers no longer writes .bin")
    from scripts.convert_hf_checkpoint import convert_hf_checkpoint
    model = load_model(convert_hf_checkpoint(tmp_path))
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_cached_decode_equals_full_forward(converted):
    _, path = converted("llama31")
    model = load_model(path)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = our_logits(model, ids)
        model.setup_caches(2, 24)
        steps = [model(ids[:, :10], torch.arange(10), from_start=True)]  # fills the cache as prefill does
        for t in range(10, 24):
            steps.append(model(ids[:, t:t + 1], torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_bf16_kv_cache_under_fp32_activations(converted):
    """--kv_cache_dtype bfloat16: the cache holds bf16, decoding through it equals a full forward that
    reads the same cache (cached == uncached), and both stay within bf16 rounding of the fp32 cache."""
    _, path = converted("llama31")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32_cache = our_logits(load_model(path), ids)
        model = load_model(path)
        model.kv_cache_dtype = torch.bfloat16
        full = our_logits(model, ids)
        assert model.layers[0].attention.kv_cache.k_cache.dtype == torch.bfloat16
        assert full.dtype == torch.float32
        model.setup_caches(2, 24)
        steps = [model(ids[:, :10], torch.arange(10))]
        for t in range(10, 24):
            steps.append(model(ids[:, t:t + 1], torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full, fp32_cache, atol=3e-2, rtol=3e-2)
    assert not torch.equal(full, fp32_cache)  # the cache really rounds


def test_batch_rows_equal_single(converted):
    _, path = converted("qwen2")
    model = load_model(path)
    prompt = torch.tensor([1, 2, 3, 4])
    single = generate(model, prompt, 16, temperature=0.0)
    batched = generate(model, prompt, 16, batch_size=3, temperature=0.0)
    assert all(row.tolist() == single[0].tolist() for row in batched)


@pytest.mark.parametrize("queue_ahead", [False, True])
def test_generate_streams_each_token_once_in_order(converted, queue_ahead):
    """The callback gets each token on the host, in order, and an end of sequence stops generation
    where a loop that recomputes the whole sequence for every token stops; queue_ahead (CUDA's
    default) queues step n+1 before token n is read, which wastes one step past the end."""
    _, path = converted("llama31")
    model = load_model(path)
    prompt = torch.tensor([5, 17, 99, 3, 42, 7])
    with torch.no_grad():
        ids = prompt[None]
        for _ in range(12):  # the reference: no cache, no queue
            ids = torch.cat([ids, our_logits(model, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    reference = ids[0, 6:].tolist()
    eos = reference[7]
    assert eos not in reference[:7], "pick another prompt: the end token comes earlier"
    calls, streamed = [], []

    def counting_step(*args, **kwargs):
        calls.append(1)
        return decode_one_token(*args, **kwargs)

    def on_token(token):
        assert token.device.type == "cpu" and token.shape == (1,)
        streamed.append(int(token[0]))
    out = generate(model, prompt, 12, eos_ids=[eos], callback=on_token, decode_fn=counting_step,
                   queue_ahead=queue_ahead)
    assert out[0, 6:].tolist() == reference[:8] == streamed  # the end token is the last one
    assert len(calls) == 7 + queue_ahead  # steps for tokens 2..8 (and the one queued past the end)
    calls.clear()
    assert generate(model, prompt, 12, decode_fn=counting_step, queue_ahead=queue_ahead)[0, 6:].tolist() == reference
    assert len(calls) == 11  # no end token: no step past the last


def test_presets_exact_names():
    assert ModelArgs.from_name("llama-3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert ModelArgs.from_name("7B").intermediate_size == 11008
    assert ModelArgs.from_name("70B").n_local_heads == 8
    with pytest.raises(ValueError, match="valid names"):
        ModelArgs.from_name("llama-3.1-8b-instruct")  # no fuzzy matching
    for name in ["stories15M", "stories42M", "stories110M", "7B", "13B", "30B", "34B", "70B", "Mistral-7B",
                 "llama-3-8b", "llama-3-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
                 "llama-3.2-1b", "llama-3.2-3b"]:
        ModelArgs.from_name(name)



@pytest.mark.parametrize("vocab", [2048, 2049, 2560, 49152, 50257, 151936])
def test_argmax_equals_torch(vocab):
    """decode.argmax (the maxima of blocks, then one block's argmax) picks what torch.argmax picks:
    the first of equal maxima, wherever they lie (two blocks, one block, the partial last block), a
    NaN as the largest, rows of -inf; eager, and inside a compiled step as decode_one_token's."""
    from decode import ARGMAX_BLOCK, argmax
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g)
    top = x.max().item() + 1
    x[1, [7, vocab - 1]] = top  # a tie in two blocks: the first
    x[2, [ARGMAX_BLOCK + 3, ARGMAX_BLOCK + 9]] = top  # a tie within a block
    x[3, vocab - 1] = top  # the very last value (in a partial block where vocab % ARGMAX_BLOCK)
    x[4, vocab - 2:] = top  # the partial block's real values tie
    x[5] = 0.0  # all equal
    x[6] = -float("inf")
    x[7, [vocab // 2, vocab // 3]] = float("nan")  # the first NaN, as torch
    x[8, vocab // 3] = float("inf")
    x[9, -(vocab % ARGMAX_BLOCK or ARGMAX_BLOCK) - 1] = top  # the last whole block's last value
    x[10, ARGMAX_BLOCK - 1] = top  # the end of the first block
    expected = torch.argmax(x, dim=-1)
    assert argmax(x).tolist() == expected.tolist()
    assert argmax(x.reshape(3, 4, vocab)).tolist() == expected.reshape(3, 4).tolist()
    assert argmax(x[:0]).shape == (0,)
    torch._dynamo.reset()
    assert torch.compile(argmax, fullgraph=True)(x[:11]).tolist() == expected[:11].tolist()

@pytest.mark.slow
def test_compiled_decode_equals_eager(converted):
    from compiling import compile_prefill, compile_step
    from decode import decode_one_token, prefill
    _, path = converted("llama31")
    model = load_model(path)
    prompt = torch.tensor([9, 8, 7, 6])
    eager = generate(model, prompt, 12, temperature=0.0)
    prefill_fn, decode_fn = compile_prefill(prefill, "cpu"), compile_step(decode_one_token, "cpu")
    torch._dynamo.reset()
    # fullgraph=True fails on a graph break; a recompile per token (e.g. on input_pos) fails here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, prompt, 12, temperature=0.0, prefill_fn=prefill_fn, decode_fn=decode_fn)
    assert compiled.tolist() == eager.tolist()
    # --compile_prefill compiles prefill for any prompt length (dynamic shapes).
    longer = torch.arange(3, 20)
    assert generate(model, longer, 4, prefill_fn=prefill_fn).tolist() == generate(model, longer, 4).tolist()


@pytest.mark.slow
def test_compiled_decode_follows_cache_and_batch_changes(converted):
    """generate() skips the compiled step's guards after its first step; a new call that grows
    the cache or changes the batch must still recompile and decode as eagerly."""
    from compiling import compile_step
    from decode import decode_one_token
    _, path = converted("llama31")
    model = load_model(path)
    decode_fn = compile_step(decode_one_token, "cpu")
    torch._dynamo.reset()
    for new_tokens, batch_size, prompt_len in [(6, 1, 4), (30, 1, 4), (8, 2, 4), (6, 1, 9), (6, 1, 4)]:
        prompt = torch.arange(5, 5 + prompt_len)
        eager = generate(model, prompt, new_tokens, batch_size=batch_size)
        compiled = generate(model, prompt, new_tokens, batch_size=batch_size, decode_fn=decode_fn)
        assert compiled.tolist() == eager.tolist(), (new_tokens, batch_size, prompt_len)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_compiled_cpu_step_freezes_and_matches_eager(converted, dtype):
    """The CPU decode step really compiles with freezing (weights repacked for oneDNN / the C++ GEMM
    template; passing it as a torch.compile option alone silently did nothing) and its logits
    equal the eager model's at the same position, within the dtype's precision."""
    from torch._dynamo.utils import counters
    from compiling import compile_step
    _, path = converted("qwen2")  # biases too
    model = load_model(path, "cpu", dtype)
    model.setup_caches(max_batch_size=1, max_seq_length=16)
    prompt, pos = torch.tensor([[5, 9, 2, 7, 1]]), torch.tensor([5], dtype=torch.int)
    step = compile_step(lambda m, x, p: m(x, p), "cpu")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        model(prompt, torch.arange(5))
        eager = model(torch.tensor([[3]]), pos).float()
        compiled = step(model, torch.tensor([[3]]), pos).float()  # rewrites the same cache row
    # oneDNN packs bf16 weights only on CPUs with bf16 instructions (AVX-512 BF16, AMX); fp32 always.
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0, "freezing was not applied"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(compiled, eager, atol=tol * eager.abs().max().item(), rtol=tol)
