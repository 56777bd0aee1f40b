# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): int4 weights chosen against calibration data.

    python quantize.py --checkpoint_path X/model.pth --mode int4-gptq --groupsize 128 --calibration_file corpus.txt
    python quantize.py --checkpoint_path X/model.pth --mode int4-gptq --calibration_tasks wikitext

Round-to-nearest (quantize.py --mode int4) rounds every weight on its own. GPTQ rounds the
columns of a layer one at a time and spreads each rounding error over the columns not yet
rounded, weighted by the inverse Hessian H = 2 X^T X of the layer's inputs X, so that the
layer's *outputs* on real data move as little as possible. It writes exactly quantize.py's int4
layout (same groups, scales, zeros, padding), so loading and kernels need nothing new.

The model is processed block by block: each block sees the outputs of the already quantized
blocks before it, and within a block wqkv, wo, w1/w3 (which share their input) and w2 are
quantized in that order, each on inputs produced by the ones quantized before it (the reference
implementation's "true sequential"). Memory: the model plus two copies of one block's input.
The output projection is quantized by GPTQ too, on the final norm's outputs; the embedding is
as quantize.py makes it (a tied one reads the quantized output's rows).
"""
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from load import with_tied_output
from model import ModelArgs, Transformer
from quantized import (dequantize_int4, int4_group_params, pack_int4_codes, padded_size, quantize_int4,
                       quantize_int8)
from tokenizer import check_vocab, load_tokenizer

DEFAULT_PERCDAMP = 0.01  # dampening added to H's diagonal, as a fraction of its mean
DEFAULT_BLOCKSIZE = 128  # columns per lazy batch update
DEFAULT_CALIBRATION_LIMIT = 128  # the paper's 128 random segments of 2048 tokens
DEFAULT_CALIBRATION_SEQ_LENGTH = 2048
DEFAULT_SEED = 0
# Linears of a block in the order they are quantized; the ones in a group share one input (and Hessian).
BLOCK_LINEARS = (("attention.wqkv",), ("attention.wo",), ("feed_forward.w1", "feed_forward.w3"),
                 ("feed_forward.w2",))


# ---------------------------------------------------------------------------------------------
# One layer

@torch.no_grad()
def gptq_quantize(w: Tensor, H: Tensor, groupsize: int, percdamp: float = DEFAULT_PERCDAMP,
                  blocksize: int = DEFAULT_BLOCKSIZE, act_order: bool = False) -> tuple:
    """w [N, K], H [K, K] -> (packed, scales_and_zeros, dequantized weight [N, K]) in quantize_int4's layout.

    act_order quantizes the columns with the largest H diagonal (the most active inputs) first,
    while each column keeps the scale and zero of its own group of `groupsize` consecutive columns,
    computed up front ("static groups"), so the file layout is unchanged.
    """
    N, K = w.shape
    Kp = padded_size(K, groupsize)
    W = F.pad(w.float(), (0, Kp - K))  # (N, Kp): padded columns are zero
    H = F.pad(H.float(), (0, Kp - K, 0, Kp - K))  # (Kp, Kp): padded inputs are zero, like dead ones
    dead = H.diagonal() == 0
    H[dead, dead] = 1  # an input that is always zero: its weights cannot matter, and H stays invertible
    W[:, dead] = 0
    G = Kp // groupsize
    if act_order:
        scales, zeros = int4_group_params(W.reshape(N, G, groupsize))  # (N, G), from the unchanged weights
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        group = perm // groupsize  # the group of each quantization step's column
    else:
        scales = torch.empty(N, G, dtype=torch.bfloat16, device=W.device)
        zeros = torch.empty_like(scales)
        group = torch.arange(Kp, device=W.device) // groupsize
    group = group.tolist()
    H.diagonal().add_(percdamp * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(H)
    if info:
        raise ValueError(f"a layer's Hessian is not positive definite even after dampening; raise --percdamp "
                         f"(now {percdamp}) or calibrate on more data")
    # Upper Cholesky factor of H^-1: row i holds how column i's rounding error spreads to columns > i.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    # Blocks hold whole groups, so a group's scale is found from its fully updated columns.
    blocksize = -(-blocksize // groupsize) * groupsize
    Q = torch.empty_like(W)  # codes 0..15, as floats until packing
    for i1 in range(0, Kp, blocksize):
        i2 = min(i1 + blocksize, Kp)
        W1, Hinv1 = W[:, i1:i2], Hinv[i1:i2, i1:i2]  # W1 is a view: updates land in W
        Err1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            g = group[i1 + i]
            if not act_order and (i1 + i) % groupsize == 0:
                scales[:, g], zeros[:, g] = int4_group_params(W1[:, i:i + groupsize])
            s, z = scales[:, g].float(), zeros[:, g].float()
            w = W1[:, i]
            q = torch.round((w - z) / s).add_(8).clamp_(0, 15)  # int4_codes, one column at a time
            Q[:, i1 + i] = q
            err = (w - (q - 8) * s - z) / Hinv1[i, i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)
            Err1[:, i] = err
        W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1)  # the lazy batch update of the columns after this block
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    packed = pack_int4_codes(Q.to(torch.uint8))
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
    return packed, scales_and_zeros, dequantize_int4(packed, scales_and_zeros, groupsize)[:, :K]


def output_error(w: Tensor, approx: Tensor, H: Tensor) -> float:
    """||X (W - W_q)^T|| / ||X W^T|| on the inputs X that H = 2 X^T X / n was built from."""
    d, w = (w - approx).float(), w.float()
    return float(((d @ H) * d).sum().clamp(min=0).sqrt() / ((w @ H) * w).sum().clamp(min=1e-30).sqrt())


class _Stop(Exception):
    """Raised by a hook to end a forward pass once it has what it needs."""


class Hessian:
    """Accumulates H = 2 X^T X / n over input rows x [n, K]."""

    def __init__(self, k: int, device):
        self.sum = torch.zeros(k, k, device=device)
        self.rows = 0

    def add(self, x: Tensor):
        x = x.reshape(-1, self.sum.shape[0]).float()
        self.sum.addmm_(x.T, x)
        self.rows += x.shape[0]

    def value(self) -> Tensor:
        return 2 * self.sum / max(self.rows, 1)


# ---------------------------------------------------------------------------------------------
# The whole model, block by block

def block_arguments(model: Transformer, seq_length: int, device) -> list:
    """Per block, the (input_pos, rope, mask) that Transformer.forward passes it for one sequence
    (blocks differ where the config gives some layers a sliding window or their own RoPE)."""
    captured = []
    handles = [layer.register_forward_pre_hook(lambda module, args: captured.append(args[1:]))
               for layer in model.layers]
    try:
        with torch.no_grad():
            model(torch.zeros(1, seq_length, dtype=torch.long, device=device), torch.arange(seq_length, device=device))
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def gptq_model(model: Transformer, tokens: Tensor, groupsize: int, percdamp: float = DEFAULT_PERCDAMP,
               blocksize: int = DEFAULT_BLOCKSIZE, act_order: bool = False, log=lambda *a: None) -> tuple:
    """GPTQ every linear of a full-precision model on calibration tokens [n, T].

    Returns (quantized tensors by state dict key, per-module metadata as quantize_state_dict's,
    {module name: (RTN error, GPTQ error)} on the calibration inputs). The model's linears are left
    holding their dequantized GPTQ weights (the output projection untied from the embedding).
    """
    c = model.config
    if c.num_experts > 0 or c.kv_lora_rank or c.per_layer_input_size or c.kv_shared_layers \
            or c.linear_attention_layers:
        raise ValueError("int4-gptq supports dense feed-forward models with LLaMA's attention; quantize "
                         "mixture-of-experts, latent-attention, linear-attention (Qwen3.5, LFM2) and Gemma 4 E2B / E4B "
                         "models with --mode int4")
    device = model.tok_embeddings.weight.device
    n, T = tokens.shape
    tokens = tokens.to(device)
    model.setup_caches(max_batch_size=1, max_seq_length=T)
    block_args = block_arguments(model, T, device)
    out, layers, errors = {}, {}, {}

    def quantize(names: list, modules: list, H: Tensor):
        """GPTQ linears that share their input: stacked, as GPTQ treats every output row on its own."""
        t0 = time.perf_counter()
        rows = [m.out_features for m in modules]
        w = torch.cat([m.weight for m in modules])  # (sum of N, K)
        packed, sz, deq = gptq_quantize(w, H, groupsize, percdamp, blocksize, act_order)
        rtn = dequantize_int4(*quantize_int4(w, groupsize), groupsize)[:, :w.shape[1]]
        for name, module, w, p, s, d, r in zip(names, modules, w.split(rows), packed.split(rows), sz.split(rows, 1),
                                               deq.split(rows), rtn.split(rows)):
            errors[name] = (output_error(w, r, H), output_error(w, d, H))
            out[f"{name}.weight"], out[f"{name}.scales_and_zeros"] = p, s.contiguous()
            layers[name] = {"kind": "int4", "groupsize": groupsize,
                            "padded_in_features": padded_size(w.shape[1], groupsize)}
            module.weight = nn.Parameter(d.to(w.dtype), requires_grad=False)  # what the next layers will see
            log(f"  {name:32s} output error RTN {errors[name][0]:.4f} -> GPTQ {errors[name][1]:.4f}  "
                f"({'x'.join(map(str, w.shape))})")
        log(f"  ({time.perf_counter() - t0:.1f} s)")

    # The embedding is a lookup, not a product: as quantize.py makes it, a tied one the quantized
    # output's rows (quantized.TiedEmbedding), an untied one int8 rows.
    if c.tie_embeddings:
        layers["tok_embeddings"] = {"kind": "tied"}
    else:
        out["tok_embeddings.weight"], out["tok_embeddings.scales"] = quantize_int8(model.tok_embeddings.weight)
        layers["tok_embeddings"] = {"kind": "int8"}
    x = model.embed(tokens)  # (n, T, D): the first block's inputs

    def run(block, block_args) -> Tensor:
        return torch.cat([block(x[j:j + 1], *block_args) for j in range(n)])

    def hessian(block, block_args, module: nn.Linear) -> Tensor:
        """H of `module`'s inputs when the calibration batch runs through `block` as it is now."""
        acc = Hessian(module.in_features, device)

        def hook(module, args):
            acc.add(args[0])
            raise _Stop  # the rest of the block is not needed yet

        handle = module.register_forward_pre_hook(hook)
        try:
            for j in range(n):
                try:
                    block(x[j:j + 1], *block_args)
                except _Stop:
                    pass
        finally:
            handle.remove()
        return acc.value()

    t0 = time.perf_counter()
    for i, (block, args) in enumerate(zip(model.layers, block_args)):
        log(f"block {i + 1}/{len(model.layers)} ({time.perf_counter() - t0:.0f} s)")
        for names in BLOCK_LINEARS:
            modules = [block.get_submodule(name) for name in names]
            quantize([f"layers.{i}.{name}" for name in names], modules, hessian(block, args, modules[0]))
        x = run(block, args)  # the next block's inputs, from this block quantized
    acc = Hessian(model.config.dim, device)
    for j in range(n):
        acc.add(model.norm(x[j]))
    quantize(["output"], [model.output], acc.value())
    return out, layers, errors


# ---------------------------------------------------------------------------------------------
# Calibration data

def sample_sequences(tokens: list, limit: int, seq_length: int, seed: int) -> Tensor:
    """`limit` windows of `seq_length` tokens at random offsets (reproducible with `seed`) -> [limit, seq_length]."""
    if len(tokens) < seq_length:
        raise ValueError(f"the calibration text has {len(tokens)} tokens, fewer than --calibration_seq_length "
                         f"{seq_length}: use a longer text or shorter sequences")
    tokens = torch.tensor(tokens)
    starts = torch.randint(0, len(tokens) - seq_length + 1, (limit,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([tokens[s:s + seq_length] for s in starts.tolist()])


def task_text(tasks: list) -> str:
    """The documents of lm_eval tasks (training split first: calibrating on test data would leak it)."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError as e:
        raise ValueError(f"--calibration_tasks needs lm-evaluation-harness ({e}); pip install it, or pass a local "
                         "text file with --calibration_file") from e
    try:
        task_dict = get_task_dict(tasks, TaskManager())
        texts = []
        for task in task_dict.values():
            docs = next(split() for has, split in ((task.has_training_docs, task.training_docs),
                                                   (task.has_validation_docs, task.validation_docs),
                                                   (task.has_test_docs, task.test_docs)) if has())
            for doc in docs:
                texts.append("".join(str(part) for part in (task.doc_to_text(doc), task.doc_to_target(doc))))
    except Exception as e:  # lm_eval and datasets raise many types when the Hub cannot be reached
        raise ValueError(f"could not load --calibration_tasks {' '.join(tasks)} ({type(e).__name__}: {e}); "
                         "pass a local text file with --calibration_file instead") from e
    return "\n\n".join(texts)


def calibration_tokens(checkpoint_dir: Path, config: ModelArgs, calibration_file: Optional[Path],
                       calibration_tasks: Optional[list], limit: int, seq_length: int, seed: int) -> tuple:
    """(tokens [limit, seq_length], a description of the source for the metadata)."""
    if (calibration_file is None) == (not calibration_tasks):
        raise ValueError("--mode int4-gptq needs calibration text: pass --calibration_file FILE (a local text "
                         "file) or --calibration_tasks TASK ... (lm_eval tasks), not both")
    if calibration_file is not None and not Path(calibration_file).is_file():
        raise FileNotFoundError(f"--calibration_file {calibration_file}: no such file")
    if seq_length > config.block_size:
        raise ValueError(f"--calibration_seq_length {seq_length} exceeds the model's context of "
                         f"{config.block_size} tokens")
    if limit < 1 or seq_length < 2:
        raise ValueError("--calibration_limit must be at least 1 and --calibration_seq_length at least 2")
    if calibration_file is not None:
        try:
            text, source = Path(calibration_file).read_text(), f"file {Path(calibration_file).name}"
        except UnicodeDecodeError as e:
            raise ValueError(f"--calibration_file {calibration_file} is not UTF-8 text ({e})") from None
    else:
        text, source = task_text(calibration_tasks), f"lm_eval tasks {' '.join(calibration_tasks)}"
    tokenizer = load_tokenizer(checkpoint_dir)
    check_vocab(tokenizer, config.vocab_size, checkpoint_dir)
    tokens = tokenizer.encode(text)
    return sample_sequences(tokens, limit, seq_length, seed), source


def quantize_state_dict(state_dict: dict, config: ModelArgs, checkpoint_dir: Path, groupsize: int,
                        calibration_file: Optional[Path] = None, calibration_tasks: Optional[list] = None,
                        calibration_limit: int = DEFAULT_CALIBRATION_LIMIT,
                        calibration_seq_length: Optional[int] = None, seed: int = DEFAULT_SEED,
                        percdamp: float = DEFAULT_PERCDAMP, blocksize: int = DEFAULT_BLOCKSIZE, act_order: bool = False,
                        device: Optional[str] = None, log=lambda *a: None) -> tuple:
    """quantize.quantize_state_dict's (state dict, per-module metadata) for int4-gptq, plus the GPTQ settings."""
    if not 0 < percdamp < 1 or blocksize < 1:
        raise ValueError(f"--percdamp must lie in (0, 1) and --blocksize be positive; got {percdamp}, {blocksize}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if calibration_seq_length is None:
        calibration_seq_length = min(DEFAULT_CALIBRATION_SEQ_LENGTH, config.block_size)
    tokens, source = calibration_tokens(checkpoint_dir, config, calibration_file, calibration_tasks,
                                        calibration_limit, calibration_seq_length, seed)
    log(f"GPTQ on {device.type}: {calibration_limit} calibration sequences of {calibration_seq_length} tokens "
        f"from {source}, group size {groupsize}, act_order {act_order}")
    with torch.device("meta"):
        model = Transformer(config)
    weights = with_tied_output(state_dict, config)
    model.load_state_dict(weights, assign=True, strict=True)
    model = model.to(device=device, dtype=torch.float32).eval()  # GPTQ's algebra wants fp32
    t0 = time.perf_counter()
    sd, layers, errors = gptq_model(model, tokens, groupsize, percdamp, blocksize, act_order, log)
    rtn, gptq = (sum(e[k] for e in errors.values()) / len(errors) for k in (0, 1))
    log(f"GPTQ took {time.perf_counter() - t0:.0f} s; mean output error over {len(errors)} layers: "
        f"RTN {rtn:.4f} -> GPTQ {gptq:.4f}")
    sd = {k: v.cpu() for k, v in sd.items()}
    # What is left (norms, biases) is kept as it is.
    sd.update({k: v for k, v in weights.items() if not (k.endswith(".weight") and k[:-len(".weight")] in layers)})
    settings = {"percdamp": percdamp, "blocksize": blocksize, "act_order": act_order,
                "calibration": {"source": source, "samples": calibration_limit,
                                "seq_length": calibration_seq_length, "seed": seed},
                "output_error": {"rtn": rtn, "gptq": gptq}}
    return sd, layers, settings
