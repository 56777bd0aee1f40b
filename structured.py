# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Structured outputs: a request's text held to a grammar, such as a JSON schema's (OpenAI's
`response_format`), by masking the tokens that cannot come next before each pick.

Which tokens may follow a text under a grammar, over a vocabulary of 50-150k tokens, is a parser's
work that llguidance owns (Rust; the library behind Guidance, and one of vLLM's and llama.cpp's
structured-output backends): it compiles a JSON schema, a regex or a Lark grammar, and answers
each step's mask. This file only joins it to brisk's tokenizers and to the engine's sampling
(engine.py: a request's `grammar`).

    grammar = json_grammar({"type": "object", "properties": {"ok": {"type": "boolean"}}})
    Engine(model, tokenizer).generate([Request(ids, 64, grammar=grammar)])
"""
import json
from typing import Optional

import torch
from torch import Tensor

from tokenizer import HFTokenizer, Tokenizer


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install -r requirements.txt") from None
    return llguidance


# Between JSON's tokens, a bounded run of whitespace (as llama.cpp's JSON grammars allow): room for
# indented output, none for a model that would pad forever (llguidance's default run is unbounded).
WHITESPACE = r"[ \t\n\r]{0,20}"


def json_grammar(schema: Optional[dict] = None, thought: str = "") -> str:
    """A JSON schema (None: any JSON object, OpenAI's json_object mode) -> a grammar for Request.grammar.
    thought: Lark rules of the thinking the answer opens with (reasoning.py). ValueError, naming the
    problem, for a schema that cannot be compiled."""
    schema = schema if schema is not None else {"type": "object"}
    options = {"whitespace_pattern": WHITESPACE}
    if thought:
        schema = json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
        return lark_grammar(f"start: thought answer\nanswer: %json {schema}\n{thought}")
    return _checked(lambda matcher: matcher.grammar_from_json_schema(schema, defaults=options), "the JSON schema")


def lark_grammar(lark: str) -> str:
    """A Lark grammar in llguidance's dialect (`%json {schema}` embeds a JSON schema) -> a grammar for
    Request.grammar; ValueError naming the problem."""
    return _checked(lambda matcher: matcher.grammar_from_lark(lark), "the grammar")


def lark_literal(tokenizer: Tokenizer, text: str) -> str:
    """Lark for exactly `text` as this tokenizer writes it: each special token in it (Gemma 4's
    <|channel>, harmony's markers) as that token, which no text can spell in llguidance's parser;
    the rest as strings."""
    special = {i for i, t in tokenizer.tok.get_added_tokens_decoder().items() if t.special} \
        if isinstance(tokenizer, HFTokenizer) else set()
    ids = tokenizer.encode(text, bos=False)
    if not special.intersection(ids):
        return json.dumps(text, ensure_ascii=False)
    parts, run = [], []
    for i in ids + [None]:
        if (i is None or i in special) and run:
            parts.append(json.dumps(tokenizer.decode(run), ensure_ascii=False))
            run = []
        if i in special:
            parts.append(f"<[{i}]>")
        elif i is not None:
            run.append(i)
    return " ".join(parts)


def pattern_regex(pattern: str) -> str:
    """A JSON schema's `pattern` (ECMA-262, found anywhere in the string unless anchored) -> the
    Lark regex (inside /.../) of the whole strings it admits."""
    head = pattern.startswith("^")
    tail = pattern.endswith("$") and not pattern.endswith("\\$")
    body = _llguidance().regex_to_lark(pattern[head:len(pattern) - tail], "dw")  # \d and \w in ASCII, as JSON
    anything = r"[\s\S]*"
    return f"{'' if head else anything}(?:{body}){'' if tail else anything}"


def _checked(compile_grammar, what: str) -> str:
    matcher = _llguidance().LLMatcher
    try:
        grammar = compile_grammar(matcher)
    except ValueError as e:
        raise ValueError(f"{what} cannot be read: {e}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{what} cannot be used: {error}")
    return grammar


class TokenTable:
    """A tokenizer's tokens as llguidance's parser reads them (built once per engine, at its first
    constrained request), for a model whose logits have vocab_size entries."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        if not isinstance(tokenizer, HFTokenizer):
            raise ValueError("structured outputs need a model with a tokenizer.json (a Hugging Face tokenizer); "
                             f"this one is {type(tokenizer).__name__}")
        self.table = _llguidance().LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size,
                                               eos_token=list(tokenizer.eos_ids))

    def check(self, grammar: str):
        """A ValueError for a grammar this vocabulary cannot follow."""
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.table)
        if error:
            raise ValueError(f"the grammar cannot be used: {error}")


class Constraint:
    """One request's place in its grammar: which tokens may come next, and each token it took."""

    def __init__(self, table: TokenTable, grammar: str):
        self.matcher = _llguidance().LLMatcher(table.table, grammar)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()}")

    def allowed(self, device) -> Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (an EOS once the text is complete)."""
        bias = bytearray(self.matcher.compute_logit_bias())  # a byte a token: 0 where not allowed
        return torch.frombuffer(bias, dtype=torch.uint8).to(device) != 0

    def take(self, token: int) -> bool:
        """False where the grammar does not allow the token (the matcher then allows nothing)."""
        return self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Nothing but an EOS may follow (or the matcher failed): the text is final."""
        return self.matcher.is_stopped()
