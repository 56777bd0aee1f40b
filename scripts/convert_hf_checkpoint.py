# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Convert a Hugging Face LLaMA-family checkpoint into brisk's model.pth + config.json.

Reads safetensors (single file or sharded index) or pytorch_model*.bin from CHECKPOINT_DIR/hf
(where scripts/download.py puts them) or CHECKPOINT_DIR itself, and writes model.pth,
config.json and the tokenizer files into CHECKPOINT_DIR. Every HF tensor must be consumed.
"""
import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_output_dir, error_boundary  # noqa: E402
from load import atomic_save, atomic_write  # noqa: E402
from model import ModelArgs  # noqa: E402

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")

# HF name (layer index as {}) -> brisk name. q/k/v are fused into wqkv afterwards.
WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    # Mixtral, hub layout: one tensor per expert, stacked into [E, ...] afterwards.
    "model.layers.{}.block_sparse_moe.gate.weight": "layers.{}.feed_forward.gate.weight",
    "model.layers.{}.block_sparse_moe.experts.{}.w1.weight": "layers.{}.feed_forward.w1.{}",
    "model.layers.{}.block_sparse_moe.experts.{}.w2.weight": "layers.{}.feed_forward.w2.{}",
    "model.layers.{}.block_sparse_moe.experts.{}.w3.weight": "layers.{}.feed_forward.w3.{}",
    # Mixtral, transformers 5 in-memory layout: experts stacked, gate and up fused as [E, 2I, D].
    "model.layers.{}.mlp.gate.weight": "layers.{}.feed_forward.gate.weight",
    "model.layers.{}.mlp.experts.gate_up_proj": "layers.{}.feed_forward.w13",
    "model.layers.{}.mlp.experts.down_proj": "layers.{}.feed_forward.w2",
}
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def config_from_hf(hf: dict) -> ModelArgs:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported architecture {model_type!r} ({hf.get('architectures')}); "
                         f"supported model_type values: {', '.join(SUPPORTED)}")
    # transformers 5 writes rope_parameters; hub checkpoints carry rope_theta / rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    rope_base = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
    rope_scaling = hf.get("rope_scaling") or rope or None
    if rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
        if rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
    sliding_window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        sliding_window = None
    n_head = hf["num_attention_heads"]
    return ModelArgs(
        block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        dim=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        n_local_heads=hf.get("num_key_value_heads") or n_head,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_base=float(rope_base),
        rope_scaling=rope_scaling,
        norm_eps=hf["rms_norm_eps"],
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        num_experts=hf.get("num_local_experts", 0) if model_type == "mixtral" else 0,
        num_activated_experts=hf.get("num_experts_per_tok", 2),
    )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object; download it again")
    return data


def weight_files(source: Path) -> list:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (source / index).is_file():
            weight_map = read_json(source / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{source / index} has no weight_map; download it again")
            shards = [source / s for s in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise FileNotFoundError(f"{source / index} lists shards that are missing: {missing[:3]}; "
                                        "the download is incomplete: run scripts/download.py again")
            return shards
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (source / single).is_file():
            return [source / single]
    raise FileNotFoundError(f"no weights in {source}: expected model.safetensors, a sharded "
                            "model.safetensors.index.json, or pytorch_model*.bin")


def load_shard(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except SafetensorError as e:  # truncated or not safetensors at all
            raise ValueError(f"{path} is not a readable safetensors file ({e}); the download may be "
                             "incomplete: run scripts/download.py again") from None
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise ValueError(f"{path} is not a readable PyTorch file ({type(e).__name__}: {e}); the download may be "
                         "incomplete: run scripts/download.py again") from None


def rename(hf_name: str) -> str:
    numbers = re.findall(r"\.(\d+)\.", hf_name)
    pattern = re.sub(r"\.\d+\.", ".{}.", hf_name)
    if pattern not in WEIGHT_MAP:
        raise ValueError(f"unmapped HF tensor {hf_name!r}: this architecture variant is not supported")
    return WEIGHT_MAP[pattern].format(*numbers)


def convert_state_dict(hf_state: dict, config: ModelArgs) -> dict:
    state = {}
    for name, tensor in hf_state.items():
        if not IGNORED.fullmatch(name):
            state[rename(name)] = tensor
    if config.tie_embeddings:
        state.pop("output.weight", None)  # the loader ties it to tok_embeddings
    for i in range(config.n_layer):
        p = f"layers.{i}.attention."
        for kind in ("weight", "bias"):
            parts = [state.pop(p + f"w{x}.{kind}", None) for x in "qkv"]
            if all(t is not None for t in parts):
                state[p + f"wqkv.{kind}"] = torch.cat(parts)
            elif any(t is not None for t in parts):
                raise ValueError(f"layer {i}: q/k/v {kind}s are incomplete in the HF checkpoint")
        f = f"layers.{i}.feed_forward."
        if config.num_experts and f + "w13" in state:
            w1, w3 = state.pop(f + "w13").chunk(2, dim=1)
            state[f + "w1"], state[f + "w3"] = w1.contiguous(), w3.contiguous()
        elif config.num_experts:
            for w in ("w1", "w2", "w3"):
                experts = [state.pop(f + f"{w}.{e}", None) for e in range(config.num_experts)]
                if any(t is None for t in experts):
                    raise ValueError(f"layer {i}: {w} is missing experts in the HF checkpoint")
                state[f + w] = torch.stack(experts)
    return state


def check_against_model(state: dict, config: ModelArgs):
    """Every tensor must have the exact name and shape the model expects."""
    from model import Transformer
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    if config.tie_embeddings:
        expected.pop("output.weight")
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"converted weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(state[name].shape)}, "
                             f"config expects {tuple(t.shape)}")


def find_source(checkpoint_dir: Path) -> Path:
    for source in (checkpoint_dir / "hf", checkpoint_dir):
        if (source / "config.json").is_file() and "model_type" in read_json(source / "config.json"):
            return source
    raise FileNotFoundError(f"no Hugging Face config.json in {checkpoint_dir}/hf or {checkpoint_dir}; "
                            f"download one with: python scripts/download.py --repo_id ORG/NAME")


def convert_hf_checkpoint(checkpoint_dir: Path, output_dir: Path = None) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    source = find_source(checkpoint_dir)
    output_dir = Path(output_dir or checkpoint_dir)
    if source.resolve() == output_dir.resolve():
        raise ValueError(f"{source} holds the HF files, whose config.json would be overwritten by brisk's; "
                         f"move them into {source / 'hf'} or pass --output_dir")
    check_output_dir(output_dir, "--output_dir")
    hf_config = read_json(source / "config.json")
    try:
        config = config_from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"{source / 'config.json'} lacks {e}, which {hf_config.get('model_type')} models "
                         "need; download the model's config.json again") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source / 'config.json'}: {e}; download the model's config.json again") from None
    files = weight_files(source)
    hf_state = {}
    for k, path in enumerate(files, 1):
        print(f"[{k}/{len(files)}] reading {path.name}", file=sys.stderr, flush=True)
        hf_state.update(load_shard(path))
    state = convert_state_dict(hf_state, config)
    check_against_model(state, config)

    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / "model.pth"
    print(f"writing {out}", file=sys.stderr, flush=True)
    atomic_save(state, out)
    atomic_write(output_dir / "config.json", config.to_json)
    copy_tokenizer(source, output_dir)
    print(f"done: {out} ({sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters)", file=sys.stderr)
    return out


def copy_tokenizer(source: Path, output_dir: Path):
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in found:
        atomic_write(output_dir / name, lambda tmp: shutil.copyfile(source / name, tmp))
    # Meta's LLaMA 3 repos keep the tiktoken file under original/.
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        meta = source / "original" / "tokenizer.model"
        if meta.is_file():
            atomic_write(output_dir / "tokenizer.model", lambda tmp: shutil.copyfile(meta, tmp))
        else:
            print(f"warning: no tokenizer.json or tokenizer.model in {source}; generate.py will need one",
                  file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_dir", type=Path, required=True,
                   help="folder holding the HF files (or their hf/ subfolder)")
    p.add_argument("--output_dir", type=Path, default=None, help="where to write (default: --checkpoint_dir)")
    args = p.parse_args(argv)
    with error_boundary():
        convert_hf_checkpoint(args.checkpoint_dir, args.output_dir)


if __name__ == "__main__":
    main()
