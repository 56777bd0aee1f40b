# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Where a decoded token's time goes: the torch profiler over batch-1 decode steps, per operator.

    python scripts/profile_decode.py --checkpoint_path checkpoints/X/model.pth --precision bfloat16

Prints the top operators by self time, in milliseconds per token and as a share of the step,
next to the step's wall time; --trace also writes a Chrome trace (chrome://tracing, Perfetto).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decode  # noqa: E402
import load  # noqa: E402
from compiling import compile_step, compiled_steps_dir, skip_guards  # noqa: E402
from errors import check_output_file, error_boundary, positive_int  # noqa: E402
from packed_cache import finish_writing, load_packed  # noqa: E402


def profile_decode(checkpoint_path: Path, precision: str, compile: bool, prompt_tokens: int, new_tokens: int,
                   device: str, top: int, shapes: bool = False, trace: Path = None) -> str:
    model = load_packed(checkpoint_path, device, load.PRECISIONS[precision])  # as generate.py
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(model.config.vocab_size, 1000), (prompt_tokens,), generator=g).to(device)
    prefill_fn = decode.prefill
    decode_fn = compile_step(decode.decode_one_token, device) if compile else decode.decode_one_token
    model.setup_caches(max_batch_size=1, max_seq_length=prompt_tokens + new_tokens)
    decode.generate(model, prompt, 4, prefill_fn=prefill_fn, decode_fn=decode_fn)  # warm-up (and compile)
    finish_writing()  # a first run's packed model, written in the background: not beside the profile

    # Profile decode steps only: prefill once outside the profiler, then the steps one by one.
    with torch.no_grad():
        greedy = dict(temperature=0.0, top_k=None, top_p=None)  # generate()'s keywords: no recompile
        token = prefill_fn(model, prompt[None], **greedy)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=shapes) as prof:
            t0 = time.perf_counter()
            for i in range(new_tokens):
                pos = torch.tensor([prompt_tokens + i], device=device, dtype=torch.int)
                with skip_guards(i > 0):  # as decode.generate() does
                    token, _ = decode_fn(model, token.clone(), pos, **greedy)
            load.device_sync(device)
            step_ms = (time.perf_counter() - t0) * 1e3 / new_tokens
    if trace:
        prof.export_chrome_trace(str(trace))
    events = sorted(prof.key_averages(group_by_input_shape=shapes), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in events) / 1e3 / new_tokens
    lines = [f"{checkpoint_path} {precision}{' compiled' if compile else ''}: {step_ms:.2f} ms per token "
             f"({1e3 / step_ms:.1f} tok/s under the profiler), of which {total_self:.2f} ms operator self time "
             f"and {step_ms - total_self:.2f} ms outside operators (Python, dispatch, profiler)",
             f"{'operator':<48} {'ms/token':>8} {'share':>6} {'calls/token':>11}{'  input shapes' if shapes else ''}"]
    for e in events[:top]:
        ms = e.self_cpu_time_total / 1e3 / new_tokens
        lines.append(f"{e.key[:48]:<48} {ms:>8.3f} {ms / step_ms:>6.1%} {e.count / new_tokens:>11.1f}"
                     + (f"  {e.input_shapes}" if shapes else ""))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, default=load.DEFAULT_CHECKPOINT, help="model.pth to profile")
    p.add_argument("--precision", choices=sorted(load.PRECISIONS), default="float32", help="weights dtype")
    p.add_argument("--compile", action="store_true", help="profile the compiled decode step")
    p.add_argument("--prompt_tokens", type=positive_int, default=16, help="synthetic prompt length")
    p.add_argument("--new_tokens", type=positive_int, default=64, help="decode steps profiled")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (the profiler records CPU-side time)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--top", type=positive_int, default=20, help="operators shown")
    p.add_argument("--shapes", action="store_true", help="one row per operator and input shapes")
    p.add_argument("--trace", type=Path, default=None, help="also write a Chrome trace here")
    p.add_argument("--kernels", action="store_true",
                   help="with --compile on a CPU: time each kernel inductor generates (its matrix products too) "
                        "instead of one opaque row for the compiled graph")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True
        # compiling.precompiled names its files without inductor's settings: profiled steps apart.
        os.environ["BRISK_COMPILE_CACHE"] = str(compiled_steps_dir() / "profiled")
    with error_boundary():
        if args.trace is not None:
            check_output_file(args.trace, "--trace")
        print(profile_decode(args.checkpoint_path, args.precision, args.compile, args.prompt_tokens, args.new_tokens,
                             args.device, args.top, args.shapes, args.trace))


if __name__ == "__main__":
    main()
