"""Tool calling (tools.py; the server's `tools` / `tool_choice`): the prompt as transformers renders
the same template with the same tools, the calls held to the tools' schemas and read back, the
text streamed before a call; SmolLM2 calls the right tool; the official client end to end."""
import functools
import json
import shutil

import pytest
import torch

from conftest import chat_checkpoint, set_chat_template
from decode import generate
from engine import Engine, Request
from load import load_model
from reasoning import THOUGHT_CHANNEL, Reasoning
from tokenizer import load_tokenizer
from tools import JSON, JSON_CALL, SYSTEM_PROMPT, XML, Tools, ToolStream, encode_conversation, read_messages

# Templates written for these tests in the two ways models are taught to call tools: hermes tags
# (Qwen2.5 / Qwen3, Hermes) and a bare JSON object with "parameters" (Llama 3.x); and one that
# knows no tools (as SmolLM2's).
HERMES_TEMPLATE = """{%- if tools %}system: {% if messages[0].role == 'system' %}{{ messages[0].content }} {% endif %}Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as <tool_call>
{"name": ..., "arguments": ...}
</tool_call>
{% elif messages[0].role == 'system' %}system: {{ messages[0].content }}
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}{{ m.role }}: {{ m.content }}
{% elif m.role == 'assistant' %}assistant: {{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif m.role == 'tool' %}tool ({{ m.name }}): {{ m.content }}
{% endif %}
{%- endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""

JSON_TEMPLATE = """{%- if tools %}system: Answer a call as {"name": function name, "parameters": its arguments}. Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}assistant: {"name": "{{ m.tool_calls[0].function.name }}", "parameters": {{ m.tool_calls[0].function.arguments | tojson }}}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}
{%- endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""

# Qwen3.5's way (Qwen3-Coder's too): <function=NAME> and a <parameter=KEY> element per argument, a string
# as its text and any other value as JSON, written as Qwen3.5's chat template writes past calls.
XML_TEMPLATE = """{%- if tools %}system: Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}assistant: {{ m.content }}
{%- for c in m.tool_calls or [] %}{{ '<tool_call>\n<function=' + c.function.name + '>\n' }}
{%- for key, value in c.function.arguments | items %}{{ '<parameter=' + key + '>\n' }}
{{- value | string if value is string else value | tojson }}{{ '\n</parameter>\n' }}{% endfor %}
{{- '</function>\n</tool_call>' }}{% endfor %}
{% elif m.role == 'tool' %}tool ({{ m.name }}): {{ m.content }}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}
{%- endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""

# Gemma 4's way, in special tokens: <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|>
# quotes, keys bare; results as <|tool_response> blocks; its thought channel closed unless it thinks.
GEMMA4_TEMPLATE = (
    "{% macro arg(v) %}{% if v is string %}<|\"|>{{ v }}<|\"|>{% elif v is mapping %}{{ '{' }}"
    "{% for k, x in v | dictsort %}{{ k }}:{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}}"
    "{% elif v is sequence %}[{% for x in v %}{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}]"
    "{% else %}{{ v | tojson }}{% endif %}{% endmacro %}"
    "{% if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:{{ t.function.name }}"
    "{description:<|\"|>{{ t.function.description }}<|\"|>}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
    "<|tool_response>response:{{ m.name }}{value:<|\"|>{{ m.content }}<|\"|>}<tool_response|>"
    "{% else %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ '{' }}"
    "{% for k, v in c.function.arguments | dictsort %}{{ k }}:{{ arg(v) }}{% if not loop.last %},{% endif %}"
    "{% endfor %}}<tool_call|>{% endfor %}"
    "{{ m.content or '' }}<turn|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|turn>model\n"
    "{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}{% endif %}")
GEMMA4_MARKERS = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                  "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>"]

# LFM2's way: the tools listed in the system turn after "List of tools:", an assistant's content written as
# it is (its calls a Python list between <|tool_call_start|> and <|tool_call_end|> in it), results between
# <|tool_response_start|> and <|tool_response_end|>; the markers special tokens.
LFM_TEMPLATE = (
    "{% set ns = namespace(system='') %}{% if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}"
    "{% set messages = messages[1:] %}{% endif %}{% if tools %}{% set ns.system = ns.system + "
    "('\\n' if ns.system else '') + 'List of tools: <|tool_list_start|>[' %}{% for t in tools %}"
    "{% set ns.system = ns.system + (t | tojson) + (', ' if not loop.last else '') %}{% endfor %}"
    "{% set ns.system = ns.system + ']<|tool_list_end|>' %}{% endif %}"
    "{% if ns.system %}<|im_start|>system\n{{ ns.system }}<|im_end|>\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}<|tool_response_start|>{{ m.content }}<|tool_response_end|>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
LFM_MARKERS = ["<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
               "<|tool_response_start|>", "<|tool_response_end|>", "<|im_start|>", "<|im_end|>"]

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")

# Bounded everywhere, so that even a random model's call must end; descriptions with the
# characters jinja2's own tojson would escape.
PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a colour's <number> & shade",
                                         "parameters": {"type": "object", "required": ["color", "n"], "properties": {
                                             "color": {"enum": ["red", "blue"]},
                                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "required": ["k"], "properties": {"k": {"type": "integer", "minimum": 1, "maximum": 3}}}}}

NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "maxLength": 40},
                                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                   "maxItems": 2}}}}}

CONVERSATION = [  # OpenAI's messages: a call, its result, a question after it
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Pick one."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": '{"color": "red", "n": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    {"role": "user", "content": "Again?"},
]


# CONVERSATION's call and result as a template without tools gets them.
CALL_AS_TEXT = {"role": "assistant",
                "content": '<tool_call>\n{"name": "pick", "arguments": {"color": "red", "n": 3}}\n</tool_call>'}
RESULT_AND_QUESTION = {"role": "user", "content": "<tool_response>\nok\n</tool_response>\nAgain?"}


def follows_schema(call: dict) -> bool:
    """A call's arguments checked by hand against PICK or COUNT, independently of the grammar."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "pick":
        return set(args) == {"color", "n"} and args["color"] in ("red", "blue") and \
            type(args["n"]) is int and 0 <= args["n"] <= 9
    return call["function"]["name"] == "count" and set(args) == {"k"} and type(args["k"]) is int and \
        1 <= args["k"] <= 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random model with room for a prompt that lists tools (the tiny tokenizer spells JSON in many tokens)."""
    path = chat_checkpoint(tmp_path_factory.mktemp("tools"), PLAIN_TEMPLATE, context=2048)
    from transformers import AutoTokenizer
    return path, load_model(path), AutoTokenizer.from_pretrained(path.parent / "hf")


def special_checkpoint(root, template: str, markers: list) -> tuple:
    """(checkpoint, model, tokenizer) of the tiny model whose tokenizer has these markers as special tokens
    (one token each, as in the real vocabularies) and this template."""
    from conftest import save_tokenizer
    path = chat_checkpoint(root, template, context=2048)
    hf_tok = save_tokenizer(root / "hf")
    hf_tok.add_special_tokens({"additional_special_tokens": markers})
    hf_tok.save_pretrained(root)
    set_chat_template(root, template)
    return path, load_model(path), load_tokenizer(root)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return special_checkpoint(tmp_path_factory.mktemp("gemma4"), GEMMA4_TEMPLATE, GEMMA4_MARKERS)


@pytest.fixture(scope="module")
def lfm(tmp_path_factory):
    return special_checkpoint(tmp_path_factory.mktemp("lfm"), LFM_TEMPLATE, LFM_MARKERS)


# The checkpoint fixture each template's tests run on (the others: tiny's)
OWN_FIXTURE = {GEMMA4_TEMPLATE: "gemma4", LFM_TEMPLATE: "lfm"}


def tokenizer_with(path, template):
    tokenizer = load_tokenizer(path.parent)
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, JSON_TEMPLATE, XML_TEMPLATE, GEMMA4_TEMPLATE],
                         ids=["hermes", "json", "xml", "gemma4"])
def test_prompt_is_what_transformers_renders(tiny, template):
    """A template that takes tools: the prompt the server builds from OpenAI's messages equals
    transformers' apply_chat_template of the same template, tools and conversation (the calls'
    arguments as objects, as transformers documents them)."""
    path, _, hf_tokenizer = tiny
    tokenizer = tokenizer_with(path, template)
    ours = encode_conversation(tokenizer, read_messages(CONVERSATION), Tools.read([PICK, COUNT], None, True, tokenizer))
    messages = json.loads(json.dumps(CONVERSATION))
    messages[2]["content"] = ""
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"color": "red", "n": 3}
    messages[3]["name"] = "pick"
    theirs = hf_tokenizer.apply_chat_template(messages, tools=[PICK, COUNT], chat_template=template, tokenize=False,
                                              add_generation_prompt=True)
    assert "<number> & shade" in theirs and "colour's" in theirs
    assert ours == tokenizer.encode(theirs, bos=False)


def test_prompt_for_a_template_that_writes_calls_as_content(lfm):
    """LFM2's template takes tools but writes an assistant's content alone: the conversation's call goes in
    as its Python text, what transformers renders from a message holding that text; read back, the same call."""
    from tools import PY_CLOSE, PY_OPEN, python_calls
    _, _, tokenizer = lfm
    from transformers import PreTrainedTokenizerFast
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(lfm[0].parent / "tokenizer.json"),
                                           chat_template=LFM_TEMPLATE)
    tools = Tools.read([PICK, COUNT], None, True, tokenizer)
    assert tools.style == "python"
    ours = encode_conversation(tokenizer, read_messages(CONVERSATION), tools)
    messages = json.loads(json.dumps(CONVERSATION))
    messages[2] = {"role": "assistant", "content": f'{PY_OPEN}[pick(color="red", n=3)]{PY_CLOSE}'}
    theirs = hf_tokenizer.apply_chat_template(messages, tools=[PICK, COUNT], tokenize=False, add_generation_prompt=True)
    assert "List of tools: <|tool_list_start|>[" in theirs and ours == tokenizer.encode(theirs, bos=False)
    assert encode_conversation(tokenizer, read_messages(CONVERSATION)) == tokenizer.encode(
        hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), bos=False)
    nested = {"id": "c", "type": "function", "function": {"name": "note", "arguments": json.dumps(
        {"text": 'a "b"\n', "tags": ["a", None, True, {"x": -1.5}]})}}
    prompt = tokenizer.decode(encode_conversation(tokenizer, read_messages(
        [{"role": "user", "content": "Note it."}, {"role": "assistant", "content": "Sure.", "tool_calls": [nested]}])))
    assert "Sure." + PY_OPEN in prompt
    written = prompt[prompt.index(PY_OPEN) + len(PY_OPEN):prompt.index(PY_CLOSE)]
    assert python_calls(written) == [{"name": "note", "arguments": json.loads(nested["function"]["arguments"])}]


def test_prompt_for_a_template_without_tools(tiny):
    """A template that knows no tools: the tools in the system message, the call as hermes text in
    the assistant's turn, the result as a user turn; rendered by transformers from those messages."""
    path, _, hf_tokenizer = tiny
    tokenizer = tokenizer_with(path, PLAIN_TEMPLATE)
    conversation = read_messages(CONVERSATION)
    ours = encode_conversation(tokenizer, conversation, Tools.read([PICK, COUNT], "auto", True, tokenizer))
    listing = json.dumps(PICK, ensure_ascii=False) + "\n" + json.dumps(COUNT, ensure_ascii=False)
    messages = [{"role": "system", "content": "Be brief.\n\n" + SYSTEM_PROMPT.format(tools=listing)},
                {"role": "user", "content": "Pick one."}, CALL_AS_TEXT, RESULT_AND_QUESTION]
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=PLAIN_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == tokenizer.encode(theirs, bos=False)
    # tool_choice "none": no tools in the prompt, the history still written as text.
    assert Tools.read([PICK], "none", True, tokenizer) is None
    theirs = hf_tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *messages[1:]],
                                              chat_template=PLAIN_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert encode_conversation(tokenizer, conversation) == tokenizer.encode(theirs, bos=False)


