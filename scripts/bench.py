# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Benchmark brisk against what users would run instead, on this machine, in one run.

    python scripts/bench.py --quick                          # smoke run: SmolLM2, 1 round, few tokens
    python scripts/bench.py --configs all --rounds 3         # the README run (SmolLM2 + a 1B-shaped LLaMA)

Systems: brisk eager and --compile (with --compile_prefill), transformers generate() (plain, and
its static cache + torch.compile recipe), llama.cpp's llama-bench (built by
scripts/bench_llamacpp.sh; skipped with a line when missing), all at batch 1 on the same weights:
fp32 / bf16 / int8 / int4 / int4-sym, where llama.cpp runs F32 / BF16 / Q8_0 / Q4_1 / Q4_0 GGUFs
converted from the same HF weights. Every measurement runs in its own process (clean memory and
thread state) and the rounds alternate over all of them, so that machine noise hits every side
alike; the tables keep the best round. Each round also measures the memory roofline (a streaming
read with all threads), and each decode speed is shown as a fraction of it: bytes of weights read
per token x tokens/s / bandwidth.
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(ROOT))
from errors import error_boundary, positive_int  # noqa: E402

SYSTEMS = ("brisk", "brisk-compile", "transformers", "transformers-compile", "llama.cpp")
DEFAULT_SYSTEMS = ("brisk", "brisk-compile", "transformers", "llama.cpp")  # transformers' compile takes minutes
PRECISIONS = ("fp32", "bf16", "int8", "int4", "int4-sym")
# Each against the GGUF type of its own format and bits a weight: int4 (a scale and a zero per 32: 5 bits)
# against Q4_1 (a scale and a minimum per 32: 5 bits); int4-sym (a scale per 32: 4.5 bits) is Q4_0's grid.
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1", "int4-sym": "Q4_0"}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
INT4_GROUPSIZE = 32  # like Q4_0's blocks of 32
SHORT_PROMPT = 16  # tokens; synthetic prompts like generate.py's --synthetic_prompt_len N
WARMUP_TOKENS = 4
DEFAULT_LLAMACPP_DIR = Path(os.environ.get("BRISK_LLAMACPP_DIR", Path.home() / ".cache/brisk/llama.cpp"))
DEFAULT_SMOLLM2_DIR = ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct"


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Models: a converted brisk checkpoint, the HF weights it came from (for transformers and the GGUF
# converter), and a folder for what the benchmark derives from them (GGUFs, quantized checkpoints).

@dataclass
class Model:
    name: str
    checkpoint: Path  # brisk model.pth, config.json beside it
    hf_dir: Optional[Path]
    work_dir: Path
    new_tokens: int  # decode length of the short-prompt run
    gguf_flags: tuple = ()  # for llama.cpp's converter


def resolve_model(name: str, args) -> Model:
    work = args.work_dir / name
    if name == "smollm2":
        d = args.smollm2_dir
        if not (d / "model.pth").is_file():
            raise FileNotFoundError(f"{d / 'model.pth'} not found; run ./scripts/prepare.sh or pass --smollm2_dir")
        hf = d / "hf" if (d / "hf" / "config.json").is_file() else hf_from_default_gguf(work / "hf")
        return Model(name, d / "model.pth", hf, work, 128)
    if name in PRESETS:
        make, new_tokens, gguf_flags = PRESETS[name]
        make(work, tokenizer_dir=args.smollm2_dir)
        return Model(name, work / "model.pth", work / "hf", work, new_tokens, gguf_flags=gguf_flags)
    d = Path(name)
    if not (d / "model.pth").is_file():
        raise ValueError(f"--models: {name!r} is neither smollm2, {', '.join(PRESETS)} nor a folder holding model.pth")
    hf = d / "hf" if (d / "hf" / "config.json").is_file() else None
    return Model(d.name, d / "model.pth", hf, args.work_dir / d.name, 128)


def hf_from_default_gguf(out: Path) -> Path:
    """Offline, the default model's HF folder: transformers reads the GGUF prepare.sh converted
    (dequantized, as our converter does) and writes its state dict, config and tokenizer."""
    if (out / "config.json").is_file():
        return out
    import transformers
    from safetensors.torch import save_file
    from scripts.default_model import fetch_gguf
    gguf = fetch_gguf()
    log(f"writing {out} from {gguf.name} with transformers (no hub here)")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written below are plain fp32
    config["architectures"] = [type(model).__name__]  # what llama.cpp's converter dispatches on
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


def make_random(out: Path, tokenizer_dir: Path, what: str, build) -> None:
    """Once: out/model.pth from build(transformers), a random transformers model, seeded."""
    if (out / "model.pth").is_file():
        return
    import torch
    import transformers
    log(f"making a random {what} model in {out} (once)")
    torch.manual_seed(0)
    save_random_model(build(transformers), out, tokenizer_dir)


def make_random_llama_1b(out: Path, tokenizer_dir: Path):
    """A random LLaMA-3.2-1B-shaped model (vocab 49152 so SmolLM2's tokenizer fits, tied embeddings),
    written by transformers' save_pretrained so that every system reads identical weights."""
    def build(transformers):
        from model import ModelArgs
        a = ModelArgs.from_name("llama-3.2-1b")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=49152, hidden_size=a.dim, intermediate_size=a.intermediate_size, num_hidden_layers=a.n_layer,
            num_attention_heads=a.n_head, num_key_value_heads=a.n_local_heads, head_dim=a.head_dim,
            max_position_embeddings=2048, rms_norm_eps=a.norm_eps, rope_theta=a.rope_base,
            rope_scaling=a.rope_scaling, tie_word_embeddings=True, bos_token_id=None, eos_token_id=2))
    make_random(out, tokenizer_dir, "LLaMA-3.2-1B-shaped", build)


