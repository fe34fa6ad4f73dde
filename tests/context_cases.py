"""Cases of context-parallel attention (autotp.runtime.context), run on every rank of a cp
group (threads or gloo processes): each rank attends with its shard of one global q, k, v
and returns its output and gradients beside the unsharded attention's, as the layout shards
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from autotp.features.verify import max_difference
from autotp.runtime.comm import Communicator
from autotp.runtime.context import SequenceLayout, ring_attention, ulysses_attention


@dataclass(frozen=True)
class Case:
    heads: int = 4
    kv_heads: int = 4
    causal: bool = True
    balanced: bool = True
    window: Optional[int] = None
    padding: Optional[str] = None  # "right" or "left": the second sequence's 5 pad tokens
    length: int = 24  # 2 x cp chunks at cp 2, 3 and 4


CASES = {
    "causal": Case(),
    "causal-contiguous": Case(balanced=False),
    "bidirectional": Case(causal=False, balanced=False),
    "gqa": Case(heads=8, kv_heads=2),
    "gqa-6-3": Case(heads=6, kv_heads=3),
    "window": Case(window=5),
    "padding": Case(padding="right"),
    # causal with the pad tokens first: their queries see no key at all (zeros, no gradient)
    "left-padding": Case(padding="left"),
    "bidirectional-padding": Case(causal=False, balanced=False, padding="right"),
}


def inputs(case: Case) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    b, d, s = 2, 8, case.length
    q = torch.randn(b, case.heads, s, d, generator=gen)
    k = torch.randn(b, case.kv_heads, s, d, generator=gen)
    v = torch.randn(b, case.kv_heads, s, d, generator=gen)
    grad = torch.randn(b, case.heads, s, d, generator=gen)
    keys = torch.ones(b, s, dtype=torch.bool)
    if case.padding == "right":
        keys[1, s - 5:] = False
    elif case.padding == "left":
        keys[1, :5] = False
    return q, k, v, grad, keys


def reference(case: Case) -> dict[str, torch.Tensor]:
    """The unsharded attention: scaled_dot_product_attention over the whole sequence."""
    q, k, v, grad, keys = (t.clone() for t in inputs(case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = case.length
    pos = torch.arange(s)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if case.causal:
        allowed = pos[None, :] <= pos[:, None]
    if case.window is not None:
        allowed &= pos[:, None] - pos[None, :] < case.window
    mask = allowed[None, None] & keys[:, None, None, :]
    empty = ~mask.any(-1, keepdim=True)  # a query no key is left for: zeros
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty,
                                         enable_gqa=case.heads != case.kv_heads)
    out = out.masked_fill(empty, 0.0)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def run(comm: Communicator, case: Case, strategy: str) -> dict[str, float]:
    """This rank's shard through ``strategy``; the largest difference to the unsharded
    attention's output and gradients (each as this rank's shard of them)."""
    layout = SequenceLayout(comm.world_size, case.balanced)
    q, k, v, grad, keys = inputs(case)
    mine = [layout.shard(t, 2, comm.rank).requires_grad_() for t in (q, k, v)]
    attend = ring_attention if strategy == "ring" else ulysses_attention
    out = attend(*mine, comm, layout, causal=case.causal, window=case.window,
                 key_mask=keys if case.padding else None)
    out.backward(layout.shard(grad, 2, comm.rank))
    want = reference(case)
    got = {"out": out.detach(), "q": mine[0].grad, "k": mine[1].grad, "v": mine[2].grad}
    for name, tensor in got.items():
        assert tensor is not None and bool(torch.isfinite(tensor).all()), (name, tensor)
    return {name: max_difference(layout.shard(want[name], 2, comm.rank), got[name],
                                 relative=True) for name in want}


def process_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """Every case and both strategies (Ulysses where the heads divide) in one gloo launch."""
    from autotp.runtime.comm import ProcessGroupComm

    comm = ProcessGroupComm()
    results = {}
    for name, case in CASES.items():
        for strategy in ("ring", "ulysses"):
            if strategy == "ulysses" and (case.heads % world_size or case.kv_heads % world_size):
                continue
            results[f"{name}-{strategy}"] = run(comm, case, strategy)
    results["shifts"] = {"forward": float(comm.log.count("forward", kind="shift",
                                                          any_layer=True))}
    return results
