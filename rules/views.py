"""View ops: reshapes, permutations, slices, concatenations, index reads and writes.

Reshapes map a shard by the view algebra (``autotp.rules.view_algebra``: groups of input
and output dims of equal product, a shard found by strides; re-exported here). Every view is
linear, so ``P`` passes through. The lowerings rewrite size arguments to their local values
(C -> C/tp, H -> H/tp, split sizes likewise); ``-1`` stays ``-1``.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

import sympy
import torch

from autotp.layout import (
    Blocks,
    Layout,
    P,
    R,
    R_STAR,
    ROUTED,
    Period,
    Shard,
    block_weights,
    proportions,
    segment_sizes,
    smaller_whole,
    whole_segments,
)
from autotp.rules.registry import (
    OpCall,
    RuleSet,
    Strategy,
    TensorMeta,
    normalize_dim,
    shardable_dims,
)
from autotp.rules.view_algebra import map_shard_through_view, view_groups

__all__ = ["map_shard_through_view", "rules", "segment_of", "view_groups"]

aten = torch.ops.aten
rules = RuleSet()


def _expr(size: Any) -> sympy.Expr:
    return sympy.sympify(size)


@rules.register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.view_copy.default, aten.flatten.using_ints, aten.unflatten.int)
def view_rule(call: OpCall) -> Iterator[Strategy]:
    """Any reshape, by the view algebra (flatten takes dims, not sizes: nothing to localize;
    unflatten's sizes are localized below)."""
    src, dst = call.inputs[0], call.out
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(src, call):
        mapped = map_shard_through_view(Shard(dim, blocks), src, dst, call.tp)
        if mapped is not None and (call.context or not (
                isinstance(mapped.blocks, Period) and mapped.blocks.symbolic)):
            yield Strategy((Shard(dim, blocks),), mapped, name="view")


@rules.register(aten.transpose.int)
def transpose_rule(call: OpCall) -> Iterator[Strategy]:
    ndim = call.inputs[0].ndim
    d0, d1 = normalize_dim(call.arg("dim0"), ndim), normalize_dim(call.arg("dim1"), ndim)
    perm = list(range(ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    yield from _permutation_strategies(call, perm)


@rules.register(aten.t.default, aten.numpy_T.default)
def t_rule(call: OpCall) -> Iterator[Strategy]:
    yield from _permutation_strategies(call, list(reversed(range(call.inputs[0].ndim))))


@rules.register(aten.permute.default)
def permute_rule(call: OpCall) -> Iterator[Strategy]:
    ndim = call.inputs[0].ndim
    yield from _permutation_strategies(call, [normalize_dim(d, ndim) for d in call.arg("dims")])


def _permutation_strategies(call: OpCall, perm: list[int]) -> Iterator[Strategy]:
    """out.dim(i) = in.dim(perm[i])."""
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(call.inputs[0], call):
        yield Strategy((Shard(dim, blocks),), Shard(perm.index(dim), blocks), name="permute")


@rules.register(aten.movedim.int)
def movedim_rule(call: OpCall) -> Iterator[Strategy]:
    """``movedim(x, s, d)``: dim s moved to d, the others in their order; a permutation."""
    ndim = call.inputs[0].ndim
    source = normalize_dim(call.arg("source"), ndim)
    rest = [d for d in range(ndim) if d != source]
    rest.insert(normalize_dim(call.arg("destination"), ndim), source)
    yield from _permutation_strategies(call, rest)


@rules.register(aten.unfold.default)
def unfold_rule(call: OpCall) -> Iterator[Strategy]:
    """``x.unfold(d, size, step)``: dim d becomes the window count and a last dim of
    ``size`` is appended: ``out[..., w, ..., k] = x[..., w * step + k, ...]``. A shard of any
    other dim stays (windows are taken within each index of it); a view, so linear."""
    src = call.inputs[0]
    dim = normalize_dim(call.arg("dimension"), src.ndim)
    yield Strategy((P,), P, name="linear")
    for d, blocks in shardable_dims(src, call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="windows")


@rules.register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(call: OpCall) -> Iterator[Strategy]:
    """``x.repeat_interleave(r, d)``: ``out[..., i, ...] = x[..., i // r, ...]`` (GQA's k/v
    heads repeated for the query heads). A contiguous shard of d gives the contiguous shard
    of the output that repeats it (rank j's heads [a, b) -> [a r, b r)), each block of a
    blocked shard likewise; a shard of another dim stays. Linear. Without d the input is
    flattened: computed whole."""
    given = call.arg("dim")
    if given is None:
        return
    src, dst = call.inputs[0], call.out
    dim = normalize_dim(given, src.ndim)
    yield Strategy((P,), P, name="linear")
    for d, blocks in shardable_dims(src, call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="view")
        elif isinstance(blocks, int) and dst.shardable(d, call.tp, blocks):
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="repeat heads")


@rules.register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Iterator[Strategy]:
    new = normalize_dim(call.arg("dim"), call.inputs[0].ndim + 1)
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(call.inputs[0], call):
        yield Strategy((Shard(dim, blocks),), Shard(dim + (dim >= new), blocks), name="view")


@rules.register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> Iterator[Strategy]:
    """``[..., n, 2] -> [..., n]`` (complex): a complex tensor is a float tensor with a
    trailing (real, imaginary) pair, so every dim but the pair keeps its shard. Linear:
    vac(A1 + A2) = vac(A1) + vac(A2)."""
    src = call.inputs[0]
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(src, call):
        if dim < src.ndim - 1:
            yield Strategy((Shard(dim, blocks),), Shard(dim, blocks), name="view")


@rules.register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> Iterator[Strategy]:
    """``[..., n]`` (complex) ``-> [..., n, 2]``: every dim keeps its shard; linear."""
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(call.inputs[0], call):
        yield Strategy((Shard(dim, blocks),), Shard(dim, blocks), name="view")


@rules.register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(call: OpCall) -> Iterator[Strategy]:
    src = call.inputs[0]
    if call.op == aten.squeeze.default:
        removed = [d for d in range(src.ndim) if _expr(src.shape[d]) == 1]
    else:
        given = call.arg("dim")
        dims = given if isinstance(given, (list, tuple)) else [given]
        removed = [normalize_dim(d, src.ndim) for d in dims if _expr(src.shape[d]) == 1]
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(src, call):
        shift = sum(1 for r in removed if r < dim)
        yield Strategy((Shard(dim, blocks),), Shard(dim - shift, blocks), name="view")


@rules.register(aten.expand.default)
def expand_rule(call: OpCall) -> Iterator[Strategy]:
    src, dst = call.inputs[0], call.out
    offset = dst.ndim - src.ndim
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(src, call):
        if _expr(src.shape[dim]) == _expr(dst.shape[dim + offset]):
            yield Strategy((Shard(dim, blocks),), Shard(dim + offset, blocks), name="view")


@rules.register(aten.expand_as.default)
def expand_as_rule(call: OpCall) -> Iterator[Strategy]:
    """``expand_as(x, other)``: x broadcast to other's shape (``F.normalize``'s norm over a
    head). The output takes other's local shape, so other carries the output's layout
    (a partial x against a whole other); x's dim is sharded alike or broadcast (size 1)."""
    src, other, dst = call.inputs[0], call.inputs[1], call.out
    offset = dst.ndim - src.ndim
    yield Strategy((P, R), P, name="linear")
    for dim, blocks in shardable_dims(other, call):
        if not dst.shardable(dim, call.tp, blocks):
            continue
        mine = dim - offset
        if mine < 0 or _expr(src.shape[mine]) == 1:
            yield Strategy((R, Shard(dim, blocks)), Shard(dim, blocks), name="broadcast")
        elif _expr(src.shape[mine]) == _expr(dst.shape[dim]) and \
                src.shardable(mine, call.tp, blocks):
            yield Strategy((Shard(mine, blocks), Shard(dim, blocks)), Shard(dim, blocks),
                           name="view")


@rules.register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Iterator[Strategy]:
    """``repeat(x, r)``: ``out[..., i, ...] = x[..., i % n, ...]``, with ``len(r) - x.ndim``
    new leading dims. A dim repeated once keeps its shard, shifted past the new dims. A
    sharded dim repeated ``k > 1`` times is ``cat([x] * k)``: each rank's slice of every copy,
    which is the blocked shard with one block per copy (``S(d) -> S(d')xk``; b blocks ->
    b*k); the local ``repeat`` with the same counts writes exactly that, so nothing is
    localized. Linear: repeat(A1 + A2) = repeat(A1) + repeat(A2)."""
    src, dst = call.inputs[0], call.out
    lead = dst.ndim - src.ndim
    yield Strategy((P,), P, name="linear")
    for dim, blocks in shardable_dims(src, call):
        times = sympy.cancel(_expr(dst.shape[dim + lead]) / _expr(src.shape[dim]))
        if times == 1:
            yield Strategy((Shard(dim, blocks),), Shard(dim + lead, blocks), name="view")
            continue
        repeated = _repeated_blocks(blocks, times)
        if repeated is not None and dst.shardable(dim + lead, call.tp, repeated):
            yield Strategy((Shard(dim, blocks),), Shard(dim + lead, repeated),
                           name="repeat blocks")


def _repeated_blocks(blocks: Blocks, times: Any) -> Optional[Blocks]:
    """The segments of ``times`` copies of a dim in ``blocks``: the segments of each copy in
    turn (a period's segments are the same length, only more of them); None for routed
    rows or a count that is not a whole number."""
    if not (isinstance(times, sympy.Integer) and times > 1):
        return None
    if isinstance(blocks, Period):
        return blocks
    if isinstance(blocks, (int, tuple)):
        return blocks * int(times)
    return None


def _is_full_slice(src: TensorMeta, dim: int, start: Any, end: Any, step: Any) -> bool:
    if step not in (None, 1) or start not in (None, 0):
        return False
    if end is None:
        return True
    size = src.static(dim)
    if size is None and hasattr(end, "meta"):  # a symbolic end: the dim's own size?
        return _same_size(end.meta.get("val"), src.shape[dim])
    return isinstance(end, int) and (end >= 2**62 or (size is not None and end >= size))


def _same_size(a: Any, b: Any) -> bool:
    """Two sizes (symbolic ints or expressions) that are one expression (einops' ``unpack``
    slicing a merged batch ``[:b * h]`` of a tensor whose dim is ``b * h``)."""
    try:
        return sympy.simplify(sympy.sympify(str(a)) - sympy.sympify(str(b))) == 0
    except (sympy.SympifyError, TypeError):
        return False


def _block_of_slice(src: TensorMeta, dim: int, start: Any, end: Any, step: Any,
                    blocks: Any) -> Optional[int]:
    """The segment of ``blocks`` that ``x[start:end]`` along ``dim`` is exactly, or None."""
    size = src.static(dim)
    if blocks == 1 or size is None or step not in (None, 1):
        return None
    return segment_of(size, blocks, start, end)


def segment_of(size: int, blocks: Any, start: Any, end: Any) -> Optional[int]:
    start = 0 if start is None else start
    end = size if end is None or (isinstance(end, int) and end >= size) else end
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    bounds = (start + size if start < 0 else start, end + size if end < 0 else end)
    edges = [0, *itertools.accumulate(segment_sizes(size, blocks))]
    return next((j for j in range(len(edges) - 1) if (edges[j], edges[j + 1]) == bounds),
                None)


@rules.register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Iterator[Strategy]:
    """A slice keeps shards of other dims (and of its own dim when it takes all of it); a
    slice that takes one segment of a blocked shard (Phi-3's ``qkv[..., :q_size]``) is a
    plain shard of that segment."""
    src = call.inputs[0]
    dim = normalize_dim(call.arg("dim", 0), src.ndim)
    start, end, step = call.arg("start"), call.arg("end"), call.arg("step", 1)
    full = _is_full_slice(src, dim, start, end, step)
    yield Strategy((P,), P, name="linear")
    for d, blocks in shardable_dims(src, call):
        if d != dim or full:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="view")
            continue
        segment = _block_of_slice(src, dim, start, end, step, blocks)
        if segment is not None:  # a segment held whole is whole on every rank
            yield Strategy((Shard(d, blocks),),
                           R_STAR if whole_segments(blocks)[segment] else Shard(d),
                           name="slice block")


@rules.register(aten.select.int)
def select_rule(call: OpCall) -> Iterator[Strategy]:
    """Besides the view's strategies: ``x[:, i]`` of ``x`` sharded along that very dim is
    held by one rank, the others holding zeros in its place: a partial sum
    (``(S(d)) -> P``), reduced only where the value must be whole (attention probabilities
    of one head returned beside the output, not the whole attention gathered for them)."""
    yield from _select_strategies(call, call.arg("dim"))
    src, index = call.inputs[0], call.arg("index")
    dim = normalize_dim(call.arg("dim"), src.ndim)
    if isinstance(index, int) and src.floating and src.shardable(dim, call.tp):
        yield Strategy((Shard(dim),), P, name="owner's slice")


def _select_strategies(call: OpCall, dim: int) -> Iterator[Strategy]:
    """``x[..., i, ...]`` along ``dim``: a shard on another dim stays, one dim lower past
    it; linear."""
    src = call.inputs[0]
    dim = normalize_dim(dim, src.ndim)
    yield Strategy((P,), P, name="linear")
    for d, blocks in shardable_dims(src, call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), Shard(d - (d > dim), blocks), name="view")


