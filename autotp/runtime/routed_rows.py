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

Expert parallelism (``ep``) splits the experts further over ep data-parallel ranks, which
hold different tokens: tp rank r of ep rank e owns experts share e * tp + r. The rows a rank
sorted by expert are then dispatched by an all-to-all among the ranks of its tp rank (the
row counts per expert exchanged first), each destination receiving the rows of the experts
it owns, which it sorts by expert (each expert's rows from every source rank, in rank
order); they are combined back by the reverse all-to-all, into zeros for the rows the other
tp ranks' experts took (a partial sum over tp, as above), before they return to token
order. Backward runs the same moves reversed.

    dispatch  rows sorted by expert -> the owners' rows (all-to-all), sorted by expert
    combine   the owners' rows -> each source rank's rows, in its own order (all-to-all)

The bounds need the row counts on the host (one synchronization per block, as any expert
dispatch that sizes its buffers by the routing).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autotp.capture.trace import tensor_inputs
from autotp.errors import PlanError, where
from autotp.layout import P, R_STAR, ROUTED, Shard, parse_layout
from autotp.runtime.collectives import Redistribute

if TYPE_CHECKING:
    from autotp.planner.plan import Plan
    from autotp.runtime.comm import Communicator

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


@dataclass
class Exchange:
    """The all-to-all moves of one grouping's rows between the ep ranks (this rank's tp rank
    r in each): ``pick`` the rows of the rank's sorted rows it sends, in order (to ep rank d
    those of experts share d * tp + r), ``send[d]`` of them to rank d, ``recv[s]`` arriving
    from rank s; ``order`` sorts the arrived rows (by source rank, then expert) by expert,
    then source rank; ``total`` the rows the rank sorted."""

    comm: "Communicator"
    send: list[int]
    recv: list[int]
    pick: torch.Tensor
    order: torch.Tensor
    total: int
    layer: Optional[int] = None

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        sent = rows.index_select(0, self.pick)
        return _AllToAllFn.apply(sent, self, True).index_select(0, self.order)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows back at their source rank, in its order, zeros for the rows it sent the
        other tp ranks' experts (a partial sum over tp)."""
        unsorted = rows.new_empty(rows.shape).index_copy(0, self.order, rows)
        back = _AllToAllFn.apply(unsorted, self, False)
        return back.new_zeros((self.total, *back.shape[1:])).index_copy(0, self.pick, back)

    def move(self, rows: torch.Tensor, to_owners: bool, phase: str) -> torch.Tensor:
        send, recv = (self.send, self.recv) if to_owners else (self.recv, self.send)
        out = self.comm.all_to_all(rows.contiguous(), send, recv)
        self.comm.log.record("all_to_all", phase, self.layer, out.numel() * out.element_size(),
                             "experts' rows " + ("dispatched" if to_owners else "combined"))
        return out


class _AllToAllFn(torch.autograd.Function):
    """An all-to-all of rows; its gradient moves back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, exchange: Exchange, to_owners: bool
                ) -> torch.Tensor:
        ctx.exchange, ctx.to_owners = exchange, to_owners
        return exchange.move(rows, to_owners, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.exchange.move(grad, not ctx.to_owners, "backward"), None, None


@dataclass
class Route:
    """One grouping's routed rows on this rank: ``bounds`` (start, end, total) of its own
    among the ``total`` rows it sorted by expert (with expert parallelism: None, its rows
    are those dispatched to it), ``offsets`` the cumulative row counts of its experts from
    its first row, ``shard`` the index of its experts among the tp * ep equal shares of a
    per-expert table."""

    total: int
    bounds: Optional[Bounds]
    offsets: torch.Tensor
    shard: int
    exchange: Optional[Exchange] = None


def route(offs: torch.Tensor, rank: int, tp: int) -> Route:
    """The tp group's split of a grouping whose cumulative row counts per expert are
    ``offs`` (every rank holds the same rows)."""
    bounds = routed_bounds(offs, rank, tp)
    e0, e1 = expert_range(offs.shape[0], rank, tp)
    return Route(bounds[2], bounds, offs[e0:e1] - bounds[0], rank)


class ExpertDispatch(nn.Module):
    """The rows of one grouping, moved to the ranks that own their experts. Every tp rank
    holds the same sorted rows; tp rank r of each ep rank sends the rows of experts share
    d * tp + r to ep rank d (whose tp rank r owns them), after the row counts per expert
    (an all-to-all of e / tp integers)."""

    def __init__(self, comm: "Communicator", rank: int, tp: int, layer: Optional[int]):
        super().__init__()
        self.comm, self.rank, self.tp, self.layer = comm, rank, tp, layer

    @torch.compiler.disable
    def forward(self, offs: torch.Tensor) -> Route:
        ep, tp = self.comm.world_size, self.tp
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        if counts.numel() % (ep * tp):
            raise RuntimeError(f"autotp: {counts.numel()} experts cannot be split among "
                               f"ep={ep} x tp={tp} ranks")
        per = counts.numel() // (ep * tp)
        # share d * tp + r of every destination d: [ep, tp, per] -> [ep, per] at r
        sent = counts.view(ep, tp, per)[:, self.rank].contiguous()
        got = self.comm.all_to_all(sent.flatten(), [per] * ep, [per] * ep).view(ep, per)
        self.comm.log.record("all_to_all", "forward", self.layer,
                             got.numel() * got.element_size(), "experts' row counts")
        starts = (offs - counts).view(ep, tp, per)[:, self.rank, 0]
        # what the host needs, in one synchronization: the splits, where each sent run
        # starts, and the rows sorted
        host = torch.cat([sent.sum(1), got.sum(1), starts, offs[-1:]]).tolist()
        send, recv, begin, total = host[:ep], host[ep:2 * ep], host[2 * ep:3 * ep], host[-1]
        pick = torch.cat([torch.arange(b, b + n, device=offs.device)
                          for b, n in zip(begin, send)])
        # arrived rows are grouped by (source rank, expert): sort them by (expert, source)
        keys = torch.arange(ep * per, device=got.device).view(ep, per)
        keys = (keys % per) * ep + keys // per
        order = torch.argsort(torch.repeat_interleave(keys.flatten(), got.flatten(),
                                                      output_size=sum(recv)), stable=True)
        exchange = Exchange(self.comm, send, recv, pick, order, total, self.layer)
        return Route(exchange.total, None, torch.cumsum(got.sum(0), 0).to(offs.dtype),
                     self.comm.rank * tp + self.rank, exchange)


def take_rows(x: torch.Tensor, route: Route) -> torch.Tensor:
    """This rank's routed rows of ``x`` (rows sorted by expert, replicated over tp)."""
    if x.shape[0] != route.total:
        raise RuntimeError(f"autotp: {x.shape[0]} rows sorted by expert, but the experts' row "
                           f"counts add up to {route.total}: rows outside every expert cannot "
                           "be split among the ranks that own the experts")
    if route.exchange is not None:
        return route.exchange.dispatch(x)
    assert route.bounds is not None
    start, end, _ = route.bounds
    return x.narrow(0, start, end - start)


