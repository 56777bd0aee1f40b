# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""CPU products that read each weight once for all the rows of a step (kernels.cpp): fp32, bf16, int8, int4.

    from kernels import pack_for_cpu
    model = pack_for_cpu(model)  # a CPU fp32 (or bf16) model: every nn.Linear -> PackedLinear, in place

quantized.py's int8 / int4 layers pack their own weights with `pack_int8` / `pack_int4` (their
"packed" kernel) where `best_isa()` says the CPU has one.

A decode step of B streams multiplies B rows by every weight. PyTorch's products (MKL, oneDNN,
inductor's GEMM template) are tuned for other shapes and at 8 rows take 2-4x the time it takes
to read the weights from memory; kernels.cpp's take about that time (README, Benchmarks). The
packed weight replaces the original, so eager code, compiled graphs and a tied embedding all read
one copy. The C++ is built by torch's extension loader on first use (~30 s, cached after) and
picks AVX-512 or AVX2 at run time.
"""
import functools
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import Attention, FeedForward, RMSNorm, Transformer

BLOCK = 32  # output columns per packed block (kernels.cpp)
# compiling.py, for every module that calls these ops: freezing the weights gains nothing (they
# are packed already) while it costs every warm start (compiling.needs_freezing).
INDUCTOR_HINTS = {"freeze": False}
ISA_CODES = {"avx2": 0, "avx512": 1, "avx512vnni": 2}  # the ops' isa argument (kernels.cpp)
# Where int8 / int4 products are integer dot products: x rounded to int8 per 32 columns, the
# weights packed with 4 consecutive k of a column side by side (kernels.cpp).
INTEGER_ISAS = ("avx512vnni", "avx2")


CFLAGS = ["-O3", "-fopenmp"]


@functools.cache
def extension():
    """torch.ops.brisk: the ops of kernels.cpp, attention.cpp and rowwise.cpp, whose library is loaded
    straight from where it was built for these sources, flags, torch and Python, without asking the
    compiler and ninja whether it is up to date (three subprocesses, a visible part of a warm start);
    built by torch's extension loader the first time, into $TORCH_EXTENSIONS_DIR (default
    ~/.cache/torch_extensions). A library of ops alone, not a Python module: it needs none of
    pybind11's headers, a first run's wait."""
    import hashlib
    import os
    here = Path(__file__).parent
    sources = [here / "kernels.cpp", here / "attention.cpp", here / "rowwise.cpp"]
    digest = hashlib.sha256(repr((CFLAGS, torch.__version__, sys.version)).encode()
                            + b"".join(p.read_bytes() for p in [*sources, here / "simd.h"])).hexdigest()[:16]
    name = f"brisk_kernels_{digest}"
    build = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")).expanduser() / name
    built = build / f"{name}.so"
    if built.is_file():
        try:
            torch.ops.load_library(str(built))
            return torch.ops.brisk
        except OSError:  # damaged (a killed build): the loader builds it again
            pass
    from torch.utils.cpp_extension import load
    print("kernels.cpp: building the compiled extension (about 25 s on 2 cores, once)", file=sys.stderr, flush=True)
    build.mkdir(parents=True, exist_ok=True)
    load(name, [str(p) for p in sources], extra_cflags=CFLAGS, build_directory=str(build), verbose=False,
         is_python_module=False)
    return torch.ops.brisk


@functools.cache
def best_isa() -> str:
    """"avx512vnni", "avx512", "avx2", or "" where kernels.cpp has nothing for this CPU or cannot be
    built (no C++ compiler: the model then runs PyTorch's own products). PyTorch's own cap on its CPU
    kernels caps these too: under ATEN_CPU_CAPABILITY=avx2 an AVX-512 CPU runs what a CPU with AVX2
    alone (AMD Zen 3) runs, "default" none of them."""
    try:
        best = extension().best_isa()
    except Exception as e:  # torch's loader raises several kinds for a missing or failing compiler
        reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
        print(f"kernels.cpp could not be built ({reason}); products stay PyTorch's", file=sys.stderr, flush=True)
        return ""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability == "AVX2" and best.startswith("avx512"):
        return "avx2"
    return best if capability in ("AVX2", "AVX512") else ""


def isa_code(isa: Optional[str]) -> int:
    """The ops' isa argument for isa (None: the CPU's best, as for the products)."""
    return ISA_CODES[isa or best_isa()]


def avx512() -> bool:
    """Whether best_isa is one of AVX-512's (the bf16 product's, attention.cpp's and rowwise.cpp's AVX-512 code)."""
    return best_isa().startswith("avx512")


@functools.cache
def bf16_dot() -> bool:
    """Whether kernels.cpp's bf16 product multiplies bf16 pairs here (AVX-512 BF16: vdpbf16ps, and
    AMX tiles for a prompt's rows where the CPU has them); elsewhere it widens them to fp32."""
    return avx512() and extension().has_bf16_dot()


