"""Dropout under tensor parallelism: replicated values draw the same mask on every rank
(so they stay replicated and their gradients agree), shards draw independent masks; with
dropout off the results equal the unsharded model (test_equivalence)."""

from __future__ import annotations

import torch

import autotp
from models import VOCAB, batch


def _gpt2_with_dropout(p: float):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=VOCAB,
                                     n_positions=64, resid_pdrop=p, embd_pdrop=p,
                                     attn_pdrop=p)
    return transformers.GPT2LMHeadModel(config).train()


def _step(sim, ids):
    def step(module):
        out = module(ids).logits
        out.float().pow(2).mean().backward()
        grads = {t: p.grad.clone() for t, p in module.local_parameters().items()
                 if sim.plan.params[t].layout.startswith("R")}
        return out.detach(), grads

    return sim.run(step)


def test_replicated_values_stay_replicated_with_dropout() -> None:
    model = _gpt2_with_dropout(0.3)
    ids = batch()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})
    kinds = {type(m).__name__ for m in sim.ranks[0].program.children()}
    assert {"TrackedDropout", "TrackedAttention"} <= kinds
    (out0, grads0), (out1, grads1) = _step(sim, ids)
    assert torch.equal(out0, out1), "logits (replicated) differ across ranks"
    assert grads0 and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    # dropout is really on: the output differs from the model without dropout
    expected = model.eval()(ids).logits
    assert float((out0 - expected).abs().max()) > 1e-3


def test_dropout_masks_are_reproducible_and_rate_is_kept() -> None:
    from autotp.random import RngTracker, Stream, TrackedDropout

    x = torch.ones(4096)
    a = TrackedDropout(RngTracker(7, rank=0), Stream.SHARDED)(x, 0.25, True)
    b = TrackedDropout(RngTracker(7, rank=1), Stream.SHARDED)(x, 0.25, True)
    c = TrackedDropout(RngTracker(7, rank=1), Stream.REPLICATED)(x, 0.25, True)
    d = TrackedDropout(RngTracker(7, rank=0), Stream.REPLICATED)(x, 0.25, True)
    assert torch.equal(c, d), "the replicated stream must agree across ranks"
    assert not torch.equal(a, b), "shards must draw different masks"
    kept = float((a != 0).float().mean())
    assert abs(kept - 0.75) < 0.03 and torch.allclose(a[a != 0], torch.full_like(a[a != 0],
                                                                                 1 / 0.75))
