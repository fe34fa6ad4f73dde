"""Context parallelism's attention: the sequence sharded over a group of cp ranks, attention
computed exactly across the shards, forward and backward.

Token layout (``SequenceLayout``). The sequence is cut into chunks and each rank holds some of
them, in order. Contiguous: cp chunks, rank r holds chunk r. Balanced (for causal attention):
2 cp chunks, rank r holds chunks r and 2 cp - 1 - r, so that every rank has the same number of
(query, key) pairs under the causal mask. ``positions(rank)`` gives the global positions of
a rank's tokens (what rotary tables and position embeddings read); ``shard`` and ``unshard``
move a tensor between the global order and the ranks' shards.

Two ways to attend across the shards:

- ``ulysses_attention``: an all-to-all turns the sequence shards of q, k and v into head
  shards (each rank: every token, 1/cp of the heads), attention runs whole on them, and a
  second all-to-all turns the output back. The query and key/value heads must divide by cp.
  Each rank sends (cp - 1)/cp of q, k, v and the output each way.
- ``ring_attention``: each rank keeps its queries; the key/value blocks pass around the ring
  (cp - 1 shifts) and the partial results are merged by their log-sum-exp (the online
  softmax). Any head count. Backward passes the blocks around again, each block's gradient
  accumulator one step behind it, home after cp shifts. Every shift is begun before the
  step's products and awaited after them, so the transfer overlaps the compute. A pair of
  chunks that the mask hides entirely (the future under a causal mask, what lies beyond a
  sliding window) is skipped.

``attention_strategy`` (from ``autotp.planner.cost``, where the plan applies it) picks one by
the bytes each sends and says why.

Masks are given by positions, never as an [S, S] tensor: ``causal``; ``window`` (with causal,
a query at position p sees the keys at p - window < position <= p); ``key_mask`` ([b, S] in
the global order, True where a key is a real token: padding). A model's own mask arrives
as ``attn_mask``: its rows for this rank's queries, or (``BlockMask``) as the elementwise
program that makes it from vectors of positions, evaluated for each block of queries and
keys the ring meets, so that no [s/cp, S] tensor is held. Either way the pairs of chunks
it hides are skipped, and the pairs it keeps whole need no mask. A query that no key is
left for gets zeros and passes no gradient.

The ring computes in float32 (or the inputs' dtype where wider), autocast or not, and saves
its output and log-sum-exp for backward, which recomputes each pair's scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from autotp.errors import ConfigError
from autotp.planner.masks import MaskRegion, unsqueezed_dim
from autotp.planner.cost import attention_strategy  # noqa: F401 (re-exported)
from autotp.runtime.comm import Communicator

aten = torch.ops.aten


@dataclass(frozen=True)
class SequenceLayout:
    cp: int
    balanced: bool  # 2 cp chunks, rank r holds r and 2 cp - 1 - r

    @property
    def chunks(self) -> int:
        return 2 * self.cp if self.balanced else self.cp

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.cp - 1 - rank) if self.balanced else (rank,)

    def check(self, length: int) -> None:
        if length % self.chunks:
            how = (f"causal attention at cp={self.cp} cuts it into 2 x cp = {self.chunks} "
                   "chunks, two per rank" if self.balanced
                   else f"cp={self.cp} cuts it into {self.chunks} chunks")
            raise ConfigError(
                f"sequence length {length} does not divide by {self.chunks}: {how}; pad the "
                f"sequence to a multiple of {self.chunks} (or choose a cp that divides it)")

    def positions(self, rank: int, length: int,
                  device: Optional[torch.device] = None) -> torch.Tensor:
        """The global positions of ``rank``'s tokens in a sequence of ``length``."""
        self.check(length)
        size = length // self.chunks
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                          for c in self.chunks_of(rank)])

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        return x.index_select(dim, self.positions(rank, x.shape[dim], x.device))

    def unshard(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's shard (in rank order) -> the tensor in the global order."""
        joined = torch.cat(shards, dim=dim)
        return joined.index_select(dim, self._to_global(joined.shape[dim], joined.device))

    def _rank_order(self, length: int, device: Optional[torch.device]) -> torch.Tensor:
        """The global positions of the ranks' tokens laid end to end, rank after rank."""
        return torch.cat([self.positions(r, length, device) for r in range(self.cp)])

    def _to_global(self, length: int, device: Optional[torch.device]) -> torch.Tensor:
        return torch.argsort(self._rank_order(length, device))


# ---- the mask of one pair of chunks -----------------------------------------------------------


@dataclass(frozen=True)
class _Mask:
    causal: bool
    window: Optional[int]

    def of(self, qpos: torch.Tensor, kpos: torch.Tensor) -> Optional[torch.Tensor]:
        """[sq, sk] True where a query may see a key; None where it may see every key."""
        if not self.causal:
            return None
        allowed = kpos[None, :] <= qpos[:, None]
        if self.window is not None:
            allowed &= qpos[:, None] - kpos[None, :] < self.window
        return allowed

    def hides(self, qpos: torch.Tensor, kpos: torch.Tensor) -> bool:
        """Whether no query of the chunk sees any key of the other (by their ranges alone)."""
        if not self.causal:
            return False
        q_lo, q_hi, k_lo, k_hi = int(qpos[0]), int(qpos[-1]), int(kpos[0]), int(kpos[-1])
        if k_lo > q_hi:  # every key in every query's future
            return True
        return self.window is not None and q_lo - k_hi >= self.window


def _broadcast_to_rank(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``expand`` in a mask's program: the same elements, size-1 dims left to broadcast."""
    return x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape)) if x.dim() < ndim else x


