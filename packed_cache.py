# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""A checkpoint's model as it runs on this CPU (cast, packed: kernels.py, quantized.py), kept on disk
so that the next start maps it instead of loading and packing again.

    from packed_cache import load_packed
    model = load_packed(checkpoint_path, "cpu", torch.bfloat16)  # = pack_for_cpu(load_model(...)), cached

Packing reads every weight and writes a copy, each new page of which the OS must first zero: for a
1B model seconds of every start, most of it in fp32 and in a bf16 model cast from an fp32 checkpoint.
Mapped from the page cache, the packed copy costs almost nothing until a step reads it, and two
processes share its pages, as llama.cpp's mapped GGUF does. That holds while the page cache keeps
the file as it was written, in 2 MB pages; read back after the OS evicted it, the file comes in 4 KB
pages, which a step reads slower, and the weights are copied into memory of 2 MB pages instead
(kernels.into_huge_pages), as are freshly packed ones.

The file is `torch.save` of the whole model object, loaded with `weights_only=False`: the packed
modules are brisk's own classes, and this file is brisk's own output, written in the same folder
tree as (and trusted no less than) the compiled libraries compiling.py loads and runs. A
checkpoint is never loaded this way. The cache holds one file per checkpoint and precision, named
by everything that decides its bytes: the checkpoint (path, size, modification time), its
config.json, brisk's code, the CPU's instruction sets and torch's version; any change writes a new
file and removes the old. $BRISK_PACKED_CACHE: the folder (default ~/.cache/brisk/packed), or
"off". The file is written in the background (at the disk's pace, seconds per GB, which a first
run spends compiling and generating); the process exits once it is complete.
"""
import copy
import hashlib
import itertools
import os
import pickle
import shutil
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from compiling import code_digest, machine_digest
from kernels import best_isa, huge_share, into_huge_pages, pack_for_cpu, register_fake
from load import Dist, atomic_save, checkpoint_config, load_model
from model import Transformer
from tokenizer import check_vocab, load_tokenizer


def cache_dir() -> Optional[Path]:
    """$BRISK_PACKED_CACHE, default ~/.cache/brisk/packed; None where it is "off"."""
    folder = os.environ.get("BRISK_PACKED_CACHE", "~/.cache/brisk/packed")
    return None if folder == "off" else Path(folder).expanduser()


def cache_path(checkpoint_path, precision: torch.dtype) -> Optional[Path]:
    """Where the packed model of this checkpoint, precision, code and machine is kept (None: off)."""
    folder, checkpoint = cache_dir(), Path(checkpoint_path).resolve()
    config = checkpoint.parent / "config.json"
    if folder is None or not checkpoint.is_file() or not config.is_file():
        return None  # off, or load_model says what is missing
    stat = checkpoint.stat()
    source = hashlib.sha256(f"{checkpoint}\0{precision}".encode()).hexdigest()[:16]
    version = hashlib.sha256()
    for part in (stat.st_size, stat.st_mtime_ns, config.read_bytes(), code_digest(),
                 machine_digest(), torch.__version__):
        version.update(repr(part).encode() + b"\0")
    return folder / f"{source}-{version.hexdigest()[:16]}.pt"


def load_packed(checkpoint_path, device="cpu", precision: torch.dtype = torch.float32,
                tp: Optional[Dist] = None) -> Transformer:
    """pack_for_cpu(load_model(...)): on a CPU with kernels.cpp (and outside torchrun), from the
    cache where an earlier run kept it, else loaded, packed and kept for the next run."""
    if torch.device(device).type != "cpu" or tp is not None or best_isa() == "":
        return pack_for_cpu(load_model(checkpoint_path, device, precision, tp=tp))
    path = cache_path(checkpoint_path, precision)
    if path is not None and path.is_file():
        model = read(path)
        if model is not None:
            if huge_share(model) < 0.8:  # in the page cache in 4 KB pages: read back after an eviction
                into_huge_pages(model)
            return model
    model = pack_for_cpu(load_model(checkpoint_path, device, precision))
    into_huge_pages(model)
    if path is not None:
        keep(model, path)
    return model


def load_with_tokenizer(checkpoint_path, device="cpu", precision: torch.dtype = torch.float32,
                        tp: Optional[Dist] = None) -> tuple:
    """(load_packed(...), the tokenizer beside the checkpoint), checked against each other: what the
    command lines run. The path, its config.json and the tokenizer are read first, so a missing one
    is said before seconds of loading and packing."""
    checkpoint_config(checkpoint_path)
    folder = Path(checkpoint_path).parent
    tokenizer = load_tokenizer(folder)
    model = load_packed(checkpoint_path, device, precision, tp=tp)
    check_vocab(tokenizer, model.config.vocab_size, folder)
    return model, tokenizer


WRITER = "packed_cache.write"  # the name of the threads keep starts


def finish_writing() -> None:
    """Wait for the packed models this process is still writing (a benchmark, before it measures)."""
    for thread in threading.enumerate():
        if thread.name == WRITER:
            thread.join()


def read(path: Path) -> Optional[Transformer]:
    """The model kept at path, its tensors mapped from the file; None (and a line saying so) where
    the file cannot be read."""
    try:
        model = torch.load(path, mmap=True, weights_only=False, map_location="cpu")
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, AttributeError) as e:
        print(f"packed_cache: {path} is unreadable ({type(e).__name__}); packing again", file=sys.stderr, flush=True)
        return None
    register_fake()  # what each packed module's __init__ does, which unpickling skips
    return model if isinstance(model, Transformer) else None


def keep(model: Transformer, path: Path) -> None:
    """Write model to path (atomically) and remove the files this one replaces (the same checkpoint
    and precision, another version), in a thread of its own (not a daemon: the process waits for it
    at exit) working on a copy of the model's modules that shares their tensors, so that the caller
    may change the model meanwhile (setup_caches, a compile's tracing); the weights are never
    written to. Where the file would take more than half of the disk's free space, nothing is kept.
    The line saying what is kept is written before the thread starts, never into the middle of the
    caller's output."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in itertools.chain(model.parameters(), model.buffers())}
    size = sum(storages.values())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
    except OSError as e:
        say(f"packed_cache: could not keep the packed weights in {path.parent} ({e.strerror or e}); each start "
            "packs them again")
        return
    if 2 * size > free:
        say(f"packed_cache: not keeping the packed weights ({size / 1e6:,.0f} MB, {free / 1e6:,.0f} MB free in "
            f"{path.parent}); each start packs them again")
        return
    say(f"packed_cache: keeping the packed weights for the next start in {path} ({size / 1e6:,.0f} MB; "
        "BRISK_PACKED_CACHE=off keeps none)")
    shared = {id(t): t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)}
    shared.update((id(t), t) for t in itertools.chain(model.parameters(), model.buffers()))
    threading.Thread(target=write, args=(copy.deepcopy(model, shared), path), name=WRITER).start()


def write(model: Transformer, path: Path) -> None:
    """keep's writing: the file, then the removal of the ones it replaces."""
    try:
        # No CRC: computing it would take most of the write, and the file is read where it was written.
        with torch.utils.serialization.config.patch("save.compute_crc32", False):
            atomic_save(model, path)
    except OSError as e:
        say(f"packed_cache: could not keep the packed weights in {path.parent} ({e.strerror or e}); each start "
            "packs them again")
        return
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a module holding a lambda or a handle
        say(f"packed_cache: this model cannot be kept ({e}); each start packs it again")
        return
    source = path.name.split("-")[0]
    for old in path.parent.glob(f"{source}-*.pt"):
        if old != path:
            old.unlink(missing_ok=True)


def say(line: str) -> None:
    """A line to stderr in one write (print writes the newline apart: another thread's line could
    come between)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
