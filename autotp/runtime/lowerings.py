"""Lowerings: what the rewriter does to one rank's copy of an op node once the plan has
chosen its strategy, where the op's arguments hold global sizes or indices (a view's shape,
a slice's bounds, an embedding's rows, a grouped product's offsets).

The rules (rules/) say which layouts an op takes and gives; a lowering makes the node compute
that on local shards: a sharded dim's size divided by tp (``LowerContext.local_size_arg``), a
vocabulary-parallel lookup masked to the rank's rows, a routed product's offsets made local
to the rows the rank holds. ``lowering_for(op)`` finds an op's lowering; ops without one run
as traced.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from autotp.errors import PlanError, where
from autotp.layout import P, ROUTED, Partial, Shard, block_weights, is_mixed, local_segment_sizes, \
    whole_segments
from autotp.ops import arg_node, arg_seq, node_arg
from autotp.rules.matmul import CONV, GROUPED_MM
from autotp.rules.registry import Strategy, normalize_dim
from autotp.rules.views import segment_of
from autotp.runtime.routed_rows import expert_rows, local_offsets, routed_lookup

aten = torch.ops.aten


class LowerContext:
    """What a lowering may use: the rank, tp, the graph being rewritten."""

    def __init__(self, graph: fx.Graph, rank: int, tp: int,
                 routes: Optional[dict[str, fx.Node]] = None):
        self.graph = graph
        self.rank = rank
        self.tp = tp
        # node -> the bounds of its routed rows (autotp.runtime.routed_rows)
        self.routes = routes or {}
        self.lowered: dict[fx.Node, fx.Node] = {}

    def local_size_arg(self, arg: Any, node: fx.Node) -> Any:
        """A size argument of a sharded dim, made local: C -> C/tp; -1 stays -1."""
        if isinstance(arg, int):
            if arg == -1:
                return arg
            if arg % self.tp:
                raise PlanError(f"size {arg} is not divisible by tp={self.tp}{where(node)}")
            return arg // self.tp
        if isinstance(arg, fx.Node):
            with self.graph.inserting_before(node):
                return self.graph.call_function(operator.floordiv, (arg, self.tp))
        raise PlanError(f"cannot localize size argument {arg!r}{where(node)}")

    def mark_lowered(self, node: fx.Node, replacement: fx.Node) -> None:
        self.lowered[node] = replacement

    def apply_after(self, node: fx.Node, op: Any, *args: Any) -> fx.Node:
        """``op(node, *args)`` inserted after ``node``, read by all of ``node``'s users in its
        place; for a tensor, it is recorded as the node now holding ``node``'s value."""
        with self.graph.inserting_after(node):
            new = self.graph.call_function(op, (node, *args))
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        if isinstance(node.meta.get("val"), torch.Tensor):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            self.mark_lowered(node, new)
        return new


Lowering = Callable[[LowerContext, fx.Node, Strategy], None]
LOWERINGS: dict[Any, Lowering] = {}


def lowering(*ops: Any) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of ``ops`` (overloads, or qualified
    names of custom ops that exist only once their library is imported)."""
    def decorate(fn: Lowering) -> Lowering:
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return decorate


def lowering_for(op: Any) -> Optional[Lowering]:
    """The lowering of ``op``, registered as itself or by its qualified name."""
    if op in LOWERINGS:
        return LOWERINGS[op]
    schema = getattr(op, "_schema", None)
    return LOWERINGS.get(schema.name) if schema is not None else None


# ---- vocabulary-parallel lookups (autotp.rules.embedding) ---------------------------------------

def _local_indices(graph: Any, index: Any, rows: int, rank: int) -> tuple[Any, Any]:
    """Nodes for the index local to this rank's block of ``rows`` (rank r holds [r rows,
    (r + 1) rows)) and the mask of indices outside it, in three ops: the block an index
    falls in is ``index // rows``, its place there ``index % rows`` (in range for every
    index, so no fill; a negative one, an ignored target, falls in no rank's block)."""
    local = graph.call_function(aten.remainder.Scalar, (index, rows))
    block = graph.call_function(aten.floor_divide.Scalar, (index, rows))
    outside = graph.call_function(aten.ne.Scalar, (block, rank))
    return local, outside


