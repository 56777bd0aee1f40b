# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Checkpoint files and the model built from them: find, read, load onto a device, write atomically.

A checkpoint folder holds model.pth (brisk's names; a quantized one wraps its state dict with
the metadata quantized.py reads) and config.json (`ModelArgs`), written by the converters.
Device, precision and torchrun setup live here too, since every script that loads a model
needs the same three decisions.
"""
import contextlib
import glob
import itertools
import os
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from model import ModelArgs, Transformer

DEFAULT_CHECKPOINT = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Devices, precision, torchrun

def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_precision(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16
    if device.startswith("mps"):
        return torch.float16
    return torch.float32


def check_device(device: str) -> str:
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps was asked for but MPS is not available; use --device cpu")
    return device


def device_sync(device):
    if "cuda" in str(device):
        torch.cuda.synchronize(device)
    elif "mps" in str(device):
        torch.mps.synchronize()


class Dist(NamedTuple):
    rank: int
    world_size: int
    device: str  # this rank's device: cuda:LOCAL_RANK on GPUs


def maybe_init_dist(device: str) -> Optional[Dist]:
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU); None when not run by torchrun."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    import atexit
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = torch.device(device).type
    if kind == "cuda":
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if local_world > torch.cuda.device_count():
            raise ValueError(f"launched with {local_world} ranks on this node but only {torch.cuda.device_count()} "
                             f"CUDA devices are visible; use --nproc_per_node={torch.cuda.device_count()} or fewer")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=torch.device(device))
    elif kind == "cpu":
        dist.init_process_group("gloo")
    else:
        raise ValueError(f"tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {kind}; pass --device cpu")
    atexit.register(dist.destroy_process_group)
    return Dist(rank, world_size, device)


def placement(device: Optional[str], precision: Optional[str]) -> tuple:
    """A command's --device and --precision (None: the defaults) -> (device, dtype, dist); under
    torchrun (dist not None) the device is this rank's."""
    device = check_device(device or default_device())
    dist = maybe_init_dist(device)  # under torchrun: tensor parallel, one shard (and device) per rank
    device = dist.device if dist else device
    return device, PRECISIONS[precision] if precision else default_precision(device), dist


def add_placement_flags(p, kv_cache: bool = False) -> None:
    """The flags of every command that runs a model (argparse parser p): where (--device) and in what
    dtype (--precision; kv_cache: --kv_cache_dtype too)."""
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                   help="weights and activations dtype (default: bfloat16 on CUDA, float16 on MPS, float32 on CPU)")
    if kv_cache:
        p.add_argument("--kv_cache_dtype", choices=["bfloat16", "float32"], default=None,
                       help="the KV cache's dtype (default: the activations'): bfloat16 under float32 activations "
                            "halves the bytes a long context's decode step reads, as llama.cpp's F16 cache")


@contextlib.contextmanager
def rank0_output():
    """Silence stdout and stderr on every torchrun rank but 0, so text and logs appear once."""
    if int(os.environ.get("RANK", "0")) == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


# ---------------------------------------------------------------------------------------------
# Reading and writing checkpoints

def checkpoint_config(checkpoint_path) -> ModelArgs:
    """The ModelArgs of config.json beside checkpoint_path, with errors that say how to get both."""
    checkpoint_path = Path(checkpoint_path)
    if checkpoint_path.is_dir():
        raise ValueError(f"checkpoint {checkpoint_path} is a folder; pass the model.pth inside it")
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint_path} not found; convert one with "
                                "scripts/prepare.sh REPO_ID or scripts/convert_hf_checkpoint.py")
    config_path = checkpoint_path.parent / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: the converters write it beside model.pth; "
                                "re-run scripts/convert_hf_checkpoint.py")
    return ModelArgs.from_json(config_path)


