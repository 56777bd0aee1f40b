"""Structured outputs (structured.py; engine.py's Request.grammar): the answers parse as JSON and
follow their schema, greedy and sampled, alone and beside free requests, which the constraint
leaves as they were; bad schemas and tokenizers without a tokenizer.json are refused."""
import json
import re

import pytest
import torch

from conftest import make_hf_model, save_and_convert, save_tokenizer
from decode import generate
from engine import Engine, Request
from load import load_model
from structured import WHITESPACE, json_grammar, lark_grammar
from tokenizer import load_tokenizer

# Every part bounded (strings, arrays, numbers), so that even a random model's answer must end.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color", "tags"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}}}}


def follows_schema(value) -> bool:
    """SCHEMA checked by hand, independently of the grammar made from it."""
    return (isinstance(value, dict) and set(value) == {"ok", "n", "color", "tags"}
            and isinstance(value["ok"], bool)
            and isinstance(value["n"], int) and not isinstance(value["n"], bool) and -5 <= value["n"] <= 99
            and value["color"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured")
    save_tokenizer(d / "hf")
    path = save_and_convert(make_hf_model("llama31", vocab_size=320, eos_token_id=0, max_position_embeddings=256), d)
    return load_model(path), load_tokenizer(d)


def test_answers_follow_the_schema(tiny):
    model, tokenizer = tiny
    grammar = json_grammar(SCHEMA)
    prompts = [tokenizer.encode(t) for t in ("The sea is", "A river runs", "She sells", "Paris")]
    requests = [Request(prompts[0], 200, grammar=grammar),
                Request(prompts[1], 200, grammar=grammar, temperature=1.0, seed=3),
                Request(prompts[2], 200, grammar=grammar, temperature=0.7, top_p=0.9, seed=4),
                Request(prompts[3], 20)]
    results = Engine(model, tokenizer, max_batch_size=4, max_seq_length=256).generate(requests)
    for r in results[:3]:
        assert r.finish_reason == "stop", r.text
        assert follows_schema(json.loads(r.text)), r.text
    assert results[0].text != results[1].text  # the sampled one did sample
    # The free request beside them is what greedy decoding gives alone.
    alone = generate(model, torch.tensor(prompts[3]), 20, eos_ids=tokenizer.eos_ids)[0, len(prompts[3]):].tolist()
    assert results[3].token_ids == alone[:alone.index(0)] if 0 in alone else alone
    # A constrained request alone equals itself in the batch (its mask is its own).
    again = Engine(model, tokenizer, max_batch_size=1, max_seq_length=256).generate(requests[1:2])[0]
    assert again.token_ids == results[1].token_ids


def test_unconstrained_greedy_is_not_json(tiny):
    """The test above is not vacuous: the same prompt without the grammar is no such JSON."""
    model, tokenizer = tiny
    free = Engine(model, tokenizer, max_batch_size=1, max_seq_length=256).generate(
        [Request(tokenizer.encode("The sea is"), 60)])[0]
    with pytest.raises(ValueError):
        json.loads(free.text)


@pytest.mark.parametrize("schema,needle", [({"type": "nonsense"}, "cannot be used"),
                                           ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                                            "cannot be used")])
def test_bad_schema_is_a_value_error(schema, needle):
    with pytest.raises(ValueError, match=needle):
        json_grammar(schema)


def test_needs_a_tokenizer_json(tiny):
    class SentencePieceLike:  # a tokenizer that is no tokenizer.json's (SentencePiece, tiktoken)
        eos_ids = [0]
    model, _ = tiny
    engine = Engine(model, SentencePieceLike(), max_batch_size=1, max_seq_length=64)
    with pytest.raises(ValueError, match="tokenizer.json"):
        engine.add(Request([1, 2], 4, grammar=json_grammar()))
    assert not engine.has_work()


@pytest.mark.parametrize("kind", ["text", "pattern", "group"])
def test_lazy_grammar_starts_at_its_trigger(tiny, kind):
    """grammar_trigger (tool calls' lazy grammars): the answer is the free one, nothing masked, up
    to the trigger's first appearance, and follows the grammar after it; a trigger that never
    appears leaves the answer free. A pattern with a group hands the grammar the text from the
    group on (here the trigger's last character, which the grammar then must start with)."""
    model, tokenizer = tiny
    ids = tokenizer.encode("Paris is the capital of")
    engine = Engine(model, tokenizer, max_batch_size=2, max_seq_length=256)
    free = engine.generate([Request(ids, 30)])[0]
    texts = [tokenizer.decode(free.token_ids[:j]) for j in range(len(free.token_ids) + 1)]
    # A trigger that ends where a token ends, at its first appearance: the grammar takes over there.
    j = next(j for j in range(2, len(texts)) if len(texts[j]) >= 2 and "\ufffd" not in texts[j][-2:]
             and texts[j].find(texts[j][-2:]) == len(texts[j]) - 2)
    trigger, never, grammar = texts[j][-2:], "\x00never", json_grammar(SCHEMA)
    if kind != "text":  # re patterns: the grammar starts where the first match ends
        trigger, never = re.compile(re.escape(trigger)), re.compile(re.escape(never))
    if kind == "group":
        trigger = re.compile(re.escape(texts[j][-2]) + f"({re.escape(texts[j][-1])})")
        compact = {**SCHEMA, "x-guidance": {"whitespace_pattern": WHITESPACE}}
        grammar = lark_grammar(f"start: {json.dumps(texts[j][-1])} %json {json.dumps(compact)}")
    lazy, never = engine.generate([Request(ids, 200, grammar=grammar, grammar_trigger=trigger),
                                   Request(ids, 30, grammar=grammar, grammar_trigger=never)])
    assert lazy.token_ids[:j] == free.token_ids[:j] and lazy.text.startswith(texts[j])
    assert lazy.finish_reason == "stop" and follows_schema(json.loads(lazy.text[len(texts[j]):]))
    assert never.token_ids == free.token_ids
    with pytest.raises(ValueError, match="needs a grammar"):
        engine.add(Request(ids, 5, grammar_trigger="x"))


def test_real_model_answers_in_json(default_model):
    """SmolLM2 asked for a city as JSON: any JSON object (OpenAI's json_object mode), then a schema
    with typed fields and nothing else, each a complete answer that parses and has those types."""
    from packed_cache import load_with_tokenizer
    model, tokenizer = load_with_tokenizer(default_model, "cpu", torch.float32)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Describe the city of Paris as JSON: its name, "
                                                             "country and population."}])
    city = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population"],
            "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                           "population": {"type": "integer"}}}
    engine = Engine(model, tokenizer, max_batch_size=2, max_seq_length=512)
    anything, typed = engine.generate([Request(ids, 120, grammar=json_grammar()),
                                       Request(ids, 120, grammar=json_grammar(city))])
    assert anything.finish_reason == typed.finish_reason == "stop"
    assert isinstance(json.loads(anything.text), dict)
    answer = json.loads(typed.text)
    assert set(answer) == {"name", "country", "population"} and isinstance(answer["population"], int)
    assert "Paris" in answer["name"]
