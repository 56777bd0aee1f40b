"""packed_cache.py: a second load maps the model the first one packed and kept, its tensors read from
that file (or copied into huge pages where the page cache holds it in small ones), and computes what a
model packed afresh computes; a changed checkpoint, a damaged file, a
full disk or "off" never serve a stale model nor stop a run."""
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
import packed_cache
import quantize
from compiling import structure_digest
from conftest import huge_page_memory, make_hf_model, save_and_convert
from load import load_model


def load_packed(*args, **kwargs):
    """packed_cache.load_packed, and the file it keeps written (it writes in the background)."""
    model = packed_cache.load_packed(*args, **kwargs)
    packed_cache.finish_writing()
    return model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    if kernels.best_isa() == "":
        pytest.skip("kernels.cpp has no code for this CPU: nothing is packed, nothing kept")
    monkeypatch.setenv("BRISK_PACKED_CACHE", str(tmp_path / "packed"))
    return tmp_path / "packed"


def kept(cache) -> list:
    return sorted(cache.glob("*")) if cache.is_dir() else []


def mapped_file(t: torch.Tensor) -> str:
    """The file whose private mapping holds t's first byte ("" where none does)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


def shared_embedding(model) -> bool:
    """Whether the embedding reads a tensor of the output projection (a tied weight, one copy)."""
    def pointers(m):  # PackedEmbedding holds the output's packed weight as a plain attribute
        held = [t for module in m.modules() for t in vars(module).values() if isinstance(t, torch.Tensor)]
        return {t.data_ptr() for t in itertools.chain(m.parameters(), m.buffers(), held)}
    return bool(pointers(model.tok_embeddings) & pointers(model.output))


def outputs(model) -> list:
    """Logits of a 12-token prefill and of a decode step after it."""
    model.setup_caches(max_batch_size=1, max_seq_length=32)
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        return [model(ids, torch.arange(12)), model(ids[:, -1:], torch.tensor([12]))]


def checkpoint(family: str, mode: str, root, seed: int = 0) -> tuple:
    """(model.pth of a tiny random model, quantized as mode says, and the precision to load it in)."""
    path = save_and_convert(make_hf_model(family, seed=seed), root)
    if mode in ("int8", "int4"):
        return quantize.quantize_checkpoint(path, mode, 32 if mode == "int4" else None), torch.float32
    return path, getattr(torch, mode)


@pytest.mark.parametrize("family, mode", [("llama32", "float32"), ("llama32", "bfloat16"), ("qwen2", "int8"),
                                          ("llama31", "int4"), ("llama32", "int4"), ("mixtral", "int8"),
                                          ("gemma2", "int4")])
def test_a_second_load_maps_the_kept_model(family, mode, cache, tmp_path):
    path, precision = checkpoint(family, mode, tmp_path)
    first = load_packed(path, "cpu", precision)
    (file,) = kept(cache)
    second = load_packed(path, "cpu", precision)
    assert kept(cache) == [file]
    afresh = kernels.pack_for_cpu(load_model(path, "cpu", precision))
    assert structure_digest(second) == structure_digest(afresh) == structure_digest(first)
    tensors = [t for _, t in second.state_dict(keep_vars=True).items()]
    if sys.platform.startswith("linux"):
        assert all(mapped_file(t) == str(file) for t in tensors if t.numel() > 1), "a tensor not read from the file"
    # A tied weight stays one tensor, quantized too (quantized.TiedEmbedding)
    assert shared_embedding(second) == shared_embedding(first) == second.config.tie_embeddings
    for a, b in zip(outputs(second), outputs(afresh)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not kernels.huge_pages_available(), reason="this OS backs no memory with huge pages")
@pytest.mark.parametrize("family, mode", [("llama32", "float32"), ("qwen2", "int8"), ("gemma2", "int4")])
def test_weights_read_back_in_small_pages_move_into_huge_pages(family, mode, cache, tmp_path, monkeypatch):
    """A kept file the page cache holds in 4 KB pages (read back after an eviction): the weights a
    step reads whole are copied into memory of 2 MB pages, tensors that shared a storage still
    share one, their file pages leave the process, and the model computes what a model packed
    afresh computes. An untied embedding table (int8 in a quantized model) stays mapped: a step
    reads a row of it; a tied one is the output's weight. A tiny model is smaller than a huge page: the size that decides it is made
    smaller too."""
    monkeypatch.setattr(kernels, "HUGE_PAGE", 64 << 10)
    path, precision = checkpoint(family, mode, tmp_path)
    first = load_packed(path, "cpu", precision)  # packed here, then moved: the file is written from the moved copy
    (file,) = kept(cache)

    def split(model) -> tuple:
        """(the tensors a step reads whole, those of an untied embedding table)."""
        whole = {id(t) for users in kernels.streamed_storages(model).values() for _, _, t in users}
        tensors = [t for t in model.state_dict(keep_vars=True).values() if t.numel()]
        return [t for t in tensors if id(t) in whole], [t for t in tensors if id(t) not in whole]
    assert all(huge_page_memory(t) for t in split(first)[0])
    monkeypatch.setattr(packed_cache, "huge_share", lambda model: 0.0)
    second = load_packed(path, "cpu", precision)
    moved, table = split(second)
    assert moved and all(huge_page_memory(t) and mapped_file(t) != str(file) for t in moved)
    assert all(t.data_ptr() % 64 == 0 for t in moved)
    assert all(mapped_file(t) == str(file) for t in table)
    assert bool(table) == (not shared_embedding(second))
    assert shared_embedding(second) == shared_embedding(first) == second.config.tie_embeddings
    afresh = kernels.pack_for_cpu(load_model(path, "cpu", precision))
    assert structure_digest(second) == structure_digest(afresh)
    for a, b in zip(outputs(second), outputs(afresh)):
        assert torch.equal(a, b)
    monkeypatch.setattr(packed_cache, "huge_share", lambda model: 1.0)  # kept in 2 MB pages: mapped, not copied
    third = load_packed(path, "cpu", precision)
    assert all(mapped_file(t) == str(file) for t in third.state_dict().values() if t.numel() > 1)


def test_huge_share_faults_the_mapping_in(tmp_path):
    """huge_share: the share of the file-mapped weights' pages mapped 2 MB at a time, after faulting
    them in (a mapping nothing has read yet would say nothing); 0 for weights in no file."""
    path = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(1024, 1024), path)
    assert kernels.huge_share(torch.load(path, weights_only=False)) == 0.0
    linear = torch.load(path, mmap=True, weights_only=False)

    def resident() -> int:  # bytes of the weight's mapping in memory
        return sum(int(vma["Rss"][0]) << 10 for vma in kernels.vma_fields([linear.weight.data_ptr()]))
    assert resident() < linear.weight.nbytes
    assert 0.0 <= kernels.huge_share(linear) <= 1.0
    assert resident() >= linear.weight.nbytes


def test_a_changed_checkpoint_is_packed_again(cache, tmp_path):
    path, precision = checkpoint("llama31", "float32", tmp_path)
    load_packed(path, "cpu", precision)
    (old,) = kept(cache)
    path, precision = checkpoint("llama31", "float32", tmp_path, seed=1)  # new weights, same file name
    reloaded = load_packed(path, "cpu", precision)
    (new,) = kept(cache)
    assert new != old
    for a, b in zip(outputs(reloaded), outputs(kernels.pack_for_cpu(load_model(path)))):
        assert torch.equal(a, b)


def test_a_damaged_file_is_packed_again(cache, tmp_path, capsys):
    path, precision = checkpoint("llama31", "float32", tmp_path)
    load_packed(path, "cpu", precision)
    (file,) = kept(cache)
    size = file.stat().st_size
    os.truncate(file, size // 2)
    capsys.readouterr()
    model = load_packed(path, "cpu", precision)
    assert "is unreadable" in capsys.readouterr().err
    assert kept(cache) == [file] and file.stat().st_size == size
    for a, b in zip(outputs(model), outputs(kernels.pack_for_cpu(load_model(path)))):
        assert torch.equal(a, b)


def test_off_or_a_full_disk_keeps_nothing(cache, tmp_path, monkeypatch, capsys):
    path, precision = checkpoint("llama31", "float32", tmp_path)
    monkeypatch.setenv("BRISK_PACKED_CACHE", "off")
    assert isinstance(load_packed(path, "cpu", precision).output, kernels.PackedLinear)
    assert kept(cache) == []
    monkeypatch.setenv("BRISK_PACKED_CACHE", str(cache))
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 10))
    load_packed(path, "cpu", precision)
    assert "not keeping the packed weights" in capsys.readouterr().err and kept(cache) == []
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)

    def full(obj, p):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(packed_cache, "atomic_save", full)
    assert isinstance(load_packed(path, "cpu", precision).output, kernels.PackedLinear)
    assert "could not keep the packed weights" in capsys.readouterr().err and kept(cache) == []
    monkeypatch.setattr(packed_cache, "atomic_save", lambda obj, p: pickle.dumps(lambda: 0))  # unpicklable
    assert isinstance(load_packed(path, "cpu", precision).output, kernels.PackedLinear)
    assert "cannot be kept" in capsys.readouterr().err and kept(cache) == []


def test_the_file_is_written_while_the_model_runs(cache, tmp_path, monkeypatch):
    """load_packed returns before the packed model is on disk; the writer's copy of the modules is
    its own (the caller sets up caches and runs meanwhile), and the file it writes maps a model that
    computes what the one in use does."""
    path, precision = checkpoint("llama31", "int8", tmp_path)
    write, go = packed_cache.write, threading.Event()
    monkeypatch.setattr(packed_cache, "write", lambda model, p: go.wait(60) and write(model, p))
    model = packed_cache.load_packed(path, "cpu", precision)
    assert kept(cache) == []  # not yet written
    running = outputs(model)  # caches set up on the model while its writer waits
    go.set()
    packed_cache.finish_writing()
    (file,) = kept(cache)
    second = packed_cache.load_packed(path, "cpu", precision)
    assert second.layers[0].attention.kv_cache is None  # kept as loaded, without the caches set up since
    for a, b in zip(outputs(second), running):
        assert torch.equal(a, b)


TRACE_IN_A_NEW_PROCESS = """
import sys, torch
import kernels
from compiling import compile_step
from packed_cache import load_packed
model = load_packed(sys.argv[1])
assert kernels.from_file(model.output.packed), "not mapped from the kept file"
model.setup_caches(max_batch_size=1, max_seq_length=16)
x, pos = torch.tensor([[3]]), torch.tensor([4], dtype=torch.int)
with torch.no_grad():
    torch.testing.assert_close(compile_step(lambda m, x, p: m(x, p), "cpu")(model, x, pos), model(x, pos))
"""


def test_a_new_process_compiles_the_mapped_model(cache, tmp_path):
    """A run that finds the packed model kept but no compiled step (an emptied compile cache, a new
    torch) traces the mapped model: unpickling skips the packed modules' __init__, which registers
    the shape functions tracing needs."""
    path, precision = checkpoint("llama31", "float32", tmp_path, seed=2)
    load_packed(path, "cpu", precision)
    env = dict(os.environ, BRISK_COMPILE_CACHE=str(tmp_path / "compiled"), PYTHONPATH=str(Path(kernels.__file__).parent))
    r = subprocess.run([sys.executable, "-c", TRACE_IN_A_NEW_PROCESS, str(path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compiling: compiled " in r.stderr