def test_prompt_for_a_template_without_a_system_role(tiny):
    """A template that refuses a system message and wants turns to alternate (as Gemma 2's): the
    tools come in the first user message, a result and the question after it in one user turn."""
    path, _, hf_tokenizer = tiny
    template = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer = tokenizer_with(path, template)
    ours = encode_conversation(tokenizer, read_messages(CONVERSATION[1:]), Tools.read([PICK], "auto", True, tokenizer))
    first = SYSTEM_PROMPT.format(tools=json.dumps(PICK, ensure_ascii=False)) + "\n\nPick one."
    messages = [{"role": "user", "content": first}, CALL_AS_TEXT, RESULT_AND_QUESTION]
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)
    assert ours == tokenizer.encode(theirs, bos=False)


def hermes_tools(tokenizer, choice="auto", parallel=True) -> Tools:
    return Tools.read([PICK, COUNT], choice, parallel, tokenizer)


def test_parse_hermes(tiny):
    tools = hermes_tools(tokenizer_with(tiny[0], HERMES_TEMPLATE))
    text = ('Let me see.\n<tool_call>\n{"name": "pick", "arguments": {"color": "red", "n": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "count", "arguments": "{\\"k\\": 2}"}</tool_call>')
    content, calls = tools.parse(text)
    assert content == "Let me see.\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("pick", {"color": "red", "n": 3}), ("count", {"k": 2})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    # Cut off inside a second call (max_tokens): the first stands.
    assert len(tools.parse(text[:-30])[1]) == 1
    # A call that does not parse, or names no tool: the answer is text.
    for bad in ['<tool_call>{"name": "pick", "arguments": {</tool_call>', '<tool_call>{"name": "fly"}</tool_call>',
                '<tool_call>{"name": "pick", "arguments": [1]}</tool_call>', "no call here"]:
        assert tools.parse(bad) == (bad, [])
    # parallel_tool_calls false: one call.
    one = hermes_tools(tokenizer_with(tiny[0], HERMES_TEMPLATE), parallel=False)
    assert len(one.parse(text)[1]) == 1


