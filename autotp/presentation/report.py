"""Reading a Plan: identical layers folded, bytes at a given (B, T), an alpha-beta time, and
the stable JSON schema of ``autotp plan --format json``.

JSON schema ``autotp.plan/1`` (keys sorted, so the same plan gives byte-identical JSON)::

    {"schema": "autotp.plan/1", "model": str, "tp": int, "layers": int,
     "batch": int, "seq": int, "bandwidth_GBps": float, "latency_us": float,
     "step_latency_us": float,  # per ring step: 2(tp-1) for an all-reduce, tp-1 otherwise
     "sequence_parallel": bool, "context_parallel": bool (the lead axis is cp: tp is then
     the cp degree),
     "outputs": ["R" | "S(2)" ...],  # as returned to the user
     "attention": {node: "ring: why" | "ulysses: why"},  # context parallelism only
     "context": {...},  # the cp axis beside tp: its plan (``Plan.on("cp")``), this schema
     "params": {name: {"layout": "S(0)" | "S(1)x3" | "R" ..., "global_shape": [int],
                       "local_shape": [int], "layer": int | null, "aliases": [str],
                       "grad_sync": bool}},
     "collectives": [{"kind": "all_reduce" | "all_gather" | "reduce_scatter",
                      "phase": "forward" | "backward", "layer": int | null,
                      "bytes": int, "bytes_expr": str, "time_us": float, "node": str,
                      "from": str, "to": str, "source": "file:line" | null,
                      "module": str | null}],
     "summary": {"forward_collectives": int, "backward_collectives": int,
                 "forward_bytes": int, "backward_bytes": int, "time_ms": float,
                 "groups": [{"layers": [int], "forward": int, "backward": int}],
                 "megatron_bound": {"forward": 2, "backward": 2}, "meets_bound": bool,
                 "bound": {"met": bool, "text": "Megatron bound (2, 2): met",
                           "reasons": [str], "notes": [str]},  # autotp.planner.bound's verdict
                 "param_bytes_per_rank": int, "param_bytes": int, "fallbacks": [str]}}

``bytes`` is ``bytes_expr`` (in the batch ``B`` and sequence ``T``) at the given B and T.
``source`` is the model's own line (the innermost frame outside torch and autotp) and
``module`` the path of the module it runs in (``model.layers.0.self_attn.o_proj``; null at
the top level and for the gradient sync of parameters).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

# the bound and its verdict are the planner's (autotp.planner.bound); named here too, as the
# benchmarks read them
from autotp.planner.bound import BOUND_BYTES as BOUND_BYTES
from autotp.planner.bound import MEGATRON_BOUND as MEGATRON_BOUND
from autotp.planner.bound import SEQUENCE_PARALLEL_BOUND as SEQUENCE_PARALLEL_BOUND
from autotp.planner.bound import layer_ranges as layer_ranges
from autotp.planner.bound import megatron_verdict
from autotp.planner.bound import within_bound as within_bound
from autotp.planner.cost import CostModel, parse_size_expr
from autotp.planner.plan import JOINED, CollectiveRecord, Plan
from autotp.planner.transitions import Collective

SCHEMA = "autotp.plan/1"
PHASE_SHORT = {"forward": "fwd", "backward": "bwd"}


@functools.lru_cache(maxsize=4096)
def evaluate_bytes(expr: str, batch: int, seq: int) -> int:
    """A byte expression ("32768*B*T") at ``batch`` and ``seq``; every layer repeats its
    layer's few expressions."""
    value = parse_size_expr(expr)
    subs = {s: (batch if str(s).startswith("B") else seq) for s in value.free_symbols}
    return int(value.subs(subs))


def relative_source(source: Optional[str]) -> Optional[str]:
    """A source location without machine-specific prefixes (site-packages, the cwd)."""
    if not source:
        return None
    path, _, line = source.rpartition(":")
    marker = "site-packages" + os.sep
    if marker in path:
        path = path.split(marker, 1)[1]
    else:
        try:
            rel = os.path.relpath(path)
            if not rel.startswith(".."):
                path = rel
        except ValueError:
            pass
    return f"{path}:{line}"


def relative_name(name: str, layer: Optional[int], paths: Sequence[str] = ()) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``mlp.up_proj.weight`` (display only):
    relative to the layer's module path (``paths``: ``plan.layer_paths``), else to the
    layer's index in the name."""
    if layer is None:
        return name
    if layer < len(paths):
        path = paths[layer].split("@")[0]
        if name.startswith(path + "."):
            return name[len(path) + 1:]
    parts = name.split(".")
    for k in range(len(parts) - 1, -1, -1):
        if parts[k] == str(layer):
            return ".".join(parts[k + 1:])
    return name


