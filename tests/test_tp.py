"""tp.py: 2-way tensor parallelism under torchrun on the CPU (gloo) against the single-process model."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model, save_and_convert
from eval import cli as eval_cli
from decode import generate
from generate import cli
from load import load_model
from model import ModelArgs, Transformer
import quantize
from load import Dist, maybe_init_dist
from tp import check_divisible
from tp_worker import PROMPT, dequant_only, logits

REPO = Path(__file__).resolve().parent.parent


def torchrun(*args, timeout=600) -> subprocess.CompletedProcess:
    # OMP_NUM_THREADS set: one thread per rank, and torchrun prints no banner about it.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def save_random_moe(root: Path) -> Path:
    """A tiny Mixtral-shaped checkpoint (4 experts, top-2, GQA) with random weights."""
    config = ModelArgs(block_size=256, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=128, num_experts=4, num_activated_experts=2)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.normal_(1, 0.05)
    root.mkdir(parents=True)
    torch.save(model.state_dict(), root / "model.pth")
    config.to_json(root / "config.json")
    return root / "model.pth"


def save_byte_tokenizer(root: Path, size: int = 256):
    """A byte-level tokenizer.json (no merges) of the first `size` byte symbols: enough for ASCII text
    on a vocab-256 model (size 255 for the odd-vocab one: a tokenizer larger than its model is refused)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:size])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(root / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {
        # GQA + q/k/v bias + tied embeddings (the output shard is a view of the embedding rows).
        "qwen2": save_and_convert(make_hf_model("qwen2"), root / "qwen2"),
        # Untied, and a vocab of 255 that 2 ranks split only with padding.
        "llama_odd_vocab": save_and_convert(make_hf_model("llama31", vocab_size=255, intermediate_size=128),
                                            root / "llama"),
        "moe": save_random_moe(root / "moe"),
        # Q/k norm over the whole projection, whose heads the ranks split (tp.ShardedRMSNorm); post-norms.
        "olmo2": save_and_convert(make_hf_model("olmo2"), root / "olmo2"),
        # Experts with their own size, unnormalised top-k, a dense layer between sparse ones.
        "qwen3_moe": save_and_convert(make_hf_model("qwen3_moe"), root / "qwen3_moe"),
        # Sinks per query head, o_proj's bias and the down projections' added once, biased experts.
        "gpt_oss": save_and_convert(make_hf_model("gpt_oss"), root / "gpt_oss"),
        # Attention and feed-forward side by side on one LayerNorm, each all-reduced.
        "cohere2": save_and_convert(make_hf_model("cohere2"), root / "cohere2"),
        # A shared expert split as a dense feed-forward beside the routed ones, its gate whole.
        "qwen2_moe": save_and_convert(make_hf_model("qwen2_moe"), root / "qwen2_moe"),
        # Sigmoid routing within groups, the selection bias whole on every rank, shared experts split.
        "glm4_moe": save_and_convert(make_hf_model("glm4_moe"), root / "glm4_moe"),
        # Latent attention: heads split, the latent whole on every rank.
        "deepseek_v3": save_and_convert(make_hf_model("deepseek_v3"), root / "deepseek_v3"),
        # Global layers with heads of their own size and count (values their keys), split apart from the local ones.
        "gemma4": save_and_convert(make_hf_model("gemma4", num_global_key_value_heads=2), root / "gemma4"),
        # Experts beside the dense feed-forward: each split and all-reduced before its own norm.
        "gemma4_moe": save_and_convert(make_hf_model("gemma4_moe", num_global_key_value_heads=2), root / "gemma4_moe"),
        # Per-layer inputs (whole on every rank), layers reading an earlier one's split cache.
        "gemma4_e2b": save_and_convert(make_hf_model("gemma4_e2b", num_key_value_heads=2), root / "gemma4_e2b"),
        # Gated DeltaNet: key heads and the value heads they serve split, each rank's state its heads';
        # the gated attention's gates split with its query heads.
        "qwen3_5": save_and_convert(make_hf_model("qwen3_5"), root / "qwen3_5"),
        # LFM2's convolution: its channels split, each rank's state its channels'.
        "lfm2_moe": save_and_convert(make_hf_model("lfm2_moe"), root / "lfm2_moe"),
        # LFM3: a gate per head, split with its query heads; a window on one layer.
        "lfm3": save_and_convert(make_hf_model("lfm3"), root / "lfm3"),
    }
    paths["qwen2_int8"] = quantize.quantize_checkpoint(paths["qwen2"], "int8")
    paths["qwen3_5_int8"] = quantize.quantize_checkpoint(paths["qwen3_5"], "int8")
    paths["llama_odd_vocab_int4"] = quantize.quantize_checkpoint(paths["llama_odd_vocab"], "int4", 32)
    paths["moe_int8"] = quantize.quantize_checkpoint(paths["moe"], "int8")
    paths["moe_int4"] = quantize.quantize_checkpoint(paths["moe"], "int4", 32)
    paths["qwen3_moe_int8"] = quantize.quantize_checkpoint(paths["qwen3_moe"], "int8")
    paths["gpt_oss_int8"] = quantize.quantize_checkpoint(paths["gpt_oss"], "int8")
    paths["glm4_moe_int8"] = quantize.quantize_checkpoint(paths["glm4_moe"], "int8")
    paths["deepseek_v3_int8"] = quantize.quantize_checkpoint(paths["deepseek_v3"], "int8")
    paths["gemma4_moe_int8"] = quantize.quantize_checkpoint(paths["gemma4_moe"], "int8")
    return paths


@pytest.fixture(scope="module")
def tp_results(checkpoints, tmp_path_factory):
    """One torchrun launch checks every checkpoint; returns path -> what rank 0 saw."""
    out = tmp_path_factory.mktemp("tp_out") / "results.pt"
    run = torchrun("tests/tp_worker.py", *checkpoints.values(), "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("name", ["qwen2", "llama_odd_vocab", "moe", "olmo2", "qwen3_moe", "qwen2_int8:dequant",
                                  "llama_odd_vocab_int4:dequant", "moe_int8:dequant", "moe_int4:dequant",
                                  "qwen3_moe_int8:dequant", "gpt_oss", "gpt_oss_int8:dequant", "cohere2",
                                  "qwen2_moe", "glm4_moe", "glm4_moe_int8:dequant", "deepseek_v3",
                                  "deepseek_v3_int8:dequant", "gemma4", "gemma4_moe", "gemma4_moe_int8:dequant",
                                  "gemma4_e2b", "qwen3_5", "qwen3_5_int8:dequant", "lfm2_moe", "lfm3"])
