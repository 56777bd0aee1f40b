# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Text generation: prefill, then one token at a time from the static KV cache.

stdout carries only generated text; timings and diagnostics go to stderr.
The units `prefill` and `decode_one_token` are what --compile compiles; compiled versions are
local callables passed into `generate`, never rebound globals.
"""
import argparse
import contextlib
import functools
import hashlib
import itertools
import json
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from model import ModelArgs, Transformer
from tp import apply_tp, maybe_init_dist, rank0_output

DEFAULT_CHECKPOINT = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def device_sync(device):
    if "cuda" in str(device):
        torch.cuda.synchronize(device)
    elif "mps" in str(device):
        torch.mps.synchronize()


def logits_to_probs(logits: Tensor, temperature: float, top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> Tensor:
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, -float("inf"), logits)
    if top_p is not None and top_p < 1.0:
        # Keep the smallest set of tokens whose probability mass reaches top_p.
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, -float("inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None):
    """logits: [B, V] -> (next token [B, 1], probabilities [B, V]). temperature 0 is argmax."""
    if temperature <= 0:
        token = logits.argmax(dim=-1, keepdim=True)
        return token, torch.nn.functional.one_hot(token[:, 0], logits.size(-1)).float()
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    # Exponential race instead of torch.multinomial: same distribution, no host sync on CUDA.
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1, keepdim=True), probs


def prefill(model: Transformer, x: Tensor, **sampling) -> Tensor:
    """x: [B, T], the sequences' first T tokens -> first generated token [B, 1]."""
    logits = model(x, torch.arange(x.shape[1], device=x.device), last_only=True, from_start=True)
    return sample(logits[:, -1], **sampling)[0]


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, **sampling):
    """x: [B, 1] at position input_pos [1] -> (next token [B, 1], probabilities [B, V])."""
    logits = model(x, input_pos)
    return sample(logits[:, -1], **sampling)


@torch.no_grad()
def generate(model: Transformer, prompt: Tensor, max_new_tokens: int, *, batch_size: int = 1,
             eos_ids=(), callback: Optional[Callable[[Tensor], None]] = None,
             prefill_fn: Callable = prefill, decode_fn: Callable = decode_one_token,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> Tensor:
    """Generate up to max_new_tokens after `prompt` ([T] or [B, T]); returns [B, T + n] token ids.

    Stops early once every row has produced one of eos_ids; rows that stopped earlier continue
    with tokens that `trim_at_eos` removes. callback receives each new token column [B].
    """
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(batch_size, -1)
    B, T = prompt.shape
    total = T + max_new_tokens
    check_context(model.config, T, max_new_tokens)
    device = prompt.device
    model.setup_caches(max_batch_size=B, max_seq_length=total)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)

    seq = torch.empty(B, total, dtype=torch.long, device=device)
    seq[:, :T] = prompt
    token = prefill_fn(model, prompt, **sampling)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    n = 0
    for n in range(1, max_new_tokens + 1):
        seq[:, T + n - 1] = token[:, 0]
        if callback is not None:
            callback(token[:, 0])
        finished |= torch.isin(token[:, 0], eos)
        # Reading `finished` waits for the step to finish (on a GPU, the CPU stops queueing ahead).
        if n == max_new_tokens or (eos.numel() > 0 and bool(finished.all())):
            break
        input_pos = torch.tensor([T + n - 1], device=device, dtype=torch.int)
        # From the second step on, the model, its caches and the inputs' shapes are those the first
        # step's guards checked: a compiled step need only tell apart the graphs it holds.
        # Checking all of its ~3000 guards cost 0.7 ms a token on a CPU (15% of int4 decode).
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=n > 1):
            token, _ = decode_fn(model, token.clone(), input_pos, **sampling)
    return seq[:, :T + n]


def check_context(config: ModelArgs, prompt_len: int, max_new_tokens: int):
    if prompt_len + max_new_tokens > config.block_size:
        raise ValueError(f"the prompt ({prompt_len} tokens) plus --max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {config.block_size} tokens; shorten the prompt or lower "
                         "--max_new_tokens")


def trim_at_eos(tokens: list, eos_ids) -> list:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens


