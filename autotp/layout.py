"""Layouts: how one global tensor is held across the ranks of a tensor-parallel group.

Layouts are plain, frozen data. Nothing here communicates; the rewriter acts on layouts.

    R      every rank holds the whole tensor, and its gradient is identical on every rank
    R*     every rank holds the whole tensor, but each rank's gradient is a partial sum:
           the value feeds a sharded computation (Megatron's ``f`` has been applied)
    S(d)   rank r holds the r-th of ``tp`` equal slices of dim ``d``
    S(d)x3 blocked: dim ``d`` is ``k = 3`` equal segments (fused q|k|v, gate|up), each
           sliced across the ranks; rank r holds slice r of every segment, concatenated
    S(d)x2:1:1  blocked into unequal segments in proportions 2:1:1 (a fused q|k|v with half
           as many k/v heads as query heads), each sliced across the ranks the same way
    S(d)x8:1*:1*  blocked, the starred segments held whole by every rank with a partial
           gradient, as R* is (multi-query attention's fused q|k|v: q sliced by heads, the
           single k/v head whole)
    S(d)%8 blocked into segments of 8 elements, as many as the (symbolic) size holds, each
           sliced across the ranks: heads sharded in a dim that merges batch and heads
           (Bloom's [B*H, T, D] attention), where the count of segments is the batch
    S(0)%s1  segments of a symbolic length: batch x sequence rows ([B*T, V]) with each
           sequence split across a context-parallel group, read where they are made
    S(0)@experts  rows routed to experts (sorted by expert): rank r holds the contiguous rows
           of the experts it owns, as many as the routing sends them, known only at run time
           (the experts' cumulative row counts give the bounds: autotp.runtime.routed_rows)
    P      every rank holds a tensor of the global shape; the global value is their sum
    P(lse) the global value is the log of the sum of the ranks' exponentials (a logsumexp
           over a sharded dim leaves one partial logsumexp per rank)

The gradient of a value with layout S(d) has layout S(d); that of P is replicated; that of R*
is partial. Keeping R-gradients identical on every rank is the invariant that lets the
rewriter place Megatron's ``f``/``g`` pairs from forward layouts alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch


@dataclass(frozen=True, order=True)
class Replicate:
    grad_partial: bool = False

    def __str__(self) -> str:
        return "R*" if self.grad_partial else "R"


@dataclass(frozen=True, order=True)
class Period:
    """Equal segments of ``length`` elements, however many the dim's size holds. ``length``
    may be a sequence size symbol's name (``"s1"``): a dim merging the batch with a sequence
    that context parallelism splits (``logits.view(-1, vocab)``), each sequence one segment.
    Such a layout is read where it is made (row by row, reduced to partial sums), never
    redistributed: its segments' size is known only to the program, not to a collective."""

    length: Union[int, str]

    def __post_init__(self) -> None:
        if isinstance(self.length, str):
            if not self.length.isidentifier():
                raise ValueError(f"Period.length must be an int or a symbol's name, got "
                                 f"{self.length!r}")
        elif self.length < 2:
            raise ValueError(f"Period.length must be >= 2, got {self.length}")

    @property
    def symbolic(self) -> bool:
        return isinstance(self.length, str)


@dataclass(frozen=True, order=True)
class Routed:
    """Rows split at run-time bounds: those routed to the experts each rank owns."""

    def __str__(self) -> str:
        return "experts"


ROUTED = Routed()

# Segments of a blocked dim: k equal ones (an int), or unequal ones in the given proportions
# (a tuple of at least two ints, coprime in absolute value, not all equal and positive), or
# equal ones of a given length (a Period: their count is a symbolic size, such as the batch).
# A negative proportion marks a segment every rank holds whole (with a partial gradient).
# Routed: not segments at all, a partition of the rows decided at run time.
Blocks = Union[int, tuple[int, ...], Period, Routed]


def counted(size: int, blocks: Blocks) -> Union[int, tuple[int, ...]]:
    """``blocks`` for a dim of this concrete size: a period becomes its count of segments."""
    if isinstance(blocks, Routed):
        raise TypeError("routed rows have run-time bounds: autotp.runtime.routed_rows slices them")
    if isinstance(blocks, Period):
        if isinstance(blocks.length, str):
            raise TypeError(f"segments of a symbolic length ({blocks.length}) are counted by "
                            "the program, not on a size")
        if size % blocks.length:
            raise ValueError(f"size {size} is not a whole number of segments of "
                             f"{blocks.length}")
        return size // blocks.length
    return blocks


def block_weights(blocks: Blocks) -> tuple[int, ...]:
    if isinstance(blocks, Routed):
        raise TypeError("routed rows have run-time bounds, not segments")
    if isinstance(blocks, Period):
        raise TypeError("a period's segments are counted on a concrete size: use counted()")
    return (1,) * blocks if isinstance(blocks, int) else tuple(abs(w) for w in blocks)


