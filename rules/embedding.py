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

from typing import Iterator

import torch

from autotp.layout import P, R, Shard
from autotp.rules.registry import OpCall, RuleSet, Strategy, normalize_dim, shardable_dims

aten = torch.ops.aten
rules = RuleSet()


@rules.register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Iterator[Strategy]:
    weight, indices = call.inputs[:2]
    if weight.shardable(1, call.tp):
        yield Strategy((Shard(1), R), Shard(indices.ndim), name="column")
    # With scale_grad_by_freq the masked-out lookups (remapped to local row 0) would count
    # toward that row's frequency: no vocab parallelism then.
    if weight.shardable(0, call.tp) and not call.arg("scale_grad_by_freq", False):
        yield Strategy((Shard(0), R), P, name="vocab parallel")
    if call.context:  # each rank looks up its own tokens in the whole table
        for d, blocks in shardable_dims(indices, call):
            yield Strategy((R, Shard(d, blocks)), Shard(d, blocks), name="tokens")


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

