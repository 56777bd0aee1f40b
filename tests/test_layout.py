"""The shape of the code: imports point down toward model.py, with no cycle, and a command-line
script is imported by nothing but scripts/ (read from the source, lazy imports included)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Command-line drivers: what they hold is for users, not for other files of the library.
CLIS = {"generate", "eval", "quantize", "server"}


def local_modules() -> dict:
    """Module name ("load", "scripts.bench") -> its file, for the top-level files and scripts/."""
    files = [*ROOT.glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    return {".".join(f.relative_to(ROOT).with_suffix("").parts): f for f in files}


def imports(path: Path, known: set) -> set:
    """The local modules a file imports anywhere in it (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def import_graph() -> dict:
    modules = local_modules()
    return {name: imports(path, set(modules)) - {name} for name, path in modules.items()}


def find_cycle(graph: dict):
    state = {}  # name -> "open" while on the DFS stack, "done" after

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert {"model", "load", "decode", "generate", "scripts.bench"} <= set(graph)
    assert "model" in graph["load"] and "load" in graph["generate"]
    assert "quantized" in graph["load"]  # a lazy import inside a function counts


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_imports_point_down():
    for name, deps in import_graph().items():
        if not name.startswith("scripts."):
            assert not {d for d in deps if d.startswith("scripts.")}, f"{name} imports from scripts/: {deps}"
            assert not deps & CLIS, f"{name} imports a command-line script: {deps & CLIS}"
    graph = import_graph()
    # model.py's RoPE tables live in rope.py, its linear attention in linear_attention.py, which import
    # nothing of ours: together the ground floor.
    floor = {"rope", "linear_attention"}
    assert graph["model"] <= floor and not any(graph[f] for f in floor), \
        "model.py (with rope.py and linear_attention.py) imports nothing else of ours"


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_generate_imports_no_parallel_or_quantization_code():
    probe = ("import sys, generate; print(sorted(m for m in ('tp', 'quantize', 'quantized', 'GPTQ', "
             "'torch.distributed._functional_collectives') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert r.stderr == ""  # importing prints nothing


def test_compile_caches_skip_only_command_lines(tmp_path):
    """compiling.code_digest (the key of compiled steps and packed models) leaves out the command-line
    scripts alone, which no library file imports: editing server.py keeps both caches, editing a
    library file does not."""
    import shutil
    from compiling import COMMAND_LINES, code_digest
    assert COMMAND_LINES == {f"{name}.py" for name in CLIS}
    for f in [*ROOT.glob("*.py"), *ROOT.glob("*.cpp"), *ROOT.glob("*.h")]:
        shutil.copy(f, tmp_path / f.name)
    before = code_digest(tmp_path)
    (tmp_path / "server.py").write_text((tmp_path / "server.py").read_text() + "\n# edited\n")
    assert code_digest(tmp_path) == before
    for name in ("model.py", "decode.py", "engine.py", "kernels.cpp"):
        comment = "//" if name.endswith(".cpp") else "#"
        (tmp_path / name).write_text((tmp_path / name).read_text() + f"\n{comment} edited\n")
        assert code_digest(tmp_path) != before, name
        before = code_digest(tmp_path)