def load_model(checkpoint_path, device="cpu", precision: torch.dtype = torch.float32, tp=None) -> Transformer:
    """Build the model from config.json beside the checkpoint and load its weights strictly.

    Quantized checkpoints carry their own quantization settings, read here (never from the name).
    tp: the tp.Dist of tp.maybe_init_dist (under torchrun): keep this rank's tensor-parallel shard,
    cut while the weights are still memory-mapped on the CPU, so only the shard reaches the device.
    """
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint_path} not found; convert one with "
                                "scripts/prepare.sh REPO_ID or scripts/convert_hf_checkpoint.py")
    config_path = checkpoint_path.parent / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: the converters write it beside model.pth; "
                                "re-run scripts/convert_hf_checkpoint.py")
    config = ModelArgs.from_json(config_path)
    with torch.device("meta"):
        model = Transformer(config)
    try:
        checkpoint = torch.load(checkpoint_path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise ValueError(f"{checkpoint_path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                         "re-run the conversion") from e
    state_dict, quantization = checkpoint, None
    if isinstance(checkpoint, dict) and "quantization" in checkpoint and "state_dict" in checkpoint:
        state_dict, quantization = checkpoint["state_dict"], checkpoint["quantization"]
        import quantize  # only quantized checkpoints need it
        quantize.prepare_model(model, quantization)
    if config.tie_embeddings and "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        state_dict = dict(state_dict, **{"output.weight": state_dict["tok_embeddings.weight"]})
    model.load_state_dict(state_dict, assign=True, strict=True)
    if config.tie_embeddings and quantization is None:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    if tp is not None:
        apply_tp(model, tp.rank, tp.world_size)
    model = model.to(device=device, dtype=precision)
    if quantization is not None:
        quantize.finalize_model(model, quantization, device=device, precision=precision)
    return model.eval()


def weights(model: Transformer):
    """(name, tensor) for each parameter and buffer of the model but its KV caches."""
    caches = {id(b) for m in model.modules() if hasattr(m, "k_cache") for b in (m.k_cache, m.v_cache)}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(t) not in caches:
            yield name, t


def model_bytes(model: Transformer) -> int:
    """Bytes of weights read per decoded token (MoE: only the activated experts)."""
    total = 0
    for name, t in weights(model):
        if name.endswith("rope_cos_sin"):
            continue
        size = t.numel() * t.element_size()
        if model.config.num_experts and ".feed_forward.w" in name:
            size = size * model.config.num_activated_experts // model.config.num_experts
        total += size
    return total


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_precision(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16
    if device.startswith("mps"):
        return torch.float16
    return torch.float32


def check_device(device: str) -> str:
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps was asked for but MPS is not available; use --device cpu")
    return device


def compile_step(fn: Callable, device: str) -> Callable:
    """torch.compile a decode-sized step fn(model, ...) (a few tokens, static shapes) for `device`."""
    if device.startswith("cuda"):
        return torch.compile(fn, mode="reduce-overhead", fullgraph=True)  # CUDA graphs: one launch per step
    compiled = torch.compile(fn, fullgraph=True)
    if device != "cpu":
        return compiled
    steps = weakref.WeakKeyDictionary()  # model -> its compiled step, chosen at its first call

    def step(model, *args, **kwargs):
        f = steps.get(model)
        if f is None:
            f = steps[model] = frozen_step(fn, model) if freezable(model) else compiled
        return f(model, *args, **kwargs)
    return step


def frozen_step(fn: Callable, model) -> Callable:
    """fn compiled for the CPU with the model's weights frozen."""
    import torch._inductor.config as inductor_config
    # Freezing makes the weights compile-time constants, so inductor repacks them once for its
    # kernels: oneDNN's bf16 matrix-vector product streams them with every core, where eager
    # PyTorch's runs on one. The repacked copy stays beside the model's own weights (which eager
    # prefill still reads).
    options = dict(freezing=True, autotune_num_choices_displayed=0,
                   post_grad_custom_post_pass=weights_cache_key(model), **kernel_options(model))
    # Dynamo reads the freezing flag while tracing, which happens inside calls (the first, and any
    # recompile): the settings hold during every call rather than globally.
    return inductor_config.patch(options)(torch.compile(fn, fullgraph=True))


def weights_cache_key(model):
    """A graph pass that changes nothing and puts a digest of the weights into inductor's cache key.

    inductor's on-disk cache keys a frozen graph by its code and shapes, not by the weights, yet
    the C++ GEMM template bakes the weights it repacked at compile time into the cached code (torch
    2.13, int8): a second checkpoint of the same shape (a fine-tune, GPTQ beside round-to-nearest)
    would decode with the first one's weights. Hashing costs ~0.5 s a GB, once per model.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass
    digest = hashlib.sha256()
    for name, t in weights(model):
        digest.update(name.encode())
        digest.update(t.detach().reshape(-1).view(torch.uint8).numpy())
    key = digest.hexdigest()

    class WeightsKey(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return key
    return WeightsKey()


def kernel_options(model) -> dict:
    """Inductor's options for the products of a frozen CPU step, read from the model's module types."""
    import quantize
    modules = list(model.modules())
    if model.norm.weight.dtype != torch.float32:  # norm.weight has the activations' dtype
        # bf16: oneDNN's products, without autotuning (timing the candidates with the weights in
        # cache, it picks inductor's template although oneDNN is faster reading from memory).
        # oneDNN's products are ops that the Python wrapper dispatches one by one (151 on SmolLM2:
        # 1.2 ms of a 10 ms step); the C++ wrapper calls them directly: +7-11%. Around inductor's
        # own GEMM kernels (int8, int4, fp32 below) it measured slower and stays off.
        quantized = any(isinstance(m, quantize.QUANTIZED) for m in modules)
        # Products that share their input (w1 and w3) become one over weights concatenated at
        # freezing: bf16 +5% on SmolLM2 and +3% on the 1B model, int4 +4-11%. (In fp32 +1%, for a
        # third copy of w1 and w3: +2.3 GB of peak memory on the 1B model.)
        return {"cpp.enable_concat_linear": True, "cpp_wrapper": not quantized}
    # fp32 needs max-autotune: oneDNN's fp32 matrix-vector product is single-threaded and
    # inductor's C++ GEMM template ("CPP") is 2x faster; it also has int8 and int4 weight-only
    # variants.
    expert_bits = {m.bits for m in modules if isinstance(m, quantize.QuantizedMoEFeedForward)}
    # Frozen and autotuned, inductor's int4 template computed wrong logits for int4 experts (each a
    # slice of one stacked tensor) in torch 2.13; freezing alone is right, as are int4 linears.
    if 4 in expert_bits:
        return {}
    # For int8 layers it picks ATen's kernel (30 GB/s on the 1B model, where the template reads
    # 40): int8 models get the template alone. Elsewhere ATen stays, as some int4 shapes have no
    # template and inductor then has no candidate left.
    int8 = 8 in expert_bits or any(isinstance(m, quantize.Int8Linear) for m in modules)
    int4 = any(isinstance(m, quantize.Int4Linear) for m in modules)
    return dict(max_autotune=True, max_autotune_gemm_backends="CPP" if int8 and not int4 else "CPP,ATEN")


def freezable(model) -> bool:
    # Tensor-parallel shards keep the plain compiled step: frozen, the 2-rank test decoded other
    # greedy tokens than one process (not investigated: 2-way TP on a CPU is a correctness check).
    return not torch.distributed.is_initialized()


def compile_fns(device: str, compile_prefill: bool):
    """Compiled decode (and optionally prefill) as local callables."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = device.startswith("cuda")
    inductor_config.fx_graph_cache = True  # warm runs skip most of the compile time
    decode = compile_step(decode_one_token, device)
    pre = torch.compile(prefill, fullgraph=True, dynamic=True) if compile_prefill else prefill
    return pre, decode


class TextStreamer:
    """Prints the text of a growing token list as it forms (decoding the whole list each time,
    since BPE and SentencePiece pieces only become text together with their neighbours)."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.tokens, self.printed, self.done = [], "", False

    def __call__(self, token: Tensor):
        t = int(token[0])
        if self.done or t in self.eos_ids:
            self.done = True
            return
        self.tokens.append(t)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next piece
            self._write(text)

    def finish(self) -> str:
        """Print what was held back (a sequence that never completed) and return the whole text."""
        self._write(self.tokenizer.decode(self.tokens))
        return self.printed

    def _write(self, text: str):
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


def sampling_settings(checkpoint_dir: Path, temperature: Optional[float], top_k: Optional[int],
                      top_p: Optional[float]) -> dict:
    """Flags win; then the checkpoint's generation_config.json, as transformers reads it; else greedy."""
    path = checkpoint_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if temperature is None:
        temperature = gen.get("temperature", 1.0) if gen.get("do_sample") else 0.0
    if gen.get("do_sample") or temperature > 0:
        top_k = top_k if top_k is not None else gen.get("top_k")
        top_p = top_p if top_p is not None else gen.get("top_p")
    return dict(temperature=temperature, top_k=top_k, top_p=top_p)


def encode_prompt(tokenizer, prompt: str, chat: bool, config: ModelArgs) -> list:
    if prompt.isdigit():  # a synthetic prompt of that many tokens, for benchmarks
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, min(config.vocab_size, 1000), (int(prompt),), generator=g).tolist()
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def main(prompt: str, interactive: bool, chat: Optional[bool], num_samples: int, max_new_tokens: int, batch_size: int,
         temperature: float, top_k: Optional[int], top_p: Optional[float], checkpoint_path: Optional[Path],
         compile: bool, compile_prefill: bool, device: Optional[str], precision: Optional[str],
         profile: Optional[Path], seed: int, ignore_eos: bool, draft_checkpoint_path: Optional[Path],
         speculate_k: int, speculate_ngram: Optional[int]):
    from tokenizer import load_tokenizer

    if checkpoint_path is None:
        checkpoint_path = DEFAULT_CHECKPOINT
        if not checkpoint_path.is_file():
            raise FileNotFoundError(f"the default model is not prepared ({checkpoint_path} missing); run "
                                    "./scripts/prepare.sh, or pass --checkpoint_path")
    device = check_device(device or default_device())
    dist = maybe_init_dist(device)  # under torchrun: tensor parallel, one shard (and device) per rank
    device = dist.device if dist else device
    if dist and interactive:
        raise ValueError("--interactive reads stdin in one process; run it without torchrun")
    dtype = PRECISIONS[precision] if precision else default_precision(device)
    torch.manual_seed(seed)

    t0 = time.perf_counter()
    model = load_model(checkpoint_path, device, dtype, tp=dist)
    tokenizer = load_tokenizer(Path(checkpoint_path).parent)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"wrong tokenizer for this checkpoint: it has {tokenizer.vocab_size} tokens, the model "
                         f"{model.config.vocab_size}; re-run the conversion so the tokenizer files match")
    device_sync(device)
    # Weight bytes rather than a parameter count: quantized layers keep their weights in buffers.
    log(f"Loaded {checkpoint_path} ({model_bytes(model) / 1e6:.1f} MB of weights, "
        f"{dtype}, {device}) in {time.perf_counter() - t0:.2f} s")
    eos_ids = [] if ignore_eos else tokenizer.eos_ids
    sampling = sampling_settings(Path(checkpoint_path).parent, temperature, top_k, top_p)
    if chat is None:  # like llama.cpp's CLI: a checkpoint with a chat template is chatted with
        chat = tokenizer.chat_template is not None and not prompt.isdigit()
    prefill_fn, decode_fn = compile_fns(device, compile_prefill) if compile else (prefill, decode_one_token)
    generate_fn = functools.partial(generate, prefill_fn=prefill_fn, decode_fn=decode_fn)
    accepted = None  # accepted draft tokens per verify step, when speculating
    if draft_checkpoint_path is not None or speculate_ngram is not None:
        import speculative
        if draft_checkpoint_path is not None and speculate_ngram is not None:
            raise ValueError("--draft_checkpoint_path and --speculate_ngram are two ways to draft; pass one")
        draft = None
        if draft_checkpoint_path is not None:
            draft = speculative.load_draft(draft_checkpoint_path, model, tokenizer, device, dtype)
            log(f"Loaded draft {draft_checkpoint_path} ({model_bytes(draft) / 1e6:.0f} MB of weights)")
        accepted = []
        generate_fn = functools.partial(
            speculative.speculative_generate, draft_model=draft, ngram=speculate_ngram, k=speculate_k,
            prefill_fn=prefill_fn, draft_fn=decode_fn, accepted=accepted,
            verify_fn=speculative.compile_verify(device) if compile else speculative.verify)

    if interactive:
        return chat_loop(model, tokenizer, device, max_new_tokens, generate_fn, sampling)

    prompt_tokens = encode_prompt(tokenizer, prompt, chat, model.config)
    check_context(model.config, len(prompt_tokens), max_new_tokens)
    encoded = torch.tensor(prompt_tokens, dtype=torch.long, device=device)
    nbytes = model_bytes(model)
    rates = []
    # With --compile the first sample compiles; it is reported but not averaged.
    for i in range(-1 if compile else 0, num_samples):
        stream = batch_size == 1 and i >= 0
        streamer = TextStreamer(tokenizer, eos_ids)
        if stream and not chat:  # a chat answer is shown without the template around the question
            sys.stdout.write(tokenizer.decode(prompt_tokens))
        profiler = torch.profiler.profile() if profile and i == num_samples - 1 else contextlib.nullcontext()
        device_sync(device)
        t0 = time.perf_counter()
        with profiler:
            out = generate_fn(model, encoded, max_new_tokens, batch_size=batch_size, eos_ids=eos_ids,
                              callback=streamer if stream else None, **sampling)
        device_sync(device)
        elapsed = time.perf_counter() - t0
        if profile and i == num_samples - 1:
            profiler.export_chrome_trace(str(profile))
            log(f"Profile trace written to {profile}")
        if i < 0:
            log(f"Compilation (and first run) took {elapsed:.2f} s")
            if accepted is not None:
                accepted.clear()
            continue
        if stream:
            streamer.finish()
            sys.stdout.write("\n")
        else:
            for row in out.tolist():
                completion = trim_at_eos(row[len(prompt_tokens):], set(eos_ids))
                print(tokenizer.decode(completion if chat else prompt_tokens + completion))
        new = out.shape[1] - len(prompt_tokens)
        rates.append(new * batch_size / elapsed)
        log(f"Time for inference {i + 1}: {elapsed:.2f} s total, {rates[-1]:.2f} tokens/sec")
        log(f"Bandwidth achieved: {nbytes * rates[-1] / batch_size / 1e9:.2f} GB/s")
        if accepted is not None:
            log(speculative.acceptance_summary(accepted, speculate_k))
            accepted.clear()
    log(f"Average tokens/sec: {sum(rates) / len(rates):.2f}")
    if device.startswith("cuda"):
        log(f"Memory used: {torch.cuda.max_memory_reserved() / 1e9:.02f} GB")


def chat_loop(model, tokenizer, device, max_new_tokens, generate_fn, sampling):
    """A multi-turn chat on stdin/stdout using the checkpoint's chat template."""
    messages = []
    log("Chat mode: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            text = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return
        if not text.strip():
            return
        messages.append({"role": "user", "content": text})
        tokens = tokenizer.encode_chat(messages)
        budget = min(max_new_tokens, model.config.block_size - len(tokens))
        if budget <= 0:
            raise ValueError("the conversation no longer fits the model's context; start a new chat")
        streamer = TextStreamer(tokenizer, tokenizer.eos_ids)
        generate_fn(model, torch.tensor(tokens, device=device), budget, eos_ids=tokenizer.eos_ids,
                    callback=streamer, **sampling)
        messages.append({"role": "assistant", "content": streamer.finish()})
        sys.stdout.write("\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Generate text with a brisk checkpoint.")
    p.add_argument("--prompt", default="Hello, my name is",
                   help="input text; an integer N means a synthetic prompt of N tokens (benchmarks)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap --prompt in the checkpoint's chat template (default: when it has one; "
                        "--no-chat continues the raw text)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin (uses the chat template)")
    p.add_argument("--num_samples", type=int, default=1, help="how many times to generate")
    p.add_argument("--max_new_tokens", type=int, default=200, help="the most tokens to generate per sample")
    p.add_argument("--batch_size", type=int, default=1, help="rows generated in parallel from the same prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 means greedy argmax (default: the checkpoint's "
                        "generation_config.json when it samples, else greedy, as transformers does)")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling: the smallest set with this mass")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help=f"model.pth of a converted checkpoint (default: {DEFAULT_CHECKPOINT})")
    p.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (dynamic shapes)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                   help="weights and activations dtype (default: bfloat16 on CUDA, float16 on MPS, float32 on CPU)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch profiler trace of the last sample")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-sequence (benchmarks)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="speculative decoding: a smaller or quantized model with the same vocabulary drafts "
                        "tokens that the target verifies (the output is still the target's)")
    p.add_argument("--speculate_ngram", type=int, default=None, metavar="N",
                   help="speculative decoding without a draft model: propose the tokens that followed the "
                        "latest earlier occurrence of the last N (down to 1) tokens (prompt lookup)")
    p.add_argument("--speculate_k", type=int, default=5, help="draft tokens the target verifies per forward")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    try:
        with rank0_output():
            main(**vars(args))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    cli()
