"""scripts/convert_gguf.py: GGUF files written here as llama.cpp writes them, and the real default model,
against the originals, transformers and sentencepiece."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import make_hf_model, save_and_convert, save_gpt_oss_mxfp4
from decode import generate
from load import load_model
from model import ModelArgs, Transformer
from rope import rope_frequencies
from rope import rope_attention_factor
from scripts.convert_gguf import convert_gguf
from tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# brisk name (layer as {}) -> GGUF name, as llama.cpp's convert_hf_to_gguf.py names LLaMA tensors.
GGUF_NAMES = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
    "layers.{}.attention.wo.weight": "blk.{}.attn_output.weight",
    "layers.{}.attention_norm.weight": "blk.{}.attn_norm.weight",
    "layers.{}.ffn_norm.weight": "blk.{}.ffn_norm.weight",
    "layers.{}.feed_forward.w1.weight": "blk.{}.ffn_gate.weight",
    "layers.{}.feed_forward.w3.weight": "blk.{}.ffn_up.weight",
    "layers.{}.feed_forward.w2.weight": "blk.{}.ffn_down.weight",
    "layers.{}.feed_forward.gate.weight": "blk.{}.ffn_gate_inp.weight",
    "layers.{}.feed_forward.w1": "blk.{}.ffn_gate_exps.weight",
    "layers.{}.feed_forward.w3": "blk.{}.ffn_up_exps.weight",
    "layers.{}.feed_forward.w2": "blk.{}.ffn_down_exps.weight",
    "layers.{}.attention.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "layers.{}.attention.k_norm.weight": "blk.{}.attn_k_norm.weight",
    "layers.{}.post_attention_norm.weight": "blk.{}.post_attention_norm.weight",
    "layers.{}.post_ffn_norm.weight": "blk.{}.post_ffw_norm.weight",
    "layers.{}.attention.wo.bias": "blk.{}.attn_output.bias",
    "layers.{}.attention.sinks": "blk.{}.attn_sinks.weight",
    "layers.{}.feed_forward.gate.bias": "blk.{}.ffn_gate_inp.bias",
    "layers.{}.feed_forward.w1_bias": "blk.{}.ffn_gate_exps.bias",
    "layers.{}.feed_forward.w3_bias": "blk.{}.ffn_up_exps.bias",
    "layers.{}.feed_forward.w2_bias": "blk.{}.ffn_down_exps.bias",
}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves become interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(c: ModelArgs) -> torch.Tensor:
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, written from its loop.
    s = c.rope_scaling
    factors = []
    for freq in rope_frequencies(c.head_dim, c.rope_base, None).tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < s["original_max_position_embeddings"] / s["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > s["original_max_position_embeddings"] / s["low_freq_factor"]:
            factors.append(s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def interleaved(w: torch.Tensor, heads: int, c: ModelArgs) -> torch.Tensor:
    """The inverse of the converter's rope_halves: GLM's rows, rotary pairs next to each other."""
    rd, hd = c.rope_dim, c.head_dim
    order = torch.cat([torch.stack([torch.arange(rd // 2), torch.arange(rd // 2) + rd // 2], 1).flatten(),
                       torch.arange(rd, hd)])
    return w.reshape(heads, hd, *w.shape[1:])[:, order].reshape(w.shape)


def write_gguf(path, state: dict, c: ModelArgs, qtype=T.F32, arch="llama", vocab=None, raw=None):
    """A GGUF file of a brisk state dict, as llama.cpp's convert_hf_to_gguf.py writes one for `arch`:
    permuted q/k (llama and granite), Gemma's norms as 1 + weight, Phi-3's fused qkv and gate/up, 1-D
    tensors in F32, the others in qtype. vocab: the tokenizer.* metadata (default: a toy byte-level
    vocabulary); raw: GGUF name -> (bytes array, type) written instead of that tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.block_size)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_local_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.rope_dim)
    w.add_rope_freq_base(c.rope_base)
    if c.norm_centered:  # Cohere's LayerNorm
        w.add_layer_norm_eps(c.norm_eps)
        w.add_logit_scale(1 / c.logit_divisor)
    else:
        w.add_layer_norm_rms_eps(c.norm_eps)
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_activated_experts)
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if arch in ("gemma2", "gemma3") and c.sliding_window and c.sliding_window_layers != [i for i in range(c.n_layer) if (i + 1) % 6]:
        w.add_sliding_window_pattern([i in c.sliding_window_layers for i in range(c.n_layer)])
    if arch in ("olmo2", "exaone4", "cohere2") and c.sliding_window:  # llama.cpp's converter lists every layer
        w.add_sliding_window_pattern([c.is_sliding(i) for i in range(c.n_layer)])
    if c.attn_logit_softcap:
        w.add_attn_logit_softcapping(c.attn_logit_softcap)
    if c.final_logit_softcap:
        w.add_final_logit_softcapping(c.final_logit_softcap)
    if c.rope_local_base is not None:
        w.add_rope_freq_base_swa(c.rope_local_base)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_scale)
        w.add_attention_scale(c.attention_scale)
        w.add_residual_scale(c.residual_scale)
        w.add_logit_scale(c.logit_divisor)
    tensors = {}
    kind = (c.rope_scaling or {}).get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    elif kind == "longrope":
        s = c.rope_scaling
        w.add_rope_scaling_attn_factors(rope_attention_factor(s))
        w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
        tensors["rope_factors_long.weight"] = torch.tensor(s["long_factor"])
        tensors["rope_factors_short.weight"] = torch.tensor(s["short_factor"])
    elif kind == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(c)
    elif kind == "yarn":  # as llama.cpp's convert_hf_to_gguf.py writes it
        s = c.rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["factor"])
        w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
        for key in ("attention_factor", "beta_fast", "beta_slow"):
            if key in s:
                getattr(w, f"add_rope_scaling_yarn_{key.replace('attention', 'attn')}")(s[key])
    add_vocab(w, vocab or toy_vocab(c.vocab_size))
    for name, t in state.items():
        i = name.split(".")[1] if name.startswith("layers.") else None
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1
        if arch in ("glm4", "ernie4_5", "command-r", "cohere2") and name.rpartition(".")[0].endswith("wqkv"):  # pairs
            q, k, v = t.split([c.n_head * c.head_dim, c.n_local_heads * c.head_dim, c.n_local_heads * c.head_dim])
            for x, part in zip("qkv", (interleaved(q, c.n_head, c), interleaved(k, c.n_local_heads, c), v)):
                tensors[f"blk.{i}.attn_{x}.{name.rpartition('.')[2]}"] = part
        elif name.endswith("wqkv.weight") and arch == "phi3":
            tensors[f"blk.{i}.attn_qkv.weight"] = t
        elif name.endswith("wqkv.weight") or name.endswith("wqkv.bias"):
            q, k, v = t.split([c.n_head * c.head_dim, c.n_local_heads * c.head_dim, c.n_local_heads * c.head_dim])
            if arch in ("llama", "granite"):
                q, k = llama_cpp_permute(q, c.n_head), llama_cpp_permute(k, c.n_local_heads)
            for x, part in zip("qkv", (q, k, v)):
                tensors[f"blk.{i}.attn_{x}.{name.rpartition('.')[2]}"] = part
        elif arch in ("phi3", "glm4") and name.endswith("w1.weight"):
            tensors[f"blk.{i}.ffn_up.weight"] = torch.cat([t, state[name.replace("w1.", "w3.")]])
        elif arch in ("seed_oss", "gpt-oss") and name.endswith("ffn_norm.weight"):
            tensors[f"blk.{i}.post_attention_norm.weight"] = t
        elif not (arch in ("phi3", "glm4") and name.endswith("w3.weight")):
            pattern = name.replace(f".{i}.", ".{}.") if i is not None else name
            tensors[GGUF_NAMES[pattern].format(i)] = t
    for name, t in sorted(tensors.items()):
        data = t.detach().float().numpy()
        if name in (raw or {}):
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif t.dim() == 1 or qtype == T.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def toy_vocab(n: int) -> dict:
    """A byte-level vocabulary without merges: byte symbols, then an end token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values())[:n - 1] + ["<|end|>"]
    return dict(model="gpt2", pre="gpt2", tokens=tokens, eos=n - 1, types=[1] * (n - 1) + [3])


def add_vocab(w, v: dict):
    w.add_tokenizer_model(v["model"])
    w.add_tokenizer_pre(v.get("pre", "default"))
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    for key in ("bos", "eos", "unk"):
        if key in v:
            getattr(w, f"add_{key}_token_id")(v[key])
    for key, value in v.get("flags", {}).items():
        getattr(w, f"add_{key}")(value)


def random_brisk_state(config: ModelArgs, seed=0) -> dict:
    torch.manual_seed(seed)
    with torch.no_grad():
        model = Transformer(config)
        for p in model.parameters():
            p.normal_(0, 0.15)
    state = model.state_dict()
    if config.tie_embeddings:
        state.pop("output.weight")
    return state


def our_logits(model, ids):
    model.setup_caches(max_batch_size=ids.shape[0], max_seq_length=ids.shape[1])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))


# --- round trips of GGUF files written by the test ------------------------------------------------

ROUND_TRIPS = {
    "gqa": ("llama2", dict(num_key_value_heads=2)),
    # tied embeddings (no output.weight) and LLaMA 3.1 rope scaling (written as rope_freqs.weight)
    "tied_llama3_rope": ("llama32", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_f32_round_trip_is_exact(case, tmp_path):
    family, overrides = ROUND_TRIPS[case]
    hf = make_hf_model(family, seed=5, **overrides)
    original = save_and_convert(hf, tmp_path / "hf_route")  # our HF converter: tested against transformers
    config = ModelArgs.from_json(original.parent / "config.json")
    gguf_file = write_gguf(tmp_path / "model.gguf", torch.load(original, weights_only=True), config)
    path = convert_gguf(gguf_file, tmp_path / "gguf_route")

    assert ModelArgs.from_json(path.parent / "config.json") == config
    expected, got = torch.load(original, weights_only=True), torch.load(path, weights_only=True)
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(load_model(path), ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


# llama.cpp's architectures of issue 21's families: case -> (GGUF architecture, conftest family, overrides).
FAMILY_ROUND_TRIPS = {
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {}),
    "qwen3moe": ("qwen3moe", "qwen3_moe", {}),
    # llama.cpp derives Gemma's attention scale from the shape (head_dim but for the 27B models).
    "gemma2": ("gemma2", "gemma2", dict(query_pre_attn_scalar=24)),
    "gemma3": ("gemma3", "gemma3", {}),
    "phi3_window": ("phi3", "phi3", {}),
    "phi4_longrope": ("phi3", "phi4_longrope", {}),
    "olmo2": ("olmo2", "olmo2", {}),
    "granite": ("granite", "granite", {}),
    "olmo3": ("olmo2", "olmo3", {}),
    "olmo3_yarn": ("olmo2", "olmo3", dict(num_hidden_layers=4, layer_types=None, rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=32, attention_factor=1.2))),
    "exaone4": ("exaone4", "exaone4", {}),
    "seed_oss": ("seed_oss", "seed_oss", {}),
    "glm4": ("glm4", "glm4", {}),
    "ernie4_5": ("ernie4_5", "ernie4_5", {}),
    "gpt_oss": ("gpt-oss", "gpt_oss", {}),
    "cohere": ("command-r", "cohere", {}),
    "cohere2": ("cohere2", "cohere2", {}),
    "qwen3_yarn": ("qwen3", "qwen3", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=16.0))),
    "qwen3_yarn_attention_factor": ("qwen3", "qwen3", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, attention_factor=1.25))),
}


@pytest.mark.parametrize("case", sorted(FAMILY_ROUND_TRIPS))
def test_family_gguf_matches_transformers(case, tmp_path):
    """A GGUF written as llama.cpp writes the architecture loads to transformers' logits, with the
    config of the HF route (longrope's factors come back through float32)."""
    arch, family, overrides = FAMILY_ROUND_TRIPS[case]
    hf = make_hf_model(family, seed=5, **overrides)
    original = save_and_convert(hf, tmp_path / "hf_route")
    config = ModelArgs.from_json(original.parent / "config.json")
    gguf_file = write_gguf(tmp_path / "model.gguf", torch.load(original, weights_only=True), config, arch=arch)
    path = convert_gguf(gguf_file, tmp_path / "gguf_route")
    got = ModelArgs.from_json(path.parent / "config.json")
    assert {**vars(got), "rope_scaling": None} == {**vars(config), "rope_scaling": None}
    assert (got.rope_scaling or {}).get("rope_type") == (config.rope_scaling or {}).get("rope_type")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(load_model(path), ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


# DeepSeek V2-Lite's YaRN: mscale equal to mscale_all_dim, both below 1.
FAMILY_ROUND_TRIPS_YARN = dict(rope_parameters=dict(
    rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, beta_fast=32.0,
    beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707))
# Families whose GGUF comes from llama.cpp's own converter below: conftest family, overrides.
LLAMA_CPP_CONVERTED = {
    "llama31": ("llama31", {}),
    "qwen3_yarn": ("qwen3", FAMILY_ROUND_TRIPS["qwen3_yarn"][2]),
    "olmo3_yarn": ("olmo3", FAMILY_ROUND_TRIPS["olmo3_yarn"][2]),
    "exaone4": ("exaone4", {}),
    "seed_oss": ("seed_oss", {}),
    "granite": ("granite", {}),
    "glm4": ("glm4", {}),
    "gpt_oss": ("gpt_oss", {}),
    # Command R7B's window on 3 layers in 4, which llama.cpp assumes (its converter writes no pattern), and
    # its rotary_pct, which that converter reads.
    "cohere2": ("cohere2", {"rotary_pct": 1.0, "sliding_window_pattern": 4}),
    "gpt_oss_mxfp4": ("gpt_oss", None),  # the hub's MXFP4 experts, which llama.cpp keeps in its MXFP4 type
    # DeepSeek V3's routing: expert groups (GLM-4.5's hub configs have one), the selection bias, shared experts
    "glm4_moe": ("glm4_moe", {}),
    # GLM-4.5's hub form: its last layer a multi-token-prediction layer, which llama.cpp keeps and brisk leaves out
    "glm4_moe_mtp": ("glm4_moe", {"num_hidden_layers": 4, "mtp": 1}),
    "dots1": ("dots1", {"sliding_window": None}),  # llama.cpp has no window for dots1 (the hub's has none)
    "minimax_m2": ("minimax_m2", {}),
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": []}),  # (llama.cpp's converter cannot map a dense layer there)
    "olmoe": ("olmoe", {}),
    "granitemoe": ("granitemoe", {}),
    "ministral3": ("ministral3", {}),
    # Latent attention (architecture deepseek2): kv_b split and transposed, RoPE on pairs, YaRN's log multiplier
    "deepseek_v3": ("deepseek_v3", {"scoring_func": "sigmoid"}),  # as the hub's config says (llama.cpp reads it)
    "deepseek_v2_yarn": ("deepseek_v2", FAMILY_ROUND_TRIPS_YARN),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    # Gated DeltaNet: -exp(A_log), Qwen3.5's value heads tiled, Qwen3-Next's fused projections regrouped
    # (--no-mtp: these tiny models have no prediction layer, which the converter otherwise expects)
    "qwen3_5": ("qwen3_5", {"args": ["--no-mtp"]}),
    # (its model type makes transformers load the tokenizer as Qwen3.5's own class, whose pre-tokenizer llama.cpp
    # would then not recognise on SmolLM2's vocab: the converter runs with transformers' generic class)
    "qwen3_5_moe": ("qwen3_5_moe", {"args": ["--no-mtp"], "generic_tokenizer": True}),
    "qwen3_next": ("qwen3_next", {"mlp_only_layers": [], "args": ["--no-mtp"]}),
    # LFM2's convolutions (the layers with no key/value heads), its final norm as token_embd_norm; LFM2-MoE
    # tied, as the hub's (llama.cpp's converter has no name for its untied output)
    "lfm2": ("lfm2", {}),
    "lfm2_moe": ("lfm2_moe", {"tie_word_embeddings": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LLAMA_CPP_CONVERTED))
def test_llama_cpp_converter_output_matches_transformers(case, default_model, tmp_path):
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes (where scripts/bench_llamacpp.sh put it) loads
    to transformers' logits: its names, keys and layouts, not this file's idea of them."""
    from scripts.bench import DEFAULT_LLAMACPP_DIR
    script = DEFAULT_LLAMACPP_DIR / "src/convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp is not at {DEFAULT_LLAMACPP_DIR} (scripts/bench_llamacpp.sh puts it there)")
    import transformers
    family, overrides = LLAMA_CPP_CONVERTED[case]
    # Its converter knows SmolLM2's tokenizer; GLM-4's wants <|user|> among the special tokens, GLM-4.5's more.
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model.parent)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "[gMASK]", "<|observation|>"]})
    args = []
    if overrides is None:
        hf = save_gpt_oss_mxfp4(tmp_path / "hf", vocab_size=len(tokenizer))
    else:
        overrides = dict(overrides)
        mtp, args = overrides.pop("mtp", 0), overrides.pop("args", [])
        generic = overrides.pop("generic_tokenizer", False)
        hf = make_hf_model(family, seed=5, vocab_size=len(tokenizer), **overrides)
        hf.save_pretrained(tmp_path / "hf")
        if mtp:  # the last layers become prediction layers, as a hub config counts them
            config = json.loads((tmp_path / "hf" / "config.json").read_text())
            n_layer = config["num_hidden_layers"] - mtp
            config.update(num_hidden_layers=n_layer, num_nextn_predict_layers=mtp)
            (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
            hf.model.layers = hf.model.layers[:n_layer]
    tokenizer.save_pretrained(tmp_path / "hf")
    run = [str(script)]
    if overrides is not None and generic:
        run = ["-c", "import os, runpy, sys, transformers\n"
               "fast = transformers.PreTrainedTokenizerFast.from_pretrained\n"
               "transformers.AutoTokenizer.from_pretrained = lambda path, *a, **k: fast(path)\n"
               "sys.argv = sys.argv[1:]\nsys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')", str(script)]
    subprocess.run([sys.executable, *run, str(tmp_path / "hf"), "--outfile", str(tmp_path / "model.gguf"),
                    "--outtype", "f32", *args], check=True, capture_output=True)
    path = convert_gguf(tmp_path / "model.gguf", tmp_path / "gguf_route")
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(load_model(path), ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def save_gemma_tokenizer(hf_dir):
    """A tiny tokenizer of Gemma's kind (BPE on the text with spaces as ▁, bytes it lacks as <0xXX>
    pieces, <bos> first), trained on the tests' text: llama.cpp's Gemma 4 converter wants one."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from conftest import TOKENIZER_TEXT
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
                                 unk_token="<unk>")
    hf.save_pretrained(hf_dir)
    return hf


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe", "gemma4_e2b"])
def test_llama_cpp_gemma4_matches_transformers(family, tmp_path):
    """Gemma 4 as llama.cpp's converter writes it (head sizes and key/value heads per kind of layer, the
    global layers' values as their keys, proportional RoPE as rope_freqs, E2B's per-layer inputs and
    shared caches, the 26B's experts beside the feed-forward; its gemma4 tokenizer): transformers' logits,
    and its tokenizer's ids and text."""
    from scripts.bench import DEFAULT_LLAMACPP_DIR
    script = DEFAULT_LLAMACPP_DIR / "src/convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp is not at {DEFAULT_LLAMACPP_DIR} (scripts/bench_llamacpp.sh puts it there)")
    theirs = save_gemma_tokenizer(tmp_path / "hf")
    hf = make_hf_model(family, seed=5, vocab_size=len(theirs))
    hf.save_pretrained(tmp_path / "hf")
    subprocess.run([sys.executable, str(script), str(tmp_path / "hf"), "--outfile", str(tmp_path / "model.gguf"),
                    "--outtype", "f32"], check=True, capture_output=True)
    path = convert_gguf(tmp_path / "model.gguf", tmp_path / "gguf_route")
    # (E2B's per-layer embeddings cover the first 256 ids here, as its vocab_size_per_layer_input says)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(load_model(path), ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    ours = load_tokenizer(tmp_path / "gguf_route")
    for text in ["Hello world, the cat\n\nsat.", "  two  spaces\n", "\u00e9moji \U0001f999 ok", "The quick fox."]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text


