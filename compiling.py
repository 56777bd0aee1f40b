# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""How a decode-sized step is compiled for a device: one function, `compile_step`.

CUDA: CUDA graphs (one launch per step). CPU: a model whose products are kernels.cpp's (packed
at load time: kernels.py, quantized.py) compiles as it is, for caches of any length, through
torch.export and AOTInductor into a package that a second run loads without dynamo or inductor.
Other models' weights are frozen into the graph so inductor repacks them once for its GEMM
kernels, whose matrix-vector products use every core (eager PyTorch's run on one). Which kernels
inductor may pick is asked of the model's modules (`inductor_hints`, declared by kernels.py's and
quantized.py's modules); nothing here knows their classes.
"""
import contextlib
import functools
import hashlib
import inspect
import os
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from load import weights
from linear_attention import RecurrentState
from model import KVCache, MoEFeedForward

# An unpacked bf16 step of up to this many rows runs inductor's bf16 template, faster there than
# oneDNN's products (kernel_options; the command lines pack bf16 models where kernels.cpp can).
BF16_TEMPLATE_ROWS = 4


def compile_step(fn: Callable, device: str, dynamic_rows: bool = False) -> Callable:
    """torch.compile a decode-sized step fn(model, x, ...) (x: a few tokens, static shapes) for `device`.
    dynamic_rows: the first dimension of every tensor argument (the batch: an engine's live slots)
    varies from call to call, and a packed CPU model's one compiled step serves them all
    (`rows_vary` says where that holds; elsewhere each batch compiles its own)."""
    if device != "cpu":
        import torch._inductor.config as inductor_config
        inductor_config.coordinate_descent_tuning = device.startswith("cuda")
        inductor_config.fx_graph_cache = True  # warm runs skip most of the compile time
        return torch.compile(fn, mode="reduce-overhead" if device.startswith("cuda") else None, fullgraph=True)
    # Nothing of inductor is imported here: a packed model's warm start loads its step without it.
    # model -> {rows: its step}: frozen weights are part of the graph, and which GEMM kernels may
    # run depends on the products' rows (kernel_options). A packed model compiles unfrozen.
    steps = weakref.WeakKeyDictionary()

    def step(model, x, *args, **kwargs):
        by_rows = steps.setdefault(model, {})  # None: the unfrozen step, whatever the rows
        f = by_rows.get(None) or by_rows.get(x.numel())
        if f is None:
            if needs_freezing(model):
                f = by_rows[x.numel()] = frozen_step(fn, model, x.numel())
            else:
                f = by_rows[None] = unfrozen_step(fn, dynamic_rows)
        return f(model, x, *args, **kwargs)
    return step


def rows_vary(model, device: str) -> bool:
    """Whether compile_step(..., dynamic_rows=True) compiles one step for batches of any size for
    this model: a packed CPU model's (frozen graphs are compiled for their rows)."""
    return device == "cpu" and not needs_freezing(model)


def unfrozen_step(fn: Callable, dynamic_rows: bool = False) -> Callable:
    """fn compiled for a packed CPU model (weights as they are, inputs of the graph), for caches of
    any length (and batches of any size: dynamic_rows). Each kind of call (its signature: the
    shapes of its tensors, the values of its other arguments, the model's structure) compiles once
    into a package that later runs load in well under a second (`precompiled`); under torchrun
    (its collectives), or where torch lacks AOTInductor's package loader, through dynamo and its
    own caches."""
    if torch.distributed.is_initialized() or not hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader"):
        return dynamo_step(fn, dynamic_rows)
    steps = weakref.WeakKeyDictionary()  # model -> {call signature: its compiled step}

    def step(model, *args, **kwargs):
        by_signature = steps.setdefault(model, {})
        signature = call_signature(model, args, kwargs, dynamic_rows)
        f = by_signature.get(signature)
        if f is None:
            try:
                f = precompiled(fn, model, args, kwargs, signature, dynamic_rows)
            except Exception as e:  # export's refusals come in many classes: the step still runs
                import sys
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(f"compiling: {fn.__qualname__} could not be compiled ahead of time ({reason}); compiling it "
                      "through dynamo", file=sys.stderr, flush=True)
                f = dynamo_step(fn, dynamic_rows)
            by_signature[signature] = f
        return f(model, *args, **kwargs)
    return step


def dynamo_step(fn: Callable, dynamic_rows: bool = False) -> Callable:
    """unfrozen_step through dynamo: one graph for caches of any length, found in the on-disk caches
    by a second run (with another prompt or --max_new_tokens too). dynamo keeps every module buffer's
    shape static unless told otherwise, and would make any shape that changes between calls dynamic
    on its own (a draft model's weights beside the target's): only the marked sequence dimensions are."""
    import torch._inductor.inductor_prims  # noqa: F401  (model.in_memory's prim)
    compiled = size_asserts_off(torch.compile(fn, fullgraph=True))
    marked = weakref.WeakKeyDictionary()  # model -> the RoPE table of the caches marked (setup_caches makes new ones)

    def step(model, *args, **kwargs):
        if marked.get(model) is not model.rope_cos_sin:
            sequence_dims_dynamic(model)
            marked[model] = model.rope_cos_sin
        if dynamic_rows:
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(t, 0)  # a batch of one: a graph of its own
        with torch._dynamo.config.patch(DYNAMO_SEQUENCE_DIMS):  # dynamo reads these while tracing, inside a call
            return compiled(model, *args, **kwargs)
    return step


# Only the sequence dimensions that sequence_dims_dynamic marks are dynamic.
DYNAMO_SEQUENCE_DIMS = dict(force_parameter_static_shapes=False, force_nn_module_property_static_shapes=False,
                            automatic_dynamic_shapes=False)


def size_asserts_off(compiled: Callable) -> Callable:
    """The graph's wrapper skips its size asserts: a few hundred calls a step, a visible part of a
    small model's."""
    import torch._inductor.config as inductor_config
    return inductor_config.patch(size_asserts=False, alignment_asserts=False, scalar_asserts=False)(compiled)


def call_signature(model, args: tuple, kwargs: dict, dynamic_rows: bool = False) -> tuple:
    """What a compiled step is specialised to, short of the model's structure: the shapes and dtypes
    of the tensors (but their first dimension where dynamic_rows), the values of the other arguments
    (an int or float may be burnt into the graph), the caches' rows, whether their length is 1
    (dynamo specialises it), autograd's state."""
    def of(a):
        if not isinstance(a, torch.Tensor):
            return type(a), a
        return a.dtype, (None, *a.shape[1:]) if dynamic_rows else tuple(a.shape)
    return (model.max_batch_size, model.max_seq_length == 1, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple(of(a) for a in args), tuple((k, of(v)) for k, v in sorted(kwargs.items())))


def precompiled(fn: Callable, model, args: tuple, kwargs: dict, signature: tuple,
                dynamic_rows: bool = False) -> Callable:
    """fn compiled ahead of time by AOTInductor for calls of this signature on models of this
    structure, kept as a package in compiled_steps_dir(): a warm start loads a shared library and
    runs it without importing dynamo or inductor (seconds of a start, ~0.1 GB of its memory). The
    model's weights stay out of the package: the library reads the model's own tensors in place
    (AOTInductor's user-managed constants). The KV caches and RoPE tables are inputs whose length is
    dynamic (one package serves caches of any length); the step writes the caches in place. The
    arguments that are not tensors are part of the package, as the signature that names it; it
    checks nothing at a call (each call's signature and the model's structure pick its file)."""
    from load import atomic_write
    key = hashlib.sha256(repr((code_digest(), torch.__version__, machine_digest(), structure_digest(model),
                               fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno, fn.__code__.co_code,
                               source_digest(fn), signature)).encode()).hexdigest()[:32]
    path = compiled_steps_dir() / f"{key}.pt2"
    t0 = time.perf_counter()
    if path.is_file():
        try:
            step = load_package(path, model)
            print(f"compiling: loaded {fn.__qualname__} from {path} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
            return step
        # Stale (a format this torch no longer reads) or damaged: compile again.
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            print(f"compiling: {path} does not load ({type(e).__name__}); compiling again", file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
    # The wait a first run has no other sign of: half a minute or more on a few cores.
    print(f"compiling: {fn.__qualname__} ahead of time for this model and call (once; later runs load it)",
          file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: export_and_package(fn, model, args, kwargs, tmp, dynamic_rows))
    step = load_package(path, model)
    print(f"compiling: compiled {fn.__qualname__} in {time.perf_counter() - t0:.1f} s, saved to {path}",
          file=sys.stderr, flush=True)
    return step


def sequence_tensors(model) -> dict:
    """The tensors setup_caches makes, by name, in the order a package takes them as inputs (a step
    writes the caches; their length varies): each layer's K/V cache, linear attention's state (Qwen3.5:
    sized by the slots alone) and the RoPE tables."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, KVCache):
            tensors[f"{name}.k_cache"] = module.k_cache
            if module.v_cache is not None:  # (a keys-only cache: latent attention's)
                tensors[f"{name}.v_cache"] = module.v_cache
        elif isinstance(module, RecurrentState):
            tensors[f"{name}.conv"] = module.conv
            if module.memory is not None:  # (a short convolution's state has none)
                tensors[f"{name}.memory"] = module.memory
    for name in ("rope_cos_sin", "rope_local_cos_sin"):
        if getattr(model, name, None) is not None:
            tensors[name] = getattr(model, name)
    return tensors


def sequence_dim(name: str) -> Optional[int]:
    """The positions dimension of the sequence tensor `name`: a RoPE table's rows, a cache's third;
    None for a linear-attention state, which has none."""
    if name.endswith((".conv", ".memory")):
        return None
    return 0 if name.endswith("cos_sin") else 2


def export_and_package(fn: Callable, model, args: tuple, kwargs: dict, path, dynamic_rows: bool = False) -> None:
    """torch.export fn(model, *args, **kwargs) with its tensor arguments and the model's sequence
    tensors as inputs (the tensor arguments' first dimension dynamic where dynamic_rows), and
    compile it with AOTInductor into the package `path`."""
    import torch._inductor
    import torch._inductor.inductor_prims  # noqa: F401  (model.in_memory's prim)
    calls = [*args, *(v for _, v in sorted(kwargs.items()))]
    at = [i for i, a in enumerate(calls) if isinstance(a, torch.Tensor)]
    names = list(sequence_tensors(model))

    class Step(nn.Module):  # export traces a module's forward
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, tensors: list, sequence: list):
            given = list(calls)
            for i, t in zip(at, tensors):
                given[i] = t
            swapped = swap_tensors(model, dict(zip(names, sequence)))
            try:
                return fn(model, *given[:len(args)], **dict(zip(sorted(kwargs), given[len(args):])))
            finally:
                swap_tensors(model, swapped)

    # Example inputs apart from the model's own tensors (an input that aliases a buffer fails to
    # export); the contents never matter: export traces with shapes alone.
    # A batch of one would be traced as a static 1 (export specialises sizes 0 and 1): the example
    # of a dynamic batch has at least two rows.
    examples = ([torch.cat([calls[i]] * 2) if dynamic_rows and calls[i].shape[0] == 1 else calls[i].clone()
                 for i in at], [torch.empty_like(t) for t in sequence_tensors(model).values()])
    # DYNAMIC: export may narrow a length's range (a step that attends to the first 256 positions
    # needs at least 256) rather than fail; a cache of one position is a static shape.
    length = torch.export.Dim.DYNAMIC
    dims = [None if model.max_seq_length == 1 or sequence_dim(n) is None else {sequence_dim(n): length}
            for n in names]
    rows = [{0: torch.export.Dim.DYNAMIC} if dynamic_rows else None for _ in at]
    with buffers_as_parameters(model, names):
        program = torch.export.export(Step(), examples, dynamic_shapes=(rows, dims), strict=False)
    with open(path, "wb") as f, warnings.catch_warnings():  # a file object: the package's name must end in .pt2
        # torch's own deepcopy of the graph trips its own deprecation of LeafSpec: nothing a user can act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        torch._inductor.aoti_compile_and_package(program, package_path=f, inductor_configs={
            "aot_inductor.package_constants_in_so": False,  # the weights are the model's, read in place
            # The wrapper only calls the kernels, in order: optimising it and its debug line tables
            # took a third of a cold compile for no difference in a step's time (README, Benchmarks).
            "aot_inductor.compile_wrapper_opt_level": "O0", "aot_inductor.enable_line_tables": False,
            "fallback_random": True})  # sampling draws from torch's generator, as eager steps do


@contextlib.contextmanager
def buffers_as_parameters(model, keep: list):
    """The model's buffers (packed and quantized weights) as parameters that share their memory,
    all but those named in `keep`: AOTInductor copies every buffer of the graph it compiles (in
    case the step mutates it), which is a second copy of a packed model's weights in memory
    while it compiles; parameters it leaves alone."""
    moved, as_parameter = [], {}  # as_parameter: one Parameter per tensor (a tied weight stays one)
    for owner, module in model.named_modules():
        for name, t in list(module._buffers.items()):
            if t is not None and f"{owner}.{name}".removeprefix(".") not in keep:
                if id(t) not in as_parameter:
                    as_parameter[id(t)] = nn.Parameter(t, requires_grad=False)
                moved.append((module, name, t))
                del module._buffers[name]
                module._parameters[name] = as_parameter[id(t)]
    try:
        yield
    finally:
        for module, name, t in moved:
            del module._parameters[name]
            module._buffers[name] = t


def swap_tensors(model, tensors: dict) -> dict:
    """Set the model's buffers named in `tensors` to them; returns the ones they replaced."""
    old = {}
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        old[name] = getattr(module, attr)
        setattr(module, attr, t)
    return old


def load_package(path, model) -> Callable:
    """The step in the package at `path` for calls with `model`, reading its weights where they are."""
    from torch.utils._pytree import tree_unflatten, treespec_loads
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    own = dict(model.state_dict(keep_vars=True), **dict(model.named_buffers()))
    loader.load_constants({name: own[name.removeprefix("model.")].detach() for name in loader.get_constant_fqns()},
                          False, True, True)  # every constant given, held by the model (user-managed)
    out_spec = treespec_loads(loader.get_call_spec()[1])
    seen = [None, []]  # the model's RoPE table and its sequence tensors when last called

    def step(model, *args, **kwargs):
        if seen[0] is not model.rope_cos_sin:  # setup_caches made new ones
            seen[:] = model.rope_cos_sin, list(sequence_tensors(model).values())
        inputs = [a for a in (*args, *(v for _, v in sorted(kwargs.items()))) if isinstance(a, torch.Tensor)]
        return tree_unflatten(loader.run(inputs + seen[1]), out_spec)
    return step


def compiled_steps_dir():
    """Where precompiled steps are kept: $BRISK_COMPILE_CACHE, default ~/.cache/brisk/compiled."""
    return Path(os.environ.get("BRISK_COMPILE_CACHE", "~/.cache/brisk/compiled")).expanduser()


def source_digest(fn: Callable) -> str:
    """Of the file that defines fn, whatever it is (a command-line script's own step included); none
    for code typed in (python -c: its co_code is in the key)."""
    path = inspect.getsourcefile(fn)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and Path(path).is_file() else ""


# The command-line scripts: no library file imports them (tests/test_layout.py), so nothing a compiled
# step runs or a packed model holds comes from them, and editing one keeps both caches.
COMMAND_LINES = {"generate.py", "eval.py", "quantize.py", "server.py"}


def code_digest(here=None) -> str:
    """Of brisk's library files in `here` (default: this one's folder), what a compiled step traces
    and packing runs: any change compiles and packs afresh."""
    digest = hashlib.sha256()
    here = Path(here or Path(__file__).parent)
    for f in sorted(here.glob("*.py")) + sorted(here.glob("*.cpp")) + sorted(here.glob("*.h")):
        if f.name not in COMMAND_LINES:
            digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


def machine_digest() -> str:
    """The CPU's instruction sets, which pick the compiled kernels."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "") \
        if cpuinfo.is_file() else ""
    return hashlib.sha256((torch.backends.cpu.get_cpu_capability() + flags).encode()).hexdigest()


def stable_repr(v) -> str:
    """repr, but a function by its name rather than its address (the same in every run), and a
    partial one by its function's name and its arguments' reprs."""
    if isinstance(v, functools.partial):
        return f"partial({stable_repr(v.func)}, {[stable_repr(a) for a in v.args]}, " \
               f"{sorted((k, stable_repr(a)) for k, a in v.keywords.items())})"
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return repr(v)


def structure_digest(model) -> str:
    """What a compiled step reads of the model besides its tensors' values: each module's class and
    plain attributes (sizes, scales, kernels and instruction sets, attached functions), and each
    parameter's and buffer's name, dtype and shape (a cache's length aside: it is dynamic)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        plain = sorted((k, stable_repr(v)) for k, v in vars(module).items()
                       if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))
                       and k not in ("max_seq_length", "max_batch_size"))  # the caches' (call_signature)
        digest.update(repr((name, type(module).__qualname__, plain, bool(module._forward_hooks),
                            bool(module._forward_pre_hooks))).encode())
        for tensor_name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                shape = list(t.shape)
                if isinstance(module, KVCache) or tensor_name.endswith("cos_sin"):
                    shape[sequence_dim(tensor_name)] = -1
                digest.update(repr((tensor_name, t.dtype, shape)).encode())
    return digest.hexdigest()


def sequence_dims_dynamic(model):
    """Mark the positions dimension of the model's KV caches and RoPE tables dynamic (a cache of
    one position stays static: dynamo specialises sizes 0 and 1)."""
    for name, t in sequence_tensors(model).items():
        if sequence_dim(name) is not None:
            torch._dynamo.maybe_mark_dynamic(t, sequence_dim(name))


def compile_prefill(fn: Callable, device: str) -> Callable:
    """torch.compile a prompt-sized step fn(model, x, ...): its length varies, so dynamic shapes.

    On the CPU the weights are frozen too: inductor repacks them for oneDNN's products, several
    times faster than eager PyTorch's on a short prompt (README, How it works), at the cost of
    that repacked copy in memory. There the first dimension of every tensor argument is a batch
    whose size is left unbacked (unknown to the graph), so that one graph serves one prompt and
    several: a batch of 1 would otherwise be a graph of its own, each a long compile. A packed
    model (not needs_freezing) runs its prompts eagerly: its products are kernels.cpp's either way,
    and compiling would fuse only the work around them (5-15% of a prompt's time) for ~20 s of
    every start (the dynamic-shape trace, which AOTAutograd's cache does not spare). A model with
    linear attention (Qwen3.5) runs its prompts eagerly on every device: the chunked delta rule
    loops over a prompt's chunks, a count no graph of dynamic length can hold.
    """
    if device != "cpu":
        compiled = torch.compile(fn, fullgraph=True, dynamic=True)

        def step(model, *args, **kwargs):
            if model.config.linear_attention_layers:
                return fn(model, *args, **kwargs)
            static_buffers(model)
            return compiled(model, *args, **kwargs)
        return step
    steps = weakref.WeakKeyDictionary()  # model -> its frozen prefill, or fn for a packed model

    def step(model, *args, **kwargs):
        f = steps.get(model)
        if f is None:
            eager = not needs_freezing(model) or model.config.linear_attention_layers
            f = steps[model] = fn if eager else frozen_step(fn, model, rows=None)
        if f is fn:
            return fn(model, *args, **kwargs)
        static_buffers(model)
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                torch._dynamo.decorators.mark_unbacked(t, 0)
        return f(model, *args, **kwargs)
    return step


def static_buffers(model):
    """Keep the shapes of the model's buffers (quantized and packed weights, caches) out of the
    dynamic ones: under dynamic=True dynamo would give each dimension a symbol, and one that
    happened to equal a prompt's length (duck sizing: a packed layout's 2 or 32 and a prompt of 2
    or 32 tokens share a symbol) was then pinned by the frozen weights, so the next prompt length
    recompiled the whole prefill. Parameters are static already. Marked on every call: a new
    cache (setup_caches) is a new tensor."""
    for t in model.buffers():
        torch._dynamo.mark_static(t)


def skip_guards(steady: bool):
    """Context for calls of compiled steps. steady: the model, its caches and the inputs' shapes are
    those an earlier call's guards already checked, so only the guards that tell the step's graphs
    apart need to run (checking all of them costs a noticeable part of a small model's step). A
    process without dynamo runs no guards (precompiled steps check none): nothing to skip, and
    nothing imported for it."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=steady)


def needs_freezing(model) -> bool:
    """Whether inductor must freeze the model's weights to run its products fast: yes for
    nn.Linear, experts and quantized layers on PyTorch's kernels; no when every product is an op
    on weights packed at load time (modules whose hints say "freeze": False). Those steps run as
    fast unfrozen, and a frozen graph misses AOTAutograd's cache: every warm start would redo
    most of the compile."""
    if any(type(m) is nn.Linear or isinstance(m, MoEFeedForward) for m in model.modules()):
        return True
    return any(m.inductor_hints.get("freeze", True) for m in model.modules() if hasattr(m, "inductor_hints"))


def frozen_step(fn: Callable, model, rows: Optional[int]) -> Callable:
    """fn compiled for the CPU with the model's weights frozen, for inputs of `rows` tokens, or of
    any number (None: dynamic shapes, and inductor's default products, as its GEMM template and
    kernel_options are for static ones).

    The repacked copy stays beside the model's own weights, which eager paths still read.
    """
    import torch._inductor.config as inductor_config
    import torch._inductor.inductor_prims  # noqa: F401  (model.in_memory's prim)
    options = dict(freezing=True, autotune_num_choices_displayed=0,
                   post_grad_custom_post_pass=weights_cache_key(model),
                   **(kernel_options(model, rows) if rows is not None else {}))
    # Dynamo reads the freezing flag while tracing, which happens inside calls (the first, and any
    # recompile): the settings hold during every call rather than globally.
    return inductor_config.patch(options)(torch.compile(fn, fullgraph=True, dynamic=True if rows is None else None))


def weights_cache_key(model):
    """A graph pass that changes nothing and puts a digest of the weights into inductor's cache key.

    inductor's on-disk cache keys a frozen graph by its code and shapes, not by the weights, yet
    its C++ GEMM template bakes the weights it repacked at compile time into the cached code: a
    second checkpoint of the same shape (a fine-tune, GPTQ beside round-to-nearest) would decode
    with the first one's weights.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass
    digest = hashlib.sha256()
    for name, t in weights(model):
        digest.update(name.encode())
        digest.update(t.detach().reshape(-1).view(torch.uint8).numpy())
    key = digest.hexdigest()

    class WeightsKey(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return key
    return WeightsKey()


def kernel_options(model, rows: int) -> dict:
    """Inductor's options for the products of a frozen CPU step.

    Modules with their own kernels declare `inductor_hints`: "gemm_backends" they need among
    max-autotune's candidates,
    "cpp_wrapper": False where the C++ wrapper around inductor's own kernels is slower.
    """
    hints = [m.inductor_hints for m in model.modules() if hasattr(m, "inductor_hints")]
    moe = any(isinstance(m, MoEFeedForward) for m in model.modules())
    # bf16 (norm.weight has the activations' dtype) on a CPU with AVX-512 BF16 dot products, up
    # to BF16_TEMPLATE_ROWS rows: inductor's template, as in fp32 below (faster than oneDNN's
    # products at one row, slower at 8; README, Benchmarks).
    bf16_template = (rows <= BF16_TEMPLATE_ROWS and not hints and not moe
                     and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    if model.norm.weight.dtype != torch.float32 and not bf16_template:
        # Elsewhere bf16 runs oneDNN's products, without autotuning (timing the candidates with
        # the weights in cache picks inductor's template although oneDNN is faster reading from
        # memory there). The C++ wrapper calls oneDNN's ops directly instead of dispatching each
        # from Python. Products that share their input (w1 and w3) become one over weights
        # concatenated at freezing.
        return {"cpp.enable_concat_linear": True,
                "cpp_wrapper": all(h.get("cpp_wrapper", True) for h in hints)}
    # fp32 needs max-autotune: oneDNN's fp32 matrix-vector product is single-threaded and
    # inductor's C++ GEMM template ("CPP") uses every core. (Concatenating w1 and w3 would cost a
    # third copy of them in memory for little speed in fp32.) But the frozen template reads a
    # weight that is a view at an offset into a larger tensor (an expert of the stacked ones, run
    # on every token when a batch has more tokens than the experts allow gathering) from the
    # wrong place: mixture-of-experts steps keep freezing alone.
    if moe:
        return {}
    # Batched rows (several streams, a speculative verify) run inductor's template alone: timing
    # the candidates with the weights in cache picks oneDNN's products for some shapes, which are
    # slower reading the weights from memory.
    default = {"CPP", "ATEN"} if rows == 1 else {"CPP"}
    backends = set().union(*(h.get("gemm_backends", ()) for h in hints)) or default
    return dict(max_autotune=True, max_autotune_gemm_backends=",".join(sorted(backends)))
