# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Generate text with a brisk checkpoint: the command-line driver over load.py, decode.py and
compiling.py (speculative.py when drafting).

stdout carries only generated text; timings and diagnostics go to stderr.
"""
import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

import speculative
from compiling import compile_prefill as compile_prefill_step, compile_step
from decode import check_context, check_sampling, decode_one_token, generate, prefill, trim_at_eos
from engine import DEFAULT_PREFILL_CHUNK, Engine, Request, check_request
from errors import SEED, check_output_file, error_boundary, finite_float, nonnegative_int, positive_int
from load import (DEFAULT_CHECKPOINT, PRECISIONS, add_placement_flags, atomic_write_text, device_sync, log, model_bytes,
                  placement, rank0_output)
from model import ModelArgs
from packed_cache import load_with_tokenizer
from structured import json_grammar
from tokenizer import read_json


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
    """Flags win; then the checkpoint's generation_config.json, as transformers reads it; else greedy.
    top_k 0 means no top-k, as in transformers."""
    path = checkpoint_dir / "generation_config.json"
    gen = read_json(path)
    if temperature is None:
        temperature = gen.get("temperature", 1.0) if gen.get("do_sample") else 0.0
    if gen.get("do_sample") or temperature > 0:
        top_k = top_k if top_k is not None else gen.get("top_k")
        top_p = top_p if top_p is not None else gen.get("top_p")
    try:
        check_sampling(temperature, top_k, top_p)
    except ValueError as e:  # the flags were checked by argparse: the file is at fault
        raise ValueError(f"{path}: {e}; fix the file or pass --temperature, --top_k, --top_p") from None
    return dict(temperature=temperature, top_k=top_k or None, top_p=top_p)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list:
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def check_options(interactive: bool, profile: Optional[Path], draft_checkpoint_path: Optional[Path],
                  speculate_ngram: Optional[int], batch_size: int):
    """What can be refused before loading anything."""
    if draft_checkpoint_path is not None and speculate_ngram is not None:
        raise ValueError("--draft_checkpoint_path and --speculate_ngram are two ways to draft; pass one")
    if (draft_checkpoint_path is not None or speculate_ngram is not None) and batch_size != 1:
        raise ValueError("speculative decoding generates one sequence at a time; use --batch_size 1")
    if interactive and profile is not None:
        raise ValueError("--profile traces the last sample of a run, not a chat; drop one of them")
    if profile is not None:
        check_output_file(profile, "--profile")


def synthetic_prompt(length: int, config: ModelArgs) -> list:
    """A reproducible prompt of random token ids, for benchmarks."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(config.vocab_size, 1000), (length,), generator=g).tolist()


# What a line of a .jsonl prompts file may set, and the type each setting must have.
PROMPT_SETTINGS = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
                   "seed": int, "stop": (str, list), "frequency_penalty": (int, float),
                   "presence_penalty": (int, float), "logit_bias": dict, "json_schema": dict}