def make_random_qwen35(out: Path, tokenizer_dir: Path):
    """A random model of Qwen3.5's small shape (0.75B: 24 layers of 1024, 18 of them Gated DeltaNet of 16
    heads of 128, 6 of gated attention, 8 query and 2 key/value heads of 256; a tied 248320-token
    vocabulary), in bf16 as Qwen's releases, by transformers' own class and initialisation."""
    def build(transformers):
        return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768,
            tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=0)).bfloat16()
    make_random(out, tokenizer_dir, "Qwen3.5-shaped", build)


def make_random_lfm2(out: Path, tokenizer_dir: Path):
    """A random model of LFM2-1.2B's shape (16 layers of 2048: 10 short convolutions of 3 taps, 6 of
    attention with 32 query and 8 key/value heads of 64; a feed-forward of 8192; a tied 65536-token
    vocabulary), in bf16 as Liquid's releases, by transformers' own class and initialisation."""
    def build(transformers):
        return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, max_position_embeddings=128000, full_attn_idxs=[2, 5, 8, 10, 12, 14],
            tie_word_embeddings=True, norm_eps=1e-5, eos_token_id=0)).bfloat16()
    make_random(out, tokenizer_dir, "LFM2-shaped", build)


def make_random_lfm3(out: Path, tokenizer_dir: Path):
    """A random model of LFM3-1.7B's shape (transformers' Lfm3Config defaults: 24 layers of 2048, 12 short
    convolutions of 7 taps, 6 attention layers windowed to 256 and 6 full, 16 query and 4 key/value heads of
    128 with a gate each; a feed-forward of 7680; a tied 128000-token vocabulary), in bf16."""
    def build(transformers):
        return transformers.Lfm3ForCausalLM(transformers.Lfm3Config(eos_token_id=0)).bfloat16()
    make_random(out, tokenizer_dir, "LFM3-shaped", build)


# Random models of these shapes: name -> (what makes it once, tokens decoded after the short prompt,
# flags for llama.cpp's converter: Qwen3.5's has no multi-token-prediction layer, which it would expect)
PRESETS = {"llama-1b": (make_random_llama_1b, 64, ()), "qwen3.5-0.8b": (make_random_qwen35, 128, ("--no-mtp",)),
           "lfm2-1.2b": (make_random_lfm2, 128, ()), "lfm3-1.7b": (make_random_lfm3, 128, ())}


def save_random_model(model, out: Path, tokenizer_dir: Path):
    """A random transformers model into out/hf with SmolLM2's tokenizer (the GGUF converter needs one;
    the vocabulary fits), converted into out."""
    from scripts.convert_hf_checkpoint import TOKENIZER_FILES, convert_hf_checkpoint
    model.save_pretrained(out / "hf")
    src = tokenizer_dir / "hf" if (tokenizer_dir / "hf" / "tokenizer.json").is_file() else tokenizer_dir
    for f in TOKENIZER_FILES:
        if (src / f).is_file() and f != "generation_config.json":
            shutil.copyfile(src / f, out / "hf" / f)
    convert_hf_checkpoint(out)


def brisk_checkpoint(model: Model, precision: str) -> Path:
    """model.pth for fp32/bf16 (cast at load time), a quantized copy in the work folder for int8/int4."""
    if precision in TORCH_DTYPES:
        return model.checkpoint
    import hashlib
    import quantize
    group = None if precision == "int8" else INT4_GROUPSIZE  # precision: quantize.py's mode
    # Named by the quantizing code, so that a file an earlier quantize.py wrote is not measured as this one's.
    code = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in ("quantize.py", "quantized.py", "GPTQ.py")))
    path = model.work_dir / f"model_{precision}.{code.hexdigest()[:12]}.pth"
    if not path.is_file():
        for old in [model.work_dir / f"model_{precision}.pth", *model.work_dir.glob(f"model_{precision}.*.pth")]:
            old.unlink(missing_ok=True)
        model.work_dir.mkdir(parents=True, exist_ok=True)
        if not (model.work_dir / "config.json").is_file():  # the 1B model is made in its work folder
            shutil.copyfile(model.checkpoint.parent / "config.json", model.work_dir / "config.json")
        log(f"quantizing {model.checkpoint} to {precision} -> {path}")
        quantize.quantize_checkpoint(model.checkpoint, precision, group, output_path=path)
    return path


# ---------------------------------------------------------------------------------------------
# llama.cpp: binaries from scripts/bench_llamacpp.sh, GGUFs converted from the same HF weights.

