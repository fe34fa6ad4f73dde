"""Ops that autotp computes replicated by design, and ops that carry no tensor result.

Factories (arange, full, ones), index arithmetic (index, diff) and the captured
no-grad regions (e.g. rotary tables) read only inputs and buffers, which are replicated:
computing them on every rank is exact and cheap. They are registered here explicitly; an op
that is registered nowhere is an error (or, with ``strict=False``, a recorded fallback).

``sym_size(x, d)`` reads a global size: along a sharded ``d`` it is the local size times tp.
``_assert_tensor_metadata`` checks dtype and device only: any layout will do.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from autotp.layout import P, Shard
from autotp.rules.registry import OpCall, RuleSet, Strategy, normalize_dim, shardable_dims

aten = torch.ops.aten
rules = RuleSet()

REPLICATED_ONLY: list[Any] = [
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.diff.default,
    aten.repeat_interleave.self_Tensor,
    aten.index_select.default,
    aten.sort.default,
    aten.argsort.default,
    aten.argsort.stable,
    aten.topk.default,
    aten.histc.default,
    aten.bincount.default,
    aten.scatter.value,
    aten.scatter.src,
    aten.bucketize.Tensor,
    aten.searchsorted.Tensor,
    aten.outer.default,
    aten.item.default,
    aten.any.default,  # a whole tensor reduced to one flag (if mask.any():)
    aten.all.default,
    # the run-time check of a branch traced as the example took it (capture.branches)
    aten._assert_async.msg,
    aten._assert_async.default,
    aten.lift_fresh.default,
    aten.min.default,
    aten.max.default,
    # losses: computed on replicated (gathered) inputs; vocabulary-parallel losses come from
    # the reduction rules, not from these ops
    aten.nll_loss_forward.default,
    aten.nll_loss_nd.default,
    aten.nll_loss.default,
    aten.cross_entropy_loss.default,
    aten.mse_loss.default,
]

try:  # torch.export's no-grad regions (autocast regions are inlined at capture)
    from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

    REPLICATED_ONLY += [wrap_with_set_grad_enabled]
except ImportError:  # pragma: no cover - older torch
    pass


@rules.register(*REPLICATED_ONLY)
def replicated_rule(call: OpCall) -> Iterator[Strategy]:
    """Computed on replicated inputs only (the registry adds that strategy)."""
    return iter(())


@rules.register(aten.tril.default, aten.triu.default)
def triangle_rule(call: OpCall) -> Iterator[Strategy]:
    """``tril(x, k)`` / ``triu(x, k)`` zero the entries of each matrix of the last two dims on
    one side of a diagonal: a mask of positions, not of values. So it is linear (a partial
    sum's triangle is the sum of the partial triangles) and keeps a shard of any dim before
    those two (each matrix is whole on one rank: a per-head decay mask with heads sharded)."""
    x = call.inputs[0]
    if x.floating:
        yield Strategy((P,), P, name="linear")
    for d, blocks in shardable_dims(x, call):
        if d < x.ndim - 2:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="per matrix")


@rules.register(aten.sym_size.int)
def sym_size_rule(call: OpCall) -> Iterator[Strategy]:
    x = call.inputs[0]
    dim = normalize_dim(call.arg("dim"), x.ndim)
    yield Strategy((P,), None, name="global size")
    for d, blocks in shardable_dims(x, call):
        yield Strategy((Shard(d, blocks),), None,
                       name="global size" if d != dim else "local size x tp")


@rules.register(aten._assert_tensor_metadata.default)
def assert_metadata_rule(call: OpCall) -> Iterator[Strategy]:
    x = call.inputs[0]
    yield Strategy((P,), None, name="metadata")
    for d, blocks in shardable_dims(x, call):
        yield Strategy((Shard(d, blocks),), None, name="metadata")
