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
"""
import re
from typing import Optional

OPEN, CLOSE = "<think>", "</think>"


def held_tail(text: str, tag: str) -> int:
    """How many trailing characters of text may be the start of tag (to hold back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Reasoning:
    def __init__(self, opened: bool):
        self.opened = opened  # the prompt ends inside <think>: the answer starts thinking

    @classmethod
    def of(cls, tokenizer, prompt: list) -> Optional["Reasoning"]:
        if not tokenizer.chat_template or CLOSE not in tokenizer.chat_template:
            return None
        return cls(opened=tokenizer.decode(prompt[-8:]).rstrip().endswith(OPEN))

    def after_thinking(self, trigger: str) -> re.Pattern:
        """A lazy grammar's trigger (engine.py) found only after the thinking: a tool call that the
        model spells out while it thinks is not one."""
        tag = re.escape(trigger)
        if self.opened:
            return re.compile(f"{CLOSE}.*?{tag}", re.S)
        return re.compile(rf"^(?:\s*{OPEN}.*?{CLOSE}|(?!\s*{OPEN})).*?{tag}", re.S)

    def split(self, text: str, final: bool = True) -> tuple:
        """An answer -> (its thinking, None where it has none; the rest). final False: the answer so
        far, of which each part is a beginning of what the whole answer's will be (a tail that may
        be a tag's start, or whitespace that may end the thinking, is left out)."""
        body = text
        if not self.opened:
            head = text.lstrip()
            if not final and len(head) < len(OPEN) and OPEN.startswith(head):
                return None, ""  # may still open the thinking
            if not head.startswith(OPEN):
                return None, text
            body = head[len(OPEN):]
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end].strip(), body[end + len(CLOSE):].lstrip()
        if not final:
            body = body[:len(body) - held_tail(body, CLOSE)].rstrip()
        return body.strip(), ""


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
