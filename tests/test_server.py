"""server.py through the official `openai` client (and raw HTTP where the client cannot go),
against generation in this process: the same text, streaming or not, alone or among 16 streams."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import chat_checkpoint, make_hf_model, save_and_convert, save_tokenizer
from decode import generate
from load import load_model
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
QUESTIONS = ["Paris is the capital of", "One plus one is", "What colour is the sky?",
             "The quick brown fox jumps over the lazy dog. " * 4, "She sells sea shells", "A river",
             "Two plus two is four. " * 6, "Question: what colour is the sea?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, *args, launcher=(sys.executable,)) -> tuple:
    port = free_port()
    proc = subprocess.Popen([*launcher, "server.py", "--checkpoint_path", str(checkpoint), "--port", str(port), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import httpx
    for _ in range(240):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def stop_server(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("server"), TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint):
    proc, url = start_server(checkpoint, "--api_key", KEY, "--max_batch_size", "4", "--max_seq_length", "256",
                             "--prefill_chunk", "32", "--model_name", "tiny")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy text of a chat question or a raw prompt, generated in this process."""
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint.parent)

    def answer(text: str, max_tokens: int, chat: bool = True) -> tuple:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)
        out = generate(model, torch.tensor(ids), max_tokens, eos_ids=tokenizer.eos_ids)[0, len(ids):].tolist()
        finish = "stop" if 0 in out else "length"
        out = out[:out.index(0)] if 0 in out else out
        return tokenizer.decode(out), len(out), finish, len(ids)
    return answer


def chat(client, question, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}], **kwargs)


def test_chat_and_completions_equal_local_generation(client, reference):
    text, n, finish, prompt_len = reference(QUESTIONS[0], 12)
    r = chat(client, QUESTIONS[0], max_tokens=12, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
    assert r.choices[0].message.role == "assistant" and r.model == "tiny"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, n)
    chunks = list(chat(client, QUESTIONS[0], max_tokens=12, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    # The same prompt again: all but its last token found in the slot the first request left.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt_len - 1

    text, n, finish, _ = reference("The quick brown", 10, chat=False)
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == n
    streamed = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    r = client.completions.create(model="tiny", prompt=["The quick brown", "Paris"], max_tokens=10, temperature=0,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == "The quick brown" + text


def test_n_seed_stop_logprobs(client, reference):
    r = chat(client, QUESTIONS[1], max_tokens=10, temperature=1.0, n=3, seed=5)
    again = chat(client, QUESTIONS[1], max_tokens=10, temperature=1.0, n=3, seed=5)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.message.content for c in again.choices]

    full = reference(QUESTIONS[2], 20)[0]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = chat(client, QUESTIONS[2], max_tokens=20, temperature=0, stop=[stop, "never appears"])
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"

    r = chat(client, QUESTIONS[0], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and entry.token == entry.top_logprobs[0].token
    r = client.completions.create(model="tiny", prompt="Paris", max_tokens=5, temperature=0, logprobs=2)
    assert len(r.choices[0].logprobs.token_logprobs) == 5


def test_penalties_and_logit_bias(client, checkpoint, reference):
    """frequency / presence penalties and logit_bias reach the engine (tests/test_engine.py checks its
    arithmetic against a reference): the server's text is the engine's own for the same request."""
    from engine import Engine, Request
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint.parent)
    ids = tokenizer.encode("The quick brown")
    penalties = dict(frequency_penalty=0.5, presence_penalty=-2.0)  # negative: repeats
    expected = Engine(model, tokenizer, 1, 256).generate([Request(ids, 12, **penalties)])[0]
    assert expected.text != reference("The quick brown", 12, chat=False)[0]  # they change the greedy text
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0, **penalties)
    assert r.choices[0].text == expected.text
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=4, temperature=0,
                                  logit_bias={"100": 100})
    assert r.choices[0].text == tokenizer.decode([100] * 4)

def test_structured_outputs(client):
    """response_format through the official client: `parse` with a pydantic model sends its strict
    JSON schema, and pydantic validates the answer (tests/test_structured.py: the engine's side);
    json_object mode answers an object."""
    from typing import Annotated, Literal
    from pydantic import BaseModel, Field

    class Answer(BaseModel):  # bounded everywhere: a random model's answer must end
        ok: bool
        n: int = Field(ge=-5, le=99)
        color: Literal["red", "green", "blue"]
        tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)

    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                      response_format=Answer, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Answer)
    r = chat(client, QUESTIONS[1], max_tokens=8, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")  # an object begun (a random model may not end one)
    # /v1/completions takes it too (as vLLM's does; the official client passes it through extra_body).
    r = client.completions.create(model="tiny", prompt="Paris", max_tokens=20, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}}})
    assert json.loads(r.choices[0].text) in ("yes", "no") and r.choices[0].finish_reason == "stop"

