"""Segmentations worth considering for blocked shards: the parts a fused projection is split
into (equal, in proportions, or with the smaller parts held whole), the pieces a
concatenation joins, the periods heads or sequences take across reshapes. The problem
(``autotp.planner.problem``) offers each rule these block counts besides the plain shard."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from autotp.capture.trace import size_expr
from autotp.layout import Blocks, Period, proportions, smaller_whole
from autotp.ops import MATMULS, RESHAPES, node_arg
from autotp.rules.view_algebra import view_groups, view_segmentations

aten = torch.ops.aten

# a product, or a product with its bias added: the values a slice of one dim may tile
_PRODUCTS = MATMULS | {aten.add.Tensor}


def _sliced_segments(node: fx.Node) -> list[int]:
    """The sizes of slices of ``node`` along one dim that tile it (``qkv[..., :q]``,
    ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``), or [] when its slices do not."""
    val = node.meta.get("val")
    viewed = node.target in RESHAPES and isinstance(node.args[0], fx.Node) and \
        node.args[0].target in _PRODUCTS  # Falcon's qkv.view(B, T, heads + 2, head_dim)
    if not isinstance(val, torch.Tensor) or not (node.target in _PRODUCTS or viewed):
        return []  # only a product's output is a fused projection (not a KV cache's reads)
    by_dim: dict[int, set] = {}
    for user in node.users:
        if user.target != aten.slice.Tensor or user.args[0] is not node:
            continue
        dim = node_arg(user, "dim", 0) % val.ndim
        size = val.shape[dim]
        start, end = node_arg(user, "start") or 0, node_arg(user, "end")
        if node_arg(user, "step", 1) != 1 or not isinstance(size, int):
            continue
        end = size if end is None or (isinstance(end, int) and end >= size) else end
        if isinstance(start, int) and isinstance(end, int):
            by_dim.setdefault(dim, set()).add((start % size if start < 0 else start,
                                               end % size if end < 0 else end))
    for dim, ranges in by_dim.items():
        ordered = sorted(ranges)
        if len(ordered) > 1 and ordered[0][0] == 0 and ordered[-1][1] == val.shape[dim] and \
                all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            return [end - start for start, end in ordered]
    return []


def block_counts(gm: fx.GraphModule, sequences: frozenset = frozenset()
                 ) -> tuple[Blocks, ...]:
    """Segmentations worth considering for blocked shards: those of the graph's splits (a
    fused q|k|v or gate|up projection split into its parts): their count when the parts
    are equal, their proportions when not (q|k|v with fewer k/v heads), and those with the
    smaller parts held whole (multi-query attention's single k/v head), and the proportions
    of concatenated pieces; and the ``sequences`` (context parallelism's size symbols) a
    reshape merges after the batch."""
    counts: set = {1}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
                aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            val = node.meta.get("val")
            if not isinstance(val, (list, tuple)) or len(val) < 2:
                continue
            dim = node_arg(node, "dim", 0)
            sizes = [v.shape[dim] for v in val if isinstance(v, torch.Tensor)]
            if len(sizes) == len(val) and all(isinstance(size, int) for size in sizes):
                counts.add(proportions(sizes))
                counts.add(smaller_whole(proportions(sizes)))
                counts.update(smallest_whole(proportions(sizes)))
            else:
                counts.add(len(val))
            resplit = _resplit_sizes(node)
            if resplit:
                counts.add(proportions(resplit))
                counts.update(smallest_whole(proportions(resplit)))
        tiling = _sliced_segments(node)
        if tiling:
            counts.add(proportions(tiling))
            counts.add(smaller_whole(proportions(tiling)))
        if node.op == "call_function" and node.target == aten.cat.default:
            pieces = [a.meta.get("val") for a in node.args[0] if isinstance(a, fx.Node)]
            dim = node_arg(node, "dim", 0)
            sizes = [p.shape[dim] for p in pieces if isinstance(p, torch.Tensor)]
            if all(isinstance(size, int) and size > 0 for size in sizes) and \
                    len(set(sizes)) > 1:
                counts.add(proportions(sizes))  # Flux's cat([attention, mlp], -1): (1, 4)
        if node.op == "call_function" and node.target == aten.unbind.int:
            counts.add(len(node.meta.get("val") or ()))  # timm's qkv...unbind(0): 3 parts
        if node.op == "call_function" and node.target == aten.glu.default:
            counts.add(2)  # F.glu takes its input's halves: a gate|value projection's blocks
        counts.add(_selected_parts(node))
        if node.op == "call_function" and node.target in RESHAPES:
            counts.update(_merged_periods(node, sequences))
            counts.update(_view_segmentations(node, counts))
    counts.discard(None)
    counts.discard(0)
    return tuple(sorted(counts, key=lambda b: (
        isinstance(b, Period), isinstance(b, tuple),
        (isinstance(b.length, str), b.length) if isinstance(b, Period) else b)))


def smallest_whole(blocks: Blocks) -> list[Blocks]:
    """Unequal proportions with the smallest segments held whole, for each size they may go
    up to short of the largest: PaLM's q|k|v|ff with its single k/v head whole and q sliced
    by heads, beside ``smaller_whole``'s q whole as well."""
    if not isinstance(blocks, tuple) or min(blocks) < 0:
        return []
    return [tuple(-w if w <= limit else w for w in blocks)
            for limit in sorted(set(blocks))[:-1]]


def _static_split(node: fx.Node) -> Optional[tuple[int, list[int]]]:
    """(dim, the parts' sizes) of a split or chunk into static parts; None otherwise."""
    if node.op != "call_function" or node.target not in (
            aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    val, src = node.meta.get("val"), node.args[0]
    if not isinstance(val, (list, tuple)) or len(val) < 2 or not isinstance(src, fx.Node) \
            or not isinstance(src.meta.get("val"), torch.Tensor):
        return None
    dim = node_arg(node, "dim", 0) % src.meta["val"].ndim
    sizes = [v.shape[dim] for v in val if isinstance(v, torch.Tensor)]
    if len(sizes) != len(val) or not all(isinstance(size, int) and size > 0 for size in sizes):
        return None
    return dim, [int(size) for size in sizes]


def _resplit_sizes(node: fx.Node) -> list[int]:
    """A part of a split split again along the same dim (PaLM's fused q|k|v|ff, whose ff
    part SwiGLU halves): the first split's sizes with that part's replaced by the second's,
    the segments a blocked shard of the fused output needs; [] otherwise."""
    inner = _static_split(node)
    part = node.args[0]
    if inner is None or not isinstance(part, fx.Node) or part.target is not operator.getitem \
            or not isinstance(part.args[0], fx.Node) or not isinstance(part.args[1], int):
        return []
    outer = _static_split(part.args[0])
    if outer is None or outer[0] != inner[0]:
        return []
    index = part.args[1]
    return outer[1][:index] + inner[1] + outer[1][index + 1:]


def _selected_parts(node: fx.Node) -> Optional[int]:
    """k when ``node`` is taken apart along a static dim of size k by a ``select`` of each
    index, as ``unbind`` does (torch's attention: ``proj[0], proj[1], proj[2]`` of a fused
    projection unflattened into (3, h)); None otherwise."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    taken: dict[int, set] = {}
    for user in node.users:
        if user.target == aten.select.int and user.args[0] is node:
            dim = node_arg(user, "dim", 0) % val.ndim
            index = node_arg(user, "index")
            size = val.shape[dim]
            if isinstance(size, int) and isinstance(index, int):
                taken.setdefault(dim, set()).add(index % size)
    for dim, indices in taken.items():
        if val.shape[dim] >= 2 and indices == set(range(val.shape[dim])):
            return val.shape[dim]
    return None


def _merged_periods(node: fx.Node, sequences: frozenset = frozenset()) -> set[Period]:
    """The periods of static dims a reshape merges after a symbolic one, or splits back out
    of it (Bloom's [B, H, T, D] <-> [B*H, T, D]): heads sharded inside the batch; and of one
    of the ``sequences`` merged after the batch ([B, T, V] -> [B*T, V])."""
    src, dst = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(dst, torch.Tensor) or \
            not isinstance(src.meta.get("val"), torch.Tensor):
        return set()
    shapes = ([size_expr(s) for s in src.meta["val"].shape],
              [size_expr(s) for s in dst.shape])
    try:
        groups = view_groups(*shapes)
    except ValueError:
        return set()
    periods = set()
    for dims in groups:
        for many, one in ((0, 1), (1, 0)):
            majors = [d for d in dims[many] if shapes[many][d] != 1]
            single = [d for d in dims[one] if shapes[one][d] != 1]
            if len(single) != 1 or len(majors) < 2 or isinstance(shapes[one][single[0]], int):
                continue
            for k in range(1, len(majors)):
                inner = [shapes[many][d] for d in majors[k:]]
                if all(isinstance(size, int) for size in inner) and math.prod(inner) > 1:
                    periods.add(Period(int(math.prod(inner))))
            last = shapes[many][majors[-1]]
            if last in sequences:  # batch x sequence rows, split by context parallelism
                periods.add(Period(str(last)))
    return periods


def _view_segmentations(node: fx.Node, counts: set) -> set:
    """The periods a shard takes across a reshape, by the view algebra, from a plain shard
    or a period found so far (fairseq's [T, B, h] -> [T, B*heads, d]: segments of heads)."""
    src, dst = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(dst, torch.Tensor) or \
            not isinstance(src.meta.get("val"), torch.Tensor):
        return set()
    known = {1} | {b for b in counts if isinstance(b, Period) and not b.symbolic}
    return view_segmentations([size_expr(s) for s in src.meta["val"].shape],
                              [size_expr(s) for s in dst.shape], known)
