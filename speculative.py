# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Speculative decoding: a draft proposes k tokens, the target checks them in one forward.

Drafts come from a smaller (or quantized) model of the same vocabulary, or from the context
itself (prompt lookup: `ngram_draft`). Acceptance follows speculative sampling (Leviathan et al.
2023, Chen et al. 2023), so the output is distributed exactly as the target's own samples, and
with temperature 0 it equals greedy decoding token for token.

Rejected drafts need no cache rollback: their K/V entries sit at positions past the accepted
text, every query at position i reads only keys at positions <= i (model.py's mask), and the
next forward overwrites those positions before any query that could see them.
"""
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from compiling import skip_guards
from decode import argmax, check_context, check_sampling, decode_one_token, logits_to_probs, prefill
from model import Transformer
from packed_cache import load_packed
from tokenizer import load_tokenizer


def verify(model: Transformer, x: Tensor, input_pos: Tensor, temperature: float = 0.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None) -> Tensor:
    """x: [B, k+1] at positions input_pos [k+1] -> the target's next-token probabilities [B, k+1, V]."""
    logits = model(x, input_pos)
    if temperature <= 0:  # greedy: a point mass on the argmax, as `sample` does
        return F.one_hot(argmax(logits), logits.size(-1)).float()
    return logits_to_probs(logits, temperature, top_k, top_p)


def accept_draft(draft: Tensor, q: Tensor, p: Tensor):
    """Speculative sampling for rows of drafts: draft [B, k] was sampled from q [B, k, V]; p [B, k+1, V]
    holds the target's distributions at the same positions and one more.

    Draft token i is kept with probability min(1, p(x)/q(x)); the first rejected one is replaced by
    a sample from norm(max(0, p - q)); when all k are kept a bonus token comes from p[k].
    Returns (accepted count [B], next token [B]).
    """
    B, k = draft.shape
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]  # (B, k)
    q_x = q.gather(-1, draft[..., None])[..., 0]  # (B, k)
    keep = torch.rand_like(q_x) * q_x < p_x  # u < p/q without dividing by q
    n = keep.float().cumprod(dim=1).sum(dim=1).long()  # length of the leading run of kept tokens (B,)
    rows = torch.arange(B, device=draft.device)
    q = F.pad(q, (0, 0, 0, 1))  # q = 0 at the bonus position, so the residual there is p itself
    residual = (p[rows, n] - q[rows, n]).clamp(min=0)  # (B, V), unnormalised
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, n])  # p == q up to rounding
    # Exponential race: argmax(w / Exp(1)) samples from w / sum(w), no normalisation or host sync.
    return n, argmax(residual / torch.empty_like(residual).exponential_(1))


