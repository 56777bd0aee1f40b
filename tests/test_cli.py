"""generate.py and the converter: bad input gives one clear line, never a traceback."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_hf_model, save_and_convert
from test_tokenizer import train_bpe

ROOT = Path(__file__).resolve().parent.parent


def run(args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A converted tiny model with a tokenizer, as a user would have it."""
    d = tmp_path_factory.mktemp("cli")
    path = save_and_convert(make_hf_model("llama31", vocab_size=512), d)
    train_bpe(d, False)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def assert_clean_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    for needle in needles:
        assert needle in last, last


def test_generate_works(checkpoint):
    r = run(["generate.py", "--checkpoint_path", str(checkpoint), "--prompt", "The quick", "--max_new_tokens", "8",
             "--temperature", "0", "--device", "cpu"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The quick")
    assert "Average tokens/sec" in r.stderr and "Average tokens/sec" not in r.stdout


@pytest.mark.slow  # ~37 s, a whole compile; the bf16 cache's attention is in test_kernels.py
def test_bf16_kv_cache_compiled(checkpoint):
    """--kv_cache_dtype bfloat16 through the compiled decode step (fp32 activations over a bf16 cache)."""
    r = run(["generate.py", "--checkpoint_path", str(checkpoint), "--prompt", "The quick", "--max_new_tokens", "8",
             "--temperature", "0", "--device", "cpu", "--compile", "--kv_cache_dtype", "bfloat16"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The quick") and len(r.stdout) > len("The quick")


def test_number_prompt_is_text(checkpoint):
    """A number is text to --prompt (as a user means it); a synthetic prompt needs its own flag."""
    r = run(["generate.py", "--checkpoint_path", str(checkpoint), "--prompt", "300", "--no-chat",
             "--max_new_tokens", "2", "--temperature", "0", "--device", "cpu"])
    assert r.returncode == 0, r.stderr  # 300 synthetic tokens would not fit the 256-token context
    assert r.stdout.startswith("300")
    r = run(["generate.py", "--checkpoint_path", str(checkpoint), "--synthetic_prompt_len", "20",
             "--max_new_tokens", "2", "--temperature", "0", "--device", "cpu"])
    assert r.returncode == 0, r.stderr


def test_missing_checkpoint(tmp_path):
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(tmp_path / "nope/model.pth")]), "not found")


def test_default_model_not_prepared(tmp_path):
    r = run([str(ROOT / "generate.py")], cwd=tmp_path)
    assert_clean_error(r, "prepare.sh")


def test_missing_config(checkpoint, tmp_path):
    shutil.copy(checkpoint, tmp_path / "model.pth")
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(tmp_path / "model.pth")]), "config.json")


def test_missing_tokenizer(checkpoint, tmp_path):
    for name in ("model.pth", "config.json"):
        shutil.copy(checkpoint.parent / name, tmp_path / name)
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(tmp_path / "model.pth"), "--device", "cpu"]),
                       "tokenizer")


def test_wrong_tokenizer(checkpoint, tmp_path, converted):
    _, small_vocab = converted("llama2")  # 256 tokens: fewer than the tokenizer's 400
    for name in ("model.pth", "config.json"):
        shutil.copy(small_vocab.parent / name, tmp_path / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint.parent / name, tmp_path / name)
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(tmp_path / "model.pth"), "--device", "cpu"]),
                       "wrong tokenizer")


def test_corrupt_checkpoint(checkpoint, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint.parent / name, tmp_path / name)
    (tmp_path / "model.pth").write_bytes(checkpoint.read_bytes()[:1000])
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(tmp_path / "model.pth")]), "not a readable")


@pytest.mark.parametrize("args,needle", [
    (["--synthetic_prompt_len", "300"], "context"),  # the tiny model's context is 256 tokens
    (["--prompt", "hi", "--max_new_tokens", "1000"], "context"),
    (["--device", "tpu"], "unknown device"),
])
def test_bad_arguments(checkpoint, args, needle):
    assert_clean_error(run(["generate.py", "--checkpoint_path", str(checkpoint), *args]), needle)


def test_convert_unsupported_architecture(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_clean_error(run(["scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path)]),
                       "unsupported architecture 'gpt2'")


def test_convert_unmapped_weight(tmp_path):
    from safetensors.torch import load_file, save_file
    make_hf_model("llama2").save_pretrained(tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = weights["model.norm.weight"].clone()
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    assert_clean_error(run(["scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path)]),
                       "model.layers.0.self_attn.o_proj.bias")
    assert not (tmp_path / "model.pth").exists()


def test_convert_missing_source(tmp_path):
    assert_clean_error(run(["scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path)]),
                       "download.py")


def test_interactive_chat_uses_template(checkpoint, tmp_path):
    """Two turns through --interactive: each answer is the greedy continuation of the templated chat."""
    import torch
    from decode import generate
    from load import load_model
    from tokenizer import load_tokenizer
    d = tmp_path / "chat"
    shutil.copytree(checkpoint.parent, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(d / "model.pth"), "--interactive",
                        "--temperature", "0", "--max_new_tokens", "6", "--device", "cpu"],
                       cwd=ROOT, input="Hello there\nAnd again\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.split("\n")[:2]

    tok, model = load_tokenizer(d), load_model(d / "model.pth")
    messages = [{"role": "user", "content": "Hello there"}]
    expected = []
    for follow_up in ("And again", None):
        ids = tok.encode_chat(messages)
        out = generate(model, torch.tensor(ids), 6, temperature=0.0, eos_ids=tok.eos_ids)[0, len(ids):].tolist()
        expected.append(tok.decode([t for t in out if t not in tok.eos_ids]))
        messages += [{"role": "assistant", "content": expected[-1]}, {"role": "user", "content": follow_up}]
    assert answers == expected