@lowering(aten.embedding.default)
def vocab_parallel_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    if strategy.inputs[0] != Shard(0):
        return
    weight, indices = node.args[:2]
    vocab = arg_node(node, 0).meta["val"].shape[0]
    rows = vocab // ctx.tp
    lo, hi = ctx.rank * rows, (ctx.rank + 1) * rows
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    local_padding = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else -1
    graph = ctx.graph
    with graph.inserting_before(node):
        local, outside = _local_indices(graph, indices, rows, ctx.rank)
        outside_col = graph.call_function(aten.unsqueeze.default, (outside, -1))
    node.args = (weight, local, local_padding, *node.args[3:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "padding_idx"}
    ctx.apply_after(node, aten.masked_fill.Scalar, outside_col, 0.0)


@lowering(aten.gather.default)
def masked_gather_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    if strategy.output != P:
        return
    x, dim, index = arg_node(node, 0), *node.args[1:3]
    dim = normalize_dim(dim, x.meta["val"].ndim)
    rows = x.meta["val"].shape[dim] // ctx.tp
    graph = ctx.graph
    with graph.inserting_before(node):
        local, outside = _local_indices(graph, index, rows, ctx.rank)
    node.args = (x, dim, local, *node.args[3:])
    ctx.apply_after(node, aten.masked_fill.Scalar, outside, 0.0)


# ---- grouped products and convolutions (autotp.rules.matmul) ------------------------------------

@lowering(*GROUPED_MM)
def experts_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    if strategy.output != Shard(0, ROUTED):
        return
    x, weight, offs = node.args[:3]
    with ctx.graph.inserting_before(node):
        local = ctx.graph.call_function(local_offsets, (ctx.routes[node.name],))
    node.args = (x, weight, local, *node.args[3:])


@lowering(*CONV)
def local_groups_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """``groups`` counts the groups one rank convolves: g -> g/tp (blocks held whole: those
    segments' groups whole)."""
    layout = strategy.inputs[0]
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    if groups == 1 or not isinstance(layout, Shard) or layout.dim != 1:
        return
    assert isinstance(groups, int), "the conv rule shards only an int count of groups"
    local = sum(local_segment_sizes(groups, layout.blocks, ctx.tp)) \
        if is_mixed(layout.blocks) else ctx.local_size_arg(groups, node)
    if len(node.args) > 6:
        node.args = (*node.args[:6], local, *node.args[7:])
    else:
        node.kwargs = {**node.kwargs, "groups": local}


@lowering(aten.select.int)
def owner_select_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """``x[:, i]`` along the sharded dim (autotp.rules.views's owner's slice): the rank holding
    index i selects it at its local index, every other rank gives zeros of its shape."""
    layout = strategy.inputs[0]
    src = node.args[0]
    dim = node_arg(node, "dim")
    val = src.meta["val"] if isinstance(src, fx.Node) else None
    if not isinstance(layout, Shard) or val is None or \
            layout.dim != dim % val.ndim or not isinstance(strategy.output, Partial):
        return
    index = node_arg(node, "index")
    size = int(val.shape[layout.dim])
    index %= size
    local = size // ctx.tp
    owner = index // local
    node.args = (src, dim, index - owner * local if ctx.rank == owner else 0)
    node.kwargs = {}
    if ctx.rank != owner:
        ctx.apply_after(node, aten.zeros_like.default)


@lowering(aten.native_group_norm.default)
def local_group_norm_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """C and group count one rank's channels and groups: C -> C/tp, group -> group/tp."""
    layout = strategy.inputs[0]
    if not isinstance(layout, Shard) or layout.dim != 1:
        return
    args = list(node.args)
    args[4] = ctx.local_size_arg(args[4], node)  # C
    args[6] = ctx.local_size_arg(args[6], node)  # group
    node.args = tuple(args)


# ---- sizes (autotp.rules.misc) ------------------------------------------------------------------

@lowering(aten.sym_size.int)
def global_size_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    layout = strategy.inputs[0]
    x_ndim = arg_node(node, 0).meta["val"].ndim
    if isinstance(layout, Shard) and layout.dim == normalize_dim(node.args[1], x_ndim):
        ctx.apply_after(node, operator.mul, ctx.tp)


# ---- partial statistics (autotp.rules.norms) ----------------------------------------------------

@lowering(aten.mean.default, aten.mean.dim)
def partial_mean_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    if isinstance(strategy.inputs[0], Shard) and strategy.output == P:
        ctx.apply_after(node, aten.div.Scalar, ctx.tp)


# ---- views, slices and lookups (autotp.rules.views) ---------------------------------------------

@lowering(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.view_copy.default, aten.expand.default)
def localize_shape_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    out = strategy.output
    if isinstance(out, Shard):
        shape = list(arg_seq(node, 1))
        size = shape[out.dim]
        if out.blocks == ROUTED:  # as many rows as the rank holds: the view infers them
            if node.target == aten.expand.default:
                shape[out.dim] = -1
            elif -1 in shape[1:]:
                raise PlanError(f"a view of routed rows infers two sizes{where(node)}")
            else:
                shape[out.dim] = -1
        elif is_mixed(out.blocks) and isinstance(size, int) and size != -1:
            shape[out.dim] = sum(local_segment_sizes(size, out.blocks, ctx.tp))
        else:
            shape[out.dim] = ctx.local_size_arg(size, node)
        node.args = (node.args[0], shape, *node.args[2:])


@lowering(aten.unflatten.int)
def localize_unflatten_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """``unflatten(x, d, sizes)``: the size of the output dim that holds the shard is local
    (Flux's ``q.unflatten(-1, (heads, -1))``: heads -> heads / tp)."""
    out = strategy.output
    if not isinstance(out, Shard):
        return
    src_ndim = len(arg_node(node, 0).meta["val"].shape)
    dim = normalize_dim(node.args[1], src_ndim)
    sizes = list(arg_seq(node, 2))
    if 0 <= out.dim - dim < len(sizes):
        sizes[out.dim - dim] = ctx.local_size_arg(sizes[out.dim - dim], node)
        node.args = (node.args[0], node.args[1], sizes, *node.args[3:])


@lowering(aten.repeat_interleave.self_int)
def localize_output_size_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """``output_size``, where given, counts the rank's rows of a sharded ``dim``."""
    out, size = strategy.output, node.kwargs.get("output_size")
    given = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if size is None or not isinstance(out, Shard) or given is None:
        return
    if normalize_dim(given, len(node.meta["val"].shape)) == out.dim:
        node.kwargs = {**node.kwargs, "output_size": ctx.local_size_arg(size, node)}


@lowering(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """Squeeze exactly the dims that are 1 globally: a shard of size 1 must stay."""
    if not isinstance(strategy.inputs[0], Shard):
        return
    shape = arg_node(node, 0).meta["val"].shape
    if node.target == aten.squeeze.default:
        dims = [d for d in range(len(shape)) if shape[d] == 1]
    else:
        given = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [normalize_dim(d, len(shape)) for d in given]
        dims = [d for d in dims if shape[d] == 1]
    node.target = aten.squeeze.dims
    node.args = (node.args[0], dims)


@lowering(aten.slice.Tensor)
def localize_slice_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    """A segment of a blocked shard starts and ends at the global bounds / tp locally; with
    segments held whole, at the local segments' edges."""
    layout = strategy.inputs[0]
    if isinstance(layout, Shard) and is_mixed(layout.blocks) and strategy.output != layout:
        size = arg_node(node, 0).meta["val"].shape[layout.dim]
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
        end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end")
        j = segment_of(size, layout.blocks, start, end)
        assert j is not None, "the slice rule offers a held-whole segment only for one segment"
        local = [0, *itertools.accumulate(local_segment_sizes(size, layout.blocks, ctx.tp))]
        node.args = (node.args[0], node.args[1], local[j], local[j + 1], *node.args[4:])
        return
    if strategy.output == strategy.inputs[0] or not isinstance(strategy.output, Shard):
        return
    args = list(node.args) + [None] * (4 - len(node.args))
    size = arg_node(node, 0).meta["val"].shape[strategy.output.dim]
    start = args[2] or 0
    end = size if args[3] is None or (isinstance(args[3], int) and args[3] >= size) \
        else args[3]
    node.args = (args[0], args[1], ctx.local_size_arg(start, node) if start else 0,
                 ctx.local_size_arg(end, node), *node.args[4:])


@lowering(aten.split.Tensor, aten.split_with_sizes.default)
def localize_split_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    layout = strategy.inputs[0]
    if not isinstance(layout, Shard):
        return
    ndim = len(arg_node(node, 0).meta["val"].shape)
    dim = normalize_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim)
    if layout.dim != dim:
        return
    sizes = node.args[1]
    outs = strategy.output if isinstance(strategy.output, tuple) else ()
    if isinstance(sizes, (list, tuple)) and len(outs) == len(sizes):
        # each piece as its layout holds it: whole, sliced, or in blocks of its own with
        # some whole (a fused q|k|v|ff's ff part in two halves beside a whole k/v head)
        local: Any = [s if not isinstance(o, Shard) else
                      sum(local_segment_sizes(s, o.blocks, ctx.tp)) if is_mixed(o.blocks)
                      else ctx.local_size_arg(s, node) for s, o in zip(sizes, outs)]
    elif isinstance(sizes, (list, tuple)):
        whole = whole_segments(layout.blocks) if len(sizes) == len(block_weights(layout.blocks)) \
            else (False,) * len(sizes)
        local = [s if held else ctx.local_size_arg(s, node) for s, held in zip(sizes, whole)]
    else:
        local = ctx.local_size_arg(sizes, node)
    node.args = (node.args[0], local, *node.args[2:])


@lowering(aten.index.Tensor)
def routed_lookup_lowering(ctx: LowerContext, node: fx.Node, strategy: Strategy) -> None:
    if strategy.inputs[0] == Shard(0, ROUTED):
        x, (index,) = node.args[0], arg_seq(node, 1)
        node.target = routed_lookup
        node.args = (x, index, ctx.routes[node.name])
    elif strategy.inputs == (Shard(0), Shard(0, ROUTED)):
        x, (index,) = node.args[0], arg_seq(node, 1)
        node.target = expert_rows
        node.args = (x, index, ctx.routes[node.name])