@rules.register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split_rule(call: OpCall) -> Iterator[Strategy]:
    src = call.inputs[0]
    outputs = call.output
    assert isinstance(outputs, tuple)
    n = len(outputs)
    dim = normalize_dim(call.arg("dim", 0), src.ndim)
    yield Strategy((P,), (P,) * n, name="linear")
    for d, blocks in shardable_dims(src, call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), (Shard(d, blocks),) * n, name="view")
    # A blocked shard with one block per piece splits into plain shards (fused q|k|v; with
    # fewer k/v heads the pieces are unequal and the blocks are their proportions).
    sizes = [o.shape[dim] for o in outputs if o is not None]
    if n > 1 and len(sizes) == n and all(isinstance(size, int) for size in sizes):
        blocks = proportions(sizes)
        if src.shardable(dim, call.tp, blocks):
            yield Strategy((Shard(dim, blocks),), (Shard(dim),) * n, name="split blocks")
        # Multi-query attention's q|k|v: q sliced by heads, the smaller parts (one k/v head)
        # held whole by every rank, with partial gradients (each rank's query heads).
        mixed = smaller_whole(blocks)
        if mixed is not None and src.shardable(dim, call.tp, mixed):
            yield Strategy((Shard(dim, mixed),),
                           tuple(R_STAR if whole else Shard(dim)
                                 for whole in whole_segments(mixed)), name="split blocks")
        # Finer blocks whose segments tile every piece (PaLM's fused q|k|v|ff with the ff
        # part halved again by SwiGLU, its single k/v head whole): each piece takes the
        # segments it covers, as blocks of its own.
        size = src.static(dim)
        for finer in call.blocks:
            if size is None or not isinstance(finer, tuple) or finer in (blocks, mixed) or \
                    not src.shardable(dim, call.tp, finer):
                continue
            pieces = _pieces(size, finer, sizes, dim)
            if pieces is not None:
                yield Strategy((Shard(dim, finer),), pieces, name="split blocks")