def whole_segments(blocks: Blocks) -> tuple[bool, ...]:
    """Per segment: held whole by every rank (not sliced)."""
    if isinstance(blocks, (Period, Routed)):
        return ()
    return (False,) * blocks if isinstance(blocks, int) else tuple(w < 0 for w in blocks)


def is_mixed(blocks: Blocks) -> bool:
    return any(whole_segments(blocks))


def block_units(blocks: Blocks) -> int:
    """How many equal units the segments make."""
    return sum(block_weights(blocks))


def segment_sizes(size: int, blocks: Blocks) -> list[int]:
    blocks = counted(size, blocks)
    unit = size // block_units(blocks)
    return [weight * unit for weight in block_weights(blocks)]


def smaller_whole(blocks: Blocks) -> Optional[Blocks]:
    """Unequal proportions with every segment smaller than the largest held whole (q sliced
    by heads, the k/v of multi-query attention whole); None for equal segments."""
    if isinstance(blocks, (int, Period, Routed)) or is_mixed(blocks):
        return None
    return tuple(-w if w < max(blocks) else w for w in blocks)


def divides(size: int, tp: int, blocks: Blocks) -> bool:
    """Whether a dim of ``size`` splits into the segments, each sliced one across tp."""
    if isinstance(blocks, Routed):
        return True  # any count of rows, in any proportions the routing gives
    if isinstance(blocks, Period):
        if isinstance(blocks.length, str):
            return False  # a concrete size says nothing of a symbolic segment
        return size % blocks.length == 0 and blocks.length % tp == 0
    units = block_units(blocks)
    if size % units:
        return False
    return all(whole or segment % tp == 0 for segment, whole in
               zip(segment_sizes(size, blocks), whole_segments(blocks)))