@dataclass
class Group:
    layers: list[int]
    params: list[tuple[str, str, tuple, tuple]]  # relative name, layout, global, local
    collectives: list[CollectiveRecord]


def fold_layers(plan: Plan) -> list[Group]:
    """Layers with the same parameters, layouts and collectives, grouped."""
    by_layer_params: dict[int, list] = {}
    for name, p in plan.params.items():
        if p.layer is not None:
            by_layer_params.setdefault(p.layer, []).append(
                (relative_name(name, p.layer, plan.layer_paths), p.layout, p.global_shape,
                 p.local_shape))
    by_layer_coll: dict[int, list[CollectiveRecord]] = {}
    for c in plan.collectives:
        if c.layer is not None:
            by_layer_coll.setdefault(c.layer, []).append(c)
    layers = sorted(set(by_layer_params) | set(by_layer_coll))
    groups: dict[Any, Group] = {}
    for layer in layers:
        params = sorted(by_layer_params.get(layer, []))
        colls = by_layer_coll.get(layer, [])
        key = (tuple(params), tuple(sorted((c.kind, c.phase, c.bytes_expr, c.src, c.dst)
                                           for c in colls)))
        if key in groups:
            groups[key].layers.append(layer)
        else:
            groups[key] = Group([layer], params, colls)
    return list(groups.values())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def origin_text(collective: dict[str, Any], layer: Optional[int],
                paths: Sequence[str] = ()) -> str:
    """A collective of ``to_dict`` in the user's terms: its module (relative to its layer, as
    parameter names are) and the file and line of the model's code; the graph value when
    neither is known (the gradient sync of parameters)."""
    module = collective["module"]
    source = collective["source"]
    parts = [relative_name(module, layer, paths) if module else "",
             os.path.basename(source) if source else ""]
    text = "  ".join(p for p in parts if p) or collective["node"]
    names = grad_sync_params(text)
    return f"{GRAD_SYNC} {group_names(names)}" if names else text


GRAD_SYNC = "grad sync:"  # how the plan names the after-backward sum of replicated gradients


def grad_sync_params(node: str) -> list[str]:
    """The parameters of a grad-sync collective's node text; [] for any other collective."""
    if not node.startswith(GRAD_SYNC):
        return []
    return [p.strip() for p in node[len(GRAD_SYNC):].split(",") if p.strip()]


def group_names(names: list[str]) -> str:
    """Parameter names folded by their layer index: ``model.layers.{0-31}.mlp.w`` for the
    same parameter of 32 layers; names without an index are listed as they are."""
    groups: dict[tuple[str, str], list[int]] = {}
    for name in names:
        match = re.match(r"^(.*?\.)(\d+)(\..*)$", name)
        if match:
            groups.setdefault((match.group(1), match.group(3)), []).append(int(match.group(2)))
        else:
            groups.setdefault((name, ""), [])
    parts = []
    for (head, tail), layers in groups.items():
        if not layers:
            parts.append(head)
        elif len(layers) == 1:
            parts.append(f"{head}{layers[0]}{tail}")
        else:
            parts.append(f"{head}{{{layer_ranges(layers)}}}{tail}")
    return ", ".join(parts)


def _shape(shape: tuple) -> str:
    return "x".join(str(s) for s in shape)