def llamacpp_tools(llamacpp_dir: Path) -> dict:
    tools = {"bench": llamacpp_dir / "build/bin/llama-bench", "quantize": llamacpp_dir / "build/bin/llama-quantize",
             "simple": llamacpp_dir / "build/bin/llama-simple",
             "convert": llamacpp_dir / "src/convert_hf_to_gguf.py"}
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"llama.cpp not built ({missing[0]} missing); build it with "
                                f"scripts/bench_llamacpp.sh {llamacpp_dir}")
    return tools


def gguf_file(model: Model, precision: str, tools: dict) -> Path:
    if model.hf_dir is None:
        raise FileNotFoundError(f"no HF weights ({model.checkpoint.parent}/hf) to convert to GGUF")
    f32 = model.work_dir / "gguf/F32.gguf"
    if not f32.is_file():
        f32.parent.mkdir(parents=True, exist_ok=True)
        log(f"converting {model.hf_dir} to {f32}")
        with partial_file(f32) as tmp:
            run_checked([sys.executable, str(tools["convert"]), str(model.hf_dir), "--outtype", "f32",
                         "--outfile", str(tmp), *model.gguf_flags])
    out = f32.with_name(f"{GGUF_TYPES[precision]}.gguf")
    if not out.is_file():
        log(f"llama-quantize {f32.name} -> {out.name}")
        with partial_file(out) as tmp:
            run_checked([str(tools["quantize"]), str(f32), str(tmp), GGUF_TYPES[precision]])
    return out


@contextlib.contextmanager
def partial_file(path: Path):
    """A temporary name beside `path`, renamed to it on success: an interrupted run leaves no
    truncated file that a later run would take for a finished one."""
    tmp = path.with_name(path.name + ".partial")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def run_checked(cmd) -> Optional[float]:
    """run_child, raising on a failed exit; the child's peak RSS in MB."""
    code, out, err, peak = run_child(cmd)
    if code != 0:
        raise RuntimeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed "
                           f"(exit {code}): {err.strip().splitlines()[-1:] or out[-200:]}")
    return peak


def measure_llamacpp(case: "Case", gguf: Path, tools: dict, threads: int) -> dict:
    """Short: prefill of the short prompt and decode from it; long: prefill of the long prompt, then
    decode at that depth (two calls of llama-bench: each measures one)."""
    def bench(*flags):
        cmd = [str(tools["bench"]), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *flags]
        code, out, err, rss = run_child(cmd)
        if code != 0:
            raise RuntimeError(f"llama-bench failed (exit {code}): {err.strip().splitlines()[-1:]}")
        return json.loads(out), rss

    stored = []  # the measurements that fell back to the weights as stored

    def bench_or_stored(what, *flags):
        # Seen on an Intel Xeon with AMX: prompt processing on the weights llama.cpp repacks for
        # its CPU kernels dies (SIGSEGV / SIGILL) while decode on them runs. A call that processes
        # a prompt (prefill, decode at a depth) then runs on the weights as stored, slower.
        try:
            return bench(*flags)
        except RuntimeError as e:
            stored.append(f"{what} ({e})")
            return bench(*flags, "--repack", "0")

    T, N = case.prompt_tokens, case.new_tokens
    start_s = None
    (pp,), rss1 = bench_or_stored("prefill", "-p", str(T), "-n", "0")
    (tg,), rss2 = bench_or_stored("decode", "-p", "0", "-n", str(N), *(("-d", str(T)) if case.prompt == "long" else ()))
    rss = max(rss1 or 0, rss2 or 0) or None
    if case.prompt == "short":
        # Start: load the weights and answer a short prompt's first token, as brisk's start_s.
        t0 = time.time()
        code, _, _, _ = run_child([str(tools["simple"]), "-m", str(gguf), "-n", "1", "The capital of France is"])
        start_s = time.time() - t0 if code == 0 else None  # where prompt processing dies (above)
    return dict(decode_tok_s=tg["avg_ts"], prefill_tok_s=pp["avg_ts"], ttft_s=T / pp["avg_ts"], peak_rss_mb=rss,
                start_s=start_s, **({"note": "with --repack 0: " + ", ".join(stored)} if stored else {}),
                bytes_per_token=pp["model_size"], weights_bytes=pp["model_size"],
                build=f"{pp['build_number']} ({pp['build_commit']})")


# ---------------------------------------------------------------------------------------------
# Workers: each runs in its own process (`--worker SPEC`) and prints one JSON line.
# Bytes per token: the weights a decode step reads. An embedding table that the output projection
# does not share counts for one row only, i.e. not at all. Weights' bytes: every weight the process
# holds, that table included, which the peak memory is set beside.

