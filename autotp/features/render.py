"""Pictures of a Plan: a Graphviz digraph (``to_dot``) and one self-contained HTML page
(``to_html``), for ``autotp plan MODEL --tp N --format dot|html``.

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
import html
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from autotp.layout import ROUTED
from autotp.planner.cost import CostModel
from autotp.planner.plan import CollectiveRecord, Plan
from autotp.features.report import (
    PHASE_SHORT,
    Group,
    fold_layers,
    grad_sync_params,
    group_names,
    human_bytes,
    layer_ranges,
    relative_name,
    relative_source,
    to_dict,
)

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


def _param_keys(plan: Plan) -> dict[str, str]:
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
    keys = _param_keys(plan)
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


# ---- DOT -----------------------------------------------------------------------------------


def dot_quote(text: str) -> str:
    """A DOT double-quoted string; newlines become ``\\n`` (centred lines)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\r", "").replace("\n", "\\n")
    return f'"{escaped}"'


def dot_attrs(**attrs: str) -> str:
    return "[" + ", ".join(f"{k}={dot_quote(v)}" for k, v in attrs.items()) + "]"


def _dot_node(view: View, name: str) -> str:
    info = view.nodes[name]
    cls = layout_class(info.layout)
    layout = info.layout or "–"
    style = {"fillcolor": FILL[cls], "color": STROKE[cls]}
    if info.kind == "param" and info.param is not None:
        p = view.plan.params[info.param]
        label = (f"{info.param}\n{layout}  {shape_text(p.global_shape)} → "
                 f"{shape_text(p.local_shape)}" + ("\ngrad all-reduce" if p.grad_sync else ""))
        attrs = dot_attrs(label=label, shape="cylinder", style="filled", **style)
    elif info.kind == "buffer":
        attrs = dot_attrs(label=f"{info.op}\n{layout} (buffer)", shape="cylinder",
                          style="filled,dashed", **style)
    elif info.kind in ("input", "output"):
        attrs = dot_attrs(label=f"{name}\n{info.kind} {layout}",
                          shape="invhouse" if info.kind == "input" else "house",
                          style="filled", **style)
    else:
        choice = view.plan.choices.get(name)
        tag = strategy_tag(choice.strategy) if choice else ""
        label = f"{name}\n{short_op(info.op)}" + (f" [{tag}]" if tag else "") + f"\n{layout}"
        attrs = dot_attrs(label=label, shape="box", style="rounded,filled",
                          tooltip=choice.strategy if choice else info.op, **style)
    return f"{dot_quote(name)} {attrs};"


def _collective_line(shown: Shown) -> str:
    row = shown.row
    return (f"{row['kind']} {PHASE_SHORT.get(row['phase'], row['phase'])} "
            f"{human_bytes(row['bytes'])}  {row['from']}→{row['to']}")


def _diamonds(view: View) -> dict[tuple[str, str, str], list[Shown]]:
    """Collectives on graph values, one diamond per (drawn value, from, to)."""
    out: dict[tuple[str, str, str], list[Shown]] = {}
    for s in view.shown:
        if s.site is not None:
            out.setdefault((s.site, s.record.src, s.record.dst), []).append(s)
    return out


def _diamond_id(key: tuple[str, str, str]) -> str:
    return f"collective:{key[0]}:{key[1]}->{key[2]}"


def _dot_diamond(node_id: str, shown: list[Shown]) -> str:
    label = "\n".join(_collective_line(s) for s in shown)
    sources = sorted({relative_source(s.record.source) or "" for s in shown} - {""})
    return (f"{dot_quote(node_id)} "
            + dot_attrs(label=label, shape="diamond", style="filled", fillcolor="#fee2e2",
                        color=COLLECTIVE_COLOUR, fontcolor=COLLECTIVE_COLOUR,
                        tooltip=", ".join(sources) or "collective") + ";")


