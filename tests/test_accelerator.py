"""The GPU paths (CUDA graphs, CUDA's int4 kernel, device-side sampling) against the same
independent references as the CPU tests. Skipped without a GPU; BRISK_TEST_DEVICE=mps (or cpu,
to check the tests themselves) runs them elsewhere."""
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import quantize
import quantized
from conftest import make_hf_model, save_and_convert
from compiling import compile_step
from decode import decode_one_token, generate
from load import load_model
from speculative import speculative_generate, verify
from test_quantize import MODELS, dequantized_model, rel_error, rounding_bound, save_random_model, step_logits

DEVICE = os.environ.get("BRISK_TEST_DEVICE", "cuda")
AVAILABLE = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available, "cpu": lambda: True}
pytestmark = pytest.mark.skipif(not AVAILABLE[DEVICE.split(":")[0]](), reason=f"no {DEVICE} device")
PROMPT = torch.tensor([5, 17, 99, 3, 42, 7])


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    counters.clear()
    yield
    # Skipped CUDA graphs are a silent slowdown, not an error: fail on them here.
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("family", ["llama31", "mixtral", "qwen2", "mistral", "qwen3_5"])
def test_logits_match_transformers(family, converted):
    hf, path = converted(family)
    model = load_model(path, DEVICE, torch.float32)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        model.setup_caches(max_batch_size=2, max_seq_length=40)
        got = model(ids.to(DEVICE), torch.arange(40, device=DEVICE)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama31", "mixtral", "qwen3_5"])  # (qwen3_5: its state written in the graph)
def test_compiled_generation_equals_eager(family, converted):
    """Greedy tokens of the compiled step (CUDA graphs on CUDA) equal eager ones, also when a later
    call grows the cache, changes the batch or the prompt length (generate() skips the guards after
    a call's first step, so each of these must still reach a graph of its own)."""
    _, path = converted(family)
    model = load_model(path, DEVICE, torch.float32)
    decode_fn = compile_step(decode_one_token, DEVICE)
    for new_tokens, batch_size, prompt_len in [(12, 1, 6), (30, 1, 6), (8, 2, 6), (8, 1, 3)]:
        prompt = PROMPT[:prompt_len].to(DEVICE)
        eager = generate(model, prompt, new_tokens, batch_size=batch_size)
        compiled = generate(model, prompt, new_tokens, batch_size=batch_size, decode_fn=decode_fn)
        assert compiled.tolist() == eager.tolist(), (new_tokens, batch_size, prompt_len)


def test_bf16_generation_matches_transformers(converted):
    """The default GPU precision end to end: bf16 brisk against transformers in fp32, teacher-forced
    on brisk's own greedy tokens (bf16 may flip a near-tie, so compare the logits, not the tokens)."""
    hf, path = converted("llama31")
    model = load_model(path, DEVICE, torch.bfloat16)
    decode_fn = compile_step(decode_one_token, DEVICE)
    tokens = generate(model, PROMPT.to(DEVICE), 24, decode_fn=decode_fn).cpu()
    with torch.no_grad():
        expected = hf(tokens).logits[0, len(PROMPT) - 1:-1]
    chosen = expected.gather(-1, tokens[0, len(PROMPT):, None])[:, 0]
    # Each greedy token is transformers' top token or within bf16 rounding of it.
    assert (expected.max(-1).values - chosen).max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("model_kind", ["llama", "moe"])
def test_quantized_step_matches_dequantized_weights(tmp_path, model_kind, mode, groupsize):
    """Eager and compiled steps of a quantized model (CUDA's int4 kernel on CUDA) against the model
    with its quantized weights dequantized, in fp32 on the CPU."""
    path = save_random_model(tmp_path, **MODELS[model_kind])
    qpath = quantize.quantize_checkpoint(path, mode, groupsize)
    model, reference = load_model(qpath, DEVICE, torch.bfloat16), dequantized_model(path, qpath)
    if mode == "int4" and DEVICE.startswith("cuda"):
        assert {m.kernel for m in model.modules() if isinstance(m, quantized.Int4Linear)} == {"cuda"}
    got = step_logits(model, reference, DEVICE)
    bound = rounding_bound(model, 0.03)  # (on a CPU, BRISK_TEST_DEVICE=cpu: kernels.cpp's int8 rounding)
    for name in ("eager", "compiled"):
        assert rel_error(got[name], got["reference"]) < bound, name


def test_sampling_on_device(converted):
    """Sampling (exponential race, top-k, top-p) runs on the device without host syncs inside the
    compiled step and gives only tokens that top-k allows."""
    _, path = converted("llama31")
    model = load_model(path, DEVICE, torch.float32)
    decode_fn = compile_step(decode_one_token, DEVICE)
    torch.manual_seed(0)
    out = generate(model, PROMPT.to(DEVICE), 16, batch_size=4, decode_fn=decode_fn, temperature=0.8, top_k=1)
    assert out.tolist() == generate(model, PROMPT.to(DEVICE), 16, batch_size=4).tolist()  # top_k=1 is greedy
    out = generate(model, PROMPT.to(DEVICE), 16, batch_size=4, decode_fn=decode_fn, temperature=1.0, top_p=0.9)
    assert len({tuple(r) for r in out.tolist()}) > 1, "four sampled rows came out identical"


def test_speculative_greedy_equals_plain_greedy(tmp_path_factory):
    target = load_model(save_and_convert(make_hf_model("llama31"), tmp_path_factory.mktemp("t")), DEVICE)
    draft = load_model(save_and_convert(make_hf_model("qwen2", seed=1), tmp_path_factory.mktemp("d")), DEVICE)
    prompt = PROMPT.to(DEVICE)
    plain = generate(target, prompt, 30)[0].tolist()
    decode_fn = compile_step(decode_one_token, DEVICE)
    verify_fn = compile_step(verify, DEVICE)
    for drafter in (dict(draft_model=draft), dict(ngram=2)):
        accepted = []
        out = speculative_generate(target, prompt, 30, k=3, accepted=accepted, draft_fn=decode_fn,
                                   verify_fn=verify_fn, **drafter)
        assert out[0].tolist() == plain, drafter


def test_engine_on_device(tmp_path):
    """The serving engine on the device, compiled (on CUDA: CUDA graphs over every slot): requests
    that wait for and copy another's prefix, one with penalties and one held to a JSON schema each
    answer as they do alone in an eager engine."""
    import json
    from conftest import save_tokenizer
    from engine import Engine, Request
    from structured import json_grammar
    from tokenizer import load_tokenizer
    save_tokenizer(tmp_path / "hf")
    path = save_and_convert(make_hf_model("llama31", vocab_size=320, eos_token_id=0, max_position_embeddings=256),
                            tmp_path)
    model, tokenizer = load_model(path, DEVICE, torch.float32), load_tokenizer(tmp_path)
    common = list(range(40, 100))
    requests = [Request(common + [3], 16), Request(common + [4, 5], 16, frequency_penalty=1.0, presence_penalty=-0.5),
                Request(common[:40], 40, grammar=json_grammar({"enum": ["yes", "no", "maybe"]}))]
    outputs = []
    engine = Engine(model, tokenizer, max_batch_size=4, max_seq_length=128, compile=True)
    for r in requests:
        r.on_output = outputs.append
    together = engine.generate(requests)
    cached = {o.request_id: o.cached_tokens for o in outputs}
    assert [cached[i] for i in range(3)] == [0, 60, 39]  # the first's prefix, copied
    for r, got in zip(requests, together):
        r.on_output = None
        alone = Engine(model, tokenizer, max_batch_size=1, max_seq_length=128).generate([r])[0]
        assert got.token_ids == alone.token_ids
    assert json.loads(together[2].text) in ("yes", "no", "maybe")