def local_segment_sizes(size: int, blocks: Blocks, tp: int) -> list[int]:
    """The segments' sizes on one rank, for a dim of global ``size`` (routed rows: the
    expected share under balanced routing, for memory estimates)."""
    if isinstance(blocks, Routed):
        return [-(-size // tp)]
    blocks = counted(size, blocks)
    return [segment if whole else segment // tp for segment, whole in
            zip(segment_sizes(size, blocks), whole_segments(blocks))]


def global_extent(local: int, blocks: Blocks, tp: int) -> int:
    """The global size of a dim that is ``local`` on one rank (inverse of the above)."""
    if isinstance(blocks, Routed):
        raise TypeError("routed rows have run-time bounds: the global size is not implied")
    if isinstance(blocks, Period):
        return local * tp
    weights, whole = block_weights(blocks), whole_segments(blocks)
    # local = unit / tp * (sliced weights + tp * whole weights)
    unit = local * tp // sum(w * (tp if h else 1) for w, h in zip(weights, whole))
    return unit * sum(weights)


def proportions(sizes: Sequence[int]) -> Blocks:
    """The ``blocks`` of segments of these sizes: their count if equal, else their ratios."""
    if len(set(sizes)) == 1:
        return len(sizes)
    common = math.gcd(*sizes)
    return tuple(size // common for size in sizes)


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: Blocks = 1

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be normalized (>= 0), got {self.dim}")
        if isinstance(self.blocks, Routed):
            if self.dim != 0:
                raise ValueError(f"routed rows are dim 0, got Shard.dim={self.dim}")
        elif isinstance(self.blocks, Period):
            pass
        elif isinstance(self.blocks, int):
            if self.blocks < 1:
                raise ValueError(f"Shard.blocks must be >= 1, got {self.blocks}")
        elif (len(self.blocks) < 2 or 0 in self.blocks or max(self.blocks) < 1
              or (min(self.blocks) > 0 and len(set(self.blocks)) == 1)
              or math.gcd(*self.blocks) != 1):
            raise ValueError(f"unequal Shard.blocks must be coprime proportions, not all "
                             f"equal, some positive, got {self.blocks}")

    def __lt__(self, other: "Shard") -> bool:
        return (self.dim, _order(self.blocks)) < (other.dim, _order(other.blocks))

    def __str__(self) -> str:
        if self.blocks == 1:
            return f"S({self.dim})"
        if isinstance(self.blocks, Period):
            return f"S({self.dim})%{self.blocks.length}"
        if isinstance(self.blocks, Routed):
            return f"S({self.dim})@{self.blocks}"
        if isinstance(self.blocks, int):
            return f"S({self.dim})x{self.blocks}"
        return f"S({self.dim})x" + ":".join(f"{-w}*" if w < 0 else str(w) for w in self.blocks)


def _order(blocks: Blocks) -> tuple:
    if isinstance(blocks, Routed):
        return (2, ())
    if isinstance(blocks, Period):
        return (1, (isinstance(blocks.length, str), str(blocks.length)))
    return (0, block_weights(blocks))


@dataclass(frozen=True, order=True)
class Partial:
    """The global value is ``reduce`` over the ranks' tensors: "sum" or "logsumexp"."""

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in PARTIAL_REDUCTIONS:
            raise ValueError(f"Partial.reduce must be one of {sorted(PARTIAL_REDUCTIONS)}, "
                             f"got {self.reduce!r}")

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({PARTIAL_REDUCTIONS[self.reduce]})"


PARTIAL_REDUCTIONS = {"sum": "sum", "logsumexp": "lse"}


Layout = Union[Replicate, Shard, Partial]

R = Replicate()
R_STAR = Replicate(grad_partial=True)
P = Partial()
P_LSE = Partial("logsumexp")


def is_replicated(layout: Layout) -> bool:
    return isinstance(layout, Replicate)


def parse_layout(text: str) -> Layout:
    """Inverse of ``str(layout)``: ``"R"``, ``"R*"``, ``"P"``, ``"S(2)"``, ``"S(1)x3"``,
    ``"S(0)%8"``, ``"S(0)@experts"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "R*":
        return R_STAR
    if text == "P":
        return P
    for reduce, short in PARTIAL_REDUCTIONS.items():
        if text == f"P({short})":
            return Partial(reduce)
    if text.startswith("S(") and ")" in text:
        dim_text, _, rest = text[2:].partition(")")
        blocks: Blocks = 1
        if rest.startswith("x"):
            parts = tuple(-int(p[:-1]) if p.endswith("*") else int(p)
                          for p in rest[1:].split(":"))
            blocks = parts[0] if len(parts) == 1 else parts
        elif rest.startswith("%"):
            blocks = Period(int(rest[1:]) if rest[1:].isdigit() else rest[1:])
        elif rest == f"@{ROUTED}":
            blocks = ROUTED
        return Shard(int(dim_text), blocks)
    raise ValueError(f"not a layout: {text!r}")


def local_size(global_size: int, tp: int) -> int:
    if global_size % tp:
        raise ValueError(f"size {global_size} is not divisible by tp={tp}")
    return global_size // tp


def local_shape(global_shape: Sequence[int], layout: Layout, tp: int) -> tuple[int, ...]:
    shape = list(global_shape)
    if isinstance(layout, Shard):
        if not divides(shape[layout.dim], tp, layout.blocks):
            raise ValueError(
                f"dim {layout.dim} of size {shape[layout.dim]} cannot be split into "
                f"{layout.blocks} block(s) x tp={tp}"
            )
        shape[layout.dim] = sum(local_segment_sizes(shape[layout.dim], layout.blocks, tp))
    return tuple(shape)


def whole_numel(global_shape: Sequence[int], layout: Shard) -> int:
    """Elements of the segments every rank holds whole (their gradients are partial)."""
    sizes = segment_sizes(global_shape[layout.dim], layout.blocks)
    rest = math.prod(global_shape) // global_shape[layout.dim]
    return rest * sum(size for size, whole in zip(sizes, whole_segments(layout.blocks))
                      if whole)


def whole_slices(local_size: int, blocks: Blocks, tp: int) -> list[tuple[int, int]]:
    """(start, length) on one rank of the segments it holds whole."""
    size = global_extent(local_size, blocks, tp)
    out, start = [], 0
    for length, whole in zip(local_segment_sizes(size, blocks, tp), whole_segments(blocks)):
        if whole:
            out.append((start, length))
        start += length
    return out


def shard_tensor(full: torch.Tensor, layout: Layout, rank: int, tp: int) -> torch.Tensor:
    """The piece of ``full`` that ``rank`` holds under ``layout`` (a copy for shards).

    For ``P`` rank 0 holds the value and the others hold zeros, so the sum is ``full``
    (``-inf`` for ``P(lse)``, so the logsumexp is ``full``).
    """
    if isinstance(layout, Replicate):
        return full
    if isinstance(layout, Partial):
        if rank == 0:
            return full
        return torch.full_like(full, -torch.inf) if layout.reduce == "logsumexp" \
            else torch.zeros_like(full)
    blocks = counted(full.shape[layout.dim], layout.blocks)
    segments = full.split(segment_sizes(full.shape[layout.dim], blocks), dim=layout.dim)
    pieces = [seg if whole else seg.chunk(tp, dim=layout.dim)[rank]
              for seg, whole in zip(segments, whole_segments(blocks))]
    return torch.cat(pieces, dim=layout.dim).contiguous()


def unshard_tensor(pieces: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """Reassemble the global tensor from every rank's piece (rank order)."""
    if isinstance(layout, Replicate):
        return pieces[0]
    if isinstance(layout, Partial):
        if layout.reduce == "logsumexp":
            return torch.logsumexp(torch.stack(list(pieces)), dim=0)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total = total + piece
        return total
    tp = len(pieces)
    size = global_extent(pieces[0].shape[layout.dim], layout.blocks, tp)
    blocks = counted(size, layout.blocks)
    local = local_segment_sizes(size, blocks, tp)
    per_rank = [piece.split(local, dim=layout.dim) for piece in pieces]
    segments = [
        per_rank[0][j] if whole else
        torch.cat([per_rank[r][j] for r in range(tp)], dim=layout.dim)
        for j, whole in enumerate(whole_segments(blocks))
    ]
    return torch.cat(segments, dim=layout.dim)
