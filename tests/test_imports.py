"""The layers of autotp import one way: the op vocabulary, the rules (algebra over layouts,
which capture's op calls are written in), capture, the planner (the plan search), the job
model of ``autotp estimate`` (planner.job), the weights, the runtime, one rank's module, the
user API, the rooms on top of it (verification, presentation, integrations), the command
line. Read from the
source (``ast``), not by importing: a module-level import (outside ``if TYPE_CHECKING``) is
an edge; the module graph and the graph of layers must both be acyclic, and the rules are
algebra, importing nothing but rules and the vocabulary."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autotp": "autotp", "rules": "autotp.rules", "planner": "autotp.planner"}
# lowest first: a module may import its own layer and the layers before it
LAYERS = [
    {"autotp.errors", "autotp.ops", "autotp.layout", "autotp.progress"},
    {"autotp.rules"},
    {"autotp.capture"},
    {"autotp.planner"},
    {"autotp.planner.job"},
    {"autotp.weights"},
    {"autotp.runtime", "autotp.mesh"},
    {"autotp.sharded"},
    {"autotp.api", "autotp.options"},
    {"autotp.verification", "autotp.presentation", "autotp.integrations"},
    {"autotp.cli", "autotp.cli_support", "autotp.__main__", "autotp"},
]
VOCABULARY = LAYERS[0]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            name = ".".join(parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> nx.DiGraph:
    """module -> the autotp modules it imports at module level."""
    modules = _modules()
    graph = nx.DiGraph()

    def visit(name: str, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # imports inside functions run when called
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module:
                targets = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            else:
                visit(name, child)
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)

    for name, path in modules.items():
        graph.add_node(name)
        visit(name, ast.parse(path.read_text(encoding="utf-8")))
    return graph


def _layer(module: str) -> int:
    """The layer of the longest name in LAYERS that ``module`` is or lies under
    (autotp.planner.job.memory: autotp.planner.job's, not autotp.planner's)."""
    tops = [(len(top), index) for index, layer in enumerate(LAYERS)
            for top in layer - {"autotp"} if module == top or module.startswith(top + ".")]
    if tops:
        return max(tops)[1]
    assert module == "autotp", module
    return len(LAYERS) - 1


def test_modules_import_without_a_cycle() -> None:
    graph = import_graph()
    cycle = next(iter(nx.simple_cycles(graph)), None)
    assert cycle is None, " -> ".join(cycle + cycle[:1])


def test_layers_import_one_way() -> None:
    upward = [(a, b) for a, b in import_graph().edges if _layer(b) > _layer(a)]
    assert not upward, "\n".join(f"{a} imports {b}, a later layer" for a, b in upward)


def test_rules_import_only_rules_and_the_vocabulary() -> None:
    graph = import_graph()
    outside = [(a, b) for a, b in graph.edges if a.startswith("autotp.rules")
               and not (b.startswith("autotp.rules") or b in VOCABULARY)]
    assert not outside, outside


def test_the_layering_check_sees_an_upward_import() -> None:
    """A rule that imported the runtime (as lowerings once did) is found."""
    graph = import_graph()
    graph.add_edge("autotp.rules.views", "autotp.runtime.routed_rows")
    assert any(a == "autotp.rules.views" and _layer(b) > _layer(a) for a, b in graph.edges)
    # the plan search reading the job model is upward too
    assert _layer("autotp.planner.job.memory") > _layer("autotp.planner.solve")
    assert graph.number_of_nodes() > 60 and graph.number_of_edges() > 150