def test_tp_matches_single_process(name, checkpoints, tp_results):
    """Sharded == whole to fp32 precision (quantized layers on the fp32 dequantize path)."""
    name, _, variant = name.partition(":")
    path = checkpoints[name]
    got = tp_results[f"{path}:{variant}" if variant else str(path)]
    with dequant_only() if variant else contextlib.nullcontext():
        model = load_model(path)
    torch.testing.assert_close(got["logits"], logits(model), atol=2e-5, rtol=1e-5)
    expected = generate(model, PROMPT, 20, temperature=0.0)
    assert got["greedy"].tolist() == expected.tolist()
    assert len(set(expected[0, len(PROMPT):].tolist())) > 3, "degenerate test: the model repeats one token"
    assert_ranks_sampled_alike(got)


@pytest.mark.parametrize("name", ["qwen2_int8", "llama_odd_vocab_int4", "moe_int8", "moe_int4"])
def test_tp_quantized_kernels(name, checkpoints, tp_results):
    """With the CPU int8/int4 kernels (activations rounded to bf16, or to int8 with VNNI) sharded and
    whole agree to that precision: a misplaced scale or nibble would be off by the size of the
    logits (~5), not by ~0.05."""
    path = checkpoints[name]
    got = tp_results[str(path)]
    torch.testing.assert_close(got["logits"], logits(load_model(path)), atol=0.15, rtol=0.02)
    assert_ranks_sampled_alike(got)


def assert_ranks_sampled_alike(got):
    """Every rank drew the same tokens (same seed, bit-identical gathered logits)."""
    rank0, rank1 = got["sampled_by_rank"]
    assert rank0.tolist() == rank1.tolist()
    assert rank0[0].tolist() != rank0[1].tolist(), "degenerate test: sampling rows should differ"


def single_process_text(checkpoints, capsys) -> tuple:
    path = checkpoints["qwen2"]
    save_byte_tokenizer(path.parent)
    args = ["--checkpoint_path", str(path), "--prompt", "Hi", "--temperature", "0", "--max_new_tokens", "24",
            "--device", "cpu"]
    cli(args)
    return args, capsys.readouterr().out