def read_checkpoint(checkpoint_path) -> tuple:
    """(state dict, quantization metadata or None), memory-mapped on the CPU."""
    try:
        checkpoint = torch.load(checkpoint_path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise ValueError(f"{checkpoint_path} is not a readable checkpoint ({type(e).__name__}: {e}); "
                         "re-run the conversion") from e
    if isinstance(checkpoint, dict) and "quantization" in checkpoint and "state_dict" in checkpoint:
        checkpoint, quantization = checkpoint["state_dict"], checkpoint["quantization"]
    else:
        quantization = None
    if not isinstance(checkpoint, dict) or not all(isinstance(t, torch.Tensor) for t in checkpoint.values()):
        raise ValueError(f"{checkpoint_path} does not hold a state dict (names to tensors); re-run the conversion")
    return checkpoint, quantization


def with_tied_output(state_dict: dict, config: ModelArgs) -> dict:
    """A tied checkpoint stores the embedding once; strict loading wants output.weight too."""
    if config.tie_embeddings and "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        return dict(state_dict, **{"output.weight": state_dict["tok_embeddings.weight"]})
    return state_dict


def check_state_dict(model: torch.nn.Module, state_dict: dict, checkpoint_path) -> None:
    """The checkpoint's tensor names and shapes are the model's (built from config.json), or a
    ValueError saying what differs; load_state_dict's own error is a page of names."""
    checkpoint_path = Path(checkpoint_path)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    fix = (f"{checkpoint_path.parent / 'config.json'} does not describe {checkpoint_path}; "
           "re-run the conversion so both come from one")
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if any(k.startswith("model.") or k == "lm_head.weight" for k in unexpected):
        raise ValueError(f"{checkpoint_path} holds Hugging Face tensor names ({unexpected[0]}); convert it with "
                         "scripts/convert_hf_checkpoint.py")
    layers = {int(k.split(".")[1]) for k in got if k.startswith("layers.") and k.split(".")[1].isdigit()}
    n_layer = getattr(getattr(model, "config", None), "n_layer", None)
    if n_layer is not None and layers and len(layers) != n_layer:
        raise ValueError(f"config.json says n_layer {n_layer} but {checkpoint_path.name} holds {len(layers)} "
                         f"layers; {fix}")
    if missing or unexpected:
        what = [f"missing {missing[:3]}"] * bool(missing) + [f"unexpected {unexpected[:3]}"] * bool(unexpected)
        raise ValueError(f"{checkpoint_path.name} does not match config.json ({', '.join(what)}); {fix}")
    for k, shape in expected.items():
        if got[k] != shape:
            raise ValueError(f"{k} is {list(got[k])} in {checkpoint_path.name} but config.json makes it "
                             f"{list(shape)}; {fix}")


def atomic_write(path, write) -> None:
    """write(tmp_path) to a temporary name beside path, then rename: a failed or killed write never
    leaves a half-written file under the real name. The temporary name is this thread's own (pid
    and thread), so two processes writing one file at once (two servers compiling the same step)
    never write into or remove each other's; one left by a killed run (its process gone) is removed."""
    path = Path(path)
    for stale in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 1:].split(".")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            with contextlib.suppress(OSError):  # another process may be removing it too
                stale.unlink()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a pid reused from a killed run
        write(tmp)
        tmp.replace(path)
    except OSError as e:
        if e.filename is None:  # a full disk says so without naming the file
            e.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) there would end the process: keep every temporary
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        pass
    return True


