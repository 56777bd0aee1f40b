# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""An OpenAI-compatible HTTP server on the serving engine, with a chat page.

    python server.py                                             # the default model, http://127.0.0.1:8000
    python server.py --checkpoint_path X/model_int8.pth --compile --max_batch_size 16 --api_key KEY
    torchrun --standalone --nproc_per_node=2 server.py --checkpoint_path X/model.pth

POST /v1/chat/completions, /v1/responses and /v1/completions (streaming or not), GET /v1/models, /health,
/metrics (Prometheus) and / (chat.html). Every request becomes engine requests (one per choice);
the engine, on the main thread (HTTP has a thread of its own), decodes all of them together and
hands each output to the request's asyncio queue. Under torchrun rank 0 serves HTTP and the other
ranks follow its engine's schedule.

HTTP is Starlette on uvicorn, server-sent events sse-starlette, metrics prometheus_client: the
protocol work belongs to those libraries; this file maps the OpenAI API onto the engine.
"""
import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from engine import DEFAULT_PREFILL_CHUNK, Engine, Request
from errors import SEED, error_boundary, finite_float, int_in, positive_int
from load import DEFAULT_CHECKPOINT, PRECISIONS, add_placement_flags, log, placement
from packed_cache import load_with_tokenizer
from reasoning import FINAL, Harmony, Reasoning, ReasoningStream
import responses_api
from structured import json_grammar
from tools import Tools, ToolStream, encode_conversation, read_messages

MAX_BODY_BYTES = 1 << 20  # larger bodies get 413: no prompt the context holds is that long
MAX_N = 16
MAX_STOP = 16
# Accepted and ignored: they change nothing a local model does.
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "stream", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
               "parallel_tool_calls", "functions", "chat_template_kwargs", "logit_bias", "frequency_penalty",
               "presence_penalty"} | IGNORED
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "logprobs", "echo", "suffix", "best_of", "logit_bias", "frequency_penalty",
                     "presence_penalty", "response_format"} | IGNORED  # response_format: as vLLM's


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# Reading a request

def get(body: dict, name: str, kinds, default=None, check=None, must: str = ""):
    """body[name] of one of the JSON kinds ("int", "number", "bool", "string", "list", "object"), or default."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "bool": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
          "list": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}
    if not any(ok[k](value) for k in kinds.split("|")):
        raise APIError(400, f"'{name}' must be of type {kinds.replace('|', ' or ')}, got {json.dumps(value)[:50]}",
                       param=name)
    if check is not None and not check(value):
        raise APIError(400, f"'{name}' must be {must}, got {json.dumps(value)[:50]}", param=name)
    return value


