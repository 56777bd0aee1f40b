# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Batch-1 decode against the device's memory roofline, on random weights of a model's shape.

    python scripts/roofline.py --model llama-3-8b --precisions bf16,int8,int4 --peer --profile

Builds the model from a preset of model.py (or a config.json) with random weights made on the
device, so an 8B model needs no checkpoint on disk and starts in seconds; quantizes it in memory
as quantize.py does; compiles the decode step as generate.py --compile does; and decodes. It
reports tokens/s two ways (the rate between streamed tokens, as a user sees them, and the rate
of the device when no one reads the tokens), the weight bytes each step reads, the bandwidth
that makes, and its share of a streaming read of the device's memory measured in the same run.
--peer runs transformers on the same shape (random weights too: speed does not depend on the
values) with its static cache and torch.compile, as scripts/bench.py runs it. --profile splits
a decode step into the host's time to queue it and the device kernels' time (CUDA), which tells
a launch-bound step from a bandwidth-bound one.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decode  # noqa: E402
import load  # noqa: E402
from compiling import compile_step, skip_guards  # noqa: E402
from errors import check_output_file, error_boundary, positive_int  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZED = ("int8", "int4", "int4-sym")  # weights quantized, activations in --activations


def model_config(name: str, vocab_size: int = None) -> ModelArgs:
    config = ModelArgs.from_json(name) if name.endswith(".json") else ModelArgs.from_name(name)
    if vocab_size:
        config.vocab_size = vocab_size
    return config


def random_state_dict(config: ModelArgs, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Weights of config's shape drawn on the device (norm scales 1, biases 0), the tied output left out."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    g = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name == "output.weight" and config.tie_embeddings:
            continue
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("bias"):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02)
    return out


def random_model(config: ModelArgs, device: str, precision: str, activations: torch.dtype,
                 groupsize: int) -> Transformer:
    """What load_packed(...) returns for a checkpoint of this shape at `precision`, without the checkpoint."""
    dtype = activations if precision in QUANTIZED else DTYPES[precision]
    state_dict, quantization = random_state_dict(config, device, dtype), None
    if precision in QUANTIZED:
        import quantize
        gs = groupsize if precision != "int8" else None
        state_dict, layers = quantize.quantize_state_dict(state_dict, config, precision, gs)
        quantization = {"format": quantize.FORMAT_VERSION, "mode": precision, "bits": 8 if precision == "int8" else 4,
                        "groupsize": gs, "layers": layers}
    model = load.build_model(config, state_dict, quantization, device, dtype)
    if device == "cpu":
        from kernels import pack_for_cpu
        model = pack_for_cpu(model)
    return model


def timed_generate(model, prompt, new_tokens, decode_fn, device, callback=None) -> tuple:
    """(seconds, tokens) of one generation, from the device idle to the device idle."""
    load.device_sync(device)
    t0 = time.perf_counter()
    out = decode.generate(model, prompt, new_tokens, decode_fn=decode_fn, callback=callback)
    load.device_sync(device)
    return time.perf_counter() - t0, out