def to_dict(plan: Plan, cost_model: CostModel) -> dict[str, Any]:
    batch, seq = cost_model.batch, cost_model.seq
    collectives = []
    totals = {"forward": [0, 0], "backward": [0, 0]}
    time_s = 0.0
    for c in plan.collectives:
        nbytes = evaluate_bytes(c.bytes_expr, batch, seq)
        seconds = cost_model.collective_time(Collective(c.kind), nbytes, plan.degree)
        time_s += seconds
        totals[c.phase][0] += 1
        totals[c.phase][1] += nbytes
        collectives.append({
            "kind": c.kind, "phase": c.phase, "layer": c.layer, "bytes": nbytes,
            "bytes_expr": c.bytes_expr, "time_us": round(seconds * 1e6, 3), "node": c.node,
            "from": c.src, "to": c.dst, "source": relative_source(c.source),
            "module": c.module,
        })
    params = {}
    per_rank = total = 0
    for name, p in plan.params.items():
        itemsize = getattr(torch, p.dtype).itemsize
        numel = math.prod(p.global_shape)
        total += numel * itemsize
        per_rank += math.prod(p.local_shape) * itemsize
        params[name] = {"layout": p.layout, "global_shape": list(p.global_shape),
                        "local_shape": list(p.local_shape), "layer": p.layer,
                        "aliases": list(p.names), "grad_sync": p.grad_sync}
    groups = []
    verdict = megatron_verdict(plan)
    for group in fold_layers(plan):
        fwd = sum(1 for c in group.collectives if c.phase == "forward")
        bwd = sum(1 for c in group.collectives if c.phase == "backward")
        groups.append({"layers": group.layers, "forward": fwd, "backward": bwd})
    out = {
        "schema": SCHEMA, "model": plan.model, "tp": plan.degree, "layers": plan.layers,
        "batch": batch, "seq": seq, "bandwidth_GBps": cost_model.bandwidth / 1e9,
        "latency_us": round(cost_model.latency * 1e6, 6),
        "step_latency_us": round(cost_model.step_latency * 1e6, 6),
        "params": params, "collectives": collectives,
        "sequence_parallel": plan.sequence_parallel,
        "context_parallel": plan.lead.name == "cp",
        "outputs": list(plan.outputs),
        "summary": {
            "forward_collectives": totals["forward"][0],
            "backward_collectives": totals["backward"][0],
            "forward_bytes": totals["forward"][1], "backward_bytes": totals["backward"][1],
            "time_ms": round(time_s * 1e3, 3), "groups": groups,
            "megatron_bound": dict(verdict.bound), "meets_bound": verdict.met,
            "bound": verdict.as_dict(),
            "param_bytes_per_rank": per_rank, "param_bytes": total,
            "fallbacks": list(plan.fallbacks),
        },
    }
    if plan.blocked:  # matrix kept whole -> the ops that stop sharding it
        out["why_replicated"] = {
            name: [{**b, "source": relative_source(_source_line(b["source"])),
                    "module": _module(b["source"])} for b in blockers]
            for name, blockers in plan.blocked.items()}
    if plan.attention:  # context parallelism: attention node -> "ring: why" / "ulysses: why"
        out["attention"] = dict(plan.attention)
    for axis in plan.layout_axes()[1:]:  # the cp axis beside tp: its own plan
        out["context"] = to_dict(plan.on(axis.name), cost_model)
    if plan.experts:  # stacked weight -> [experts, how held]; ep: also split over ep ranks
        out["experts"] = {"ep": plan.ep, "stacks": {k: list(v) for k, v in plan.experts.items()},
                          "split": list(plan.expert_params)}
    return out


def to_json(plan: Plan, cost_model: CostModel) -> str:
    return json.dumps(to_dict(plan, cost_model), indent=1, sort_keys=True) + "\n"