TOOL = {"type": "function", "function": {"name": "pick", "description": "Pick a colour's number", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}}, "required": ["color"]}}}


def test_responses_api(client, reference):
    """/v1/responses through the official client: the answer is the in-process generation's, whole
    and streamed (the client's own accumulation of the typed events); instructions and input items
    give what chat completions gives for the same conversation; text.format holds the answer to a
    pydantic model's schema; max_output_tokens ends it incomplete."""
    from typing import Literal
    from pydantic import BaseModel
    text, n, finish, prompt_len = reference(QUESTIONS[0], 12)
    r = client.responses.create(model="tiny", input=QUESTIONS[0], max_output_tokens=12, temperature=0)
    assert r.output_text == text and r.id.startswith("resp_") and r.output[0].type == "message"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_len, n)
    assert r.status == ("incomplete" if finish == "length" else "completed")
    for question in QUESTIONS[:3]:
        text, _, finish, _ = reference(question, 30)
        with client.responses.stream(model="tiny", input=question, max_output_tokens=30, temperature=0) as stream:
            events = list(stream)
        assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert events[-1].type == ("response.incomplete" if finish == "length" else "response.completed")
        assert events[-1].response.output[0].content[0].text == text
        assert [e.sequence_number for e in events] == list(range(len(events)))

    conversation = [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": [{"type": "input_text", "text": QUESTIONS[5]}]}]
    r = client.responses.create(model="tiny", instructions="Be brief.", input=conversation, max_output_tokens=8,
                                temperature=0)
    chat_messages = [{"role": "system", "content": "Be brief."}, *conversation[:2],
                     {"role": "user", "content": QUESTIONS[5]}]
    expected = client.chat.completions.create(model="tiny", messages=chat_messages, max_tokens=8, temperature=0)
    assert r.output_text == expected.choices[0].message.content

    class Colour(BaseModel):
        color: Literal["red", "green", "blue"]
    r = client.responses.parse(model="tiny", input=QUESTIONS[2], text_format=Colour, max_output_tokens=60,
                               temperature=0)
    assert isinstance(r.output_parsed, Colour)


def test_loadgen_smoke(server, capsys):
    """scripts/loadgen.py (the server benchmark's client) runs against this server: clients behind a
    shared system prompt, every request answered (its timings are the benchmark's, not asserted)."""
    from scripts import loadgen
    loadgen.main(["--url", server + "/v1", "--api_key", KEY, "--clients", "2", "--requests", "4", "--max_tokens", "5",
                  "--system_words", "40"])
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["errors"] == 0 and result["tokens"] > 0 and result["system_words"] == 40

def test_echo_scores_the_prompt(client, checkpoint):
    """echo with logprobs (OpenAI's legacy scoring): every prompt token after the first carries its
    log-probability under the model, the first none, then the generated tokens'; streamed the same."""
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint.parent)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    with torch.no_grad():
        model.setup_caches(1, len(ids))
        want = torch.log_softmax(model(torch.tensor([ids]), torch.arange(len(ids)))[0].float(), dim=-1)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want[torch.arange(len(ids) - 1), ids[1:]].tolist(), abs=1e-4)
    assert [max(top.values()) for top in lp.top_logprobs[1:len(ids)]] == \
        pytest.approx(want[:-1].max(dim=-1).values.tolist(), abs=1e-4)
    assert r.choices[0].text.startswith(tokenizer.decode(ids))
    streamed = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                         stream=True)
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-6, nan_ok=True)
    for stream in (False, True):  # max_tokens 0: the prompt alone, scored, nothing generated
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=0, echo=True, stream=stream,
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(r) if stream else [r]
        scored = [v for c in chunks if c.choices for v in c.choices[0].logprobs.token_logprobs]
        assert scored == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-6, nan_ok=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(ids)
        assert chunks[-1].usage.completion_tokens == 0