def measure_decode(model, device: str, compile: bool, prompt_tokens: int, new_tokens: int, profile: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(model.config.vocab_size, 1000), (prompt_tokens,), generator=g).to(device)
    decode_fn = compile_step(decode.decode_one_token, device) if compile else decode.decode_one_token
    model.setup_caches(max_batch_size=1, max_seq_length=prompt_tokens + new_tokens)
    warm_s, _ = timed_generate(model, prompt, new_tokens, decode_fn, device)  # compiles; CUDA graphs captured
    timed_generate(model, prompt, new_tokens, decode_fn, device)

    # Streamed: the callback gets each token on the host, as generate.py's streamer does.
    times, streamed = [], []

    def on_token(token):
        times.append(time.perf_counter())
        streamed.append(int(token[0]))
    _, out = timed_generate(model, prompt, new_tokens, decode_fn, device, callback=on_token)
    if streamed != out[0, prompt_tokens:].tolist():
        raise AssertionError("the streamed tokens differ from the returned ones")
    # The device's own rate: two generations that differ only in their length, nothing read between,
    # each the best of 3. Their difference is a few steps: on a tiny model within the timer's noise,
    # where it can come out negative, so that none is reported then.
    half = new_tokens // 2
    full_s = min(timed_generate(model, prompt, new_tokens, decode_fn, device)[0] for _ in range(3))
    half_s = min(timed_generate(model, prompt, half, decode_fn, device)[0] for _ in range(3))
    # And every token waited for before the next step is queued (a loop that reads each token at once).
    synced = []
    timed_generate(model, prompt, new_tokens, decode_fn, device,
                   callback=lambda token: (load.device_sync(device), synced.append(time.perf_counter())))
    result = dict(streamed_tok_s=(len(times) - 1) / (times[-1] - times[0]),
                  unread_tok_s=(new_tokens - half) / (full_s - half_s) if full_s > half_s else None,
                  synced_tok_s=(len(synced) - 1) / (synced[-1] - synced[0]),
                  first_run_s=warm_s, tokens=out[0, prompt_tokens:prompt_tokens + 16].tolist())
    if profile:
        result.update(profile_steps(model, prompt, decode_fn, device, steps=min(32, new_tokens - 1)))
    return result


def profile_steps(model, prompt, decode_fn, device: str, steps: int) -> dict:
    """The host's time to queue a decode step, the device kernels' time in one, and the kernels
    that take the most of it (CUDA: the torch profiler's kernel records)."""
    T = prompt.numel()
    positions = torch.arange(T, T + steps, device=device, dtype=torch.int)
    greedy = dict(temperature=0.0, top_k=None, top_p=None)

    def prefill():
        with torch.no_grad():
            return decode.prefill(model, prompt[None], **greedy)

    @torch.no_grad()  # as generate(): a step compiled with no autograd
    def run(token):
        load.device_sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            with skip_guards(True):
                token, _ = decode_fn(model, token.clone(), positions[i:i + 1], **greedy)
        queued = time.perf_counter()
        load.device_sync(device)
        return (queued - t0) / steps * 1e3, (time.perf_counter() - t0) / steps * 1e3
    host_ms, wall_ms = run(prefill())
    out = dict(host_ms_per_step=host_ms, wall_ms_per_step=wall_ms)
    if not device.startswith("cuda"):
        return out
    from torch.profiler import ProfilerActivity, profile
    token = prefill()  # outside the profile
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(token)
    except Exception as e:  # the figures above stand without it
        return dict(out, kernels=f"the profiler failed: {type(e).__name__}: {e}"[:300])
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return dict(out, kernels="the profiler recorded no kernels")
    by_name = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps  # ms
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    return dict(out, kernels_per_step=len(kernels) / steps, kernel_ms_per_step=busy,
                top_kernels=[dict(name=n[:90], ms_per_step=sum(t) / 1e3 / steps, calls_per_step=len(t) / steps,
                                  mean_us=sum(t) / len(t)) for n, t in top])


