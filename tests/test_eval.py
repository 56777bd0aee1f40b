"""eval.py against lm_eval's own Hugging Face model (HFLM) and transformers, on local tasks, offline."""
import json
import math

import pytest
import torch

from conftest import make_hf_model, save_and_convert, save_tokenizer
from eval import Scorer, cli, make_lm
from load import load_model
from tokenizer import load_tokenizer

MAX_LENGTH = 40  # short enough that long prompts are truncated and rolling documents span windows

MC_DOCS = [
    {"question": "Paris is the capital of", "choices": [" France", " the sea", " blue"], "answer": 0},
    {"question": "One plus one is", "choices": [" two", " four"], "answer": 0},
    {"question": "What colour is the sky? The sky is", "choices": [" blue", " quick brown"], "answer": 0},
    {"question": "The quick brown fox jumps over the lazy dog. " * 3 + "The fox is", "choices": [" quick", " lazy"],
     "answer": 0},  # longer than MAX_LENGTH: truncated from the left
]
GEN_DOCS = [{"question": q, "answer": a} for q, a in [
    ("what colour is the sky?", "blue"), ("what colour is the sea?", "blue"), ("one plus one", "two"),
    ("two plus two", "four"), ("who sells sea shells on the sea shore? " * 2, "she"), ("the lazy dog", "sleeps")]]
ROLLING_DOCS = [{"text": " ".join(["A river runs to the sea, and the sea is never full."] * 4)},
                {"text": "Paris is the capital of France."}]
TASKS = {
    "brisk_mc": (MC_DOCS, """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc"""),
    "brisk_gen": (GEN_DOCS, """output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: " {{answer}}"
generation_kwargs:
  until: ["e", "\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match"""),
    "brisk_rolling": (ROLLING_DOCS, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte"""),
}


def write_tasks(root):
    for name, (docs, spec) in TASKS.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                           f"    test: {root / (name + '.jsonl')}\ntest_split: test\n{spec}\n")
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["no_bos", "bos"])
def tiny(request, tmp_path_factory):
    """(transformers model, its tokenizer, converted model.pth, task dir) with a real tokenizer."""
    root = tmp_path_factory.mktemp("eval")
    hf_tok = save_tokenizer(root / "hf", bos=request.param)
    hf = make_hf_model("llama2", seed=5, vocab_size=320, eos_token_id=0, bos_token_id=1)
    return hf, hf_tok, save_and_convert(hf, root), write_tasks(tmp_path_factory.mktemp("tasks"))


def evaluate(lm, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    results = simple_evaluate(model=lm, tasks=sorted(TASKS), log_samples=True,
                              task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}, results["results"]


def ours(path, batch_size):
    model = load_model(path)
    return make_lm(Scorer(model, load_tokenizer(path.parent), MAX_LENGTH, batch_size))


def assert_same_responses(got, expected):
    assert got.keys() == expected.keys()
    for ll_got, ll_exp in zip(got["brisk_mc"], expected["brisk_mc"]):
        for (lp, greedy), (lp_exp, greedy_exp) in zip((r[0] for r in ll_got), (r[0] for r in ll_exp)):
            assert lp == pytest.approx(lp_exp, abs=1e-3, rel=1e-5) and greedy == greedy_exp
    assert [r[0][0] for r in got["brisk_rolling"]] == pytest.approx([r[0][0] for r in expected["brisk_rolling"]],
                                                                   abs=1e-3, rel=1e-5)
    assert got["brisk_gen"] == expected["brisk_gen"]


@pytest.mark.slow
def test_tasks_match_lm_eval_hf_model(tiny):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    hf, hf_tok, path, task_dir = tiny
    expected, expected_metrics = evaluate(HFLM(pretrained=hf, tokenizer=hf_tok, device="cpu", batch_size=1,
                                               max_length=MAX_LENGTH), task_dir)
    answers = [r[0][0] for r in expected["brisk_gen"]]
    assert any(answers) and len(set(answers)) > 2, f"degenerate generations {answers}"
    for batch_size in (1, 3):
        got, metrics = evaluate(ours(path, batch_size), task_dir)
        assert_same_responses(got, expected)
        assert metrics["brisk_mc"]["acc,none"] == expected_metrics["brisk_mc"]["acc,none"]


def test_generation_batches_any_lengths(tiny):
    """Prompts of different lengths share a batch; every answer equals batch size 1 and transformers' greedy."""
    hf, hf_tok, path, _ = tiny
    model = load_model(path)
    tokenizer = load_tokenizer(path.parent)
    prompts = [tokenizer.encode(f"Question: {d['question']}\nAnswer:") for d in GEN_DOCS]
    prompts += [p[:-1] + [p[-1] + 1] for p in prompts[:2]]  # same lengths as the first two, different tokens
    assert len({len(p) for p in prompts}) > 3
    one = Scorer(model, tokenizer, 256, batch_size=1).generate(prompts, [], 10, dict(temperature=0.0))
    four = Scorer(model, tokenizer, 256, batch_size=4).generate(prompts, [], 10, dict(temperature=0.0))
    assert one == four
    for prompt, text in zip(prompts, one):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0]
        assert text == hf_tok.decode(out[len(prompt):], skip_special_tokens=True)


def test_one_token_choices_share_a_forward_pass(tiny):
    _, _, path, _ = tiny
    scorer = Scorer(load_model(path), load_tokenizer(path.parent), MAX_LENGTH, batch_size=1)
    calls = []
    forward = scorer.forward
    scorer.forward = lambda x, input_pos: calls.append(x.shape) or forward(x, input_pos)
    contexts = [[5, 6, 7], [8, 9, 10, 11]]
    requests = [(ctx + [answer], 1) for ctx in contexts for answer in (20, 21, 22)] + [([5, 6, 7, 20, 21], 2)]
    results = scorer.score(requests)
    assert len(calls) == 3  # one per distinct model input: two contexts, and [5, 6, 7, 20]
    unshared = [scorer.score([r])[0] for r in requests]
    assert [lp for lp, _ in results] == pytest.approx([lp for lp, _ in unshared], abs=1e-5)


def hf_strided_perplexity(hf, ids, max_length, stride):
    """Hugging Face's perplexity recipe, dividing by the number of tokens actually scored."""
    nll, scored, count = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        window = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(window).logits[0, :-1].float(), dim=-1)
        targets = window[0, 1:]
        n = min(end - scored, len(targets))  # a window's first token has no context in it
        nll -= logprobs[-n:].gather(-1, targets[-n:, None]).sum().item()
        scored, count = end, count + n
        if end == len(ids):
            break
    return math.exp(nll / count)