def ngram_draft(context: Tensor, n: int, k: int) -> Tensor:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the context's last
    m tokens, for the largest m <= n that occurs; [k] token ids."""
    L = context.numel()
    start = L - 1  # no match at all: repeat the last token
    for m in range(min(n, L - 1), 0, -1):
        hits = (context.unfold(0, m, 1)[:-1] == context[-m:]).all(dim=1).nonzero()  # earlier m-grams
        if len(hits):
            start = int(hits[-1]) + m
            break
    # Continuing past the end of the context repeats the matched span (draft tokens extend it).
    return context[start + torch.arange(k, device=context.device) % (L - start)]


@torch.no_grad()
def speculative_generate(model: Transformer, prompt: Tensor, max_new_tokens: int, *,
                         draft_model: Optional[Transformer] = None, ngram: Optional[int] = None, k: int = 5,
                         batch_size: int = 1, eos_ids=(), callback: Optional[Callable[[Tensor], None]] = None,
                         prefill_fn: Callable = prefill, verify_fn: Callable = verify,
                         draft_fn: Callable = decode_one_token, accepted: Optional[list] = None,
                         temperature: float = 0.0, top_k: Optional[int] = None,
                         top_p: Optional[float] = None) -> Tensor:
    """decode.generate's contract for one sequence, drafting with draft_model or, when ngram is
    given, by prompt lookup. Appends the accepted draft count of each verify step to `accepted`."""
    assert (draft_model is None) != (ngram is None), "pass draft_model or ngram"
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(batch_size, -1)
    B, T = prompt.shape
    if B != 1:
        raise ValueError("speculative decoding generates one sequence at a time; use --batch_size 1")
    if any(m is not None and m.config.linear_attention_layers for m in (model, draft_model)):
        raise ValueError("speculative decoding rolls back the draft tokens the target rejects, which linear "
                         "attention's state (Qwen3.5, Qwen3-Next, LFM2) cannot; generate without a draft")
    if k < 1 or (ngram is not None and ngram < 1):
        raise ValueError(f"--speculate_k and --speculate_ngram must be at least 1, got {k} and {ngram}")
    check_context(model.config, T, max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    # The last verify step writes up to k - 1 positions past the final token.
    max_seq_length = T + max_new_tokens + k - 1
    if max_seq_length > model.config.block_size:
        raise ValueError(f"the prompt ({T} tokens) plus --max_new_tokens ({max_new_tokens}) plus --speculate_k "
                         f"({k}) - 1 exceeds the model's context of {model.config.block_size} tokens; shorten one")
    device, sampling, eos = prompt.device, dict(temperature=temperature, top_k=top_k, top_p=top_p), set(eos_ids)
    model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
    token = prefill_fn(model, prompt, **sampling)
    if draft_model is not None:
        draft_model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
        prefill_fn(draft_model, prompt, **sampling)

    seq = torch.empty(T + max_new_tokens, dtype=torch.long, device=device)
    seq[:T] = prompt[0]
    n, new = 0, token[0]  # new: tokens to append, the last of them not yet in any KV cache
    while True:
        for i, t in enumerate(new.tolist()):
            seq[T + n] = t
            n += 1
            if callback is not None:
                callback(new[i:i + 1])
            if t in eos or n == max_new_tokens:
                return seq[None, :T + n]
        pos = T + n - 1  # position of the last token, seq[pos]
        with skip_guards(pos > T):  # after the first round, the first round's guards hold
            if draft_model is not None:
                draft, q = draft_k_tokens(draft_model, seq[pos:pos + 1], pos, k, draft_fn, sampling)
            else:
                draft = ngram_draft(seq[:pos + 1], ngram, k)
                q = F.one_hot(draft, model.config.vocab_size).float()  # a deterministic proposal: point masses
            input_pos = torch.arange(pos, pos + k + 1, device=device, dtype=torch.int)
            p = verify_fn(model, torch.cat([seq[pos:pos + 1], draft])[None], input_pos, **sampling)
            a, next_token = accept_draft(draft[None], q[None], p)
            a = int(a)
            if draft_model is not None and a == k:  # the draft never saw its own last token: cache it now
                # Strides (1, 1) like the drafting steps' tokens: draft[None, -1:] has (k, 1), which
                # made Dynamo compile a second graph (or raise, with the guards skipped).
                draft_fn(draft_model, draft[-1:].view(1, 1), input_pos[-1:].clone(), **sampling)
        if accepted is not None:
            accepted.append(a)
        new = torch.cat([draft[:a], next_token])


def draft_k_tokens(draft_model: Transformer, token: Tensor, pos: int, k: int, draft_fn: Callable, sampling: dict):
    """token [1] at position pos -> (k draft tokens [k], their draft distributions [k, V])."""
    tokens, probs = [], []
    token = token[None]  # (1, 1)
    for i in range(k):
        input_pos = torch.tensor([pos + i], device=token.device, dtype=torch.int)
        # Clones: compiled with CUDA graphs, the outputs live in memory the next replay overwrites.
        token, prob = (t.clone() for t in draft_fn(draft_model, token, input_pos, **sampling))
        tokens.append(token[0])
        probs.append(prob)
    return torch.cat(tokens), torch.cat(probs)


def load_draft(path: Path, target: Transformer, tokenizer, device, precision) -> Transformer:
    """Load the draft model (packed for the CPU, as the target) and check that it shares the target's vocabulary."""
    draft = load_packed(path, device, precision)
    problem = None
    if draft.config.vocab_size != target.config.vocab_size:
        problem = f"vocab_size {draft.config.vocab_size} vs the target's {target.config.vocab_size}"
    elif any((Path(path).parent / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        problem = vocab_difference(load_tokenizer(Path(path).parent), tokenizer)
    if problem:
        raise ValueError(f"the draft {path} does not share the target's vocabulary ({problem}); "
                         "use a draft from the same model family, with the same tokenizer")
    return draft


def vocab_difference(draft_tokenizer, tokenizer) -> Optional[str]:
    probe = "Hello, world! Speculative décodage 1234 ∑ 你好\n\tdef f(x):\n        return x ** 2"
    V = tokenizer.vocab_size
    if draft_tokenizer.vocab_size != V:
        return f"tokenizer size {draft_tokenizer.vocab_size} vs {V}"
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe):
        return "a probe text encodes to different token ids"
    if any(draft_tokenizer.decode([i]) != tokenizer.decode([i]) for i in range(0, V, max(1, V // 64))):
        return "some token ids decode to different text"
    return None


def acceptance_summary(accepted: list, k: int) -> str:
    per_position = [sum(a > i for a in accepted) for i in range(k)]
    mean = sum(accepted) / max(len(accepted), 1)
    return (f"Speculation: {len(accepted)} verify steps, accepted at draft position 1..{k}: {per_position}; "
            f"mean accepted {mean:.2f} of {k} ({mean + 1:.2f} tokens per target forward)")