def test_parse_json_style(tiny):
    tools = Tools.read([PICK, COUNT], "auto", True, tokenizer_with(tiny[0], JSON_TEMPLATE))
    assert tools.style == JSON and tools.arguments_key == "parameters"
    content, [call] = tools.parse(' {"name": "count", "parameters": {"k": 1}}')
    assert call["function"] == {"name": "count", "arguments": '{"k": 1}'} and content == ""
    assert len(tools.parse('[{"name": "count", "arguments": {"k": 1}}, {"name": "pick", "arguments": {}}]')[1]) == 2
    assert tools.parse("The answer is {1}") == ("The answer is {1}", [])


def test_parse_xml(tiny):
    """Qwen3.5's calls: a string argument as its text (newlines and all), the others as JSON (by the
    tool's schema); several calls; a cut-off one after a whole one; what is not such a call is text."""
    tools = Tools.read([PICK, COUNT, NOTE], "auto", True, tokenizer_with(tiny[0], XML_TEMPLATE))
    assert tools.style == XML
    text = ("Let me see.\n<tool_call>\n<function=pick>\n<parameter=color>\nred\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=note>\n"
            "<parameter=text>\n12 < 13,\n\"quoted\"\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
            "</function>\n</tool_call>")
    content, calls = tools.parse(text)
    assert content == "Let me see.\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("pick", {"color": "red", "n": 3}), ("note", {"text": '12 < 13,\n"quoted"', "tags": ["a"]})]
    assert len(tools.parse(text[:-40])[1]) == 1
    for bad in ["<tool_call>\n<function=fly>\n</function>\n</tool_call>", "<tool_call>\n{}\n</tool_call>",
                "no call here"]:
        assert tools.parse(bad) == (bad, [])


def test_parse_gemma4(gemma4):
    """Gemma 4's calls, as the model's tokens decode (its markers kept in the text): strings between
    <|"|> quotes, keys bare, numbers, nested values; several calls; a cut-off one after a whole one;
    what is not such a call is text. Reading a call back and writing it again gives the same text."""
    from tools import CALL_CLOSE, CALL_OPEN, QUOTE, gemma_call
    _, _, tokenizer = gemma4
    tools = Tools.read([PICK, COUNT, NOTE], "auto", True, tokenizer)
    assert tools.style == "gemma4"
    text = ('Let me see.<|tool_call>call:pick{color:<|"|>red<|"|>,n:3}<tool_call|>'
            '<|tool_call>call:note{tags:[<|"|>a<|"|>,{x:-1.5e2,y:null}],text:<|"|>12 < 13,\n"q"<|"|>}<tool_call|>')
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.decode(ids) == text and {tokenizer.token_id(m) for m in (CALL_OPEN, CALL_CLOSE, QUOTE)} <= set(ids)
    content, calls = tools.parse(tokenizer.decode(ids))
    assert content == "Let me see."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("pick", {"color": "red", "n": 3}),
         ("note", {"tags": ["a", {"x": -150.0, "y": None}], "text": '12 < 13,\n"q"'})]
    assert len(tools.parse(text[:-20])[1]) == 1
    for bad in ["<|tool_call>call:fly{}<tool_call|>", "<|tool_call>pick{}<tool_call|>", "<|tool_call>call:pick{n:}"
                "<tool_call|>", "no call here"]:
        assert tools.parse(bad) == (bad, [])
    # A past call as the template writes it into the prompt reads back to the same call.
    call = {"id": "c", "type": "function", "function": {"name": "note", "arguments": '{"text": "a:b", "tags": ["a"]}'}}
    conversation = [{"role": "user", "content": "Note it."},
                    {"role": "assistant", "content": None, "tool_calls": [call]}]
    prompt = tokenizer.decode(encode_conversation(tokenizer, read_messages(conversation), tools))
    written = prompt[prompt.index(CALL_OPEN) + len(CALL_OPEN):prompt.index(CALL_CLOSE)]
    assert gemma_call(written) == {"name": "note", "arguments": {"tags": ["a"], "text": "a:b"}}


def test_parse_python(lfm):
    """LFM2's calls: a Python list of calls by keyword between its markers (special tokens the decoded
    text keeps), values Python's literals or JSON's; text before them is content; what is no such list,
    or names no tool, leaves the answer as text."""
    _, _, tokenizer = lfm
    tools = Tools.read([PICK, COUNT, NOTE], "auto", True, tokenizer)
    text = ('Let me see.<|tool_call_start|>[pick(color="red", n=3), note(text=\'12 < 13,\\n"q"\', '
            'tags=["a", {"x": -1.5e2, "y": null}], ok=True)]<|tool_call_end|>')
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.decode(ids) == text and tokenizer.token_id("<|tool_call_start|>") in ids
    content, calls = tools.parse(tokenizer.decode(ids))
    assert content == "Let me see."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("pick", {"color": "red", "n": 3}),
         ("note", {"text": '12 < 13,\n"q"', "tags": ["a", {"x": -150.0, "y": None}], "ok": True})]
    for bad in ["<|tool_call_start|>[fly()]<|tool_call_end|>", "<|tool_call_start|>[pick('red')]<|tool_call_end|>",
                "<|tool_call_start|>pick(n=1)<|tool_call_end|>", "<|tool_call_start|>[pick(n=f())]<|tool_call_end|>",
                "no call here"]:
        assert tools.parse(bad) == (bad, [])


def test_call_ids_a_mistral_template_takes(tiny):
    """Mistral's templates write [TOOL_CALLS] and refuse a call id that is not 9 characters: the
    calls read back get such ids, and a conversation holding them renders."""
    template = ("{% for m in messages %}{% if m.tool_calls is defined %}[TOOL_CALLS]{% for c in m.tool_calls %}"
                "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
                "length 9!') }}{% endif %}{{ c.function | tojson }}{% endfor %}"
                "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}{{ raise_exception('length 9!') }}"
                "{% endif %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
                "{% else %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
                "{% endif %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer = tokenizer_with(tiny[0], template)
    tools = Tools.read([PICK], "auto", True, tokenizer)
    _, [call] = tools.parse('[{"name": "pick", "arguments": {"color": "red", "n": 1}}]')
    assert len(call["id"]) == 9 and call["id"].isalnum()
    conversation = [{"role": "user", "content": "Pick one."},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
                    {"role": "user", "content": "Again?"}]
    assert "[TOOL_RESULTS]ok" in tokenizer.decode(encode_conversation(tokenizer, read_messages(conversation), tools))


def test_stream_shows_the_text_before_a_call(tiny):
    """Fed a few characters at a time: the text before the call is shown as it comes, nothing of the
    call is, and what is shown plus the rest at the end is the text outside the calls."""
    tools = hermes_tools(tokenizer_with(tiny[0], HERMES_TEMPLATE))
    text = 'Sure <tool thing> here.\n<tool_call>\n{"name": "count", "arguments": {"k": 2}}\n</tool_call>\nBye'
    for step in (1, 3, 7):
        stream = ToolStream(tools)
        shown = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        rest, calls = stream.finish()
        assert "".join(shown) == "Sure <tool thing> here.\n" and rest == "\nBye" and len(calls) == 1
        assert shown[0] == text[:step].split("<")[0]  # text comes out as it arrives; "<t" waits: a tag's start?
    stream = ToolStream(tools)  # a text that only looks like a tag's start at its end
    assert stream.feed("x <tool_ca") == "x " and stream.finish() == ("<tool_ca", [])
    forced = ToolStream(hermes_tools(tokenizer_with(tiny[0], HERMES_TEMPLATE), "required"))
    assert forced.feed("<tool_call>\n{") == ""


def token_ids(tokenizer, text):
    return tokenizer.encode(text, bos=False)


def lazy_grammar_accepts(tokenizer, model):
    """-> accepted(tools, text): whether the tools' lazy grammar, started at <tool_call> (a bare JSON
    call: at the start of the text; Gemma 4's: at <|tool_call>), takes every token of text after it (on
    llguidance's matcher, token by token)."""
    from structured import Constraint, TokenTable
    table = TokenTable(tokenizer, model.config.vocab_size)

    def accepted(tools, text):
        grammar, trigger = tools.grammar()
        assert trigger == {JSON: JSON_CALL, "gemma4": "<|tool_call>", "python": "<|tool_call_start|>"}.get(
            tools.style, "<tool_call>")
        constraint = Constraint(table, grammar)
        for t in token_ids(tokenizer, text):
            if not constraint.allowed("cpu")[t]:
                return False
            constraint.take(t)
        return True
    return accepted


def test_auto_grammar_holds_calls_after_the_tag(tiny):
    """tool_choice auto: the grammar starts where the model writes <tool_call> (engine.py's
    grammar_trigger; tests/test_structured.py: the text before it is the free answer); from there
    each call must name a tool and match its parameters, and nothing but calls follows
    (checked on llguidance's matcher, token by token)."""
    tokenizer = tokenizer_with(tiny[0], HERMES_TEMPLATE)
    accepted = lazy_grammar_accepts(tokenizer, tiny[1])
    call = '\n{"name": "pick", "arguments": {"color": "blue", "n": 7}}\n</tool_call>'
    second = '\n<tool_call>{"name": "count", "arguments": {"k": 2}}</tool_call>'
    tools, one = hermes_tools(tokenizer), hermes_tools(tokenizer, parallel=False)
    assert accepted(tools, call) and accepted(tools, call + second) and accepted(one, call)
    assert not accepted(one, call + second) and not accepted(tools, call + " and then")
    assert not accepted(tools, '\n{"name": "pick", "arguments": {"color": "green", "n": 7}}')
    assert not accepted(tools, '\n{"name": "pick", "arguments": {"color": "red", "n": 7, "x": 1}}')
    assert not accepted(tools, '\n{"name": "fly", "arguments": {}}')


def test_auto_grammar_holds_xml_calls(tiny):
    """The same for Qwen3.5's XML calls: arguments in the schema's order, a string one as raw text up to
    its closing tag, held to its length and pattern (JSON's: found anywhere unless anchored), another as
    JSON of its schema; an optional one may be left out."""
    tokenizer = tokenizer_with(tiny[0], XML_TEMPLATE)
    label = {"type": "function", "function": {"name": "label", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}\\d+$"}, "word": {"type": "string", "pattern": "ok",
                                                                          "minLength": 3}}}}}
    tools = Tools.read([PICK, COUNT, NOTE, label], "auto", True, tokenizer)
    accepted = functools.partial(lazy_grammar_accepts(tokenizer, tiny[1]), tools)
    pick = '\n<function=pick>\n<parameter=color>\nblue\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n'
    note = '\n<function=note>\n<parameter=text>\na < b\nc\n</parameter>\n</function>\n'
    assert accepted(pick + "</tool_call>") and accepted(note + "</tool_call>")
    assert accepted(pick + "</tool_call>\n<tool_call>" + note + "</tool_call>")
    assert not accepted(pick.replace("blue", "green"))
    assert not accepted(pick.replace("7", "12"))
    assert not accepted('\n<function=pick>\n<parameter=n>\n7\n</parameter>\n')  # order, and color is required
    assert not accepted('\n<function=fly>\n')
    assert not accepted(pick + "</tool_call> and then")
    assert accepted(note.replace("a < b\nc", "x" * 40) + "</tool_call>")
    assert not accepted(note.replace("a < b\nc", "x" * 41))  # maxLength 40

    def labelled(code=None, word=None):
        args = [f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (("code", code), ("word", word)) if v is not None]
        return accepted("\n<function=label>\n" + "".join(args) + "</function>\n</tool_call>")
    assert labelled("AB12") and labelled("AB1", "is ok") and labelled(word="ok!") and labelled()
    assert not labelled("ab12") and not labelled("AB") and not labelled("xAB12")
    assert not labelled(word="ok") and not labelled(word="nope")


def test_auto_grammar_holds_bare_json_calls(tiny):
    """Llama 3.x's bare JSON: the grammar takes over where the answer opens with {"name" (the
    trigger's group, from the brace on); from there the answer is one call that names a tool and
    matches its parameters, or with parallel calls a list of them (Mistral's), and nothing after it.
    An answer that opens otherwise, a JSON one included, stays free."""
    tokenizer = tokenizer_with(tiny[0], JSON_TEMPLATE)
    accepted = lazy_grammar_accepts(tokenizer, tiny[1])
    tools, one = (Tools.read([PICK, COUNT], "auto", parallel, tokenizer) for parallel in (True, False))
    pick = '{"name": "pick", "parameters": {"color": "blue", "n": 7}}'
    count = '{"name": "count", "parameters": {"k": 2}}'
    assert accepted(tools, pick) and accepted(one, pick) and accepted(tools, f"[{pick}, {count}]")
    assert accepted(one, f"[{count}]") and not accepted(one, f"[{pick}, {count}]")
    assert not accepted(tools, pick + " and then") and not accepted(tools, pick.replace("blue", "green"))
    assert not accepted(tools, pick.replace("parameters", "arguments"))
    assert not accepted(tools, '{"name": "fly", "parameters": {}}')
    starts = [JSON_CALL.search(text) for text in (" \n" + pick, f"[ {pick}]", '{"answer": 1}', "Sure: " + pick)]
    assert [m and m.start(1) for m in starts] == [2, 0, None, None]


def test_auto_grammar_holds_gemma4_calls(gemma4):
    """Gemma 4's calls from <|tool_call> on: the name, then the arguments by name (as its template writes
    them), a string between quotes (special tokens: any text inside) held to its enum and length, a number
    to its bounds, others any Gemma 4 value; then <|tool_call> again or nothing."""
    _, model, tokenizer = gemma4
    accepted = functools.partial(lazy_grammar_accepts(tokenizer, model), Tools.read([PICK, COUNT, NOTE], "auto", True,
                                                                                   tokenizer))
    pick, note = 'call:pick{color:<|"|>blue<|"|>,n:7}<tool_call|>', 'call:note{text:<|"|>a < b\n}<|"|>}<tool_call|>'
    assert accepted(pick) and accepted(note) and accepted(pick + "<|tool_call>" + note)
    assert accepted('call:note{tags:[<|"|>a<|"|>,{x:1}],text:<|"|><|"|>}<tool_call|>')
    assert not accepted(pick.replace("blue", "green")) and not accepted(pick.replace("7", "12"))
    assert not accepted('call:pick{n:7,color:<|"|>blue<|"|>}') and not accepted("call:pick{n:7}")  # order; required
    assert not accepted(note.replace("a < b\n}", "x" * 41)) and not accepted('call:fly{}')
    assert not accepted(pick + " and then")
    # Forced: calls from the first token, after a thought where the model thinks (its template left it to).
    from structured import Constraint, TokenTable
    table = TokenTable(tokenizer, model.config.vocab_size)
    required = Tools.read([PICK, COUNT], "required", True, tokenizer)

    def forced(text, thinks):
        thought = Reasoning(False, THOUGHT_CHANNEL).thought_rules(tokenizer) if thinks else ""
        constraint = Constraint(table, required.grammar(thought=thought)[0])
        return all(constraint.allowed("cpu")[t] and constraint.take(t)
                   for t in tokenizer.encode(text, bos=False))
    thought = "<|channel>thought\nThe sky.<channel|>"
    assert forced("<|tool_call>" + pick, False) and forced(thought + "<|tool_call>" + pick, True)
    assert forced("<|tool_call>" + pick, True) and not forced(thought + "<|tool_call>" + pick, False)
    assert not forced("Sure." + "<|tool_call>" + pick, True)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize("template, call", [
    (HERMES_TEMPLATE, '<tool_call>\n{"name": "pick", "arguments": {"color": "blue", "n": 7}}\n</tool_call>'),
    (JSON_TEMPLATE, '{"name": "pick", "parameters": {"color": "blue", "n": 7}}'),
    (XML_TEMPLATE, '<tool_call>\n<function=pick>\n<parameter=color>\nblue\n</parameter>\n<parameter=n>\n7\n'
                   '</parameter>\n</function>\n</tool_call>'),
    (GEMMA4_TEMPLATE, '<|tool_call>call:pick{color:<|"|>blue<|"|>,n:7}<tool_call|>'),
    (LFM_TEMPLATE, '<|tool_call_start|>[pick(color="blue", n=7)]<|tool_call_end|>')],
    ids=["hermes", "json", "xml", "gemma4", "python"])
def test_auto_calls_or_an_answer_in_the_response_format(tiny, template, call, request):
    """tool_choice auto with response_format: from the first token the answer is a call, or JSON that
    follows the response's schema, and then the end; free text, an answer outside the schema and a wrong
    call are held back (llguidance's matcher, token by token). A model that thinks may think first, to its closing
    tag (a special token in Gemma 4, text in Qwen3's <think>): where the prompt opened the thinking,
    it must close it."""
    from structured import Constraint, TokenTable
    path, model, _ = request.getfixturevalue(OWN_FIXTURE[template]) if template in OWN_FIXTURE else tiny
    tokenizer = tokenizer_with(path, template)
    table, tools = TokenTable(tokenizer, model.config.vocab_size), Tools.read([PICK, COUNT], "auto", True, tokenizer)

    def accepted(text, thinking=None):
        grammar, trigger = tools.grammar(CITY, thought=thinking.thought_rules(tokenizer) if thinking else "")
        assert trigger is None
        constraint = Constraint(table, grammar)  # every token allowed, and the end after them
        return all(constraint.allowed("cpu")[t] and constraint.take(t) for t in token_ids(tokenizer, text)) and \
            bool(constraint.allowed("cpu")[tokenizer.eos_ids[0]])
    assert accepted(call) and accepted('{"city": "Paris"}')
    assert not accepted('{"town": "Paris"}') and not accepted('{"city": "P' + "a" * 20 + 'ris"}')
    assert not accepted("Paris") and not accepted(call.replace("blue", "green"))
    tags = THOUGHT_CHANNEL if template is GEMMA4_TEMPLATE else ("<think>", "</think>")
    may, opened, closed = Reasoning(False, tags), Reasoning(True, tags), Reasoning(False, tags, closed=True)
    thought = f"{tags[0]}\nA city {{\"b\"}} </thin k> <think>.{tags[1]}\n\n"
    for answer in ('{"city": "Paris"}', call):
        assert accepted(thought + answer, may) and accepted(answer, may) and accepted(answer, closed)
        assert accepted(thought[len(tags[0]):] + answer, opened) and not accepted(answer, opened)
        assert not accepted(thought + answer) and not accepted(thought + answer, closed)
    assert not accepted(thought + "Paris", may) and not accepted(thought + thought + call, may)


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, JSON_TEMPLATE, XML_TEMPLATE, GEMMA4_TEMPLATE, LFM_TEMPLATE,
                                      PLAIN_TEMPLATE], ids=["hermes", "json", "xml", "gemma4", "python", "none"])
