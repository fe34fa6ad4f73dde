"""A plan as a Graphviz digraph (``to_dot``): one cluster per folded group of layers, each
value a node coloured by its layout, each collective a diamond on the value it moves
(the guarantees: ``autotp.presentation.render``)."""

from __future__ import annotations

from autotp.presentation.render import (COLLECTIVE_COLOUR, FILL, LEGEND, STROKE, Shown, View,
                                    build_view, collectives_phrase, group_title, layout_class,
                                    shape_text, short_op, strategy_tag)
from autotp.presentation.report import PHASE_SHORT, grad_sync_params, human_bytes, relative_source
from autotp.planner.cost import CostModel
from autotp.planner.plan import Plan


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
    title = (f"autotp plan: {plan.model}, {plan.degrees_text()}, {plan.layers} layers; bytes at "
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
