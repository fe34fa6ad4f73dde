"""Rows routed to experts (``S(0)@experts``): the run-time bounds of each rank's rows, and the
moves between replicated, routed and partial rows.

A mixture-of-experts block sorts its (token, choice) rows by expert and multiplies each
expert's contiguous group by that expert's weights (``offs``: the cumulative row count per
expert). With the stacked expert weights sharded along the experts, rank r owns experts
[r * e/tp, (r + 1) * e/tp) and so the rows [offs[e0 - 1], offs[e1 - 1]): contiguous, as many
as the routing sends them. Every row-wise op between the grouped products runs on those rows
alone; the rows go back to token order through a lookup that reads the rank's own rows and
writes zeros elsewhere, a partial sum the layer's all-reduce completes (Megatron's count).

    replicated -> routed   take_rows      backward: the gradient zero-padded (a partial sum)
    routed -> partial      put_rows       zeros outside the rank's rows
    routed -> token order  routed_lookup  a partial sum (zeros for other ranks' rows)

The bounds need the row counts on the host (one synchronization per block, as any expert
dispatch that sizes its buffers by the routing).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autotp.errors import PlanError, where
from autotp.layout import P, R_STAR, ROUTED, Shard, parse_layout

if TYPE_CHECKING:
    from autotp.planner.plan import Plan

Bounds = tuple[int, int, int]  # (start, end, total) of this rank's routed rows


def expert_range(experts: int, rank: int, tp: int) -> tuple[int, int]:
    """The experts [e0, e1) rank ``rank`` owns (their count divides by tp)."""
    per_rank = experts // tp
    return rank * per_rank, (rank + 1) * per_rank


def routed_bounds(offs: torch.Tensor, rank: int, tp: int) -> Bounds:
    """This rank's rows of a grouping whose cumulative row counts per expert are ``offs``."""
    counts = offs.tolist()
    e0, e1 = expert_range(len(counts), rank, tp)
    return (counts[e0 - 1] if e0 else 0), counts[e1 - 1], counts[-1]


