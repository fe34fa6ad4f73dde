"""Lookups: embedding rows and ``gather``.

``embedding(W, idx)`` is a row gather: out[..., :] = W[idx[...], :].

* W sharded by columns (S(1)): each rank gathers its columns -> the output's last dim is
  sharded.
* W sharded by rows, i.e. by vocabulary (S(0)): rank r holds rows [lo, hi); it looks up the
  indices that fall in its range and writes zeros elsewhere, so the ranks' outputs sum to the
  full lookup -> P. The lowering emits the masked local lookup.

``gather(x, dim, index)`` reads out[i][j] = x[i][index[i][j]] (for dim = 1):

* any other dim sharded in both x and index (of the same size) stays sharded;
* index sharded (x replicated) gives the same shard of the output;
* x sharded along ``dim`` with a replicated index: each rank reads the indices in its range
  and writes zeros elsewhere -> P, as for the vocabulary-parallel embedding (the target
  logit of a cross-entropy over vocabulary-sharded logits).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from autotp.layout import P, R, Shard
from autotp.rules.registry import OpCall, RuleSet, Strategy, normalize_dim, shardable_dims

aten = torch.ops.aten
rules = RuleSet()


def _local_indices(graph: Any, index: Any, lo: int, hi: int) -> tuple[Any, Any]:
    """Nodes for (index - lo, 0 where outside [lo, hi)) and the outside mask."""
    below = graph.call_function(aten.lt.Scalar, (index, lo))
    above = graph.call_function(aten.ge.Scalar, (index, hi))
    outside = graph.call_function(aten.logical_or.default, (below, above))
    shifted = graph.call_function(aten.sub.Tensor, (index, lo))
    local = graph.call_function(aten.masked_fill.Scalar, (shifted, outside, 0))
    return local, outside


@rules.register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Iterator[Strategy]:
    weight, indices = call.inputs[:2]
    if weight.shardable(1, call.tp):
        yield Strategy((Shard(1), R), Shard(indices.ndim), name="column")
    # With scale_grad_by_freq the masked-out lookups (remapped to local row 0) would count
    # toward that row's frequency: no vocab parallelism then.
    if weight.shardable(0, call.tp) and not call.arg("scale_grad_by_freq", False):
        yield Strategy((Shard(0), R), P, name="vocab parallel")


@rules.lowering(aten.embedding.default)
def vocab_parallel_lowering(ctx: Any, node: Any, strategy: Strategy) -> None:
    if strategy.inputs[0] != Shard(0):
        return
    weight, indices = node.args[:2]
    vocab = node.args[0].meta["val"].shape[0]
    rows = vocab // ctx.tp
    lo, hi = ctx.rank * rows, (ctx.rank + 1) * rows
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    local_padding = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else -1
    graph = ctx.graph
    with graph.inserting_before(node):
        local, outside = _local_indices(graph, indices, lo, hi)
        outside_col = graph.call_function(aten.unsqueeze.default, (outside, -1))
    node.args = (weight, local, local_padding, *node.args[3:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "padding_idx"}
    ctx.apply_after(node, aten.masked_fill.Scalar, outside_col, 0.0)


@rules.register(aten.gather.default)
def gather_rule(call: OpCall) -> Iterator[Strategy]:
    x, index = call.inputs[:2]
    dim = normalize_dim(call.arg("dim"), x.ndim)
    if call.arg("sparse_grad", False) or x.ndim != index.ndim:
        return
    for d, blocks in shardable_dims(index, call):
        if d == dim:
            yield Strategy((R, Shard(d, blocks)), Shard(d, blocks), name="index shard")
        elif x.static(d) == index.static(d):
            yield Strategy((Shard(d, blocks), Shard(d, blocks)), Shard(d, blocks),
                           name="keep shard")
    if x.floating and x.shardable(dim, call.tp):
        yield Strategy((Shard(dim), R), P, name="masked lookup")


@rules.lowering(aten.gather.default)
def masked_gather_lowering(ctx: Any, node: Any, strategy: Strategy) -> None:
    if strategy.output != P:
        return
    x, dim, index = node.args[:3]
    dim = normalize_dim(dim, x.meta["val"].ndim)
    rows = x.meta["val"].shape[dim] // ctx.tp
    lo, hi = ctx.rank * rows, (ctx.rank + 1) * rows
    graph = ctx.graph
    with graph.inserting_before(node):
        local, outside = _local_indices(graph, index, lo, hi)
    node.args = (x, dim, local, *node.args[3:])
    ctx.apply_after(node, aten.masked_fill.Scalar, outside, 0.0)
