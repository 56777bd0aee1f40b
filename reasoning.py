# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""A reasoning model's thinking, apart from its answer: `<think>...</think>` (Qwen3, SmolLM3,
DeepSeek-R1's distills) read into the `reasoning_content` that DeepSeek's API, llama.cpp's and
vLLM's servers return beside `content`.

A chat template that writes `</think>` marks a model that thinks. Its answer thinks first where it
opens with `<think>`, or where the prompt already ends inside the tag (templates that force the
thinking open); the thinking runs to `</think>`, and the rest is the answer (an answer cut off
while thinking has thought only).

    thinking = Reasoning.of(tokenizer, prompt_ids)        # None: the model does not think
    reasoning, content = thinking.split(answer_text)

Gemma 4 thinks in a channel of its own, `<|channel>thought ...<channel|>` (its template writes
`<channel|>`): the same reading with those tags.

OpenAI's harmony format (gpt-oss) writes its answer as messages on channels instead
(`Harmony`): the `analysis` channel is the thinking, `final` the answer, and a message to a
recipient (`to=functions.NAME`) a tool call, which tools.py reads.
"""
import re

from structured import lark_literal

OPEN, CLOSE = "<think>", "</think>"
THOUGHT_CHANNEL = ("<|channel>thought", "<channel|>")  # Gemma 4's (tokenizer.py keeps these markers)


def held_tail(text: str, tag: str) -> int:
    """How many trailing characters of text may be the start of tag (to hold back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Reasoning:
    def __init__(self, opened: bool, tags: tuple = (OPEN, CLOSE), closed: bool = False):
        self.opened = opened  # the prompt ends inside the opening tag: the answer starts thinking
        self.closed = closed  # the prompt ends with an empty thought (thinking switched off): it answers at once
        self.open, self.close = tags

    @classmethod
    def of(cls, tokenizer, prompt: list):
        """How this model's answers think: a Reasoning, a Harmony, or None."""
        template = tokenizer.chat_template or ""
        if CHANNEL in template:
            return Harmony(opened=tokenizer.decode(prompt[-16:]).endswith(THINKING))
        tags = next((tags for tags in ((OPEN, CLOSE), THOUGHT_CHANNEL) if tags[1] in template), None)
        if tags is None:
            return None
        tail = tokenizer.decode(prompt[-8:]).rstrip()
        return cls(opened=tail.endswith(tags[0]), tags=tags, closed=tail.endswith(tags[1]))

    def thought_rules(self, tokenizer) -> str:
        """Lark rules of `thought`, what an answer held to a grammar from its first token (`start:
        thought ...`) opens with: the thinking, free up to its closing tag, and the whitespace after
        it; optional where the model may answer at once. "" where the prompt closed it: no rules."""
        if self.closed:
            return ""
        close = lark_literal(tokenizer, self.close)
        if "<[" in close:  # a special token ends the text: no text can spell it
            text, body = "/[\\s\\S]*/", f"THOUGHT_TEXT {close}"
        else:  # the text up to the first closing tag, which it holds
            end = re.escape(self.close).replace("/", "\\/")
            text, body = f"/[\\s\\S]*{end}/ & ~/[\\s\\S]*{end}[\\s\\S]+/", "THOUGHT_TEXT"
        body += " THOUGHT_SPACE"
        thought = body if self.opened else f"({lark_literal(tokenizer, self.open)} {body})?"
        return f"thought: {thought}\nTHOUGHT_TEXT: {text}\nTHOUGHT_SPACE: /[ \\t\\n]{{0,4}}/"

    def after_thinking(self, trigger) -> re.Pattern:
        """A lazy grammar's trigger (engine.py) found only after the thinking: a tool call that the
        model spells out while it thinks is not one. trigger: a text, or a pattern anchored at the
        answer's start (`^`: where the answer after the thinking starts)."""
        if isinstance(trigger, str):
            rest = ".*?" + re.escape(trigger)
        else:
            assert trigger.pattern.startswith("^"), "a pattern trigger holds at the answer's start"
            rest = trigger.pattern[1:]
        start, end = re.escape(self.open), re.escape(self.close)
        if self.opened:
            return re.compile(f"{end}{rest}", re.S)
        return re.compile(rf"^(?:\s*{start}.*?{end}|(?!\s*{start})){rest}", re.S)

    def split(self, text: str, final: bool = True) -> tuple:
        """An answer -> (its thinking, None where it has none; the rest). final False: the answer so
        far, of which each part is a beginning of what the whole answer's will be (a tail that may
        be a tag's start, or whitespace that may end the thinking, is left out)."""
        body = text
        if not self.opened:
            head = text.lstrip()
            if not final and len(head) < len(self.open) and self.open.startswith(head):
                return None, ""  # may still open the thinking
            if not head.startswith(self.open):
                return None, text
            body = head[len(self.open):]
        end = body.find(self.close)
        if end >= 0:
            return body[:end].strip(), body[end + len(self.close):].lstrip()
        if not final:
            body = body[:len(body) - held_tail(body, self.close)].rstrip()
        return body.strip(), ""


START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
THINKING = CHANNEL + "analysis" + MESSAGE
FINAL = CHANNEL + "final" + MESSAGE  # where the answer after the thinking starts


class Harmony:
    """An answer in OpenAI's harmony format, as the prompt's `<|start|>assistant` leaves it to the
    model: `<|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant<|channel|>final<|message|>
    ANSWER`. (tokenizer.py keeps these special tokens in the decoded text.) Each marker is one
    token, so an answer so far never ends inside one. opened: the prompt ends inside an analysis
    message, which the answer goes on with."""

    def __init__(self, opened: bool = False):
        self.opened = opened

    @staticmethod
    def after_thinking(trigger: re.Pattern) -> re.Pattern:
        """A tool call's trigger as it is: it is found in a message's header (tools.HARMONY_CALL), of
        markers that no thought's text can hold."""
        return trigger

    def split(self, text: str, final: bool = True) -> tuple:
        """(the analysis messages' text, None where there is none; the final and commentary
        messages' text, with each message to a recipient - a tool call - kept whole, from
        `<|start|>` on, for tools.py).
        final is unused: the parts of an answer so far are already beginnings of the whole's."""
        if self.opened:
            text = THINKING + text
        if not text.startswith(CHANNEL):
            return None, text  # not harmony after all (a constrained answer, a raw completion)
        thoughts, answer = [], []
        for message in text.split(START):
            head, sep, content = message.partition(MESSAGE)
            if not sep:
                continue  # its header is still coming
            content = content.partition(END)[0]
            if " to=" in f" {head}":  # the recipient may stand after the role or after the channel
                answer.append(START + head + MESSAGE + content)
            elif head.partition(CHANNEL)[2].split()[:1] == ["analysis"]:
                thoughts.append(content)
            else:
                answer.append(content)
        return ("\n".join(thoughts) if thoughts else None), "".join(answer)


class ReasoningStream:
    """A streamed answer split as it comes: (new thinking, new answer text) for each piece."""

    def __init__(self, reasoning: Reasoning):
        self.reasoning, self.text, self.sent = reasoning, "", (0, 0)

    def feed(self, piece: str, final: bool = False) -> tuple:
        self.text += piece
        thought, answer = self.reasoning.split(self.text, final)
        thought = thought or ""
        new = thought[self.sent[0]:], answer[self.sent[1]:]
        self.sent = len(thought), len(answer)
        return new
