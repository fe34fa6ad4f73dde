"""A plan as one self-contained HTML page (``to_html``): a summary, the legend, one section
per folded group of layers with its values, parameters and collectives, the plan's data as
JSON; its CSS and JS (page.css, page.js beside this module) inline (the guarantees:
``autotp.presentation.render``)."""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any, Iterable, Optional, Sequence

from autotp.presentation.render import (LEGEND, Shown, View, param_keys, build_view,
                                    collectives_phrase, group_title, layout_class, shape_text,
                                    short_op, strategy_tag, time_text)
from autotp.presentation.report import (PHASE_SHORT, Group, group_names, human_bytes, layer_ranges,
                                    relative_name)
from autotp.layout import ROUTED
from autotp.planner.cost import CostModel
from autotp.planner.plan import Plan


def _asset(name: str) -> str:
    """A file shipped beside this module (package data)."""
    return resources.files("autotp.presentation").joinpath(name).read_text(encoding="utf-8")


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


CSS = "\n" + _asset("page.css")

JS = "\n" + _asset("page.js")

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:")


def _card(key: str, value: str, extra: str = "", notes: Sequence[str] = ()) -> str:
    items = "".join(f"<li>{esc(note)}</li>" for note in notes)
    return (f'<div class="card"><div class="k">{esc(key)}</div>'
            f'<div class="v{extra}">{esc(value)}</div>'
            + (f'<ul class="why">{items}</ul>' if items else "") + "</div>")


def _html_summary(view: View, cost_model: CostModel) -> str:
    s = view.data["summary"]
    per_layer = sorted({(g["forward"], g["backward"]) for g in s["groups"]})
    per_layer_text = ", ".join(f"{f} fwd + {b} bwd" for f, b in per_layer) or "none"
    verdict = s["bound"]  # autotp.planner.bound's, as the summary and the table print it
    share = s["param_bytes_per_rank"] / s["param_bytes"] if s["param_bytes"] else 1.0
    dtypes = ", ".join(sorted({p.dtype for p in view.plan.params.values()})) or "no parameters"
    cards = [
        _card("collectives per layer", per_layer_text),
        _card("vs Megatron", verdict["text"], " ok" if verdict["met"] else " bad",
              verdict["reasons"] + verdict["notes"]),
        _card("total per step", f"{s['forward_collectives']} fwd "
              f"({human_bytes(s['forward_bytes'])}) + {s['backward_collectives']} bwd "
              f"({human_bytes(s['backward_bytes'])})"),
        _card("estimated communication", f"{s['time_ms']:.2f} ms per step"),
        _card("parameters per rank", f"{human_bytes(s['param_bytes_per_rank'])} of "
              f"{human_bytes(s['param_bytes'])} ({share:.1%}, {dtypes})"),
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
        f'<header><h1>autotp plan <code>{esc(plan.model)}</code> · {esc(plan.degrees_text())}</h1>'
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
            f'<td class="mono">{esc(relative_name(name, layer, plan.layer_paths))}</td>'
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
    keys = param_keys(plan)
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
    held = {key: experts_per_rank(*experts[key], plan.degree, ep) for key in keys}
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
            paths.setdefault(relative_name(block, layer, plan.layer_paths), []).append(block)
    rows = []
    for block, keys in blocks.items():
        folded = group_names(paths.get(relative_name(block, rep, plan.layer_paths), [block]))
        weights = "".join(_expert_weight(plan, key, block) for key in keys)
        rows.append(
            f'<tr class="experts-row" data-block="{esc(folded)}" title="{esc(folded)}">'
            f'<td class="mono block">{esc(relative_name(block, rep, plan.layer_paths))}'
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
        return relative_name(info.param, layer, view.plan.layer_paths)
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
    title = f"autotp plan: {plan.model} {plan.degrees_text()}"
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