class TokenTimer:
    """Timestamps every new token: a brisk `generate` callback and a transformers streamer."""

    def __init__(self, sync):
        self.sync, self.times, self.prompt_seen = sync, [], False

    def start(self):
        self.times, self.prompt_seen, self.t0 = [], False, time.perf_counter()

    def __call__(self, token):
        if token.device.type != "cpu":  # brisk hands the host a finished token; transformers a device tensor
            self.sync()
        self.times.append(time.perf_counter())

    def put(self, value):  # transformers streamer: the first call carries the prompt
        if self.prompt_seen:
            self(value)
        self.prompt_seen = True

    def end(self):
        pass

    def summary(self, prompt_tokens: int) -> dict:
        ttft = self.times[0] - self.t0
        decode = (len(self.times) - 1) / (self.times[-1] - self.times[0])
        return dict(decode_tok_s=decode, prefill_tok_s=prompt_tokens / ttft, ttft_s=ttft)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def synthetic_prompt(n: int, vocab_size: int) -> list:
    """The same n tokens as generate.py's --synthetic_prompt_len N, for every system."""
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab_size, 1000), (n,), generator=g).tolist()


def worker_brisk(spec: dict) -> dict:
    import torch
    import decode
    import load
    from compiling import compile_prefill, compile_step
    from packed_cache import finish_writing, load_packed
    device = spec["device"]
    precision = getattr(torch, spec["dtype"]) if spec["dtype"] else load.default_precision(device)
    # as generate.py does (batch 1)
    model = load_packed(spec["checkpoint"], device, precision)
    T, N = spec["prompt_tokens"], spec["new_tokens"]
    prompt = torch.tensor(synthetic_prompt(T, model.config.vocab_size), device=device)
    fns = {}
    if spec["compile"]:  # generate.py --compile --compile_prefill
        fns = dict(decode_fn=compile_step(decode.decode_one_token, device),
                   prefill_fn=compile_prefill(decode.prefill, device))
    # The cache size generate.py would use, set before the warm-up so the compiled decode fits both runs.
    model.setup_caches(max_batch_size=1, max_seq_length=T + N)
    timer = TokenTimer(lambda: load.device_sync(device))
    t0 = time.perf_counter()
    # The start a user waits for ends with the warm-up's first decoded token (its first token can
    # come from an eager prefill, before the decode step compiles).
    token_times = []
    decode.generate(model, prompt[:SHORT_PROMPT], WARMUP_TOKENS, callback=lambda _: token_times.append(time.time()),
                    **fns)  # also compiles
    warmup_s = time.perf_counter() - t0
    start_s = token_times[1] - spec["spawned_at"]
    if spec.get("start_only"):
        return dict(start_s=start_s)
    finish_writing()  # a first run's packed model, written in the background: not beside the timed decode
    timer.start()
    out = decode.generate(model, prompt, N, callback=timer, **fns)
    return dict(timer.summary(T), bytes_per_token=load.step_bytes(model),
                weights_bytes=load.model_bytes(model, all_experts=True), tokens=out[0, T:T + 32].tolist(),
                compile_s=warmup_s if spec["compile"] else None, activations=str(precision).removeprefix("torch."),
                start_s=start_s,
                **device_memory(device))


def worker_transformers(spec: dict) -> dict:
    import torch
    import transformers
    device = spec["device"]
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=getattr(torch, spec["dtype"]))
    model = model.to(device).eval()
    T, N = spec["prompt_tokens"], spec["new_tokens"]
    prompt = torch.tensor([synthetic_prompt(T, model.config.vocab_size)], device=device)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    kwargs = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, temperature=None, top_p=None, top_k=None)
    warmup = (prompt[:, :SHORT_PROMPT], dict(kwargs, max_new_tokens=WARMUP_TOKENS, min_new_tokens=WARMUP_TOKENS))
    if spec["compile"]:
        # transformers' documented recipe: a static cache and a compiled forward. The cache is sized
        # by max_new_tokens, so the warm-up (which compiles) runs the same generation.
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
        warmup = (prompt, kwargs)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    timer = TokenTimer(sync)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(warmup[0], attention_mask=torch.ones_like(warmup[0]), **warmup[1])
        warmup_s = time.perf_counter() - t0
        timer.start()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), streamer=timer, **kwargs)
    weights_bytes = nbytes = tensor_bytes(model.parameters())  # parameters() skips tied copies
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        nbytes -= tensor_bytes([embedding])
    return dict(timer.summary(T), bytes_per_token=nbytes, weights_bytes=weights_bytes,
                tokens=out[0, T:T + 32].tolist(),
                compile_s=warmup_s if spec["compile"] else None, **device_memory(device))


def worker_roofline(spec: dict) -> dict:
    """Streaming read bandwidth of the device: sum over a tensor far larger than the caches, best of 10."""
    from load import streaming_read_gbps
    return dict(bandwidth_gbps=streaming_read_gbps(spec["device"], spec["roofline_bytes"]))


def device_memory(device: str) -> dict:
    """The worker's peak GPU memory (reserved by PyTorch's allocator, as generate.py reports it)."""
    import torch
    return dict(peak_gpu_mb=torch.cuda.max_memory_reserved(device) / 1e6) if device.startswith("cuda") else {}


WORKERS = {"brisk": worker_brisk, "transformers": worker_transformers, "roofline": worker_roofline}


def worker_main(spec: dict):
    import torch
    torch.set_num_threads(spec["threads"])
    result = WORKERS[spec["kind"]](spec)
    print(json.dumps(result))


