"""Joined collectives: several values made whole by one collective.

``join_siblings``: all-reduces of one layer that neither waits for (``autotp.planner.coalesce``)
run as one, of a flat buffer of their values (forward) or gradients (backward), at the first
op that reads any of them; the ops computing a later value move ahead of that op.

``join_ahead``: layer-invariant values made whole ahead of the layers, one collective for
every layer's.

A value a layer computes from the model's inputs and its own parameters alone (adaLN's
modulation vectors, a timestep MLP each block recomputes; ``autotp.planner.invariant``) may be
computed sharded or as a partial sum and made whole where it is read. The plan marks those
redistributions ``batched``; here they become one collective per kind:

    before:  layer k: ... mod_k(c) [S] -> all-gather -> (1 + scale_k) * norm(x) ...   (x L)
    after:   mod_0(c) ... mod_L-1(c) [S], one all-gather of all of them;
             layer k: (1 + scale_k) * norm(x) ...

The values and everything they read move ahead of the first layer (they read no layer's
output, so the program means the same); they belong to no layer afterwards
(``autotp.runtime.layers`` leaves them in the root). A chain that reads a joined value and
makes another (DiT's per-block timestep MLP: its row-parallel output summed, then the
column-parallel modulation gathered) runs in stages, one joined collective per stage
(``autotp.planner.invariant.stages``).

Forward: the shards all-gathered together, the partial sums all-reduced together.
Backward: each rank keeps its slice of a gathered value's gradient, or, where the plan keeps
the gradient partial (``S -> R*``), one reduce-scatter of all of those; a summed value's
gradient passes as it is, or, partial (``P -> R*``), is all-reduced with the others.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, TypeVar, cast

import torch
import torch.fx as fx
from torch import nn

from autotp.layout import Layout, Partial, Replicate, Shard, parse_layout
from autotp.planner.coalesce import place
from autotp.planner.invariant import closure, stages
from autotp.planner.plan import Plan
from autotp.runtime.collectives import (Redistribute, _rank_major, _segment_major, local_slice,
                                        sequence_order)
from autotp.runtime.comm import Communicator, compiled_where_traceable
from autotp.runtime.ring import SequenceLayout

HOISTED = "autotp_hoisted"  # node meta: moved ahead of the layers, owned by none
_Source = TypeVar("_Source", Shard, Partial)


def flat_all_reduce(comm: Communicator, xs: list[torch.Tensor],
                    log: Callable[[torch.Tensor], None]) -> list[torch.Tensor]:
    """Sums every rank's ``xs`` in one all-reduce of a flat buffer of all of them (``log``
    records it); each back in its shape and dtype."""
    flat = torch.cat([x.contiguous().reshape(-1) for x in xs])
    log(flat)
    total = comm.all_reduce(flat, in_place=True)  # cat's own buffer
    out, start = [], 0
    for x in xs:
        out.append(total[start:start + x.numel()].reshape(x.shape).to(x.dtype))
        start += x.numel()
    return out


class JoinedRedistribute(nn.Module):
    """Makes several sharded or partial values whole: one all-gather of the shards and one
    all-reduce of the partial sums."""

    def __init__(self, comm: Communicator, layouts: list[tuple[Layout, Replicate]],
                 labels: list[str], sequence: Optional[SequenceLayout] = None):
        super().__init__()
        for src, _ in layouts:
            assert isinstance(src, Shard) or (isinstance(src, Partial) and src.reduce == "sum"), \
                src
        self.comm = comm
        self.sequence = sequence  # context parallelism: how the group holds the sequence
        self.layouts = layouts
        self.labels = labels

    def extra_repr(self) -> str:
        return f"{len(self.layouts)} values: " + ", ".join(self.labels)

    @compiled_where_traceable
    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _JoinedFn.apply(self, *xs)

    def _where(self, kind: type[_Source]) -> dict[int, _Source]:
        """The values whose source layout is a ``kind``: index -> that layout."""
        return {i: src for i, (src, _) in enumerate(self.layouts) if isinstance(src, kind)}

    def whole(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        out: list[Any] = [None] * len(xs)
        gathered, summed = self._where(Shard), self._where(Partial)
        if gathered:
            tp = self.comm.world_size
            flat = torch.cat([xs[i].contiguous().reshape(-1) for i in gathered])
            full = self.comm.all_gather(flat, 0).view(tp, -1)
            self._log("all_gather", "forward", full)
            start = 0
            for i, src in gathered.items():
                x = xs[i]
                pieces = full[:, start:start + x.numel()].reshape(tp, *x.shape)
                start += x.numel()
                whole = torch.cat(pieces.unbind(0), dim=src.dim).to(x.dtype)
                out[i] = _segment_major(whole, src.dim, src.blocks, tp,
                                        sequence_order(self.sequence, src))
        if summed:
            out_summed = self._all_reduce([xs[i] for i in summed], "forward")
            for i, x in zip(summed, out_summed):
                out[i] = x
        return out

    def _all_reduce(self, xs: list[torch.Tensor], phase: str) -> list[torch.Tensor]:
        return flat_all_reduce(self.comm, xs, lambda flat: self._log("all_reduce", phase, flat))

    def scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each value's gradient in its own layout (see the module docstring)."""
        tp, rank = self.comm.world_size, self.comm.rank
        out: list[Any] = [None] * len(grads)
        scattered = {i: src for i, src in self._where(Shard).items()
                     if self.layouts[i][1].grad_partial}
        reduced = [i for i in self._where(Partial) if self.layouts[i][1].grad_partial]
        for i, (src, dst) in enumerate(self.layouts):
            if not dst.grad_partial:
                out[i] = local_slice(grads[i], src, rank, tp,
                                     sequence_order(self.sequence, src)).contiguous() \
                    if isinstance(src, Shard) else grads[i]
        if scattered:
            rows = []
            for i, src in scattered.items():
                ordered = _rank_major(grads[i], src.dim, src.blocks, tp,
                                      sequence_order(self.sequence, src))
                rows.append(torch.stack([p.reshape(-1) for p in ordered.chunk(tp, src.dim)]))
            buffer = torch.cat(rows, dim=1)  # [tp, all values' pieces]
            self._log("reduce_scatter", "backward", buffer)
            mine = self.comm.reduce_scatter(buffer.reshape(-1).contiguous(), 0)
            start = 0
            for i, src in scattered.items():
                shape = list(grads[i].shape)
                shape[src.dim] //= tp
                n = int(torch.Size(shape).numel())
                out[i] = mine[start:start + n].reshape(shape).to(grads[i].dtype)
                start += n
        if reduced:
            for i, g in zip(reduced, self._all_reduce([grads[i] for i in reduced], "backward")):
                out[i] = g
        return out

    def _log(self, kind: str, phase: str, sized: torch.Tensor) -> None:
        self.comm.log.record(kind, phase, None, sized.numel() * sized.element_size(),
                             "batched: " + ", ".join(self.labels))