def product_rows(config: ModelArgs, device: str, precisions: list) -> list:
    """Each distinct one-row product of the decode step ([1, K] @ [N, K].T), alone, three ways:
    ATen's (cuBLAS; int8 cast to bf16 first), inductor's as a compiled step makes it (its reduction
    kernel, the int8 cast fused in) and gemv.py's Triton kernel; GB/s of the weights read, each
    checked against ATen's result. triton.testing.do_bench clears the L2 cache between calls, as
    a step's other layers do."""
    import torch._inductor.config as inductor_config
    import triton.testing
    from torch.nn import functional as F

    import gemv
    import quantized
    gemv.register()
    with torch.device("meta"):
        shapes = sorted({tuple(m.weight.shape) for m in Transformer(config).modules() if isinstance(m, torch.nn.Linear)})
    g = torch.Generator(device).manual_seed(0)
    rows = []
    for precision in [p for p in ("bf16", "int8") if p in precisions]:
        for N, K in shapes:
            x = torch.randn(1, K, generator=g, device=device, dtype=torch.bfloat16)
            if precision == "int8":
                w = torch.randint(-127, 128, (N, K), generator=g, device=device, dtype=torch.int8)
                scales = torch.rand(N, generator=g, device=device, dtype=torch.bfloat16) + 0.5

                def aten(x, w=w, scales=scales):
                    return quantized.int8_matmul(x, w, scales, "fused")
            else:
                w, scales = torch.randn(N, K, generator=g, device=device, dtype=torch.bfloat16), None

                def aten(x, w=w):
                    return F.linear(x, w)
            nbytes = w.numel() * w.element_size() + (0 if scales is None else scales.numel() * 2)
            row = dict(precision=precision, N=N, K=K, mb=nbytes / 1e6)
            try:  # one shape failing (a compile, memory) must not lose the others
                with inductor_config.patch(coordinate_descent_tuning=True):  # as compile_step on CUDA
                    compiled = torch.compile(aten, fullgraph=True)
                    compiled(x)
                expected = aten(x).float()
                for name, fn in (("aten", aten), ("inductor", compiled), ("gemv", lambda x: gemv.gemv(x, w, scales))):
                    err = ((fn(x).float() - expected).abs().max() / expected.abs().max()).item()
                    ms = triton.testing.do_bench(lambda: fn(x), warmup=25, rep=200)
                    row[f"{name}_us"], row[f"{name}_gbps"], row[f"{name}_rel_error"] = ms * 1e3, nbytes / ms / 1e6, err
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            torch._dynamo.reset()
    return rows


def peer_transformers(config: ModelArgs, device: str, dtype: torch.dtype, prompt_tokens: int, new_tokens: int) -> dict:
    """transformers' LLaMA of the same shape, random weights, static cache + torch.compile (bench.py's recipe)."""
    import transformers
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_local_heads,
        head_dim=config.head_dim, max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_base, rope_scaling=config.rope_scaling, tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(config.vocab_size, 1000), (1, prompt_tokens), generator=g).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None,
                  top_p=None, top_k=None, attention_mask=torch.ones_like(prompt))

    class Timer:
        def __init__(self):
            self.times, self.seen_prompt = [], False

        def put(self, value):  # the first call carries the prompt
            if self.seen_prompt:
                load.device_sync(device)
                self.times.append(time.perf_counter())
            self.seen_prompt = True

        def end(self):
            pass
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(prompt, **kwargs)
        warm_s = time.perf_counter() - t0
        timer = Timer()
        model.generate(prompt, streamer=timer, **kwargs)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_embeddings:
        nbytes -= model.get_input_embeddings().weight.numel() * dtype.itemsize
    return dict(synced_tok_s=(len(timer.times) - 1) / (timer.times[-1] - timer.times[0]), first_run_s=warm_s,
                bytes_per_step=nbytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b", help="a preset of model.py (llama-3-8b, llama-3.2-1b, ...) "
                                                          "or a config.json")
    p.add_argument("--vocab_size", type=positive_int, default=None, help="override the preset's vocabulary")
    p.add_argument("--precisions", default="bf16,int8", help="comma-separated: fp32, bf16, fp16, int8, int4, int4-sym")
    p.add_argument("--activations", choices=sorted(DTYPES), default="bf16", help="dtype around quantized weights")
    p.add_argument("--groupsize", type=positive_int, default=32, help="int4 group size")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager decode steps")
    p.add_argument("--prompt_tokens", type=positive_int, default=16)
    p.add_argument("--new_tokens", type=positive_int, default=256)
    p.add_argument("--roofline_gb", type=float, default=4.0, help="size of the streaming read (beyond the caches)")
    p.add_argument("--peer", action="store_true", help="also transformers (static cache + compile) at 16-bit")
    p.add_argument("--profile", action="store_true", help="host vs device time per decode step, top kernels")
    p.add_argument("--gemv", default="inductor",
                   help="comma-separated, a row each: inductor (its own one-row products, the default) and/or "
                        "triton (gemv.py's kernel for every one-row product: 16-bit and int8 weights)")
    p.add_argument("--products", action="store_true",
                   help="also time each distinct one-row product of the step alone (bf16 / int8 rows of "
                        "--precisions): ATen, inductor and gemv.py, GB/s of weights read (CUDA)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON (after each row)")
    args = p.parse_args(argv)
    with error_boundary():
        precisions = args.precisions.split(",")
        for name in precisions:
            if name not in (*DTYPES, *QUANTIZED):
                raise ValueError(f"--precisions: unknown {name!r}; use fp32, bf16, fp16, int8, int4 or int4-sym")
        args.gemv = args.gemv.split(",")
        if not set(args.gemv) <= {"inductor", "triton"}:
            raise ValueError(f"--gemv: use inductor, triton or both (comma-separated), got {','.join(args.gemv)!r}")
        if args.new_tokens < 4:
            raise ValueError("--new_tokens must be at least 4 (the rates compare two lengths)")
        if args.out:
            check_output_file(args.out, "--out")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = load.check_device(device)
        if (args.products or "triton" in args.gemv) and not device.startswith("cuda"):
            raise ValueError("--products and --gemv triton measure GPU kernels: run them on a CUDA device")
        config = model_config(args.model, args.vocab_size)
        run(args, config, device, precisions)


