# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""A serving engine: many independent requests decoded together on the static KV cache.

The cache holds max_batch_size rows ("slots"). A request waits for a free slot, is prefilled into
it, then decodes with every other active slot in one step of a token each (the live slots alone
where one compiled step takes any number of rows; else every slot, in the static shape
[max_batch_size, 1] that `--compile` captures, beside a graph for prompts); when it finishes its slot
is free for the next waiting request at once (continuous batching). Each step does at most
`prefill_chunk` tokens of prefill beside the decode step, so a long prompt loads in chunks while
the running streams keep going; short prompts that fit the chunk together are all prefilled in
that step. A prompt's last token alone (a one-token prompt, a chunk's remainder, a prompt found
whole in the cache) needs no prefill: it joins the decode step, as a decoding row's next token.

A slot's cache row is never cleared: positions past what its current request wrote hold another
request's values, and the causal mask (keys at positions <= the query's) never lets it see them.
What a finished request left there is also a prompt cache: a new request takes the free slot whose
tokens share the longest prefix with its prompt and prefills only the rest (a chat's system prompt
and earlier turns, a few-shot preamble), as llama.cpp's server does with its slots; and what another
slot's row holds of a prompt, a running request's too, is copied rather than computed (`_share`).

    engine = Engine(model, tokenizer, max_batch_size=8)
    results = engine.generate([Request(tokenizer.encode("Hello"), max_new_tokens=32), ...])

A server calls `add` / `abort` from its own threads; they only queue events, which `step` applies
on the engine's thread, so the schedule is decided in one place. Under tensor parallelism that
place is rank 0: `sync` hands every rank rank 0's events, and all ranks then run the same steps.
"""
import dataclasses
import random
import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from compiling import compile_prefill, compile_step, rows_vary, skip_guards
from decode import check_sampling, sample_rows
from model import Transformer
from structured import Constraint, TokenTable

DEFAULT_PREFILL_CHUNK = 512
# Prompt positions that another slot's cache row holds are copied rather than computed from this
# many on (fewer cost more in copies, a few per layer, than in a batched prefill's rows).
MIN_SHARED = 16


@dataclass
class Request:
    """What one caller asks for. prompt: token ids. seed None: one drawn from the engine's seed."""
    prompt: Sequence[int]
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    # OpenAI's: each generated token's logit is lowered by frequency_penalty for every time it was
    # generated before, and by presence_penalty once if it was; logit_bias adds to a token's logit
    # (-100 bans it, 100 all but forces it). Before sampling, greedy too; logprobs stay the model's own.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict] = None  # token id -> bias
    # The text follows this llguidance grammar (structured.json_grammar(schema): a JSON schema's); it
    # ends, finish_reason "stop", once the grammar allows nothing more.
    grammar: Optional[str] = None
    # With a trigger the grammar is lazy (as llama.cpp's are for tool calls): the text is free, and
    # nothing is masked, until the trigger first appears in it; the grammar then holds what follows.
    # A compiled re pattern: from where its first match in the text ends, or, where the pattern has
    # a group, from where that group starts (the group is the grammar's own first text: a bare JSON
    # call's `{"name"`, which nothing before it marks).
    grammar_trigger: Union[str, re.Pattern, None] = None
    seed: Optional[int] = None
    stop: Sequence[str] = ()  # stop strings: the text ends before the first one
    eos_ids: Optional[Sequence[int]] = None  # None: the tokenizer's
    logprobs: Optional[int] = None  # None: none; n >= 0: each token's log-probability and the n most likely
    prompt_logprobs: Optional[int] = None  # the same for each prompt token after the first (scoring a text)
    on_output: Optional[Callable[["Output"], None]] = None  # called from the engine's thread


@dataclass
class Output:
    """New text of one request since its last output; finish_reason set on its last one."""
    request_id: int
    text: str
    token_ids: list
    # Per new token, the EOS that ended the request included: (token id, logprob, [(token id, logprob), ...]).
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # the same per prompt token but the first (first Output)
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string), "length", "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, found in the slot's cache (not prefilled)
    completion_tokens: int = 0  # so far