def _pieces(size: int, blocks: Blocks, sizes: list[int], dim: int
            ) -> Optional[tuple[Layout, ...]]:
    """The layout of each piece of ``sizes`` cut from a dim of ``size`` sharded in
    ``blocks``, where the segments tile every piece; None where one straddles two."""
    segments = list(zip(segment_sizes(size, blocks), whole_segments(blocks)))
    out: list[Layout] = []
    for piece in sizes:
        taken: list[tuple[int, bool]] = []
        while segments and sum(s for s, _ in taken) < piece:
            taken.append(segments.pop(0))
        if sum(s for s, _ in taken) != piece:
            return None
        if all(whole for _, whole in taken):
            out.append(R_STAR)
        elif len(taken) == 1:
            out.append(Shard(dim))
        else:
            weights = proportions([s for s, _ in taken])
            if any(whole for _, whole in taken):
                units = block_weights(weights)
                weights = tuple(-w if whole else w for w, (_, whole) in zip(units, taken))
            out.append(Shard(dim, weights))
    return tuple(out)


@rules.register(aten.unbind.int)
def unbind_rule(call: OpCall) -> Iterator[Strategy]:
    """``unbind(x, d)`` = every ``select(x, d, i)`` (timm's ``qkv.unbind(0)``): select's
    strategies, for each part."""
    assert isinstance(call.output, tuple)
    for strategy in _select_strategies(call, call.arg("dim", 0)):
        yield Strategy(strategy.inputs, (strategy.output,) * len(call.output),
                       name=strategy.name)


