"""Dropout under tensor parallelism: replicated values draw the same mask on every rank
(so they stay replicated and their gradients agree), shards draw independent masks; with
dropout off the results equal the unsharded model (test_equivalence)."""

from __future__ import annotations

import math

import pytest
import torch

import autotp
from autotp.runtime.layers import program_nodes
from autotp.verification.verify import perturb
from tests.models import VECTOR_NOISE, VOCAB, batch


def _gpt2_with_dropout(p: float):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=VOCAB,
                                     n_positions=64, resid_pdrop=p, embd_pdrop=p,
                                     attn_pdrop=p)
    return perturb(transformers.GPT2LMHeadModel(config), seed=10_000, **VECTOR_NOISE).train()


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
    kinds = {type(m).__name__ for m in sim.ranks[0].program.modules()}
    assert {"TrackedDropout", "TrackedAttention"} <= kinds
    (out0, grads0), (out1, grads1) = _step(sim, ids)
    assert torch.equal(out0, out1), "logits (replicated) differ across ranks"
    assert grads0 and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    # dropout is really on: the output differs from the model without dropout
    expected = model.eval()(ids).logits
    assert float((out0 - expected).abs().max()) > 1e-3


def test_dropout_masks_are_reproducible_and_rate_is_kept() -> None:
    from autotp.runtime.random import RngTracker, Stream, TrackedDropout

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


# ---- masks, read off every rank's dropout ops -------------------------------------------------


def _record_masks(sim) -> list[dict[str, list[torch.Tensor]]]:
    """Per rank: original dropout node -> the keep masks it drew, call after call (a forward
    hook on each rank's ``TrackedDropout``): 1 kept, 0 dropped, NaN where the input is 0."""
    from autotp.runtime.random import TrackedDropout

    recorded: list[dict[str, list[torch.Tensor]]] = []
    for module in sim.ranks:
        masks: dict[str, list[torch.Tensor]] = {}
        recorded.append(masks)
        for name, child in module.program.named_modules():  # in the layers too
            if isinstance(child, TrackedDropout):
                node = name.rsplit(".", 1)[-1][len("autotp_random_"):]

                def hook(_mod, args, out, node=node, masks=masks):
                    # where the input is 0 (masked attention scores) the mask is unknown
                    keep = torch.where(args[0] != 0, (out != 0).float(), torch.nan)
                    masks.setdefault(node, []).append(keep.detach())

                child.register_forward_hook(hook)
    return recorded


def _check_masks(sim, recorded, p: float) -> tuple[int, int]:
    """Replicated values: the same mask on every rank. Shards: the ranks' masks are
    independent (about half their entries agree at p = 0.5; the same stream on every rank
    would make them all agree). Returns how many replicated and sharded dropouts were seen."""
    from autotp.layout import Shard, parse_layout

    n_rep = n_shard = 0
    for node, calls in recorded[0].items():
        layout = parse_layout(sim.plan.values[node])
        for call, mask0 in enumerate(calls):
            masks = [r[node][call] for r in recorded]
            if isinstance(layout, Shard):
                n_shard += 1
                assert all(m.shape == mask0.shape for m in masks), node
                for other in masks[1:]:
                    known = ~(mask0.isnan() | other.isnan())
                    agree = float((mask0[known] == other[known]).float().mean())
                    assert abs(agree - 0.5) < 0.1, (
                        f"{node} ({layout}): shards agree on {agree:.3f} of their mask")
            else:
                n_rep += 1
                same = all(torch.equal(mask0.nan_to_num(-1), m.nan_to_num(-1))
                           for m in masks[1:])
                assert same, f"{node} ({layout}): replicated value, different masks across ranks"
            kept = float(torch.cat([m.flatten() for m in masks]).nanmean())
            assert abs(kept - (1 - p)) < 0.1, (node, kept)
    return n_rep, n_shard


def _full_masks(sim, recorded) -> list[torch.Tensor]:
    """The whole model's masks, in the order the dropouts run (shards put back together)."""
    from autotp.layout import parse_layout, unshard_tensor

    nodes = [n for n in program_nodes(sim.ranks[0].program)
             if n.op == "call_module" and n.target.startswith("autotp_random_")]
    full = []
    for node in nodes:
        name = node.target[len("autotp_random_"):]
        if name not in recorded[0]:
            continue
        layout = parse_layout(sim.plan.values[name])
        for call in range(len(recorded[0][name])):
            pieces = [r[name][call].nan_to_num(0.0) for r in recorded]
            full.append(unshard_tensor(pieces, layout))
    return full


def _replaying(masks: list[torch.Tensor]):
    """``F.dropout`` that applies the given masks in turn (for the unsharded model)."""
    queue = list(masks)

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        mask = queue.pop(0)
        assert mask.shape == x.shape, (mask.shape, x.shape)
        return x * mask.to(x.dtype) / (1.0 - p)

    return dropout, queue


