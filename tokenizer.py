# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Tokenizers for a checkpoint directory: Hugging Face tokenizer.json, SentencePiece, tiktoken.

The kind is chosen by the files the checkpoint holds, never by its name. BOS/EOS ids, whether a
BOS is prepended and the chat template come from the checkpoint's own tokenizer_config.json and
generation_config.json, as transformers reads them.
"""
import base64
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Optional


# Special tokens that OpenAI's harmony format (gpt-oss) writes between the messages of an answer:
# decoded text keeps them where the chat template is harmony's (it writes <|channel|>), so the
# answer's reader (reasoning.Harmony) can tell its thinking from its answer and its tool calls.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
# Gemma 4's (its template writes <|tool_call>): a thought channel, tool calls and their strings' quotes.
GEMMA4_MARKERS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')
# LFM2's / LFM2.5's (their templates list the tools after "List of tools:"): the markers around its calls.
LFM_MARKERS = ("<|tool_call_start|>", "<|tool_call_end|>")
LFM_TOOLS = "List of tools:"


class Tokenizer:
    """Common interface: encode/decode plus the special-token facts generation needs."""

    bos_id: Optional[int] = None
    eos_ids: list = []
    add_bos: bool = False
    chat_template: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes that were not UTF-8, smuggled in by the OS as surrogates
            raise ValueError(f"the text is not valid UTF-8 (at character {e.start}); pass UTF-8 text") from None
        ids = self._encode(text)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    chat_template_source: str = "tokenizer_config.json"

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True,
                            tools: Optional[list] = None, variables: Optional[dict] = None) -> str:
        """tools: OpenAI's {"type": "function", "function": {...}} entries, which a template that knows
        tools writes into the prompt (transformers passes them as `tools` too). variables: more that
        the template may read (e.g. Qwen3's enable_thinking), as transformers' keyword arguments."""
        import jinja2
        try:
            return self.compiled_chat_template().render(
                **(variables or {}), messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token, eos_token=self.eos_token)
        # The template is the checkpoint's code: whatever it raises is a fault of that file.
        except (jinja2.TemplateError, TypeError, LookupError, ArithmeticError) as e:
            raise ValueError(f"the chat template in {self.chat_template_source} failed ({type(e).__name__}: {e}); "
                             "fix it, or pass --no-chat") from None

    def compiled_chat_template(self):
        """The chat template as a jinja2 Template; a ValueError when there is none or it does not parse."""
        return self._compiled()[0]

    def chat_template_takes(self, name: str) -> bool:
        """Whether the chat template reads the variable `name` (e.g. `tools`) from its caller."""
        return name in self._compiled()[1]

    def _compiled(self) -> tuple:
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template'); use plain prompts instead of chat mode")
        import jinja2
        try:
            return compile_template(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template in {self.chat_template_source} has a syntax error (line {e.lineno}: "
                             f"{e.message}); fix it, or pass --no-chat") from None

    def encode_chat(self, messages: list, tools: Optional[list] = None, variables: Optional[dict] = None) -> list:
        # The template writes BOS itself where the model wants one.
        return self.encode(self.apply_chat_template(messages, tools=tools, variables=variables), bos=False)

    def _load_special(self, checkpoint_dir: Path, default_add_bos: bool):
        cfg = read_json(checkpoint_dir / "tokenizer_config.json")
        gen = read_json(checkpoint_dir / "generation_config.json")
        self.chat_template = cfg.get("chat_template")
        self.chat_template_source = str(checkpoint_dir / "tokenizer_config.json")
        if (checkpoint_dir / "chat_template.jinja").is_file():  # where transformers 5 writes it
            self.chat_template = (checkpoint_dir / "chat_template.jinja").read_text()
            self.chat_template_source = str(checkpoint_dir / "chat_template.jinja")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            try:
                self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"),
                                          self.chat_template[0]["template"])
            except (LookupError, TypeError, AttributeError):
                raise ValueError(f"{self.chat_template_source}: chat_template is a list but not of "
                                 '{"name": ..., "template": ...} entries') from None
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"{self.chat_template_source}: chat_template must be a string")
        bos = _token_content(cfg.get("bos_token"))
        eos = _token_content(cfg.get("eos_token"))
        if bos is not None and self.token_id(bos) is not None:
            self.bos_id, self.bos_token = self.token_id(bos), bos
        if eos is not None and self.token_id(eos) is not None:
            self.eos_ids, self.eos_token = [self.token_id(eos)], eos
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gen_eos):
            raise ValueError(f"{checkpoint_dir / 'generation_config.json'}: eos_token_id must be a token id or a "
                             f"list of them, got {gen.get('eos_token_id')!r}")
        for i in gen_eos:
            if i not in self.eos_ids:
                self.eos_ids.append(i)
        self.add_bos = cfg.get("add_bos_token", default_add_bos) and self.bos_id is not None


class HFTokenizer(Tokenizer):
    """tokenizer.json through the `tokenizers` library (SmolLM2, LLaMA 3 HF, Qwen2, Mistral HF...)."""

    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer as _Tok
        path = checkpoint_dir / "tokenizer.json"
        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises the base class for every parse error
            raise ValueError(f"{path} is not a readable tokenizer ({e}); copy it again from the model's "
                             "files or re-run the conversion") from None
        self.eos_ids = []
        # Without add_bos_token in tokenizer_config.json, transformers relies on the post-processor.
        with_special = self.tok.encode("", add_special_tokens=True).ids
        self._load_special(checkpoint_dir, default_add_bos=False)
        if "add_bos_token" not in read_json(checkpoint_dir / "tokenizer_config.json"):
            self.add_bos = self.bos_id is not None and with_special[:1] == [self.bos_id]
        template = self.chat_template or ""
        markers = (HARMONY_MARKERS if "<|channel|>" in template else GEMMA4_MARKERS if "<|tool_call>" in template
                   else LFM_MARKERS if LFM_TOOLS in template else ())
        self.kept = {self.token_id(m): m for m in markers if self.token_id(m) is not None}

    def token_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def _encode(self, text: str) -> list:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list) -> str:
        if not self.kept or not any(i in self.kept for i in ids):
            return self.tok.decode(ids, skip_special_tokens=True)
        pieces, start = [], 0
        for k, i in enumerate(ids):
            if i in self.kept:
                pieces += [self.tok.decode(ids[start:k], skip_special_tokens=True), self.kept[i]]
                start = k + 1
        return "".join(pieces + [self.tok.decode(ids[start:], skip_special_tokens=True)])

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model in SentencePiece format (LLaMA 2, Mistral, CodeLlama)."""

    def __init__(self, checkpoint_dir: Path):
        import sentencepiece
        path = checkpoint_dir / "tokenizer.model"
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path} is not a readable SentencePiece model ({e}); copy it again from the "
                             "model's files or re-run the conversion") from None
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
        path = checkpoint_dir / "tokenizer.model"
        try:
            ranks = load_tiktoken_bpe(str(path))
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path} is not a readable tiktoken file ({e}); copy it again from the model's "
                             "files") from None
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