# Bits per weight of each block type: the dequantized value lies within one quantization step,
# (block max |w|) * 2 / (2^bits - 1), of the original (rounding gives half a step; fp16 scales and
# Q4_0's asymmetric range [-8, 7] add less than the other half).
BLOCK_BITS = {T.Q8_0: 8, T.Q5_0: 5, T.Q5_1: 5, T.Q4_0: 4, T.Q4_1: 4}


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, *BLOCK_BITS], ids=lambda q: q.name)
def test_quantized_round_trip_within_quantization_error(qtype, tmp_path):
    config = ModelArgs(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=160)
    state = random_brisk_state(config)
    path = convert_gguf(write_gguf(tmp_path / "model.gguf", state, config, qtype), tmp_path / "out")
    got = torch.load(path, weights_only=True)
    assert sorted(got) == sorted(state)
    for name, w in state.items():
        g = got[name].float()
        if w.dim() == 1:
            assert torch.equal(g, w), name  # llama.cpp keeps norms in F32
            continue
        if qtype in (T.F16, T.BF16):
            assert got[name].dtype == {T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
            torch.testing.assert_close(g, w.to(got[name].dtype).float(), atol=0, rtol=0, msg=name)
            continue
        assert got[name].dtype == torch.float32
        blocks = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True)  # (rows, cols / 32, 1)
        step = (blocks * 2 / (2 ** BLOCK_BITS[qtype] - 1)).expand(-1, -1, 32).reshape(w.shape)
        err = (g - w).abs()
        assert (err <= step).all(), f"{name}: error {(err / step).max():.2f} steps"
        assert err.max() > 0, f"{name} was not quantized"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_k_quants_dequantize_in_place(qtype, tmp_path):
    # The gguf package cannot quantize K-quants: write random 256-weight blocks with small fp16
    # scales and check the converter puts gguf's dequantization of them in the right place.
    config = ModelArgs(block_size=64, vocab_size=256, n_layer=1, n_head=4, n_local_heads=2, dim=256,
                       intermediate_size=512)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (256, 512 // elems, nbytes), dtype=np.uint8)
    scales = np.full((256, 512 // elems, 2), 0.01, dtype=np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # ... scales[16], d: the fp16 scale comes last
        blocks[..., -2:] = scales[..., :2]
    else:  # d, dmin, ...: two fp16 scales first
        blocks[..., :4] = scales
    raw = blocks.reshape(256, -1)
    path = write_gguf(tmp_path / "m.gguf", random_brisk_state(config), config,
                      raw={"blk.0.ffn_down.weight": (raw, qtype)})
    got = torch.load(convert_gguf(path, tmp_path / "out"), weights_only=True)["layers.0.feed_forward.w2.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert got.shape == (256, 512) and torch.isfinite(expected).all() and expected.abs().max() > 0
    assert torch.equal(got, expected)


def test_moe_round_trip_is_exact(tmp_path):
    config = ModelArgs(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=96, num_experts=4, num_activated_experts=2)
    state = random_brisk_state(config)
    path = convert_gguf(write_gguf(tmp_path / "moe.gguf", state, config), tmp_path / "out")
    got = torch.load(path, weights_only=True)
    assert ModelArgs.from_json(path.parent / "config.json") == config
    assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_dtype_option(tmp_path):
    config = tiny_config()
    state = random_brisk_state(config)
    path = convert_gguf(write_gguf(tmp_path / "m.gguf", state, config, T.Q8_0), tmp_path / "out", dtype="bfloat16")
    got = torch.load(path, weights_only=True)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert torch.equal(got["norm.weight"], state["norm.weight"].bfloat16())


# --- tokenizers rebuilt from GGUF metadata ------------------------------------------------------

VARIED_TEXT = ("Héllo wörld! Ünïcödé: 你好，世界 — ça va? 🦀🚀👍🏽 naïve café\n\n"
               "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345 3.14159\n"
               "\tTabs\tand    runs of spaces   \r\n\n\n  leading, trailing  \n"
               "x = {'a': [1, 22, 333]}; y = \"DON'T\" isn't we'll they've\u00a0nbsp\u200bzwsp")


def sentencepiece_vocab(tmp_path, vocab_size=400, space_prefix=True):
    """Train a small SentencePiece BPE model (LLaMA's settings; Gemma's without the space prefix)
    and describe it as llama.cpp's converter writes a `llama` vocabulary into a GGUF."""
    import sentencepiece as spm
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((VARIED_TEXT.replace("\u00a0", " ") + "\nThe quick brown fox jumps over the lazy dog. "
                       "Tokenizers split text into pieces; merges join frequent pairs.\n") * 50)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), model_type="bpe",
                                   vocab_size=vocab_size, byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, character_coverage=1.0,
                                   add_dummy_prefix=space_prefix, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else
             6 if sp.is_byte(i) else 1 for i in range(sp.get_piece_size())]
    vocab = dict(model="llama", pre="default", tokens=[sp.id_to_piece(i) for i in range(sp.get_piece_size())],
                 scores=[sp.get_score(i) for i in range(sp.get_piece_size())], types=types,
                 bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id(),
                 flags=dict(add_bos_token=True, add_space_prefix=space_prefix))
    return sp, vocab


def test_sentencepiece_vocab_round_trip(tmp_path):
    from transformers import AutoTokenizer
    sp, vocab = sentencepiece_vocab(tmp_path)
    config = ModelArgs(block_size=64, vocab_size=sp.get_piece_size(), n_layer=1, n_head=2, dim=32,
                       intermediate_size=64)
    gguf_file = write_gguf(tmp_path / "spm.gguf", random_brisk_state(config), config, vocab=vocab)
    ours = load_tokenizer(convert_gguf(gguf_file, tmp_path / "out").parent)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)

    for text in [VARIED_TEXT, "Hello world", " leading space", "The quick brown fox", "😀 unseen: Ωmega"]:
        ids = ours.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text), text  # SentencePiece itself
        assert ours.decode(ids) == sp.decode(ids) == text
        if not text.startswith(" "):  # there transformers adds no prefix space; sentencepiece and llama.cpp do
            assert ids == reference.encode(text), text
    assert ours.bos_id == sp.bos_id() and ours.eos_ids == [sp.eos_id()] and ours.add_bos