def run(args, config: ModelArgs, device: str, precisions: list):
    def log(*a):
        print(*a, file=sys.stderr, flush=True)
    report = dict(model=args.model, config=config.__dict__, device=device, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
                  compile=args.compile, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rows=[])
    report["roofline_gbps"] = load.streaming_read_gbps(device, int(args.roofline_gb * 1e9))
    log(f"{report['gpu'] or device}: streaming read {report['roofline_gbps']:.0f} GB/s")

    def save():
        if args.out:
            load.atomic_write_text(args.out, json.dumps(report, indent=1))
    peers = ("transformers",) if args.peer else ()
    if args.products:
        report["products"] = []
        for row in product_rows(config, device, precisions):
            report["products"].append(row)
            save()
            log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    rows = [(p, s, g) for p in precisions for s in ("brisk", *peers) if s == "brisk" or p in DTYPES
            for g in (args.gemv if s == "brisk" else [None])]
    for precision, system, gemv_kind in rows:
        row = dict(system=system, precision=precision, **(dict(gemv=gemv_kind) if gemv_kind else {}))
        try:
            t0 = time.perf_counter()
            if system == "brisk":
                model = random_model(config, device, precision, DTYPES[args.activations], args.groupsize)
                if gemv_kind == "triton":
                    import gemv
                    gemv.use_gemv(model)
                row["build_s"] = time.perf_counter() - t0
                row["bytes_per_step"] = load.step_bytes(model)
                try:
                    row.update(measure_decode(model, device, args.compile, args.prompt_tokens, args.new_tokens,
                                              args.profile))
                except Exception as e:
                    if not args.compile:
                        raise
                    row["compile_error"] = f"{type(e).__name__}: {e}"[:500]  # then the eager steps' figures
                    row.update(measure_decode(model, device, False, args.prompt_tokens, args.new_tokens, args.profile))
            else:
                row.update(peer_transformers(config, device, DTYPES[precision], args.prompt_tokens, args.new_tokens))
        except Exception as e:  # one row failing (a kernel missing for a shape, memory) must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            model = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        for key in ("streamed_tok_s", "unread_tok_s", "synced_tok_s"):
            if row.get(key) is not None:
                row[key.replace("tok_s", "gbps")] = row[key] * row["bytes_per_step"] / 1e9
                row[key.replace("tok_s", "roofline")] = row[key.replace("tok_s", "gbps")] / report["roofline_gbps"]
        report["rows"].append(row)
        save()
        log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                        if k not in ("tokens", "top_kernels")}))
        for k in row.get("top_kernels", []):
            log(f"    {k['ms_per_step']:.3f} ms/step {k['calls_per_step']:6.1f} calls {k['mean_us']:7.1f} us  "
                f"{k['name']}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
