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
  accumulator (in the inputs' dtype) one step behind it, home after cp shifts. Every shift
  is begun before the step's kernels and awaited after them, so the transfer overlaps the
  compute. A pair of
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

Each step of the ring is a few calls (``_step_calls``) of the device's fused attention
kernel in the inputs' dtype (``autotp.runtime.ring_kernels``: on the CPU the flash kernel, which
reads grouped key/value heads as they are; on CUDA flash or memory-efficient, given the
heads expanded once per step; float32 products where no kernel takes the call). Pairs of
chunks kept whole go without a mask, several in one call; a chunk against itself under a
plain causal mask with the kernel's ``is_causal``; the rest with their block of the mask,
built on the device from positions and the model's mask. The calls merge by their
log-sum-exp in float32; the ring saves its output (inputs' dtype) and log-sum-exp, and
backward calls each kernel's backward with them, which gives each call's share of dq, dk
and dv. Autocast changes nothing: the kernels run in the inputs' dtype.

What the ring does is decided from positions, host integers, and, for a model's mask, one
read of what it keeps of each pair of chunks (``_live_pairs``; once for all the layers of a
step where the mask is a program of the same factors): the ring reads no other tensor value
on the host.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from autotp.errors import ConfigError
from autotp.planner.cost import attention_strategy  # noqa: F401 (re-exported)
from autotp.runtime.block_mask import HIDDEN, PARTIAL, WHOLE, BlockMask, MaskProgram
from autotp.runtime.comm import Communicator, compiled_where_traceable, tracing
from autotp.runtime.ring_kernels import Call as KernelCall, Kernel, Merged, Summed, bias_of, \
    choose, mask_dtype, takes_groups
from autotp.runtime.ring_kernels import backward as kernel_backward
from autotp.runtime.ring_kernels import forward as kernel_forward

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
        return joined.index_select(dim, self.to_global(joined.shape[dim], joined.device))

    def rank_order(self, length: int, device: Optional[torch.device]) -> torch.Tensor:
        """The global positions of the ranks' tokens laid end to end, rank after rank."""
        return torch.cat([self.positions(r, length, device) for r in range(self.cp)])

    def to_global(self, length: int, device: Optional[torch.device]) -> torch.Tensor:
        """The inverse of ``rank_order``: where each global position sits among the ranks'
        tokens laid end to end."""
        return torch.argsort(self.rank_order(length, device))


def held_sequence(cp: int) -> Optional[SequenceLayout]:
    """How a context-parallel group of ``cp`` ranks holds the sequence: balanced, each rank
    two chunks of 2 x cp, head and tail (the same causal work on every rank); None at cp 1,
    where no group splits it."""
    return SequenceLayout(cp, balanced=True) if cp > 1 else None


# ---- what a mask keeps of a pair of chunks ---------------------------------------------------


@dataclass(frozen=True)
class _Mask:
    """The mask by positions: ``causal``, and with it ``window``. Runs of positions are given
    by their first and last (host integers), so that what a pair of chunks needs is decided
    without reading a tensor."""
    causal: bool
    window: Optional[int]

    def of(self, q_lo: int, rows: int, k_lo: int, keys: int,
           device: Optional[torch.device]) -> Optional[torch.Tensor]:
        """[rows, keys] True where a query (at q_lo, q_lo + 1, ...) may see a key (at k_lo,
        ...), built on ``device``; None where each may see every key."""
        if not self.causal:
            return None
        qpos = torch.arange(q_lo, q_lo + rows, device=device)[:, None]
        kpos = torch.arange(k_lo, k_lo + keys, device=device)[None, :]
        allowed = kpos <= qpos
        if self.window is not None:
            allowed &= qpos - kpos < self.window
        return allowed

    def hides(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether no query at q_lo..q_hi sees any key at k_lo..k_hi."""
        if not self.causal:
            return False
        return k_lo > q_hi or (self.window is not None and q_lo - k_hi >= self.window)

    def keeps(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether every query at q_lo..q_hi sees every key at k_lo..k_hi."""
        if not self.causal:
            return True
        return k_hi <= q_lo and (self.window is None or q_hi - k_lo < self.window)

    def diagonal(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether the queries and keys have the same positions and each query sees the keys
        up to its own: exactly the kernels' ``is_causal``."""
        return self.causal and (q_lo, q_hi) == (k_lo, k_hi) and \
            (self.window is None or q_hi - k_lo < self.window)


TILE_BYTES = 1 << 28  # the float32 scores (or mask) of one tile of queries against a key chunk


class _Cell(enum.Enum):
    """What a call needs for a pair of chunks, or a tile of one."""
    HIDDEN = "hidden"  # nothing kept: skipped
    WHOLE = "whole"  # every query sees every key: no mask
    CAUSAL = "causal"  # the same positions, exactly causal: the kernels' is_causal
    MASKED = "masked"  # some kept: the pair's mask, built for it


@dataclass(frozen=True)
class _Call:
    """One kernel call of a ring step: ``rows`` of this rank's queries against ``keys``, rows
    of the key block. A ``MASKED`` call's rows and keys are each one run of global positions
    from ``q_lo`` and ``k_lo``; ``explicit``: the model's mask applies to it. ``pairs``: the
    pairs of chunks it begins (a rank's work, counted)."""
    rows: slice
    keys: slice
    cell: _Cell
    q_lo: int = 0
    k_lo: int = 0
    explicit: bool = False
    pairs: int = 1


def _cell(mask: _Mask, q_lo: int, k_lo: int, rows: int, keys: int, mark: int) -> _Cell:
    """``mark``: what the model's mask keeps of the pair (HIDDEN, PARTIAL or WHOLE)."""
    q_hi, k_hi = q_lo + rows - 1, k_lo + keys - 1
    if mark == HIDDEN or mask.hides(q_lo, q_hi, k_lo, k_hi):
        return _Cell.HIDDEN
    if mark == WHOLE and mask.keeps(q_lo, q_hi, k_lo, k_hi):
        return _Cell.WHOLE
    if mark == WHOLE and mask.diagonal(q_lo, q_hi, k_lo, k_hi):
        return _Cell.CAUSAL
    return _Cell.MASKED


def _step_calls(mask: _Mask, layout: SequenceLayout, rank: int, source: int, length: int,
                live: Optional[list[list[int]]], per_row: int, fused: bool) -> list[_Call]:
    """The calls of one ring step: this rank's query chunks against the chunks of the block
    from ``source``, but the pairs nothing is kept of. With ``fused`` kernels (which hold no
    scores) consecutive query chunks whole against the same run of key chunks are one call,
    and each exactly causal pair (a chunk against itself) one causal call: on the CPU kernel
    three calls of a balanced rank's own block take less time than one causal call of it
    (measured: ``benchmarks/ring_kernels.py``). On ``Kernel.MATMUL`` each pair is a call.
    A masked pair (on MATMUL, every pair) goes in tiles of query rows whose float32 scores
    (or mask) take at most ``TILE_BYTES`` (``per_row``: one row's against one chunk, all
    heads), so that a long sequence's pair of chunks is never one [s/2cp, s/2cp] block per
    head."""
    size = length // layout.chunks
    qcs, kcs = layout.chunks_of(rank), layout.chunks_of(source)
    marks = [[WHOLE if live is None else live[qi][kc] for kc in kcs] for qi in range(len(qcs))]
    cells = [[_cell(mask, qc * size, kc * size, size, size, marks[qi][kj])
              for kj, kc in enumerate(kcs)] for qi, qc in enumerate(qcs)]
    calls = _whole_runs(cells, size) if fused else []
    for qi, qc in enumerate(qcs):
        for kj, kc in enumerate(kcs):
            cell = cells[qi][kj]
            if cell is _Cell.HIDDEN or (fused and cell is _Cell.WHOLE):
                continue
            if fused and cell is _Cell.CAUSAL:
                calls.append(_Call(slice(qi * size, (qi + 1) * size),
                                   slice(kj * size, (kj + 1) * size), cell))
                continue
            tile = max(1, min(size, TILE_BYTES // per_row))
            first = True
            for start in range(0, size, tile):
                rows = min(tile, size - start)
                part = _cell(mask, qc * size + start, kc * size, rows, size, marks[qi][kj])
                if part is not _Cell.HIDDEN:
                    calls.append(_Call(slice(qi * size + start, qi * size + start + rows),
                                       slice(kj * size, (kj + 1) * size), part,
                                       qc * size + start, kc * size,
                                       marks[qi][kj] == PARTIAL, int(first)))
                    first = False
    return calls


def _whole_runs(cells: list[list[_Cell]], size: int) -> list[_Call]:
    """The whole pairs as calls: consecutive query chunks whole against the same run of
    consecutive key chunks, one call (the chunks lie in order in the shard and the block)."""
    runs: list[tuple[int, int, int, int]] = []  # query chunks i0..i1 against key chunks j0..j1
    for i, row in enumerate(cells):
        whole = [j for j, cell in enumerate(row) if cell is _Cell.WHOLE]
        spans = [(whole[0], whole[-1])] if whole and whole[-1] - whole[0] + 1 == len(whole) \
            else [(j, j) for j in whole]
        for span in spans:
            if len(spans) == 1 and runs and runs[-1][1] == i - 1 and runs[-1][2:] == span:
                runs[-1] = (runs[-1][0], i, *span)
            else:
                runs.append((i, i, *span))
    return [_Call(slice(i0 * size, (i1 + 1) * size), slice(j0 * size, (j1 + 1) * size),
                  _Cell.WHOLE, pairs=(i1 - i0 + 1) * (j1 - j0 + 1))
            for i0, i1, j0, j1 in runs]


def _live_pairs(extra: Any, chunks: int, layout: "SequenceLayout", length: int,
                traced: bool = False) -> Optional[list[list[int]]]:
    """What an explicit mask keeps of each (query chunk of this rank, global key chunk)
    pair, HIDDEN, PARTIAL or WHOLE, read in one transfer to the host per attention call:
    transformers' causal masks arrive as tensors or programs, and the pairs they hide are
    skipped as ``causal`` ones are. ``traced``: torch.compile traces the call, and nothing is
    read on the host inside its graph (``BlockMask.traced_grid``; a mask tensor: every pair
    PARTIAL, its blocks applied as they are)."""
    if extra is None:
        return None
    if isinstance(extra, BlockMask):
        if traced:
            return extra.traced_grid(chunks, layout, TILE_BYTES)
        return extra.grid(chunks, layout, TILE_BYTES)
    if traced:
        return [[PARTIAL] * layout.chunks for _ in range(chunks)]
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


def _block(extra: Any, rows: slice, columns: slice) -> torch.Tensor:
    """The model's mask for some of this rank's queries and a run of keys' positions."""
    if isinstance(extra, BlockMask):
        return extra.block(rows, columns)
    part = extra if extra.shape[2] == 1 else extra[:, :, rows]
    return part[..., columns]


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


class _Expanded:
    """A key/value block with its heads repeated to the query heads, for the kernels that do
    not read grouped heads: made at most once per ring step, when a call first needs it."""

    def __init__(self, block: list[torch.Tensor], groups: int):
        self.block, self.groups = block, groups
        self.made: Optional[list[torch.Tensor]] = None

    def __call__(self) -> list[torch.Tensor]:
        if self.made is None:
            self.made = [_expand(t, self.groups) for t in self.block]
        return self.made


def _kernel_inputs(call: _Call, q: torch.Tensor, block: list[torch.Tensor],
                   expanded: _Expanded, mask: _Mask, extra: Any
                   ) -> tuple[Kernel, torch.Tensor, torch.Tensor, KernelCall, bool]:
    """The call's kernel, its keys and values, what it is asked besides, and whether it reads
    the key/value heads grouped (its dk and dv have the block's heads)."""
    masked = call.cell is _Cell.MASKED
    kernel = choose(q, block[0], block[1], masked)
    grouped = takes_groups(kernel) or expanded.groups == 1
    k, v = block if grouped else expanded()
    spec = KernelCall(causal=call.cell is _Cell.CAUSAL)
    if masked:
        rows, keys = call.rows.stop - call.rows.start, call.keys.stop - call.keys.start
        allowed = mask.of(call.q_lo, rows, call.k_lo, keys, q.device)
        part = _block(extra, call.rows, slice(call.k_lo, call.k_lo + keys)) \
            if call.explicit else None
        spec = bias_of(allowed, part, mask_dtype(kernel, q))
    return kernel, k[:, :, call.keys], v[:, :, call.keys], spec, grouped


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator, layout: SequenceLayout, mask: _Mask,
                extra: Optional[torch.Tensor], scale: float, label: str) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the kernels: the inputs' dtype
            return _RingAttention._forward(ctx, q, k, v, comm, layout, mask, extra, scale,
                                           label)

    @staticmethod
    def _forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 comm: Communicator, layout: SequenceLayout, mask: _Mask,
                 extra: Optional[torch.Tensor], scale: float, label: str) -> torch.Tensor:
        b, hq, sq, _ = q.shape
        length = sq * layout.cp
        live = _live_pairs(extra, len(layout.chunks_of(0)), layout, length, tracing(comm))
        fused = choose(q, k, v, False) is not Kernel.MATMUL
        per_row = 4 * b * hq * (length // layout.chunks)
        plan = [_step_calls(mask, layout, comm.rank, (comm.rank - step) % layout.cp, length,
                            live, per_row, fused) for step in range(layout.cp)]
        merged = Merged(q, v.shape[-1])
        aux: list[Any] = []
        block = [k, v]
        for step, calls in enumerate(plan):
            # the next block travels while this one is computed
            coming = _send_around(comm, block, "forward", label) \
                if step < layout.cp - 1 else None
            expanded = _Expanded(block, hq // k.shape[1])
            for call in calls:
                kernel, kb, vb, spec, _ = _kernel_inputs(call, q, block, expanded, mask, extra)
                out, lse, kept = kernel_forward(kernel, q[:, :, call.rows], kb, vb, spec, scale)
                merged.add(call.rows, out, lse)
                aux.append(kept)
            if coming is not None:
                block = coming()
        out, lse = merged.result(q.dtype, maybe_empty=extra is not None)
        program = extra if isinstance(extra, BlockMask) else None
        ctx.save_for_backward(q, k, v, out, lse, None if program is not None else extra)
        ctx.setup = (comm, layout, mask, scale, label, program, plan, aux)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        with torch.autocast(grad.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, extra = ctx.saved_tensors
        comm, layout, mask, scale, label, program, plan, aux = ctx.setup
        extra = program if program is not None else extra
        groups = q.shape[1] // k.shape[1]
        grad = grad.to(q.dtype)
        dq = Summed(q)
        kept = iter(aux)
        # Each block's gradient accumulator travels one step behind it: rank r adds its share
        # to the accumulator rank r - 1 sent after the step before, and sends it on; after
        # the last step it arrives home. Both shifts overlap the next step's kernels. Each
        # rank's share is summed in float32; the accumulator travels in the inputs' dtype.
        block = [k, v]
        passing: Optional[Callable[[], list[torch.Tensor]]] = None  # the accumulator coming
        for step, calls in enumerate(plan):
            coming = _send_around(comm, block, "backward", label) \
                if step < layout.cp - 1 else None
            expanded = _Expanded(block, groups)
            sums = [Summed(t) for t in block]
            for call in calls:
                kernel, kb, vb, spec, grouped = _kernel_inputs(call, q, block, expanded, mask,
                                                               extra)
                rows = call.rows
                dq_, dk_, dv_ = kernel_backward(kernel, grad[:, :, rows], q[:, :, rows], kb,
                                                vb, out[:, :, rows], lse[:, :, rows], spec,
                                                scale, next(kept))
                dq.add(rows, dq_)
                for acc, part in zip(sums, (dk_, dv_)):
                    acc.add(call.keys, part if grouped else _fold(part, groups))
            dkv = [acc.result() for acc in sums]
            if passing is not None:
                dkv = [a + b for a, b in zip(dkv, passing())]
            passing = _send_around(comm, [g.to(t.dtype) for g, t in zip(dkv, (k, v))],
                                   "backward", label)
            if coming is not None:
                block = coming()
        assert passing is not None
        dk, dv = passing()  # home after cp shifts
        return (dq.result().to(q.dtype), dk, dv,
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
    to_global = layout.to_global(length, q.device)
    qh, kh, vh = (_AllToAll.apply(x, comm, True, label).index_select(2, to_global)
                  for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if window is None and key_mask is None:  # SDPA's own causal path: no [S, S] mask
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
    else:  # a window or padding: the mask as a tensor
        allowed = _Mask(causal, window).of(0, length, 0, length, q.device)
        if key_mask is not None:
            keys = key_mask.to(q.device, torch.bool)[:, None, None, :]
            allowed = keys if allowed is None else allowed & keys
        assert allowed is not None
        # a query no key is left for gets zeros, as in ring_attention
        empty = ~allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed | empty,
                                             scale=scale, enable_gqa=gqa)
        out = out.masked_fill(empty, 0.0)
    back = _AllToAll.apply(out.index_select(2, layout.rank_order(length, q.device)), comm,
                           False, label)
    result: torch.Tensor = back
    return result


class RingAttention(nn.Module):
    """``aten.scaled_dot_product_attention`` of a rank program whose plan shards q, k and v
    along the sequence over the group (as ``sequence``, the rank program's, lays it out:
    balanced, or contiguous where it is None): the same arguments, computed by
    ``ring_attention``. The mask arrives with this rank's query rows and every key column,
    or (``mask``: the program that makes it) as its factors, ``mask_factors``."""

    def __init__(self, comm: Communicator, label: str, mask: Optional[MaskProgram] = None, *,
                 sequence: Optional[SequenceLayout] = None):
        super().__init__()
        self.comm = comm
        self.label = label
        self.layout = sequence or SequenceLayout(comm.world_size, balanced=False)
        self.mask = mask

    @compiled_where_traceable
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
