"""The view algebra: where a reshape puts an input dim's shard.

``view_groups(from_shape, to_shape)`` splits any reshape into groups of input dims whose
product equals that of a group of output dims: [B, T, 192] -> [B*T, 192] is
((0, 1) -> (0,)), ((2,) -> (1,)); [B, T, 64] -> [B, T, 4, 16] ends with ((2,) -> (2, 3)).
Where the algebra cannot prove a group's products equal (einops' ``b (n g) d -> b n g d``
with a dynamic T: [B, T, d] -> [B, T // 8, 8, d]), ``view_groups_around`` still lines up the
groups before and after it, from either end; only that middle keeps no shard.

A shard of the *major* dim of a group survives as a shard of the major output dim when tp
divides both: splitting C into (H, D) keeps the shard on H exactly when tp divides H. A
shard of any other dim of a group, and a shard in segments (a period, or k equal blocks of
a static dim), is found by strides: in the group's flat index one segment spans its length
times the sizes after it, each rank one tp-th of that; the output dim holding it is the
innermost whose stride divides a rank's span ([T, B, h] -> [T, B*heads, d]: heads sharded
inside the batch x heads dim, ``S(1)%heads``; and back). A segmentation lands on a static
output dim as its count of blocks (``S(1)%4`` of [T, 8, d] is ``S(1)x2``), on a symbolic one
as a period.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Optional, Sequence

import sympy
import torch

from autotp.layout import Blocks, Period, Shard, block_units
from autotp.rules.registry import TensorMeta

Group = tuple[tuple[int, ...], tuple[int, ...]]


def _expr(size: Any) -> sympy.Expr:
    return sympy.sympify(size)


def _lined_up(src: list[sympy.Expr], dst: list[sympy.Expr]) -> tuple[list[Group], int, int]:
    """Groups of equal product from the front, as far as the algebra proves them: the groups
    and the input and output dims they take (all of both where the whole reshape lines up)."""
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and j < len(dst) and src[i] == 1 and dst[j] == 1:
            groups.append(((i,), (j,)))
            i, j = i + 1, j + 1
            continue
        if i < len(src) and src[i] == 1:
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(((), (j,)))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            break
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        k, m = i + 1, j + 1
        while sympy.simplify(pi - pj) != 0:
            _, denominator = sympy.fraction(sympy.cancel(pj / pi))
            if denominator == 1:  # pj is a multiple of pi: the input group needs more dims
                if k >= len(src):
                    break
                gi.append(k)
                pi = pi * src[k]
                k += 1
            else:
                if m >= len(dst):
                    break
                gj.append(m)
                pj = pj * dst[m]
                m += 1
        else:
            groups.append((tuple(gi), tuple(gj)))
            i, j = k, m
            continue
        break  # this group never closes: what follows is not lined up from the front
    return groups, i, j


@functools.lru_cache(maxsize=4096)
def _around(src: tuple, dst: tuple) -> tuple[tuple[Group, ...], Optional[Group]]:
    head, i, j = _lined_up(list(src), list(dst))
    if i == len(src) and j == len(dst):
        return tuple(head), None
    # from the back: the same algebra on the rest, reversed
    back, k, m = _lined_up(list(src[i:][::-1]), list(dst[j:][::-1]))
    last_in, last_out = len(src) - 1, len(dst) - 1
    tail = [(tuple(last_in - d for d in reversed(ins)), tuple(last_out - d for d in reversed(outs)))
            for ins, outs in reversed(back)]
    middle = (tuple(range(i, len(src) - k)), tuple(range(j, len(dst) - m)))
    return tuple(head + tail), (middle if middle != ((), ()) else None)


def view_groups_around(from_shape: Sequence[Any], to_shape: Sequence[Any]
                       ) -> tuple[list[Group], Optional[Group]]:
    """The groups a reshape lines up in from its front and from its back, in dim order, and
    the middle group between them whose products the algebra cannot prove equal (None where
    the whole reshape lines up): [B, T, d] -> [B, T // 8, 8, d] is ((0,), (0,)) and
    ((2,), (3,)) around the middle ((1,), (1, 2))."""
    groups, middle = _around(tuple(_expr(s) for s in from_shape),
                             tuple(_expr(s) for s in to_shape))
    return list(groups), middle


def view_groups(from_shape: Sequence[Any], to_shape: Sequence[Any]) -> list[Group]:
    """Decompose a reshape into (input dims, output dims) groups of equal product; a
    ValueError where the algebra cannot line up all of it."""
    groups, middle = view_groups_around(from_shape, to_shape)
    if middle is not None:
        raise ValueError(f"cannot group {tuple(from_shape)} -> {tuple(to_shape)}")
    return groups


def map_shard_through_view(
    layout: Shard, src: TensorMeta, dst: TensorMeta, tp: int
) -> Optional[Shard]:
    """The output shard a reshape gives an input shard, or None if it cannot be kept."""
    groups, middle = view_groups_around(src.shape, dst.shape)
    if middle is not None and layout.dim in middle[0]:
        return None  # sizes the algebra cannot line up (T -> (T // 8, 8)): replicate
    for in_dims, out_dims in groups:
        if layout.dim not in in_dims:
            continue
        major_in = [d for d in in_dims if _expr(src.shape[d]) != 1]
        major_out = [d for d in out_dims if _expr(dst.shape[d]) != 1]
        if not major_in or not major_out:
            return None
        if isinstance(layout.blocks, Period) and layout.blocks.symbolic:
            return _sequence_rows(layout, src, dst, major_in, major_out, tp)
        if major_in[0] != layout.dim:
            merged = _merged_into_period(layout, src, dst, major_in, major_out, tp)
            return merged or _strided_shard(layout, src, dst, major_in, major_out, tp)
        out_dim = major_out[0]
        identity = len(major_in) == 1 and len(major_out) == 1
        if identity:
            return Shard(out_dim, layout.blocks) if dst.shardable(out_dim, tp, layout.blocks) \
                else None
        if isinstance(layout.blocks, Period):
            return _strided_shard(layout, src, dst, major_in, major_out, tp)
        # k equal blocks split into (k, n, ...): the blocks become the leading dim and each
        # block's slice is a slice of n (timm's qkv.reshape(B, N, 3, nh, hs): the heads;
        # torch's attention's proj.unflatten(-1, (3, h)): the features, whose later view
        # into heads keeps the shard only where it holds whole heads).
        blocks = layout.blocks
        if isinstance(blocks, int) and blocks > 1 and len(major_in) == 1 and \
                len(major_out) >= 2 and dst.static(out_dim) == blocks:
            inner = major_out[1]
            return Shard(inner) if dst.shardable(inner, tp) else None
        # a blocked dim split into (major, minor) keeps its blocks on the major dim when every
        # segment is whole rows of it (Falcon's q|k|v viewed as heads + 2 heads)
        aligned = len(major_in) == 1 and isinstance(dst.static(out_dim), int) and \
            dst.static(out_dim) % block_units(layout.blocks) == 0
        if (layout.blocks == 1 or aligned) and dst.shardable(out_dim, tp, layout.blocks):
            return Shard(out_dim, layout.blocks)
        if isinstance(blocks, int) and blocks > 1:  # equal segments merged: as a period
            return _strided_shard(layout, src, dst, major_in, major_out, tp)
        return None
    return None


def _sequence_rows(layout: Shard, src: TensorMeta, dst: TensorMeta,
                   major_in: list[int], major_out: list[int], tp: int) -> Optional[Shard]:
    """Batch x sequence rows (a period of the sequence's symbolic length) kept as they are,
    or split back: the sequence dim holds the shard again."""
    assert isinstance(layout.blocks, Period)
    if major_in[0] != layout.dim:
        return None
    out_dim, last = major_out[0], major_out[-1]
    if len(major_in) == 1 and len(major_out) == 1:
        return Shard(out_dim, layout.blocks) if dst.shardable(out_dim, tp, layout.blocks) \
            else None
    if len(major_in) == 1 and str(_expr(dst.shape[last])) == layout.blocks.length:
        return Shard(last) if dst.shardable(last, tp) else None
    return None


def _merged_sequences(layout: Shard, src: TensorMeta, dst: TensorMeta,
                      major_in: list[int], major_out: list[int], tp: int) -> Optional[Shard]:
    """A split sequence merged after the batch (``logits.view(-1, vocab)`` with the sequence
    split by context parallelism): each batch index holds one sequence, split across the
    ranks, the rows of each rank's shard in order (the local view of [B, T / cp] is
    [B * T / cp]). A period of the sequence's symbolic length."""
    if layout.blocks != 1 or src.shape[layout.dim] not in src.split or \
            major_in[-1] != layout.dim or len(major_out) != 1:
        return None
    period = Period(str(_expr(src.shape[layout.dim])))
    return Shard(major_out[0], period) if dst.shardable(major_out[0], tp, period) else None


def _merged_into_period(layout: Shard, src: TensorMeta, dst: TensorMeta,
                        major_in: list[int], major_out: list[int], tp: int) -> Optional[Shard]:
    """A sharded dim merged after outer dims (Bloom's [B, H, T, D] -> [B*H, T, D] with heads
    sharded): every outer index holds one segment of the sharded dim times the static dims
    after it, sliced across the ranks; a sequence split by context parallelism merged after
    the batch is a period of its symbolic length."""
    sequences = _merged_sequences(layout, src, dst, major_in, major_out, tp)
    if sequences is not None:
        return sequences
    inner = _static_product(src, major_in[major_in.index(layout.dim):])
    if layout.blocks != 1 or len(major_out) != 1 or inner is None or inner < 2:
        return None
    return _segments(dst, major_out[0], inner, tp)


def _whole(expr: sympy.Expr) -> bool:
    """Whether a size ratio is a whole number for every value of its symbols."""
    numerator, denominator = sympy.fraction(sympy.cancel(expr))
    return denominator == 1 and bool(numerator.is_integer) and bool(numerator.is_positive)


def _segment(layout: Shard, meta: TensorMeta) -> Optional[sympy.Expr]:
    """The length of the segments the ranks each slice: the whole dim for a plain shard, a
    period's length, a k-th of a static dim in k equal blocks."""
    blocks, size = layout.blocks, _expr(meta.shape[layout.dim])
    if blocks == 1:
        return size
    if isinstance(blocks, Period):
        return None if blocks.symbolic else sympy.Integer(blocks.length)
    if isinstance(blocks, int) and isinstance(meta.static(layout.dim), int):
        return sympy.Integer(meta.static(layout.dim) // blocks)
    return None


def _strided_shard(layout: Shard, src: TensorMeta, dst: TensorMeta,
                   major_in: list[int], major_out: list[int], tp: int) -> Optional[Shard]:
    """A shard of any dim of a group, found among the group's output dims by strides.

    In the group's flat index one segment of the sharded dim spans ``extent`` (its length
    times the sizes after it) and each rank one ``extent / tp`` of it. The output dim that
    holds the shard is the innermost whose stride divides a rank's span and whose size is a
    whole number of spans: each run of ``extent / stride`` of its indices is one segment,
    split across the ranks (fairseq's ``[T, B, h] -> [T, B*heads, d]``: heads sharded inside
    the batch and heads dim, a segment of ``heads`` per batch index; whole heads when tp
    divides heads). A periodic shard is the same with one segment as the extent (torch's
    attention ``[T, B*heads, d] -> [T*B, h]``: heads sharded again, in the features; and
    ``[T, B*heads, d] -> [T, B*h]``: segments of h)."""
    extent = _segment(layout, src)
    if extent is None:
        return None
    for d in major_in[major_in.index(layout.dim) + 1:]:
        extent = extent * _expr(src.shape[d])
    stride = sympy.Integer(1)
    for out_dim in reversed(major_out):
        size = _expr(dst.shape[out_dim])
        if _whole(extent / (tp * stride)) and _whole(size * stride / extent):
            segment = sympy.cancel(extent / stride)
            if sympy.simplify(segment - size) == 0:
                return Shard(out_dim) if dst.shardable(out_dim, tp) else None
            if not segment.is_Integer or int(segment) < 2:
                return None
            return _segments(dst, out_dim, int(segment), tp)
        stride = stride * size
    return None


def _segments(meta: TensorMeta, dim: int, length: int, tp: int) -> Optional[Shard]:
    """A shard of ``dim`` in segments of ``length``: a period where the size is symbolic,
    its count of blocks where it is static (the same layout: ``S(1)%4`` of [T, 8, d] is
    ``S(1)x2``)."""
    size = meta.static(dim)
    if size is None:
        layout = Shard(dim, Period(length))
    elif size % length:
        return None
    else:
        layout = Shard(dim, size // length)
    return layout if meta.shardable(dim, tp, layout.blocks) else None


def _static_product(meta: TensorMeta, dims: Sequence[int]) -> Optional[int]:
    """The product of these dims' sizes, or None if one is symbolic."""
    sizes = [meta.static(d) for d in dims]
    return None if None in sizes else math.prod(s for s in sizes if s is not None)


def view_segmentations(from_shape: Sequence[Any], to_shape: Sequence[Any],
                       known: Iterable[Blocks] = (1,)) -> set[Period]:
    """The periods a shard of either side of a reshape, in one of the ``known``
    segmentations, takes on the other side: the segmentations of a symbolic dim a plan
    should consider for the values around it ([T, B, h] -> [T, B*heads, d]: segments of
    heads, whichever way the code folds them). Any tp: found at tp 1, where every
    segmentation that holds at some tp holds. (Blocks of a static dim are left out: a
    head's slice merged into the features is 'heads' blocks, a layout no plan wants.)"""
    shapes = (tuple(_expr(s) for s in from_shape), tuple(_expr(s) for s in to_shape))
    return set(_segmentations(*shapes, frozenset(known)))


@functools.lru_cache(maxsize=4096)
def _segmentations(src_shape: tuple, dst_shape: tuple, known: frozenset) -> frozenset:
    groups, _ = _around(src_shape, dst_shape)
    if not any(_mixed([src_shape[d] for d in ins] + [dst_shape[d] for d in outs])
               for ins, outs in groups):
        return frozenset()  # a period needs static sizes grouped with a symbolic one
    src, dst = TensorMeta(src_shape, torch.float32), TensorMeta(dst_shape, torch.float32)
    out = set()
    for a, b in ((src, dst), (dst, src)):
        for dim in range(a.ndim):
            for blocks in known:
                if a.shardable(dim, 1, blocks):
                    mapped = map_shard_through_view(Shard(dim, blocks), a, b, 1)
                    if mapped is not None and isinstance(mapped.blocks, Period):
                        out.add(mapped.blocks)
    return frozenset(out)


def _mixed(sizes: list[sympy.Expr]) -> bool:
    return any(not s.is_Integer for s in sizes) and any(s.is_Integer and s > 1 for s in sizes)