class _JoinedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, module: JoinedRedistribute, *xs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.module = module
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(module.whole(xs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        module = ctx.module
        full = []
        for g, (shape, dtype, device), (src, _) in zip(grads, ctx.shapes, module.layouts):
            if g is None:  # an output no gradient reached: zeros of the whole value
                whole = list(shape)
                if isinstance(src, Shard):
                    whole[src.dim] *= module.comm.world_size
                g = torch.zeros(whole, dtype=dtype, device=device)
            full.append(g)
        return (None, *module.scatter(full))


def join_ahead(graph: fx.Graph, plan: Plan, comm: Communicator, root: nn.Module,
               sequence: Optional[SequenceLayout] = None) -> int:
    """The plan's batched redistributions as ``JoinedRedistribute`` calls ahead of the first
    layer, one per stage; returns how many values they make whole. ``sequence``: how the
    group holds the sequence (context parallelism)."""
    edges = [e for e in plan.edges if e.batched]
    if not edges or plan.degree == 1:
        return 0
    nodes = {n.name: n for n in graph.nodes}
    keys = list(dict.fromkeys((e.value, e.dst) for e in edges))
    have = {e.value: e.src for e in edges}
    level = stages(graph, {(e.value, e.consumer) for e in edges})
    moved = closure([nodes[value] for value, _ in keys])
    hoisted = set(moved)
    order = list(graph.nodes)
    last_input = max(i for i, n in enumerate(order) if n.op == "placeholder")
    anchor = next(n for n in order[last_input + 1:] if n not in hoisted and
                  not (n.op == "call_module" and n.target == "_guards_fn"))
    # graph order within a stage; every read goes to the same or a later stage
    index = {n: i for i, n in enumerate(order)}
    moved.sort(key=lambda n: (level[n.name], index[n]))
    for node in moved:
        anchor.prepend(node)
        node.meta[HOISTED] = True
    outs: dict[tuple[str, str], fx.Node] = {}
    levels = sorted({level[value] for value, _ in keys})
    for stage in levels:
        staged = [k for k in keys if level[k[0]] == stage]
        # the call goes before the next stage's first node (after this stage's last)
        where = next((n for n in moved if level[n.name] > stage), anchor)
        name = "autotp_joined" if len(levels) == 1 else f"autotp_joined_{stage}"
        root.add_module(name, JoinedRedistribute(
            comm, [(parse_layout(have[v]), cast(Replicate, parse_layout(d))) for v, d in staged],
            [f"{v} {have[v]}->{d}" for v, d in staged], sequence))
        with graph.inserting_before(where):
            call = graph.call_module(name, tuple(nodes[v] for v, _ in staged))
            call.meta[HOISTED] = True
            for i, key in enumerate(staged):
                out = graph.call_function(operator.getitem, (call, i))
                out.meta["val"] = nodes[key[0]].meta.get("val")
                out.meta[HOISTED] = True
                outs[key] = out
    for e in edges:
        nodes[e.consumer].replace_input_with(nodes[e.value], outs[(e.value, e.dst)])
    return len(keys)


# ---- sibling all-reduces -------------------------------------------------------------------


class JoinedAllReduce(nn.Module):
    """Runs several redistributions whose one collective is an all-reduce of the same
    direction as one all-reduce: forward, of the partial sums (``P -> R``); backward, of the
    gradients that Megatron's ``f`` sums (``R -> R*``)."""

    def __init__(self, comm: Communicator, members: list[Redistribute], phase: str,
                 layer: Optional[int]):
        super().__init__()
        self.comm = comm
        self.members = members  # plain list: the members hold no state of their own
        self.phase = phase
        self.layer = layer
        self.label = "joined: " + ", ".join(m.label for m in members)

    def extra_repr(self) -> str:
        return f"{self.phase} all-reduce of {len(self.members)} values: {self.label}"

    @compiled_where_traceable
    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _JoinedAllReduceFn.apply(self, *xs)

    def all_reduce(self, xs: list[torch.Tensor], phase: str) -> list[torch.Tensor]:
        return flat_all_reduce(self.comm, xs, lambda flat: self.comm.log.record(
            "all_reduce", phase, self.layer, flat.numel() * flat.element_size(), self.label))


class _JoinedAllReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, module: JoinedAllReduce, *xs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.module = module
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        if module.phase == "forward":
            return tuple(module.all_reduce(list(xs), "forward"))
        return tuple(m.run_forward(x) for m, x in zip(module.members, xs))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Any, ...]:
        module = ctx.module
        if module.phase == "forward":
            return (None, *(None if g is None else m.run_backward(g)
                            for m, g in zip(module.members, grads)))
        full = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        return (None, *module.all_reduce(full, "backward"))


def join_siblings(graph: fx.Graph, plan: Plan, comm: Communicator, root: nn.Module) -> int:
    """The plan's joined all-reduces (``Edge.joined``) as ``JoinedAllReduce`` calls before the
    first op that reads any of their values, in the plan's order
    (``autotp.planner.coalesce.place``); returns how many joins."""
    groups: dict[int, list[Any]] = {}
    for edge in plan.edges:
        if edge.joined is not None:
            groups.setdefault(edge.joined, []).append(edge)
    if not groups or plan.degree == 1:
        return 0
    for index, edges in sorted(groups.items()):
        keys = list(dict.fromkeys((e.value, e.dst) for e in edges))
        members, phase = [], "forward" if edges[0].forward else "backward"
        for value, dst in keys:
            src = next(e.src for e in edges if (e.value, e.dst) == (value, dst))
            members.append(Redistribute(comm, parse_layout(src), parse_layout(dst),
                                        layer=edges[0].layer, bwd_layer=edges[0].layer,
                                        label=f"{value} {src}->{dst}"))
        name = f"autotp_joined_siblings_{index}"
        root.add_module(name, JoinedAllReduce(comm, members, phase, edges[0].layer))
        place(graph, keys, [((e.value, e.dst), e.consumer) for e in edges],
              lambda values, name=name: graph.call_module(name, values))
    return len(groups)