class MaskProgram(nn.Module):
    """An attention mask's elementwise ops (``planner.masks.MaskRegion``) as a program of
    their factors: ``bind`` it to the factors' values, and each block of the mask is the
    program run on those rows and columns of them."""

    def __init__(self, region: MaskRegion):
        super().__init__()
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {f: graph.placeholder(f"factor_{i}")
                                       for i, f in enumerate(region.factors)}
        for node in region.nodes:
            source = cast(fx.Node, node.args[0]) if node.args else node
            if node.target == aten.expand.default:
                env[node] = graph.call_function(_broadcast_to_rank,
                                                (env[source], node.meta["val"].dim()))
            elif node.target in (aten.slice.Tensor, aten.alias.default):  # whole: the same
                env[node] = env[source]
            elif node.target == aten.unsqueeze.default:
                env[node] = graph.call_function(aten.unsqueeze.default,
                                                (env[source], unsqueezed_dim(node)))
            else:
                env[node] = graph.node_copy(node, lambda a: env[a])
        graph.output(env[region.nodes[-1]])
        self.program = fx.GraphModule(nn.Module(), graph)
        self.memo: Optional[tuple[list[Any], Any, list[list[int]]]] = None

    def bind(self, factors: tuple, queries: int, length: int) -> "BlockMask":
        return BlockMask(self, tuple(factors), queries, length)