@rules.register(aten.cat.default)
def cat_rule(call: OpCall) -> Iterator[Strategy]:
    n = len(call.inputs)
    out = call.out
    dim = normalize_dim(call.arg("dim", 0), out.ndim)
    yield Strategy((P,) * n, P, name="linear")
    for d, blocks in shardable_dims(out, call):
        if (d != dim or n == 1) and all(m.shape[d] == out.shape[d] for m in call.inputs):
            yield Strategy((Shard(d, blocks),) * n, Shard(d, blocks), name="view")
    # Concatenating sharded pieces gives a blocked shard: one block per piece, in their
    # proportions where they differ (Flux's single-stream cat([attention, mlp], -1), h and
    # 4h, before one row-parallel output projection).
    sizes = [m.shape[dim] for m in call.inputs]
    if n > 1 and all(isinstance(size, int) and size > 0 for size in sizes) and \
            all(m.shardable(dim, call.tp) for m in call.inputs):
        yield Strategy((Shard(dim),) * n, Shard(dim, proportions(sizes)), name="cat blocks")


@rules.register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(call: OpCall) -> Iterator[Strategy]:
    """``pad`` holds (before, after) amounts for the last dims, the last dim first: a dim
    padded by nothing keeps its shard (gateloop's and FLASH's ``pad_at_dim`` name every dim
    after the one they pad, with zeros); P stays P for zero fill."""
    src = call.inputs[0]
    pad = list(call.arg("pad"))
    touched = {src.ndim - 1 - k for k in range(len(pad) // 2)
               if not (pad[2 * k] == 0 and pad[2 * k + 1] == 0)}
    for d, blocks in shardable_dims(src, call):
        if d not in touched:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="keep shard")
    value = call.arg("value", 0)
    mode = call.arg("mode", "constant") if call.op == aten.pad.default else "constant"
    if mode == "constant" and not value and call.out.floating:
        yield Strategy((P,), P, name="linear")


