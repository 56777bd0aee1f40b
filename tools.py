# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Tool calling as OpenAI's chat API has it (`tools`, `tool_choice`, `parallel_tool_calls`): the
tools written into the prompt, the answer held to their schemas, the calls read back out of it.

How a model calls tools is what its chat template taught it:
- a template that reads `tools` (Qwen2.5 / Qwen3, Llama 3.1-3.3, Hermes, Mistral, ...) is given
  them as transformers gives them, with the conversation's tool calls and results as they come;
  the model answers in the format the template shows: `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>` blocks ("hermes", wherever the template writes that tag), the same blocks holding
  `<function=NAME>` and a `<parameter=KEY>` element per argument ("xml": Qwen3.5, Qwen3-Coder, where
  the template writes `<function=`; a string argument as its raw text, others as JSON), or else one
  bare JSON object (Llama 3.x's `{"name": ..., "parameters": ...}`), Gemma 4's special tokens
  (`<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between `<|"|>` quotes, where the
  template writes `<|tool_call>`), LFM2's Python list of calls by keyword (`<|tool_call_start|>[name(key="text",
  n=3)]<|tool_call_end|>`, where the template lists the tools after "List of tools:"; past calls go into
  the assistant's content as that text, the only part of it such a template writes), or, in OpenAI's
  harmony format (gpt-oss), a message to the recipient `functions.NAME` whose text is the arguments;
- a template that knows no tools (SmolLM2, Gemma 2 / 3, ...) gets them in a system message that asks for
  the hermes format, its assistant calls as that text and the results as user turns.

The calls are held to the tools' JSON schemas by a grammar (structured.py, llguidance): with
`tool_choice` "required" or a named function the answer is calls from its first token; with
"auto" the text is free, nothing masked, until the model writes `<tool_call>` (Gemma 4's
`<|tool_call>`, LFM2's `<|tool_call_start|>`; a bare JSON call: until the answer opens with
`{"name"`; harmony: until a message's header names `to=functions.`, forced or not, as its thinking
comes first), and from there each call must name a tool and match its parameters (a lazy grammar,
engine.py's grammar_trigger, as llama.cpp's server does it), so a call read back parses.

    tools = Tools.read(body["tools"], body.get("tool_choice"), True, tokenizer)
    ids = tokenizer.encode_chat(tools.messages(messages), tools=tools.template_tools)
    grammar, trigger = tools.grammar()
    Request(ids, 256, grammar=grammar, grammar_trigger=trigger)
    content, calls = tools.parse(answer_text)
"""
import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from reasoning import CHANNEL, FINAL, MESSAGE, START
from structured import WHITESPACE, lark_grammar, lark_literal, pattern_regex
from tokenizer import LFM_MARKERS, LFM_TOOLS

HERMES, XML, JSON, HARMONY, GEMMA4, PYTHON = "hermes", "xml", "json", "harmony", "gemma4", "python"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = "<function="  # (XML's call: <function=NAME> then <parameter=KEY>\nVALUE\n</parameter> each)
# Gemma 4's call, in special tokens: <|tool_call>call:NAME{key:value,...}<tool_call|>, its values JSON's
# but for strings between <|"|> quotes and bare object keys (tokenizer.py keeps these markers)
CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
GEMMA_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
# Any Gemma 4 value, for an argument whose schema the grammar does not spell out (as llama.cpp holds them all)
GEMMA_VALUE = """
gvalue: gstring | gdict | garray | GSCALAR
gstring: <|"|> GTEXT? <|"|>
gdict: "{" (GKEY ":" gvalue ("," GKEY ":" gvalue)*)? "}"
garray: "[" (gvalue ("," gvalue)*)? "]"
GKEY: /[^:{}\[\],<]+/
GTEXT: /[\\s\\S]+/
GSCALAR: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null/"""
# LFM2's calls: a Python list of calls by keyword, `[name(key="text", n=3), ...]`, between its markers
PY_OPEN, PY_CLOSE = LFM_MARKERS
# Where a bare JSON call starts: an answer that opens with {"name" (or a list of such), the grammar
# taking over at its brace (engine.py's grammar_trigger: a pattern's group).
JSON_CALL = re.compile(r'^\s*((?:\[\s*)?\{\s*"name")')
# Where a harmony call starts: a recipient `functions.NAME` in a message's header (after the role or
# the channel; each marker is a special token, so no message's text can hold one).
HARMONY_CALL = re.compile(r"(?:<\|start\|>assistant|<\|channel\|>[a-z]+) to=functions\.")
HARMONY_CALL_OR_FINAL = re.compile(f"{HARMONY_CALL.pattern}|{re.escape(FINAL)}")  # (with response_format)
# An XML string argument: raw text up to its closing tag (no "</" inside), the tag with it
RAW_TEXT = r"/([^<]|<[^\/])*/"
RAW_ARGUMENT = r"/([^<]|<[^\/])*\n<\/parameter>\n/"

# For a template without tools: the hermes format, which many instruction-tuned models have seen.
SYSTEM_PROMPT = """You can call functions to help answer. Their signatures, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with one block per call and nothing else:
<tool_call>
{{"name": <function name>, "arguments": <the arguments as a JSON object>}}
</tool_call>
Each result comes back in <tool_response></tool_response> tags. Answer in plain text when no call is needed."""


def closed(schema: dict) -> dict:
    """A function's parameters, with no arguments beyond those it names unless it says otherwise:
    JSON Schema's default (any other key allowed) lets a model invent arguments that no function
    takes (OpenAI's strict mode wants every object closed too)."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def takes_system(tokenizer) -> bool:
    """Whether the chat template writes a system message rather than refusing it."""
    try:
        tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        return True
    except ValueError:
        return False


def new_call_id(short: bool = False) -> str:
    """OpenAI's form, or 9 letters and digits where the template takes no other (Mistral's)."""
    return uuid.uuid4().hex[:9] if short else "call_" + uuid.uuid4().hex[:24]


class ToolsError(ValueError):
    """A fault in a request's tools or tool_choice; param names which of the two."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def read_tool_list(tools) -> list:
    """OpenAI's `tools` -> the same entries, checked; a ValueError naming the first fault."""
    if not isinstance(tools, list) or not tools:
        raise ToolsError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects",
                         "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise ToolsError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with "
                             "a name of 1-64 letters, digits, _ . or -", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise ToolsError(f"tools[{i}].function.description must be a string", "tools")
        if fn["name"] in names:
            raise ToolsError(f"tools[{i}]: the name {fn['name']!r} is given twice", "tools")
        names.add(fn["name"])
    return tools


@dataclass
class Tools:
    """One request's tools: how they enter the prompt, the grammar of its answer, how it is read."""
    specs: list            # OpenAI's tool entries
    choice: str            # "auto", "required", or the one function's name that must be called
    parallel: bool         # more than one call in an answer
    native: bool           # the chat template takes `tools`
    style: str             # HERMES, XML, JSON, HARMONY, GEMMA4 or PYTHON
    arguments_key: str = "arguments"
    system: bool = True    # the chat template takes a system message (Gemma 2's refuses one)
    short_ids: bool = False  # call ids of 9 characters: Mistral's templates refuse any other
    # PYTHON: the Lark of its call markers as this tokenizer writes them (special tokens or text)
    markers: tuple = ("", "")
    schemas: dict = field(init=False)  # function name -> its parameters' schema

    def __post_init__(self):
        self.schemas = {t["function"]["name"]: closed(t["function"].get("parameters") or {"type": "object"})
                        for t in self.specs}

    @classmethod
    def read(cls, tools, tool_choice, parallel: bool, tokenizer) -> Optional["Tools"]:
        """The request's fields -> Tools, or None where no tool may be called (none given, or
        tool_choice "none"). ValueError naming the fault."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise ToolsError("'tool_choice' needs 'tools'", "tool_choice")
            return None
        specs = read_tool_list(tools)
        if tool_choice in (None, "auto", "required"):
            choice = tool_choice or "auto"
        elif tool_choice == "none":
            return None
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
                isinstance(tool_choice.get("function"), dict):
            choice = tool_choice["function"].get("name")
            if choice not in {t["function"]["name"] for t in specs}:
                raise ToolsError(f"'tool_choice' names the function {choice!r}, which is not among 'tools'",
                                 "tool_choice")
        else:
            raise ToolsError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        native, style = tokenizer.chat_template_takes("tools"), call_style(tokenizer)
        key = "parameters" if style == JSON and '"parameters"' in tokenizer.chat_template else "arguments"
        markers = tuple(lark_literal(tokenizer, m) for m in LFM_MARKERS) if style == PYTHON else ("", "")
        return cls(specs, choice, parallel, native, style, key, native or takes_system(tokenizer),
                   "[TOOL_CALLS]" in tokenizer.chat_template, markers)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def call_tags(self) -> tuple:
        """The tags a call's text stands between (those of the tagged styles)."""
        return {GEMMA4: (CALL_OPEN, CALL_CLOSE), PYTHON: (PY_OPEN, PY_CLOSE)}.get(self.style, (OPEN, CLOSE))

    # -- the prompt --------------------------------------------------------------------------

    @property
    def template_tools(self) -> Optional[list]:
        return self.specs if self.native else None

    def messages(self, messages: list) -> list:
        """The conversation as this template should see it (see template_messages), the tools in a
        system message where the template takes none."""
        messages = template_messages(messages, self.native, self.style == PYTHON)
        if self.native:
            return messages
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.specs)
        prompt = SYSTEM_PROMPT.format(tools=listing)
        first = messages[0] if messages else {}
        if first.get("role") == "system":
            return [{**first, "content": first["content"] + "\n\n" + prompt}, *messages[1:]]
        if first.get("role") == "user" and not self.system:  # before the question, as Gemma 3 puts a system text
            return [{**first, "content": prompt + "\n\n" + first["content"]}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    # -- the answer's grammar ----------------------------------------------------------------

    def call_schema(self, names: list) -> dict:
        """One call to one of `names`, as the model writes it."""
        options = [{"type": "object", "properties": {"name": {"const": n}, self.arguments_key: self.schemas[n]},
                    "required": ["name", self.arguments_key], "additionalProperties": False} for n in names]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": {"whitespace_pattern": WHITESPACE}}

    def grammar(self, answer_schema: Optional[dict] = None, thought: str = "") -> tuple:
        """-> (a Lark grammar for llguidance, or None where the answer is free; the text that starts
        it, or None where it holds from the first token): Request's grammar and grammar_trigger.
        answer_schema: response_format's, which an answer without calls follows; thought: the rules of
        the thinking that an answer held from its first token opens with (Reasoning.thought_rules)."""
        names = [self.choice] if self.forced and self.choice != "required" else list(self.schemas)
        answer = "" if answer_schema is None else "\nanswer: %json " + json.dumps(
            {**answer_schema, "x-guidance": {"whitespace_pattern": WHITESPACE}}, ensure_ascii=False)
        if self.style == HARMONY:  # a call is a message whose header names it: held from there, forced or not
            if answer:  # and the final channel's answer, held to response_format's schema from its message on
                return lark_grammar(f"start: call | answer\n{self.harmony_rules(names)}{answer}"), HARMONY_CALL_OR_FINAL
            return lark_grammar(f"start: call\n{self.harmony_rules(names)}"), HARMONY_CALL
        head, thought = ("thought ", "\n" + thought) if thought else ("", "")

        def held(body: str, rules: str) -> tuple:  # from the first token, after the thinking
            return lark_grammar(f"start: {head}{body}{rules}{answer}{thought}"), None
        many = self.parallel and self.choice in ("auto", "required")
        if self.style == GEMMA4:
            calls, rules = f"call{' (<|tool_call> call)*' if many else ''}", "\n" + self.gemma4_rules(names)
            if self.forced:
                return held(f"<|tool_call> {calls}", rules)
            if answer:  # calls, or an answer that follows the schema
                return held(f"(<|tool_call> {calls} | answer)", rules)
            return lark_grammar(f"start: {calls}{rules}"), CALL_OPEN  # held from <|tool_call> on
        if self.style == PYTHON:  # one list of calls between the markers
            opening, closing = self.markers
            more = ' ("," " "? call)*' if many else ""
            calls = f'"[" call{more} "]" {closing}'
            rules = "\n" + self.python_rules(names)
            if self.forced:
                return held(f"{opening} {calls}", rules)
            if answer:
                return held(f"({opening} {calls} | answer)", rules)
            return lark_grammar(f"start: {calls}{rules}"), PY_OPEN  # held from the opening marker on
        call, rules = f"%json {json.dumps(self.call_schema(names), ensure_ascii=False)}", ""
        if self.style == XML:
            call, rules = "function", self.xml_rules(names)
        if self.style == JSON:  # the answer is the call (Llama 3.x), or a list of calls (Mistral)
            listed = '"[" WS call ("," WS call)* WS "]"' if many else '"[" WS call WS "]"'
            shape = f"\ncalls: call | {listed}\ncall: {call}\nWS: /[ \\t\\n]{{0,4}}/"
            if self.forced:
                return held("calls", shape)
            if answer:
                return held("(calls | answer)", shape)
            return lark_grammar(f"start: calls{shape}"), JSON_CALL
        calls = 'call ("\\n" call)*' if many else "call"
        block = f'\ncall: "{OPEN}\\n" {call} "\\n{CLOSE}"{rules}'
        if self.forced:
            return held(calls, block)
        if answer:
            return held(f"({calls} | answer)", block)
        # Free text until the model writes the tag (the engine starts the grammar there, as
        # llama.cpp's lazy grammars do), then calls held to the schemas, and nothing after them.
        rest = f'start: body (WS "{OPEN}" body)*' if many else "start: body"
        return lark_grammar(f'{rest}\nbody: WS {call} WS "{CLOSE}"\nWS: /[ \\t\\n]{{0,4}}/{rules}'), OPEN

    def xml_rules(self, names: list) -> str:
        """Lark rules of an XML call to one of `names` (rule `function`): its arguments in the schema's
        order, the required ones always, a string one as raw text (held to its length and pattern),
        any other as JSON of its schema."""
        rules = ["function: " + " | ".join(f"function{k}" for k in range(len(names)))]
        for k, name in enumerate(names):
            schema = self.schemas[name]
            required, parts = set(schema.get("required") or ()), []
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                end = "\n</parameter>\n"
                if not is_string(sub):
                    value = f'%json {json.dumps(sub, ensure_ascii=False)} {json.dumps(end)}'
                elif "enum" in sub:
                    value = "(" + " | ".join(json.dumps(v + end, ensure_ascii=False) for v in sub["enum"]) + ")"
                elif bounds := string_bounds(sub):  # the raw text within its bounds, the closing tag after it
                    value = f"VALUE{k}_{j}"
                    rules += [f"{value}: TEXT{k}_{j} {json.dumps(end)}", f"TEXT{k}_{j}: {RAW_TEXT} & {bounds}"]
                else:
                    value = RAW_ARGUMENT
                rules.append(f"argument{k}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}")
                parts.append(f"argument{k}_{j}" + ("" if key in required else "?"))
            if not schema.get("properties") and schema.get("additionalProperties", True) is not False:
                parts.append(f'("<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {RAW_ARGUMENT})*')  # any arguments
            head = json.dumps(f"{FUNCTION}{name}>\n")
            rules.append(f'function{k}: {head} {" ".join(parts)} "</function>"')
        return "\n" + "\n".join(rules)

    def python_rules(self, names: list) -> str:
        """Lark rules of an LFM2 call (rule `call`) to one of `names`: `name(key=value, ...)`, its
        arguments by keyword in the schema's order, the required ones always, each value JSON of its
        schema (a JSON string is a Python one; true, false and null are read as Python's)."""
        rules = ["call: " + " | ".join(f"function{k}" for k in range(len(names)))]
        for k, name in enumerate(names):
            schema, items = self.schemas[name], []
            required = set(schema.get("required") or ())
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                rules.append(f"argument{k}_{j}: {json.dumps(key + '=')} %json {json.dumps(sub, ensure_ascii=False)}")
                items.append((f"argument{k}_{j}", key in required))
            if not schema.get("properties") and schema.get("additionalProperties", True) is not False:
                items.append(('PKEY "=" pvalue ("," " "? PKEY "=" pvalue)*', False))  # any arguments
            rules.append(f'function{k}: {json.dumps(name + "(")} {in_order(items, SPACED) or ""} ")"')
        return "\n".join(rules) + '\nPKEY: /[A-Za-z_][A-Za-z0-9_]*/\npvalue: %json {}'

    def harmony_rules(self, names: list) -> str:
        """Lark rules of a harmony call (rule `call`) from its recipient's name on: the name (one of
        `names`), the rest of its header (a channel, `<|constrain|>json`), the arguments as JSON of its
        schema. The markers are special tokens, written as llguidance writes them."""
        calls = [f"{json.dumps(name)} head <|message|> %json "
                 + json.dumps({**self.schemas[name], "x-guidance": {"whitespace_pattern": WHITESPACE}},
                              ensure_ascii=False) for name in names]
        return ("call: " + " | ".join(calls) + "\nhead: WORDS? (<|channel|> WORDS)? (<|constrain|> WORDS)?"
                "\nWORDS: /[ A-Za-z]{1,24}/")

    def gemma4_rules(self, names: list) -> str:
        """Lark rules of a Gemma 4 call (rule `call`, after <|tool_call>) to one of `names`: its arguments
        by name (as its template writes them), the required ones always; a string as text between
        quotes (held to its enum, length and pattern), a number, boolean or null as JSON of its schema,
        anything else as any Gemma 4 value."""
        rules = ["call: (" + " | ".join(f"function{k}" for k in range(len(names))) + ") <tool_call|>"]
        for k, name in enumerate(names):
            schema, items = self.schemas[name], []
            required = set(schema.get("required") or ())
            for j, (key, sub) in enumerate(sorted((schema.get("properties") or {}).items())):
                if is_string(sub):  # (the quotes are special tokens: no text runs into them)
                    if "enum" in sub:
                        text = " | ".join(json.dumps(v, ensure_ascii=False) for v in sub["enum"])
                    elif bounds := string_bounds(sub):
                        text = f"TEXT{k}_{j}"
                        rules.append(f"{text}: /[\\s\\S]*/ & {bounds}")
                    else:
                        text = "GTEXT?"
                    value = f"<|\"|> ({text}) <|\"|>"
                elif sub.get("type") in ("number", "integer", "boolean", "null") or "const" in sub or \
                        "enum" in sub and all(not isinstance(v, (str, list, dict)) for v in sub["enum"]):
                    value = f"%json {json.dumps(sub, ensure_ascii=False)}"
                else:
                    value = "gvalue"
                rules.append(f"argument{k}_{j}: {json.dumps(key + ':')} {value}")
                items.append((f"argument{k}_{j}", key in required))
            if not schema.get("properties") and schema.get("additionalProperties", True) is not False:
                items.append(('GKEY ":" gvalue ("," GKEY ":" gvalue)*', False))  # any arguments
            rules.append(f'function{k}: {json.dumps(f"call:{name}{{")} {in_order(items) or ""} "}}"')
        return "\n".join(rules) + GEMMA_VALUE

    # -- reading the answer ------------------------------------------------------------------

    def parse(self, text: str) -> tuple:
        """An answer -> (its text outside the calls, the calls as OpenAI's tool_calls entries).
        A call that does not parse or names no tool leaves the whole answer as text."""
        found = (self._tagged(text) if self.style in (HERMES, XML, GEMMA4, PYTHON) else self._harmony(text)
                 if self.style == HARMONY else self._json(text))
        if found is None:
            return text, []
        outside, raw = found
        calls = []
        for obj in raw:
            call = self._call(obj)
            if call is None:
                return text, []
            calls.append(call)
        if not self.parallel:
            calls = calls[:1]
        return outside, calls

    def _tagged(self, text: str) -> Optional[tuple]:
        """Calls between tags: hermes' JSON or Qwen3.5's XML in <tool_call>, Gemma 4's in <|tool_call>,
        LFM2's list of them in <|tool_call_start|>."""
        opening, closing = self.call_tags
        read = {HERMES: json.loads, XML: self._xml_call, GEMMA4: gemma_call, PYTHON: python_calls}[self.style]
        blocks, outside, at = [], [], 0
        while (i := text.find(opening, at)) >= 0:
            outside.append(text[at:i])
            j = text.find(closing, i)
            try:
                found = read(text[i + len(opening): j if j >= 0 else len(text)])
                blocks += found if self.style == PYTHON else [found]
            except ValueError:  # (json's errors are ValueErrors too)
                if j >= 0:
                    return None
                # An unclosed call that does not parse was cut off (max_tokens): the calls before it stand.
            at = len(text) if j < 0 else j + len(closing)
        if not blocks:
            return None
        outside.append(text[at:])
        return "".join(outside), blocks

    def _xml_call(self, body: str) -> dict:
        """`<function=NAME>` and its `<parameter=KEY>`s -> {"name", "arguments"}; a string argument
        (by its schema) as written, another as JSON. JSONDecodeError where it is not such a call."""
        call = re.fullmatch(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", body, re.S)
        if call is None:
            raise json.JSONDecodeError("not an XML tool call", body, 0)
        properties = (self.schemas.get(call[1]) or {}).get("properties") or {}
        arguments = {}
        for key, value in re.findall(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", call[2], re.S):
            if not is_string(properties.get(key, {"type": "string"})):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    pass  # as text: where it is no JSON, the schema's check tells the client
            arguments[key] = value
        return {"name": call[1], "arguments": arguments}

    def _harmony(self, text: str) -> Optional[tuple]:
        """reasoning.Harmony's answer text: each call a message from <|start|> on, its recipient
        `functions.NAME` in the header, its arguments the message."""
        calls, outside = [], []
        for k, message in enumerate(text.split(START)):
            head, sep, body = message.partition(MESSAGE)
            recipient = re.search(r"\bto=functions\.([^\s<]+)", head) if k and sep else None
            if recipient is None:
                outside.append(message if k == 0 else START + message)
                continue
            try:
                calls.append({"name": recipient.group(1), "arguments": json.loads(body)})
            except json.JSONDecodeError:
                return None
        return ("".join(outside), calls) if calls else None

    def _json(self, text: str) -> Optional[tuple]:
        body = text.strip()
        if not body.startswith(("{", "[")):
            return None
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        return "", obj if isinstance(obj, list) else [obj]

    def _call(self, obj) -> Optional[dict]:
        if not isinstance(obj, dict) or obj.get("name") not in self.schemas:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return {"id": new_call_id(self.short_ids), "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolStream:
    """A streamed answer's text as the client may see it while it comes: everything before a place
    where a call may begin; the rest, and the calls, once the answer is complete."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.shown = tools, "", 0

    def feed(self, delta: str) -> str:
        """More of the answer -> the part of the text that may be shown now."""
        self.text += delta
        end = max(self._known_text(), self.shown)
        out, self.shown = self.text[self.shown:end], end
        return out

    def _known_text(self) -> int:
        """How much of the answer is known to be text, not a call."""
        if self.tools.forced:
            return 0
        if self.tools.style in (HARMONY, GEMMA4):  # a call opens with a token of its own
            i = self.text.find(START if self.tools.style == HARMONY else CALL_OPEN, self.shown)
            return len(self.text) if i < 0 else i
        if self.tools.style == JSON:  # a call is the whole answer: its first character tells
            head = self.text.lstrip()
            return 0 if self.shown == 0 and (not head or head[0] in "{[") else len(self.text)
        opening = self.tools.call_tags[0]
        if (i := self.text.find(opening, self.shown)) >= 0:  # nothing shown is a tag's start: look past it
            return i
        for k in range(min(len(opening) - 1, len(self.text)), 0, -1):  # a tail that may be the tag's start
            if self.text.endswith(opening[:k]):
                return len(self.text) - k
        return len(self.text)

    def finish(self) -> tuple:
        """-> (the text not shown yet, the calls)."""
        outside, calls = self.tools.parse(self.text)
        if not calls:
            return self.text[self.shown:], []
        return outside[self.shown:], calls


def is_string(schema: dict) -> bool:
    """Whether an argument's schema admits strings only (an XML call writes it as raw text)."""
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return kind == "string" or kind == ["string"]


def string_bounds(schema: dict) -> str:
    """A string argument's minLength, maxLength and pattern as Lark regexes that its whole text must
    each match ("" where it has none)."""
    bounds = []
    if "minLength" in schema or "maxLength" in schema:
        bounds.append(f"/[\\s\\S]{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}/")
    if "pattern" in schema:
        bounds.append(f"/{pattern_regex(schema['pattern'])}/")
    return " & ".join(bounds)


SPACED = '"," " "?'  # LFM2's separator of arguments: a comma, a space after it or not


def in_order(items: list, comma: str = '","') -> Optional[str]:
    """A Lark expression of (item, required) pairs in their order, joined by commas, the optional
    ones left out or not (None: nothing to write)."""
    if not items:
        return None
    (item, required), rest = items[0], items[1:]
    after = " ".join(f'({comma} {x})' + ("" if r else "?") for x, r in rest)
    written = f"{item} {after}".strip()
    if required:
        return written
    skipped = in_order(rest, comma)
    return f"({written} | {skipped})" if skipped else f"({written})?"


def python_calls(body: str) -> list:
    """LFM2's `[name(key=value, ...), ...]` -> [{"name", "arguments"}], the values Python's literals or
    JSON's (true, false, null); ValueError where it is no such list."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not a list of Python calls") from None
    if not isinstance(tree, ast.List) or not all(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args and
            all(k.arg is not None for k in c.keywords) for c in tree.elts):
        raise ValueError("not a list of Python calls by keyword")
    return [{"name": c.func.id, "arguments": {k.arg: python_value(k.value) for k in c.keywords}}
            for c in tree.elts]


PYTHON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def python_value(node: ast.AST):
    """A literal's node -> its value (JSON's names for True, False and None too); ValueError otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in PYTHON_NAMES:
        return PYTHON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [python_value(x) for x in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {python_value(k): python_value(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def python_call_text(calls: list) -> str:
    """Calls (name, arguments) as LFM2 writes them: `<|tool_call_start|>[name(key="text", n=3)]<|tool_call_end|>`
    (strings as JSON's, which Python reads alike; booleans and None as Python's)."""
    def literal(v):
        if isinstance(v, bool) or v is None:
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(map(literal, v)) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{literal(str(k))}: {literal(x)}" for k, x in v.items()) + "}"
        return json.dumps(v, ensure_ascii=False)
    written = [f"{name}({', '.join(f'{k}={literal(v)}' for k, v in args.items())})" for name, args in calls]
    return f"{PY_OPEN}[{', '.join(written)}]{PY_CLOSE}"


def gemma_call(body: str) -> dict:
    """Gemma 4's `call:NAME{...}` -> {"name", "arguments"}; ValueError where it is no such call."""
    call = re.match(r"\s*call:([^{\s]+)(?=\{)", body)
    if call is None:
        raise ValueError("not a Gemma 4 tool call")
    arguments, end = gemma_value(body, call.end())
    if body[end:].strip() or not isinstance(arguments, dict):
        raise ValueError("not a Gemma 4 tool call")
    return {"name": call[1], "arguments": arguments}


def gemma_value(text: str, at: int = 0) -> tuple:
    """Gemma 4's value at text[at:] -> (the value, where it ends). ValueError where it is none."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith(("{", "["), at):
        closing, items, at = "}" if text[at] == "{" else "]", [], at + 1
        while True:
            while at < len(text) and text[at] in " \n,":
                at += 1
            if text.startswith(closing, at):
                return (dict(items) if closing == "}" else items), at + 1
            if closing == "}":
                colon = text.find(":", at)
                if colon < 0:
                    raise ValueError("a key without a value")
                key = text[at:colon].strip()
                value, at = gemma_value(text, colon + 1)
                items.append((key[len(QUOTE):-len(QUOTE)] if key.startswith(QUOTE) else key, value))
            else:
                value, at = gemma_value(text, at)
                items.append(value)
    scalar = GEMMA_SCALAR.match(text, at)
    if scalar is None:
        raise ValueError(f"no value at {text[at:at + 20]!r}")
    return json.loads(scalar.group()), scalar.end()


def hermes_call(name: str, arguments: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def call_style(tokenizer) -> str:
    """How this tokenizer's chat template has the model call tools (the module's docstring)."""
    template, native = tokenizer.chat_template, tokenizer.chat_template_takes("tools")
    return (HARMONY if native and CHANNEL in template else GEMMA4 if native and CALL_OPEN in template else
            XML if native and FUNCTION in template else PYTHON if native and LFM_TOOLS in template else
            HERMES if not native or OPEN in template else JSON)


def template_messages(messages: list, native: bool, python: bool = False) -> list:
    """Checked OpenAI messages -> what a chat template reads. A template that takes tools gets the
    calls as transformers documents them (arguments as objects) and the results in their own role;
    one that does not gets the calls as hermes text in the assistant's turn and the results as a
    user turn (consecutive results, and a user message after them, in one). python: an LFM2 template,
    which writes an assistant's content alone: the calls as its text, after the content."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [(c, json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
            if python:
                text = python_call_text([(c["function"]["name"], args) for c, args in calls])
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = (m.get("content") or "") + text
            elif native:
                m = {**m, "content": m.get("content") or "", "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": args}} for c, args in calls]}
            else:
                text = "\n".join(hermes_call(c["function"]["name"], args) for c, args in calls)
                m = {"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), text]))}
        elif m["role"] == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        if not native and m["role"] == "user" and out and out[-1]["role"] == "user" and \
                out[-1]["content"].endswith("</tool_response>"):
            # One user turn for the results and what follows them: templates that want turns to
            # alternate (Gemma's) refuse two in a row.
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
            continue
        out.append(m)
    return out


def read_messages(messages: list) -> list:
    """OpenAI's chat messages -> what the templating reads: {"role", "content"} with the text parts
    joined, "developer" as "system", an assistant's tool_calls checked (arguments a JSON object's
    text) and reasoning_content kept (also as thinking), a tool result with the name of the function it answers.
    ValueError naming the fault."""
    out, names = [], {}  # tool call id -> its function's name, which some templates write beside a result
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] must be an object with a role of system, developer, user, assistant "
                             "or tool")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) and not (calls and content is None):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        thought = m.get("reasoning_content") if role == "assistant" else None
        if thought is not None and not isinstance(thought, str):
            raise ValueError(f"messages[{i}].reasoning_content must be a string")
        if calls:
            calls = read_calls(calls, f"messages[{i}].tool_calls")
            names.update((c["id"], c["function"]["name"]) for c in calls)
            out.append({"role": role, "content": content, "tool_calls": calls})
        elif role == "tool":
            call_id = m.get("tool_call_id", "")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_call_id must be a string")
            out.append({"role": role, "content": content, "tool_call_id": call_id, "name": names.get(call_id, "")})
        else:
            out.append({"role": role, "content": content})
        if thought is not None:  # a thinking model's earlier thought, which its template may write back
            out[-1]["reasoning_content"] = thought  # Qwen3's name for it
            out[-1]["thinking"] = thought  # gpt-oss's, Ministral 3's and DeepSeek-V3.2's
    return out


def read_calls(calls, where: str) -> list:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ValueError(f'{where}: each must be {{"id", "type": "function", "function": {{"name", "arguments"}}}} '
                             "with the arguments as a JSON string")
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise ValueError(f"{where}: the arguments of {fn['name']!r} are not a JSON object's text")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def encode_conversation(tokenizer, messages: list, tools: Optional[Tools] = None,
                        variables: Optional[dict] = None) -> list:
    """Messages (read_messages') -> prompt token ids, with the tools that may be called (None: none,
    though the conversation may hold earlier calls and their results) and the template's own
    variables (chat_template_kwargs)."""
    if tools is not None:
        return tokenizer.encode_chat(tools.messages(messages), tools=tools.template_tools, variables=variables)
    return tokenizer.encode_chat(template_messages(messages, tokenizer.chat_template_takes("tools"),
                                                   call_style(tokenizer) == PYTHON), variables=variables)