def to_table(plan: Plan, cost_model: CostModel) -> str:
    data = to_dict(plan, cost_model)
    batch, seq = cost_model.batch, cost_model.seq
    ep = f", ep={plan.ep}" if plan.ep > 1 else ""
    lines = [f"autotp plan: {plan.model}, {plan.degrees_text()}{ep}, {plan.layers} layers; "
             f"bytes at "
             f"B={batch} T={seq}; link {cost_model.bandwidth / 1e9:g} GB/s, "
             f"{cost_model.latency * 1e6:g} us + {cost_model.step_latency * 1e6:g} us per ring "
             f"step"]
    context = plan.on("cp") if "cp" in plan.axes else None  # the sequence axis
    if context is not None:
        rings = sum(c.strategy.endswith("[ring]") for c in context.choices.values())
        ulysses = sum(c.strategy.endswith("[ulysses]") for c in context.choices.values())
        lines.append(f"attention: {rings} call(s) by ring attention (key/value blocks passed "
                     f"around the {context.degree} cp ranks inside the op, not listed below)"
                     if not ulysses else
                     f"attention: {rings} call(s) by ring attention, {ulysses} by Ulysses "
                     f"(all-to-alls between sequence and head shards inside the op, not "
                     f"listed below)")
        for why in dict.fromkeys(context.attention.values()):
            lines.append(f"  {why}")

    def collective_lines(colls: list[dict], indent: str, layer: Optional[int]) -> list[str]:
        out = []
        for c in sorted(colls, key=lambda c: (c["phase"] != "forward", c["kind"], c["node"])):
            joined = c["node"].count(", ") + 1 if c["node"].startswith(JOINED) else 1
            out.append(f"{indent}{PHASE_SHORT[c['phase']]} {c['kind']:<14} "
                       f"{c['from']:>3}->{c['to']:<3} {human_bytes(c['bytes']):>10} "
                       f"{c['time_us'] / 1e3:8.3f} ms  "
                       f"{origin_text(c, layer, plan.layer_paths)}" +
                       (f"  ({joined} values joined)" if joined > 1 else ""))
        return out

    for group in fold_layers(plan):
        count = len(group.layers)
        lines.append(f"layers {layer_ranges(group.layers)}" + (f"  (x{count}, identical)"
                                                               if count > 1 else ""))
        for name, layout, global_shape, local_shape in group.params:
            lines.append(f"  {name:<40} {_shape(global_shape):>14} {layout:<7} "
                         f"-> {_shape(local_shape)}")
        layer0 = group.layers[0]
        colls = [c for c in data["collectives"] if c["layer"] == layer0]
        lines += collective_lines(colls, "  ", layer0)
    outside = [(n, p) for n, p in plan.params.items() if p.layer is None]
    outside_colls = [c for c in data["collectives"] if c["layer"] is None]
    if outside or outside_colls:
        lines.append("outside the layers")
        for name, p in outside:
            lines.append(f"  {name:<40} {_shape(p.global_shape):>14} {p.layout:<7} "
                         f"-> {_shape(p.local_shape)}")
        lines += collective_lines(outside_colls, "  ", None)
    for axis in plan.layout_axes()[1:]:  # the cp axis beside tp
        over_cp = to_dict(plan.on(axis.name), cost_model)["collectives"]
        lines.append(f"over {axis.name}={axis.degree} (parameters as tp holds them, their "
                     "gradients also summed over cp; bytes of the whole tensors, 1/tp of them "
                     "where tp splits them):")
        lines += [line for layer in sorted({c["layer"] for c in over_cp}, key=str)
                  for line in collective_lines([c for c in over_cp if c["layer"] == layer],
                                               "  ", layer)]
    s = data["summary"]
    per_layer = sorted({(g["forward"], g["backward"]) for g in s["groups"]})
    lines.append(
        f"total: {s['forward_collectives']} forward collectives "
        f"({human_bytes(s['forward_bytes'])}), {s['backward_collectives']} backward "
        f"({human_bytes(s['backward_bytes'])}); estimated {s['time_ms']:.2f} ms per step")
    lines.append(f"per layer (forward, backward): {per_layer}; {s['bound']['text']}")
    lines += [f"  {line}" for line in s["bound"]["reasons"] + s["bound"]["notes"]]
    if plan.experts:
        lines.append(f"experts: {plan.experts_summary()}")
    if plan.ep > 1:
        lines.append(f"  split over tp x ep = {plan.degree * plan.ep} ranks; per MoE block, "
                     f"over the "
                     f"ep ranks: the row counts, the rows dispatched and combined by "
                     f"all-to-all (and back in backward)")
    lines += plan.output_lines()
    lines.append(f"parameters per rank: {human_bytes(s['param_bytes_per_rank'])} of "
                 f"{human_bytes(s['param_bytes'])} "
                 f"({', '.join(sorted({p.dtype for p in plan.params.values()}))})")
    lines += why_replicated_lines(data.get("why_replicated", {}))
    if s["fallbacks"]:
        lines.append(f"replicated fallbacks: {len(s['fallbacks'])}")
        lines += [f"  {f}" for f in s["fallbacks"]]
    return "\n".join(lines) + "\n"


def why_replicated_lines(why: dict[str, list[dict]]) -> list[str]:
    """The matrices kept whole that tp could shard, grouped by the op that stops sharding
    them: its module, its line of the model, the direction and the layout it cannot take
    (column: the product's output sharded) or give (row: the product's input sharded)."""
    if not why:
        return []
    by_op: dict[tuple, list[str]] = {}
    for name, blockers in why.items():
        if not blockers:
            by_op.setdefault(("kept whole for its cost (an exact sharding exists)",), []).append(
                name)
        for b in blockers:
            module = re.sub(r"\.\d+(?=\.|$)", ".N", b["module"] or "")
            where = "  ".join(p for p in (module, os.path.basename(b["source"] or "")) if p)
            op = b["op"].removeprefix("aten.")
            verb = "takes" if b["direction"] == "column" else "gives"
            by_op.setdefault((f"{op} ({where}): as {b['direction']}, no strategy {verb} "
                              f"{b['layout']}",), []).append(name)
    lines = [f"why replicated: {len(why)} matrices tp could shard are kept whole; what "
             "stops each:"]
    for (text,), names in by_op.items():
        lines.append(f"  {text}: {group_names(names)}")
    return lines


def _source_line(origin: str) -> Optional[str]:
    """The file:line of ``origin_of``'s ``module at file:line`` (None without one)."""
    tail = origin.rpartition(" at ")[2] if " at " in origin else origin
    return tail if re.search(r":\d+$", tail) else None


def _module(origin: str) -> Optional[str]:
    head = origin.partition(" at ")[0] if " at " in origin else origin
    return None if re.search(r":\d+$", head) or head == "unknown source" else head