@functools.cache
def register_fake():
    """torch.ops.brisk.packed_linear* (defined by kernels.cpp) with the shape functions torch.compile
    traces; call it before the first call of an op, which may be inside torch.compile's tracing."""
    extension()

    @torch.library.register_fake("brisk::packed_linear")
    def _(x, packed, out_features, isa):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("brisk::packed_linear_int8")
    def _(x, packed, scales, out_features, isa):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("brisk::packed_linear_int4")
    def _(x, packed, scales_and_zeros, out_features, isa):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("brisk::packed_linear_bf16")
    def _(x, packed, out_features, isa):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("brisk::packed_embedding")
    def _(idx, packed, dim):
        return packed.new_empty(*idx.shape, dim)

    @torch.library.register_fake("brisk::packed_embedding_int8")
    def _(idx, packed, scales, dim):
        return scales.new_empty(*idx.shape, dim)

    @torch.library.register_fake("brisk::packed_embedding_int4")
    def _(idx, packed, scales_and_zeros, dim):
        return idx.new_empty(*idx.shape, dim, dtype=torch.float32)

    @torch.library.register_fake("brisk::decode_attention")
    def _(q, k_cache, v_cache, rows, mask, scale, isa):
        return q.new_empty(q.shape)

    @torch.library.register_fake("brisk::prompt_attention")
    def _(q, k, v, scale, isa):
        B, H, T, D = q.shape
        return q.new_empty(B, T, H * D)


