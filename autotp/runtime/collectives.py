"""Autograd-correct redistributions: each forward collective has its conjugate backward.

    R  -> R*   identity        | all-reduce      (Megatron's f)
    P  -> R    all-reduce      | identity        (Megatron's g)
    S  -> R    all-gather      | slice
    P  -> S    reduce-scatter  | all-gather      (sequence parallelism)
    P(lse) -> R  all-gather, logsumexp over ranks | g * exp(x_r - y), local
    ...        (the full table is ``autotp.planner.transitions``)

With sequence parallelism an all-gather along the sequence runs again in backward
(``Redistribute.regather``) for the ops that saved its output: they keep the shard
(``autotp.runtime.regather``).

All-reduces write into their operand where the program proves it is a fresh buffer that
nothing else reads (``reduce_in_place``): the forward sum of a product's partial output read
by this collective alone, the gradient of a value read only by products (whose input
gradients are fresh); everywhere else the communicator reduces a copy.

A sequence all-gather whose output only row-wise ops read, up to reduce-scatters back to the
same shard (an MLP), runs along dim 0, and so do those reduce-scatters (``gather_rows``): the
values between hold the ranks' rows end to end instead of interleaved along the sequence, and
no collective copies to interleave or part them.

The rewriter inserts one ``Redistribute`` module per (value, target layout). Parameters that
are replicated but read where their gradient is partial go through ``DeferredGradReduce``:
their gradient contributions are summed across ranks once, in one bucket, at the end of
backward (as Megatron does for sequence-parallel norm weights) instead of once per use.

Compiled (``compile=``): every module here is traced into the program's graphs, its
collectives the communicator's traceable ones (``autotp.runtime.comm``), its autograd.Function
forward and backward traced by dynamo. Three things differ from the eager program, none in
value: an all-reduce returns a new tensor (no in-place sum: functional collectives own their
outputs); a sequence all-gather's output is saved as the compiled graph's partitioner decides,
not as the shard (``ShardKeeper`` sees no tensor inside a graph); and a deferred parameter's
gradient is all-reduced at each use, inside autograd, as ``GradSync.PER_USE`` does (the
bucket's ``queue_callback`` runs Python after backward, which no graph holds): the same sum
over ranks, added up in another order, one all-reduce per use instead of one per step.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

from autotp.runtime.comm import Communicator, compiled_where_traceable, tracing
from autotp.layout import (
    Blocks,
    Layout,
    Partial,
    Replicate,
    Shard,
    counted,
    is_mixed,
    segment_sizes,
    shard_tensor,
    unshard_tensor,
)
from autotp.runtime.ring import SequenceLayout
from autotp.runtime.regather import ShardKeeper

# ---- blocked shards: reorder so that each rank's pieces are contiguous ----------------------


def _swap_groups(x: torch.Tensor, dim: int, outer: int, inner: int) -> torch.Tensor:
    """View ``dim`` as [outer, inner, piece] and swap outer and inner."""
    shape = list(x.shape)
    piece = shape[dim] // (outer * inner)
    y = x.reshape(*shape[:dim], outer, inner, piece, *shape[dim + 1:]).transpose(dim, dim + 1)
    return y.reshape(shape)


def sequence_order(sequence: Optional[SequenceLayout], layout: Layout
                   ) -> Optional[SequenceLayout]:
    """The token order of a context-parallel group whose ranks hold the sequence balanced
    (``sequence``, the rank program's: rank r the chunks r and 2 cp - 1 - r of 2 cp) where
    ``layout`` is a plain shard (under context parallelism every shard is along a
    sequence); else None."""
    if sequence is None or not sequence.balanced or not isinstance(layout, Shard) or \
            layout.blocks != 1:
        return None
    return sequence


def _rank_major(x: torch.Tensor, dim: int, blocks: Blocks, tp: int,
                order: Optional[SequenceLayout] = None) -> torch.Tensor:
    """[seg0 | seg1 | ...] of the global dim -> [rank0 pieces | rank1 pieces | ...];
    ``order``: a balanced sequence (``sequence_order``), its ranks' tokens end to end."""
    if order is not None:
        return x.index_select(dim, order.rank_order(x.shape[dim], x.device))
    blocks = counted(x.shape[dim], blocks)
    if blocks == 1:
        return x
    if isinstance(blocks, int):
        return _swap_groups(x, dim, blocks, tp)
    pieces = [seg.chunk(tp, dim=dim)
              for seg in x.split(segment_sizes(x.shape[dim], blocks), dim=dim)]
    return torch.cat([p[r] for r in range(tp) for p in pieces], dim=dim)


def _segment_major(x: torch.Tensor, dim: int, blocks: Blocks, tp: int,
                   order: Optional[SequenceLayout] = None) -> torch.Tensor:
    """Inverse of ``_rank_major``."""
    if order is not None:
        return x.index_select(dim, order.to_global(x.shape[dim], x.device))
    blocks = counted(x.shape[dim], blocks)
    if blocks == 1:
        return x
    if isinstance(blocks, int):
        return _swap_groups(x, dim, tp, blocks)
    per_rank = [chunk.split(segment_sizes(chunk.shape[dim], blocks), dim=dim)
                for chunk in x.chunk(tp, dim=dim)]
    return torch.cat([per_rank[r][j] for j in range(len(blocks)) for r in range(tp)], dim=dim)


def local_slice(x: torch.Tensor, layout: Shard, rank: int, tp: int,
                order: Optional[SequenceLayout] = None) -> torch.Tensor:
    if is_mixed(layout.blocks):
        return shard_tensor(x, layout, rank, tp)
    return _rank_major(x, layout.dim, layout.blocks, tp, order).chunk(tp, dim=layout.dim)[rank]


def gather(comm: Communicator, x: torch.Tensor, layout: Shard,
           sequence: Optional[SequenceLayout] = None) -> torch.Tensor:
    """The whole tensor of every rank's shard ``x``; ``sequence``: how the group holds the
    sequence, where the shards are its pieces (context parallelism)."""
    full = comm.all_gather(x.contiguous(), layout.dim)
    if is_mixed(layout.blocks):  # segments held whole: rank 0's copy of each
        return unshard_tensor(full.chunk(comm.world_size, dim=layout.dim), layout)
    return _segment_major(full, layout.dim, layout.blocks, comm.world_size,
                          sequence_order(sequence, layout))


def reduce_scatter(comm: Communicator, x: torch.Tensor, layout: Shard,
                   sequence: Optional[SequenceLayout] = None) -> torch.Tensor:
    ordered = _rank_major(x, layout.dim, layout.blocks, comm.world_size,
                          sequence_order(sequence, layout))
    return comm.reduce_scatter(ordered.contiguous(), layout.dim)


def zero_pad(x: torch.Tensor, layout: Shard, rank: int, tp: int,
             order: Optional[SequenceLayout] = None) -> torch.Tensor:
    """The full-size tensor holding ``x`` at this rank's position and zeros elsewhere."""
    shape = list(x.shape)
    shape[layout.dim] *= tp
    full = x.new_zeros(shape)
    full_ordered = _rank_major(full, layout.dim, layout.blocks, tp, order)
    full_ordered.narrow(layout.dim, rank * x.shape[layout.dim], x.shape[layout.dim]).copy_(x)
    return _segment_major(full_ordered, layout.dim, layout.blocks, tp, order)


# ---- the redistribution --------------------------------------------------------------------


class Redistribute(nn.Module):
    """Changes the layout of one value, with the conjugate collective in backward."""

    def __init__(self, comm: Communicator, src: Layout, dst: Layout, *, layer: Optional[int],
                 bwd_layer: Optional[int], label: str,
                 sequence: Optional[SequenceLayout] = None):
        super().__init__()
        self.comm = comm
        # context parallelism: how the group holds the sequence its shards are pieces of
        self.sequence = sequence
        self.src = src
        self.dst = dst
        self.layer = layer
        self.bwd_layer = bwd_layer
        self.label = label
        # a sequence all-gather: the keeper has saves of its output stored as the shard
        self.keeper: Optional[ShardKeeper] = None
        # all-reduces that may sum their operand in place (``reduce_in_place``): forward's
        # input, backward's incoming gradient
        self.reduce_in_place = False
        self.grad_in_place = False
        # a sequence gather or scatter along dim 0: the values between them hold the ranks'
        # rows end to end (``gather_rows``)
        self.rank_rows = False

    def extra_repr(self) -> str:
        rows = ", along dim 0 (rank-major rows)" if self.rank_rows else ""
        return f"{self.src} -> {self.dst}, {self.label}{rows}"

    def _moved(self, layout: Layout) -> Layout:
        """The layout its collectives run on: a shard of dim 0 where the rows are
        rank-major (``rank_rows``)."""
        return Shard(0) if self.rank_rows and isinstance(layout, Shard) else layout

    @compiled_where_traceable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.src, Partial) and self.src.reduce == "logsumexp":
            return _LogSumExpFn.apply(x, self)
        out = _RedistributeFn.apply(x, self)
        if self.keeper is not None and not tracing(self.comm):
            self.keeper.record(out, x, self)
        return out

    def regather(self, shard: torch.Tensor) -> torch.Tensor:
        """The forward all-gather of ``shard`` again, for a backward that reads its output."""
        src = self._moved(self.src)
        assert isinstance(src, Shard), self
        out = gather(self.comm, shard, src, self.sequence)
        self.comm.log.record("all_gather", "backward", self.layer,
                             out.numel() * out.element_size(), f"{self.label}, re-gathered")
        return out

    # forward and backward programs, by (src, dst) kind

    def run_forward(self, x: torch.Tensor) -> torch.Tensor:
        src, dst, comm, sequence = self._moved(self.src), self._moved(self.dst), self.comm, \
            self.sequence
        tp, rank = comm.world_size, comm.rank
        if isinstance(src, Partial) and src.reduce == "logsumexp":
            pieces = comm.all_gather(x.unsqueeze(0).contiguous(), 0)
            self._log("all_gather", "forward", pieces, pieces)
            return torch.logsumexp(pieces, dim=0)
        if isinstance(src, Replicate) and isinstance(dst, Replicate):
            return x.view_as(x)
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            return local_slice(x, dst, rank, tp, sequence_order(sequence, dst)).contiguous()
        if isinstance(src, Partial) and isinstance(dst, Replicate):
            own = self.reduce_in_place and not tracing(comm) and _owns_storage(x)
            return self._log("all_reduce", "forward", x, comm.all_reduce(x, in_place=own))
        if isinstance(src, Partial) and isinstance(dst, Shard):
            return self._log("reduce_scatter", "forward", x,
                             reduce_scatter(comm, x, dst, sequence))
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            out = gather(comm, x, src, sequence)
            return self._log("all_gather", "forward", out, out)
        raise AssertionError(f"no redistribution {src} -> {dst}")

    def run_backward(self, g: torch.Tensor) -> torch.Tensor:
        src, dst, comm, sequence = self._moved(self.src), self._moved(self.dst), self.comm, \
            self.sequence
        tp, rank = comm.world_size, comm.rank
        if isinstance(src, Replicate) and isinstance(dst, Replicate):
            if dst.grad_partial and not src.grad_partial:  # f: sum the partial gradients
                return self._log("all_reduce", "backward", g,
                                 comm.all_reduce(g, in_place=self.grad_in_place))
            if src.grad_partial and not dst.grad_partial:  # identical grads, counted once
                return g / tp
            return g
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            if src.grad_partial:
                return zero_pad(g, dst, rank, tp, sequence_order(sequence, dst))
            out = gather(comm, g, dst, sequence)
            return self._log("all_gather", "backward", out, out)
        if isinstance(src, Partial) and isinstance(dst, Replicate):
            if dst.grad_partial:
                return self._log("all_reduce", "backward", g,
                                 comm.all_reduce(g, in_place=self.grad_in_place))
            return g
        if isinstance(src, Partial) and isinstance(dst, Shard):
            out = gather(comm, g, dst, sequence)
            return self._log("all_gather", "backward", out, out)
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            if dst.grad_partial:
                return self._log("reduce_scatter", "backward", g,
                                 reduce_scatter(comm, g, src, sequence))
            return local_slice(g, src, rank, tp, sequence_order(sequence, src)).contiguous()
        raise AssertionError(f"no redistribution {src} -> {dst}")

    def _log(self, kind: str, phase: str, sized: torch.Tensor,
             result: torch.Tensor) -> torch.Tensor:
        layer = self.layer if phase == "forward" else self.bwd_layer
        nbytes = sized.numel() * sized.element_size()
        self.comm.log.record(kind, phase, layer, nbytes, self.label)
        return result


