"""Training does not pay for outputs it does not read: with ``labels=`` the logits leave the
rank program sharded over the vocabulary and are gathered when first read
(``autotp.runtime.outputs``); ``gather_outputs="always"`` gathers them in the forward, and a
call without a loss gathers them there as before.

The small HF LLaMA (tests/models.py, vocabulary 128) at tp 2, ranks simulated as threads,
against the unsharded model on the same weights and inputs, float32: losses within 1e-5,
logits within 1e-5 (max abs), every parameter's gradient within 1e-4 of its largest entry.
Collectives are counted from the communicator's log (what ran).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch.utils import _pytree as pytree

import autotp
from autotp.errors import ConfigError
from autotp.options import Options
from autotp.planner.problem import OutputGather
from autotp.runtime.comm import CollectiveError
from autotp.runtime.launch import run_processes
from tests.models import VOCAB, llama

ATOL, GRAD_REL = 1e-5, 1e-4


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A loss the loop computes from the logits itself (next-token cross-entropy)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                             ids[:, 1:].reshape(-1))


def _gathers(module: Any, phase: str) -> list[tuple[str, int]]:
    return [(e.label, e.nbytes) for e in module.comm.log.events
            if e.kind == "all_gather" and e.phase == phase]


def _reference(model: torch.nn.Module, ids: torch.Tensor,
               loss_of: Callable[[Any], torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    reference = copy.deepcopy(model)
    out = reference(input_ids=ids, labels=ids)
    loss_of(out).backward()
    return out, {n: p.grad for n, p in reference.named_parameters()}


def _assert_grads(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, want in expected.items():
        scale = want.abs().max().clamp_min(1e-12)
        assert (grads[name] - want).abs().max() <= GRAD_REL * scale, name


def test_a_step_that_reads_only_the_loss_gathers_no_logits() -> None:
    """Forward and backward of ``out.loss`` run the vocabulary-parallel loss's per-token
    all-gather and no b x s x V gather; the loss and every gradient are the unsharded ones."""
    model, ids = llama().train(), _ids()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids})
    assert sim.plan.gathered_when_read == {"logits": "S(2)"}
    assert sim.plan.outputs == ["R", "S(2)"]
    # the plan prices no gather of the logits: its one forward all-gather is the loss's
    gathers = [c for c in sim.plan.collectives if c.kind == "all_gather"]
    assert [c.bytes_expr for c in gathers] == ["8*B*T"], gathers

    def step(m: Any) -> tuple[float, list, list, dict[str, torch.Tensor]]:
        out = m(input_ids=ids, labels=ids)
        assert out["loss"] is out.loss and out[0] is out.loss and out.get("loss") is out.loss
        out.loss.backward()
        ran = (_gathers(m, "forward"), _gathers(m, "backward"))
        return out.loss.item(), *ran, autotp.full_state_dict(m, grads=True)

    ref_out, ref_grads = _reference(model, ids, lambda out: out.loss)
    b, s = ids.shape
    for loss, forward, backward, grads in sim.run(step):
        assert forward == [("logsumexp_default P(lse)->R", 2 * b * s * 4)], forward
        assert backward == []
        assert abs(loss - ref_out.loss.item()) <= ATOL
        _assert_grads(grads, ref_grads)


def test_logits_read_afterwards_are_the_unsharded_ones_and_back_propagate() -> None:
    """``out.logits`` gathers once, when first read (every way of reading it gives the same
    tensor), equals the unsharded logits, and a loss the loop computes from it
    back-propagates to the unsharded model's gradients."""
    model, ids = llama().train(), _ids()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids})

    def step(m: Any) -> tuple[torch.Tensor, list, list, dict[str, torch.Tensor]]:
        out = m(input_ids=ids, labels=ids)
        before = _gathers(m, "forward")
        logits = out.logits
        assert out["logits"] is logits and out[1] is logits and out.to_tuple()[1] is logits
        assert pytree.tree_leaves(out)[1] is logits and dict(out)["logits"] is logits
        read = _gathers(m, "forward")[len(before):]
        _logits_loss(logits, ids).backward()
        return logits.detach(), read, _gathers(m, "backward"), \
            autotp.full_state_dict(m, grads=True)

    ref_out, ref_grads = _reference(model, ids, lambda out: _logits_loss(out.logits, ids))
    for logits, read, backward, grads in sim.run(step):
        assert read == [("logits S(2)->R, read", logits.numel() * 4)], read
        assert backward == []  # the gather's backward is this rank's slice
        assert (logits - ref_out.logits).abs().max() <= ATOL
        _assert_grads(grads, ref_grads)


def test_gather_outputs_always_gathers_the_logits_in_the_forward() -> None:
    model, ids = llama().train(), _ids()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids},
                          gather_outputs="always")
    assert sim.plan.gathered_when_read == {} and sim.plan.outputs == ["R", "R"]
    gathers = [c.bytes_expr for c in sim.plan.collectives if c.kind == "all_gather"]
    assert sorted(gathers) == ["512*B*T", "8*B*T"], gathers  # B x T x 128 x 4 bytes

    def step(m: Any) -> tuple[list, Any]:
        out = m(input_ids=ids, labels=ids)
        return _gathers(m, "forward"), out

    ref = model(input_ids=ids, labels=ids)
    for forward, out in sim.run(step):
        assert sorted(n for _, n in forward) == [2 * ids.numel() * 4, ref.logits.numel() * 4]
        assert type(out) is type(ref)
        assert (out.logits - ref.logits).abs().max() <= ATOL


