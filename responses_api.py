# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""OpenAI's Responses API (`POST /v1/responses`) on the chat completions machinery: a request's
`input` items and `instructions` read as chat messages, its function tools and `text.format` as
chat's `tools` and `response_format`; the answer given back as output items (reasoning, message,
function calls), whole or as the API's typed stream of events.

Nothing is stored (`store` is answered false): a conversation continues by sending its items
again, as `previous_response_id` would have the server keep them.

    chat = chat_request(body)                  # the chat completions request it asks for
    response = Response(body, model_name)      # its output items and events
"""
import time
import uuid
from typing import Optional

# Accepted and ignored: they change nothing a local model does.
IGNORED = {"store", "metadata", "user", "service_tier", "truncation", "reasoning", "include", "prompt_cache_key",
           "safety_identifier", "background", "max_tool_calls", "top_logprobs"}
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "text", "stream", "previous_response_id", "stream_options"} | IGNORED


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}.content must be a string or a list of input_text parts (only text is supported)")


def input_messages(items) -> list:
    """`input` (a string, or a list of items) -> chat messages: messages as they are, function calls
    as an assistant's tool_calls (consecutive ones in one message), their outputs as tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("'input' must be a string or a non-empty list of items")
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where} must have a role of user, system, developer or assistant")
            messages.append({"role": item["role"], "content": text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else text_of(output, where)})
        elif kind == "reasoning":  # an earlier turn's thinking: templates drop it from past turns
            continue
        else:
            raise ValueError(f"{where}: items of type message, function_call, function_call_output or reasoning "
                             f"are supported, not {kind!r}")
    return messages


def chat_request(body: dict) -> dict:
    """A Responses request -> the chat completions request it asks for. ValueError naming the
    first field this server cannot do, or that is malformed."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ValueError(f"unrecognized request argument {unknown[0]!r}")
    if body.get("previous_response_id") is not None:
        raise ValueError("'previous_response_id' is not supported: this server stores no responses; send the "
                         "conversation's items in 'input'")
    if body.get("background"):
        raise ValueError("'background' is not supported")
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError("'instructions' must be a string")
        messages = [{"role": "system", "content": instructions}, *messages]
    chat = {"messages": messages}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("stream", "stream"),
                         ("model", "model")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") is not None:
        tools = body["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("'tools' must be a list of tool objects")
        for i, tool in enumerate(tools):
            if tool.get("type") != "function":
                raise ValueError(f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if k in t}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise ValueError("'text' must be an object, as {\"format\": {...}}")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"),
                                                                          "schema": fmt.get("schema", {})}}
    elif fmt is not None:
        chat["response_format"] = fmt
    return chat


class Response:
    """One response: its object, and the events that stream it (each a dict to send as JSON)."""

    def __init__(self, body: dict, model: str):
        self.id, self.created = new_id("resp"), int(time.time())
        self.body, self.model = body, model
        self.output: list = []      # finished items
        self.open: Optional[dict] = None  # the item being streamed: reasoning or message
        self.sequence = 0

    def object(self, status: str, usage: Optional[dict] = None, incomplete: Optional[str] = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": list(self.output), "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": None,
                "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools", []),
                "text": b.get("text") or {"format": {"type": "text"}}, "store": False, "metadata": {},
                "usage": usage}

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    # -- streaming ---------------------------------------------------------------------------

    def start(self) -> list:
        return [self.event("response.created", response=self.object("in_progress")),
                self.event("response.in_progress", response=self.object("in_progress"))]

    def _open(self, kind: str) -> list:
        """Close the item being streamed, if it is another kind, and open one of this kind."""
        events = self._close() if self.open is not None and self.open["type"] != kind else []
        if self.open is not None:
            return events
        index = len(self.output)
        if kind == "reasoning":
            self.open = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self.event("response.output_item.added", output_index=index, item=dict(self.open, content=[])))
        self.open["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                 content_index=0, part=dict(part)))
        return events

    def _close(self) -> list:
        item, self.open = self.open, None
        index, part = len(self.output), item["content"][0]
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        done = {"text": part["text"]} if kind == "reasoning_text" else {"text": part["text"], "logprobs": []}
        item["status"] = "completed"
        self.output.append(item)
        return [self.event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0, **done),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def delta(self, thought: str, text: str) -> list:
        """New thinking and new answer text -> their events."""
        events = []
        for kind, piece in (("reasoning", thought), ("message", text)):
            if piece:
                events += self._open(kind)
                self.open["content"][0]["text"] += piece
                name = "reasoning_text" if kind == "reasoning" else "output_text"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                events.append(self.event(f"response.{name}.delta", item_id=self.open["id"],
                                         output_index=len(self.output), content_index=0, delta=piece, **extra))
        return events

    def finish(self, calls: list, reason: str, usage: dict) -> list:
        """The calls the answer made, why it ended and its usage -> the closing events."""
        events = self._close() if self.open is not None else []
        if not self.output and not calls:  # an empty answer is still a message
            events += self._open("message") + self._close()
        for call in calls:
            item = function_call_item(call)
            index = len(self.output)
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=dict(item, arguments="", status="in_progress")))
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=item["arguments"]))
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"], name=item["name"]))
            self.output.append(item)
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        incomplete = "max_output_tokens" if reason == "length" else None
        final = self.object("incomplete" if incomplete else "completed", usage, incomplete)
        return [*events, self.event("response.incomplete" if incomplete else "response.completed", response=final)]

    # -- whole -------------------------------------------------------------------------------

    def whole(self, thought: Optional[str], text: str, calls: list, reason: str, usage: dict) -> dict:
        """The answer's parts -> the response object."""
        self.delta(thought or "", text)
        return self.finish(calls, reason, usage)[-1]["response"]


def function_call_item(call: dict) -> dict:
    """A chat tool call -> a Responses function_call item."""
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}
