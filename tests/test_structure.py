"""The package's shape: imports point one way, and each room keeps to itself.

Every import counts, whether at module level, inside a function (a lazy
import) or under ``TYPE_CHECKING``: a cycle through any of them is a cycle
a reader has to untangle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pagedkv_np"
# Over ~450 lines on purpose: Numba's disk cache keys compiled code by its own
# source file, so the kernels' helpers cannot move out (their docstrings say so).
LONG_ON_PURPOSE = {"backends/_numba_kernels.py", "backends/_numba_quant.py",
                   "backends/block_q8.py", "onnxruntime/batching.py",
                   "onnxruntime/runners.py"}     # each says why in its docstring
MAX_LINES = 470


def module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    parts = ["pagedkv_np", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: pathlib.Path, known: set[str], root: pathlib.Path = PACKAGE) -> set[str]:
    """The package modules that ``path`` imports, anywhere in it."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        for target in targets:
            # the deepest package module the name refers to
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {name: imported(path, known) for name, path in mods.items()}
    # importing a submodule runs its packages' __init__ too, but that is not
    # an edge a reader follows: keep the edges as written
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def is_package_init_edge(a: str, b: str) -> bool:
    """A package's ``__init__`` re-exporting its own submodules."""
    return b.startswith(a + ".")


def test_no_import_cycles():
    edges = {a: {b for b in bs if not is_package_init_edge(a, b)} for a, bs in graph().items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "pagedkv_np"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "top.py", "sub/__init__.py", "sub/other.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "mod.py").write_text(
        "def f():\n    from ..top import x\n    from . import other\n")
    known = {"pagedkv_np", "pagedkv_np.top", "pagedkv_np.sub", "pagedkv_np.sub.mod",
             "pagedkv_np.sub.other"}
    assert imported(pkg / "sub" / "mod.py", known, pkg) == {
        "pagedkv_np.top", "pagedkv_np.sub.other", "pagedkv_np.sub"}


@pytest.mark.parametrize("room", ["pagedkv_np.models", "pagedkv_np.text"])
def test_models_and_text_know_nothing_of_the_cache_the_engine_or_the_server(room):
    forbidden = ("pagedkv_np.cache", "pagedkv_np.onnxruntime", "pagedkv_np.serve",
                 "pagedkv_np.tiers", "pagedkv_np.backends")
    for name, targets in graph().items():
        if name == room or name.startswith(room + "."):
            bad = sorted(t for t in targets if t.startswith(forbidden))
            assert not bad, f"{name} imports {bad}"


def test_modules_stay_small():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if rel not in LONG_ON_PURPOSE and lines > MAX_LINES:
            too_long.append(f"{rel}: {lines}")
    assert not too_long, too_long


@pytest.mark.parametrize("old, new", [
    ("pagedkv_np.onnxruntime.testmodel", "pagedkv_np.models.testmodel"),
    ("pagedkv_np.onnxruntime.gguf_import", "pagedkv_np.models.gguf.importer"),
])
def test_the_old_documented_module_paths_warn_and_still_work(old, new):
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        shim = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert shim.__all__ == moved.__all__
    for name in moved.__all__:
        assert getattr(shim, name) is getattr(moved, name)


def test_the_old_gguf_import_command_still_runs():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:__main__", "-m",
                           "pagedkv_np.onnxruntime.gguf_import", "--help"],
                          capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0 and "gguf" in proc.stdout.lower(), proc.stderr[-2000:]