@rules.register(aten.roll.default)
def roll_rule(call: OpCall) -> Iterator[Strategy]:
    """``roll(x, shifts, dims)`` moves elements along ``dims`` only (Swin's shifted windows
    roll the spatial dims): a shard of any other dim stays; it is linear, so P stays P. A
    roll of the flattened tensor (no dims) keeps no shard."""
    src = call.inputs[0]
    dims = call.arg("dims", [])
    rolled = {normalize_dim(d, src.ndim) for d in dims}
    if dims:
        for d, blocks in shardable_dims(src, call):
            if d not in rolled:
                yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="keep shard")
    if src.floating:
        yield Strategy((P,), P, name="linear")


@rules.register(aten.stack.default)
def stack_rule(call: OpCall) -> Iterator[Strategy]:
    """stack = cat along a new dim: every input's shard moves past the new dim."""
    n = len(call.inputs)
    out = call.out
    new = normalize_dim(call.arg("dim", 0), out.ndim)
    yield Strategy((P,) * n, P, name="linear")
    first = call.inputs[0]
    for d, blocks in shardable_dims(first, call):
        if all(m.shape == first.shape for m in call.inputs):
            yield Strategy((Shard(d, blocks),) * n, Shard(d + (d >= new), blocks), name="view")


@rules.register(aten.index_copy.default, aten.index_copy_.default)
def index_copy_rule(call: OpCall) -> Iterator[Strategy]:
    """``index_copy(self, dim, index, source)`` writes source's slices into self along
    ``dim`` (a KV cache written at the new positions): any other dim sharded alike on self
    and source stays sharded, and the write is linear in (self, source)."""
    dst, _, src = call.inputs
    dim = normalize_dim(call.arg("dim"), dst.ndim)
    yield Strategy((P, R, P), P, name="linear")
    for d, blocks in shardable_dims(dst, call):
        if d != dim and src.shape[d] == dst.shape[d]:
            yield Strategy((Shard(d, blocks), R, Shard(d, blocks)), Shard(d, blocks),
                           name="write shard")


def _advanced_index(call: OpCall, indices: list) -> "Optional[tuple[int, int, int]]":
    """(first indexed dim, number of indexed dims, ndim of the broadcast index) when the
    non-None indices are one adjacent run (then the index dims replace them in place)."""
    present = [i for i, index in enumerate(indices) if index is not None]
    if not present or present != list(range(present[0], present[-1] + 1)):
        return None
    k = len(present)
    index_ndim = call.out.ndim - (call.inputs[0].ndim - k)
    return present[0], k, index_ndim