def _grad_sync_lines(view: View) -> list[str]:
    lines = []
    leaf_of = {info.param: name for name, info in view.nodes.items()
               if info.kind == "param" and view.drawn(name)}
    for index, s in enumerate(v for v in view.shown if v.site is None):
        node_id = f"collective:grad-sync:{index}"
        params = grad_sync_params(s.record.node)
        label = f"{_collective_line(s)}\ngrad sync of {len(params)} replicated parameter(s)"
        lines.append(f"  {dot_quote(node_id)} " + dot_attrs(
            label=label, shape="diamond", style="filled", fillcolor="#fee2e2",
            color=COLLECTIVE_COLOUR, fontcolor=COLLECTIVE_COLOUR) + ";")
        for param in params:
            if param in leaf_of:
                lines.append(f"  {dot_quote(leaf_of[param])} -> {dot_quote(node_id)} "
                             + dot_attrs(color=COLLECTIVE_COLOUR, style="dashed") + ";")
    return lines


def _cluster_id(layer: int) -> str:
    return f"cluster_layers_{layer}"


def _dot_clusters(view: View, diamonds: dict[tuple[str, str, str], list[Shown]]) -> list[str]:
    lines = []
    for group in view.groups:
        rep = group.layers[0]
        count = len(group.layers)
        label = group_title(group) + (f" (x{count})" if count > 1 else "")
        label += f"\n{collectives_phrase(group.collectives)} per layer"
        lines.append(f"  subgraph {dot_quote(_cluster_id(rep))} {{")
        attrs = dot_attrs(label=label, style="rounded,dashed", color="#475569")
        lines.append(f"    graph {attrs};")
        for name in view.by_layer.get(rep, []):
            lines.append("    " + _dot_node(view, name))
        for key, shown in diamonds.items():
            if view.region(key[0]) == rep:
                lines.append("    " + _dot_diamond(_diamond_id(key), shown))
        lines.append("  }")
    return lines


def _dot_outside(view: View, diamonds: dict[tuple[str, str, str], list[Shown]]) -> list[str]:
    lines = []
    for name in view.nodes:
        if view.drawn(name) and view.region(name) is None:
            lines.append("  " + _dot_node(view, name))
    for key, shown in diamonds.items():
        if view.region(key[0]) is None:
            lines.append("  " + _dot_diamond(_diamond_id(key), shown))
    return lines


def _layout_changes(plan: Plan) -> dict[tuple[str, str], list[tuple[str, str, list[str]]]]:
    """(value, consumer) -> (from, to, collective kinds) of each layout change on that edge."""
    out: dict[tuple[str, str], list[tuple[str, str, list[str]]]] = {}
    for e in plan.edges:
        kinds = [f"{k} {ph}" for k, ph in ((e.forward, "fwd"), (e.backward, "bwd")) if k]
        out.setdefault((e.value, e.consumer), []).append((e.src, e.dst, kinds))
    return out


def _across_fold(view: View, value: str, tail: str) -> dict[str, str]:
    """Edge attributes for a value read across the fold (drawn from the group's cluster)."""
    if tail == value:
        return {}
    attrs = {"label": f"from layer {view.nodes[value].layer}", "style": "dashed"}
    region = view.region(tail)
    if region is not None:
        attrs["ltail"] = _cluster_id(region)
    return attrs


def _dot_edges(view: View, diamonds: dict[tuple[str, str, str], list[Shown]]) -> list[str]:
    """Dataflow edges into drawn nodes; a redistribution goes through its collective's
    diamond, a local layout change (no communication) is labelled in grey."""
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    layout_changes = _layout_changes(view.plan)

    def add(tail: str, head: str, **attrs: str) -> None:
        if (tail, head) not in seen:
            seen.add((tail, head))
            lines.append(f"  {dot_quote(tail)} -> {dot_quote(head)}"
                         + (f" {dot_attrs(**attrs)}" if attrs else "") + ";")

    for consumer in view.nodes:
        if not view.drawn(consumer):
            continue
        for value in view.plan.graph[consumer]:
            tail = view.representative(value) if value in view.nodes else None
            if tail is None:
                continue
            base = _across_fold(view, value, tail)
            changes = layout_changes.get((value, consumer), [])
            if not changes:
                add(tail, consumer, **base)
            for src, dst, kinds in changes:
                key = (tail, src, dst)
                if kinds and key in diamonds:
                    diamond = _diamond_id(key)
                    add(tail, diamond, color=COLLECTIVE_COLOUR, penwidth="2")
                    add(diamond, consumer, color=COLLECTIVE_COLOUR, penwidth="2",
                        **{k: v for k, v in base.items() if k != "ltail"})
                elif kinds:
                    add(tail, consumer, color=COLLECTIVE_COLOUR, fontcolor=COLLECTIVE_COLOUR,
                        **{**base, "label": f"{src}→{dst} " + ", ".join(kinds)})
                else:
                    add(tail, consumer, color="#94a3b8", fontcolor="#64748b",
                        **{**base, "label": f"{src}→{dst}"})
    return lines


