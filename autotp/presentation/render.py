"""Pictures of a Plan: a Graphviz digraph (``autotp.presentation.dot.to_dot``) and one
self-contained HTML page (``autotp.presentation.page.to_html``), for ``autotp plan MODEL --tp N
--format dot|html``. This module holds what both draw: the view of a plan (``build_view``:
its nodes, layers folded, collectives marked) and the shared vocabulary (layout classes and
colours, short op names, shapes, times).

What this module guarantees:

- Both renderers are pure functions of ``(plan, cost_model)``: the same plan gives
  byte-identical text (graph order, collective order and sorted parameters only; no clocks,
  no hashing, no ids from memory addresses).
- Identical layers are folded exactly as ``report.fold_layers`` groups them: the first layer
  of each group is drawn once and stands for the group; the other layers of the group are left
  out. A value read across the fold (the last layer's output read by the final norm) is drawn
  from the same value of the group's first layer, through the group's cluster.
- Run-time checks of the traced program (``CHECK_OPS``: ``_assert_tensor_metadata``) are not
  drawn: they produce no value.
- Every collective of the shown layers and of the code outside the layers is marked on the
  value it redistributes, with its kind, phase, layouts, bytes and alpha-beta time at the cost
  model's (B, T); the numbers are those of ``report.to_dict``.
- DOT: a valid Graphviz ``digraph``: every id and label is a quoted, escaped string.
- HTML: one file with inline CSS and JS only (a Content-Security-Policy forbids anything
  else), readable without a network; every text taken from the plan is escaped; the data of
  ``report.to_dict(plan, cost_model)`` is embedded as JSON in
  ``<script type="application/json" id="autotp-plan">`` and ``json.loads`` of that element's
  text gives it back unchanged. Only the stdlib is used.
- HTML, mixture of experts: a plan with stacked expert weights (``plan.experts``) gets a
  summary line under the title (``plan.experts_summary()``) and, in each section, one row per
  MoE block (the module path the stacked weights share) saying how many experts each
  rank holds; a plan without them shows neither. Values of rows routed to the experts
  (``S(0)@experts``) carry a dashed badge.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from autotp.planner.cost import CostModel
from autotp.planner.plan import CollectiveRecord, Plan
from autotp.presentation.report import PHASE_SHORT, Group, fold_layers, layer_ranges, to_dict

# ---- layouts -------------------------------------------------------------------------------

LAYOUT_CLASSES = ("replicated", "sharded", "partial", "tuple", "none")
FILL = {"replicated": "#dbeafe", "sharded": "#bbf7d0", "partial": "#fed7aa",
        "tuple": "#e9d5ff", "none": "#f1f5f9"}
STROKE = {"replicated": "#2563eb", "sharded": "#15803d", "partial": "#c2410c",
          "tuple": "#7e22ce", "none": "#64748b"}
LEGEND = (("replicated", "R / R*", "replicated (R*: gradient is a partial sum)"),
          ("sharded", "S(d)", "sharded along dim d (S(d)x3: fused blocks, each sharded)"),
          ("partial", "P", "partial sum: the value is the sum over ranks"),
          ("tuple", "(…)", "tuple of layouts (multi-output op)"),
          ("none", "–", "no tensor layout"))
COLLECTIVE_COLOUR = "#dc2626"
# Run-time checks of the traced program (dtype/shape assertions): they produce no value and
# nothing flows through them, so the pictures leave them out.
CHECK_OPS = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"})


def layout_class(text: Optional[str]) -> str:
    """``"R"``/``"R*"`` -> replicated, ``"S(2)"`` -> sharded, ``"P"`` -> partial, ..."""
    if not text or text == "-":
        return "none"
    if text.startswith("("):
        return "tuple"
    if text.startswith("R"):
        return "replicated"
    if text.startswith("S"):
        return "sharded"
    if text == "P":
        return "partial"
    return "none"


def short_op(op: str) -> str:
    """``aten.linear.default`` -> ``linear``; ``aten.add.Tensor`` -> ``add.Tensor``."""
    if op.startswith("aten."):
        op = op[len("aten."):]
    if op.endswith(".default"):
        op = op[:-len(".default")]
    return op


def shape_text(shape: Iterable[int]) -> str:
    return "×".join(str(s) for s in shape) or "scalar"


def strategy_tag(strategy: str) -> str:
    """``"(R*, S(0)) -> S(2)  [column]"`` -> ``"column"``."""
    if strategy.endswith("]") and "[" in strategy:
        return strategy[strategy.rindex("[") + 1:-1]
    return ""


def time_text(time_us: float) -> str:
    return f"{time_us / 1e3:.3f} ms" if time_us >= 1000 else f"{time_us:.1f} µs"


def kind_text(kind: str, count: int = 1) -> str:
    """``all_reduce`` -> ``all-reduce`` (``all-reduces`` when count != 1)."""
    return kind.replace("_", "-") + ("" if count == 1 else "s")


# ---- the folded view of a plan -------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    name: str
    kind: str  # input | param | buffer | op | getitem | output
    op: str
    layout: Optional[str]
    layer: Optional[int]
    param: Optional[str]  # the plan.params key of a parameter leaf


@dataclass(frozen=True)
class Shown:
    """One collective that is drawn: its record, its evaluated row of ``to_dict``, and the
    drawn node it sits on (None: a gradient sync of parameters, not on a graph value)."""

    record: CollectiveRecord
    row: dict[str, Any]
    site: Optional[str]


@dataclass
class View:
    plan: Plan
    data: dict[str, Any]
    groups: list[Group]
    nodes: dict[str, NodeInfo]  # graph order
    rep_of_layer: dict[int, int]  # layer -> the first layer of its group
    by_layer: dict[Optional[int], list[str]]  # graph order
    consumers: dict[str, list[str]]
    shown: list[Shown]

    def drawn(self, name: str) -> bool:
        layer = self.nodes[name].layer
        return layer is None or self.rep_of_layer.get(layer, layer) == layer

    def representative(self, name: str) -> Optional[str]:
        """The node of the group's first layer that stands for ``name`` (itself if drawn)."""
        if self.drawn(name):
            return name
        layer = self.nodes[name].layer
        assert layer is not None, "a node outside the layers is drawn"
        own, rep = self.by_layer[layer], self.by_layer.get(self.rep_of_layer[layer], [])
        index = own.index(name)
        if index < len(rep) and self.nodes[rep[index]].kind == self.nodes[name].kind:
            return rep[index]
        return rep[-1] if rep else None

    def region(self, name: str) -> Optional[int]:
        """The cluster (first layer of a group) a drawn node belongs to, or None (outside)."""
        layer = self.nodes[name].layer
        return layer if layer is not None and layer in self.rep_of_layer else None

    def markers(self, name: str) -> list[Shown]:
        return [s for s in self.shown if s.site == name]