def test_without_labels_the_logits_are_gathered_in_the_forward() -> None:
    model, ids = llama().eval(), _ids()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})
    assert sim.plan.gathered_when_read == {} and sim.plan.outputs == ["R"]

    def step(m: Any) -> tuple[list, Any]:
        with torch.no_grad():
            out = m(input_ids=ids)
        return _gathers(m, "forward"), out

    with torch.no_grad():
        ref = model(input_ids=ids)
    for forward, out in sim.run(step):
        assert [n for _, n in forward] == [ref.logits.numel() * 4]
        assert type(out) is type(ref)
        assert (out.logits - ref.logits).abs().max() <= ATOL


def test_logits_read_on_one_rank_only_say_so() -> None:
    """Reading is a collective: a rank that reads alone waits for the others and fails in
    autotp's words, naming the option that gathers in the forward."""
    model, ids = llama().train(), _ids()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids},
                          timeout=2.0)

    def step(m: Any) -> Any:
        out = m(input_ids=ids, labels=ids)
        return out.logits if m.rank == 0 else out.loss

    with pytest.raises(CollectiveError, match="out.logits is gathered when read: read it on "
                                              "every rank, or pass gather_outputs=\"always\""):
        sim.run(step)


class DictHead(torch.nn.Module):
    """A model of its own returning a dict with its loss (vocabulary-parallel: logsumexp and
    gather over the sharded vocabulary), or the same as a tuple."""

    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple
        self.emb = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> Any:
        logits = self.head(torch.relu(self.proj(self.emb(ids))))  # (B, T, V)
        lse = torch.logsumexp(logits, dim=-1)
        loss = (lse - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()
        return (loss, logits) if self.as_tuple else {"loss": loss, "logits": logits}


def test_a_dict_is_gathered_when_read_and_a_tuple_in_the_forward() -> None:
    """A plain dict's tensor fields are gathered when read by key (not as attributes); a
    tuple is unpacked whole, so its outputs are gathered in the program."""
    torch.manual_seed(0)
    ids, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    model = DictHead()
    sim = autotp.simulate(model, 2, example_args=(ids, targets))
    assert sim.plan.gathered_when_read == {"logits": "S(2)"}

    def step(m: Any) -> tuple[list, Any, bool]:
        out = m(ids, targets)
        out["loss"].backward()
        before = _gathers(m, "forward")
        no_attribute = not hasattr(out, "logits")  # a dict's key is no attribute: no read
        return before + _gathers(m, "forward")[len(before):], dict(out), no_attribute

    want = model(ids, targets)
    for gathered, out, no_attribute in sim.run(step):
        assert [n for _, n in gathered] == [2 * ids.numel() * 4] and no_attribute
        assert (out["logits"] - want["logits"]).abs().max() <= ATOL
        assert abs(out["loss"].item() - want["loss"].item()) <= ATOL

    pair = DictHead(as_tuple=True)
    pair.load_state_dict(model.state_dict())
    assert autotp.plan(pair, 2, example_args=(ids, targets)).gathered_when_read == {}


def gloo_case(rank: int, world_size: int) -> dict[str, Any]:
    """One step on a process group reading only the loss, then the logits read on every
    rank and a loss of them back-propagated: what ran, and the differences."""
    torch.set_num_threads(1)
    model, ids = llama().train(), _ids()
    sharded = autotp.parallelize(model, example_kwargs={"input_ids": ids, "labels": ids})
    out = sharded(input_ids=ids, labels=ids)
    out.loss.backward(retain_graph=True)  # the logits' loss goes through the same graph
    loss_only = _gathers(sharded, "forward") + _gathers(sharded, "backward")
    loss_grads = autotp.full_state_dict(sharded, grads=True)
    sharded.zero_grad()
    sharded.comm.log.clear()
    logits = out.logits
    _logits_loss(logits, ids).backward()
    read = _gathers(sharded, "forward") + _gathers(sharded, "backward")
    ref_out, ref_loss_grads = _reference(model, ids, lambda o: o.loss)
    _, ref_logits_grads = _reference(model, ids, lambda o: _logits_loss(o.logits, ids))
    _assert_grads(loss_grads, ref_loss_grads)
    _assert_grads(autotp.full_state_dict(sharded, grads=True), ref_logits_grads)
    return {"loss_only": loss_only, "read": read,
            "loss_diff": abs(out.loss.item() - ref_out.loss.item()),
            "logits_diff": (logits - ref_out.logits).abs().max().item(),
            "logits_bytes": logits.numel() * logits.element_size()}


def test_on_gloo_processes_the_logits_are_gathered_only_when_read() -> None:
    for r in run_processes(gloo_case, 2, timeout=300):
        assert r["loss_only"] == [("logsumexp_default P(lse)->R", 2 * 2 * 12 * 4)], r
        assert r["read"] == [("logits S(2)->R, read", r["logits_bytes"])], r
        assert r["loss_diff"] <= ATOL and r["logits_diff"] <= ATOL, r


def test_gather_outputs_takes_its_names_and_the_earlier_booleans() -> None:
    read = Options().plan_options().gather_outputs
    assert read is OutputGather.READ
    assert Options(gather_outputs=True).plan_options().gather_outputs is OutputGather.ALWAYS
    assert Options(gather_outputs=False).plan_options().gather_outputs is OutputGather.NEVER
    assert Options(gather_outputs="never").plan_options().gather_outputs is OutputGather.NEVER
    with pytest.raises(ConfigError, match="gather_outputs takes one of"):
        Options(gather_outputs="lazy").plan_options()