def put_rows(x: torch.Tensor, route: Route) -> torch.Tensor:
    """Every row sorted by expert, this rank's from ``x`` and zeros for the others' (a
    partial sum over tp); with expert parallelism, combined back from the experts' owners."""
    if route.exchange is not None:
        return route.exchange.combine(x)
    assert route.bounds is not None
    start, end, total = route.bounds
    return F.pad(x, (0, 0) * (x.dim() - 1) + (start, total - end))


def local_offsets(route: Route) -> torch.Tensor:
    """The cumulative row counts of this rank's experts, counted from its first row."""
    return route.offsets


def routed_lookup(x: torch.Tensor, index: torch.Tensor, route: Route) -> torch.Tensor:
    """``full[index]`` where ``full`` holds ``x`` at this rank's rows and zeros elsewhere,
    without building ``full`` where the rows never left: an index outside the rank's rows
    reads an appended zero row."""
    if route.exchange is not None:
        return put_rows(x, route)[index]
    assert route.bounds is not None
    start, end, _ = route.bounds
    outside = (index < start) | (index >= end)
    local = torch.where(outside, end - start, index - start)
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
    return padded[local]


def expert_rows(table: torch.Tensor, ids: torch.Tensor, route: Route) -> torch.Tensor:
    """``full_table[ids]`` from this rank's rows of a per-expert table, where ``ids`` are the
    expert ids of the rank's routed rows (its own experts only)."""
    local = ids - route.shard * table.shape[0]
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


def route_rows(graph: fx.Graph, plan: "Plan", comm: Any, root: nn.Module,
               ep_comm: Optional["Communicator"] = None) -> dict[str, fx.Node]:
    """Insert each grouping's route (with ``ep_comm``, the expert-parallel group: its
    dispatch), the moves to and from routed rows, and return node name -> route node for
    the lowerings of the ops on routed rows."""
    if (plan.degree == 1 and ep_comm is None) or \
            not any(routed_text(v) for v in plan.values.values()):
        return {}
    regions = _regions(graph, plan)
    _count_rows_first(graph, regions, {name: routed_text(plan.values.get(name, "")) or
                                       name in plan.choices and
                                       any(routed_text(x) for x in plan.choices[name].inputs)
                                       for name in regions})
    order = {node: i for i, node in enumerate(graph.nodes)}
    bounds: dict[fx.Node, fx.Node] = {}
    for source in sorted(set(regions.values()), key=order.__getitem__):
        with graph.inserting_after(source):
            if ep_comm is None:
                bounds[source] = graph.call_function(route, (source, comm.rank, plan.degree))
            else:
                label = f"autotp_{source.name}_dispatch"
                root.add_module(label, ExpertDispatch(ep_comm, comm.rank, plan.degree,
                                                      plan.node_layers.get(source.name)))
                bounds[source] = graph.call_module(label, (source,))
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
                new = padded = graph.call_function(put_rows, (value, bounds[source]))
                _copy_place(padded, first)
                layer = layers[(name, dst_text)]
                if plan.degree > 1:
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