def test_lm_eval_through_the_server(server, checkpoint, monkeypatch, tmp_path):
    """lm-eval's own API model (`local-completions` given only the server's URL: its remote tokenizer
    reads /tokenizer_info and /tokenize) gets through the server what eval.py computes in-process:
    multiple-choice loglikelihoods (echo with logprobs), rolling perplexity, generate_until."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from test_eval import assert_same_responses, evaluate, write_tasks
    from eval import Scorer, make_lm
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    tokenizer = load_tokenizer(checkpoint.parent)
    prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_ids[0]  # eval.py's
    task_dir = write_tasks(tmp_path)
    # Batches of 3 prompts a request, 2 requests at a time: the engine's slots hold several scored prompts.
    lm = LocalCompletionsAPI(base_url=server + "/v1/completions", model="tiny", tokenizer_backend="auto",
                             auth_token=KEY, max_length=256, custom_prefix_token_id=prefix, batch_size=3,
                             num_concurrent=2)
    assert lm.tokenizer_backend == "remote"
    got, _ = evaluate(lm, task_dir)
    expected, _ = evaluate(make_lm(Scorer(load_model(checkpoint), tokenizer, 256)), task_dir)
    assert_same_responses(got, expected)


def test_tokenizer_endpoints(server):
    import httpx
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server + "/tokenize", json={"prompt": "Paris is the capital"}, headers=headers).json()["tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}, headers=headers).json() == \
        {"prompt": "Paris is the capital"}
    chat_ids = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                          headers=headers).json()["tokens"]
    templated = httpx.post(server + "/tokenize", json={"prompt": "user: Hi\nassistant:"}, headers=headers)
    assert chat_ids == templated.json()["tokens"]
    info = httpx.get(server + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": 3}), ("/detokenize", {"tokens": [10**6]}),
                       ("/detokenize", {"tokens": "x"})):
        r = httpx.post(server + path, json=body, headers=headers)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server + "/tokenizer_info").status_code == 401


def test_models_and_health(client, server):
    import httpx
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    import openai
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_sixteen_concurrent_streams(client, reference):
    """16 streaming clients of different prompt lengths on 4 slots: each gets what it gets alone."""
    questions = [QUESTIONS[i % 8] + " " * (i // 8) + "?" * (i % 5) for i in range(16)]
    got, errors = {}, []

    def ask(i):
        try:
            stream = chat(client, questions[i], max_tokens=10 + i % 7, temperature=0, stream=True)
            got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(16):
        assert got[i] == reference(questions[i], 10 + i % 7)[0], i


BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be of type list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "at least 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "0 only with echo"),
    ("/v1/completions", {"prompt": "caf\udcff"}, 400, "UTF-8"),  # a lone surrogate, escaped in the JSON
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400, "type int"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6}, 400,
     "context is 256 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "context is 256"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "between 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 100}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools[0] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL]}, 400,
     "given twice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "needs 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "fly"}}}, 400, "not among 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "any"},
     400, "'tool_choice' must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [TOOL["function"]]}, 400,
     "pass 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                              "parallel_tool_calls": "no"}, 400, "type bool"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                              "tool_calls": [{"id": "1", "type": "function", "function": {
                                  "name": "pick", "arguments": "{oops"}}]}]}, 400, "not a JSON object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": 5}]}, 400,
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "text, json_object or json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "JSON schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400, "'schema'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "beam": 2}, 400, "unrecognized"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "'stop'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}, 400,
     "between -2 and 2"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, 400, "between -100 and 100"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": 5}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", b"x" * (2 << 20), 413, "larger than"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400, "stores no responses"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "only function tools"),
    ("/v1/responses", {"input": [{"type": "input_image"}]}, 400, "items of type message"),
    ("/v1/responses", {"input": "x", "modalities": ["audio"]}, 400, "unrecognized"),
    ("/v1/responses", {"input": 5}, 400, "'input' must be"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, 400, "at least 1"),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=range(len(BAD)))
def test_bad_requests(server, path, body, status, needle):
    import httpx
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=raw, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_still_serving_after_bad_requests_and_auth(server, client, reference):
    import httpx
    import openai
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert chat(client, QUESTIONS[5], max_tokens=8, temperature=0).choices[0].message.content == \
        reference(QUESTIONS[5], 8)[0]


def metric(server, name) -> float:
    import httpx
    for line in httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_disconnect_frees_the_slot(server, client, reference):
    import httpx
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": 100,
            "temperature": 0, "stream": True, "stop": []}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    other = chat(client, QUESTIONS[4], max_tokens=8, temperature=0).choices[0].message.content
    assert other == reference(QUESTIONS[4], 8)[0]
    for _ in range(40):
        if metric(server, "brisk_active_slots") == 0:
            break
        time.sleep(0.25)
    assert metric(server, "brisk_active_slots") == 0 and metric(server, "brisk_queue_length") == 0
    assert metric(server, "brisk_time_to_first_token_seconds_count") > 0


def test_sigterm_lets_streams_finish(checkpoint, reference):
    """SIGTERM: the running stream still ends with [DONE] and its whole text, then the process ends
    (uvicorn re-raises the signal after draining, so its status is SIGTERM's)."""
    import httpx
    proc, url = start_server(checkpoint, "--max_seq_length", "256")
    text = reference(QUESTIONS[6], 40)[0]
    got = []
    try:
        body = {"messages": [{"role": "user", "content": QUESTIONS[6]}], "max_tokens": 40, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not got:
                    proc.send_signal(signal.SIGTERM)
                got.append(line)
        assert got[-1] == "data: [DONE]" or got[-2] == "data: [DONE]"
        content = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content", "")
                          for line in got if line.startswith("data: {"))
        assert content == text
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        stop_server(proc)


def chat_page(url: str, question: str, max_tokens: int):
    """Headless Chromium on the chat page at url, the question sent at temperature 0 and answered."""
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.get(url + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.execute_script("document.getElementById('key').onchange()")
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").text == "tiny")
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "max_tokens").send_keys(str(max_tokens))
        driver.find_element(By.ID, "input").send_keys(question)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(ANSWERED) == 1)
    except BaseException:
        driver.quit()
        raise
    return driver


