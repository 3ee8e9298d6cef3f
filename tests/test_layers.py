"""Imports run one way, bottom to top (docs/architecture.md, "Layers"):

    kernels/, device, memory, paths, outputs -> ops -> model/, checkpoint/, tokenizer/, cache/, sampling/,
    structured/ -> config/, runner/ -> spec_decode/ -> engine/
    -> llm, serve/, tool_calls, training/, cli (the front ends)

A module may import its own layer and the layers below it, never one above: a proposer never reaches into the
engine, verification never imports a proposer's request type, the runner never imports speculative decoding. Every
import in the package is read from the source (``ast``: module level and inside functions alike), so a lazy
import inside a function cannot hide a dependency that runs back up.

Checked to fail on the code before the round-as-data refactor: pointed at that tree (``check(old_root)``), it
reports the drafters importing ``specdec.engine`` (sequence, model runner, adaptive), ``sampling/verify.py``
importing ``specdec.drafters``, and ``specdec.drafters`` itself in no layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# bottom first; a module belongs to the layer of its longest matching prefix ("specdec", the package's own
# __init__, matches only itself)
LAYERS: list[tuple[str, ...]] = [
    ("specdec.kernels", "specdec.device", "specdec.memory", "specdec.paths", "specdec.outputs"),
    ("specdec.ops",),
    # the sharded forward's pieces sit with the model; starting and driving workers with the runner. Checkpoints
    # build the forward (checkpoint -> model) and the forward reads checkpoint entries in place (model.llama ->
    # checkpoint.safetensors_reader), so the two share a layer; test_no_import_cycles keeps them acyclic
    ("specdec.model", "specdec.checkpoint", "specdec.tokenizer", "specdec.cache", "specdec.sampling",
     "specdec.structured", "specdec.distributed.comm", "specdec.distributed.sharding", "specdec.distributed.layers"),
    ("specdec.config", "specdec.runner", "specdec.distributed"),
    ("specdec.spec_decode",),
    ("specdec.engine",),
    ("specdec.llm", "specdec.serve", "specdec.tool_calls", "specdec.training", "specdec.cli", "specdec.__main__",
     "specdec"),
]


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "specdec" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def source_modules(root: Path) -> dict[str, Path]:
    """module name -> file, for ``specdec/`` and ``kernels/`` (installed as ``specdec.kernels``)."""
    out = {}
    for base, package in ((root / "specdec", "specdec"), (root / "kernels", "specdec.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported: the body and the branches of top-level ``if`` / ``try``
    / ``with`` (not functions or classes' methods, and not ``if TYPE_CHECKING:``)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body
    return out


def imports_of(module: str, path: Path, known: set[str], module_level: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every specdec import in ``path`` (``from specdec import ops`` names the
    submodule ``specdec.ops``; relative imports resolved). ``module_level``: only the imports that run when the
    module is imported (``_module_level``), not those inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in (_module_level(tree) if module_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("specdec")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("specdec"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in known else base))
    return found


def check(root: Path) -> list[str]:
    """Every import that runs up the layers, and every module in no layer."""
    modules = source_modules(root)
    known = set(modules)
    problems = []
    for module, path in modules.items():
        rank = layer_of(module)
        if rank is None:
            problems.append(f"{module} ({path.relative_to(root)}) is in no layer: add it to LAYERS")
            continue
        for line, target in imports_of(module, path, known):
            target_rank = layer_of(target)
            if target_rank is None:
                problems.append(f"{path.relative_to(root)}:{line} imports {target}, which is in no layer")
            elif target_rank > rank:
                problems.append(f"{path.relative_to(root)}:{line} ({module}, layer {rank}) imports {target} "
                                f"(layer {target_rank}): imports must not run up the layers")
    return problems


def import_cycles(root: Path, module_level: bool = False) -> list[list[str]]:
    """Every cycle of imports among the package's modules, as the strongly connected components of the import graph
    with more than one module (or a module importing itself), each sorted. ``module_level=False`` (the stricter):
    every import, inside functions too - a lazy import that closes a loop still ties the modules together;
    ``module_level=True``: only the imports that run when a module is imported (``_module_level``)."""
    modules = source_modules(root)
    known = set(modules)
    graph = {m: sorted({t for _, t in imports_of(m, p, known, module_level) if t in known})
             for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan; the graph is ~200 modules, well inside the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles():
    """No cycle, counting imports inside functions too (the last one, before the checkpoint package: the quantised
    loader imported the model loader for ``cache_root``, which imported the quantised loader lazily)."""
    cycles = import_cycles(REPO)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_a_cycle(tmp_path):
    """A planted cycle (a -> b -> a at module level) is reported; a pair joined by an import inside a function and
    one under ``if TYPE_CHECKING:`` (c <-> d) is reported only when imports inside functions count."""
    for rel in ("specdec/__init__.py", "specdec/pkg/__init__.py", "kernels/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "specdec/pkg/a.py").write_text("from specdec.pkg.b import g\n")
    (tmp_path / "specdec/pkg/b.py").write_text("import specdec.pkg.a\n\ndef g():\n    return 1\n")
    (tmp_path / "specdec/pkg/c.py").write_text("def f():\n    from specdec.pkg.d import g\n    return g\n")
    (tmp_path / "specdec/pkg/d.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from specdec.pkg.c import f\n\n"
        "from specdec.pkg import c\n\ndef g():\n    return c\n")
    assert import_cycles(tmp_path, module_level=True) == [["specdec.pkg.a", "specdec.pkg.b"]]
    assert import_cycles(tmp_path) == [["specdec.pkg.a", "specdec.pkg.b"], ["specdec.pkg.c", "specdec.pkg.d"]]


def test_imports_run_one_way():
    problems = check(REPO)
    assert not problems, "\n".join(problems)


def test_the_checker_sees_an_import_that_runs_up(tmp_path):
    """A planted violation - a proposer importing the engine's Sequence, inside a function - is reported."""
    for rel in ("specdec/__init__.py", "specdec/spec_decode/__init__.py", "specdec/engine/__init__.py",
                "specdec/engine/sequence.py", "kernels/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "specdec/spec_decode/proposer.py").write_text(
        "def propose(seqs):\n    from specdec.engine.sequence import Sequence\n    return Sequence\n")
    (tmp_path / "specdec/stray.py").write_text("")
    problems = check(tmp_path)
    assert any("proposer.py:2" in p and "specdec.engine.sequence" in p for p in problems), problems
    assert any("specdec.stray" in p and "no layer" in p for p in problems), problems


@pytest.mark.parametrize("module,rank", [("specdec.spec_decode.proposers.ngram", 4), ("specdec.runner.staging", 3),
                                         ("specdec.kernels.philox", 0), ("specdec", 6), ("specdec.ops", 1)])
def test_layer_of(module, rank):
    assert layer_of(module) == rank