def test_generate_cli_under_torchrun(checkpoints, capsys):
    """generate.py under torchrun prints the single-process text once; logs come from rank 0 only."""
    args, single = single_process_text(checkpoints, capsys)
    run = torchrun("generate.py", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == single
    assert run.stderr.count("Loaded ") == 1 and run.stderr.count("Average tokens/sec") == 1


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_under_torchrun(checkpoints, tmp_path, capsys, compile):
    """generate.py --prompts_file under torchrun: every rank runs the engine's schedule on its shard;
    the JSONL equals the single process's, sampled prompts included, written once. Compiled too
    (against the compiled single process): the decode graph with the collectives in it (frozen, and
    a compiled prefill too, where the model is not packed for kernels.cpp)."""
    # int8: decisive logits (a random MoE's router has near-ties). Compiled, fp32: the compiled int8
    # step gives another token at the 5th of the long prompt's 7 under 2 ranks than in one process
    # (with eager prefill too; open, README Tensor parallelism).
    path = checkpoints["qwen2" if compile else "qwen2_int8"]
    save_byte_tokenizer(path.parent)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in [
        {"prompt": "Hi"}, {"prompt": "A much longer prompt than the first one, " * 3, "max_new_tokens": 7},
        {"prompt": "Sampled", "temperature": 1.0, "seed": 3}, {"prompt": "x"}]))
    args = ["--checkpoint_path", str(path), "--prompts_file", str(prompts), "--temperature", "0",
            "--max_new_tokens", "12", "--max_batch_size", "2", "--prefill_chunk", "16", "--device", "cpu"]
    args += ["--compile"] if compile else []
    cli(args + ["--output", str(tmp_path / "single.jsonl")])
    run = torchrun("generate.py", *args, "--output", tmp_path / "tp.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "single.jsonl").read_text()
    assert run.stderr.count("Results written") == 1


@pytest.mark.slow
def test_speculative_under_torchrun(checkpoints, capsys):
    """A sharded target verifies the drafts of a whole (unsharded) int8 draft on every rank;
    greedy, it must give the target's own greedy text."""
    args, single = single_process_text(checkpoints, capsys)
    run = torchrun("generate.py", *args, "--draft_checkpoint_path", checkpoints["qwen2_int8"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == single and run.stderr.count("Speculation: ") == 1


def test_eval_perplexity_under_torchrun(checkpoints, tmp_path, capsys):
    """eval.py under torchrun: the single-process perplexity, printed once, the JSON written once."""
    path = checkpoints["llama_odd_vocab"]
    save_byte_tokenizer(path.parent, size=255)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    args = ["--checkpoint_path", str(path), "--perplexity", str(text), "--max_seq_length", "64", "--device", "cpu"]
    eval_cli(args)
    single = capsys.readouterr().out
    assert single.startswith("perplexity ")
    run = torchrun("eval.py", *args, "--output_json", tmp_path / "out.json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\n") == 1 and run.stdout.startswith("perplexity ")
    expected = pytest.approx(float(single.split()[1]), rel=1e-5)  # fp32: the printed 4th decimal may differ
    assert float(run.stdout.split()[1]) == expected
    assert json.loads((tmp_path / "out.json").read_text())["perplexity"] == expected


def test_divisibility_errors():
    with pytest.raises(ValueError, match=r"^n_head = 9 does not split across 2 .* across 1 or 3 ranks"):
        check_divisible(ModelArgs.from_name("SmolLM2-135M"), 2)
    with pytest.raises(ValueError, match=r"^n_local_heads \(key/value heads\) = 2 .* across 4 .* across 1 or 2 ranks"):
        check_divisible(ModelArgs(n_head=8, n_local_heads=2, dim=64, intermediate_size=128), 4)
    with pytest.raises(ValueError, match=r"^intermediate_size = 90 .* across 1 or 2 ranks"):
        check_divisible(ModelArgs(n_head=4, dim=64, intermediate_size=90), 4)
    with pytest.raises(ValueError, match=r"^moe_intermediate_size \(of each expert\) = 90 "):
        check_divisible(ModelArgs(n_head=4, dim=64, intermediate_size=90, num_experts=4), 4)
    check_divisible(ModelArgs.from_name("llama-3-70b"), 8)


@pytest.mark.parametrize("groupsize,message", [
    (32, "160 input features in groups of 32 does not split into whole groups across 2 ranks; use int8 or fewer"),
    (64, "64 input features in groups of 64 .*; re-quantize with --groupsize 32$")])
def test_int4_groups_must_split(groupsize, message, tmp_path):
    """An input split (wo: 64 columns, w2: 160) must keep int4 groups whole on each rank."""
    path = quantize.quantize_checkpoint(save_and_convert(make_hf_model("llama2"), tmp_path), "int4", groupsize)
    with pytest.raises(ValueError, match=message):
        load_model(path, tp=Dist(rank=0, world_size=2, device="cpu"))


def test_maybe_init_dist_outside_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert maybe_init_dist("cpu") is None


@pytest.mark.parametrize("device,message", [("cuda", "launched with 2 ranks on this node but only 1 CUDA"),
                                            ("mps", "runs on CUDA .* or the CPU")])
def test_maybe_init_dist_errors(device, message, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=message):
        maybe_init_dist(device)


@pytest.mark.slow
def test_compiled_tp_decode(checkpoints, tmp_path):
    """torch.compile(fullgraph=True) captures the collectives (OLMo 2's sharded q/k norm too):
    compiled greedy == single-process eager."""
    out = tmp_path / "results.pt"
    run = torchrun("tests/tp_worker.py", checkpoints["qwen2"], checkpoints["olmo2"], "--compile", "--out", out)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("qwen2", "olmo2"):
        got = torch.load(out)[str(checkpoints[name])]
        expected = generate(load_model(checkpoints[name]), PROMPT, 20, temperature=0.0)
        assert got["compiled_greedy"].tolist() == expected.tolist(), name