def atomic_save(obj, path: Path):
    """torch.save, atomically."""
    def save(tmp: Path):
        # Through a Python file, so that a failed write (a full disk) is an OSError with its errno.
        # torch's zip writer then still fails on closing ("unexpected pos"): the OSError is its cause.
        with open(tmp, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError as e:
                if isinstance(e.__context__, OSError):
                    raise e.__context__ from None
                raise
    atomic_write(path, save)


def atomic_write_text(path: Path, text: str):
    atomic_write(path, lambda tmp: tmp.write_text(text))


# ---------------------------------------------------------------------------------------------
# The model

def load_model(checkpoint_path, device="cpu", precision: torch.dtype = torch.float32,
               tp: Optional[Dist] = None) -> Transformer:
    """Build the model from config.json beside the checkpoint and load its weights strictly.

    Built on the meta device and assigned the memory-mapped tensors, so nothing is copied before
    the move to `device`. Quantized checkpoints carry their own settings (never read from the
    name). tp: the Dist of maybe_init_dist (under torchrun): keep this rank's tensor-parallel
    shard, cut while the weights are still memory-mapped, so only the shard reaches the device.
    """
    config = checkpoint_config(checkpoint_path)
    state_dict, quantization = read_checkpoint(checkpoint_path)
    return build_model(config, state_dict, quantization, device, precision, tp, source=checkpoint_path)


def build_model(config: ModelArgs, state_dict: dict, quantization: Optional[dict], device="cpu",
                precision: torch.dtype = torch.float32, tp: Optional[Dist] = None,
                source="the state dict") -> Transformer:
    """load_model's work on a state dict already in hand (quantize.quantize_state_dict's output and
    its metadata too): scripts/roofline.py builds random models on the device without a file."""
    with torch.device("meta"):
        model = Transformer(config)
    if quantization is not None:
        import quantized
        try:
            quantized.prepare_model(model, quantization)
        except (AttributeError, KeyError, TypeError) as e:  # metadata naming modules the config does not build
            raise ValueError(f"the quantization metadata in {source} does not fit config.json ({e!r}); "
                             "quantize the model again from its full-precision model.pth") from None
    check_state_dict(model, with_tied_output(state_dict, config), source)
    model.load_state_dict(with_tied_output(state_dict, config), assign=True, strict=True)
    if config.tie_embeddings and quantization is None:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    elif quantization is not None:
        quantized.tie_embedding(model)  # a quantized tied output's rows, before tp.py shards it
    if tp is not None:
        from tp import apply_tp
        apply_tp(model, tp.rank, tp.world_size)
    to_device(model, device, precision)
    if quantization is not None:
        quantized.finalize_model(model, quantization, device=device, precision=precision)
    return model.eval()


def to_device(model: torch.nn.Module, device, precision: torch.dtype) -> None:
    """model.to(device, precision) in place, a tensor at a time, each memory-mapped original's pages
    given back as soon as its copy exists (a cast on the CPU: part by part, kernels.copy_out): the
    mapping keeps every page it read resident until its last tensor goes, so a bf16 model cast from
    an fp32 checkpoint would otherwise hold both (3x the bf16 weights at the peak). Integer tensors (quantized weights) keep their dtype; tied weights
    stay one tensor. A buffer is replaced, not changed in place: load_state_dict(assign=True) made
    it the state dict's own tensor, and the caller's dict would keep each copy alive after the
    model lets it go (a quantized model's scales, cast and then repacked by finalize_model)."""
    from kernels import copy_out, release_pages

    def moved(old: torch.Tensor, dtype: torch.dtype = precision) -> torch.Tensor:
        dtype = dtype if old.is_floating_point() else old.dtype
        if old.device.type == torch.device(device).type == "cpu" and old.dtype != dtype:
            return copy_out(old, dtype)
        new = old.to(device=device, dtype=dtype)
        if new is not old:
            release_pages(old)
        return new

    with torch.no_grad():
        for p in model.parameters():  # a Parameter two modules share is one object, moved once
            p.data = moved(p.data)
        copies = {}
        for module in model.modules():
            fp32 = getattr(module, "full_precision_buffers", ())  # a router's selection bias
            for name, b in list(module.named_buffers(recurse=False)):
                if id(b) not in copies:
                    copies[id(b)] = moved(b, torch.float32 if name in fp32 else precision)
                setattr(module, name, copies[id(b)])


def weights(model: Transformer):
    """(name, tensor) for each parameter and buffer of the model but its KV caches."""
    caches = {id(b) for m in model.modules() if hasattr(m, "k_cache") for b in (m.k_cache, m.v_cache)}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(t) not in caches:
            yield name, t


def model_bytes(model: Transformer, all_experts: bool = False) -> int:
    """Bytes of weights read per decoded token (MoE: only the activated experts), an embedding table
    the output does not share included; all_experts: every weight the model holds."""
    total = 0
    for name, t in weights(model):
        if name.endswith("cos_sin"):  # the RoPE tables
            continue
        size = t.numel() * t.element_size()
        *_, parent, leaf = name.split(".")
        if not all_experts and parent in ("feed_forward", "experts") and leaf.startswith("w"):  # stacked experts
            size = size * model.config.num_activated_experts // model.config.num_experts
        total += size
    return total


def step_bytes(model: Transformer) -> int:
    """model_bytes less an embedding table the output does not share: a decode step reads one row of it."""
    output = {id(t) for t in itertools.chain(model.output.parameters(), model.output.buffers())}
    table = itertools.chain(model.tok_embeddings.parameters(), model.tok_embeddings.buffers())
    return model_bytes(model) - sum(t.numel() * t.element_size() for t in table if id(t) not in output)


def streaming_read_gbps(device, nbytes: int) -> float:
    """The device's memory bandwidth as benchmarks measure it: GB/s of a sum over nbytes (far
    beyond the caches), best of 10. On a Linux CPU the memory is in 2 MB pages, as the weights of a
    packed model are (kernels.into_huge_pages): over 4 KB pages the same sum read 5-7% less on a Xeon."""
    from kernels import huge_page_region, huge_pages_available
    if torch.device(device).type == "cpu" and sys.platform.startswith("linux") and huge_pages_available():
        region, start = huge_page_region(nbytes)
        x = torch.frombuffer(region, dtype=torch.float32, count=nbytes // 4, offset=start).fill_(1.0)
    else:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(10):
        device_sync(device)
        t0 = time.perf_counter()
        x.sum()
        device_sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9