def take_rows(x: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    start, end, total = bounds
    if x.shape[0] != total:
        raise RuntimeError(f"autotp: {x.shape[0]} rows sorted by expert, but the experts' row "
                           f"counts add up to {total}: rows outside every expert cannot be "
                           "split among the ranks that own the experts")
    return x.narrow(0, start, end - start)


def put_rows(x: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    start, end, total = bounds
    return F.pad(x, (0, 0) * (x.dim() - 1) + (start, total - end))


def local_offsets(offs: torch.Tensor, bounds: Bounds, rank: int, tp: int) -> torch.Tensor:
    """The cumulative row counts of this rank's experts, counted from its first row."""
    e0, e1 = expert_range(offs.shape[0], rank, tp)
    return offs[e0:e1] - bounds[0]


def routed_lookup(x: torch.Tensor, index: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """``full[index]`` where ``full`` holds ``x`` at this rank's rows and zeros elsewhere,
    without building ``full``: an index outside the rank's rows reads an appended zero row."""
    start, end, _ = bounds
    outside = (index < start) | (index >= end)
    local = torch.where(outside, end - start, index - start)
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
    return padded[local]


def expert_rows(table: torch.Tensor, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """``full_table[ids]`` from this rank's rows of a per-expert table, where ``ids`` are the
    expert ids of the rank's routed rows (its own experts only)."""
    local = ids - rank * table.shape[0]
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= table.shape[0]):
        raise RuntimeError("autotp: a per-expert table is read at rows routed to another "
                           "rank's experts: the ids are not those the rows are sorted by")
    return table[local]


# ---- the rank program ------------------------------------------------------------------------


def routed(layout: Any) -> bool:
    return isinstance(layout, Shard) and layout.blocks == ROUTED


def _regions(graph: fx.Graph, plan: "Plan") -> dict[str, fx.Node]:
    """Node name -> the offsets node whose experts split its routed rows.

    The values computed on routed rows and the ops that read them form connected regions
    (networkx components); each holds the grouped products whose experts own the rows, and
    all of them must read the same offsets (one sorting of rows)."""
    from autotp.capture.trace import tensor_inputs

    links = nx.Graph()
    offsets: dict[str, fx.Node] = {}
    for node in graph.nodes:
        choice = plan.choices.get(node.name)
        if choice is not None:
            for arg, layout in zip(tensor_inputs(node), choice.inputs):
                if routed(parse_layout(layout)):
                    links.add_edge(node.name, arg.name)
            if choice.strategy.endswith("[experts]"):  # a grouped product on routed rows
                offsets[node.name] = node.args[2]
        elif node.target is operator.getitem and node.name in plan.values and \
                routed_text(plan.values[node.name]):
            links.add_edge(node.name, node.args[0].name)
    out: dict[str, fx.Node] = {}
    for region in nx.connected_components(links):
        sources = {offsets[name] for name in region if name in offsets}
        if len(sources) != 1:
            names = ", ".join(sorted(region)[:6])
            raise PlanError(f"the routed rows of {names} ... are split by "
                            f"{len(sources)} expert groupings, not one: autotp splits routed "
                            "rows only by the experts of the grouped products that read them")
        (source,) = sources
        out.update(dict.fromkeys(region, source))
    return out


def routed_text(text: str) -> bool:
    return f"@{ROUTED}" in text


def route_rows(graph: fx.Graph, plan: "Plan", comm: Any, root: nn.Module
               ) -> dict[str, fx.Node]:
    """Insert each grouping's bounds, the moves to and from routed rows, and return node
    name -> bounds node for the lowerings of the ops on routed rows."""
    from autotp.runtime.collectives import Redistribute

    if plan.tp == 1 or not any(routed_text(v) for v in plan.values.values()):
        return {}
    regions = _regions(graph, plan)
    _count_rows_first(graph, regions, {name: routed_text(plan.values.get(name, "")) or
                                       name in plan.choices and
                                       any(routed_text(x) for x in plan.choices[name].inputs)
                                       for name in regions})
    order = {node: i for i, node in enumerate(graph.nodes)}
    bounds: dict[fx.Node, fx.Node] = {}
    for source in set(regions.values()):
        with graph.inserting_after(source):
            bounds[source] = graph.call_function(routed_bounds, (source, comm.rank, plan.tp))
        _copy_place(bounds[source], source)
    nodes = {node.name: node for node in graph.nodes}
    readers: dict[tuple[str, str], list[fx.Node]] = {}
    for edge in plan.edges:
        if edge.src != edge.dst and (routed_text(edge.src) or routed_text(edge.dst)):
            readers.setdefault((edge.value, edge.dst), []).append(nodes[edge.consumer])
    layers = {(edge.value, edge.dst): edge.layer for edge in plan.edges}
    for (name, dst_text), consumers in readers.items():
        value, first = nodes[name], min(consumers, key=order.__getitem__)
        dst = parse_layout(dst_text)
        source = regions[first.name] if routed(dst) else regions[name]
        if order[source] >= order[first]:
            raise PlanError(f"{first.name} reads routed rows before the experts' row counts "
                            f"({source.name}) are known{where(first)}")
        with graph.inserting_before(first):
            if routed(dst):
                new = graph.call_function(take_rows, (value, bounds[source]))
            else:
                padded = graph.call_function(put_rows, (value, bounds[source]))
                _copy_place(padded, first)
                layer = layers[(name, dst_text)]
                module = Redistribute(comm, P, dst, layer=layer, bwd_layer=layer,
                                      label=f"{name} {ROUTED} rows->{dst}")
                label = f"autotp_{name}_rows_to_{'R_star' if dst == R_STAR else 'R'}"
                root.add_module(label, module)
                new = graph.call_module(label, (padded,))
        _copy_place(new, first)
        new.meta["val"] = value.meta.get("val")
        for consumer in consumers:
            consumer.replace_input_with(value, new)
    return {name: bounds[source] for name, source in regions.items()}


def _count_rows_first(graph: fx.Graph, regions: dict[str, fx.Node],
                      routed_ops: dict[str, bool]) -> None:
    """Move each grouping's row counts (and what they are computed from) ahead of the first
    op on its routed rows: a model may sort its rows and compute on them (``perm // k``)
    before it counts them per expert."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    nodes = {node.name: node for node in graph.nodes}
    dag = nx.DiGraph((a, node) for node in graph.nodes for a in node.all_input_nodes)
    for source in set(regions.values()):
        # the ops on routed rows (a value sliced into them is read by one: it is not one)
        members = [nodes[name] for name, s in regions.items() if s is source and
                   name in nodes and routed_ops.get(name)]
        early = min(members, key=order.__getitem__)
        if order[source] < order[early]:
            continue
        needed = nx.ancestors(dag, source) | {source}
        late = sorted((n for n in needed if order[n] > order[early]), key=order.__getitem__)
        if needed & (nx.descendants(dag, early) | {early}):
            raise PlanError(f"the experts' row counts ({source.name}) depend on routed rows "
                            f"they split{where(early)}")
        for node in late:
            early.prepend(node)


def _copy_place(new: fx.Node, like: fx.Node) -> None:
    """``new`` belongs where ``like`` is: the same module (and so the same layer)."""
    if "nn_module_stack" in like.meta:
        new.meta["nn_module_stack"] = like.meta["nn_module_stack"]