def _dot_legend() -> list[str]:
    lines = ['  subgraph "cluster_legend" {',
             f"    graph {dot_attrs(label='layouts', style='rounded', color='#cbd5e1')};"]
    for cls, short, text in LEGEND:
        lines.append(f"    {dot_quote('legend:' + cls)} " + dot_attrs(
            label=f"{short}\n{text}", shape="box", style="rounded,filled",
            fillcolor=FILL[cls], color=STROKE[cls]) + ";")
    lines.append(f"    {dot_quote('legend:collective')} " + dot_attrs(
        label="collective\n(kind, phase, bytes)", shape="diamond", style="filled",
        fillcolor="#fee2e2", color=COLLECTIVE_COLOUR, fontcolor=COLLECTIVE_COLOUR) + ";")
    lines.append("  }")
    return lines


def to_dot(plan: Plan, cost_model: CostModel) -> str:
    """A Graphviz digraph of the plan's dataflow, identical layers folded."""
    view = build_view(plan, cost_model)
    diamonds = _diamonds(view)
    s = view.data["summary"]
    title = (f"autotp plan: {plan.model}, tp={plan.tp}, {plan.layers} layers; bytes at "
             f"B={cost_model.batch} T={cost_model.seq}; {s['forward_collectives']} fwd + "
             f"{s['backward_collectives']} bwd collectives, {s['time_ms']:.2f} ms")
    lines = ["digraph autotp {",
             f"  graph {dot_attrs(label=title, labelloc='t', rankdir='TB', compound='true', fontname='Helvetica', newrank='true')};",  # noqa: E501
             f"  node {dot_attrs(fontname='Helvetica', fontsize='10')};",
             f"  edge {dot_attrs(fontname='Helvetica', fontsize='9', color='#475569')};"]
    lines += _dot_legend()
    lines += _dot_clusters(view, diamonds)
    lines += _dot_outside(view, diamonds)
    lines += _grad_sync_lines(view)
    lines += _dot_edges(view, diamonds)
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- HTML ----------------------------------------------------------------------------------


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def badge(layout: Optional[str], text: Optional[str] = None) -> str:
    cls = layout_class(layout)
    routed = " routed" if is_routed(layout) else ""
    return f'<span class="badge lay-{cls}{routed}">{esc(text or layout or "–")}</span>'


