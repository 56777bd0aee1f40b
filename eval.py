# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Evaluate a brisk checkpoint: lm-evaluation-harness tasks, or sliding-window perplexity.

    python eval.py --checkpoint_path X/model.pth --tasks hellaswag winogrande --limit 200
    python eval.py --checkpoint_path X/model.pth --tasks my_task --include_path ./my_tasks
    python eval.py --checkpoint_path X/model.pth --perplexity corpus.txt --max_seq_length 1024 --stride 512

`Scorer` does the token-level work on our model (batched scoring through the static KV cache,
greedy or sampled generation with stop strings); `make_lm` wraps it as an lm_eval `LM`.
lm-evaluation-harness is optional: --perplexity runs without it.

Batching: scoring right-pads a batch, which a causal model never sees. Generation runs through
the serving engine (engine.py), whose rows keep their own positions: prompts of any lengths
share the --batch_size slots, and every answer is exactly what batch size 1 gives.
"""
import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from decode import check_sampling
from engine import Engine, Request
from errors import check_output_file, error_boundary, finite_float, int_in, nonnegative_int, positive_int
from load import add_placement_flags, atomic_write_text, device_sync, log, placement, rank0_output
from packed_cache import load_with_tokenizer

LM_EVAL_REQUIREMENT = "lm-eval==0.4.13"
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}  # generation kwargs we honour
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's HF model default, for tasks that set none


def progress(total: int, desc: str):
    from tqdm import tqdm  # ships with huggingface_hub
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=total == 0)


class Scorer:
    """Token-level scoring and generation on a loaded Transformer, batched, with the static KV cache.

    max_length is the context window: longer inputs lose their oldest tokens, as in lm_eval's
    HF model. The KV cache grows to the largest batch and length seen, never shrinks.
    """

    def __init__(self, model, tokenizer, max_length: int, batch_size: int = 1, compile: bool = False):
        if max_length > model.config.block_size:
            raise ValueError(f"--max_seq_length {max_length} exceeds the model's context of "
                             f"{model.config.block_size} tokens")
        if max_length < 2:
            raise ValueError(f"--max_seq_length must be at least 2 (a token and one to score), got {max_length}")
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size = max_length, batch_size
        self.device = model.norm.weight.device
        # Scoring takes varying lengths (dynamic shapes); generation runs through the engine.
        self.forward = torch.compile(model, dynamic=True) if compile else model
        self.compile, self.engine = compile, None

    def _setup_caches(self, batch_size: int, length: int):
        self.model.setup_caches(max_batch_size=max(batch_size, self.model.max_batch_size),
                                max_seq_length=max(length, self.model.max_seq_length))

    @torch.no_grad()
    def score(self, requests: list, desc: str = "scoring") -> list:
        """requests: (tokens, n) -> (log-probability of the last n tokens given the ones before,
        whether greedy decoding produces all n). Requests that feed the model the same input
        (the choices of a multiple-choice question with one-token answers) share one forward pass.
        """
        by_input = defaultdict(list)  # model input -> indices of the requests that read it
        for i, (tokens, n) in enumerate(requests):
            x = tuple(tokens[-(self.max_length + 1):-1])
            if not 0 < n <= len(x):
                raise ValueError(f"a request scores {n} tokens after {len(tokens) - n} of context, which a window "
                                 f"of --max_seq_length {self.max_length} cannot hold; raise --max_seq_length")
            by_input[x].append(i)
        inputs = sorted(by_input, key=len, reverse=True)  # longest first: the cache is sized once
        results = [None] * len(requests)
        with progress(len(requests), desc) as bar:
            for batch in _chunks(inputs, self.batch_size):
                T = len(batch[0])
                x = torch.zeros(len(batch), T, dtype=torch.long)  # right padding: never attended to
                for row, inp in enumerate(batch):
                    x[row, :len(inp)] = torch.tensor(inp)
                self._setup_caches(len(batch), T)
                logits = self.forward(x.to(self.device), torch.arange(T, device=self.device))  # (B, T, V)
                for row, inp in enumerate(batch):
                    for i in by_input[inp]:
                        tokens, n = requests[i]
                        target = torch.tensor(tokens[-n:], device=self.device)
                        logprobs = F.log_softmax(logits[row, len(inp) - n:len(inp)].float(), dim=-1)  # (n, V)
                        greedy = bool((logprobs.argmax(dim=-1) == target).all())
                        results[i] = (logprobs.gather(-1, target[:, None]).sum().item(), greedy)
                    bar.update(len(by_input[inp]))
        return results

    def generate(self, contexts: list, until: list, max_new_tokens: int, sampling: dict,
                 desc: str = "generating") -> list:
        """Continue each context (token list) until a stop string, an EOS token or max_new_tokens;
        returns the decoded continuations, cut before the first stop string. The contexts run
        through the serving engine: any lengths decode together, each exactly as it would alone."""
        check_sampling(**sampling)
        if max_new_tokens >= self.max_length:
            raise ValueError(f"a task asks for {max_new_tokens} new tokens, not fewer than --max_seq_length "
                             f"{self.max_length}; raise --max_seq_length")
        keep = self.max_length - max_new_tokens  # room for the answer: contexts lose their oldest tokens
        requests = [Request(c[-keep:], max_new_tokens, temperature=sampling.get("temperature") or 0.0,
                            top_k=sampling.get("top_k") or 0, top_p=sampling.get("top_p") or 1.0, stop=until)
                    for c in contexts]
        if self.engine is None:  # built once: with --compile its decode step compiles once
            self.engine = Engine(self.model, self.tokenizer, self.batch_size, self.max_length, compile=self.compile)
        with progress(len(contexts), desc) as bar:
            results = self.engine.generate(requests, on_finish=lambda i: bar.update())
        return [r.text for r in results]

    def perplexity(self, tokens: list, stride: int) -> tuple:
        """Hugging Face's strided perplexity: windows of max_length tokens start every `stride`
        tokens; each scores the tokens no earlier window scored, but never its own first token,
        which has no context in it (so the text's first token is never scored, and with
        stride == max_length no window's first). Returns (perplexity, number of tokens scored)."""
        if not 0 < stride <= self.max_length:
            raise ValueError(f"--stride must be between 1 and --max_seq_length ({self.max_length}), got {stride}")
        if len(tokens) < 2:
            raise ValueError("the text has fewer than 2 tokens: nothing to score")
        windows, scored = [], 0
        for begin in range(0, len(tokens), stride):
            end = min(begin + self.max_length, len(tokens))
            if end - begin > 1:
                windows.append((tokens[begin:end], min(end - scored, end - begin - 1)))
            scored = end
            if end == len(tokens):
                break
        # A window of max_length tokens feeds the model max_length - 1 of them: score() keeps it whole.
        nll = -sum(logprob for logprob, _ in self.score(windows, desc="perplexity windows"))
        n = sum(n for _, n in windows)
        return math.exp(nll / n), n


def _chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def make_lm(scorer: Scorer):
    """The Scorer as an lm_eval LM (built here because lm-evaluation-harness is optional)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class BriskLM(TemplateLM):
        # lm_eval sees one process even under tensor parallelism: every rank runs every request.
        def __init__(self):
            super().__init__()
            self.scorer, self.tok = scorer, scorer.tokenizer
            if not self.tok.eos_ids:
                raise ValueError("the tokenizer has no EOS token (tokenizer_config.json eos_token), which "
                                 "lm_eval needs as end-of-text marker")

        @property
        def eot_token_id(self) -> int:
            return self.tok.eos_ids[0]

        @property
        def prefix_token_id(self) -> int:  # what an empty context becomes, as in lm_eval's HF model
            return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        @property
        def tokenizer_name(self) -> str:
            return "brisk"

        def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list:
            # As transformers: special tokens by default, but never a second BOS.
            starts_with_bos = bool(self.tok.bos_token) and string.startswith(self.tok.bos_token)
            return self.tok.encode(string, bos=False if add_special_tokens is False or starts_with_bos else None)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
            results = self.scorer.score([(ctx + cont, len(cont)) for _, ctx, cont in requests],
                                        desc="loglikelihood")
            for (strings, _, _), result in zip(requests, results):
                self.cache_hook.add_partial("loglikelihood", strings, result)
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
            windows, owner = [], []
            for i, req in enumerate(requests):
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        self.tok_encode(req.args[0]), self.prefix_token_id, self.max_length, context_len=1)):
                    windows.append((ctx + cont, len(cont)))
                    owner.append(i)
            totals = [0.0] * len(requests)
            for i, (logprob, _) in zip(owner, self.scorer.score(windows, desc="loglikelihood_rolling")):
                totals[i] += logprob
            for req, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list:
            groups = defaultdict(list)  # one generation setting per group
            for i, req in enumerate(requests):
                groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
            results = [None] * len(requests)
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok.eos_token or None)
                max_gen_toks = kwargs.pop("max_gen_toks")
                unknown = sorted(set(kwargs) - SAMPLING_KEYS)
                if unknown:
                    raise ValueError(f"generation kwargs {unknown} are not supported; supported: until, "
                                     f"max_gen_toks, {', '.join(sorted(SAMPLING_KEYS))}")
                sampling = dict(temperature=kwargs["temperature"] if kwargs.get("do_sample") else 0.0,
                                top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))
                contexts = [self.tok_encode(requests[i].args[0]) for i in indices]
                texts = self.scorer.generate(contexts, until, max_gen_toks, sampling, desc="generate_until")
                for i, text in zip(indices, texts):
                    results[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
            return results

        def apply_chat_template(self, chat_history: list, add_generation_prompt: bool = True) -> str:
            return self.tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

        def chat_template(self, chat_template=False) -> Optional[str]:
            return self.tok.chat_template if chat_template else None

    return BriskLM()


def run_tasks(lm, tasks: list, num_fewshot: Optional[int], limit: Optional[float], include_path: Optional[Path],
              apply_chat_template: bool) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Indexing lm_eval's thousands of built-in task files takes seconds: skip it when every task is local.
    manager = TaskManager(include_path=str(include_path), include_defaults=False) if include_path else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):
        manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; see `lm-eval ls tasks`, or pass --include_path DIR "
                         "with your own task YAML files (or a YAML file's path as the task)")
    if limit is not None and limit >= 1:
        limit = int(limit)
    try:
        return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                               apply_chat_template=apply_chat_template, log_samples=False)
    except ConnectionError as e:  # datasets could not fetch a task's data
        raise ValueError(f"{e}: lm_eval's tasks download their data from the Hugging Face Hub; run once online "
                         "(datasets caches it, then set HF_DATASETS_OFFLINE=1) or use local tasks (--include_path)") from e


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--tasks needs lm-evaluation-harness ({e}); pip install '{LM_EVAL_REQUIREMENT}'") from e


def main(checkpoint_path: Path, tasks: Optional[list], perplexity: Optional[Path], num_fewshot: Optional[int],
         limit: Optional[float], include_path: Optional[Path], apply_chat_template: bool, max_seq_length: Optional[int],
         stride: Optional[int], batch_size: int, compile: bool, device: Optional[str], precision: Optional[str],
         output_json: Optional[Path]):
    if not tasks and perplexity is None:
        raise ValueError("nothing to evaluate: pass --tasks NAME ... and/or --perplexity FILE")
    if tasks:
        require_lm_eval()
    if include_path is not None and not include_path.is_dir():
        raise FileNotFoundError(f"--include_path {include_path} is not a directory of task YAML files")
    if perplexity is not None and not perplexity.is_file():
        raise FileNotFoundError(f"--perplexity {perplexity}: no such file")
    if output_json is not None:
        check_output_file(output_json, "--output_json")  # now, not after the whole evaluation
    device, dtype, dist = placement(device, precision)

    t0 = time.perf_counter()
    # Under torchrun every rank loads its shard and runs every request (lm_eval sees one process);
    # only rank 0 prints (cli) and writes --output_json.
    model, tokenizer = load_with_tokenizer(checkpoint_path, device, dtype, tp=dist)
    if apply_chat_template:
        tokenizer.compiled_chat_template()  # before the first request, not after the model ran
    device_sync(device)
    log(f"Loaded {checkpoint_path} in {time.perf_counter() - t0:.2f} s")
    scorer = Scorer(model, tokenizer, model.config.block_size if max_seq_length is None else max_seq_length,
                    batch_size, compile)
    stride = scorer.max_length // 2 if stride is None else stride

    output = {}
    if tasks:
        from lm_eval.utils import make_table
        t0 = time.perf_counter()
        results = run_tasks(make_lm(scorer), tasks, num_fewshot, limit, include_path, apply_chat_template)
        log(f"Tasks took {time.perf_counter() - t0:.1f} s")
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
        output.update(results)
    if perplexity is not None:
        try:
            tokens = tokenizer.encode(perplexity.read_text())
        except UnicodeDecodeError as e:
            raise ValueError(f"--perplexity {perplexity} is not UTF-8 text ({e})") from None
        t0 = time.perf_counter()
        ppl, n = scorer.perplexity(tokens, stride)
        device_sync(device)
        log(f"Perplexity took {time.perf_counter() - t0:.1f} s ({n / (time.perf_counter() - t0):.0f} tokens/s)")
        print(f"perplexity {ppl:.4f} on {perplexity} ({n} tokens scored, max_seq_length {scorer.max_length}, "
              f"stride {stride})")
        output["perplexity"] = ppl
    if output_json is not None and (dist is None or dist.rank == 0):
        atomic_write_text(output_json, json.dumps(output, indent=2, default=str) + "\n")
        log(f"Results written to {output_json}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a brisk checkpoint with lm-evaluation-harness tasks "
                                            "or sliding-window perplexity.")
    p.add_argument("--checkpoint_path", type=Path, required=True, help="model.pth of a converted checkpoint")
    p.add_argument("--tasks", nargs="+", default=None, help="lm_eval task names (e.g. hellaswag winogrande)")
    p.add_argument("--perplexity", type=Path, default=None, metavar="FILE",
                   help="strided perplexity of this text file (needs no lm_eval)")
    p.add_argument("--num_fewshot", type=nonnegative_int, default=None, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=finite_float(0, low_open=True), default=None,
                   help="examples per task: N, or a fraction below 1 (for quick checks; not comparable scores)")
    p.add_argument("--include_path", type=Path, default=None, help="directory of your own lm_eval task YAML files")
    p.add_argument("--apply_chat_template", action="store_true",
                   help="wrap prompts in the checkpoint's chat template (instruct models)")
    p.add_argument("--max_seq_length", type=int_in(2), default=None,
                   help="context window in tokens: longer inputs lose their oldest tokens; the perplexity window "
                        "(default: the model's context)")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="perplexity: tokens between window starts (default: half of --max_seq_length)")
    p.add_argument("--batch_size", type=positive_int, default=1, help="requests per forward pass")
    p.add_argument("--compile", action="store_true", help="compile the forward pass and decode step (torch.compile)")
    add_placement_flags(p)
    p.add_argument("--output_json", type=Path, default=None, help="also write the results (and perplexity) here")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    with error_boundary(), rank0_output():
        main(**vars(args))


if __name__ == "__main__":
    cli()