def release_pages(t: Tensor) -> None:
    """Give the OS back the memory pages of `t`, a tensor of a memory-mapped checkpoint that was read
    (never written) and replaced by a copy (kernels.py's packed weights): the checkpoint's mapping
    keeps every page it read resident until the file's last tensor goes, so the original and its
    copy would both count, twice the weights at the peak. A page touched again is read back from
    the file. Only pages wholly inside `t` and inside a private file mapping are given back (on
    anonymous memory MADV_DONTNEED would zero them); elsewhere, and off Linux, nothing happens."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or not t.is_contiguous():
        return
    import ctypes
    import mmap
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or not in_file_mapping(first, last):
        return
    libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def copy_out(t: Tensor, dtype: Optional[torch.dtype] = None, out: Optional[Tensor] = None) -> Tensor:
    """A copy in memory of t (a memory-mapped tensor on the CPU, read once), cast to dtype, made 16
    MB of t at a time, each part's pages given back once copied (release_pages): copied whole, the
    file's pages and the copy are both resident until the copy ends, the largest tensor's bytes
    above the weights (an untied embedding table loading a quantized model; a packed model's output
    projection moving into huge pages). out: where to write it (t's shape and dtype)."""
    new = torch.empty(t.shape, dtype=dtype or t.dtype) if out is None else out
    if not t.is_contiguous():
        return new.copy_(t)
    source, target = t.view(-1), new.view(-1)
    step = max(1, (16 << 20) // t.element_size())
    for i in range(0, source.numel(), step):
        target[i:i + step].copy_(source[i:i + step])
        release_pages(source[i:i + step])
    release_pages(source)  # the pages that straddle two parts
    return new


HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page


def huge_pages_available() -> bool:
    """Whether the OS backs memory that asks for it (MADV_HUGEPAGE) with huge pages: Linux's
    transparent huge pages "always" or "madvise"."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def streamed_storages(model: nn.Module) -> dict:
    """The storages of the CPU tensors a step reads whole: every one but a token embedding table
    the output projection does not share (a step gathers a row or two of it), each with the
    (holder, name, tensor) of every tensor on it, holder the dict that holds it (a module's
    parameters, buffers or attributes)."""
    gathered = {id(m) for m in getattr(model, "tok_embeddings", nn.Identity()).modules()}
    uses, whole = {}, set()
    for m in model.modules():
        attrs = [(m._parameters, k, t) for k, t in m._parameters.items()]
        attrs += [(m._buffers, k, t) for k, t in m._buffers.items()]
        attrs += [(m.__dict__, k, t) for k, t in vars(m).items() if isinstance(t, Tensor)]
        for holder, name, t in attrs:
            if t is None or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            uses.setdefault(key, []).append((holder, name, t))
            if id(m) not in gathered:
                whole.add(key)
    return {key: users for key, users in uses.items() if key in whole}


def vma_fields(pointers: list) -> list:
    """The fields of /proc/self/smaps (name -> the rest of its line, split) of each mapping that
    holds one of these addresses."""
    vmas, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                current = {} if any(lo <= p < hi for p in pointers) else None
                if current is not None:
                    vmas.append(current)
            elif current is not None:
                current[fields[0][:-1]] = fields[1:]
    return vmas


def huge_share(model: nn.Module) -> float:
    """The share of the pages of the file-mapped tensors a step reads whole that are mapped 2 MB at
    a time, faulted in first (MADV_POPULATE_READ: pages a step would fault anyway); 0 where nothing
    tells (off Linux, a kernel before 5.14, nothing mapped from a file)."""
    if not sys.platform.startswith("linux"):
        return 0.0
    import ctypes
    import mmap
    starts = []
    for users in streamed_storages(model).values():
        storage = users[0][2].untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        first, last = start // mmap.PAGESIZE * mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
        if in_file_mapping(start, end):
            if libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 22) != 0:  # MADV_POPULATE_READ
                return 0.0
            starts.append(start)
    vmas = vma_fields(starts)
    mapped = sum(int(vma["Rss"][0]) for vma in vmas)
    huge = sum(int(vma.get("FilePmdMapped", ["0"])[0]) for vma in vmas)
    return huge / mapped if mapped else 0.0


def into_huge_pages(model: nn.Module) -> None:
    """Move the CPU tensors a step reads whole (streamed_storages) into one block of memory backed
    by 2 MB pages, in place: a decode step streams every weight once, and over 4 KB pages the
    products read slower (a TLB miss and a hardware prefetcher stopped at every 4 KB, the page
    tables walked through the VM's too; README, How it works). A mapped file's pages are as large
    as the page cache's folios happen to be: 2 MB where the file was written lately, 4 KB where it
    was read back after the OS evicted it; freshly packed weights are the allocator's, in 4 KB
    pages. Tensors that shared a storage share one still; each storage is copied and let go in
    turn (a mapped file's pages given back: release_pages), so that the copy does not double the
    resident memory. An untied embedding table stays where it is: mapped, only the rows read are
    resident. Off Linux, or with huge pages off, nothing happens."""
    if not sys.platform.startswith("linux") or not huge_pages_available():
        return
    uses = streamed_storages(model)

    def padded(users: list) -> int:  # each storage from a 64-byte boundary
        return -(-users[0][2].untyped_storage().nbytes() // 64) * 64
    size = sum(padded(users) for users in uses.values())
    if size < HUGE_PAGE:
        return
    region, offset = huge_page_region(size)
    while uses:
        users = uses.popitem()[1]
        move_storage(region, offset, users)
        offset += padded(users)  # the same bytes on the new storage
        del users
        trim_heap()  # the storage just copied, where it was the allocator's


def huge_page_region(nbytes: int) -> tuple:
    """(an anonymous mapping of nbytes and more, advised MADV_HUGEPAGE, the offset of its first 2 MB
    boundary): the first nbytes from there are backed by 2 MB pages where the OS has them free."""
    import mmap
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return region, -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE


def move_storage(region, offset: int, users: list) -> None:
    """into_huge_pages for the tensors on one storage, (holder, name, tensor) each: to region[offset:],
    a storage of its own there (torch.save keeps tensors of different types apart), the file's
    pages given back as copy_out goes."""
    old = users[0][2].untyped_storage()
    new = torch.frombuffer(region, dtype=torch.uint8, count=old.nbytes(), offset=offset)
    copy_out(torch.empty(0, dtype=torch.uint8).set_(old), out=new)
    for holder, name, t in users:  # a parameter held twice is moved twice, to the same place
        moved = torch.empty(0, dtype=t.dtype).set_(new.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        if isinstance(t, nn.Parameter):
            t.data = moved
        else:
            holder[name] = moved


def trim_heap() -> None:
    """Give the allocator's free memory back to the OS (glibc's malloc_trim; elsewhere nothing). A
    weight replaced by its packed copy, and the temporaries of packing, are freed into the heap,
    which keeps them resident: packed one layer after another, a model would peak near twice its
    weights."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def from_file(t: Tensor) -> bool:
    """Whether t may lie in a memory-mapped file (off Linux: may, as nothing tells)."""
    if not sys.platform.startswith("linux"):
        return True
    return t.numel() > 0 and in_file_mapping(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def in_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies in one private mapping of a file (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= start and end <= hi:  # fields: range, perms, offset, device, inode, path
                return fields[1].endswith("p") and fields[4] != "0" and len(fields) > 5
    return False


def pack(w: Tensor, k_multiple: int = 1, n: int = 1, block: int = BLOCK, out: Optional[Tensor] = None) -> Tensor:
    """[N, K] -> [ceil(N / block), K / n, block, n], or [ceil(N / block), K, block] for n = 1 (K
    padded with zeros to k_multiple, a multiple of n): each block of output columns one stream over
    k, with a column's n consecutive k side by side (one 32-bit lane of a dot-product instruction).
    One copy, or two where padding is needed: a model's weights are packed one after another, and
    each temporary copy is memory the allocator may keep. out: where to write it (a slice of a
    stacked weight, pack_stacked)."""
    N, K = w.shape
    if N % block or K % k_multiple:
        padded = torch.zeros(-(-N // block) * block, -(-K // k_multiple) * k_multiple, dtype=w.dtype)
        padded[:N, :K] = w
        w = padded
    blocks, K = w.shape[0] // block, w.shape[1]
    if out is None:
        out = torch.empty(blocks, K // n, block, n, dtype=w.dtype)
    if n * w.element_size() == 4 and w.is_contiguous() and w.storage_offset() * w.element_size() % 4 == 0:
        # A lane's n values moved as one int32: torch copies 4-byte elements several times faster.
        out.view(blocks, K // n, block * n).view(torch.int32).copy_(
            w.view(torch.int32).view(blocks, block, K // n).transpose(1, 2))
    else:
        out.view(blocks, K // n, block, n).copy_(w.reshape(blocks, block, K // n, n).permute(0, 2, 1, 3))
    return out.view(blocks, K, block) if n == 1 else out


def pack_int8(weight: Tensor, scales: Tensor, isa: str) -> tuple:
    """quantized.py's int8 weight [N, K] and scales [N] -> (the weight packed for `isa`, fp32
    scales [N padded to 32]). INTEGER_ISAS: uint8 w + 128 [N / 32, Kp / 4, 32, 4] (Kp: K padded
    to 32), the 4 k of a column in one 32-bit lane; else int8 [N / 32, K, 32]."""
    padded = torch.ones(-(-len(scales) // BLOCK) * BLOCK)
    padded[:len(scales)] = scales.float()
    if isa not in INTEGER_ISAS:
        return pack(weight), padded
    q = pack(weight.view(torch.uint8), k_multiple=BLOCK, n=4)
    q ^= 128  # w + 128 is w's bit pattern with the top bit flipped (padding: 128, i.e. w = 0)
    return q, padded


def pack_int4(codes: Tensor, scales_and_zeros: Tensor, isa: str) -> tuple:
    """quantized.py's int4 codes [N, Kp] (0..15) and bf16 scales_and_zeros [G, N, 2] -> (uint8
    [N / 32, Kp, 16], or [N / 32, Kp / 4, 16, 4] for INTEGER_ISAS, holding columns j and j + 16
    of a block in byte j's low and high nibbles; bf16 [N / 32, G, 2, 32], or the scales alone
    [N / 32, G, 32] where every zero is 0: a symmetric checkpoint's 4.5 bits a weight, not 5)."""
    return pack_int4_weight(codes, isa), pack_int4_scales(scales_and_zeros)


def pack_int4_weight(codes: Tensor, isa: str, out: Optional[Tensor] = None) -> Tensor:
    """pack_int4's weight alone; out: where to write it (whole blocks of 32 rows, in order, of a
    larger weight packed a part at a time: quantized.pack_stored_int4)."""
    N, Kp = codes.shape
    if N % BLOCK:
        codes = torch.cat([codes, codes.new_zeros(-N % BLOCK, Kp)])
    halves = codes.to(torch.uint8).view(-1, 2, BLOCK // 2, Kp)  # [blocks, columns j / j + 16, 16, Kp]
    both = halves[:, 1] << 4
    both |= halves[:, 0]  # [blocks, 16, Kp]: j's code low, j + 16's high
    return pack(both.view(-1, Kp), n=4 if isa in INTEGER_ISAS else 1, block=BLOCK // 2, out=out)


def pack_int4_scales(scales_and_zeros: Tensor) -> Tensor:
    """pack_int4's scales (and zeros) alone."""
    G, N, _ = scales_and_zeros.shape
    sz = torch.zeros(G, -(-N // BLOCK) * BLOCK, 2, dtype=torch.bfloat16)
    sz[:, :N] = scales_and_zeros
    if not sz[..., 1].any():
        return sz[..., 0].view(G, -1, BLOCK).transpose(0, 1).contiguous()
    return sz.view(G, -1, BLOCK, 2).permute(1, 0, 3, 2).contiguous()


def pack_bf16(w: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """bf16 [N, K] -> [N / 32, K / 2, 32, 2] (K padded to even): the pairs vdpbf16ps multiplies."""
    return pack(w, k_multiple=2, n=2, out=out)


def pack_weight(w: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """An fp32 or bf16 nn.Linear weight [N, K] in PackedLinear's layout (pack, pack_bf16)."""
    return pack_bf16(w, out) if w.dtype == torch.bfloat16 else pack(w, out=out)


def pack_stacked(linears: list, isa: str) -> "PackedLinear":
    """One PackedLinear for fp32 or bf16 nn.Linears without bias that read the same input (all
    but the last filling whole blocks of 32 outputs), their outputs one after another: each
    packed straight into its place (packed apart and concatenated, every byte was written twice,
    most of a large model's packing time)."""
    w, K = linears[0].weight, linears[0].in_features
    blocks = [-(-m.out_features // BLOCK) for m in linears]
    out = torch.empty(sum(blocks), *((K, BLOCK) if w.dtype == torch.float32 else (-(-K // 2), BLOCK, 2)), dtype=w.dtype)
    start = 0
    for m, n in zip(linears, blocks):
        pack_weight(m.weight.detach(), out[start:start + n])
        start += n
    shape = nn.Linear(K, sum(m.out_features for m in linears), bias=False, device="meta")
    return PackedLinear(shape, isa, out)


class PackedLinear(nn.Module):
    """nn.Linear over a weight packed by kernels.cpp: fp32 [N / 32, K, 32], bf16 [N / 32, K / 2, 32, 2]
    (bias, if any, added after)."""

    inductor_hints = INDUCTOR_HINTS

    def __init__(self, linear: nn.Linear, isa: str, packed: Optional[Tensor] = None):
        """packed: the weight packed already (concat); None: pack linear's."""
        super().__init__()
        register_fake()
        self.in_features, self.out_features, self.isa = linear.in_features, linear.out_features, isa
        if packed is None:
            packed = pack_weight(linear.weight.detach())
        self.register_buffer("packed", packed)
        self.bias = linear.bias
        self._forward_pre_hooks, self._forward_hooks = linear._forward_pre_hooks, linear._forward_hooks  # tp.py's

    def concat(self, other: "PackedLinear") -> Optional["PackedLinear"]:
        """One product for self's and other's outputs (the same input): the blocks of 32 output
        columns of both, one after the other. None where self's outputs end inside a block."""
        if self.isa != other.isa or not concatenable(self, other, self.packed, other.packed):
            return None
        shape = nn.Linear(self.in_features, self.out_features + other.out_features, bias=False, device="meta")
        return PackedLinear(shape, self.isa, torch.cat([self.packed, other.packed]))

    def forward(self, x: Tensor) -> Tensor:
        if self.packed.dtype == torch.bfloat16:
            y = torch.ops.brisk.packed_linear_bf16(x, self.packed, self.out_features, ISA_CODES[self.isa])
        else:
            y = torch.ops.brisk.packed_linear(x, self.packed, self.out_features, ISA_CODES[self.isa])
        return y if self.bias is None else y + self.bias


def concatenable(a: nn.Module, b: nn.Module, wa: Tensor, wb: Tensor) -> bool:
    """Whether layers a and b, with weights wa and wb packed here (blocks of 32 output features
    first), can be one layer whose weight is wa then wb: a's outputs fill whole blocks, neither has
    a bias, and the blocks have one shape and dtype."""
    return (a.out_features % BLOCK == 0 and a.bias is None and b.bias is None and wa.shape[1:] == wb.shape[1:]
            and wa.dtype == wb.dtype)


def hookless(ff: FeedForward) -> bool:
    """Whether ff's w1 and w3 carry no hooks (tp.py's), which one layer for both could not keep."""
    return not any(m._forward_hooks or m._forward_pre_hooks for m in (ff.w1, ff.w3))


class PackedFeedForward(nn.Module):
    """model.FeedForward with w1 and w3, which read the same x, as one packed product of twice the
    outputs: one call and (int8 / int4) one rounding of x instead of two. A small model's products
    take longer than their bytes alone would (README, Benchmarks): fewer, larger ones pay."""

    def __init__(self, ff: FeedForward, w13: nn.Module):
        super().__init__()
        self.w13, self.w2, self.act, self.hidden = w13, ff.w2, ff.act, ff.w1.out_features
        self._forward_pre_hooks, self._forward_hooks = ff._forward_pre_hooks, ff._forward_hooks  # tp.py's
        self.gate_kernel: Optional[Callable] = None  # act(gate) * up in one op for eager steps (use_rowwise_kernels)

    # A prompt's rows go through an eager step this many at a time: a block's gate and up (the 1B's
    # [128, 16384] fp32: 8 MB) stay in the caches for the gate and w2 to read, and a long prompt's
    # feed-forward holds memory for a block of rows, not for the whole prompt (README, How it works).
    rows_at_once = 128

    def forward(self, x: Tensor) -> Tensor:
        n = x.numel() // x.shape[-1]
        if n <= self.rows_at_once or torch.compiler.is_compiling():
            return self.block(x)
        rows = x.reshape(n, x.shape[-1])
        first = self.block(rows[:self.rows_at_once])
        out = first.new_empty(n, first.shape[-1])
        out[:self.rows_at_once] = first
        for i in range(self.rows_at_once, n, self.rows_at_once):
            out[i:i + self.rows_at_once] = self.block(rows[i:i + self.rows_at_once])
        return out.view(*x.shape[:-1], -1)

    def block(self, x: Tensor) -> Tensor:
        gate_up = self.w13(x)
        if self.gate_kernel is not None and not torch.compiler.is_compiling():
            return self.w2(self.gate_kernel(gate_up, self.hidden))
        gate, up = gate_up.split(self.hidden, dim=-1)
        return self.w2(self.act(gate) * up)


def fuse_feed_forwards(model: Transformer) -> None:
    """Each FeedForward whose w1 and w3 are packed modules that concatenate (`concat`: PackedLinear,
    quantized.py's packed int8 / int4 layers) -> PackedFeedForward, in place."""
    for layer in model.layers:
        ff = layer.feed_forward
        if type(ff) is not FeedForward or type(ff.w1) is not type(ff.w3) or not hasattr(ff.w1, "concat") \
                or not hookless(ff):
            continue
        w13 = ff.w1.concat(ff.w3)
        if w13 is not None:
            layer.feed_forward = PackedFeedForward(ff, w13)
            del ff
            trim_heap()  # w1's and w3's copies


class PackedEmbedding(nn.Module):
    """The embedding tied to a packed output projection: rows gathered from the packed weight, in
    C++ (indexing a view of the bf16 pair layout gave inductor a prefill graph it could not run)."""

    def __init__(self, output: PackedLinear):
        super().__init__()
        self.packed = output.packed  # the same tensor: one copy
        self.dim = output.in_features

    def forward(self, idx: Tensor) -> Tensor:
        return torch.ops.brisk.packed_embedding(idx, self.packed, self.dim)


def packable_dtypes() -> tuple:
    """The weight dtypes kernels.cpp multiplies on this CPU: fp32 and bf16 (with vdpbf16ps where the
    CPU has AVX-512 BF16, else widened to fp32 for FMAs)."""
    return (torch.float32, torch.bfloat16) if best_isa() else ()


def can_pack(model: Transformer) -> bool:
    """A CPU model in a dtype kernels.cpp has code for on this CPU."""
    w = model.norm.weight
    return w.device.type == "cpu" and w.dtype in packable_dtypes()


def pack_for_cpu(model: Transformer) -> Transformer:
    """What the command lines call after loading: the model packed where kernels.cpp serves it, and
    its attention (decode steps, prompts) on attention.cpp's kernels, its norms, RoPE and gates on
    rowwise.cpp's."""
    if not can_pack(model):
        return model
    pack_linears(model)
    use_attention_kernels(model)
    use_rowwise_kernels(model)
    return model


@functools.cache
def avx512_attention() -> bool:
    """Whether attention.cpp and rowwise.cpp run their AVX-512 code here (elsewhere their AVX2 code)."""
    return avx512() and extension().attention_supported()


def cache_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Optional[Tensor], mask: Tensor,
                    scale: float, isa: Optional[str] = None) -> Tensor:
    """model.Attention's attend_cache: the query rows of a decode step against the KV cache, read in
    place (isa None: the CPU's best, as for the products: AVX-512 or AVX2)."""
    return torch.ops.brisk.decode_attention(q, k_cache, v_cache, rows, mask, scale, isa_code(isa))


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, isa: Optional[str] = None) -> Tensor:
    """model.Attention's attend_prompt: causal attention of a prompt from position 0 over its own keys,
    [B, T, n_head * head_dim]; blocks past the diagonal are never computed (SDPA's CPU kernel computes
    up to 512 keys whole). isa None: the CPU's best, as for the products (AVX-512 or AVX2)."""
    return torch.ops.brisk.prompt_attention(q, k, v, scale, isa_code(isa))


def use_attention_kernels(model: Transformer) -> None:
    """Decode steps and prompts of every layer (but soft-capped ones and those with sinks, which
    model.py keeps) through attention.cpp: cache_attention and, where a head is whole vectors of 16
    features, prompt_attention."""
    register_fake()
    for layer in model.layers:
        a = layer.attention
        if isinstance(a, Attention) and a.softcap is None and a.sinks is None:  # (not LatentAttention)
            # The isa bound here: a compiled step calls the kernel with it as a constant (dynamo
            # would otherwise trace best_isa, and the build of the extension behind it).
            a.attend_cache = functools.partial(cache_attention, isa=best_isa())
            if a.head_dim % 16 == 0:
                a.attend_prompt = prompt_attention


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, isa: Optional[str] = None) -> Tensor:
    """model.RMSNorm's kernel (rowwise.cpp; isa None: the CPU's best, as for the products)."""
    return torch.ops.brisk.rms_norm(x, weight, eps, offset, isa_code(isa))


def rotate(x: Tensor, rope: Tensor) -> Tensor:
    """model.Attention's rotate: rope.apply_rope in one op (rowwise.cpp)."""
    return torch.ops.brisk.apply_rope(x, rope)


def silu_mul(gate_up: Tensor, hidden: int, isa: Optional[str] = None) -> Tensor:
    """PackedFeedForward's gate_kernel for SwiGLU: silu(gate) * up of [gate, up] (rowwise.cpp)."""
    return torch.ops.brisk.silu_mul(gate_up, hidden, isa_code(isa))


def use_rowwise_kernels(model: Transformer) -> None:
    """The norms, RoPE and SwiGLU gates of eager steps through rowwise.cpp, an op each instead of
    PyTorch's 2-12 (compiled steps keep model.py's code, which inductor fuses). AVX-512 or AVX2, and
    only where the activations are fp32 or bf16 (a packed model's)."""
    if model.norm.weight.dtype not in (torch.float32, torch.bfloat16):
        return
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.weight.dtype == model.norm.weight.dtype and not module.centered:
            module.kernel = rms_norm
        elif isinstance(module, Attention):
            module.rotate = rotate
        elif isinstance(module, PackedFeedForward) and module.act is F.silu:
            module.gate_kernel = silu_mul


def replace_linear(module: nn.Module, name: str, isa: str) -> None:
    """module.name (an nn.Linear) -> PackedLinear, the original's memory given back at once. (A list of
    the replaced linears, or of their parents, would keep every original weight alive beside its
    packed copy until packing ends.)"""
    linear = getattr(module, name)
    setattr(module, name, PackedLinear(linear, isa))
    release_pages(linear.weight)  # memory-mapped: the checkpoint's pages
    del linear  # otherwise (a cast copy) freed here
    trim_heap()


def pack_linears(model: Transformer, isa: Optional[str] = None) -> Transformer:
    """Every fp32 (and bf16, where the CPU multiplies it) nn.Linear of the model -> PackedLinear (in
    place); isa None: the CPU's best."""
    isa = isa or best_isa()
    dtypes = packable_dtypes()
    tied = model.output.weight is model.tok_embeddings.weight
    for layer in model.layers:  # w1 and w3 stacked as they are packed (fuse_feed_forwards would copy them again)
        ff = layer.feed_forward
        if type(ff) is FeedForward and all(type(m) is nn.Linear and m.weight.dtype in dtypes for m in (ff.w1, ff.w3)) \
                and hookless(ff) and concatenable(ff.w1, ff.w3, ff.w1.weight, ff.w3.weight):
            layer.feed_forward = PackedFeedForward(ff, pack_stacked([ff.w1, ff.w3], isa))
            release_pages(ff.w1.weight)
            release_pages(ff.w3.weight)
            del ff
            trim_heap()
    for module, name in [(module, name) for module in model.modules() for name, child in module.named_children()
                         if type(child) is nn.Linear and child.weight.dtype in dtypes]:
        replace_linear(module, name, isa)
    if tied and isinstance(model.output, PackedLinear):
        model.tok_embeddings = PackedEmbedding(model.output)
    fuse_feed_forwards(model)
    # load_model maps the checkpoint file into memory, and the mapping stays while any tensor of it
    # lives: copy out the few left (norms, an untied embedding) so that the file's pages, the
    # unpacked weights among them, leave the process.
    with torch.no_grad():
        for module in model.modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None and t.device.type == "cpu" and not name.endswith("_cache") and from_file(t):
                    t.data = copy_out(t.data)
    return model