@dataclass(frozen=True)
class BlockMask:
    """A mask program bound to its factors: ``queries`` this rank's rows, ``length`` every
    key; ``keys``: a key padding mask ([b, S], True: a real token) to apply as well."""
    program: MaskProgram
    factors: tuple
    queries: int
    length: int
    keys: Optional[torch.Tensor] = None

    def block(self, rows: slice, columns: torch.Tensor) -> torch.Tensor:
        """[b|1, h|1, rows|1, columns] of the mask: rows of this rank's queries, columns the
        global positions of some keys."""
        args = []
        for f in self.factors:
            if isinstance(f, torch.Tensor) and f.dim() >= 1:
                if f.shape[-1] != 1:
                    if f.shape[-1] != self.length:
                        raise ConfigError(f"a mask operand of shape {list(f.shape)} has "
                                          f"neither 1 nor all {self.length} keys last")
                    f = f.index_select(-1, columns.to(f.device))
                if f.dim() >= 2 and f.shape[-2] != 1:
                    if f.shape[-2] != self.queries:
                        raise ConfigError(f"a mask operand of shape {list(f.shape)} has "
                                          f"neither 1 nor this rank's {self.queries} queries "
                                          "second to last")
                    f = f[..., rows, :]
            args.append(f)
        out = self.program.program(*args)
        out = _broadcast_to_rank(out, 4)
        if self.keys is not None:
            keys = self.keys.to(out.device, torch.bool)[:, None, None, :].index_select(
                3, columns.to(out.device))
            out = out & keys if out.dtype == torch.bool else out.masked_fill(~keys,
                                                                            float("-inf"))
        return out

    def grid(self, chunks: int, layout: "SequenceLayout") -> list[list[int]]:
        """``_live_pairs``'s grid, from the program run on each pair of chunks (once for all
        the attentions reading the same factors: a model's layers share one mask)."""
        memo = self.program.memo
        key = (chunks, layout, self.queries, self.length)
        if memo is not None and memo[1] == key and _same(memo[0], [*self.factors, self.keys]):
            return memo[2]
        size, width = self.queries // chunks, self.length // layout.chunks
        batch = max((f.shape[0] for f in self.factors
                     if isinstance(f, torch.Tensor) and f.dim() >= 3), default=1)
        tile = max(1, min(size, TILE_BYTES // (8 * batch * width)))  # int64 operands at most
        marks = []
        for qi in range(chunks):
            for kc in range(layout.chunks):
                columns = torch.arange(kc * width, (kc + 1) * width)
                tiles = [_mark(self.block(slice(qi * size + start,
                                                qi * size + min(size, start + tile)), columns))
                         for start in range(0, size, tile)]
                # kept somewhere if any tile keeps some; whole if every tile is whole
                marks.append(torch.stack(tiles).clamp(max=1).amax() +
                             (torch.stack(tiles) == WHOLE).all().long())
        flat = torch.stack(marks).tolist()
        grid = [flat[i * layout.chunks:(i + 1) * layout.chunks] for i in range(chunks)]
        self.program.memo = ([x.clone() if isinstance(x, torch.Tensor) else x
                              for x in (*self.factors, self.keys)], key, grid)
        return grid


def _same(kept: list[Any], now: list[Any]) -> bool:
    if len(kept) != len(now):
        return False
    for a, b in zip(kept, now):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or \
                    not torch.equal(a, b):
                return False
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return False
    return True


HIDDEN, PARTIAL, WHOLE = 0, 1, 2  # what a mask keeps of a pair of chunks: none, some, all


def _mark(mask: torch.Tensor) -> torch.Tensor:
    """HIDDEN, PARTIAL or WHOLE for one block of a mask (boolean, or additive: 0 kept as it
    is, -inf hidden)."""
    kept = mask if mask.dtype == torch.bool else mask > float("-inf")
    plain = kept if mask.dtype == torch.bool else mask == 0
    return kept.any().long() + (kept & plain).all().long()


def _pieces(positions: torch.Tensor, chunks: int) -> list[tuple[slice, torch.Tensor]]:
    """A rank's tokens as its chunks: (slice of the local sequence, their global positions)."""
    size = positions.numel() // chunks
    return [(slice(i * size, (i + 1) * size), positions[i * size:(i + 1) * size])
            for i in range(chunks)]


TILE_BYTES = 1 << 28  # the float32 scores of one tile of queries against a key chunk


def _pairs(mask: _Mask, qpos: torch.Tensor, kpos: torch.Tensor, chunks: int,
           live: Optional[list[list[int]]] = None, kchunks: tuple[int, ...] = (),
           per_row: int = 0) -> Iterator[tuple[slice, slice, Optional[torch.Tensor], bool]]:
    """This rank's query chunks against one block's key chunks, but the pairs the mask
    hides: by positions (``mask``), or where an explicit mask keeps nothing (``live``:
    query chunk x global key chunk, ``kchunks``: the block's chunks). The last of each:
    whether the explicit mask keeps part of the pair (it must be applied). ``per_row``: the
    bytes of one query row's float32 scores against one key chunk (all heads): each query
    chunk goes in tiles of rows whose scores take at most ``TILE_BYTES``, so that a long
    sequence's pair of chunks is never one [s/2cp, s/2cp] block per head."""
    for qi, (qs, qp) in enumerate(_pieces(qpos, chunks)):
        for kj, (ks, kp) in enumerate(_pieces(kpos, chunks)):
            mark = WHOLE if live is None else live[qi][kchunks[kj]]
            if mask.hides(qp, kp) or mark == HIDDEN:
                continue
            rows = qs.stop - qs.start
            tile = max(1, min(rows, TILE_BYTES // per_row)) if per_row else rows
            for start in range(0, rows, tile):
                tqs = slice(qs.start + start, min(qs.stop, qs.start + start + tile))
                tqp = qp[start:start + tile]
                if tile == rows or not mask.hides(tqp, kp):
                    yield tqs, ks, mask.of(tqp, kp), mark == PARTIAL


def _live_pairs(extra: Any, chunks: int, layout: "SequenceLayout",
                length: int) -> Optional[list[list[int]]]:
    """What an explicit mask keeps of each (query chunk of this rank, global key chunk)
    pair, HIDDEN, PARTIAL or WHOLE, read in one transfer to the host per attention call:
    transformers' causal masks arrive as tensors or programs, and the pairs they hide are
    skipped as ``causal`` ones are."""
    if extra is None:
        return None
    if isinstance(extra, BlockMask):
        return extra.grid(chunks, layout)
    kept = extra if extra.dtype == torch.bool else extra > float("-inf")
    plain = kept if extra.dtype == torch.bool else extra == 0
    whole = (kept & plain).all(dim=1).all(dim=0)  # [sq|1, S]
    kept = kept.any(dim=1).any(dim=0)
    rows = kept.shape[0]
    per_query = chunks if rows > 1 else 1
    shape = (per_query, rows // per_query, layout.chunks, length // layout.chunks)
    marks = kept.reshape(shape).any(dim=3).any(dim=1).long() + \
        whole.reshape(shape).all(dim=3).all(dim=1).long()
    live = marks.tolist()
    return live * chunks if per_query == 1 else live


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: Optional[torch.Tensor],
            extra: Optional[torch.Tensor]) -> torch.Tensor:
    """q [b, h, sq, d] against k [b, h, sk, d] (at least float32), -inf where masked;
    ``extra``: a boolean mask (True: kept) or an additive one, [b|1, h|1, sq|1, sk]."""
    s = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
    if extra is not None:
        s = s.masked_fill(~extra, float("-inf")) if extra.dtype == torch.bool \
            else s + extra.to(s.dtype)
    return s


def _extra_mask(key_mask: Optional[torch.Tensor], attn_mask: Any,
                device: torch.device) -> Any:
    """The key padding and the explicit mask as one [b|1, h|1, sq|1, S] mask (columns in the
    global order): boolean, or additive where ``attn_mask`` is; or one ``BlockMask``."""
    if isinstance(attn_mask, BlockMask):
        return attn_mask if key_mask is None else replace(attn_mask, keys=key_mask)
    keys = key_mask.to(device, torch.bool)[:, None, None, :] if key_mask is not None else None
    if attn_mask is None:
        return keys
    mask = attn_mask.to(device)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        return mask if keys is None else mask & keys
    return mask if keys is None else mask.masked_fill(~keys, float("-inf"))


def _block(extra: Any, rows: slice, columns: torch.Tensor, partial: bool = True
           ) -> Optional[torch.Tensor]:
    """The part of the mask for some of this rank's queries and one block's keys (None
    where it keeps the whole pair)."""
    if extra is None or not partial:
        return None
    if isinstance(extra, BlockMask):
        return extra.block(rows, columns)
    part = extra if extra.shape[2] == 1 else extra[:, :, rows]
    return part.index_select(3, columns.to(extra.device))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """What the ring accumulates in: float32, or the inputs' dtype where wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand``: each key/value head sums its query heads' parts."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _send_around(comm: Communicator, tensors: list[torch.Tensor], phase: str,
                 label: str) -> Callable[[], list[torch.Tensor]]:
    """One shift of several tensors, as one message per dtype, begun now: what it returns
    waits for it and gives the tensors rank - 1 sent."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    started = []
    for indexes in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indexes])
        comm.log.record("shift", phase, None, flat.numel() * flat.element_size(), label)
        started.append((indexes, comm.start_shift(flat)))

    def finish() -> list[torch.Tensor]:
        out: list[Optional[torch.Tensor]] = [None] * len(tensors)
        for indexes, wait in started:
            got = wait()
            for i, part in zip(indexes, got.split([tensors[i].numel() for i in indexes])):
                out[i] = part.view(tensors[i].shape)
        return [t for t in out if t is not None]
    return finish


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator, layout: SequenceLayout, mask: _Mask,
                extra: Optional[torch.Tensor], scale: float, label: str) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # scores and merge in float32
            return _RingAttention._forward(ctx, q, k, v, comm, layout, mask, extra, scale,
                                           label)

    @staticmethod
    def _forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 comm: Communicator, layout: SequenceLayout, mask: _Mask,
                 extra: Optional[torch.Tensor], scale: float, label: str) -> torch.Tensor:
        b, hq, sq, d = q.shape
        groups = hq // k.shape[1]
        length = sq * layout.cp
        qpos = layout.positions(comm.rank, length)  # on the host: no device sync per pair
        chunks = len(layout.chunks_of(0))
        wide = torch.promote_types(q.dtype, torch.float32)
        top = q.new_full((b, hq, sq), float("-inf"), dtype=wide)  # running max
        total = q.new_zeros((b, hq, sq), dtype=wide)  # running sum of exp
        acc = q.new_zeros((b, hq, sq, v.shape[-1]), dtype=wide)
        live = ctx.live = _live_pairs(extra, chunks, layout, length)
        per_row = 4 * b * hq * (length // layout.chunks)
        block = [k, v]
        for step in range(layout.cp):
            # the next block travels while this one is computed
            coming = _send_around(comm, block, "forward", label) \
                if step < layout.cp - 1 else None
            source = (comm.rank - step) % layout.cp
            kpos = layout.positions(source, length)
            kb, vb = _expand(block[0], groups), _expand(block[1], groups)
            for qs, ks, allowed, partial in _pairs(mask, qpos, kpos, chunks, live,
                                                   layout.chunks_of(source), per_row):
                keys = _block(extra, qs, kpos[ks], partial)
                s = _scores(q[:, :, qs], kb[:, :, ks], scale, allowed, keys)
                new_top = torch.maximum(top[:, :, qs], s.amax(-1))
                safe = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
                p = torch.exp(s - safe[..., None])
                kept = torch.exp(top[:, :, qs] - safe)
                total[:, :, qs] = total[:, :, qs] * kept + p.sum(-1)
                acc[:, :, qs] = acc[:, :, qs] * kept[..., None] + \
                    torch.matmul(p, _wide(vb[:, :, ks]))
                top[:, :, qs] = new_top
            if coming is not None:
                block = coming()
        empty = total == 0  # a query no key is left for
        out = torch.where(empty[..., None], torch.zeros_like(acc),
                          acc / torch.where(empty, torch.ones_like(total), total)[..., None])
        lse = torch.where(empty, torch.full_like(top, float("inf")), top + torch.log(total))
        program = extra if isinstance(extra, BlockMask) else None
        ctx.save_for_backward(q, k, v, out, lse, None if program is not None else extra)
        ctx.setup = (comm, layout, mask, scale, label, program)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        with torch.autocast(grad.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, extra = ctx.saved_tensors
        comm, layout, mask, scale, label, program = ctx.setup
        extra = program if program is not None else extra
        b, hq, sq, d = q.shape
        groups = hq // k.shape[1]
        length = sq * layout.cp
        qpos = layout.positions(comm.rank, length)
        chunks = len(layout.chunks_of(0))
        live = ctx.live
        per_row = 4 * b * hq * (length // layout.chunks)
        do = _wide(grad)
        delta = (do * out).sum(-1)  # [b, hq, sq]
        dq = torch.zeros(q.shape, dtype=do.dtype, device=q.device)
        # Each block's gradient accumulator travels one step behind it: rank r adds its share
        # to the accumulator rank r - 1 sent after the step before, and sends it on; after
        # the last step it arrives home. Both shifts overlap the next step's products.
        block = [k, v]
        passing: Optional[Callable[[], list[torch.Tensor]]] = None  # the accumulator coming
        for step in range(layout.cp):
            coming = _send_around(comm, block, "backward", label) \
                if step < layout.cp - 1 else None
            source = (comm.rank - step) % layout.cp
            kpos = layout.positions(source, length)
            kb, vb = _wide(_expand(block[0], groups)), _wide(_expand(block[1], groups))
            dk = torch.zeros_like(kb)
            dv = torch.zeros_like(vb)
            for qs, ks, allowed, partial in _pairs(mask, qpos, kpos, chunks, live,
                                                   layout.chunks_of(source), per_row):
                keys = _block(extra, qs, kpos[ks], partial)
                s = _scores(q[:, :, qs], kb[:, :, ks], scale, allowed, keys)
                p = torch.exp(s - lse[:, :, qs, None])  # 0 where masked (and for empty rows)
                dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do[:, :, qs])
                dp = torch.matmul(do[:, :, qs], vb[:, :, ks].transpose(-1, -2))
                ds = p * (dp - delta[:, :, qs, None])
                dq[:, :, qs] += torch.matmul(ds, kb[:, :, ks]) * scale
                dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), _wide(q[:, :, qs])) * scale
            grads = [_fold(dk, groups), _fold(dv, groups)]
            if passing is not None:
                grads = [a + b for a, b in zip(passing(), grads)]
            passing = _send_around(comm, grads, "backward", label)
            if coming is not None:
                block = coming()
        assert passing is not None
        grads = passing()  # home after cp shifts
        return (dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype),
                None, None, None, None, None, None)


