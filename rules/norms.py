"""Reductions, normalizations, softmax and attention.

* A reduction over dims that are not sharded keeps the shard (its index shifts when the
  reduced dims are dropped). ``sum`` over a sharded dim is a partial sum:
  sum(x) = sum_r sum(x_r) -> P. Both sum and mean are linear, so P passes through.
  A mean over a sharded dim is a partial statistic: mean(x) = sum_r mean(x_r) / tp -> P,
  all-reduced as the small [.., 1] statistic rather than gathering x.
  ``logsumexp`` over a sharded dim leaves a partial logsumexp per rank:
  lse(x) = log sum_r exp(lse(x_r)) -> P(lse), combined from ``tp`` numbers per row (this is
  how a cross-entropy over vocabulary-sharded logits avoids gathering them).
* softmax, layer_norm and rms_norm need the normalized dim whole on each rank; any other dim
  may be sharded (their affine weights are read replicated).
* scaled_dot_product_attention is independent per (batch, head): sharding heads needs no
  communication. The mask is sharded with the heads, or read replicated when it broadcasts
  over them. With GQA (fewer k/v heads) the k/v heads must be divisible by tp as well; a
  single k/v head broadcast to every query head (Falcon's multi-query) is read whole.
  With context parallelism (``OpCall.context``) attention also takes q, k and v sharded
  along the sequence: ring attention (autotp.runtime.ring) passes the key/value blocks
  around the group; the mask is read by this rank's query rows, every key column whole.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from autotp.layout import P, P_LSE, R, R_STAR, Layout, Shard
from autotp.rules.registry import OpCall, RuleSet, Strategy, TensorMeta, normalize_dim, \
    shardable_dims

aten = torch.ops.aten
rules = RuleSet()


def _reduced_dims(call: OpCall, dims: object) -> list[int]:
    ndim = call.inputs[0].ndim
    if dims is None or dims == []:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    assert isinstance(dims, Sequence)
    return sorted(normalize_dim(d, ndim) for d in dims)


def _kept_shards(call: OpCall, reduced: list[int], keepdim: bool) -> Iterator[Strategy]:
    for dim, blocks in shardable_dims(call.inputs[0], call):
        if dim in reduced:
            continue
        out_dim = dim if keepdim else dim - sum(1 for r in reduced if r < dim)
        yield Strategy((Shard(dim, blocks),), Shard(out_dim, blocks), name="keep shard")


@rules.register(aten.sum.dim_IntList, aten.mean.dim)
def sum_mean_rule(call: OpCall) -> Iterator[Strategy]:
    reduced = _reduced_dims(call, call.arg("dim"))
    keepdim = bool(call.arg("keepdim", False))
    yield from _kept_shards(call, reduced, keepdim)
    if call.inputs[0].floating:
        yield Strategy((P,), P, name="linear")
    x = call.inputs[0]
    for dim, blocks in shardable_dims(x, call):
        if dim not in reduced:
            continue
        if call.op == aten.sum.dim_IntList:
            yield Strategy((Shard(dim, blocks),), P, name="partial sum")
        elif x.floating:
            # A mean over sharded features (a norm's statistic over a column-parallel
            # projection, a q/k norm over all heads): each rank's local mean / tp, summed by
            # an all-reduce of the statistic alone. Priced as 3/4 of an n x n matrix held
            # whole: less than the n-wide projection it lets the plan shard (the q
            # projection ahead of it), more than half the stream's width squared, so that a
            # block's two norms never buy a residual stream sharded along h for the sake of
            # k/v projections (at most half as wide as the stream when tp exceeds their
            # heads).
            size = x.static(dim)
            if size is None:
                continue  # a split sequence (sequence parallelism): not a norm's features
            yield Strategy((Shard(dim, blocks),), P, name="partial statistic",
                           premium=0.75 * size * size * x.dtype.itemsize)


@rules.register(aten.sum.default, aten.mean.default)
def sum_all_rule(call: OpCall) -> Iterator[Strategy]:
    """sum(x) = sum_r sum(x_r); mean(x) = sum_r mean(x_r) / tp (equal shards)."""
    if call.inputs[0].floating:
        yield Strategy((P,), P, name="linear")
    if call.op == aten.mean.default and not call.inputs[0].floating:
        return
    for dim, blocks in shardable_dims(call.inputs[0], call):
        yield Strategy((Shard(dim, blocks),), P, name="partial sum")


@rules.register(aten.logsumexp.default)
def logsumexp_rule(call: OpCall) -> Iterator[Strategy]:
    reduced = _reduced_dims(call, call.arg("dim"))
    yield from _kept_shards(call, reduced, bool(call.arg("keepdim", False)))
    if call.inputs[0].floating:
        for dim, blocks in shardable_dims(call.inputs[0], call):
            if dim in reduced:
                yield Strategy((Shard(dim, blocks),), P_LSE, name="partial logsumexp")


@rules.register(aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction,
                aten.var.dim, aten.std.dim, aten.any.dim, aten.all.dim, aten.argmax.default,
                aten.argmin.default)
def reduce_keep_rule(call: OpCall) -> Iterator[Strategy]:
    reduced = _reduced_dims(call, call.arg("dim"))
    yield from _kept_shards(call, reduced, bool(call.arg("keepdim", False)))


@rules.register(aten.max.dim, aten.min.dim)
def max_dim_rule(call: OpCall) -> Iterator[Strategy]:
    """``max(x, d) -> (values, indices)`` per position over d: shards elsewhere stay."""
    reduced = _reduced_dims(call, call.arg("dim"))
    for strategy in _kept_shards(call, reduced, bool(call.arg("keepdim", False))):
        yield Strategy(strategy.inputs, (strategy.output, strategy.output), name="keep shard")


@rules.register(aten.linalg_vector_norm.default, aten.linalg_norm.default)
def vector_norm_rule(call: OpCall) -> Iterator[Strategy]:
    """``linalg_vector_norm(x, ord, dim, keepdim)`` (``F.normalize``, per-head qk-norm) and
    ``linalg_norm`` (a vector norm over one dim, as DoRA's weight norm per output row, or a
    matrix norm over two): a reduction over ``dim``; shards on the other dims stay."""
    reduced = _reduced_dims(call, call.arg("dim"))
    yield from _kept_shards(call, reduced, bool(call.arg("keepdim", False)))


@rules.register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                aten.log_softmax.int, aten.cumsum.default)
def softmax_rule(call: OpCall) -> Iterator[Strategy]:
    dim = normalize_dim(call.arg("dim"), call.inputs[0].ndim)
    for d, blocks in shardable_dims(call.inputs[0], call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="keep shard")


@rules.register(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(call: OpCall) -> Iterator[Strategy]:
    x = call.inputs[0]
    normalized = len(call.arg("normalized_shape"))
    n_affine = len(call.inputs) - 1
    for d, blocks in shardable_dims(x, call):
        if d < x.ndim - normalized:
            yield Strategy((Shard(d, blocks),) + (R,) * n_affine, Shard(d, blocks),
                           name="keep shard")


@rules.register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_eval_rule(call: OpCall) -> Iterator[Strategy]:
    """Batch norm in eval mode: ``(x - mean[c]) * rstd[c] * w[c] + b[c]``, channels along
    dim 1, with the running statistics. Elementwise along every other dim (the per-channel
    tensors read whole); along the channels, each rank its channels' weight, bias and
    statistics. Its two other outputs are empty (no statistics are computed): alike on every
    rank."""
    x, params = call.inputs[0], call.inputs[1:]
    empty = (R_STAR, R_STAR)
    for d, blocks in shardable_dims(x, call):
        if d != 1:
            yield Strategy((Shard(d, blocks),) + (R,) * len(params), (Shard(d, blocks),) + empty,
                           name="keep shard")
        elif all(p.ndim == 1 and p.shardable(0, call.tp, blocks) for p in params):
            yield Strategy((Shard(1, blocks),) + (Shard(0, blocks),) * len(params),
                           (Shard(1, blocks),) + empty, name="channels")


@rules.register(aten._native_batch_norm_legit_functional.default)
def batch_norm_training_rule(call: OpCall) -> Iterator[Strategy]:
    """Batch norm in training: each channel's statistics over the batch and positions, the
    running statistics updated per channel: exact with the channels sharded, every
    per-channel tensor (weight, bias, running and saved statistics) with them."""
    x, params = call.inputs[0], call.inputs[1:]
    for blocks in call.blocks:
        if x.shardable(1, call.tp, blocks) and \
                all(p.ndim == 1 and p.shardable(0, call.tp, blocks) for p in params):
            per_channel = Shard(0, blocks)
            yield Strategy((Shard(1, blocks),) + (per_channel,) * len(params),
                           (Shard(1, blocks),) + (per_channel,) * 4, name="channels")


@rules.register(aten.native_group_norm.default)
def group_norm_rule(call: OpCall) -> Iterator[Strategy]:
    """``native_group_norm(x, w, b, N, C, HxW, group, eps) -> (y, mean, rstd)``: each
    group's statistics over its C / group channels and the positions. Channels (dim 1)
    sharded in whole groups (RetNet's norm of each head's output, heads sharded) are exact,
    each rank its groups' weight, bias and statistics ([N, group]: dim 1); the lowering
    makes C and group local."""
    x = call.inputs[0]
    groups = call.arg("group")
    if not isinstance(groups, int):
        return
    whole_groups = TensorMeta((groups,), x.dtype)
    if x.shardable(1, call.tp) and whole_groups.shardable(0, call.tp):
        affine = (Shard(0),) * (len(call.inputs) - 1)
        yield Strategy((Shard(1),) + affine, (Shard(1), Shard(1), Shard(1)), name="groups")


@rules.register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall) -> Iterator[Strategy]:
    q, k, v = call.inputs[:3]
    mask = call.inputs[3] if len(call.inputs) > 3 else None
    for dim, blocks in shardable_dims(q, call):
        if dim >= q.ndim - 2 or blocks != 1:
            continue  # the sequence and head-size dims are mixed by attention
        if k.shardable(dim, call.tp) and v.shardable(dim, call.tp):
            inputs: list[Layout] = [Shard(dim), Shard(dim), Shard(dim)]
        elif k.static(dim) == 1 and v.static(dim) == 1:
            inputs = [Shard(dim), R, R]  # one k/v head broadcast to every query head (MQA)
        else:
            continue
        if mask is not None:
            offset = q.ndim - mask.ndim
            mdim = dim - offset
            if mdim < 0 or mask.shape[mdim] == 1:
                inputs.append(R)
            elif mask.shape[mdim] == q.shape[dim]:
                inputs.append(Shard(mdim))
            else:
                continue
        yield Strategy(tuple(inputs), Shard(dim), name="heads")
    if call.context:
        yield from _ring(call, q, k, v, mask)


def _ring(call: OpCall, q: TensorMeta, k: TensorMeta, v: TensorMeta,
          mask: "TensorMeta | None") -> Iterator[Strategy]:
    seq = q.ndim - 2
    if not all(x.shardable(seq, call.tp) for x in (q, k, v)) or \
            call.arg("dropout_p", 0.0):
        return
    inputs: list[Layout] = [Shard(seq), Shard(seq), Shard(seq)]
    if mask is not None:
        rows = seq - (q.ndim - mask.ndim)  # the mask's query dim
        if rows < 0 or mask.shape[rows] == 1:
            inputs.append(R)
        elif mask.shape[rows] == q.shape[seq]:
            inputs.append(Shard(rows))
        else:
            return
    yield Strategy(tuple(inputs), Shard(seq), name="ring")