def _node_kind(plan: Plan, name: str, param_keys: dict[str, str]) -> str:
    op = plan.ops.get(name, "")
    if op in ("input", "getitem", "output"):
        return op
    if name in plan.choices:
        return "op"
    return "param" if op in param_keys else "buffer"


def param_keys(plan: Plan) -> dict[str, str]:
    """Every name of a parameter (tied aliases included) -> its plan.params key."""
    keys: dict[str, str] = {}
    for key, p in plan.params.items():
        for alias in (key, *p.names):
            keys.setdefault(alias, key)
    return keys


def _consumers(plan: Plan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in plan.graph}
    for name, inputs in plan.graph.items():
        if plan.ops.get(name) in CHECK_OPS:
            continue
        for value in inputs:
            if name not in out.setdefault(value, []):
                out[value].append(name)
    return out


def _leaf_layer(plan: Plan, name: str, kind: str, param: Optional[str],
                consumers: dict[str, list[str]]) -> Optional[int]:
    if kind == "param" and param is not None:
        return plan.params[param].layer
    layers = {plan.node_layers.get(c) for c in consumers.get(name, [])}
    return layers.pop() if len(layers) == 1 else None


def _natural_key(name: str) -> tuple[str, int]:
    """``linear_12`` -> ("linear", 12), ``linear`` -> ("linear", -1): fx's naming order."""
    base, _, suffix = name.rpartition("_")
    return (base, int(suffix)) if base and suffix.isdigit() else (name, -1)


def execution_order(plan: Plan) -> list[str]:
    """The graph's nodes, each after its inputs: the plan's own order when it already is
    one (a fresh plan), else a topological order with fx's naming order breaking ties (a plan
    read back from JSON, whose keys are sorted)."""
    names = list(plan.graph)
    position = {name: i for i, name in enumerate(names)}
    if all(position.get(v, -1) < position[n] for n in names for v in plan.graph[n]):
        return names
    waiting = {n: sum(1 for v in set(plan.graph[n]) if v in position) for n in names}
    readers: dict[str, list[str]] = {}
    for n in names:
        for v in set(plan.graph[n]):
            readers.setdefault(v, []).append(n)
    ready = [(_natural_key(n), n) for n in names if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for reader in readers.get(name, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (_natural_key(reader), reader))
    return order + [n for n in names if n not in set(order)]  # cycles: never in an fx graph


def _nodes(plan: Plan, consumers: dict[str, list[str]]) -> dict[str, NodeInfo]:
    keys = param_keys(plan)
    nodes: dict[str, NodeInfo] = {}
    for name in execution_order(plan):
        if plan.ops.get(name) in CHECK_OPS:
            continue
        kind = _node_kind(plan, name, keys)
        op = plan.ops.get(name, "")
        param = keys.get(op) if kind == "param" else None
        if kind in ("param", "buffer"):
            layer = _leaf_layer(plan, name, kind, param, consumers)
        else:
            layer = plan.node_layers.get(name)
        nodes[name] = NodeInfo(name, kind, op, plan.values.get(name), layer, param)
    return nodes




def build_view(plan: Plan, cost_model: CostModel) -> View:
    """Fold the plan's layers and evaluate its collectives once, for both renderers."""
    data = to_dict(plan, cost_model)
    groups = fold_layers(plan)
    rep_of_layer = {layer: g.layers[0] for g in groups for layer in g.layers}
    consumers = _consumers(plan)
    nodes = _nodes(plan, consumers)
    by_layer: dict[Optional[int], list[str]] = {}
    for name, info in nodes.items():
        by_layer.setdefault(info.layer, []).append(name)
    view = View(plan, data, groups, nodes, rep_of_layer, by_layer, consumers, [])
    for record, row in zip(plan.collectives, data["collectives"]):
        if record.layer is not None and rep_of_layer.get(record.layer, record.layer) != \
                record.layer:
            continue  # the same collective of the group's first layer stands for it
        first = record.members[0]  # a join's first value stands for it
        site = view.representative(first) if first in nodes else None
        view.shown.append(Shown(record, row, site))
    return view


def group_title(group: Group) -> str:
    if len(group.layers) == 1:
        return f"layer {group.layers[0]}"
    return f"layers {layer_ranges(group.layers)}"


def collectives_phrase(records: Iterable[CollectiveRecord]) -> str:
    """``2 fwd + 2 bwd all-reduces``; ``fwd: 1 all-reduce, 1 all-gather; bwd: ...``."""
    records = list(records)
    if not records:
        return "no collectives"
    kinds = sorted({r.kind for r in records})
    counts = {ph: [r for r in records if r.phase == ph] for ph in ("forward", "backward")}
    if len(kinds) == 1:
        total = len(records)
        return (f"{len(counts['forward'])} fwd + {len(counts['backward'])} bwd "
                f"{kind_text(kinds[0], total)}")
    parts = []
    for phase, recs in counts.items():
        if recs:
            per_kind = ", ".join(f"{sum(1 for r in recs if r.kind == k)} "
                                 f"{kind_text(k, sum(1 for r in recs if r.kind == k))}"
                                 for k in kinds if any(r.kind == k for r in recs))
            parts.append(f"{PHASE_SHORT[phase]}: {per_kind}")
    return "; ".join(parts)