@dataclass
class Result:
    text: str
    token_ids: list
    finish_reason: str
    logprobs: list
    prompt_logprobs: list = field(default_factory=list)


class _Sequence:
    """A request in a slot: its prompt, what it generated, and how far its cache row is written."""

    def __init__(self, request_id: int, request: Request, eos_ids):
        self.id, self.request = request_id, request
        self.prompt = list(request.prompt)
        self.eos = set(eos_ids)
        self.generator: Optional[torch.Generator] = None  # made by the engine for a sampled request
        self.cached = 0  # positions of this sequence written into its cache row
        self.reused = 0  # of those, found there (a previous request's prefix)
        self.generated: list = []
        self.next_token: Optional[int] = None  # sampled (or the prompt's last), not yet in the cache
        self.text = IncrementalText()  # of generated
        self.text_sent = 0  # characters of text already emitted
        self.finish_reason: Optional[str] = None
        self.prompt_logprobs: list = []  # scored so far, not yet sent
        self.counts: dict = {}  # token id -> times generated, where a penalty asks
        self.constraint: Optional[Constraint] = None  # the request's place in its grammar
        self.trigger_search = 0  # where in the text a lazy grammar's trigger may first appear

    def take_prompt_logprobs(self) -> list:
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    def logit_offsets(self) -> dict:
        """token id -> what sampling adds to its logit: the request's bias and penalties (empty: none)."""
        r = self.request
        offsets = dict(r.logit_bias or {})
        for token, count in self.counts.items():
            offsets[token] = offsets.get(token, 0.0) - count * r.frequency_penalty - r.presence_penalty
        return offsets

    @property
    def prefilling(self) -> bool:
        return self.next_token is None and self.cached < len(self.prompt)

    def advance(self, cached: int):
        """cached positions written; the prompt's last token alone left joins the decode step."""
        self.cached = cached
        if cached == len(self.prompt) - 1:
            self.next_token = self.prompt[-1]