def sampling_fields(body: dict, allowed: set) -> dict:
    """The settings both endpoints share, validated; unsupported ones refused rather than ignored."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unrecognized request argument {unknown[0]!r}", param=unknown[0])
    if body.get("functions"):
        raise APIError(400, "'functions' (OpenAI's deprecated form) is not supported; pass 'tools'", param="functions")
    bias = get(body, "logit_bias", "object", {})
    if not all(k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in bias.items()):
        raise APIError(400, "'logit_bias' must map token ids (as strings) to numbers between -100 and 100",
                       param="logit_bias")
    stop = get(body, "stop", "string|list", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP} strings", param="stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    return dict(
        temperature=get(body, "temperature", "number", 1.0, lambda v: 0 <= v <= 2, "between 0 and 2"),
        top_p=get(body, "top_p", "number", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=get(body, "top_k", "int", 0, lambda v: v >= 0, ">= 0 (0: off)"),
        seed=get(body, "seed", "int"),
        stop=[s for s in stop if s],
        n=get(body, "n", "int", 1, lambda v: 1 <= v <= MAX_N, f"between 1 and {MAX_N}"),
        frequency_penalty=get(body, "frequency_penalty", "number", 0.0, lambda v: -2 <= v <= 2, "between -2 and 2"),
        presence_penalty=get(body, "presence_penalty", "number", 0.0, lambda v: -2 <= v <= 2, "between -2 and 2"),
        logit_bias={int(k): v for k, v in bias.items()} or None,
        response_schema=response_schema(body),
        stream=get(body, "stream", "bool", False),
        include_usage=bool((options or {}).get("include_usage")),
    )


def response_schema(body: dict) -> Optional[dict]:
    """response_format -> the JSON schema the answer must follow (None: free text)."""
    fmt = get(body, "response_format", "object", {})
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "'response_format.json_schema' must be an object holding the JSON schema as 'schema'",
                           param="response_format")
        return spec.get("schema", {})
    raise APIError(400, "'response_format' must be of type text, json_object or json_schema, got "
                        f"{json.dumps(kind)[:50]}", param="response_format")


def answer_grammar(params: dict, tools: Optional[Tools], thinking, tokenizer) -> tuple:
    """-> (the grammar an answer follows: the tools' calls and/or response_format's schema, None
    where it is free; what starts it, None: the first token). A thinking model thinks first: a
    grammar held from the first token opens with its thinking, calls are looked for after it, and
    harmony's answer is held from its final channel on."""
    schema = params["response_schema"]
    if tools is None and schema is None:
        return None, None
    thought = thinking.thought_rules(tokenizer) if isinstance(thinking, Reasoning) else ""
    try:
        if tools is None:
            return json_grammar(schema, thought), FINAL if isinstance(thinking, Harmony) else None
        grammar, trigger = tools.grammar(schema, thought=thought)
    except ValueError as e:
        raise APIError(400, str(e), param="tools" if tools is not None else "response_format") from None
    return grammar, thinking.after_thinking(trigger) if thinking is not None and trigger is not None else trigger


class Answer:
    """One answer as the client reads it: a thinking model's thought apart (reasoning.py), the tool
    calls read out of the rest (tools.py); streamed piece by piece, or whole."""

    def __init__(self, thinking: Optional[Reasoning], tools: Optional[Tools]):
        self.thinking, self.tools = thinking, tools
        self.thoughts = ReasoningStream(thinking) if thinking is not None else None
        self.calls = ToolStream(tools) if tools is not None else None

    def feed(self, text: str, final: bool) -> tuple:
        """A new piece -> (new thought, new text to show, the calls: on the last piece)."""
        thought, calls = "", []
        if self.thoughts is not None:
            thought, text = self.thoughts.feed(text, final)
        if self.calls is not None:  # text that may be a call is held until the answer is read
            text = self.calls.feed(text)
            if final:
                rest, calls = self.calls.finish()
                text += rest
        return thought, text, calls

    def read(self, text: str) -> tuple:
        """The whole answer -> (its thought, None where it has none; its text; its calls)."""
        thought, text = self.thinking.split(text) if self.thinking is not None else (None, text)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            text = content.strip() if calls else text
        return thought, text, calls


def read_tools(body: dict, tokenizer) -> Optional[Tools]:
    """tools / tool_choice / parallel_tool_calls -> Tools (None: no call may be made)."""
    parallel = get(body, "parallel_tool_calls", "bool", True)
    if body.get("tools") is not None and tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        return Tools.read(body.get("tools"), body.get("tool_choice"), parallel, tokenizer)
    except ValueError as e:  # a ToolsError names its field; else the template failed
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