ANSWERED = "return document.querySelectorAll('.assistant[data-done]').length"


@pytest.mark.skipif(shutil.which("chromedriver") is None, reason="needs Debian's chromium and chromium-driver")
def test_chat_page_in_a_browser(server, reference):
    """The page at / in headless Chromium: type a question, the streamed answer appears; a second
    turn carries the conversation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver = chat_page(server, QUESTIONS[0], 20)
    try:
        answer = driver.execute_script("return messages[1].content")  # as streamed; .text would strip it
        assert answer == reference(QUESTIONS[0], 20)[0]
        assert driver.find_elements(By.CSS_SELECTOR, ".assistant")[0].text == answer.strip()
        assert "tokens/s" in driver.find_element(By.ID, "stats").text
        driver.find_element(By.ID, "input").send_keys("Thanks")
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(ANSWERED) == 2)
        assert len(driver.find_elements(By.CSS_SELECTOR, ".user")) == 2
        # The second request carried the whole conversation, the first answer as the page showed it.
        history = driver.execute_script("return messages")
        assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    finally:
        driver.quit()


@pytest.mark.slow
def test_soak(checkpoint):
    """500 requests from 16 clients: no error, resident memory flat after warm-up; prints latency."""
    import openai
    proc, url = start_server(checkpoint, "--max_batch_size", "8", "--max_seq_length", "256", "--model_name", "tiny")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    latencies, errors, lock = [], [], threading.Lock()

    def rss_mb() -> float:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    def worker(k, count):
        for i in range(count):
            t0 = time.perf_counter()
            try:
                stream = chat(client, QUESTIONS[(k + i) % 8], max_tokens=8 + i % 9, temperature=0.7, seed=i,
                              stream=i % 2 == 0)
                if i % 2 == 0:
                    list(stream)
                with lock:
                    latencies.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    def run(total):
        threads = [threading.Thread(target=worker, args=(k, total // 16 + (k < total % 16))) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        run(100)  # warm-up: allocator pools, tokenizer caches
        before = rss_mb()
        latencies.clear()
        run(400)
        after = rss_mb()
        assert not errors, errors[:3]
        latencies.sort()
        p = {q: latencies[int(q / 100 * (len(latencies) - 1))] for q in (50, 90, 99)}
        print(f"\nsoak: {len(latencies)} requests, latency p50 {p[50]:.2f} s, p90 {p[90]:.2f} s, p99 {p[99]:.2f} s; "
              f"RSS {before:.0f} -> {after:.0f} MB")
        assert after - before < 50, (before, after)
    finally:
        stop_server(proc)


def test_taken_port_is_a_one_line_error(checkpoint):
    """A port another process listens on: refused in seconds, before the model loads, no traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "server.py", "--checkpoint_path", str(checkpoint), "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "Loaded" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr



@pytest.mark.parametrize("problem", ["no tokenizer", "wrong tokenizer"])
def test_bad_checkpoint_is_a_one_line_error(tmp_path, problem):
    """A checkpoint without its tokenizer, or beside one that cannot be its own (1024 rows for 400
    tokens), stops the server at start with the reason, not at the first request."""
    save_tokenizer(tmp_path / "hf")
    path = save_and_convert(make_hf_model("llama2", vocab_size=1024, num_hidden_layers=1), tmp_path)
    if problem == "no tokenizer":
        (tmp_path / "tokenizer.json").unlink()
    done = subprocess.run([sys.executable, "server.py", "--checkpoint_path", str(path), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"error: {problem}" in done.stderr

@pytest.mark.slow
def test_tensor_parallel_server(checkpoint, reference):
    """Under torchrun rank 0 serves and rank 1 follows its schedule: the single-process answers."""
    import openai
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        proc, url = start_server(checkpoint, "--max_batch_size", "2", "--max_seq_length", "256", "--model_name", "tiny",
                                 launcher=launcher)
    finally:
        del os.environ["OMP_NUM_THREADS"]
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        results = {}
        threads = [threading.Thread(target=lambda q=q: results.update(
            {q: chat(client, q, max_tokens=10, temperature=0).choices[0].message.content})) for q in QUESTIONS[:4]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {q: reference(q, 10)[0] for q in QUESTIONS[:4]}
    finally:
        stop_server(proc)