def read_prompts_file(path: Path) -> list:
    """[(line number, {"prompt": ..., settings})]: a .txt file holds a prompt per line (blank lines
    skipped), a .jsonl file an object per line with "prompt" and any of PROMPT_SETTINGS."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompts_file {path}: no such file")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            items.append((n, {"prompt": line}))
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f'{path}:{n}: each line must be a JSON object with a "prompt" string')
        for key, value in item.items():
            if key != "prompt" and key not in PROMPT_SETTINGS:
                raise ValueError(f"{path}:{n}: unknown setting {key!r}; allowed: prompt, {', '.join(PROMPT_SETTINGS)}")
            if key in PROMPT_SETTINGS and (not isinstance(value, PROMPT_SETTINGS[key]) or isinstance(value, bool)
                                           or key == "stop" and isinstance(value, list)
                                           and not all(isinstance(v, str) for v in value)):
                raise ValueError(f"{path}:{n}: {key} has the wrong type ({type(value).__name__})")
            if key == "logit_bias" and not all(k.lstrip("-").isdigit() for k in value):
                raise ValueError(f'{path}:{n}: logit_bias maps token ids to biases, as {{"198": -100}}')
        items.append((n, item))
    if not items:
        raise ValueError(f"--prompts_file {path} holds no prompt")
    return items


def run_prompts_file(model, tokenizer, prompts_file: Path, items: list, output: Optional[Path], chat: bool,
                     max_new_tokens: int, sampling: dict, eos_ids: list, seed: int, max_batch_size: int,
                     max_seq_length: Optional[int], prefill_chunk: int, compile: bool, write: bool):
    """Every prompt of the file (items: read_prompts_file's) through the engine (continuous batching);
    JSONL results in input order."""
    from tqdm import tqdm  # ships with huggingface_hub

    requests = []
    for n, item in items:
        stop = item.get("stop", [])
        try:
            grammar = json_grammar(item["json_schema"]) if "json_schema" in item else None
        except ValueError as e:
            raise ValueError(f"{prompts_file}:{n}: {e}") from None
        requests.append(Request(
            encode_prompt(tokenizer, item["prompt"], chat), item.get("max_new_tokens", max_new_tokens),
            temperature=item.get("temperature", sampling["temperature"]), top_k=item.get("top_k", sampling["top_k"] or 0),
            top_p=item.get("top_p", sampling["top_p"] or 1.0), seed=item.get("seed"),
            stop=[stop] if isinstance(stop, str) else stop, eos_ids=eos_ids,
            frequency_penalty=item.get("frequency_penalty", 0.0), presence_penalty=item.get("presence_penalty", 0.0),
            logit_bias={int(k): v for k, v in item.get("logit_bias", {}).items()} or None, grammar=grammar))
    max_seq_length = max_seq_length or min(model.config.block_size, max(len(r.prompt) + r.max_new_tokens
                                                                        for r in requests))
    for (n, _), request in zip(items, requests):
        try:
            check_request(request, max_seq_length, model.config.vocab_size)
        except ValueError as e:
            raise ValueError(f"{prompts_file}:{n}: {e}") from None
    engine = Engine(model, tokenizer, max_batch_size, max_seq_length, prefill_chunk, compile, seed)
    t0 = time.perf_counter()
    with tqdm(total=len(requests), desc="prompts", file=sys.stderr, disable=not write) as bar:
        results = engine.generate(requests, on_finish=lambda i: bar.update())
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    log(f"{len(results)} prompts, {tokens} tokens generated in {elapsed:.2f} s: {tokens / elapsed:.2f} tokens/sec "
        f"({max_batch_size} slots{', compile included' if compile else ''})")
    lines = "".join(json.dumps({"prompt": item["prompt"], "text": r.text, "tokens": len(r.token_ids),
                                "finish_reason": r.finish_reason}) + "\n" for (_, item), r in zip(items, results))
    if not write:
        return
    if output is None:
        sys.stdout.write(lines)
    else:
        atomic_write_text(output, lines)
        log(f"Results written to {output}")


def main(prompt: str, synthetic_prompt_len: Optional[int], interactive: bool, chat: Optional[bool], num_samples: int,
         max_new_tokens: int, batch_size: int, temperature: float, top_k: Optional[int], top_p: Optional[float],
         checkpoint_path: Optional[Path], compile: bool, compile_prefill: bool, device: Optional[str],
         precision: Optional[str], profile: Optional[Path], seed: int, ignore_eos: bool,
         draft_checkpoint_path: Optional[Path], speculate_k: int, speculate_ngram: Optional[int],
         prompts_file: Optional[Path], output: Optional[Path], max_batch_size: int, max_seq_length: Optional[int],
         prefill_chunk: int, kv_cache_dtype: Optional[str] = None):
    check_options(interactive, profile, draft_checkpoint_path, speculate_ngram, batch_size)
    if prompts_file is not None:
        if interactive or draft_checkpoint_path or speculate_ngram or batch_size != 1:
            raise ValueError("--prompts_file runs the prompts through the serving engine; it does not combine with "
                             "--interactive, speculative decoding or --batch_size (use --max_batch_size)")
        items = read_prompts_file(prompts_file)  # a bad line is said before seconds of loading
        if output is not None:
            check_output_file(output, "--output")
    if checkpoint_path is None:
        checkpoint_path = DEFAULT_CHECKPOINT
        if not checkpoint_path.is_file():
            raise FileNotFoundError(f"the default model is not prepared ({checkpoint_path} missing); run "
                                    "./scripts/prepare.sh, or pass --checkpoint_path")
    device, dtype, dist = placement(device, precision)
    if dist and interactive:
        raise ValueError("--interactive reads stdin in one process; run it without torchrun")
    torch.manual_seed(seed)

    t0 = time.perf_counter()
    model, tokenizer = load_with_tokenizer(checkpoint_path, device, dtype, tp=dist)
    model.kv_cache_dtype = PRECISIONS[kv_cache_dtype] if kv_cache_dtype else None
    device_sync(device)
    # Weight bytes rather than a parameter count: quantized layers keep their weights in buffers.
    log(f"Loaded {checkpoint_path} ({model_bytes(model) / 1e6:.1f} MB of weights, "
        f"{dtype}, {device}) in {time.perf_counter() - t0:.2f} s")
    eos_ids = [] if ignore_eos else tokenizer.eos_ids
    sampling = sampling_settings(Path(checkpoint_path).parent, temperature, top_k, top_p)
    if chat is None:  # like llama.cpp's CLI: a checkpoint with a chat template is chatted with
        chat = tokenizer.chat_template is not None and synthetic_prompt_len is None
    if chat or interactive:
        tokenizer.compiled_chat_template()  # no template, or a broken one: say so before the first turn
    prefill_fn, decode_fn = prefill, decode_one_token
    if compile:
        decode_fn = compile_step(decode_one_token, device)
        prefill_fn = compile_prefill_step(prefill, device) if compile_prefill else prefill
    generate_fn = functools.partial(generate, prefill_fn=prefill_fn, decode_fn=decode_fn)
    accepted = None  # accepted draft tokens per verify step, when speculating
    if draft_checkpoint_path is not None or speculate_ngram is not None:
        draft = None
        if draft_checkpoint_path is not None:
            draft = speculative.load_draft(draft_checkpoint_path, model, tokenizer, device, dtype)
            log(f"Loaded draft {draft_checkpoint_path} ({model_bytes(draft) / 1e6:.0f} MB of weights)")
        accepted = []
        generate_fn = functools.partial(
            speculative.speculative_generate, draft_model=draft, ngram=speculate_ngram, k=speculate_k,
            prefill_fn=prefill_fn, draft_fn=decode_fn, accepted=accepted,
            verify_fn=compile_step(speculative.verify, device) if compile else speculative.verify)

    if interactive:
        return chat_loop(model, tokenizer, device, max_new_tokens, generate_fn, sampling)
    if prompts_file is not None:
        return run_prompts_file(model, tokenizer, prompts_file, items, output, chat, max_new_tokens, sampling, eos_ids,
                                seed, max_batch_size, max_seq_length, prefill_chunk, compile,
                                write=dist is None or dist.rank == 0)

    if synthetic_prompt_len is not None:
        check_context(model.config, synthetic_prompt_len, max_new_tokens)  # before allocating it
        prompt_tokens = synthetic_prompt(synthetic_prompt_len, model.config)
    else:
        prompt_tokens = encode_prompt(tokenizer, prompt, chat)
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
    p.add_argument("--prompt", default="Hello, my name is", help="input text")
    p.add_argument("--synthetic_prompt_len", type=positive_int, default=None, metavar="N",
                   help="instead of --prompt, N reproducible random tokens (benchmarks; no chat template)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap --prompt in the checkpoint's chat template (default: when it has one; "
                        "--no-chat continues the raw text)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin (uses the chat template)")
    p.add_argument("--num_samples", type=positive_int, default=1, help="how many times to generate")
    p.add_argument("--max_new_tokens", type=positive_int, default=200, help="the most tokens to generate per sample")
    p.add_argument("--batch_size", type=positive_int, default=1, help="rows generated in parallel from the same prompt")
    p.add_argument("--temperature", type=finite_float(0), default=None,
                   help="sampling temperature; 0 means greedy argmax (default: the checkpoint's "
                        "generation_config.json when it samples, else greedy, as transformers does)")
    p.add_argument("--top_k", type=nonnegative_int, default=None,
                   help="sample among the k most likely tokens (0: all of them, as in transformers)")
    p.add_argument("--top_p", type=finite_float(0, 1, low_open=True), default=None,
                   help="nucleus sampling: the smallest set with this mass, in (0, 1]")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help=f"model.pth of a converted checkpoint (default: {DEFAULT_CHECKPOINT})")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with torch.compile (with --prompts_file: prefill too)")
    p.add_argument("--compile_prefill", action="store_true",
                   help="also compile prefill (dynamic shapes; a model packed for kernels.cpp prefills eagerly)")
    add_placement_flags(p, kv_cache=True)
    p.add_argument("--profile", type=Path, default=None, help="write a torch profiler trace of the last sample")
    p.add_argument("--seed", type=SEED, default=1234, help="random seed for sampling")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at end-of-sequence (benchmarks)")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="speculative decoding: a smaller or quantized model with the same vocabulary drafts "
                        "tokens that the target verifies (the output is still the target's)")
    p.add_argument("--speculate_ngram", type=positive_int, default=None, metavar="N",
                   help="speculative decoding without a draft model: propose the tokens that followed the "
                        "latest earlier occurrence of the last N (down to 1) tokens (prompt lookup)")
    p.add_argument("--speculate_k", type=positive_int, default=5, help="draft tokens the target verifies per forward")
    g = p.add_argument_group("batch inference", "many prompts through the serving engine (engine.py)")
    g.add_argument("--prompts_file", type=Path, default=None,
                   help="a .txt file (a prompt per line) or .jsonl file (objects with \"prompt\" and optional "
                        "max_new_tokens, temperature, top_p, top_k, seed, stop, frequency_penalty, presence_penalty, "
                        "logit_bias, json_schema): one JSON result per prompt")
    g.add_argument("--output", type=Path, default=None, help="write the JSONL results here instead of stdout")
    g.add_argument("--max_batch_size", type=positive_int, default=8, help="KV cache slots: requests decoded together")
    g.add_argument("--max_seq_length", type=positive_int, default=None,
                   help="positions per slot (default: the longest prompt plus its max_new_tokens)")
    g.add_argument("--prefill_chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help="the most prompt tokens prefilled per engine step, beside the decode step")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    with error_boundary(), rank0_output():
        main(**vars(args))


if __name__ == "__main__":
    cli()