def chat_prompt(body: dict, tokenizer, tools: Optional[Tools] = None) -> list:
    messages = get(body, "messages", "list")
    if not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages")
    try:
        messages = read_messages(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    variables = get(body, "chat_template_kwargs", "object", {})
    taken = sorted(set(variables) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
    if taken:
        raise APIError(400, f"'chat_template_kwargs' may not set {taken[0]!r}, which the server sets",
                       param="chat_template_kwargs")
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        return encode_conversation(tokenizer, messages, tools, variables)
    except Exception as e:  # the checkpoint's own template refused these messages (jinja2 raises many kinds)
        raise APIError(400, f"the chat template could not format these messages: {e}", param="messages") from None


def completion_prompts(body: dict, tokenizer) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                                     for p in prompt):
        return [list(p) for p in prompt]
    else:
        raise APIError(400, "'prompt' is required: a string, a list of strings, or token id lists", param="prompt")
    return [encode_text(tokenizer, p) for p in prompts]


def encode_text(tokenizer, text: str, bos: Optional[bool] = None) -> list:
    """tokenizer.encode, with its refusal of text that is not UTF-8 (a lone surrogate escaped in the
    JSON) a 400."""
    try:
        return tokenizer.encode(text, bos=bos)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None


# ---------------------------------------------------------------------------------------------
# The server state: the engine, the metrics

class Server:
    def __init__(self, engine: Engine, tokenizer, model_name: str, api_key: Optional[str] = None,
                 shutdown_s: float = 30.0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.shutdown_s = shutdown_s
        self.created = int(time.time())
        self.stop = threading.Event()  # set when HTTP has stopped: the engine's loop ends
        r = self.registry = CollectorRegistry()
        self.requests = Counter("brisk_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("brisk_prompt_tokens", "prompt tokens received", registry=r)
        self.cached_tokens = Counter("brisk_prompt_tokens_cached", "prompt tokens found in a slot's cache, not "
                                     "prefilled", registry=r)
        self.generated_tokens = Counter("brisk_generation_tokens", "tokens generated", registry=r)
        Gauge("brisk_queue_length", "requests waiting for a slot", registry=r).set_function(
            lambda: engine.stats()["waiting"])
        Gauge("brisk_active_slots", "KV cache slots in use", registry=r).set_function(
            lambda: engine.stats()["active"])
        Gauge("brisk_slots", "KV cache slots", registry=r).set(engine.max_batch_size)
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("brisk_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=buckets, registry=r)
        self.itl = Histogram("brisk_inter_token_latency_seconds", "time between a request's tokens",
                             buckets=buckets, registry=r)

    def submit(self, prompts: list, params: dict, max_tokens: Optional[int], logprobs: Optional[int],
               score_prompt: bool = False) -> tuple:
        """n engine requests per prompt -> (their ids, one asyncio queue receiving (choice, Output)).
        score_prompt: the prompt's tokens get logprobs too (completions' echo)."""
        limit = self.engine.max_seq_length
        for p in prompts:
            budget = limit - len(p)
            if budget < 1 or (max_tokens is not None and max_tokens > budget):
                raise APIError(400, f"this model's context is {limit} tokens: the prompt has {len(p)} tokens and "
                                    f"max_tokens asks for {max_tokens if max_tokens is not None else 'at least 1'} "
                                    "more; shorten the prompt or lower max_tokens", param="messages",
                               code="context_length_exceeded")
            if not p:
                raise APIError(400, "the prompt is empty", param="prompt")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        ids = []
        for i, p in enumerate(prompts):
            for j in range(params["n"]):
                choice, arrival, last = len(ids), time.perf_counter(), [None]

                def on_output(out, choice=choice, arrival=arrival, last=last):  # the engine's thread
                    now = time.perf_counter()
                    if out.token_ids:
                        if last[0] is None:
                            self.ttft.observe(now - arrival)
                            self.cached_tokens.inc(out.cached_tokens)
                        else:
                            self.itl.observe(now - last[0])
                        last[0] = now
                        self.generated_tokens.inc(len(out.token_ids))
                    loop.call_soon_threadsafe(queue.put_nowait, (choice, out))

                seed = params["seed"] + j if params["seed"] is not None else None
                request = Request(p, max_tokens or limit - len(p), temperature=params["temperature"],
                                  top_k=params["top_k"], top_p=params["top_p"], seed=seed, stop=params["stop"],
                                  frequency_penalty=params["frequency_penalty"],
                                  presence_penalty=params["presence_penalty"], logit_bias=params["logit_bias"],
                                  grammar=params["grammar"], grammar_trigger=params["grammar_trigger"],
                                  logprobs=logprobs, prompt_logprobs=logprobs if score_prompt else None,
                                  on_output=on_output)
                try:
                    ids.append(self.engine.add(request))
                except ValueError as e:
                    for request_id in ids:
                        self.engine.abort(request_id)
                    raise APIError(400, str(e)) from None
                self.prompt_tokens.inc(len(p))
        return ids, queue


# ---------------------------------------------------------------------------------------------
# Endpoints

def make_app(server: Server):
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from starlette.routing import Route

    def error_response(e: APIError, endpoint: str):
        server.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request):
        if server.api_key is not None and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", kind="authentication_error")

    async def read_body(request) -> dict:
        check_key(request)
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = get(body, "model", "string")
        if model is not None and model != server.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server has '{server.model_name}'",
                           param="model", code="model_not_found")
        return body

    def token_text(token: int) -> str:
        return server.tokenizer.decode([token])

    def chat_logprobs(out) -> list:
        entries = []
        for token, lp, top in out.logprobs:
            text = token_text(token)
            entries.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                                             for t, v in top]})
        return entries

    def top_by_text(top: list) -> dict:
        """OpenAI's legacy {text: logprob}: where two tokens read the same (byte pieces of one character),
        the likelier one's (top comes most likely first)."""
        by_text = {}
        for t, v in top:
            by_text.setdefault(token_text(t), v)
        return by_text

    def completion_logprobs(entries: list, offset: int) -> dict:
        tokens = [token_text(t) for t, _, _ in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else top_by_text(top) for _, _, top in entries],
                "text_offset": offsets}

    def usage(prompt_tokens: int, completion_tokens: int, cached: list) -> dict:
        """cached: per prompt, its tokens found in a slot's cache."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(cached)}}

    async def outputs(request, ids: list, queue: asyncio.Queue):
        """(choice, Output) until every choice finished; aborts them all if the client goes away."""
        finished = 0
        try:
            while finished < len(ids):
                try:
                    choice, out = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                finished += out.finish_reason is not None
                yield choice, out
        finally:
            if finished < len(ids):
                for request_id in ids:
                    server.engine.abort(request_id)

    async def completion(request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await read_body(request)
            params = sampling_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            tools = thinking = None
            if chat:
                tools = read_tools(body, server.tokenizer)
                want = get(body, "logprobs", "bool", False)
                top = get(body, "top_logprobs", "int", None, lambda v: 0 <= v <= 20, "between 0 and 20")
                if top is not None and not want:
                    raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
                logprobs = (top or 0) if want else None
                max_tokens = get(body, "max_completion_tokens", "int") or get(body, "max_tokens", "int")
                prompts = [chat_prompt(body, server.tokenizer, tools)]
                thinking = Reasoning.of(server.tokenizer, prompts[0])
                echo = score_only = False
            else:
                logprobs = get(body, "logprobs", "int", None, lambda v: 0 <= v <= 20, "between 0 and 20")
                echo = get(body, "echo", "bool", False)
                if get(body, "suffix", "string"):
                    raise APIError(400, "'suffix' is not supported by this server", param="suffix")
                if get(body, "best_of", "int", params["n"]) != params["n"]:
                    raise APIError(400, "'best_of' other than n is not supported", param="best_of")
                max_tokens = get(body, "max_tokens", "int", 16)
                score_only = echo and max_tokens == 0  # OpenAI's legacy scoring: the prompt alone, nothing generated
                prompts = completion_prompts(body, server.tokenizer)
            if max_tokens is not None and max_tokens < 1 and not score_only:
                raise APIError(400, f"'max_tokens' must be at least 1 (0 only with echo), got {max_tokens}",
                               param="max_tokens")
            params["grammar"], params["grammar_trigger"] = answer_grammar(params, tools, thinking, server.tokenizer)
            if server.stop.is_set():
                raise APIError(503, "the server is shutting down", kind="server_error")
            ids, queue = server.submit(prompts, params, 1 if score_only else max_tokens, logprobs, score_prompt=echo)
        except APIError as e:
            return error_response(e, endpoint)
        except ClientDisconnect:
            return PlainTextResponse("", status_code=499)
        server.requests.labels(endpoint, "200").inc()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": server.model_name}
        n = params["n"]
        prompt_len = sum(len(p) for p in prompts)
        cached = [0] * len(ids)  # per choice: its prompt's tokens found in a slot's cache (a prompt counts once)
        prefix = [server.tokenizer.decode(prompts[c // n]) if echo else "" for c in range(len(ids))]
        prompt_scored = [not echo] * len(ids)

        def shown(out):
            """out as the client sees it: with max_tokens 0 the one token generated is dropped."""
            return dataclasses.replace(out, text="", token_ids=[], logprobs=[],
                                       finish_reason=out.finish_reason and "length") if score_only else out

        def scored(c: int, out) -> list:
            """out's logprob entries, after the echoed prompt's in the choice's first output (its first
            token unscored, as OpenAI gives it): what lm-eval's loglikelihood reads."""
            if prompt_scored[c]:
                return out.logprobs
            prompt_scored[c] = True
            return [(prompts[c // n][0], None, None), *out.prompt_logprobs, *out.logprobs]

        def call_reason(reason: str, calls: list) -> str:
            """OpenAI's finish_reason for an answer that made calls: "tool_calls", or "stop" where
            tool_choice named the function."""
            return "tool_calls" if calls and reason == "stop" and tools.choice in ("auto", "required") else reason

        if params["stream"]:
            async def events():
                extra = {"usage": None} if params["include_usage"] else {}
                if chat:
                    for c in range(len(ids)):
                        # content null where the answer may be calls alone, as OpenAI's first chunk has it
                        first = {"role": "assistant", "content": "" if tools is None else None}
                        yield json.dumps({**base, "choices": [{"index": c, "delta": first,
                                                                "logprobs": None, "finish_reason": None}], **extra})
                sent_text = [False] * len(ids)
                answers = [Answer(thinking, tools) for _ in ids]
                completion_tokens = 0
                async for c, out in outputs(request, ids, queue):
                    out = shown(out)
                    completion_tokens += len(out.token_ids)
                    cached[c] = out.cached_tokens
                    text, reason = out.text, out.finish_reason
                    if not sent_text[c] and prefix[c]:
                        text, sent_text[c] = prefix[c] + text, True
                    thought, text, calls = answers[c].feed(text, final=reason is not None)
                    if calls:  # in a chunk of their own before the last, as OpenAI sends them
                        reason = call_reason(reason, calls)
                        delta = {"content": text} if text else {}
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                        yield json.dumps({**base, "choices": [{"index": c, "delta": delta, "logprobs": None,
                                                               "finish_reason": None}], **extra})
                        text = ""
                    if not text and not thought and reason is None and logprobs is None:
                        continue
                    if chat:
                        delta = {"content": text} if text else {}
                        if thought:
                            delta["reasoning_content"] = thought
                        choice = {"index": c, "delta": delta,
                                  "logprobs": {"content": chat_logprobs(out)} if logprobs is not None else None,
                                  "finish_reason": reason}
                    else:
                        choice = {"index": c, "text": text, "finish_reason": out.finish_reason,
                                  "logprobs": completion_logprobs(scored(c, out), 0) if logprobs is not None else None}
                    yield json.dumps({**base, "choices": [choice], **extra})
                if params["include_usage"]:
                    yield json.dumps({**base, "choices": [],
                                      "usage": usage(prompt_len, completion_tokens, cached[::n])})
                yield "[DONE]"

            return EventSourceResponse(events(), ping=15, shutdown_grace_period=server.shutdown_s)

        texts, reasons = list(prefix), [None] * len(ids)
        lps = [[] for _ in ids]
        completion_tokens = 0
        async for c, out in outputs(request, ids, queue):
            out = shown(out)
            completion_tokens += len(out.token_ids)
            cached[c] = out.cached_tokens
            if logprobs is not None:
                offset = 0 if not prompt_scored[c] else len(texts[c])  # the echoed prompt's entries from 0
                lps[c] += chat_logprobs(out) if chat else [completion_logprobs(scored(c, out), offset)]
            texts[c] += out.text
            reasons[c] = out.finish_reason
        if any(r is None for r in reasons):  # the client went away
            return PlainTextResponse("", status_code=499)
        if chat:
            choices = []
            for c in range(len(ids)):
                thought, text, calls = Answer(thinking, tools).read(texts[c])
                message, reason = {"role": "assistant", "content": text}, reasons[c]
                if calls:
                    message = {"role": "assistant", "content": text or None, "tool_calls": calls}
                    reason = call_reason(reason, calls)
                if thought is not None:
                    message["reasoning_content"] = thought
                choices.append({"index": c, "message": message, "finish_reason": reason,
                                "logprobs": {"content": lps[c]} if logprobs is not None else None})
        else:
            choices = [{"index": c, "text": texts[c], "finish_reason": reasons[c],
                        "logprobs": merge_completion_logprobs(lps[c]) if logprobs is not None else None}
                       for c in range(len(ids))]
        return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": usage(prompt_len, completion_tokens, cached[::n]), "system_fingerprint": None})

    async def chat_completions(request):
        return await completion(request, chat=True)

    async def completions(request):
        return await completion(request, chat=False)

    async def responses(request):
        """OpenAI's Responses API: the request read as a chat completion (responses_api.py), the answer
        given back as output items, whole or as typed events."""
        try:
            body = await read_body(request)
            try:
                chat = responses_api.chat_request(body)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            params = sampling_fields(chat, CHAT_FIELDS)
            tools = read_tools(chat, server.tokenizer)
            prompt = chat_prompt(chat, server.tokenizer, tools)
            thinking = Reasoning.of(server.tokenizer, prompt)
            params["grammar"], params["grammar_trigger"] = answer_grammar(params, tools, thinking, server.tokenizer)
            max_tokens = get(chat, "max_tokens", "int", None, lambda v: v >= 1, "at least 1")
            if server.stop.is_set():
                raise APIError(503, "the server is shutting down", kind="server_error")
            ids, queue = server.submit([prompt], params, max_tokens, None)
        except APIError as e:
            return error_response(e, "responses")
        except ClientDisconnect:
            return PlainTextResponse("", status_code=499)
        server.requests.labels("responses", "200").inc()
        response, answer = responses_api.Response(body, server.model_name), Answer(thinking, tools)
        tokens, cached, text, reason = 0, 0, "", None
        if params["stream"]:
            async def events():
                nonlocal tokens, cached
                for event in response.start():
                    yield {"event": event["type"], "data": json.dumps(event)}
                async for _, out in outputs(request, ids, queue):
                    tokens, cached = tokens + len(out.token_ids), out.cached_tokens
                    final = out.finish_reason is not None
                    thought, piece, calls = answer.feed(out.text, final)
                    produced = response.delta(thought, piece)
                    if final:
                        produced += response.finish(calls, out.finish_reason,
                                                    responses_api.usage(len(prompt), tokens, cached))
                    for event in produced:
                        yield {"event": event["type"], "data": json.dumps(event)}

            return EventSourceResponse(events(), ping=15, shutdown_grace_period=server.shutdown_s)
        async for _, out in outputs(request, ids, queue):
            tokens, cached, reason = tokens + len(out.token_ids), out.cached_tokens, out.finish_reason
            text += out.text
        if reason is None:  # the client went away
            return PlainTextResponse("", status_code=499)
        used = responses_api.usage(len(prompt), tokens, cached)
        return JSONResponse(response.whole(*answer.read(text), reason, used))

    async def models(request):
        """The model list, or one model by its id (GET /v1/models/{id}, the client's retrieve)."""
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "brisk"}
        try:
            check_key(request)
            wanted = request.path_params.get("model")
            if wanted is not None and wanted != server.model_name:
                raise APIError(404, f"the model '{wanted}' does not exist; this server has '{server.model_name}'",
                               param="model", code="model_not_found")
        except APIError as e:
            return error_response(e, "models")
        return JSONResponse(card if wanted is not None else {"object": "list", "data": [card]})

    # vLLM's tokenizer endpoints, which lm-eval's remote tokenizer reads (`local-completions` with
    # nothing but base_url): a client counts and splits tokens as this model does.
    async def tokenize(request):
        try:
            body = await read_body(request)
            if "messages" in body:
                ids = chat_prompt(body, server.tokenizer, read_tools(body, server.tokenizer))
            else:
                text = get(body, "prompt", "string")
                if text is None:
                    raise APIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
                special = get(body, "add_special_tokens", "bool", True)
                ids = encode_text(server.tokenizer, text, bos=None if special else False)
        except APIError as e:
            return error_response(e, "tokenize")
        return JSONResponse({"count": len(ids), "max_model_len": server.engine.max_seq_length, "tokens": ids})

    async def detokenize(request):
        try:
            body = await read_body(request)
            ids = get(body, "tokens", "list")
            vocab = server.engine.model.config.vocab_size
            if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise APIError(400, f"'tokens' must be a list of token ids (0..{vocab - 1})", param="tokens")
        except APIError as e:
            return error_response(e, "detokenize")
        return JSONResponse({"prompt": server.tokenizer.decode(ids)})

    async def tokenizer_info(request):
        try:
            check_key(request)
        except APIError as e:
            return error_response(e, "tokenizer_info")
        tok = server.tokenizer
        return JSONResponse({"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token or None,
                             "eos_token": tok.eos_token or None, "pad_token": None, "add_bos_token": tok.add_bos,
                             "chat_template": tok.chat_template, "model_max_length": server.engine.max_seq_length})

    async def health(request):
        return JSONResponse({"status": "ok", **server.engine.stats()})

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return PlainTextResponse(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    async def index(request):
        return HTMLResponse((Path(__file__).parent / "chat.html").read_text())

    async def http_error(request, exc):
        e = APIError(exc.status_code, exc.detail or "error",
                     code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(e.body(), status_code=exc.status_code)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/responses", responses, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models), Route("/v1/models/{model:path}", models), Route("/health", health),
              Route("/metrics", metrics), Route("/", index),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/tokenizer_info", tokenizer_info)]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def merge_completion_logprobs(parts: list) -> dict:
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


# ---------------------------------------------------------------------------------------------
# Running it

def broadcast_events(events: list) -> list:
    """Rank 0's engine events to every rank (the others' own are dropped): all ranks run one schedule."""
    import torch.distributed as dist
    box = [events]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(checkpoint_path: Optional[Path], host: str, port: int, api_key: Optional[str], max_batch_size: int,
         max_seq_length: Optional[int], prefill_chunk: int, compile: bool, device: Optional[str],
         precision: Optional[str], model_name: Optional[str], shutdown_timeout: float, seed: int,
         kv_cache_dtype: Optional[str] = None):
    import uvicorn

    if not is_loopback(host) and api_key is None:
        raise ValueError(f"--host {host} would serve the model to other machines without authentication; pass "
                         "--api_key KEY (clients send 'Authorization: Bearer KEY'), or keep --host 127.0.0.1")
    checkpoint_path = checkpoint_path or DEFAULT_CHECKPOINT
    if not Path(checkpoint_path).is_file() and checkpoint_path == DEFAULT_CHECKPOINT:
        raise FileNotFoundError(f"the default model is not prepared ({checkpoint_path} missing); run "
                                "./scripts/prepare.sh, or pass --checkpoint_path")
    device, dtype, dist = placement(device, precision)
    if dist is None or dist.rank == 0:
        check_port(host, port)
    t0 = time.perf_counter()
    model, tokenizer = load_with_tokenizer(checkpoint_path, device, dtype, tp=dist)
    model.kv_cache_dtype = PRECISIONS[kv_cache_dtype] if kv_cache_dtype else None
    max_seq_length = max_seq_length or min(model.config.block_size, 4096)
    engine = Engine(model, tokenizer, max_batch_size, max_seq_length, prefill_chunk, compile, seed,
                    sync=broadcast_events if dist else None)
    # Warm up (and compile) before the first client waits: one short request through every path
    # (two prompt tokens: a one-token prompt skips the compiled prefill).
    engine.generate([Request([tokenizer.eos_ids[0] if tokenizer.eos_ids else 0] * 2, 2, eos_ids=[])])
    log(f"Loaded {checkpoint_path} ({dtype}, {device}, {max_batch_size} slots of {max_seq_length} positions) "
        f"in {time.perf_counter() - t0:.2f} s")
    if dist is not None and dist.rank != 0:
        engine.run_forever(threading.Event())  # follows rank 0 until its engine stops
        return
    name = model_name or Path(checkpoint_path).parent.name
    server = Server(engine, tokenizer, name, api_key, shutdown_timeout)
    http = uvicorn.Server(uvicorn.Config(make_app(server), host=host, port=port, log_level="warning",
                                         timeout_graceful_shutdown=shutdown_timeout))

    def serve():
        try:
            http.run()
        finally:
            server.stop.set()
            engine.wakeup.set()

    # HTTP gets a thread and the engine keeps this one, which loaded and compiled the model. Torch's
    # kernels on a second thread would start a second OpenMP team: libgomp, seeing more of its
    # threads than CPUs, then sleeps between kernels instead of spinning, and each decode step waits
    # for its workers to wake. SIGINT / SIGTERM (delivered here) start uvicorn's graceful shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, http.handle_exit)
    thread = threading.Thread(target=serve, name="http", daemon=True)
    thread.start()
    log(f"Serving {name} on http://{host}:{port} (OpenAI API under /v1, chat page at /)")
    engine.run_forever(server.stop)
    thread.join()
    if not http.started:
        raise OSError(f"could not serve on {host}:{port} (uvicorn's error is above); pass another --port or --host")


def check_port(host: str, port: int):
    """Fail in a second, not after loading and compiling the model, when the address is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --port (or stop what "
                          "holds it)") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="An OpenAI-compatible server (and chat page) for a brisk checkpoint.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help=f"model.pth of a converted checkpoint (default: {DEFAULT_CHECKPOINT})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (other than loopback needs --api_key)")
    p.add_argument("--port", type=int_in(1, 65535), default=8000, help="port to listen on")
    p.add_argument("--api_key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    p.add_argument("--max_batch_size", type=positive_int, default=8, help="KV cache slots: requests decoded together")
    p.add_argument("--max_seq_length", type=positive_int, default=None,
                   help="positions per slot: prompt plus answer (default: the model's context, at most 4096)")
    p.add_argument("--prefill_chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help="the most prompt tokens prefilled per engine step, beside the decode step")
    p.add_argument("--compile", action="store_true",
                   help="compile the engine's decode and prefill steps (at startup)")
    add_placement_flags(p, kv_cache=True)
    p.add_argument("--model_name", default=None, help="the model id clients use (default: the checkpoint's folder)")
    p.add_argument("--shutdown_timeout", type=finite_float(0), default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C")
    p.add_argument("--seed", type=SEED, default=0, help="seeds the requests that bring none")
    return p.parse_args(argv)


def cli(argv=None):
    args = parse_args(argv)
    with error_boundary():
        main(**vars(args))


if __name__ == "__main__":
    cli()