def test_gemma_sentencepiece_vocab_without_space_prefix(tmp_path):
    """Gemma's GGUFs carry a SentencePiece vocabulary with add_space_prefix false."""
    sp, vocab = sentencepiece_vocab(tmp_path, space_prefix=False)
    config = ModelArgs(block_size=64, vocab_size=sp.get_piece_size(), n_layer=1, n_head=2, dim=32, intermediate_size=64,
                       norm_offset=1.0, block_norms="sandwich", hidden_act="gelu_tanh", embedding_scale=32 ** 0.5,
                       attention_scale=16 ** -0.5)
    gguf_file = write_gguf(tmp_path / "gemma.gguf", random_brisk_state(config), config, arch="gemma2", vocab=vocab)
    ours = load_tokenizer(convert_gguf(gguf_file, tmp_path / "out").parent)
    for text in [VARIED_TEXT, "Hello world", " leading space", "The quick brown fox"]:
        ids = ours.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert ours.decode(ids) == sp.decode(ids) == text


def test_gemma4_vocab_round_trip(tmp_path):
    """A gemma4 vocabulary (BPE with merges over SentencePiece's pieces, as llama.cpp's Gemma 4 converter
    writes it): the ids and text of the tokenizer it was made from."""
    theirs = save_gemma_tokenizer(tmp_path / "hf")
    spec = json.loads(theirs.backend_tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    types = [3 if t in theirs.all_special_tokens else 6 if t.startswith("<0x") else 1 for t in tokens]
    vocab = dict(model="gemma4", tokens=tokens, types=types, merges=[" ".join(m) for m in spec["merges"]],
                 bos=theirs.bos_token_id, eos=theirs.eos_token_id, unk=theirs.unk_token_id)
    config = ModelArgs(block_size=64, vocab_size=len(tokens), n_layer=1, n_head=2, dim=32, intermediate_size=64)
    ours = load_tokenizer(convert_gguf(write_gguf(tmp_path / "g.gguf", random_brisk_state(config), config,
                                                  vocab=vocab), tmp_path / "out").parent)
    for text in [VARIED_TEXT, "Hello world", " leading space", "The quick brown fox\n\n\nx"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    assert ours.bos_id == theirs.bos_token_id and ours.add_bos


def test_qwen3_chat_template_and_turn_end(tmp_path):
    """A Qwen3 GGUF's chat template, control tokens and end-of-turn id come through to generate.py."""
    tokens = toy_vocab(254)["tokens"][:-1] + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    vocab = dict(model="gpt2", pre="qwen2", tokens=tokens, types=[1] * 253 + [3, 3, 3], eos=255,
                 flags=dict(eot_token_id=254, chat_template=template))
    config = ModelArgs(block_size=64, vocab_size=256, n_layer=1, n_head=2, dim=32, intermediate_size=64, qk_norm="head")
    gguf_file = write_gguf(tmp_path / "qwen3.gguf", random_brisk_state(config), config, arch="qwen3", vocab=vocab)
    ours = load_tokenizer(convert_gguf(gguf_file, tmp_path / "out").parent)
    messages = [{"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages) == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    ids = ours.encode_chat(messages)
    assert ids[0] == 253 and ids.count(254) == 1  # control tokens matched whole
    assert sorted(ours.eos_ids) == [254, 255]


def test_phi4_mini_pre_tokenizer(tmp_path):
    """Phi-4-mini's GGUF names the o200k split "gpt-4o": digits in threes, contractions kept on words."""
    from tokenizers import Tokenizer
    config = tiny_config()
    vocab = dict(toy_vocab(256), pre="gpt-4o")
    path = convert_gguf(write_gguf(tmp_path / "phi4.gguf", random_brisk_state(config), config, arch="phi3",
                                   vocab=vocab), tmp_path / "out")
    tok = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("He isn't 12345 yet")]
    assert pieces == ["He", "Ġisn't", "Ġ", "123", "45", "Ġyet"]
    assert load_tokenizer(path.parent).decode(load_tokenizer(path.parent).encode(VARIED_TEXT)) == VARIED_TEXT


# --- errors -------------------------------------------------------------------------------------

def tiny_config():
    return ModelArgs(block_size=64, vocab_size=256, n_layer=1, n_head=2, dim=32, intermediate_size=64)


def test_unsupported_architecture(tmp_path):
    c = tiny_config()
    path = write_gguf(tmp_path / "m.gguf", random_brisk_state(c), c, arch="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'; supported: llama, qwen2, qwen3, "
                                         "qwen3moe, gemma2, gemma3, phi3, olmo2"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type(tmp_path):
    c = tiny_config()
    elems, nbytes = gguf.GGML_QUANT_SIZES[T.Q8_1]  # llama.cpp's internal type for activations
    q8_1 = np.zeros((c.intermediate_size, c.dim // elems * nbytes), dtype=np.uint8)
    path = write_gguf(tmp_path / "m.gguf", random_brisk_state(c), c, raw={"blk.0.ffn_up.weight": (q8_1, T.Q8_1)})
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type Q8_1 \(blk.0.ffn_up.weight\)"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_cli(tmp_path):
    result = subprocess.run([sys.executable, "scripts/convert_gguf.py", "--gguf", str(tmp_path / "nope.gguf"),
                             "--output_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: GGUF file {tmp_path / 'nope.gguf'} not found"


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


# --- the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ------------------------------------

def test_real_tokenizer_matches_transformers(default_model, default_gguf):
    from transformers import AutoTokenizer
    # The tokenizer alone: transformers' model from the GGUF (seconds of dequantizing every weight)
    # is for the slow test.
    reference = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    ours = load_tokenizer(default_model.parent)
    ids = ours.encode(VARIED_TEXT)
    assert ids == reference.encode(VARIED_TEXT)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True) == VARIED_TEXT
    # Digits one by one, as SmolLM2's own tokenizer.json and llama.cpp's "smollm" pre-tokenizer split them.
    assert [ours.decode([i]) for i in ours.encode("x 2025")] == ["x", " ", "2", "0", "2", "5"]
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is the capital of France?"}]
    text = ours.apply_chat_template(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(messages) == reference.encode(text)
    assert (ours.bos_id, ours.eos_ids, ours.add_bos) == (1, [2], False)


PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "CHAT:What is the capital of France?"]


@pytest.mark.slow
def test_real_greedy_and_logits_match_transformers(default_model, default_gguf):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                              dtype=torch.float32).eval()
    model = load_model(default_model)
    tokenizer = load_tokenizer(default_model.parent)
    for prompt in PROMPTS:
        chat = prompt.startswith("CHAT:")
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt[5:]}]) if chat else tokenizer.encode(prompt)
        got = generate(model, torch.tensor(ids), 32, temperature=0.0)[0]
        with torch.no_grad():
            expected = hf(got[None]).logits[0]
        # Greedy decoding is deterministic, so transformers decodes the same 32 tokens exactly when
        # its argmax after each prefix of our sequence is our next token (one forward instead of 32).
        assert expected[len(ids) - 1:-1].argmax(-1).tolist() == got[len(ids):].tolist(), prompt
        # Both sides dequantize the same Q4_1 data to identical fp32 weights; only the order of fp32
        # operations differs (fused qkv, SDPA). Measured: max |difference| 8e-5 on logits up to 45,
        # while the smallest top-1/top-2 gap along these decodes is 0.05; 1e-3 sits between.
        torch.testing.assert_close(our_logits(model, got[None])[0], expected, atol=1e-3, rtol=0)
        if chat:  # and once through transformers' own generate loop
            hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0]
            assert hf_out.tolist() == got.tolist()
