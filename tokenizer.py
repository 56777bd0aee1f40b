# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Tokenizers for a checkpoint directory: Hugging Face tokenizer.json, SentencePiece, tiktoken.

The kind is chosen by the files the checkpoint holds, never by its name. BOS/EOS ids, whether a
BOS is prepended and the chat template come from the checkpoint's own tokenizer_config.json and
generation_config.json, as transformers reads them.
"""
import base64
import json
from datetime import datetime
from pathlib import Path
from typing import Optional


class Tokenizer:
    """Common interface: encode/decode plus the special-token facts generation needs."""

    bos_id: Optional[int] = None
    eos_ids: list = []
    add_bos: bool = False
    chat_template: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        ids = self._encode(text)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template'); use plain prompts instead of chat mode")
        import jinja2.sandbox  # jinja2 ships with torch

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: list) -> list:
        # The template writes BOS itself where the model wants one.
        return self.encode(self.apply_chat_template(messages), bos=False)

    def _load_special(self, checkpoint_dir: Path, default_add_bos: bool):
        cfg = _read_json(checkpoint_dir / "tokenizer_config.json")
        gen = _read_json(checkpoint_dir / "generation_config.json")
        self.chat_template = cfg.get("chat_template")
        if (checkpoint_dir / "chat_template.jinja").is_file():  # where transformers 5 writes it
            self.chat_template = (checkpoint_dir / "chat_template.jinja").read_text()
        if isinstance(self.chat_template, list):  # named templates: take the default one
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"),
                                      self.chat_template[0]["template"])
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        if bos is not None and self.token_id(bos) is not None:
            self.bos_id, self.bos_token = self.token_id(bos), bos
        if eos is not None and self.token_id(eos) is not None:
            self.eos_ids, self.eos_token = [self.token_id(eos)], eos
        gen_eos = gen.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []:
            if i not in self.eos_ids:
                self.eos_ids.append(i)
        self.add_bos = cfg.get("add_bos_token", default_add_bos) and self.bos_id is not None


class HFTokenizer(Tokenizer):
    """tokenizer.json through the `tokenizers` library (SmolLM2, LLaMA 3 HF, Qwen2, Mistral HF...)."""

    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer as _Tok
        self.tok = _Tok.from_file(str(checkpoint_dir / "tokenizer.json"))
        self.eos_ids = []
        # Without add_bos_token in tokenizer_config.json, transformers relies on the post-processor.
        with_special = self.tok.encode("", add_special_tokens=True).ids
        self._load_special(checkpoint_dir, default_add_bos=False)
        if "add_bos_token" not in _read_json(checkpoint_dir / "tokenizer_config.json"):
            self.add_bos = self.bos_id is not None and with_special[:1] == [self.bos_id]

    def token_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def _encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model in SentencePiece format (LLaMA 2, Mistral, CodeLlama)."""

    def __init__(self, checkpoint_dir: Path):
        import sentencepiece
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(checkpoint_dir / "tokenizer.model"))
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_ids = [self.sp.eos_id()] if self.sp.eos_id() >= 0 else []
        self.bos_token = self.sp.id_to_piece(self.bos_id) if self.bos_id is not None else ""
        self.eos_token = self.sp.id_to_piece(self.eos_ids[0]) if self.eos_ids else ""
        self._load_special(checkpoint_dir, default_add_bos=True)

    def token_id(self, token: str) -> Optional[int]:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def _encode(self, text: str) -> list:
        return self.sp.encode(text)

    def decode(self, ids: list) -> str:
        return self.sp.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()


class TiktokenTokenizer(Tokenizer):
    """Meta's original LLaMA 3 tokenizer.model (base64 BPE ranks) through tiktoken."""

    PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    NUM_RESERVED = 256

    def __init__(self, checkpoint_dir: Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(str(checkpoint_dir / "tokenizer.model"))
        names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        names += [f"<|reserved_special_token_{i}|>" for i in range(2, self.NUM_RESERVED - len(names) + 2)]
        self.special = {name: len(ranks) + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding("llama3", pat_str=self.PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.special)
        self.bos_id, self.bos_token = self.special["<|begin_of_text|>"], "<|begin_of_text|>"
        self.eos_ids = [self.special["<|end_of_text|>"], self.special["<|eot_id|>"], self.special["<|eom_id|>"]]
        self.eos_token = "<|end_of_text|>"
        self._load_special(checkpoint_dir, default_add_bos=True)

    def token_id(self, token: str) -> Optional[int]:
        return self.special.get(token)

    def _encode(self, text: str) -> list:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list) -> str:
        return self.enc.decode([i for i in ids if i < self.enc.n_vocab - len(self.special)])

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab


def load_tokenizer(checkpoint_dir) -> Tokenizer:
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir)
    model_file = checkpoint_dir / "tokenizer.model"
    if model_file.is_file():
        return TiktokenTokenizer(checkpoint_dir) if _is_tiktoken(model_file) else SentencePieceTokenizer(checkpoint_dir)
    raise FileNotFoundError(f"no tokenizer in {checkpoint_dir}: expected tokenizer.json or tokenizer.model; "
                            "re-run scripts/convert_hf_checkpoint.py (it copies the tokenizer files)")


def _is_tiktoken(path: Path) -> bool:
    # tiktoken files are text lines "<base64 token> <rank>"; SentencePiece files are protobuf.
    first = path.open("rb").readline().split()
    if len(first) != 2 or not first[1].isdigit():
        return False
    try:
        base64.b64decode(first[0], validate=True)
    except ValueError:
        return False
    return True


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(token):
    return token.get("content") if isinstance(token, dict) else token