@pytest.mark.parametrize("max_length,stride,batch_size", [(32, 12, 1), (32, 12, 4), (32, 32, 2), (256, 128, 1)])
def test_perplexity_matches_transformers(tiny, tmp_path, capsys, max_length, stride, batch_size):
    hf, hf_tok, path, _ = tiny
    text = tmp_path / "text.txt"
    text.write_text(" ".join(ROLLING_DOCS[0]["text"] for _ in range(2)) + "\nPlus one is two.")
    ids = hf_tok(text.read_text())["input_ids"]
    assert len(ids) > 3 * max_length or max_length > len(ids)
    expected = hf_strided_perplexity(hf, ids, max_length, stride)
    out = tmp_path / "out.json"
    cli(["--checkpoint_path", str(path), "--perplexity", str(text), "--max_seq_length", str(max_length),
         "--stride", str(stride), "--batch_size", str(batch_size), "--output_json", str(out)])
    assert json.loads(out.read_text())["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_runs_local_tasks(tiny, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    _, _, path, task_dir = tiny
    out = tmp_path / "results.json"
    cli(["--checkpoint_path", str(path), "--tasks", "brisk_mc", "brisk_gen", "--include_path", str(task_dir),
         "--limit", "3", "--max_seq_length", str(MAX_LENGTH), "--batch_size", "2", "--output_json", str(out)])
    printed = capsys.readouterr().out
    assert "brisk_mc" in printed and "acc" in printed and "exact_match" in printed
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"brisk_mc", "brisk_gen"} and 0 <= results["brisk_mc"]["acc,none"] <= 1


def test_missing_lm_eval_is_one_line(tiny, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(SystemExit) as e:
        cli(["--checkpoint_path", str(tiny[2]), "--tasks", "hellaswag"])
    assert "pip install 'lm-eval==" in str(e.value.code) and "\n" not in str(e.value.code)


@pytest.mark.parametrize("args,message", [
    (["--perplexity", "missing.txt"], "no such file"),
    ([], "nothing to evaluate"),
    (["--perplexity", __file__, "--max_seq_length", "100000"], "exceeds the model's context"),
    (["--perplexity", __file__, "--max_seq_length", "16", "--stride", "17"], "--stride"),
])
def test_user_errors(tiny, args, message):
    with pytest.raises(SystemExit) as e:
        cli(["--checkpoint_path", str(tiny[2])] + args)
    assert str(e.value.code).startswith("error: ") and message in str(e.value.code)