def json_for_script(data: Any) -> str:
    """JSON that is safe inside <script>: no '<', '>' or '&' (escaped as \\u003c ...)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


CSS = """
:root{--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--red:#dc2626}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:var(--bg)}
header{background:#fff;border-bottom:1px solid var(--line);padding:16px 24px}
main{padding:16px 24px;max-width:1400px}
h1{font-size:20px;margin:0 0 4px}h1 code{font-size:19px}
h3{font-size:14px;margin:14px 0 6px;color:#334155}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.meta{color:var(--muted);margin:0 0 12px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0 12px}
.card{background:var(--bg);border:1px solid var(--line);border-radius:8px;padding:8px 12px;
min-width:190px}
.card .k{color:var(--muted);font-size:12px}.card .v{font-size:16px;font-weight:600}
.ok{color:#15803d}.bad{color:var(--red)}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin:6px 0 10px;
color:#334155;font-size:12.5px}
.badge{display:inline-block;min-width:34px;text-align:center;padding:0 6px;border-radius:10px;
border:1px solid;font:600 12px/18px ui-monospace,Menlo,Consolas,monospace;white-space:nowrap}
.lay-replicated{background:#dbeafe;border-color:#2563eb;color:#1e3a8a}
tr.blocked td:first-child{color:#b91c1c;font-weight:600}tr.blocked td:last-child{color:#b91c1c}
.lay-sharded{background:#bbf7d0;border-color:#15803d;color:#14532d}
.lay-partial{background:#fed7aa;border-color:#c2410c;color:#7c2d12}
.lay-tuple{background:#e9d5ff;border-color:#7e22ce;color:#581c87}
.lay-none{background:#f1f5f9;border-color:#94a3b8;color:#475569}
.coll{display:inline-block;background:#fee2e2;border:1px solid var(--red);color:#991b1b;
border-radius:4px;padding:0 6px;font-size:12px;white-space:nowrap}
.tools{display:flex;gap:8px;align-items:center;flex-wrap:wrap}
.tools input{padding:5px 8px;border:1px solid #cbd5e1;border-radius:6px;min-width:280px}
.tools button{padding:5px 10px;border:1px solid #cbd5e1;border-radius:6px;background:#fff;
cursor:pointer}
.tools .count{color:var(--muted)}
details.group{background:#fff;border:1px solid var(--line);border-radius:8px;margin:0 0 12px;
padding:0 14px}
details.group>summary{cursor:pointer;padding:10px 0;font-weight:600;font-size:15px}
details.group>summary .sub{font-weight:400;color:var(--muted)}
details.sub>summary{cursor:pointer;color:#334155;font-weight:600;margin:12px 0 6px}
table{border-collapse:collapse;width:100%;margin:0 0 8px}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:12px;color:var(--muted);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.nowrap{white-space:nowrap}
tr[hidden]{display:none}
ol.flow{list-style:none;margin:4px 0 14px;padding:0 0 0 14px;border-left:2px solid #cbd5e1}
ol.flow li{position:relative;padding:2px 0 2px 10px;display:flex;gap:8px;align-items:baseline;
flex-wrap:wrap}
ol.flow li::before{content:"";position:absolute;left:-20px;top:8px;width:10px;height:10px;
border-radius:50%;background:var(--dot,#94a3b8)}
ol.flow li.dot-replicated{--dot:#2563eb}ol.flow li.dot-sharded{--dot:#15803d}
ol.flow li.dot-partial{--dot:#c2410c}ol.flow li.dot-tuple{--dot:#7e22ce}
ol.flow li.mark{padding-left:26px}ol.flow li.mark::before{background:var(--red);
border-radius:2px;transform:rotate(45deg)}
.name{font-weight:600}.op{color:#334155}.strategy{color:var(--muted)}
.inputs{color:var(--muted);font-size:12px}
.tag{background:#f1f5f9;border-radius:4px;padding:0 5px;font-size:12px;color:#334155}
.muted{color:var(--muted)}
.badge.routed{border-style:dashed}
.moe{background:#f0fdfa;border:1px solid #99f6e4;border-radius:8px;padding:6px 12px;
margin:0 0 10px;color:#134e4a}
.moe .k{font-weight:600}
table.experts td.block{font-weight:600}table.experts td.block .muted{font-weight:400}
table.experts .weight{display:flex;gap:8px;align-items:baseline;flex-wrap:wrap;padding:1px 0}
.edim{color:#0f766e;font-weight:600}
"""

JS = """
(function () {
  var rows = Array.prototype.slice.call(document.querySelectorAll("tr.param-row"));
  var box = document.getElementById("param-filter");
  var count = document.getElementById("param-count");
  function apply() {
    var q = box.value.trim().toLowerCase();
    var shown = 0;
    rows.forEach(function (row) {
      var hit = row.getAttribute("data-name").toLowerCase().indexOf(q) >= 0;
      row.hidden = !hit;
      if (hit) { shown += 1; }
      if (hit && q) { var d = row.closest("details.group"); if (d) { d.open = true; } }
    });
    count.textContent = String(shown);
  }
  function setAll(open) {
    document.querySelectorAll("details").forEach(function (d) { d.open = open; });
  }
  var fromUrl = /[#&]filter=([^&]*)/.exec(window.location.hash);
  if (fromUrl) { box.value = decodeURIComponent(fromUrl[1]); }
  box.addEventListener("input", apply);
  document.getElementById("expand-all").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse-all").addEventListener("click", function () {
    setAll(false);
  });
  var data = JSON.parse(document.getElementById("autotp-plan").textContent);
  document.body.dataset.collectives = String(data.collectives.length);
  apply();
  document.body.dataset.ready = "1";
})();
"""

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:")


def _card(key: str, value: str, extra: str = "") -> str:
    return (f'<div class="card"><div class="k">{esc(key)}</div>'
            f'<div class="v{extra}">{esc(value)}</div></div>')


def _html_summary(view: View, cost_model: CostModel) -> str:
    s = view.data["summary"]
    per_layer = sorted({(g["forward"], g["backward"]) for g in s["groups"]})
    per_layer_text = ", ".join(f"{f} fwd + {b} bwd" for f, b in per_layer) or "none"
    bound = s["megatron_bound"]
    verdict = ("meets" if s["meets_bound"] else "EXCEEDS") + \
        f" the Megatron bound ({bound['forward']} + {bound['backward']})"
    share = s["param_bytes_per_rank"] / s["param_bytes"] if s["param_bytes"] else 1.0
    cards = [
        _card("collectives per layer", per_layer_text),
        _card("vs Megatron", verdict, " ok" if s["meets_bound"] else " bad"),
        _card("total per step", f"{s['forward_collectives']} fwd "
              f"({human_bytes(s['forward_bytes'])}) + {s['backward_collectives']} bwd "
              f"({human_bytes(s['backward_bytes'])})"),
        _card("estimated communication", f"{s['time_ms']:.2f} ms per step"),
        _card("parameters per rank", f"{human_bytes(s['param_bytes_per_rank'])} of "
              f"{human_bytes(s['param_bytes'])} ({share:.1%}, fp32)"),
    ]
    if s["fallbacks"]:
        cards.append(_card("replicated fallbacks", str(len(s["fallbacks"])), " bad"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _html_legend(routed: bool = False) -> str:
    items = [f'<span>{badge(short if cls != "sharded" else "S(d)")} {esc(text)}</span>'
             for cls, short, text in LEGEND if cls != "none"]
    if routed:
        items.append(f"<span>{badge(f'S(0)@{ROUTED}')} rows routed to the experts each rank "
                     "holds (bounds known at run time)</span>")
    items.append('<span><span class="coll">⇄ collective</span> a redistribution of the value '
                 'above it</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def _html_header(view: View, cost_model: CostModel) -> str:
    plan = view.plan
    return (
        f'<header><h1>autotp plan <code>{esc(plan.model)}</code> · tp={plan.tp}</h1>'
        f'<p class="meta">{plan.layers} layers · bytes at B={cost_model.batch}, '
        f'T={cost_model.seq} · link {cost_model.bandwidth / 1e9:g} GB/s per rank, '
        f'{cost_model.latency * 1e6:g} µs latency per collective + '
        f'{cost_model.step_latency * 1e6:g} µs per ring step</p>'
        + _experts_line(plan) + _html_summary(view, cost_model)
        + _html_legend(bool(plan.experts))
        + '<div class="tools"><input id="param-filter" type="search" '
          'placeholder="filter parameters by name…" aria-label="filter parameters">'
          '<button id="expand-all" type="button">expand all</button>'
          '<button id="collapse-all" type="button">collapse all</button>'
          '<span class="count"><span id="param-count">–</span> parameter rows shown</span>'
          '</div></header>')


def _param_rows(plan: Plan, names: list[str], layer: Optional[int]) -> str:
    rows = []
    for name in names:
        p = plan.params[name]
        notes = []
        if p.grad_sync:
            notes.append("gradient all-reduced after backward")
        aliases = [a for a in p.names if a != name]
        if aliases:
            notes.append("tied: " + ", ".join(aliases))
        blocked = plan.blocked.get(name)
        if blocked is not None:  # kept whole although tp could shard it: what stops it
            notes += [f"whole: as {b['direction']}, {b['op'].removeprefix('aten.')} at "
                      f"{b['source']} {'takes' if b['direction'] == 'column' else 'gives'} "
                      f"no {b['layout']}" for b in blocked] or \
                ["whole for its cost: an exact sharding exists"]
        rows.append(
            f'<tr class="param-row{" blocked" if blocked is not None else ""}" '
            f'data-name="{esc(name)}" title="{esc(name)}">'
            f'<td class="mono">{esc(relative_name(name, layer))}</td>'
            f'<td class="num mono">{esc(shape_text(p.global_shape))}</td>'
            f"<td>{badge(p.layout)}</td>"
            f'<td class="num mono">{esc(shape_text(p.local_shape))}</td>'
            f'<td class="muted">{esc("; ".join(notes))}</td></tr>')
    head = ("<tr><th>parameter</th><th>global shape</th><th>layout</th><th>local shape</th>"
            "<th>notes</th></tr>")
    return f'<table class="params">{head}{"".join(rows)}</table>'


# ---- HTML: mixture of experts --------------------------------------------------------------


def is_routed(layout: Optional[str]) -> bool:
    """``"S(0)@experts"`` (or a tuple holding one): rows routed to the experts."""
    return bool(layout) and f"@{ROUTED}" in str(layout)


def experts_per_rank(count: int, how: str, tp: int, ep: int = 1) -> str:
    """``16 of 128 per rank, whole``; ``sliced: every rank holds a 1/8 slice of every
    expert``; ``replicated: every rank holds all 128 experts``. Whole experts are split over
    the tp ranks and, with expert parallelism, over ``ep`` data-parallel ranks too."""
    if how == "whole":
        over = f" (tp {tp} × ep {ep})" if ep > 1 else ""
        return f"{count // (tp * ep)} of {count} per rank, whole{over}"
    if how == "sliced":
        return f"sliced: every rank holds a 1/{tp} slice of every expert"
    return f"replicated: every rank holds all {count} experts"


def expert_shape_text(shape: Iterable[int]) -> str:
    """``(4, 64, 32)`` -> ``[4 experts]×64×32``: the experts dim (dim 0) marked."""
    dims = [str(s) for s in shape]
    if not dims:
        return "scalar"
    return "×".join([f"[{dims[0]} experts]", *dims[1:]])


def expert_layout_text(layout: str, how: str) -> str:
    """``S(0)`` of experts held whole -> ``S(0)·experts`` (dim 0, the experts, is split);
    a layout that splits inside every expert, or none, is shown as it is."""
    return f"{layout}·experts" if how == "whole" else layout


def experts_of_params(plan: Plan) -> dict[str, tuple[int, str]]:
    """``plan.experts`` keyed by plan.params keys (a tied alias names its parameter):
    stacked weight -> (experts, "whole" | "sliced" | "replicated")."""
    keys = _param_keys(plan)
    out: dict[str, tuple[int, str]] = {}
    for name, (count, how) in plan.experts.items():
        key = keys.get(name, name)
        if key in plan.params:
            out.setdefault(key, (int(count), str(how)))
    return out


def expert_blocks(plan: Plan, layer: Optional[int]) -> dict[str, list[str]]:
    """The stacked expert weights of ``layer`` (None: outside the layers) by the module
    path they share: ``model.layers.0.mlp.experts`` -> its stacked weights (plan.params
    keys, in the plan's order)."""
    blocks: dict[str, list[str]] = {}
    for key in experts_of_params(plan):
        if plan.params[key].layer == layer:
            blocks.setdefault(key.rpartition(".")[0] or key, []).append(key)
    return blocks


def _experts_line(plan: Plan) -> str:
    if not plan.experts:
        return ""
    return (f'<p class="moe experts-summary"><span class="k">mixture of experts:</span> '
            f"{esc(plan.experts_summary())}</p>")


def _expert_weight(plan: Plan, key: str, block: str) -> str:
    p = plan.params[key]
    how = experts_of_params(plan)[key][1]
    return (f'<div class="weight"><span class="mono">{esc(key[len(block) + 1:] or key)}</span>'
            f" {badge(p.layout, expert_layout_text(p.layout, how))}"
            f' <span class="mono">{esc(expert_shape_text(p.global_shape))} → '
            f"{esc(expert_shape_text(p.local_shape))}</span></div>")


def _block_held(plan: Plan, keys: list[str], block: str) -> str:
    """How a rank holds the experts of one block: one phrase, or one per stacked weight."""
    experts = experts_of_params(plan)
    ep = int(getattr(plan, "ep", 1) or 1)
    held = {key: experts_per_rank(*experts[key], plan.tp, ep) for key in keys}
    if len(set(held.values())) == 1:
        return next(iter(held.values()))
    return "; ".join(f"{key[len(block) + 1:]}: {text}" for key, text in held.items())


def _experts_section(view: View, layers: Optional[list[int]]) -> str:
    """One row per MoE block of the section's first layer (``layers``: the group's
    layers; None: outside the layers), named for every layer of the group it stands for."""
    plan = view.plan
    rep = layers[0] if layers else None
    blocks = expert_blocks(plan, rep)
    if not blocks:
        return ""
    paths: dict[str, list[str]] = {}
    scope: list[Optional[int]] = list(layers) if layers else [None]
    for layer in scope:
        for block in expert_blocks(plan, layer):
            paths.setdefault(relative_name(block, layer), []).append(block)
    rows = []
    for block, keys in blocks.items():
        folded = group_names(paths.get(relative_name(block, rep), [block]))
        weights = "".join(_expert_weight(plan, key, block) for key in keys)
        rows.append(
            f'<tr class="experts-row" data-block="{esc(folded)}" title="{esc(folded)}">'
            f'<td class="mono block">{esc(relative_name(block, rep))}'
            f'<div class="muted">{esc(folded)}</div></td>'
            f'<td class="experts-held"><span class="edim">{esc(_block_held(plan, keys, block))}'
            f"</span></td><td>{weights}</td></tr>")
    head = ("<tr><th>MoE block</th><th>experts per rank</th>"
            "<th>stacked weights: layout, global shape → local shape</th></tr>")
    routed = sum(1 for name in view.by_layer.get(rep, []) if is_routed(view.nodes[name].layout))
    note = (f'<p class="muted">{routed} value{"s" if routed != 1 else ""} of rows routed to '
            f"the experts ({esc(f'S(0)@{ROUTED}')}, dashed in the dataflow)</p>"
            if routed else "")
    where = f"layer {rep}" if rep is not None else "outside the layers"
    return (f'<section class="experts" data-layers="{esc(layer_ranges(layers or []))}">'
            f"<h3>experts of {esc(where)}</h3>"
            f'<table class="experts">{head}{"".join(rows)}</table>{note}</section>')


def _collective_rows(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="muted">no collectives</p>'
    out = []
    for c in rows:
        out.append(
            f"<tr><td>{esc(PHASE_SHORT.get(c['phase'], c['phase']))}</td>"
            f"<td><span class=\"coll\">{esc(c['kind'])}</span></td>"
            f"<td class=\"nowrap\">{badge(c['from'])} → {badge(c['to'])}</td>"
            f'<td class="num" title="{esc(c["bytes_expr"])} at B, T">'
            f"{esc(human_bytes(c['bytes']))}</td>"
            f'<td class="num">{esc(time_text(c["time_us"]))}</td>'
            f'<td class="mono">{esc(c["module"] or "")}</td>'
            f'<td class="mono muted">{esc(c["source"] or "")}</td>'
            f'<td class="mono muted">{esc(c["node"])}</td></tr>')
    head = ("<tr><th>phase</th><th>kind</th><th>from → to</th><th>bytes</th><th>time</th>"
            "<th>module</th><th>source</th><th>value</th></tr>")
    return f'<table class="collectives">{head}{"".join(out)}</table>'


def _marker(shown: Shown, view: View, section_layer: Optional[int]) -> str:
    row = shown.row
    consumers = ", ".join(c for name in shown.record.members
                          for c in view.consumers.get(name, []))
    layer = ""
    if shown.record.layer != section_layer:
        layer = " (outside the layers)" if shown.record.layer is None else \
            f" (layer {shown.record.layer})"
    where = " at ".join(x for x in (row["module"], row["source"]) if x)
    title = f"{row['bytes_expr']} bytes; read by {consumers}; {where}"
    return (f'<li class="mark"><span class="coll" title="{esc(title)}">⇄ '
            f"{esc(PHASE_SHORT.get(row['phase'], row['phase']))} {esc(row['kind'])}"
            f"{esc(layer)}</span> {badge(row['from'])} → {badge(row['to'])} "
            f'<span class="muted">{esc(human_bytes(row["bytes"]))} · '
            f'{esc(time_text(row["time_us"]))}</span></li>')


def _input_label(view: View, name: str, layer: Optional[int]) -> str:
    info = view.nodes.get(name)
    if info is not None and info.kind == "param" and info.param is not None:
        return relative_name(info.param, layer)
    return name


def _flow_row(view: View, name: str, layer: Optional[int]) -> str:
    info = view.nodes[name]
    choice = view.plan.choices.get(name)
    tag = strategy_tag(choice.strategy) if choice else ""
    strategy = choice.strategy.rsplit("[", 1)[0].strip() if choice else ""
    inputs = ", ".join(_input_label(view, i, layer) for i in view.plan.graph.get(name, []))
    parts = [f'<li class="dot-{layout_class(info.layout)}">{badge(info.layout)}',
             f'<span class="name mono">{esc(name)}</span>',
             f'<span class="op mono">{esc(short_op(info.op))}</span>']
    if tag:
        parts.append(f'<span class="tag">{esc(tag)}</span>')
    if strategy:
        parts.append(f'<span class="strategy mono">{esc(strategy)}</span>')
    if inputs:
        parts.append(f'<span class="inputs">← {esc(inputs)}</span>')
    return " ".join(parts) + "</li>"


def _flow(view: View, names: list[str], layer: Optional[int]) -> str:
    items = []
    for name in names:
        if view.nodes[name].kind in ("param", "buffer"):
            continue
        items.append(_flow_row(view, name, layer))
        items += [_marker(s, view, layer) for s in view.markers(name)]
    return '<ol class="flow">' + "".join(items) + "</ol>"


def _flow_section(view: View, names: list[str], layer: Optional[int], what: str,
                  is_open: bool) -> str:
    count = sum(1 for n in names if view.nodes[n].kind not in ("param", "buffer"))
    return (f'<details class="sub"{" open" if is_open else ""}><summary>dataflow of '
            f"{esc(what)} ({count} ops, in order)"
            f"</summary>{_flow(view, names, layer)}</details>")


def _group_section(view: View, group: Group) -> str:
    rep = group.layers[0]
    names = sorted(n for n, p in view.plan.params.items() if p.layer == rep)
    rows = [c for c in view.data["collectives"] if c["layer"] == rep]
    count = len(group.layers)
    title = group_title(group) + (f" ×{count}, identical" if count > 1 else "")
    blocks = expert_blocks(view.plan, rep)
    moe = f", {len(blocks)} MoE block{'s' if len(blocks) != 1 else ''}" if blocks else ""
    return (
        f'<details class="group" open data-layers="{esc(layer_ranges(group.layers))}">'
        f"<summary>{esc(title)}: {esc(collectives_phrase(group.collectives))}"
        f' <span class="sub">· {len(names)} parameters per layer{esc(moe)}</span></summary>'
        f"<h3>parameters of layer {rep}</h3>{_param_rows(view.plan, names, rep)}"
        + _experts_section(view, group.layers)
        + f"<h3>collectives of layer {rep}</h3>{_collective_rows(rows)}"
        + _flow_section(view, view.by_layer.get(rep, []), rep, f"layer {rep}", True)
        + "</details>")


def _outside_section(view: View) -> str:
    plan = view.plan
    names = [n for n, p in plan.params.items() if p.layer is None]
    rows = [c for c in view.data["collectives"] if c["layer"] is None]
    records = [s.record for s in view.shown if s.record.layer is None]
    nodes = [n for n in view.nodes if view.drawn(n) and view.region(n) is None]
    return (
        '<details class="group outside" open>'
        f"<summary>outside the layers: {esc(collectives_phrase(records))}"
        f' <span class="sub">· {len(names)} parameters</span></summary>'
        f"<h3>parameters</h3>{_param_rows(plan, names, None)}"
        + _experts_section(view, None)
        + f"<h3>collectives</h3>{_collective_rows(rows)}"
        + _flow_section(view, nodes, None, "the code outside the layers", False)
        + "</details>")


def _fallbacks_section(view: View) -> str:
    fallbacks = view.data["summary"]["fallbacks"]
    if not fallbacks:
        return ""
    items = "".join(f'<li class="mono">{esc(f)}</li>' for f in fallbacks)
    return (f'<details class="group" open><summary>replicated fallbacks ({len(fallbacks)})'
            f"</summary><ul>{items}</ul></details>")


def to_html(plan: Plan, cost_model: CostModel) -> str:
    """One self-contained HTML page: summary, legend, one section per group of identical
    layers, the code outside the layers, and the plan's data as embedded JSON."""
    view = build_view(plan, cost_model)
    title = f"autotp plan: {plan.model} tp={plan.tp}"
    body = (_html_header(view, cost_model) + "<main>"
            + "".join(_group_section(view, g) for g in view.groups)
            + _outside_section(view) + _fallbacks_section(view) + "</main>")
    summary = json_for_script(view.data["summary"])
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="generator" content="autotp">'
        f'<meta name="autotp-summary" content="{esc(summary)}">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n"
        f'<body data-ready="0">{body}\n'
        f'<script type="application/json" id="autotp-plan">{json_for_script(view.data)}'
        f"</script>\n<script>{JS}</script>\n</body></html>\n")