def _heads_of(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """[b, h, s/cp, d] sequence shard -> [b, h/cp, s, d] head shard, tokens in rank order."""
    cp = comm.world_size
    b, h, s, d = x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # block c -> rank c
    got = comm.all_to_all(blocks.reshape(cp, -1), [1] * cp, [1] * cp)
    return got.view(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _tokens_of(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_heads_of``."""
    cp = comm.world_size
    b, hc, s_all, d = x.shape
    s = s_all // cp
    blocks = x.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # tokens of rank c
    got = comm.all_to_all(blocks.reshape(cp, -1), [1] * cp, [1] * cp)
    return got.view(cp, b, hc, s, d).transpose(0, 1).reshape(b, cp * hc, s, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, to_heads: bool,
                label: str) -> torch.Tensor:
        ctx.setup = (comm, to_heads, label)
        comm.log.record("all_to_all", "forward", None, x.numel() * x.element_size(), label)
        return _heads_of(comm, x) if to_heads else _tokens_of(comm, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        comm, to_heads, label = ctx.setup
        comm.log.record("all_to_all", "backward", None, grad.numel() * grad.element_size(),
                        label)
        return (_tokens_of(comm, grad) if to_heads else _heads_of(comm, grad)), None, None, None


def _checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
             layout: SequenceLayout, causal: bool, window: Optional[int],
             key_mask: Optional[torch.Tensor]) -> None:
    if comm.world_size != layout.cp:
        raise ConfigError(f"cp={layout.cp} but the context-parallel group has "
                          f"{comm.world_size} ranks: give a group of cp ranks")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or \
            (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ConfigError(f"attention takes q, k, v as [batch, heads, tokens, head dim]; got "
                          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} "
                          "key/value heads")
    layout.check(q.shape[2] * layout.cp)
    if window is not None and (not causal or window < 1):
        raise ConfigError(f"window={window}: a sliding window needs causal=True and a window "
                          "of at least 1 (a query at position p sees the keys at "
                          "p - window < position <= p)")
    if key_mask is not None and tuple(key_mask.shape) != (q.shape[0], q.shape[2] * layout.cp):
        raise ConfigError(f"key_mask must be [batch, whole sequence] = "
                          f"{[q.shape[0], q.shape[2] * layout.cp]}, got {list(key_mask.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                   layout: SequenceLayout, *, causal: bool = False,
                   window: Optional[int] = None, key_mask: Optional[torch.Tensor] = None,
                   attn_mask: Any = None, scale: Optional[float] = None,
                   label: str = "ring") -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys and values: q [b, hq, s/cp, d],
    k and v [b, hk, s/cp, d] (hk dividing hq) as ``layout`` shards the sequence.
    ``attn_mask``: scaled_dot_product_attention's mask for this rank's queries (boolean, True
    where kept, or additive), broadcastable to [b, hq, s/cp, s]: its rows this rank's
    queries, its columns every key in the global order; or a ``BlockMask`` making it."""
    _checked(q, k, v, comm, layout, causal, window, key_mask)
    length = q.shape[2] * layout.cp
    if isinstance(attn_mask, BlockMask):
        if (attn_mask.queries, attn_mask.length) != (q.shape[2], length):
            raise ConfigError(f"the mask program is bound to {attn_mask.queries} queries of "
                              f"{attn_mask.length}, not this rank's {q.shape[2]} of {length}")
    elif attn_mask is not None and (attn_mask.shape[-1] != length or attn_mask.dim() < 2 or
                                    attn_mask.shape[-2] not in (1, q.shape[2])):
        raise ConfigError(f"attn_mask must have this rank's {q.shape[2]} queries (or 1) as "
                          f"rows and all {length} keys as columns; got "
                          f"{list(attn_mask.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    extra = _extra_mask(key_mask, attn_mask, q.device)
    out: torch.Tensor = _RingAttention.apply(q, k, v, comm, layout, _Mask(causal, window),
                                             extra, scale, label)
    return out


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      layout: SequenceLayout, *, causal: bool = False,
                      window: Optional[int] = None, key_mask: Optional[torch.Tensor] = None,
                      scale: Optional[float] = None, label: str = "ulysses") -> torch.Tensor:
    """As ``ring_attention``, by all-to-alls between sequence and head shards; the query and
    key/value heads divide by cp."""
    _checked(q, k, v, comm, layout, causal, window, key_mask)
    if q.shape[1] % layout.cp or k.shape[1] % layout.cp:
        raise ConfigError(
            f"Ulysses attention splits the heads over cp={layout.cp}: {q.shape[1]} query and "
            f"{k.shape[1]} key/value heads do not divide by it; use ring attention")
    length = q.shape[2] * layout.cp
    to_global = layout._to_global(length, q.device)
    qh, kh, vh = (_AllToAll.apply(x, comm, True, label).index_select(2, to_global)
                  for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if window is None and key_mask is None:  # SDPA's own causal path: no [S, S] mask
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
    else:  # a window or padding: the mask as a tensor
        positions = torch.arange(length, device=q.device)
        allowed = _Mask(causal, window).of(positions, positions)
        if key_mask is not None:
            keys = key_mask.to(q.device, torch.bool)[:, None, None, :]
            allowed = keys if allowed is None else allowed & keys
        assert allowed is not None
        # a query no key is left for gets zeros, as in ring_attention
        empty = ~allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed | empty,
                                             scale=scale, enable_gqa=gqa)
        out = out.masked_fill(empty, 0.0)
    back = _AllToAll.apply(out.index_select(2, layout._rank_order(length, q.device)), comm,
                           False, label)
    result: torch.Tensor = back
    return result


class RingAttention(nn.Module):
    """``aten.scaled_dot_product_attention`` of a rank program whose plan shards q, k and v
    along the sequence over the group (as ``comm.sequence`` lays it out: balanced, or
    contiguous where it is None): the same arguments, computed by ``ring_attention``. The
    mask arrives with this rank's query rows and every key column, or (``mask``: the program
    that makes it) as its factors, ``mask_factors``."""

    def __init__(self, comm: Communicator, label: str, mask: Optional[MaskProgram] = None):
        super().__init__()
        self.comm = comm
        self.label = label
        self.layout = comm.sequence or SequenceLayout(comm.world_size, balanced=False)
        self.mask = mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Any = None, dropout_p: float = 0.0,
                is_causal: bool = False, *, scale: Optional[float] = None,
                enable_gqa: bool = False, mask_factors: tuple = ()) -> torch.Tensor:
        if self.mask is not None:
            attn_mask = self.mask.bind(mask_factors, q.shape[2], q.shape[2] * self.layout.cp)
        if dropout_p:
            raise ConfigError(f"{self.label}: attention dropout (dropout_p={dropout_p}) under "
                              "context parallelism: put the model in eval mode or set the "
                              "attention dropout to 0")
        if attn_mask is not None and is_causal:
            raise ConfigError(f"{self.label}: attn_mask with is_causal=True")
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise ConfigError(f"{self.label}: {q.shape[1]} query and {k.shape[1]} key/value "
                              "heads without enable_gqa")
        return self.attend(q, k, v, attn_mask, is_causal, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: Any, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
        return ring_attention(q, k, v, self.comm, self.layout, causal=is_causal,
                              attn_mask=attn_mask, scale=scale, label=self.label)


class UlyssesAttention(RingAttention):
    """``aten.scaled_dot_product_attention`` with no mask tensor, of a rank program whose plan
    shards q, k and v along the sequence, computed by ``ulysses_attention`` (the plan picks
    it where its all-to-alls send fewer bytes than the ring: ``attention_strategy``)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: Any, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
        if attn_mask is not None:
            raise ConfigError(f"{self.label}: a mask tensor reached Ulysses attention, which "
                              "the plan gives only attention without one")
        return ulysses_attention(q, k, v, self.comm, self.layout, causal=is_causal,
                                 scale=scale, label=self.label)
