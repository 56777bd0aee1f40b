# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Batched decode: aggregate tokens/s and per-stream inter-token latency at 1..16 concurrent streams.

    python scripts/bench_batched.py --models smollm2 --precisions fp32,int8 --streams 1,2,4,8,16

brisk's engine (engine.py, continuous batching, --compile), llama.cpp's llama-batched-bench on
GGUFs converted from the same weights, and transformers' batched generate() with padding, each
case in its own process, in one run. Every stream gets its own 16-token prompt and decodes
--new_tokens tokens. Also: the time to first token of a request with a --long_prompt-token prompt
arriving while 7 streams decode, against the same request on an idle engine (chunked prefill).
Writes docs/bench-batched.json and, with matplotlib, docs/bench-batched.png.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(ROOT))
from scripts import bench  # noqa: E402

PROMPT = 16


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 1000), (n, length), generator=g).tolist()


def worker_brisk(spec: dict) -> dict:
    import torch
    from engine import Engine, Request
    from packed_cache import finish_writing, load_packed
    from tokenizer import load_tokenizer
    dtype = getattr(torch, spec["dtype"]) if spec["dtype"] else torch.float32
    # as server.py does
    model = load_packed(spec["checkpoint"], "cpu", dtype)
    tokenizer = load_tokenizer(Path(spec["tokenizer_dir"]))
    B, N, long = spec["streams"], spec["new_tokens"], spec["long_prompt"]
    engine = Engine(model, tokenizer, B, max(PROMPT + N, long + 8) + 8, compile=spec["compile"])
    t0 = time.perf_counter()
    engine.generate([Request(p, 4, eos_ids=[]) for p in prompts(B, PROMPT, model.config.vocab_size)])  # compiles
    warmup_s = time.perf_counter() - t0
    finish_writing()  # a first run's packed model, written in the background: not beside the timed steps
    times = {}  # request id -> token timestamps

    def run(requests) -> list:
        ids = [engine.add(r) for r in requests]
        while engine.has_work():
            for out in engine.step():
                times.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.token_ids))
        return ids

    ids = run([Request(p, N, eos_ids=[]) for p in prompts(B, PROMPT, model.config.vocab_size)])
    first, last = max(times[i][0] for i in ids), max(times[i][-1] for i in ids)
    decoded = sum(sum(t > first for t in times[i]) for i in ids)
    gaps = sorted(b - a for i in ids for a, b in zip(times[i], times[i][1:]))
    result = dict(aggregate_tok_s=decoded / (last - first), itl_ms=1e3 * gaps[len(gaps) // 2], warmup_s=warmup_s)
    if spec["ttft"]:  # a long prompt arriving at an idle engine, then while B - 1 streams decode
        # Three different prompts: a prompt seen before would be found in the engine's prompt cache.
        warm, long_prompt, busy_prompt = (prompts(1, long, model.config.vocab_size, seed)[0] for seed in (2, 3, 4))
        run([Request(warm, 2, eos_ids=[])])  # compiles the decode step's longer attention bucket
        t0 = time.perf_counter()
        (rid,) = run([Request(long_prompt, 2, eos_ids=[])])
        idle = times[rid][0] - t0
        busy_ids = [engine.add(Request(p, N, eos_ids=[])) for p in prompts(B - 1, PROMPT, model.config.vocab_size)]
        while not all(i in times for i in busy_ids):  # the others are decoding
            for out in engine.step():
                times.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.token_ids))
        t0 = time.perf_counter()
        rid = engine.add(Request(busy_prompt, 2, eos_ids=[]))
        while rid not in times:
            for out in engine.step():
                times.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.token_ids))
        result.update(ttft_idle_s=idle, ttft_busy_s=times[rid][0] - t0)
    return result


def worker_transformers(spec: dict) -> dict:
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=getattr(torch, spec["dtype"]))
    B, N = spec["streams"], spec["new_tokens"]
    x = torch.tensor(prompts(B, PROMPT, model.config.vocab_size))
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0, temperature=None, top_p=None,
                  top_k=None)
    with torch.no_grad():
        model.generate(x, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=N, min_new_tokens=N, **kwargs)
        decode = time.perf_counter() - t0 - prefill
    return dict(aggregate_tok_s=B * (N - 1) / decode, itl_ms=1e3 * decode / (N - 1))


def llamacpp_batched(gguf: Path, streams: list, new_tokens: int, threads: int, llamacpp_dir: Path) -> dict:
    """llama-batched-bench's S_TG (aggregate decode tokens/s) for each number of parallel sequences."""
    tool = llamacpp_dir / "build/bin/llama-batched-bench"
    ctx = max(streams) * (PROMPT + new_tokens) + 64
    cmd = [str(tool), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(PROMPT),
           "-ntg", str(new_tokens), "-npl", ",".join(map(str, streams)), "-t", str(threads)]
    code, out, err, _ = bench.run_child(cmd)
    if code < 0:
        # Prompt processing on the weights llama.cpp repacks for the CPU dies on some (seen: SIGSEGV
        # with Q8_0 / Q4_0 on an AMX Xeon, as in bench.py): the weights as stored, then.
        print(f"llama-batched-bench died (signal {-code}); again with --no-repack", file=sys.stderr)
        code, out, err, _ = bench.run_child(cmd + ["--no-repack"])
    if code != 0:
        raise RuntimeError(f"llama-batched-bench failed (exit {code}): {err.strip().splitlines()[-1:]}")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0]]
    results = {}
    for row in rows[2:]:
        cells = dict(zip(header, (c.strip() for c in row)))
        results[int(cells["B"])] = dict(aggregate_tok_s=float(cells["S_TG t/s"]),
                                        itl_ms=1e3 * float(cells["T_TG s"]) / new_tokens)
    return results


