"""The package's imports form layers: no module imports, directly or through others, a module
that imports it back. Imports inside functions count (a lazy import is still a dependency);
imports under ``if TYPE_CHECKING:`` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "treefx"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The treefx modules ``path`` imports (``from . import x`` of a submodule: that module)."""
    name = _module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_pkg, node.level, node.module)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # treefx.ops.attention.X -> treefx.ops.attention
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (each list imports itself through the others):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


# Lower layers never import higher ones: the data (tree, layout, mask) and the ops know
# nothing of the passes; the passes nothing of the engine; the engine nothing of the user API.
LAYERS = [
    {"treefx._version", "treefx._progress", "treefx.tree", "treefx.mask"},
    {"treefx.layout", "treefx.reference", "treefx.synth", "treefx.partition", "treefx.data",
     "treefx.parts", "treefx.attn_impl"},
    # the ops, and what a capture patches in (recurrent kernels, HF's packed-sequence
    # inference; HF's attention switch is the oracle's too: layer 1)
    {"treefx.ops", "treefx.ops.*", "treefx.hf_packing"},
    # the compiler (graph -> sites -> tree ops, the checks, the recurrence registry)
    {"treefx.compiler", "treefx.compiler.*"},
    # what treefx knows of model families, registered into the compiler's registries
    {"treefx.families", "treefx.families.*"},
    {"treefx.backends", "treefx.verification"},
    {"treefx.engine", "treefx.regional"},
    {"treefx.tree_model", "treefx.step", "treefx.rl", "treefx.part_run", "treefx.distributed"},
    # tools and example models (the package's root still imports debug and synth: issue 33)
    {"treefx", "treefx.__main__", "treefx.cli", "treefx.demo", "treefx.zoo", "treefx.debug",
     "treefx.debug.*", "treefx.models", "treefx.models.*"},
]


def _layer(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module in layer or any(p.endswith(".*") and module.startswith(p[:-1])
                                  for p in layer):
            return i
    return None


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if _layer(m) is None)
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_layers_point_one_way():
    bad = []
    for module, deps in import_graph().items():
        lm = _layer(module)
        if lm is None:
            continue
        for d in deps:
            ld = _layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{module} (layer {lm}) imports {d} (layer {ld})")
    assert not bad, "\n".join(sorted(bad))


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", ["treefx.engine", "treefx.debug.page",
                                    "treefx.compiler.find.loss"])
def test_the_graph_sees_imports(module):
    assert import_graph()[module], module
