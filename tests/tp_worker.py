"""Run by tests/test_tp.py under torchrun: loads each checkpoint tensor-parallel and writes what rank 0 sees.

For each checkpoint: prefill + cached-decode logits for fixed ids, a greedy generation, and a sampled
generation from every rank (rank 0 collects them to prove the ranks agree). Quantized checkpoints
run twice: with the device's kernels (activations rounded on the CPU), and with every layer forced
onto quantize's dequantize path (fp32), where the sharded model must match the whole one to fp32 precision.
"""
import argparse
import sys
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from compiling import compile_step  # noqa: E402
from decode import decode_one_token, generate  # noqa: E402
from load import load_model, maybe_init_dist  # noqa: E402
import quantized  # noqa: E402

IDS = torch.arange(2 * 12).reshape(2, 12) * 7 % 200  # (B, T) fixed ids every process can rebuild
PROMPT = torch.tensor([5, 17, 99, 3, 42, 7])


def logits(model, ids=IDS, prefill_len=8):
    """Prefill the first prefill_len positions, then decode the rest one at a time: (B, T, V)."""
    model.setup_caches(max_batch_size=ids.shape[0], max_seq_length=ids.shape[1])
    with torch.no_grad():
        steps = [model(ids[:, :prefill_len], torch.arange(prefill_len))]
        steps += [model(ids[:, t:t + 1], torch.tensor([t])) for t in range(prefill_len, ids.shape[1])]
    return torch.cat(steps, dim=1)


def dequant_only():
    """Every quantized layer finalized onto the dequantize + F.linear path (fp32 activations)."""
    return patch.multiple(quantized, int8_kernel=lambda *args, **kwargs: "dequant",
                          int4_kernel=lambda *args, **kwargs: "dequant")


def check(path, d):
    model = load_model(path, "cpu", torch.float32, tp=d)
    r = {"logits": logits(model), "greedy": generate(model, PROMPT, 20, temperature=0.0)}
    torch.manual_seed(0)
    sampled = generate(model, PROMPT, 20, batch_size=2, temperature=1.0, top_k=50)
    everyone = [torch.empty_like(sampled) for _ in range(d.world_size)]
    dist.all_gather(everyone, sampled)
    r["sampled_by_rank"] = everyone
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compile", action="store_true", help="also decode with the compiled (fullgraph) step")
    args = p.parse_args()
    d = maybe_init_dist("cpu")
    assert d is not None and d.world_size == 2, "run me under torchrun --nproc_per_node=2"
    results = {}
    for path in args.checkpoints:
        results[str(path)] = r = check(path, d)
        if "quantization" in torch.load(path, mmap=True, weights_only=True):
            with dequant_only():
                results[f"{path}:dequant"] = check(path, d)
        if args.compile:
            model = load_model(path, "cpu", torch.float32, tp=d)
            decode_fn = compile_step(decode_one_token, "cpu")
            r["compiled_greedy"] = generate(model, PROMPT, 20, temperature=0.0, decode_fn=decode_fn)
    if d.rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