def run_child(cmd) -> tuple:
    """Run cmd to completion: (exit code, stdout, stderr, peak RSS in MB or None).

    The peak is the child's VmHWM, polled from /proc (Linux): rusage's ru_maxrss would also count
    the benchmark's own memory, which Linux carries across fork and exec."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        peak = None
        while p.poll() is None:
            peak = max(peak or 0, vm_hwm_mb(p.pid) or 0) or None
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read(), peak


def vm_hwm_mb(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:  # not Linux, or the process just ended
        pass
    return None


def run_worker(spec: dict) -> dict:
    spec = dict(spec, spawned_at=time.time())  # start_s: from here to a first decoded token, imports, loading, compile
    code, out, err, rss = run_child([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)])
    if code != 0:
        lines = err.strip().splitlines()
        raise RuntimeError(f"worker failed (exit {code}): {lines[-1] if lines else '(no output)'}")
    return dict(json.loads(out.strip().splitlines()[-1]), peak_rss_mb=rss)


# ---------------------------------------------------------------------------------------------
# The driver

@dataclass
class Case:
    model: str
    prompt: str  # "short" or "long"
    system: str
    precision: str
    prompt_tokens: int
    new_tokens: int

    @property
    def key(self):
        return f"{self.model} {self.prompt} {self.system} {self.precision}"


def plan(models: list, args) -> tuple:
    """(cases to run, {case key or topic: reason skipped}, llama.cpp tools or None)."""
    from model import ModelArgs
    skipped = {}
    try:
        tools = llamacpp_tools(args.llamacpp_dir) if "llama.cpp" in args.configs else None
    except FileNotFoundError as e:
        tools, skipped["llama.cpp"] = None, str(e)
    if tools is not None and args.device != "cpu":
        tools, skipped["llama.cpp"] = None, f"llama.cpp runs on the CPU only here (--device {args.device})"
    has_quantize = (ROOT / "quantize.py").is_file()
    cases = []
    for m in models:
        context = ModelArgs.from_json(m.checkpoint.parent / "config.json").block_size
        for prompt in args.prompts:
            T, N = (SHORT_PROMPT, args.new_tokens or m.new_tokens) if prompt == "short" else \
                (args.long_prompt, args.long_new_tokens)
            if T + N > context:
                skipped[f"{m.name} {prompt}"] = f"{T} + {N} tokens exceed the model's context ({context})"
                continue
            for system in args.configs:
                for precision in args.precisions:
                    case = Case(m.name, prompt, system, precision, T, N)
                    reason = skip_reason(case, m, tools, has_quantize)
                    if reason:
                        skipped.setdefault(f"{m.name} {system} {precision}", reason)
                    elif system != "llama.cpp" or tools is not None:
                        cases.append(case)
    return cases, skipped, tools


def skip_reason(case: Case, m: Model, tools, has_quantize: bool) -> Optional[str]:
    quantized = case.precision not in TORCH_DTYPES
    if case.system.startswith("brisk") and quantized and not has_quantize:
        return "quantize.py is not in this checkout yet"
    if case.system.startswith("transformers"):
        if quantized:
            return "transformers has no built-in int8/int4 weight-only path (it needs bitsandbytes or torchao)"
        if m.hf_dir is None:
            return f"no HF weights in {m.checkpoint.parent}/hf"
    if case.system == "llama.cpp" and tools is not None and m.hf_dir is None:
        return f"no HF weights in {m.checkpoint.parent}/hf to convert to GGUF"
    return None


def input_key(case: Case) -> tuple:
    """What a case reads beyond the HF weights: a brisk checkpoint or a GGUF at its precision."""
    return case.model, "llama.cpp" if case.system == "llama.cpp" else "brisk", case.precision


def make_inputs(cases: list, by_name: dict, tools, skipped: dict) -> tuple:
    """Make the quantized checkpoints and GGUFs the cases read, before any timing. A case whose
    input cannot be made is dropped with the reason. Returns (cases kept, {input_key: path})."""
    files, kept = {}, []
    for case in cases:
        key = input_key(case)
        if not case.system.startswith("transformers") and key not in files:
            what = f"{case.model} {key[1]} {case.precision}"
            if what in skipped:
                continue
            m = by_name[case.model]
            try:
                files[key] = gguf_file(m, case.precision, tools) if key[1] == "llama.cpp" else \
                    brisk_checkpoint(m, case.precision)
            except (RuntimeError, OSError, ValueError) as e:
                skipped[what] = str(e)
                log(f"skip {what}: {e}")
                continue
        kept.append(case)
    return kept, files


def measure(case: Case, m: Model, files: dict, tools, args) -> dict:
    if case.system == "llama.cpp":
        return measure_llamacpp(case, files[input_key(case)], tools, args.threads)
    kind = case.system.split("-")[0]
    spec = dict(kind=kind, compile=case.system.endswith("-compile"), threads=args.threads, device=args.device,
                prompt_tokens=case.prompt_tokens, new_tokens=case.new_tokens,
                dtype=TORCH_DTYPES.get(case.precision))  # None: int8/int4 run in generate.py's default
    if kind == "brisk":
        spec["checkpoint"] = str(files[input_key(case)])
    else:
        spec["hf_dir"] = str(m.hf_dir)
    result = run_worker(spec)
    if kind == "brisk" and case.prompt == "short":
        # llama.cpp's start is timed right after llama-bench read its GGUF; brisk's likewise, by a
        # second process right after this one (a round's own start may find its files evicted from
        # the page cache by the cases between, or the disk busy writing a cold round's files).
        result["start_s_again"] = run_worker(dict(spec, start_only=True))["start_s"]
    return result


def summarize(case: Case, rounds: list, bandwidth: float) -> dict:
    """Best of the rounds, per metric (fastest decode and prefill, lowest time to first token)."""
    ok = [r for r in rounds if "error" not in r]
    out = dict(asdict(case), rounds=rounds)
    if not ok:
        return dict(out, error=rounds[-1]["error"])
    decode = max(r["decode_tok_s"] for r in ok)
    nbytes = ok[0]["bytes_per_token"]
    compile_s = [r["compile_s"] for r in ok if r.get("compile_s") is not None]
    start_s = [r[k] for r in ok for k in ("start_s", "start_s_again") if r.get(k) is not None]
    return dict(out, decode_tok_s=decode, prefill_tok_s=max(r["prefill_tok_s"] for r in ok),
                ttft_s=min(r["ttft_s"] for r in ok), peak_rss_mb=max(r["peak_rss_mb"] or 0 for r in ok) or None,
                # The first round of a compiled case may compile cold; the lowest peak is a warm start's.
                peak_rss_mb_min=min(r["peak_rss_mb"] or 0 for r in ok) or None,
                peak_gpu_mb=max(r.get("peak_gpu_mb") or 0 for r in ok) or None,
                bytes_per_token=nbytes, bandwidth_gbps=nbytes * decode / 1e9, weights_bytes=ok[0]["weights_bytes"],
                roofline_fraction=nbytes * decode / 1e9 / bandwidth,
                compile_s=min(compile_s) if compile_s else None, compile_s_max=max(compile_s) if compile_s else None,
                # The first round of a compiled case may compile cold; later rounds find the caches.
                start_s=min(start_s) if start_s else None, start_s_max=max(start_s) if start_s else None)


def run_benchmark(args) -> dict:
    models = [resolve_model(name, args) for name in args.models]
    by_name = {m.name: m for m in models}
    cases, skipped, tools = plan(models, args)
    for what, reason in skipped.items():
        log(f"skip {what}: {reason}")
    cases, files = make_inputs(cases, by_name, tools, skipped)
    rounds = {c.key: [] for c in cases}
    # What a brisk process holds before any weights: its peak RSS beside the weights' bytes tells
    # how much of it is the weights (torch's import alone is a fixed few hundred MB on the CPU).
    runtime_rss = run_checked([sys.executable, "-c", "import torch, decode, load, compiling, packed_cache"])
    roofline = []
    for r in range(args.rounds):
        roofline.append(run_worker(dict(kind="roofline", threads=args.threads, device=args.device,
                                        roofline_bytes=args.roofline_mb * 2**20))["bandwidth_gbps"])
        log(f"[round {r + 1}/{args.rounds}] roofline {roofline[-1]:.1f} GB/s")
        # Rotate the order each round so that no case always follows the same neighbour.
        for case in cases[r % len(cases):] + cases[:r % len(cases)] if cases else []:
            try:
                result = measure(case, by_name[case.model], files, tools, args)
                log(f"[round {r + 1}/{args.rounds}] {case.key}: decode {result['decode_tok_s']:.1f} tok/s, "
                    f"prefill {result['prefill_tok_s']:.1f} tok/s, peak RSS {result['peak_rss_mb'] or 0:.0f} MB"
                    + (f", compile {result['compile_s']:.0f} s" if result.get("compile_s") else ""))
            except (RuntimeError, ValueError, OSError) as e:  # one failed case does not end the run
                result = dict(error=str(e))
                log(f"[round {r + 1}/{args.rounds}] {case.key}: FAILED {e}")
            rounds[case.key].append(result)
    bandwidth = max(roofline)
    results = [summarize(c, rounds[c.key], bandwidth) for c in cases]
    build = next((r["build"] for c in cases for r in rounds[c.key] if "build" in r), None)
    import torch
    import transformers
    return dict(
        schema=1, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=dict(cpu=cpu_name(), cores=os.cpu_count(), threads=args.threads, device=args.device,
                     gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                     cpu_capability=torch.backends.cpu.get_cpu_capability(),  # the vector ISA torch's kernels use
                     isa=cpu_isa(), caps=isa_caps(),
                     torch=torch.__version__, transformers=transformers.__version__, llama_cpp=build),
        settings=dict(rounds=args.rounds, short_prompt=SHORT_PROMPT, long_prompt=args.long_prompt,
                      long_new_tokens=args.long_new_tokens, int4_groupsize=INT4_GROUPSIZE,
                      models={m.name: str(m.checkpoint) for m in models}),
        roofline_gbps=bandwidth, roofline_rounds=roofline, runtime_rss_mb=runtime_rss, results=results,
        skipped=[dict(what=k, reason=v) for k, v in skipped.items()])


def isa_caps() -> str:
    """The caps set on the instruction sets torch (and with it kernels.py) and oneDNN use, as in
    `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: how an AVX-512 machine runs what a CPU with
    AVX2 alone runs ('' where none is set)."""
    return " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k))


def where_cpu(m: dict) -> str:
    """The machine's CPU, its vector extensions and any caps on them, for a table's or a plot's title."""
    caps = f"; capped: {m['caps']}" if m.get("caps") else ""
    return f"{m['cpu']} ({m.get('isa') or m['cpu_capability']}{caps})"


# The vector extensions that pick kernels.cpp's and llama.cpp's code paths.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu_isa() -> str:
    """The CPU's family, model and vector extensions as /proc/cpuinfo tells them ('' where there is
    none): a VM's model name can be as bare as "AMD EPYC"."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ""
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = set(info.get("flags", "").split())
    return " ".join([f"family {info.get('cpu family', '?')} model {info.get('model', '?')}:",
                     *(f for f in ISA_FLAGS if f in flags)])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------
# Reporting

def peer_of(results: list, r: dict, system: str) -> Optional[dict]:
    for p in results:
        if (p["system"], p["model"], p["prompt"], p["precision"]) == (system, r["model"], r["prompt"],
                                                                      r["precision"]) and "error" not in p:
            return p
    return None


def format_table(report: dict) -> str:
    results, m = report["results"], report["machine"]
    gpu = m.get("gpu")
    where = gpu or f"{m['threads']} threads"
    lines = [f"{where_cpu(m)}, torch {m['torch']}",
             f"roofline (streaming read, {where}): "
             f"{report['roofline_gbps']:.1f} GB/s; best of {report['settings']['rounds']} round(s)"]
    if report.get("runtime_rss_mb") and not gpu:
        lines.append(f"peak RSS of a process that only imports torch and brisk's modules: "
                     f"{report['runtime_rss_mb']:.0f} MB")
    memory = "peak_gpu_mb" if gpu else "peak_rss_mb"  # the memory that bounds the model size there
    lines.append(f"xW: the peak {'GPU memory' if gpu else 'RSS of the lowest round (a warm start)'} over the "
                 "weights' bytes (every weight held, an embedding table the output does not share included)")
    header = (f"{'model':<10} {'prompt':<6} {'system':<21} {'prec':<5} {'decode':>7} {'prefill':>8} {'TTFT':>6} "
              f"{'GPU' if gpu else 'RSS':>6} {'xW':>5} {'GB/s':>5} {'roof':>5} {'compile':>7} {'start':>11}  "
              "brisk / peer (decode, prefill)")
    lines += [header, f"{'':<51}{'tok/s':>7} {'tok/s':>8} {'s':>6} {'MB':>6} {'':>25} {'warm/cold s':>11}"]
    for r in results:
        head = f"{r['model']:<10} {r['prompt']:<6} {r['system']:<21} {r['precision']:<5}"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']}")
            continue
        ratios = []
        if r["system"].startswith("brisk"):
            for peer in ("transformers", "transformers-compile", "llama.cpp"):
                p = peer_of(results, r, peer)
                if p:
                    pp = r["prefill_tok_s"] / p["prefill_tok_s"]
                    prefill = f" (prefill {pp:.2f}x)" if peer == "llama.cpp" else ""
                    ratios.append(f"{r['decode_tok_s'] / p['decode_tok_s']:.2f}x {peer}{prefill}")
        compile_s = f"{r['compile_s']:.0f} s" if r["compile_s"] is not None else ""
        start = f"{r['start_s']:.1f}/{r['start_s_max']:.1f}" if r.get("start_s") is not None else ""
        held = r.get(memory) or 0
        low = held if gpu else r.get("peak_rss_mb_min") or held
        over_weights = f"{low * 1e6 / r['weights_bytes']:.2f}x" if low and r.get("weights_bytes") else ""
        lines.append(f"{head} {r['decode_tok_s']:>7.1f} {r['prefill_tok_s']:>8.1f} {r['ttft_s']:>6.2f} "
                     f"{held:>6.0f} {over_weights:>5} {r['bandwidth_gbps']:>5.1f} {r['roofline_fraction']:>5.0%} "
                     f"{compile_s:>7} {start:>11}  {', '.join(ratios)}")
    lines += agreement_lines(results)
    return "\n".join(lines)


def agreement_lines(results: list) -> list:
    """brisk and transformers run the same weights: their fp32 greedy tokens should agree."""
    lines = []
    for r in results:
        if (r["system"], r["precision"]) == ("brisk", "fp32") and "error" not in r:
            p = peer_of(results, r, "transformers")
            if p:
                a, b = r["rounds"][0]["tokens"], p["rounds"][0]["tokens"] if "tokens" in p["rounds"][0] else []
                same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                lines.append(f"greedy fp32 tokens, brisk vs transformers ({r['model']}, {r['prompt']} prompt): "
                             f"the first {same} of {min(len(a), len(b))} agree")
    return lines


def plot(report: dict, path: Path):
    try:
        import matplotlib
    except ImportError:
        log("skip the plot: matplotlib is not installed (pip install -r requirements-bench.txt)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["prompt"] == "short" and "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    width = 0.8 / len(systems)
    for ax, name in zip(axes[0], models):
        precisions = [p for p in PRECISIONS if any(r["model"] == name and r["precision"] == p for r in rows)]
        for i, system in enumerate(systems):
            values = [next((r["decode_tok_s"] for r in rows if (r["model"], r["system"], r["precision"])
                            == (name, system, p)), 0) for p in precisions]
            ax.bar([x + (i - (len(systems) - 1) / 2) * width for x in range(len(precisions))], values, width,
                   label=system)
        for x, p in enumerate(precisions):  # the roofline for brisk's bytes per token at this precision
            nbytes = next((r["bytes_per_token"] for r in rows if (r["model"], r["precision"]) == (name, p)
                           and r["system"].startswith("brisk")), None)
            if nbytes:
                ax.hlines(report["roofline_gbps"] * 1e9 / nbytes, x - 0.45, x + 0.45, colors="black",
                          linestyles="dashed", label="memory roofline" if x == 0 else None)
        ax.set_xticks(range(len(precisions)), [f"{p} / {GGUF_TYPES[p]}" if "llama.cpp" in systems else p
                                               for p in precisions])
        ax.set_title(f"{name}: batch 1 decode")
        ax.set_ylabel("tokens/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small", loc="upper left")
    m = report["machine"]
    where = m.get("gpu") or f"{where_cpu(m)}, {m['threads']} threads"
    fig.suptitle(f"{where}, torch {m['torch']}", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main(args):
    report = run_benchmark(args)
    print(format_table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.out}")
    if args.plot:
        plot(report, args.plot)
    return report


def optional_path(s: str) -> Optional[Path]:
    return Path(s) if s else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark brisk against transformers and llama.cpp on this machine.")
    p.add_argument("--models", default=None,
                   help="comma-separated: smollm2, llama-1b (random LLaMA-3.2-1B shape), qwen3.5-0.8b (random, "
                        "Qwen3.5's small shape: linear attention), lfm2-1.2b (random, LFM2's shape: short "
                        "convolutions), lfm3-1.7b (random, LFM3's: convolutions, windowed and gated attention; "
                        "llama.cpp has no LFM3), or folders holding model.pth (and hf/); "
                        "default smollm2,llama-1b (--quick: smollm2)")
    p.add_argument("--configs", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated systems from {', '.join(SYSTEMS)}, or all (transformers-compile "
                        "is off by default: it compiles for minutes)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="comma-separated: fp32, bf16, int8, int4, int4-sym (quantize.py's modes)")
    p.add_argument("--prompts", default="short,long", help="short (16 tokens), long (--long_prompt tokens), or both")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds; tables keep the best (default 3)")
    p.add_argument("--new_tokens", type=positive_int, default=None,
                   help="tokens decoded after the short prompt (default 128 for SmolLM2, 64 for the 1B)")
    p.add_argument("--long_prompt", type=positive_int, default=None, help="tokens in the long prompt (default 1024)")
    p.add_argument("--long_new_tokens", type=positive_int, default=None, help="tokens decoded after it (default 32)")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="threads for every system")
    p.add_argument("--device", default="cpu", help="device for brisk and transformers (llama.cpp: CPU only)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 16 tokens, a 128-token long prompt")
    p.add_argument("--smollm2_dir", type=Path, default=DEFAULT_SMOLLM2_DIR,
                   help="converted SmolLM2-135M-Instruct (model.pth, and hf/ for transformers and llama.cpp)")
    p.add_argument("--work_dir", type=Path, default=ROOT / "checkpoints/bench",
                   help="where the 1B model, GGUFs and quantized checkpoints are made (once)")
    p.add_argument("--llamacpp_dir", type=Path, default=DEFAULT_LLAMACPP_DIR,
                   help="llama.cpp built by scripts/bench_llamacpp.sh (or $BRISK_LLAMACPP_DIR)")
    p.add_argument("--roofline_mb", type=positive_int, default=None, help="size of the streaming read (default 1024)")
    p.add_argument("--out", type=optional_path, default=ROOT / "bench_results/results.json",
                   help="JSON results ('' for none)")
    p.add_argument("--plot", type=optional_path, default=ROOT / "bench_results/bench.png",
                   help="PNG plot of decode speed ('' for none)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    quick = args.quick
    args.models = (args.models or ("smollm2" if quick else "smollm2,llama-1b")).split(",")
    args.configs = list(SYSTEMS) if args.configs == "all" else args.configs.split(",")
    args.precisions = args.precisions.split(",")
    args.prompts = args.prompts.split(",")
    for what, given, valid in (("--configs", args.configs, SYSTEMS), ("--precisions", args.precisions, PRECISIONS),
                               ("--prompts", args.prompts, ("short", "long"))):
        bad = [x for x in given if x not in valid]
        if bad:
            p.error(f"{what}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
    defaults = dict(rounds=(1, 3), new_tokens=(16, None), long_prompt=(128, 1024), long_new_tokens=(8, 32),
                    roofline_mb=(256, 1024))
    for name, (if_quick, normal) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, if_quick if quick else normal)
    return args


def cli(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    with error_boundary():
        main(args)


if __name__ == "__main__":
    cli()