def _raise_exception(message):
    raise ValueError(f"chat template: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers renders templates: jinja2's own tojson escapes <, >, & and ' for HTML, which a
    # prompt holding a tool's schema must not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> tuple:
    """A chat template -> (jinja2 Template, the variables it reads from its caller), in the sandbox
    and with the helpers transformers gives templates. Kept: compiling one takes milliseconds,
    which every chat request would pay."""
    import jinja2.meta
    import jinja2.sandbox  # jinja2 ships with torch
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = _tojson
    return env.from_string(source), frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


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


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); copy it again from the model's files") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


# A model's embedding may have more rows than its tokenizer has tokens: padded to a round size
# (Qwen2 151665 -> 151936 or 152064 rows, Phi-3 32011 -> 32064), never fewer rows, and never
# more than a round size further. The rule: tokenizer <= model <= tokenizer rounded up to a
# multiple of VOCAB_PADDING, plus VOCAB_PADDING.
VOCAB_PADDING = 256


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int, checkpoint_dir) -> None:
    """A ValueError when the tokenizer cannot be this model's (the README's rule on padding)."""
    n = tokenizer.vocab_size
    limit = -(-n // VOCAB_PADDING) * VOCAB_PADDING + VOCAB_PADDING
    if not n <= model_vocab_size <= limit:
        raise ValueError(f"wrong tokenizer for this checkpoint: the tokenizer in {checkpoint_dir} has {n} tokens, "
                         f"the model {model_vocab_size} rows (allowed: {n} to {limit}, padding); "
                         "re-run the conversion so the tokenizer files match")


def _token_content(token):
    return token.get("content") if isinstance(token, dict) else token
