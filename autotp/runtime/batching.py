"""Layer-invariant gathers joined: one all-gather for every layer's, before the first layer.

A value a layer computes from the model's inputs and its own parameters alone (adaLN's
modulation vectors, ``planner/invariant.py``) may be computed sharded and gathered where it
meets the replicated stream. The plan marks those gathers ``batched``; here they become one:

    before:  layer k: ... mod_k(c) [S] -> all-gather -> (1 + scale_k) * norm(x) ...   (x L)
    after:   mod_0(c) ... mod_L-1(c) [S], one all-gather of all of them;
             layer k: (1 + scale_k) * norm(x) ...

The values and everything they read move ahead of the first layer (they read no layer's
output, so the program means the same); they belong to no layer afterwards
(``autotp.runtime.layers`` leaves them in the root). Backward: each rank keeps its slice of
the gathered gradient, or, where the plan keeps the gradient partial (``S -> R*``), one
reduce-scatter of all of them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autotp.layout import Replicate, Shard, parse_layout
from autotp.planner.invariant import closure
from autotp.planner.plan import Plan
from autotp.runtime.collectives import _rank_major, _segment_major, local_slice
from autotp.runtime.comm import Communicator

HOISTED = "autotp_hoisted"  # node meta: moved ahead of the layers, owned by none


class BatchedGather(nn.Module):
    """All-gathers several sharded values in one collective; returns them whole."""

    def __init__(self, comm: Communicator, layouts: list[tuple[Shard, Replicate]],
                 labels: list[str]):
        super().__init__()
        self.comm = comm
        self.layouts = layouts
        self.labels = labels

    def extra_repr(self) -> str:
        return f"{len(self.layouts)} values: " + ", ".join(self.labels)

    @torch.compiler.disable  # collectives run eagerly
    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _BatchedGatherFn.apply(self, *xs)

    def gather(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        tp = self.comm.world_size
        flat = torch.cat([x.contiguous().reshape(-1) for x in xs])
        full = self.comm.all_gather(flat, 0).view(tp, -1)
        self._log("all_gather", "forward", full)
        out, start = [], 0
        for x, (src, _) in zip(xs, self.layouts):
            pieces = full[:, start:start + x.numel()].reshape(tp, *x.shape)
            start += x.numel()
            whole = torch.cat(pieces.unbind(0), dim=src.dim)
            out.append(_segment_major(whole, src.dim, src.blocks, tp))
        return out

    def scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each value's gradient of its slice: kept locally, or summed over the ranks where
        the plan keeps it partial (one reduce-scatter for all of those)."""
        tp, rank = self.comm.world_size, self.comm.rank
        out: list[Any] = [None] * len(grads)
        summed = [i for i, (_, dst) in enumerate(self.layouts) if dst.grad_partial]
        for i, (src, dst) in enumerate(self.layouts):
            if not dst.grad_partial:
                out[i] = local_slice(grads[i], src, rank, tp).contiguous()
        if summed:
            rows = []
            for i in summed:
                src = self.layouts[i][0]
                ordered = _rank_major(grads[i], src.dim, src.blocks, tp)
                rows.append(torch.stack([p.reshape(-1) for p in ordered.chunk(tp, src.dim)]))
            buffer = torch.cat(rows, dim=1)  # [tp, all values' pieces]
            self._log("reduce_scatter", "backward", buffer)
            mine = self.comm.reduce_scatter(buffer.reshape(-1).contiguous(), 0)
            start = 0
            for i in summed:
                src = self.layouts[i][0]
                shape = list(grads[i].shape)
                shape[src.dim] //= tp
                n = int(torch.Size(shape).numel())
                out[i] = mine[start:start + n].reshape(shape)
                start += n
        return out

    def _log(self, kind: str, phase: str, sized: torch.Tensor) -> None:
        self.comm.log.record(kind, phase, None, sized.numel() * sized.element_size(),
                             "batched: " + ", ".join(self.labels))


class _BatchedGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, module: BatchedGather, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.module = module
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(module.gather(xs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        module = ctx.module
        full = []
        for g, (shape, dtype, device), (src, _) in zip(grads, ctx.shapes, module.layouts):
            if g is None:  # an output no gradient reached: zeros of the whole value
                whole = list(shape)
                whole[src.dim] *= module.comm.world_size
                g = torch.zeros(whole, dtype=dtype, device=device)
            full.append(g)
        return (None, *module.scatter(full))


def join_gathers(graph: fx.Graph, plan: Plan, comm: Communicator, root: nn.Module) -> int:
    """The plan's batched gathers as one ``BatchedGather`` ahead of the first layer; returns
    how many values it gathers."""
    edges = [e for e in plan.edges if e.batched]
    if not edges or plan.tp == 1:
        return 0
    nodes = {n.name: n for n in graph.nodes}
    keys = list(dict.fromkeys((e.value, e.dst) for e in edges))
    have = {e.value: e.src for e in edges}
    values = [nodes[value] for value, _ in keys]
    moved = closure(values)
    hoisted = set(moved)
    order = list(graph.nodes)
    last_input = max(i for i, n in enumerate(order) if n.op == "placeholder")
    anchor = next(n for n in order[last_input + 1:] if n not in hoisted and
                  not (n.op == "call_module" and n.target == "_guards_fn"))
    for node in moved:
        anchor.prepend(node)
        node.meta[HOISTED] = True
    layouts = []
    for value, dst in keys:
        src = parse_layout(have[value])
        assert isinstance(src, Shard), (value, src)
        layouts.append((src, parse_layout(dst)))
    name = "autotp_batched_gather"
    root.add_module(name, BatchedGather(comm, layouts, [f"{v} {have[v]}->{d}"
                                                        for v, d in keys]))
    with graph.inserting_before(anchor):
        call = graph.call_module(name, tuple(values))
        call.meta[HOISTED] = True
        outs = {}
        for i, key in enumerate(keys):
            out = graph.call_function(operator.getitem, (call, i))
            out.meta["val"] = nodes[key[0]].meta.get("val")
            out.meta[HOISTED] = True
            outs[key] = out
    for e in edges:
        nodes[e.consumer].replace_input_with(nodes[e.value], outs[(e.value, e.dst)])
    return len(keys)
