"""tokenizer.py against transformers' tokenizers built from the same files."""
import base64
import json

import pytest

from tokenizer import HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
          "Café, naïve, Straße, 東京, привет, 🙂 emoji!   multiple   spaces\t\ttabs\n\n\nnewlines",
          "Numbers 1234567 and 3.14159, symbols #$%&*()[]{}<>"]
TEXT = "Hello  world! Café 東京 🙂\n\tdef f(x):  return x**2  # squares\n\n"


def train_bpe(path, bos_in_post_processor: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    if bos_in_post_processor:  # as LLaMA 3's tokenizer.json does
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos-post-processor"])
def test_hf_tokenizer_matches_transformers(tmp_path, bos):
    from transformers import PreTrainedTokenizerFast
    train_bpe(tmp_path, bos)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = load_tokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert isinstance(ours, HFTokenizer)
    assert ours.encode(TEXT) == theirs(TEXT).input_ids
    assert (ours.encode(TEXT)[0] == 0) == bos
    assert ours.decode(ours.encode(TEXT)) == TEXT
    assert ours.bos_id == 0 and ours.eos_ids == [1]


def test_sentencepiece_matches_transformers(tmp_path):
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS * 5))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=600, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    # As LLaMA 2 repos ship it.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "LlamaTokenizer"}))
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, SentencePieceTokenizer)
    theirs = LlamaTokenizer.from_pretrained(str(tmp_path))
    text = "Hello world! Café 東京 and some code: x = f(y)"
    assert ours.encode(text) == theirs(text).input_ids  # LLaMA 2 prepends BOS
    assert ours.encode(text)[0] == 1
    assert ours.decode(ours.encode(text)) == text


def test_tiktoken_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    # A LLaMA 3 style tiktoken file: base64 token bytes and rank, from a trained byte-level BPE.
    tok = train_bpe(tmp_path, False)
    byte_of = _unicode_to_byte()
    ranks = sorted((i, bytes(byte_of[c] for c in t)) for t, i in tok.get_vocab().items() if t not in ("<s>", "</s>"))
    lines = [f"{base64.b64encode(b).decode()} {r}" for r, (_, b) in enumerate(ranks)]
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, TiktokenTokenizer)
    specials = list(ours.special)
    fast = TikTokenConverter(str(tmp_path / "tokenizer.model"), extra_special_tokens=specials).converted()
    theirs = PreTrainedTokenizerFast(tokenizer_object=fast)
    assert ours.encode(TEXT) == [ours.bos_id] + theirs(TEXT, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(TEXT)) == TEXT
    assert ours.special["<|eot_id|>"] in ours.eos_ids


def _unicode_to_byte():
    """Inverse of GPT-2's reversible byte -> printable character map, written out independently."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def test_chat_template_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast
    train_bpe(tmp_path, False)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    ours = load_tokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