def check_request(request: Request, max_seq_length: int, vocab_size: int):
    if len(request.prompt) == 0:
        raise ValueError("the prompt is empty (and this tokenizer adds no BOS): give at least one token")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
    if len(request.prompt) + request.max_new_tokens > max_seq_length:
        raise ValueError(f"the prompt ({len(request.prompt)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                         f"exceeds the context of {max_seq_length} tokens; shorten the prompt or lower max_new_tokens")
    if not all(0 <= t < vocab_size for t in request.prompt):
        raise ValueError(f"the prompt holds token ids outside the vocabulary (0..{vocab_size - 1})")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(request, name)
        if n is not None and not 0 <= n <= vocab_size:
            raise ValueError(f"{name} must be between 0 and the vocabulary's {vocab_size}, got {n}")
    check_sampling(request.temperature, request.top_k, request.top_p)
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(request, name)
        if not (isinstance(value, (int, float)) and -2 <= value <= 2):
            raise ValueError(f"{name} must be a number between -2 and 2, got {value!r}")
    for token, bias in (request.logit_bias or {}).items():
        if not (isinstance(token, int) and 0 <= token < vocab_size):
            raise ValueError(f"logit_bias names token {token!r}, outside the vocabulary (0..{vocab_size - 1})")
        if not (isinstance(bias, (int, float)) and -100 <= bias <= 100):
            raise ValueError(f"logit_bias of token {token} must be a number between -100 and 100, got {bias!r}")


def decode_step(model: Transformer, x: Tensor, input_pos: Tensor, kv_len: Optional[int],
                cache_rows: Optional[Tensor] = None, lengths: Optional[Tensor] = None) -> Tensor:
    """x [B, 1] at per-row positions input_pos [B, 1] of cache rows cache_rows [B] (None: every row),
    attending to the first kv_len cache positions -> logits [B, V]: the step compile_step compiles
    (one graph per kv_len bucket). lengths [B]: 0 for rows that only ride along (Transformer.forward)."""
    return model(x, input_pos, kv_len=kv_len, cache_rows=cache_rows, lengths=lengths)[:, -1]


def prefill_step(model: Transformer, x: Tensor, input_pos: Tensor, cache_rows: Tensor, logits_at: Tensor,
                 kv_len: int, from_start: bool) -> Tensor:
    """Prompt tokens x [B, T] at positions input_pos [B, T] into cache rows cache_rows [B] -> logits
    [B, V] at each row's index logits_at [B] into T, each row's last real token (padding follows):
    the step compile_prefill compiles (with from_start False, one graph for any number of prompts of
    any length from any positions)."""
    # The compiled graph leaves each tensor's batch unbacked (compiling.compile_prefill): say they agree.
    for t in (input_pos, cache_rows, logits_at):
        torch._check(t.shape[0] == x.shape[0])
    return model(x, input_pos, from_start=from_start, cache_rows=cache_rows, logits_at=logits_at, kv_len=kv_len,
                 lengths=logits_at + 1)[:, -1]


def ranked(logits: Tensor, tokens: Sequence[int], n: int) -> list:
    """logits [T, V] at the positions before tokens (at most T of them) -> per token, (the token,
    its log-probability, the n most likely [(token id, log-probability), ...])."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    picked = lp[torch.arange(len(tokens), device=lp.device), torch.tensor(tokens, device=lp.device)].tolist()
    top = torch.topk(lp, n) if n else None
    return [(t, v, list(zip(top.indices[i].tolist(), top.values[i].tolist())) if n else [])
            for i, (t, v) in enumerate(zip(tokens, picked))]


def kv_bucket(positions_in_use: int, max_seq_length: int) -> Optional[int]:
    """Attention reads the cache up to a power of two (>= 256) above the positions in use: a decode
    step's cost follows the longest live sequence, not the cache's size, in a few static shapes.
    None where that reaches the cache's end: the whole cache, whatever its length (a compiled step
    for it then serves caches of any length, rather than one pinned to this one's)."""
    bucket = max(256, 1 << (positions_in_use - 1).bit_length())
    return bucket if bucket < max_seq_length else None


class Engine:
    def __init__(self, model: Transformer, tokenizer, max_batch_size: int = 8, max_seq_length: Optional[int] = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, compile: bool = False, seed: int = 0,
                 sync: Optional[Callable[[list], list]] = None):
        if max_batch_size < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch_size and prefill_chunk must be at least 1, got {max_batch_size} and "
                             f"{prefill_chunk}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_length = max_seq_length or model.config.block_size
        self.prefill_chunk = prefill_chunk
        self.device = model.norm.weight.device
        model.setup_caches(max_batch_size, self.max_seq_length)
        self.decode_fn = compile_step(decode_step, self.device.type, dynamic_rows=True) if compile else decode_step
        # A step decodes the live slots alone where one compiled step takes any number of them
        # (a packed CPU model's, or eager); elsewhere every slot, in the one shape it was compiled for
        # (rows that do not decode compute garbage): one live request of 8 slots costs 8 rows there.
        self.live_rows_only = not compile or rows_vary(model, self.device.type)
        self.prefill_fn = compile_prefill(prefill_step, self.device.type) if compile else prefill_step
        # Linear attention (Qwen3.5) keeps one state per slot at the last position it consumed: a slot's
        # prefix is reused only where the new prompt goes on from all of it, and no row copies another's.
        self.recurrent = bool(model.config.linear_attention_layers)
        self.slots: list = [None] * max_batch_size  # slot -> _Sequence or None
        self.kept: list = [[] for _ in range(max_batch_size)]  # free slot -> the tokens its cache row holds
        self.freed_at: list = [0] * max_batch_size  # slot -> when it was last freed (0: never used)
        self.frees = 0
        self.waiting: deque = deque()
        self.live: dict = {}  # request id -> _Sequence, waiting or in a slot
        self.inbox: list = []  # ("add", id, request, seed) / ("abort", id) events from any thread
        self.callbacks: dict = {}  # request id -> on_output (never sent to other ranks)
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.sync = sync
        self.rng = random.Random(seed)
        self.next_id = 0
        self.last_step = (0, 0)  # the bucket (None: the whole cache) and rows of the last decode step (0: none yet)
        # attention.cpp's kernel (every layer's attend_cache) reads only the positions its rows see,
        # whatever the cache's length: buckets would only add compiled graphs, each a compile (tens
        # of seconds on a first run) the first time a sequence grows past one.
        self.kv_buckets = not all(layer.attention.attend_cache is not None for layer in model.layers
                                  if not layer.linear)
        self.token_table: Optional[TokenTable] = None  # for grammars: made at the first one

    def _grammar_table(self) -> TokenTable:
        with self.lock:
            if self.token_table is None:
                self.token_table = TokenTable(self.tokenizer, self.model.config.vocab_size)
            return self.token_table

    # -- what callers use ----------------------------------------------------------------------

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Raises ValueError (before queueing) for a bad one."""
        check_request(request, self.max_seq_length, self.model.config.vocab_size)
        if request.grammar is not None:
            self._grammar_table().check(request.grammar)
        elif request.grammar_trigger is not None:
            raise ValueError("grammar_trigger needs a grammar")
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
            seed = request.seed if request.seed is not None else self.rng.getrandbits(63)
            if request.on_output is not None:
                self.callbacks[request_id] = request.on_output
            request = dataclasses.replace(request, on_output=None, prompt=list(request.prompt))
            self.inbox.append(("add", request_id, request, seed))
        self.wakeup.set()
        return request_id

    def abort(self, request_id: int):
        """Stop a request (a client went away); its slot is free after the next step."""
        with self.lock:
            self.inbox.append(("abort", request_id))
        self.wakeup.set()

    def has_work(self) -> bool:
        return bool(self.inbox or self.waiting) or any(s is not None for s in self.slots)

    def stats(self) -> dict:
        return dict(waiting=len(self.waiting), active=sum(s is not None for s in self.slots))

    def generate(self, requests: Sequence[Request], on_finish: Optional[Callable[[int], None]] = None) -> list:
        """Run requests to completion (offline batch inference); results in the requests' order."""
        ids = [self.add(r) for r in requests]
        index = {request_id: i for i, request_id in enumerate(ids)}
        results = [Result("", [], "", []) for _ in requests]
        while self.has_work():
            for out in self.step():
                r = results[index[out.request_id]]
                r.text += out.text
                r.token_ids += out.token_ids
                r.logprobs += out.logprobs
                r.prompt_logprobs += out.prompt_logprobs
                if out.finish_reason:
                    r.finish_reason = out.finish_reason
                    if on_finish is not None:
                        on_finish(index[out.request_id])
        return results

    def run_forever(self, stop: threading.Event, idle_s: float = 0.5):
        """A server's loop: step while there is work, wait for some while there is none, until stop
        is set (on rank 0; the others follow until rank 0's events say stop). On the CPU, run it on
        the thread that loaded the model (server.py: the main one): torch's kernels on a second
        thread start a second OpenMP team, and libgomp then sleeps between kernels (README, Many
        streams)."""
        while True:
            if not self.has_work():
                self.wakeup.wait(timeout=idle_s)  # with sync: a heartbeat, so idle ranks keep in touch
                self.wakeup.clear()
            if self.step(stop=stop.is_set()) is None:
                return

    # -- one iteration -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, stop: bool = False) -> Optional[list]:
        """Apply queued events, admit waiting requests, prefill one chunk, decode one token for every
        decoding slot; returns the outputs (None once stop was sent to every rank)."""
        with self.lock:
            events, self.inbox = self.inbox, []
        events = events + [("stop",)] if stop else events
        if self.sync is not None:
            events = self.sync(events)
        outputs = []
        for event in events:
            if event[0] == "stop":
                return None
            self._apply(event, outputs)
        self._admit()
        self._prefill(outputs)
        # A prompt's first token goes out before the decode step: it would otherwise wait for it.
        self._emit(outputs)
        decoded = []
        self._decode(decoded)
        self._emit(decoded)
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.finish_reason is not None:
                self._free(i)
        return outputs + decoded

    def _emit(self, outputs: list):
        for out in outputs:
            with self.lock:
                callback = self.callbacks.get(out.request_id)
                if out.finish_reason is not None:
                    self.live.pop(out.request_id, None)
                    self.callbacks.pop(out.request_id, None)
            if callback is not None:
                callback(out)

    def _apply(self, event: tuple, outputs: list):
        if event[0] == "add":
            _, request_id, request, seed = event
            eos = self.tokenizer.eos_ids if request.eos_ids is None else request.eos_ids
            self.live[request_id] = seq = _Sequence(request_id, request, eos)
            if request.temperature > 0:
                seq.generator = torch.Generator(self.device).manual_seed(seed % 2**64)
            if request.grammar is not None and request.grammar_trigger is None:
                seq.constraint = Constraint(self._grammar_table(), request.grammar)  # every rank's own
            self.waiting.append(seq)
        elif event[0] == "abort" and event[1] in self.live:
            seq = self.live[event[1]]
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq.finish_reason is None:
                self._finish(seq, "abort", outputs)

    def _free(self, i: int):
        self.kept[i] = self._written(i)  # the last token sampled is not in the cache
        self.slots[i] = None
        self.frees += 1
        self.freed_at[i] = self.frees

    def _admit(self):
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.finish_reason is not None:  # aborted: free it now
                self._free(i)
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            free = [i for i, s in enumerate(self.slots) if s is None]
            shared = [common_prefix(self.kept[i], seq.prompt) for i in free]
            # The longest shared prefix; among equals (an unrelated prompt: none) the slot unused
            # longest, as llama.cpp's server picks, so the prefixes used last stay for their next turn.
            best = max(range(len(free)), key=lambda j: (shared[j], -self.freed_at[free[j]]))
            # At least the prompt's last token is computed again: its logits give the first token.
            # A prompt to score is computed whole: a cached position has no logits.
            seq.reused = 0 if seq.request.prompt_logprobs is not None else min(shared[best], len(seq.prompt) - 1)
            if self.recurrent and seq.reused != len(self.kept[free[best]]):  # the state stands at the end of it
                seq.reused = 0
            seq.advance(seq.reused)
            self.slots[free[best]] = seq

    def _written(self, i: int) -> list:
        """The tokens whose keys and values slot i's cache row holds, from position 0."""
        s = self.slots[i]
        return self.kept[i] if s is None else (s.prompt + s.generated)[:s.cached]

    def _share(self, todo: list) -> list:
        """Prompts copy what other slots' rows hold of them instead of computing it (a system prompt
        that concurrent chats share, a request's n choices), and a prompt that an earlier request
        still being prefilled shares waits for it; returns the (slot, sequence) pairs to prefill now.
        A row's first positions never change while its request runs (it only writes past what it
        has), so a running request's row is as good a source as a free one's."""
        ahead = []
        for i, s in todo:
            # Scored prompts are computed whole (every position's logits); one that began computing
            # its own positions goes on.
            if s.request.prompt_logprobs is not None or s.cached > s.reused or self.recurrent:
                ahead.append((i, s))
                continue
            shared = [common_prefix(self._written(j), s.prompt) if j != i else 0 for j in range(self.max_batch_size)]
            source = max(range(self.max_batch_size), key=shared.__getitem__)
            n = min(shared[source], len(s.prompt) - 1)  # the last token is computed: its logits pick the first
            if n - s.cached >= MIN_SHARED:
                for layer in self.model.layers:
                    layer.attention.kv_cache.copy_positions(source, i, s.cached, n)
                s.reused += n - s.cached
                s.advance(n)
                if not s.prefilling:  # its last token joins the decode step
                    continue
            rest = len(s.prompt) - s.cached
            if not any(o.id < s.id and o.prefilling and common_prefix(o.prompt, s.prompt) - s.cached >= max(
                    MIN_SHARED, rest // 2) for _, o in todo):
                ahead.append((i, s))
        return ahead

    def _prefill(self, outputs: list):
        todo = [(i, s) for i, s in enumerate(self.slots) if s is not None and s.prefilling and s.finish_reason is None]
        todo = self._share(todo)
        if not todo:
            return
        # A prompt to score goes alone, through the model eagerly: its every position's logits.
        scoring = [(i, s) for i, s in todo if s.request.prompt_logprobs is not None][:1]
        todo = scoring or todo
        # Prompts whose rest fits the chunk together: one right-padded forward, each row from its
        # own position (causal attention never looks right, so the padding is invisible to each
        # row's real tokens; the padding's positions must exist in the cache).
        group, longest, last_start = [], 0, 0
        for i, s in todo:
            n, start = max(longest, len(s.prompt) - s.cached), max(last_start, s.cached)
            if n * (len(group) + 1) <= self.prefill_chunk and start + n <= self.max_seq_length:
                group.append((i, s))
                longest, last_start = n, start
        if not group:  # the next chunk of the oldest prefilling request (too long for one step)
            group = todo[:1]
            longest = min(len(todo[0][1].prompt) - todo[0][1].cached, self.prefill_chunk)
        starts = [s.cached for _, s in group]
        ends = [min(len(s.prompt), start + longest) for (_, s), start in zip(group, starts)]
        x = torch.zeros(len(group), longest, dtype=torch.long)
        for row, ((_, s), start, end) in enumerate(zip(group, starts, ends)):
            x[row, :end - start] = torch.tensor(s.prompt[start:end])
        input_pos = torch.tensor(starts)[:, None] + torch.arange(longest)
        rows = torch.tensor([i for i, _ in group])
        logits_at = torch.tensor(ends) - torch.tensor(starts) - 1
        # Eager prompts from position 0 skip reading the cache (causal attention within x). The
        # compiled step always reads it: one graph for first chunks, later chunks and the rests of
        # cached prefixes alike (longest > 1 here: one-token rests decode).
        from_start = self.prefill_fn is prefill_step and max(starts) == 0
        if scoring:
            (_, s), start, end = group[0], starts[0], ends[0]
            every = self.model(x.to(self.device), input_pos.to(self.device), from_start=start == 0,
                               cache_rows=rows.to(self.device), kv_len=start + longest)[0]  # [T, V]
            s.prompt_logprobs += ranked(every[:end - start], s.prompt[start + 1:end + 1], s.request.prompt_logprobs)
            logits = every[end - start - 1][None]
        else:
            logits = self.prefill_fn(self.model, *(t.to(self.device) for t in (x, input_pos, rows, logits_at)),
                                     max(starts) + longest, from_start)
        done = [row for row, ((_, s), end) in enumerate(zip(group, ends)) if end == len(s.prompt)]
        for (_, s), end in zip(group, ends):
            s.advance(end)
        if done:
            self._sample([group[row][1] for row in done], logits[done], outputs)

    def _decode(self, outputs: list):
        active = [s is not None and s.next_token is not None and s.finish_reason is None for s in self.slots]
        if not any(active):
            return
        B = self.max_batch_size
        rows = [i for i in range(B) if active[i]]
        if self.live_rows_only:
            tokens = torch.tensor([[self.slots[i].next_token] for i in rows])
            pos = torch.tensor([[self.slots[i].cached] for i in rows], dtype=torch.int)
            cache_rows, lengths = torch.tensor(rows).to(self.device), None
        else:
            tokens = torch.zeros(B, 1, dtype=torch.long)
            pos = torch.zeros(B, 1, dtype=torch.int)
            for i, s in enumerate(self.slots):
                # Rows that do not decode write garbage at a position their own request writes again
                # before reading it (a prefilling slot's next position), or past what a free slot keeps.
                pos[i, 0] = len(self.kept[i]) if s is None else s.cached
                if active[i]:
                    tokens[i, 0] = s.next_token
            cache_rows = None
            lengths = torch.tensor(active, dtype=torch.int, device=self.device) if self.recurrent else None
        # Free slots' positions do not count: their garbage lands past the attention's bucket.
        kv_len = kv_bucket(max(s.cached for s in self.slots if s is not None) + 1, self.max_seq_length) \
            if self.kv_buckets else None
        # The graph of the last step's bucket and rows passed its guards; another must be looked up
        # (or compiled: a batch of one row is a graph of its own under dynamo).
        step = (kv_len, tokens.shape[0])
        with skip_guards(step == self.last_step):
            logits = self.decode_fn(self.model, tokens.to(self.device), pos.to(self.device), kv_len, cache_rows,
                                    lengths)
        self.last_step = step
        for i in rows:
            self.slots[i].cached += 1
        self._sample([self.slots[i] for i in rows], logits if self.live_rows_only else logits[rows], outputs)

    def _sample(self, seqs: list, logits: Tensor, outputs: list):
        """logits [len(seqs), V] at each sequence's last position -> its next token, and outputs."""
        reqs = [s.request for s in seqs]
        shaped = shaped_logits(logits, [s.logit_offsets() for s in seqs], [s.constraint for s in seqs])
        tokens = sample_rows(shaped, [r.temperature for r in reqs], [r.top_k for r in reqs], [r.top_p for r in reqs],
                             [s.generator for s in seqs])
        for s, t, row in zip(seqs, tokens, logits):
            lp = ranked(row[None], [t], s.request.logprobs) if s.request.logprobs is not None else []
            self._append(s, t, lp, outputs)

    def _append(self, s: _Sequence, token: int, logprobs: list, outputs: list):
        if token in s.eos:  # not text, nor counted: scored, if asked (it is the continuation's probability too)
            return self._finish(s, "stop", outputs, logprobs=logprobs)
        s.generated.append(token)
        s.next_token = token
        if s.request.frequency_penalty or s.request.presence_penalty:
            s.counts[token] = s.counts.get(token, 0) + 1
        if s.constraint is not None:
            s.constraint.take(token)
        text = s.text.of(self.tokenizer, s.generated)
        if s.constraint is None and s.request.grammar_trigger is not None:
            self._trigger(s, text)
        stop_at = min((i for i in (text.find(stop, max(0, s.text_sent - len(stop))) for stop in s.request.stop)
                       if i >= 0), default=-1)
        if stop_at >= 0:
            return self._finish(s, "stop", outputs, text[:stop_at], token, logprobs)
        if len(s.generated) == s.request.max_new_tokens:
            return self._finish(s, "length", outputs, text, token, logprobs)
        if s.constraint is not None and s.constraint.complete:  # only an EOS could follow: no step for it
            return self._finish(s, "stop", outputs, text, token, logprobs)
        # Hold back what may still change: an incomplete UTF-8 sequence, or the start of a stop string.
        safe = len(text) - held_back(text, s.request.stop)
        outputs.append(Output(s.id, text[s.text_sent:safe], [token], logprobs, s.take_prompt_logprobs(), None,
                              len(s.prompt), s.reused, len(s.generated)))
        s.text_sent = max(s.text_sent, safe)

    def _trigger(self, s: _Sequence, text: str):
        """A lazy grammar starts where its trigger first appears (a pattern: where its first match
        ends, or its group starts), fed the text after it (a token may hold the trigger's end and
        more). Where that text already breaks the grammar, the answer stays free."""
        trigger = s.request.grammar_trigger
        if isinstance(trigger, str):
            at = text.find(trigger, s.trigger_search)
            end = at + len(trigger) if at >= 0 else -1
            if at < 0:
                s.trigger_search = max(0, len(text) - len(trigger) + 1)
        else:  # from the text's start each time: a pattern may look behind its match (past the thinking)
            match = trigger.search(text)
            end = (-1 if match is None or match.end() <= s.trigger_search else
                   match.start(1) if trigger.groups else match.end())
        if end < 0 or text.endswith("\ufffd"):  # not there, or the text after it not whole yet
            return
        s.trigger_search = len(text) + 1  # where this tail breaks the grammar, a later trigger may start it
        constraint = Constraint(self._grammar_table(), s.request.grammar)
        if all(constraint.take(t) for t in self.tokenizer.encode(text[end:], bos=False)):
            s.constraint = constraint

    def _finish(self, s: _Sequence, reason: str, outputs: list, text: Optional[str] = None,
                token: Optional[int] = None, logprobs: Sequence = ()):
        if text is None:
            text = s.text.of(self.tokenizer, s.generated) if s.generated else ""
            if s.request.stop:  # an EOS or an abort: the held-back text is final, up to a stop string
                cut = min((i for i in (text.find(stop) for stop in s.request.stop) if i >= 0), default=len(text))
                text = text[:cut]
        s.finish_reason = reason
        outputs.append(Output(s.id, text[s.text_sent:], [] if token is None else [token], list(logprobs),
                              s.take_prompt_logprobs(), reason, len(s.prompt), s.reused, len(s.generated)))
        s.text_sent = len(text)


def shaped_logits(logits: Tensor, offsets: list, constraints: list) -> Tensor:
    """logits [B, V] as sampling sees them: each row's {token id: offset} added, and -inf at the
    tokens its constraint (None: none) does not allow next; a copy where any row has either."""
    if not any(offsets) and all(c is None for c in constraints):
        return logits
    logits = logits.clone()
    for row, (offset, constraint) in enumerate(zip(offsets, constraints)):
        if offset:
            ids = torch.tensor(list(offset), device=logits.device)
            logits[row, ids] += torch.tensor(list(offset.values()), dtype=logits.dtype, device=logits.device)
        if constraint is not None:
            logits[row].masked_fill_(~constraint.allowed(logits.device), -float("inf"))
    return logits


class IncrementalText:
    """The text of a growing list of token ids, decoding only its last few ids each time (decoding
    a whole generation at every token costs its length: 0.2 ms at 2000 tokens, per stream and
    step). The text up to the last id that ended a character is kept; what follows is decoded
    with CONTEXT ids before it (a tokenizer's decode of a piece may differ at its start: a
    SentencePiece word's leading space, a character split between ids), and where that piece does
    not begin with the context's own text, the whole list is decoded."""
    CONTEXT = 4

    def __init__(self):
        self.settled, self.settled_text = 0, ""  # ids whose text is kept, and that text

    def of(self, tokenizer, ids: list) -> str:
        start = max(0, self.settled - self.CONTEXT)
        context = tokenizer.decode(ids[start:self.settled]) if self.settled else ""
        piece = tokenizer.decode(ids[start:])
        text = self.settled_text + piece[len(context):] if piece.startswith(context) else tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            self.settled, self.settled_text = len(ids), text
        return text


def common_prefix(a: list, b: list) -> int:
    """How many leading tokens lists a and b share: compared 64 at a time (a slice comparison runs
    in C), then one at a time in the first block that differs."""
    n, end = 0, min(len(a), len(b))
    while n < end and a[n:n + 64] == b[n:n + 64]:
        n += 64
    while n < end and a[n] == b[n]:
        n += 1
    return min(n, end)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text to hold back while streaming: a replacement character
    (an incomplete UTF-8 sequence) or the longest tail that begins a stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:n])), default=0)