@rules.register(aten.index.Tensor)
def index_rule(call: OpCall) -> Iterator[Strategy]:
    """``x[..., idx, ...]`` with replicated integer indices (a token gather, a position
    lookup): linear in ``x``, and a shard of a dim that is not indexed stays a shard."""
    src = call.inputs[0]
    n_index = len(call.inputs) - 1
    if src.floating:
        yield Strategy((P,) + (R,) * n_index, P, name="linear")
    run = _advanced_index(call, list(call.arg("indices")))
    if run is None:
        return
    first, k, index_ndim = run
    for d, blocks in shardable_dims(src, call):
        if first <= d < first + k:
            continue
        out_dim = d if d < first else d - k + index_ndim
        yield Strategy((Shard(d, blocks),) + (R,) * n_index, Shard(out_dim, blocks),
                       name="gather rows")
    if first == 0 and k == 1 and n_index == 1:
        index = call.inputs[1]
        # the output's leading dims are the index's: a shard of the index's rows is a shard
        # of the output's (each rank gathers the rows its slice of the index names)
        if index.ndim >= 1 and call.out.shape[0] == index.shape[0]:
            for blocks in (1,):
                if index.shardable(0, call.tp, blocks):
                    yield Strategy((R, Shard(0, blocks)), Shard(0, blocks), name="index rows")
        if src.floating and call.routed is not None and src.shape[0] == call.routed:
            # rows routed to experts, gathered back into token order: each rank reads the
            # rows it holds and writes zeros elsewhere, so the ranks' outputs sum to x[idx]
            yield Strategy((Shard(0, ROUTED), R), P, name="routed lookup")
        if call.experts is not None and src.static(0) == call.experts and \
                call.experts % (call.tp * call.ep) == 0 and index.ndim == 1 and \
                index.shape[0] == call.routed and not index.floating:
            # a per-expert table (gpt-oss's expert biases) read at the routed rows' expert
            # ids: each rank's rows name only its own experts, the table's rows it holds
            # (checked at run time)
            yield Strategy((Shard(0), Shard(0, ROUTED)), Shard(0, ROUTED), name="expert rows")


@rules.register(aten.index_put.default, aten.index_put_.default)
def index_put_rule(call: OpCall) -> Iterator[Strategy]:
    """``self[idx] = values`` (or ``+=`` with ``accumulate``): linear in (self, values)
    jointly, and a shard of a dim that is not indexed stays a shard when ``values`` holds
    that dim whole."""
    dst, values = call.inputs[0], call.inputs[-1]
    n_index = len(call.inputs) - 2
    if dst.floating:
        yield Strategy((P,) + (R,) * n_index + (P,), P, name="linear")
    run = _advanced_index(call, list(call.arg("indices")))
    if run is None:
        return
    first, k, _ = run
    tail = dst.ndim - (first + k)
    for d, blocks in shardable_dims(dst, call):
        if first <= d < first + k or d < first:
            continue
        v = values.ndim - (dst.ndim - d)  # values broadcast from the right
        if v < 0 or dst.ndim - d > tail or values.shape[v] != dst.shape[d]:
            continue
        yield Strategy((Shard(d, blocks),) + (R,) * n_index + (Shard(v, blocks),),
                       Shard(d, blocks), name="write rows")


@rules.register(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall) -> Iterator[Strategy]:
    """``self`` with ``src`` written into a slice along ``dim`` (what functionalization makes
    of ``x[..., a:b].copy_(y)``): linear in (self, src), and any other dim sharded alike in
    both stays sharded."""
    dst, src = call.inputs
    dim = normalize_dim(call.arg("dim", 0), dst.ndim)
    if dst.floating:
        yield Strategy((P, P), P, name="linear")
    for d, blocks in shardable_dims(dst, call):
        if d != dim and src.ndim == dst.ndim and src.shape[d] == dst.shape[d]:
            yield Strategy((Shard(d, blocks), Shard(d, blocks)), Shard(d, blocks),
                           name="write shard")


@rules.register(aten.copy.default)
def copy_rule(call: OpCall) -> Iterator[Strategy]:
    """``copy(self, src)`` is ``src`` broadcast to ``self``'s shape and dtype; ``self``'s
    values are not read, so it takes the output's layout (a local slice of a fresh buffer)."""
    dst, src = call.inputs
    offset = dst.ndim - src.ndim
    if dst.dtype == src.dtype and dst.floating and offset == 0:
        yield Strategy((P, P), P, name="linear")
    for d, blocks in shardable_dims(dst, call):
        if d >= offset and src.shape[d - offset] == dst.shape[d] and \
                src.shardable(d - offset, call.tp, blocks):
            yield Strategy((Shard(d, blocks), Shard(d - offset, blocks)), Shard(d, blocks),
                           name="copy shard")
