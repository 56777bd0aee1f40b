# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Sampling, prefill and the one-token decode step, and the single-stream generation loop.

`prefill` and `decode_one_token` are the units compiling.compile_step compiles; compiled
versions are local callables passed into `generate`, never rebound globals.
"""
import math
from typing import Callable, Optional

import torch
from torch import Tensor

from compiling import skip_guards
from model import ModelArgs, Transformer


def check_sampling(temperature: float, top_k: Optional[int] = None, top_p: Optional[float] = None):
    """A ValueError for settings that would sample nonsense (nan probabilities pick token 0 forever)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be a whole number >= 0 (0 turns it off), got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1] (1 turns it off), got {top_p!r}")


def logits_to_probs(logits: Tensor, temperature: float, top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> Tensor:
    logits = logits.float() / max(temperature, 1e-5)
    if top_k:  # None or 0: off, as in transformers
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


ARGMAX_BLOCK = 512  # values whose maximum argmax takes in one vector reduction


def argmax(x: Tensor) -> Tensor:
    """x [..., V] -> the index of each row's largest value [...], exactly as torch.argmax (the first
    of equal maxima; a NaN counts as the largest). On a CPU torch's argmax compares one value at a
    time while its amax runs in vector registers, and a vocabulary's argmax is on every token's
    path: the maxima of blocks of ARGMAX_BLOCK values pick each row's first block that holds its
    maximum, and argmax searches that block alone (README, How it works)."""
    V = x.shape[-1]
    if x.device.type != "cpu" or V < 4 * ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    rows = x.reshape(-1, V)
    whole = V // ARGMAX_BLOCK * ARGMAX_BLOCK
    maxima = rows[:, :whole].reshape(rows.shape[0], whole // ARGMAX_BLOCK, ARGMAX_BLOCK).amax(dim=-1)
    if whole < V:
        maxima = torch.cat([maxima, rows[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK
    # A last block past V repeats x's last value: a tie after its real index, which argmax never picks.
    index = (start + torch.arange(ARGMAX_BLOCK, device=x.device)).clamp(max=V - 1)
    return (start[:, 0] + rows.gather(1, index).argmax(dim=-1)).reshape(x.shape[:-1])


def sample(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None):
    """logits: [B, V] -> (next token [B, 1], probabilities [B, V]). temperature 0 is argmax."""
    if temperature <= 0:
        token = argmax(logits)[:, None]
        return token, torch.nn.functional.one_hot(token[:, 0], logits.size(-1)).float()
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    # Exponential race instead of torch.multinomial: same distribution, no host sync on CUDA.
    q = torch.empty_like(probs).exponential_(1)
    return argmax(probs / q)[:, None], probs


def sample_rows(logits: Tensor, temperature: list, top_k: list, top_p: list, generators: list) -> list:
    """Each row with its own settings: logits [B, V]; per row a temperature (0: argmax), top_k (0: off),
    top_p (1: off) and a torch.Generator (used only by sampled rows) -> B token ids.

    A row draws its noise from its own generator, one draw per sampled token, never from the other
    rows' or a global one: a request samples the same tokens alone as in any batch. Greedy rows cost
    one argmax; only the rows that ask for top-k / top-p pay for a sort.
    """
    tokens = argmax(logits).tolist()
    for row in [i for i, t in enumerate(temperature) if t > 0]:
        probs = logits_to_probs(logits[row][None], temperature[row], top_k[row], top_p[row])[0]
        # The exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i.
        q = torch.empty_like(probs).exponential_(1, generator=generators[row])
        tokens[row] = int(argmax(probs / q))
    return tokens


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
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             queue_ahead: Optional[bool] = None) -> Tensor:
    """Generate up to max_new_tokens after `prompt` ([T] or [B, T]); returns [B, T + n] token ids.

    Stops early once every row has produced one of eos_ids; rows that stopped earlier continue
    with tokens that `trim_at_eos` removes. callback receives each new token column [B] as a CPU
    tensor. queue_ahead (default: on CUDA, whose steps run while the host goes on) queues the next
    step before the host reads a token, so the device computes it while the host streams this one;
    on a CPU the step would run first and delay the token.
    """
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(batch_size, -1)
    B, T = prompt.shape
    total = T + max_new_tokens
    check_context(model.config, T, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    device = prompt.device
    model.setup_caches(max_batch_size=B, max_seq_length=total)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)

    seq = torch.empty(B, total, dtype=torch.long, device=device)
    seq[:, :T] = prompt
    # The positions live on the device: one made from a Python int is copied from the host, and
    # on CUDA that copy waits for every step queued before it.
    positions = torch.arange(T, total - 1, device=device, dtype=torch.int)
    token = prefill_fn(model, prompt, **sampling)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    watch = callback is not None or eos.numel() > 0
    if queue_ahead is None:
        queue_ahead = device.type == "cuda"

    def step(n: int, token: Tensor) -> Tensor:  # the token after `token`, at position T + n - 1
        with skip_guards(n > 1):  # from the second step on, the first step's guards hold
            return decode_fn(model, token.clone(), positions[n - 1:n], **sampling)[0]
    n = 0
    for n in range(1, max_new_tokens + 1):
        seq[:, T + n - 1] = token[:, 0]
        finished |= torch.isin(token[:, 0], eos)
        ready = HostCopy(token[:, 0], finished.all()) if watch else None
        if queue_ahead and n < max_new_tokens:  # a step queued past the end is wasted
            token = step(n, token)
        if ready is not None:
            new, done = ready.wait()
            if callback is not None:
                callback(new)
            if eos.numel() > 0 and bool(done):
                break
        if not queue_ahead and n < max_new_tokens:
            token = step(n, token)
    return seq[:, :T + n]


class HostCopy:
    """A copy of device tensors on the host, started now and waited for later. Reading a CUDA
    tensor directly (.tolist(), bool()) waits for all the work queued on the device, also the
    work queued after it; this waits only for the work queued before."""

    def __init__(self, *tensors: Tensor):
        self.event = None
        if tensors[0].device.type == "cuda":
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # CPU: done; other devices wait here (before the next step is queued)
            self.tensors = [t.to("cpu", copy=True) for t in tensors]

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


def check_context(config: ModelArgs, prompt_len: int, max_new_tokens: int):
    if prompt_len < 1:
        raise ValueError("the prompt is empty (and the tokenizer adds no BOS token): give at least one token of text")
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > config.block_size:
        raise ValueError(f"the prompt ({prompt_len} tokens) plus --max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {config.block_size} tokens; shorten the prompt or lower "
                         "--max_new_tokens")


def trim_at_eos(tokens: list, eos_ids) -> list:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens
