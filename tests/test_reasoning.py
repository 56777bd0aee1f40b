"""A thinking model's reasoning apart from its answer (reasoning.py; the server's
`reasoning_content` and `chat_template_kwargs`): streamed pieces add up to the whole answer's
split, and through the official client the thinking and the answer are the generation's own."""
import shutil

import pytest
import torch

from conftest import chat_checkpoint
from decode import generate
from load import load_model
from reasoning import THOUGHT_CHANNEL, Harmony, Reasoning, ReasoningStream
from tokenizer import load_tokenizer
from tools import JSON_CALL

# As Qwen3's does: the generation prompt opens the thinking, or with enable_thinking false holds an
# empty one.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
            "assistant:{% if enable_thinking is defined and not enable_thinking %} <think>\n\n</think>\n\n"
            "{% else %} <think>\n{% endif %}{% endif %}")

ANSWERS = [  # (the prompt opened the thinking, answer) -> (thinking, content)
    (False, "<think>\nLet me see. </thin k> 2+2\n</think>\n\nThe answer is 4.", ("Let me see. </thin k> 2+2",
                                                                                "The answer is 4.")),
    (True, "\nhmm\n</think>\n\nFour.", ("hmm", "Four.")),
    (False, "Plain answer, then <think>", (None, "Plain answer, then <think>")),
    (False, "  <think>cut off while thin", ("cut off while thin", "")),
    (False, "<thinking> is not the tag", (None, "<thinking> is not the tag")),
    (True, "no end", ("no end", "")),
]
# Gemma 4's thought channel (its markers special tokens, kept in the decoded text)
GEMMA4_ANSWERS = [
    (False, "<|channel>thought\nTwo and two.<channel|>It is 4.", ("Two and two.", "It is 4.")),
    (False, "It is 4.", (None, "It is 4.")),
    (False, "<|channel>thought\ncut off", ("cut off", "")),
]


@pytest.mark.parametrize("opened,text,expected,tags", [(*a, None) for a in ANSWERS] +
                         [(*a, THOUGHT_CHANNEL) for a in GEMMA4_ANSWERS], ids=range(len(ANSWERS) + len(GEMMA4_ANSWERS)))
def test_split_and_stream(opened, text, expected, tags):
    """The split of whole answers, and the same answers streamed in pieces of 1, 2 and 5
    characters: the pieces of thinking and of answer add up to the whole answer's split."""
    reasoning = Reasoning(opened) if tags is None else Reasoning(opened, tags)
    assert reasoning.split(text) == expected
    for size in (1, 2, 5):
        stream = ReasoningStream(reasoning)
        pieces = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.feed("", final=True)]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == (expected[0] or "", expected[1])


@pytest.mark.parametrize("opened", [False, True])
def test_tool_calls_are_looked_for_after_the_thinking(opened):
    """With tools, the lazy grammar's trigger is found only after the thinking: a tag the model
    writes out while it thinks does not start a call."""
    pattern = Reasoning(opened).after_thinking("<tool_call>")

    def starts(text):
        match = pattern.search(text)
        return match and match.end()
    call = '<tool_call>{"name": "f"}'
    assert starts("<think>I could write <tool_call> here") is None
    assert starts("  <think>") is None and starts("<thi") is None
    assert starts("<think>hm <tool_call> no</think>\nYes. " + call) == len("<think>hm <tool_call> no</think>\nYes. ") + 11
    assert starts("hm</think> " + call) == len("hm</think> ") + 11
    assert starts("Plain " + call) == (None if opened else len("Plain ") + 11)
    # A bare JSON call (Llama's) must open the answer after the thinking; the grammar starts at its brace.
    bare = Reasoning(opened).after_thinking(JSON_CALL)

    def opens(text):
        match = bare.search(text)
        return match and match.start(1)
    json_call = '{"name": "f"}'
    assert opens('<think>maybe {"name": "f"}') is None and opens("hm</think> Sure: " + json_call) is None
    assert opens("<think>hm</think>\n" + json_call) == len("<think>hm</think>\n")
    assert opens("hm</think> " + json_call) == (len("hm</think> ") if opened else None)
    assert opens(json_call) == (None if opened else 0)


def tiny_server(tmp_path_factory, name: str, make_checkpoint):
    """(url, model.pth) of a server on the checkpoint make_checkpoint(folder) writes, while the
    fixture lasts."""
    from test_server import KEY, start_server, stop_server
    d = tmp_path_factory.mktemp(name)
    path = make_checkpoint(d)
    proc, url = start_server(path, "--api_key", KEY, "--max_batch_size", "2", "--max_seq_length", "256",
                             "--model_name", "tiny")
    yield url, path
    stop_server(proc)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory, "thinking", lambda d: chat_checkpoint(d, TEMPLATE))


def test_reasoning_through_the_client(thinking_server):
    """A template that opens the thinking: the random model never closes it, so all it says is
    thinking (reasoning_content, streamed as delta.reasoning_content) and the answer is empty; with
    chat_template_kwargs {"enable_thinking": false} the template closes it and all is answer. Both
    equal the generation of the same prompt in this process."""
    import openai
    from test_server import KEY
    url, path = thinking_server
    model, tokenizer = load_model(path), load_tokenizer(path.parent)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What colour is the sky?"}]

    def alone(variables=None):
        ids = tokenizer.encode_chat(question, variables=variables)
        out = generate(model, torch.tensor(ids), 12, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
        return tokenizer.decode(out[:out.index(0)] if 0 in out else out)

    thought = alone().strip()
    assert thought  # something to split
    r = client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0)
    assert r.choices[0].message.model_extra["reasoning_content"] == thought and r.choices[0].message.content == ""
    chunks = list(client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == thought
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""

    answer = alone({"enable_thinking": False})
    assert answer and answer != alone()
    r = client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == answer and "reasoning_content" not in r.choices[0].message.model_extra
    # response_format: the model thinks first (free text to </think>, but text: the random model's invalid
    # UTF-8 bytes are held back, so not the same thought); switched off, the answer is JSON from the start.
    yes_no = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}}
    r = client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0,
                                       response_format=yes_no)
    assert r.choices[0].message.model_extra["reasoning_content"] and r.choices[0].message.content == ""
    assert r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0,
                                       response_format=yes_no,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content in ('"yes"', '"no"') and r.choices[0].finish_reason == "stop"
    # An earlier turn's thinking goes back to the template as reasoning_content (Qwen3's reads it).
    history = [*question, {"role": "assistant", "content": "Blue.", "reasoning_content": "It is day."},
               {"role": "user", "content": "Why?"}]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    # The Responses API: the thinking as a reasoning item, whole and streamed.
    r = client.responses.create(model="tiny", input=question, max_output_tokens=12, temperature=0)
    assert [item.type for item in r.output] == ["reasoning"] and r.output[0].content[0].text == thought
    with client.responses.stream(model="tiny", input=question, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
        client.chat.completions.create(model="tiny", messages=question, extra_body={
            "chat_template_kwargs": {"messages": []}})


@pytest.mark.skipif(shutil.which("chromedriver") is None, reason="needs Debian's chromium and chromium-driver")
def test_chat_page_shows_the_thinking(thinking_server):
    """The chat page in headless Chromium: the thought in its own block above the answer, and
    kept with the answer in the conversation it sends next."""
    from selenium.webdriver.common.by import By
    from test_server import chat_page
    url, path = thinking_server
    model, tokenizer = load_model(path), load_tokenizer(path.parent)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Why?"}])
    out = generate(model, torch.tensor(ids), 10, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
    thought = tokenizer.decode(out[:out.index(0)] if 0 in out else out).strip()
    driver = chat_page(url, "Why?", 10)
    try:
        assert driver.execute_script("return messages[1]") == {"role": "assistant", "content": "",
                                                               "reasoning_content": thought}
        block = driver.find_element(By.CSS_SELECTOR, ".assistant .thinking")
        assert block.get_attribute("open") and block.find_element(By.TAG_NAME, "summary").text == "thinking"
        assert driver.execute_script("return document.querySelector('.thinking div').textContent") == thought
    finally:
        driver.quit()


# --- OpenAI's harmony format (gpt-oss) --------------------------------------------------------------

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]
# The shape of gpt-oss's template: messages between <|start|> and <|end|>, an assistant's on a
# channel, the tools listed where given; `prefill` opens the answer's analysis message.
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
    "{% if prefill is defined and prefill %}<|channel|>analysis<|message|>{% endif %}{% endif %}")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def harmony_checkpoint(root):
    """chat_checkpoint's tiny model, its tokenizer given harmony's special tokens (<|return|> and
    <|call|> end an answer, as gpt-oss's generation_config.json says)."""
    import json
    from conftest import save_tokenizer, set_chat_template
    path = chat_checkpoint(root, HARMONY_TEMPLATE)
    hf_tok = save_tokenizer(root / "hf")
    hf_tok.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    hf_tok.save_pretrained(root)
    set_chat_template(root, HARMONY_TEMPLATE)
    ends = [hf_tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|return|>", "<|call|>")]
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return path


HARMONY_ANSWERS = [  # answer -> (thinking, content, the calls' names and arguments)
    ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     ("Two and two.", "It is 4.", [])),
    ("<|channel|>final<|message|>No thinking.", (None, "No thinking.", [])),
    ("<|channel|>analysis<|message|>Weather asked.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
     ("Weather asked.", "", [("get_weather", {"city": "Paris"})])),
    # The recipient after the role, as harmony allows it.
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
     '<|message|>{"city": "Rome"}', ("x", "", [("get_weather", {"city": "Rome"})])),
    ("Not harmony at all.", (None, "Not harmony at all.", [])),
    ("<|channel|>analysis<|message|>cut off while thin", ("cut off while thin", "", [])),
]


@pytest.mark.parametrize("text,expected", HARMONY_ANSWERS, ids=range(len(HARMONY_ANSWERS)))
def test_harmony_answer_read_whole_and_streamed(text, expected, tmp_path):
    """A harmony answer's tokens (the markers special tokens, which the decoded text keeps and
    <|endoftext|> it drops) read as the server reads them: whole, and streamed a token at a time as
    the engine's text grows, into the same thinking, content and tool calls."""
    import json
    from server import Answer
    from tools import Tools
    harmony_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}], tools=WEATHER)
    thinking, tools = Reasoning.of(tokenizer, prompt), Tools.read(WEATHER, "auto", True, tokenizer)
    assert (type(thinking).__name__, thinking.opened, tools.style) == ("Harmony", False, "harmony")
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.decode(ids + [0]) == text
    thought, content, calls = Answer(thinking, tools).read(text)
    assert (thought, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]) \
        == expected
    answer, shown, streamed = Answer(thinking, tools), "", ("", "")
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        piece, shown = now[len(shown):], now
        t, c, _ = answer.feed(piece, final=False)
        streamed = (streamed[0] + t, streamed[1] + c)
    t, c, last_calls = answer.feed("", final=True)
    assert (streamed[0] + t, streamed[1] + c) == (expected[0] or "", expected[1])
    assert [c["function"]["name"] for c in last_calls] == [name for name, _ in expected[2]]


def test_harmony_calls_held_from_their_header(tmp_path):
    """A harmony call is held from its recipient on (tools.HARMONY_CALL finds it in a header, after the
    role or the channel, never in a thought's text): the function's name, the rest of the header, and
    arguments that follow its schema (on llguidance's matcher, token by token, the markers special
    tokens); a named tool_choice allows that function alone."""
    from structured import Constraint, TokenTable
    from tools import HARMONY_CALL, Tools
    path = harmony_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    table = TokenTable(tokenizer, load_model(path).config.vocab_size)
    count = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer", "maximum": 3}}, "required": ["k"]}}}

    def accepted(tools, text):
        grammar, trigger = tools.grammar()
        match = trigger.search(text)
        constraint = Constraint(table, grammar)
        for t in tokenizer.encode(text[match.end():], bos=False):
            if not constraint.allowed("cpu")[t]:
                return False
            constraint.take(t)
        return constraint.complete
    tools = Tools.read(WEATHER + [count], "auto", True, tokenizer)
    named = Tools.read(WEATHER + [count], {"type": "function", "function": {"name": "count"}}, True, tokenizer)
    calls = [text for text, (_, _, found) in HARMONY_ANSWERS if found]
    assert len(calls) == 2 and all(accepted(tools, text) for text in calls)
    assert not any(accepted(named, text) for text in calls)
    weather = calls[0].replace("get_weather", "count").replace('{"city": "Paris"}', '{"k": 2}')
    assert accepted(tools, weather) and accepted(named, weather) and not accepted(tools, weather.replace("2", "4"))
    assert not accepted(tools, calls[0].replace("city", "town"))
    assert not accepted(tools, calls[0].replace("get_weather", "fly"))
    assert HARMONY_CALL.search("<|channel|>analysis<|message|>I could send to=functions.get_weather") is None
    assert HARMONY_CALL.search("<|channel|>commentary to=functions.get_weather").end() == len(
        "<|channel|>commentary to=functions.")


def test_harmony_response_format_held_from_the_final_channel(tmp_path):
    """response_format on a harmony model: the analysis is free, the JSON held from the final channel's
    message on (server.answer_grammar's trigger), as the answer gpt-oss writes after its thinking; with tools,
    the trigger is a call's header or that message, and what follows a call or that JSON."""
    from server import answer_grammar
    from structured import Constraint, TokenTable
    path = harmony_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    table = TokenTable(tokenizer, load_model(path).config.vocab_size)
    grammar, trigger = answer_grammar({"response_schema": {"enum": ["yes", "no"]}}, None, Harmony(), tokenizer)
    text = HARMONY_ANSWERS[0][0].replace("It is 4.", '"yes"')
    assert text.find(trigger) == text.index("<|channel|>final<|message|>")

    def accepted(answer):
        constraint = Constraint(table, grammar)
        return all(constraint.allowed("cpu")[t] and constraint.take(t) for t in tokenizer.encode(answer, bos=False)) \
            and constraint.complete
    assert accepted('"yes"') and accepted('"no"') and not accepted("It is 4.") and not accepted('"maybe"')
    # With tools too: a call from its header on, or the final answer from its message on.
    from tools import Tools
    tools = Tools.read(WEATHER, "auto", True, tokenizer)
    grammar, trigger = answer_grammar({"response_schema": {"enum": ["yes", "no"]}}, tools, Harmony(), tokenizer)
    call = HARMONY_ANSWERS[2][0]
    for answer, expected in ((text, '"yes"'), (call, call[call.index("get_weather"):])):
        match = trigger.search(answer)
        assert answer[match.end():] == expected and accepted(expected)
    assert not accepted(call[call.index("get_weather"):].replace("city", "town")) and not accepted("It is 4.")


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory, "harmony", harmony_checkpoint)


def test_harmony_through_the_client(harmony_server):
    """A harmony template whose prompt opens the analysis channel (chat_template_kwargs prefill):
    the random model's answer is thinking until it writes <|end|>; whole and streamed, the thinking
    and the content equal the split of the same generation in this process; without the prefill,
    an answer that does not open a channel is all content."""
    import openai
    from test_server import KEY
    url, path = harmony_server
    model, tokenizer = load_model(path), load_tokenizer(path.parent)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What colour is the sky?"}]
    for prefill in (True, False):
        ids = tokenizer.encode_chat(question, variables={"prefill": prefill})
        out = generate(model, torch.tensor(ids), 16, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
        out = out[:next((k for k, i in enumerate(out) if i in tokenizer.eos_ids), len(out))]
        thought, content = Harmony(opened=prefill).split(tokenizer.decode(out))
        assert (thought is not None) == prefill
        kwargs = dict(model="tiny", messages=question, max_tokens=16, temperature=0,
                      extra_body={"chat_template_kwargs": {"prefill": prefill}})
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert (message.model_extra.get("reasoning_content"), message.content) == (thought, content)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == (thought or "")
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
        if prefill:  # response_format holds the final channel alone, which the random model does not open
            r = client.chat.completions.create(**kwargs, response_format={"type": "json_object"})
            message = r.choices[0].message
            assert (message.model_extra.get("reasoning_content"), message.content) == (thought, content)
    # With tools the text is free until a call's header: the random model's answer is its own.
    ids = tokenizer.encode_chat(question, tools=WEATHER)
    out = generate(model, torch.tensor(ids), 16, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
    out = out[:next((k for k, i in enumerate(out) if i in tokenizer.eos_ids), len(out))]
    message = client.chat.completions.create(model="tiny", messages=question, tools=WEATHER, max_tokens=16,
                                             temperature=0).choices[0].message
    assert message.content == Harmony().split(tokenizer.decode(out))[1] and not message.tool_calls