class _LogSumExpFn(torch.autograd.Function):
    """y = log sum_r exp(x_r): dy/dx_r = exp(x_r - y), known locally once y is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: Redistribute) -> torch.Tensor:
        y = module.run_forward(x)
        ctx.module = module
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        module = ctx.module
        x, y = ctx.saved_tensors
        if module.dst.grad_partial:
            g = module._log("all_reduce", "backward", g, module.comm.all_reduce(g))
        return g * torch.exp(x - y), None


class _RedistributeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: Redistribute) -> torch.Tensor:
        ctx.module = module
        out = module.run_forward(x)
        if out is x:  # summed in place: autograd takes the result as x's new history
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        return ctx.module.run_backward(g), None


# ---- in-place all-reduces ------------------------------------------------------------------

aten = torch.ops.aten
# ops whose output is a new buffer that their backward does not save: summed in place, no
# value autograd needs changes
_FRESH_OUTPUT = frozenset({
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten.baddbmm.default, aten.matmul.default, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Tensor, aten.div.Scalar, aten.masked_fill.Scalar, aten.sum.dim_IntList,
    aten.mean.dim})
# op -> the argument whose gradient is a new buffer (a product's input: g @ W^T)
_FRESH_INPUT_GRAD = {aten.linear.default: 0, aten.mm.default: 0, aten.matmul.default: 0,
                     aten.bmm.default: 0, aten.addmm.default: 1}


def reduce_in_place(graph: fx.Graph, root: nn.Module) -> int:
    """Let the all-reduces sum their own operand where the program shows that nothing else
    can see it (see the module docstring); returns how many may.

    Forward (P -> R): the operand is the output of an op in ``_FRESH_OUTPUT`` that only this
    collective reads. Backward (-> R*, gradient partial): every reader of the collective's
    output is a product reading it as its input (``_FRESH_INPUT_GRAD``), so the gradient
    arriving is a new buffer, or autograd's sum of such. Precondition: the program's ops are
    final (lowered, fused); postcondition: only ``Redistribute`` flags change."""
    count = 0
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        module = root.get_submodule(str(node.target))
        if not isinstance(module, Redistribute) or not node.args:
            continue
        x = node.args[0]
        if isinstance(module.src, Partial) and module.src.reduce != "logsumexp" and \
                isinstance(module.dst, Replicate) and isinstance(x, fx.Node) and \
                x.op == "call_function" and x.target in _FRESH_OUTPUT and \
                list(x.users) == [node]:
            module.reduce_in_place = True
            count += 1
        if isinstance(module.dst, Replicate) and module.dst.grad_partial and \
                not getattr(module.src, "grad_partial", False) and node.users and all(
                u.op == "call_function" and u.target in _FRESH_INPUT_GRAD
                and _only_at(u, node, _FRESH_INPUT_GRAD[u.target]) for u in node.users):
            module.grad_in_place = True
            count += 1
    return count


def _only_at(user: fx.Node, value: fx.Node, index: int) -> bool:
    """``user`` reads ``value`` as its argument ``index`` and nowhere else."""
    args = list(user.args) + list(user.kwargs.values())
    return len(user.args) > index and user.args[index] is value and \
        sum(1 for a in args if a is value) == 1


def _owns_storage(x: torch.Tensor) -> bool:
    """No view, no parameter: a buffer autograd lets an in-place write change."""
    return x._base is None and not (x.is_leaf and x.requires_grad)


# ---- rank-major rows: sequence collectives along dim 0 -------------------------------------

# ops that compute each position of the dims before the last alone (a product over the last
# dim, elementwise ops): permuting those positions permutes their outputs the same way
_ROW_WISE = frozenset({
    aten.linear.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.mul.Tensor,
    aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.add.Scalar,
    aten.div.Scalar, aten.to.dtype})


def gather_rows(graph: fx.Graph, root: nn.Module) -> dict[str, str]:
    """Run a sequence all-gather along dim 0 where only row-wise ops read its output, up to
    reduce-scatters back to the same shard (the MLP between the norm and the residual add);
    returns the program values that then hold rank-major rows, each named apart so that no
    check compares them with the unsharded model's.

    Along dim d >= 1 of [B, S/t, H] a gather interleaves the ranks' blocks (a copy), and the
    scatter reorders again. Along dim 0 it gives P x = [t B, S/t, H], rank r's rows at block
    r: row-wise ops f commute with the permutation (f(P x) = P f(x)), and block r of the
    reduce-scatter along dim 0 is rank r's own rows, its shard. Backward is the conjugate:
    gradients in the same rows, the weight gradients' sums over the rows in another order.
    Precondition: the program's ops are final (lowered, fused), no reader scoped yet
    (``scope_saves``); postcondition: only ``Redistribute.rank_rows`` flags change."""
    moved: dict[str, str] = {}
    for node in graph.nodes:
        gather = _sequence_gather(node, root)
        if gather is None:
            continue
        region = _row_region(node, root, gather)
        if region is None:
            continue
        values, exits = region
        gather.rank_rows = True
        for scatter in exits:
            scatter.rank_rows = True
        moved.update({v.name: f"{v.name} (rank-major rows)" for v in values if v is not node})
    return moved


def _sequence_gather(node: fx.Node, root: nn.Module) -> Optional[Redistribute]:
    """``node``'s all-gather of a plain shard along a dim after the first and before the
    last (a sequence; not context parallelism's, whose tokens have their own order)."""
    if node.op != "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    module = root.get_submodule(str(node.target))
    if not isinstance(module, Redistribute) or module.sequence is not None or \
            not isinstance(module.src, Shard) or not isinstance(module.dst, Replicate):
        return None
    ndim = getattr(node.args[0].meta.get("val"), "ndim", None)
    src = module.src
    if ndim is None or src.blocks != 1 or not 1 <= src.dim < ndim - 1:
        return None
    return module


def _row_region(node: fx.Node, root: nn.Module, gather: Redistribute
                ) -> Optional[tuple[set[fx.Node], list[Redistribute]]]:
    """The values read from ``node`` through row-wise ops alone, and the reduce-scatters back
    to ``gather``'s shard that end them; None where anything else reads one of them."""
    values, exits, stack = {node}, [], [node]
    while stack:
        value = stack.pop()
        for user in value.users:
            if user in values:
                continue
            if user.op == "call_module":
                scatter = root.get_submodule(str(user.target))
                if not isinstance(scatter, Redistribute) or \
                        not _scatters_back(scatter, gather) or user.args[0] is not value or \
                        any(a is value for a in user.args[1:]):
                    return None
                if scatter not in exits:
                    exits.append(scatter)
                continue
            if user.op != "call_function" or user.target not in _ROW_WISE:
                return None
            values.add(user)
            stack.append(user)
    for value in values - {node}:  # every tensor a row-wise op reads is a row of the region
        reads = [a for a in (*value.args, *value.kwargs.values()) if isinstance(a, fx.Node)]
        if value.target is aten.linear.default:  # the rows, then weights of no row
            if reads[0] not in values or any(a in values for a in reads[1:]):
                return None
        elif any(a not in values for a in reads):
            return None
    return (values, exits) if exits else None


def _scatters_back(module: Redistribute, gather: Redistribute) -> bool:
    """``module`` reduce-scatters a partial sum to the shard ``gather`` gathered."""
    return module.comm is gather.comm and \
        module.sequence is None and isinstance(module.src, Partial) and \
        module.src.reduce != "logsumexp" and module.dst == gather.src


# ---- deferred gradient reduction of replicated parameters ----------------------------------


class GradSync(enum.Enum):
    """How replicated parameters with partial gradients get their gradients summed.

    BUCKET: one all-reduce of all of them after backward, written into ``.grad`` (the fewest
    collectives; Megatron's choice for sequence-parallel norms). Not seen by autograd: use
    PER_USE with ``torch.autograd.grad`` or with DDP/FSDP wrapped around the sharded module.
    PER_USE: an all-reduce in backward at each use, inside autograd (Megatron's ``f`` on the
    parameter).
    """

    BUCKET = "bucket"
    PER_USE = "per_use"


class GradBucket:
    """Sums, across ranks, the partial gradients of replicated parameters after backward.

    Invariant: after each backward, ``param.grad`` of every registered parameter holds the
    sum over ranks of that backward's contributions (added to what it held before)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.params: dict[str, nn.Parameter] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.scheduled = False
        # parameters blocked with segments held whole (S(0)x8:1*:1*): only those segments'
        # gradients are partial; (dim, [(start, length)]) of this rank's tensor
        self.partial: dict[str, tuple[int, list[tuple[int, int]]]] = {}

    def add(self, key: str, grad: torch.Tensor) -> None:
        if key in self.pending:
            self.pending[key] = self.pending[key] + grad
        else:
            self.pending[key] = grad
        if not self.scheduled:
            self.scheduled = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        """The sums of this backward into ``.grad``: queued after backward by the first
        gradient to arrive, or called earlier by what reads the gradients at the end of the
        same backward (``runtime.grads.DataParallelMean``); the later call finds nothing."""
        if not self.scheduled:
            return
        self.scheduled = False
        keys = sorted(self.params)
        grads = {key: self.pending[key] if key in self.pending
                 else torch.zeros_like(self.params[key]) for key in keys}
        self.pending = {}
        summed = iter(_all_reduce_parts(self.comm, [
            part for key in keys for part in
            (_spans_of(grads[key], *self.partial[key]) if key in self.partial
             else [grads[key]])], "grad sync"))
        for key in keys:
            param = self.params[key]
            if key in self.partial:  # only the segments held whole were summed
                grad = grads[key].clone()
                for part in _spans_of(grad, *self.partial[key]):
                    part.copy_(next(summed))
            else:
                # a view of the all-reduced buffer, which holds these gradients alone (as
                # DDP's gradient_as_bucket_view): no copy
                grad = next(summed)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class DeferredGradReduce(nn.Module):
    """Identity forward; backward hands the partial gradient to the bucket."""

    per_use: nn.Module

    def __init__(self, bucket: GradBucket, key: str):
        super().__init__()
        self.bucket = bucket
        self.comm = bucket.comm
        self.key = key
        # the same sum at this use, inside autograd (``bucket.partial`` is set before this)
        label = f"grad sync {key}"
        per_use: nn.Module
        if key in bucket.partial:
            per_use = PartialSegmentsReduce(bucket.comm, *bucket.partial[key], label=label)
        else:
            per_use = Redistribute(bucket.comm, Replicate(), Replicate(grad_partial=True),
                                   layer=None, bwd_layer=None, label=label)
        object.__setattr__(self, "per_use", per_use)  # not a submodule: no state

    def extra_repr(self) -> str:
        return f"R -> R*, gradient summed after backward: {self.key}"

    @compiled_where_traceable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tracing(self.comm) or x is not self.bucket.params.get(self.key):
            # compiled: the bucket's callback after backward is no graph's (see the module
            # docstring). Or the program reads another tensor than the parameter registered:
            # a wrapper holds it (FSDP2 swaps in its unsharded parameter for the forward)
            # and reduces the gradient it gets through autograd. Either way the partial
            # gradient is summed at this use
            return self.per_use(x)
        return _DeferredFn.apply(x, self)


class PartialSegmentsReduce(nn.Module):
    """Identity forward; backward sums across ranks the gradient of the segments every rank
    holds whole (a parameter blocked as S(0)x8:1*:1*), at this use."""

    def __init__(self, comm: Communicator, dim: int, spans: list[tuple[int, int]], *,
                 label: str):
        super().__init__()
        self.comm, self.dim, self.spans, self.label = comm, dim, spans, label

    def extra_repr(self) -> str:
        return f"segments {self.spans} of dim {self.dim}: gradient all-reduced ({self.label})"

    @compiled_where_traceable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PartialSegmentsFn.apply(x, self)


class _PartialSegmentsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: PartialSegmentsReduce) -> torch.Tensor:
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        module = ctx.module
        g = g.clone()
        parts = _spans_of(g, module.dim, module.spans)
        for part, total in zip(parts, _all_reduce_parts(module.comm, parts, module.label)):
            part.copy_(total)
        return g, None


def _spans_of(grad: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [grad.narrow(dim, start, length) for start, length in spans]


def _all_reduce_parts(comm: Communicator, parts: list[torch.Tensor],
                      label: str) -> list[torch.Tensor]:
    """Each tensor summed across ranks, in one all-reduce: views of its flat result (a 1-D
    part, a norm's or a bias's gradient, is taken and given back as it is: no view op)."""
    flat = torch.cat([part if part.dim() == 1 else part.reshape(-1) for part in parts])
    total = comm.all_reduce(flat, in_place=True)  # cat's own buffer
    comm.log.record("all_reduce", "backward", None, flat.numel() * flat.element_size(), label)
    if len(parts) == 1 and parts[0].dim() == 1:
        return [total]
    return [piece if piece.shape == part.shape else piece.view_as(part)
            for piece, part in zip(total.split([part.numel() for part in parts]), parts)]


class _DeferredFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: DeferredGradReduce) -> torch.Tensor:
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None]:
        ctx.module.bucket.add(ctx.module.key, g)
        return None, None