def test_forced_calls_follow_the_schemas(tiny, template, request):
    """tool_choice "required" and a named function: a random model's answers, greedy and sampled,
    batched beside a free request (which stays as it was alone), are calls that parse and follow
    the tools' schemas, checked by hand."""
    path, model, _ = request.getfixturevalue(OWN_FIXTURE[template]) if template in OWN_FIXTURE else tiny
    tokenizer = tokenizer_with(path, template)
    required = Tools.read([PICK, COUNT], "required", False, tokenizer)
    named = Tools.read([PICK, COUNT], {"type": "function", "function": {"name": "count"}}, True, tokenizer)
    ids = tokenizer.encode_chat(required.messages([{"role": "user", "content": "Pick one."}]),
                                tools=required.template_tools)
    free = token_ids(tokenizer, "Paris is the capital of")
    requests = [Request(ids, 400, grammar=required.grammar()[0]), Request(ids, 400, grammar=named.grammar()[0]),
                Request(ids, 400, temperature=1.0, seed=5, grammar=required.grammar()[0]), Request(free, 10)]
    results = Engine(model, tokenizer, max_batch_size=4, max_seq_length=2048).generate(requests)
    for tools, out in zip([required, named, required], results):
        content, calls = tools.parse(out.text)
        assert out.finish_reason == "stop" and content.strip() == "" and len(calls) == 1, out.text
        assert follows_schema(calls[0]), calls
    assert tools.parse(results[1].text)[1][0]["function"]["name"] == "count"
    alone = generate(model, torch.tensor(free), 10, eos_ids=tokenizer.eos_ids)[0, len(free):].tolist()
    assert results[3].token_ids == alone[:len(results[3].token_ids)]


def test_real_model_calls_the_right_tool(default_model):
    """SmolLM2 (its template knows no tools: they come in the system message) asked the weather and
    a sum, with tool_choice "required": it picks the right tool and fills in the arguments."""
    from packed_cache import load_with_tokenizer
    model, tokenizer = load_with_tokenizer(default_model, "cpu", torch.float32)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    add = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
    tools = Tools.read([weather, add], "required", False, tokenizer)
    engine = Engine(model, tokenizer, max_batch_size=2, max_seq_length=1024)
    questions = ["What is the weather like in Paris today?", "What is 17 plus 25?"]
    requests = [Request(tokenizer.encode_chat(tools.messages([{"role": "user", "content": q}])), 60,
                        grammar=tools.grammar()[0]) for q in questions]
    calls = [tools.parse(out.text)[1] for out in engine.generate(requests)]
    assert [c[0]["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert "Paris" in json.loads(calls[0][0]["function"]["arguments"])["city"]
    assert json.loads(calls[1][0]["function"]["arguments"]) == {"a": 17, "b": 25}


# ---------------------------------------------------------------------------------------------
# Through the server and the official client

def test_auto_grammar_holds_python_calls(lfm):
    """LFM2's calls from <|tool_call_start|> on: one list of calls by keyword, the arguments in the schema's
    order (the required ones always), each value JSON of its schema, then the closing marker and nothing else."""
    _, model, tokenizer = lfm
    accepted = lazy_grammar_accepts(tokenizer, model)
    tools, one = (Tools.read([PICK, COUNT, NOTE], "auto", parallel, tokenizer) for parallel in (True, False))
    pick, count = 'pick(color="blue", n=7)', "count(k=2)"
    assert accepted(tools, f"[{pick}]<|tool_call_end|>") and accepted(tools, f"[{pick}, {count}]<|tool_call_end|>")
    assert accepted(tools, f"[{pick},{count}]<|tool_call_end|>") and accepted(one, f"[{count}]<|tool_call_end|>")
    assert accepted(tools, '[note(text="x", tags=["a"])]<|tool_call_end|>')
    assert not accepted(one, f"[{pick}, {count}]") and not accepted(tools, f"[{pick}]<|tool_call_end|> and then")
    assert not accepted(tools, f"[{pick.replace('blue', 'green')}]") and not accepted(tools, "[count(k=4)]")
    assert not accepted(tools, '[pick(n=7, color="blue")]') and not accepted(tools, "[pick(n=7)]")  # order; required
    assert not accepted(tools, "[fly()]") and not accepted(tools, '[note(text="' + "x" * 41 + '")]')


@pytest.fixture(scope="module", params=[pytest.param("hermes", marks=pytest.mark.slow),
                                        pytest.param("xml", marks=pytest.mark.slow),
                                        pytest.param("json", marks=pytest.mark.slow),
                                        pytest.param("gemma4", marks=pytest.mark.slow),
                                        pytest.param("python", marks=pytest.mark.slow), "none"])
def tool_server(request, tiny, tmp_path_factory):
    """The server on the tiny model, its template taking tools (hermes, Qwen3.5's XML, Llama's bare JSON,
    Gemma 4's, LFM2's Python calls) or not. The default run keeps the one SmolLM2's template takes (none); the
    server's code is the same for all."""
    from test_server import KEY, start_server, stop_server
    own = {"gemma4": "gemma4", "python": "lfm"}.get(request.param)
    path = request.getfixturevalue(own)[0] if own else tiny[0]
    d = tmp_path_factory.mktemp(f"server-{request.param}")
    for f in path.parent.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    set_chat_template(d, {"hermes": HERMES_TEMPLATE, "xml": XML_TEMPLATE, "json": JSON_TEMPLATE,
                          "gemma4": GEMMA4_TEMPLATE, "python": LFM_TEMPLATE, "none": PLAIN_TEMPLATE}[request.param])
    proc, url = start_server(d / path.name, "--api_key", KEY, "--max_batch_size", "2", "--max_seq_length", "2048",
                             "--model_name", "tiny")
    yield url, d / path.name
    stop_server(proc)


def test_tool_calls_through_the_client(tool_server):
    """The official client, whose pydantic parses each call's arguments: calls held to the tools'
    schemas, streamed or not; a tool's result sent back; with tool_choice "auto" an answer that makes
    no call is the plain generation of the same prompt."""
    from typing import Literal
    import httpx
    import openai
    from pydantic import BaseModel, Field
    from test_server import KEY

    class Pick(BaseModel):  # bounded everywhere: a random model's call must end
        color: Literal["red", "green", "blue"]
        n: int = Field(ge=0, le=9)

    class Count(BaseModel):
        k: int = Field(ge=1, le=3)

    url, checkpoint = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [openai.pydantic_function_tool(Pick), openai.pydantic_function_tool(Count)]
    question = [{"role": "user", "content": "What colour is the sky?"}]
    r = client.chat.completions.parse(model="tiny", messages=question, tools=tools, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=400, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    assert isinstance(message.tool_calls[0].function.parsed_arguments, (Pick, Count))
    assert message.tool_calls[0].id.startswith("call_")

    with client.chat.completions.stream(model="tiny", messages=question, tools=tools, max_tokens=400, seed=3,
                                        tool_choice={"type": "function", "function": {"name": "Count"}}) as stream:
        kinds = {type(event).__name__ for event in stream}
        final = stream.get_final_completion()
    assert "FunctionToolCallArgumentsDoneEvent" in kinds and "ContentDeltaEvent" not in kinds
    assert final.choices[0].finish_reason == "stop"  # OpenAI's reason where tool_choice names the function
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "Count" and isinstance(call.function.parsed_arguments, Count)

    # auto with response_format: a call, or an answer that the response's schema parses.
    class City(BaseModel):
        city: Literal["Paris", "Rome"]
    r = client.chat.completions.parse(model="tiny", messages=question, tools=tools, response_format=City,
                                      parallel_tool_calls=False, max_tokens=400, temperature=0)  # (bounded)
    answer = r.choices[0].message
    assert isinstance(answer.parsed, City) or \
        answer.tool_calls and isinstance(answer.tool_calls[0].function.parsed_arguments, (Pick, Count)), answer

    # The call and its result sent back (test_prompt_*: how the template gets them).
    history = [*question, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "done"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")

    # auto: the text is free until a call opens, so a random model's answer is what it says unconstrained.
    ids = httpx.post(url + "/tokenize", json={"messages": question, "tools": [PICK]},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint.parent)
    alone = generate(model, torch.tensor(ids), 12, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
    alone = tokenizer.decode(alone[:alone.index(0)] if 0 in alone else alone)
    r = client.chat.completions.create(model="tiny", messages=question, tools=[PICK], max_tokens=12, temperature=0)
    assert r.choices[0].message.content == alone and not r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model="tiny", messages=question, tools=[PICK], max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone


def test_function_calls_through_the_responses_api(tool_server):
    """/v1/responses with function tools: a forced call, whole and streamed, has arguments that
    follow the tool's schema; the call and its output sent back as input items give what chat
    completions gives for the same conversation."""
    import openai
    from test_server import KEY
    url, _ = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [{"type": "function", **PICK["function"]}, {"type": "function", **COUNT["function"]}]
    question = "What colour is the sky?"
    r = client.responses.create(model="tiny", input=question, tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=400, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert follows_schema({"function": {"name": call.name, "arguments": call.arguments}})
    with client.responses.stream(model="tiny", input=question, tools=tools, max_output_tokens=400, temperature=0,
                                 tool_choice={"type": "function", "name": "count"}) as stream:
        kinds = {event.type for event in stream}
        [streamed] = stream.get_final_response().output
    assert "response.function_call_arguments.done" in kinds and streamed.name == "count"
    assert follows_schema({"function": {"name": streamed.name, "arguments": streamed.arguments}})

    items = [{"role": "user", "content": question}, call, {"type": "function_call_output", "call_id": call.call_id,
                                                           "output": "done"}]
    r = client.responses.create(model="tiny", input=items, tools=tools, max_output_tokens=6, temperature=0)
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "done"}]
    expected = client.chat.completions.create(model="tiny", messages=messages, tools=[PICK, COUNT], max_tokens=6,
                                              temperature=0)
    assert r.output_text == expected.choices[0].message.content
