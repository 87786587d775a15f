"""The packages stay layered: quant/ is a leaf, kernels_cpu/ sits on it, and no import cycle hides anywhere.

The import graph is read from the source with `ast` (nothing is imported), counting every import statement
wherever it is -- module level, inside functions, under `if TYPE_CHECKING` -- and `importlib.import_module` with
a literal name. Edges go to the module named (`from edgellm.errors import X` -> edgellm.errors), not to its
parent packages, whose `__init__` runs first but is not what the importer depends on.

Layers, lowest first (an import may only go to the same layer or a lower one):
    quant        the format library: types, reference (de)quantization, k-quant math, mixes
    kernels_cpu  Numba kernels (matmul, attention, the fast quantizers) on top of quant's formats
    edgellm      the inference library (loader, engine, models, API, server)
    convert      tools that write whole GGUF files: HF -> GGUF, GGUF -> GGUF quantizer
    edgellm CLI  edgellm/cli.py and edgellm/cli_*.py, the commands that run the tools
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quant", "kernels_cpu", "edgellm", "convert")
LAYERS = {"quant": 0, "kernels_cpu": 1, "edgellm": 2, "convert": 3, "edgellm CLI": 4}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(f): f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))}


def _known(name: str) -> str | None:
    """`name` or its nearest enclosing module of ours (edgellm.errors.X -> edgellm.errors), else None."""
    mods = _modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, path: Path, node: ast.AST) -> list[str]:
    """Our modules that one import node (or importlib.import_module("literal") call) loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package that holds `module`
            pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        # `from pkg import sub` loads the submodule when there is one, else names from pkg itself
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in _modules() else base for a in node.names]
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        names = [node.args[0].value]
    else:
        return []
    return [t for t in map(_known, names) if t is not None and t != module]


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the modules of ours it imports anywhere in its source."""
    graph = {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[module] = frozenset(t for node in ast.walk(tree) for t in _targets(module, path, node))
    return graph


def layer(module: str) -> str:
    """The layer a module belongs to (see the module docstring)."""
    top, _, rest = module.partition(".")
    if top == "edgellm" and (rest == "cli" or rest.startswith("cli_")):
        return "edgellm CLI"
    return top


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def _imports_of(prefix: str) -> dict[str, set[str]]:
    """module under `prefix` -> the top-level packages of ours it imports (other than its own)."""
    return {m: {t.partition(".")[0] for t in ts} - {prefix} for m, ts in import_graph().items()
            if m.partition(".")[0] == prefix}


def test_graph_sees_the_imports_we_know_of():
    g = import_graph()
    assert "edgellm.errors" in g["edgellm.loader"]  # a module-level import
    assert any("convert" in t for t in g["edgellm.cli_quantize"])  # imports inside a function count too


def test_quant_imports_nothing_of_ours():
    bad = {m: sorted(ps) for m, ps in _imports_of("quant").items() if ps}
    assert not bad, f"quant/ must be a leaf (types, formats, k-quant math, mixes); it imports {bad}"


def test_kernels_cpu_imports_only_quant():
    bad = {m: sorted(ps - {"quant"}) for m, ps in _imports_of("kernels_cpu").items() if ps - {"quant"}}
    assert not bad, f"kernels_cpu/ may import quant/ only; it imports {bad}"


def test_imports_go_down_the_layers():
    up = sorted(f"{m} ({layer(m)}) -> {t} ({layer(t)})" for m, ts in import_graph().items() for t in ts
                if LAYERS[layer(t)] > LAYERS[layer(m)])
    assert not up, "imports that go up a layer:\n" + "\n".join(up)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, f"import cycles (function-level imports included): {found}"


def test_cycle_finder_finds_a_cycle_hidden_in_a_function():
    # the shape of the old convert/ cycle: common imports the arch modules inside a function, they import common
    g = {"c.common": frozenset({"c.llama"}), "c.llama": frozenset({"c.common"}), "c.vocab": frozenset()}
    assert cycles(g) == [["c.common", "c.llama"]]