class _DropoutNet(torch.nn.Module):
    """Dropout on a column-sharded activation (fc1's output), on the sequence-sharded
    residual under sequence parallelism, and on a value only replicated parameters make
    (the gate)."""

    def __init__(self, vocab: int = 64, d: int = 32, p: float = 0.5) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.gate = torch.nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.norm_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.drop = torch.nn.Dropout(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.drop(self.gate)
        h = h + self.drop(self.fc2(self.drop(torch.tanh(self.fc1(self.norm(h))))))
        logits = self.head(self.norm_f(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _dropout_net():
    torch.manual_seed(0)
    return perturb(_DropoutNet(), seed=10_000, **VECTOR_NOISE).train()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_shards_draw_independent_masks_and_replicated_values_the_same(
        sequence_parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """tp = 2, p = 0.5 in train mode: the masks of the column-sharded fc1 output (and under
    sequence parallelism of the sequence-sharded residual) differ between the ranks, the
    gate's mask is the same on both; the unsharded model given the same (reassembled) masks
    computes the same loss and gradients."""
    from autotp.verification.verify import compare, reference_step, sharded_step

    model = _dropout_net()
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(3))
    sim = autotp.simulate(model, 2, example_args=(ids,), sequence_parallel=sequence_parallel)
    assert sim.plan.params["fc1.weight"].layout == "S(0)"  # column-parallel fc1
    recorded = _record_masks(sim)
    results = sim.run(lambda m: sharded_step(m, lambda m: m(ids), lambda o: o, lambda o: o))
    # gate, fc1's output, the residual branch (replicated after the all-reduce, or
    # sharded after the reduce-scatter: by the batch, which tp divides)
    # (R or R*: replicated either way, whether or not its gradient is partial)
    layouts = [sim.plan.values[n].rstrip("*") for n in recorded[0]]
    assert layouts == ["R", "S(2)", "S(0)" if sequence_parallel else "R"], layouts
    assert _check_masks(sim, recorded, 0.5) == ((1, 2) if sequence_parallel else (2, 1))
    assert results[0].loss == results[1].loss and math.isfinite(results[0].loss)

    dropout, left = _replaying(_full_masks(sim, recorded))
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    reference = reference_step(model, lambda m: m(ids), lambda o: o, lambda o: o)
    assert not left
    for rank, result in enumerate(results):
        cmp = compare(reference, result)
        assert cmp.loss_diff <= 1e-4 and cmp.grad_diff <= 1e-4 and cmp.grad_rel <= 1e-4, (
            rank, cmp)
    # and the masks are really on: without them the loss is another
    monkeypatch.undo()
    assert abs(float(model.eval()(ids)) - reference.loss) > 1e-3


def test_gpt2_dropout_under_sequence_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 with every dropout at p = 0.5, in train mode, sequence-parallel at tp = 2: the
    embedding and residual dropouts act on batch shards (tp divides the batch), the
    attention dropout on head shards, each with its own mask per rank; the loss is the same
    on both ranks, and the unsharded model given the reassembled masks computes the same
    logits, loss and gradients (fp32, 1e-4 as in test_vocab_sequence)."""
    import transformers

    from autotp.layout import parse_layout, unshard_tensor
    from autotp.verification.verify import compare, reference_step, sharded_step

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=VOCAB,
                                     n_positions=64, resid_pdrop=0.5, embd_pdrop=0.5,
                                     attn_pdrop=0.5, attn_implementation="eager")
    model = perturb(transformers.GPT2LMHeadModel(config), seed=10_000, **VECTOR_NOISE).train()
    ids = batch(b=4, t=16)
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids},
                          sequence_parallel=True, gather_outputs=False)
    recorded = _record_masks(sim)

    def call(m):
        return m(input_ids=ids, labels=ids)

    results = sim.run(lambda m: sharded_step(m, call, lambda o: o.loss, lambda o: o.logits))
    _, n_shard = _check_masks(sim, recorded, 0.5)
    layouts = {sim.plan.values[n] for n in recorded[0]}
    # embedding, 2 x (attn, resid x 2): the attention's by heads, the others by the batch
    assert n_shard == 7 and layouts == {"S(0)", "S(1)"}, layouts
    assert results[0].loss == results[1].loss and math.isfinite(results[0].loss)
    logits = unshard_tensor([r.output for r in results], parse_layout(sim.plan.outputs[1]))

    dropout, left = _replaying(_full_masks(sim, recorded))
    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    reference = reference_step(model, call, lambda o: o.loss, lambda o: o.logits)
    assert not left
    for rank, result in enumerate(results):
        result.output = logits
        cmp = compare(reference, result)
        assert cmp.ok(), (rank, cmp)