WORKERS = {"brisk": worker_brisk, "transformers": worker_transformers}


def run_worker(spec: dict) -> dict:
    code, out, err, rss = bench.run_child([sys.executable, __file__, "--worker", json.dumps(spec)])
    if code != 0:
        raise RuntimeError(f"worker failed (exit {code}): {(err.strip().splitlines() or ['(no output)'])[-1]}")
    return dict(json.loads(out.strip().splitlines()[-1]), peak_rss_mb=rss)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2", help="smollm2, llama-1b, or checkpoint folders (comma-separated)")
    p.add_argument("--precisions", default="fp32,bf16,int8,int4")
    p.add_argument("--systems", default="brisk,llama.cpp,transformers")
    p.add_argument("--streams", default="1,2,4,8,16")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--long_prompt", type=int, default=512, help="the late request's prompt (time to first token)")
    p.add_argument("--eager", action="store_true", help="brisk without --compile")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work_dir", type=Path, default=ROOT / "checkpoints/bench",
                   help="where quantized checkpoints and GGUFs are made (shared with scripts/bench.py)")
    p.add_argument("--smollm2_dir", type=Path, default=bench.DEFAULT_SMOLLM2_DIR)
    p.add_argument("--llamacpp_dir", type=Path, default=bench.DEFAULT_LLAMACPP_DIR)
    p.add_argument("--output", type=Path, default=ROOT / "docs/bench-batched.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import torch
        spec = json.loads(args.worker)
        torch.set_num_threads(spec["threads"])
        print(json.dumps(WORKERS[spec["kind"]](spec)))
        return
    streams = [int(s) for s in args.streams.split(",")]
    systems = args.systems.split(",")
    tools = None
    if "llama.cpp" in systems:
        try:
            tools = bench.llamacpp_tools(args.llamacpp_dir)
        except FileNotFoundError as e:
            bench.log(f"skip llama.cpp: {e}")
    import torch
    meta = dict(cpu=bench.cpu_name(), isa=torch.backends.cpu.get_cpu_capability(), cpu_flags=bench.cpu_isa(),
                threads=args.threads,
                torch=torch.__version__, new_tokens=args.new_tokens, prompt=PROMPT, compile=not args.eager)
    table = []
    for name in args.models.split(","):
        m = bench.resolve_model(name, args)
        for precision in args.precisions.split(","):
            rows = {}
            if "llama.cpp" in systems and tools is not None and m.hf_dir is not None:
                gguf = bench.gguf_file(m, precision, tools)
                for B, r in llamacpp_batched(gguf, streams, args.new_tokens, args.threads, args.llamacpp_dir).items():
                    rows[("llama.cpp", B)] = r
            for B in streams:
                base = dict(threads=args.threads, streams=B, new_tokens=args.new_tokens,
                            dtype=bench.TORCH_DTYPES.get(precision))
                if "brisk" in systems:
                    spec = dict(base, kind="brisk", checkpoint=str(bench.brisk_checkpoint(m, precision)),
                                tokenizer_dir=str(m.checkpoint.parent), compile=not args.eager,
                                long_prompt=args.long_prompt, ttft=B == 8)
                    rows[("brisk", B)] = run_worker(spec)
                if "transformers" in systems and precision in bench.TORCH_DTYPES and m.hf_dir is not None:
                    spec = dict(base, kind="transformers", hf_dir=str(m.hf_dir))
                    rows[("transformers", B)] = run_worker(spec)
            for (system, B), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                table.append(dict(model=m.name, precision=precision, system=system, streams=B, **r))
                bench.log(f"{m.name} {precision} {system:12s} {B:2d} streams: {r['aggregate_tok_s']:8.1f} tok/s, "
                          f"ITL {r['itl_ms']:.1f} ms" + (f", TTFT idle {r['ttft_idle_s']:.2f} s / with 7 decoding "
                                                          f"{r['ttft_busy_s']:.2f} s" if "ttft_busy_s" in r else ""))
            # Written after every precision: a long run that is stopped keeps what it measured.
            args.output.write_text(json.dumps(dict(meta=meta, results=table), indent=1) + "\n")
    bench.log(f"wrote {args.output}")
    plot(table, args.output.with_suffix(".png"), meta)


def plot(table: list, path: Path, meta: dict):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        bench.log("matplotlib missing: no plot (pip install -r requirements-bench.txt)")
        return
    models = list(dict.fromkeys(r["model"] for r in table))  # a row of panels a model, a column a precision
    precisions = list(dict.fromkeys(r["precision"] for r in table))
    fig, axes = plt.subplots(len(models), len(precisions), figsize=(3.6 * len(precisions), 3.2 * len(models)),
                             squeeze=False)
    for ax, (model, precision) in zip(axes.flat, [(m, p) for m in models for p in precisions]):
        for system in ("brisk", "llama.cpp", "transformers"):
            rows = sorted((r["streams"], r["aggregate_tok_s"]) for r in table
                          if (r["model"], r["precision"], r["system"]) == (model, precision, system))
            if rows:
                ax.plot(*zip(*rows), marker="o", label=system)
        ax.set(title=f"{model} {precision}", xlabel="concurrent streams", ylabel="tokens/s, all streams",
               xscale="log", xticks=[1, 2, 4, 8, 16])
        ax.set_xticklabels(["1", "2", "4", "8", "16"])
        ax.legend()
    fig.suptitle(f"{meta['cpu']} ({meta.get('cpu_flags') or meta['isa']}), {meta['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    bench.log(f"wrote {path}")


if __name__ == "__main__":
    main()
