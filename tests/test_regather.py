"""Sequence parallelism keeps the sequence shard of every gathered input autograd saves and
gathers it again in backward (``autotp.runtime.regather``), as Megatron-LM does.

Memory is counted as ``benchmarks/sequence_memory.py`` counts it, with
``autotp.verification.saved_tensors.count_saved``: a saved-tensor hook pair set around the forward
sees every tensor autograd keeps, once per storage, parameters excluded. That pair is the
outer one; the program's own pair hands it what it really keeps.
Numbers are compared with ``keep_gathered=True`` (the gathered inputs kept whole) and with the
unsharded model (tolerances as in test_vocab_sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import autotp
from autotp.verification.saved_tensors import count_saved
from autotp.runtime.collectives import Redistribute
from autotp.layout import Replicate, Shard, parse_layout, unshard_tensor
from autotp.runtime.regather import ShardKeeper
from autotp.verification.verify import (StepResult, compare, max_difference, reference_step,
                                    sharded_step)
from tests.models import BUILDERS, VOCAB, batch

ATOL = 1e-4


def _simulate(name: str, tp: int, b: int = 3, **options: Any
              ) -> tuple[torch.nn.Module, autotp.Simulation]:
    """``name`` at ``tp`` with sequence parallelism, traced at batch ``b``: one tp does not
    divide (3) splits the sequence; one it divides, the batch (``PlanOptions.batch_tokens``)."""
    model = BUILDERS[name]()
    ids = torch.randint(0, VOCAB, (b, 16), generator=torch.Generator().manual_seed(1))
    sim = autotp.simulate(model, tp, example_kwargs={"input_ids": ids, "labels": ids},
                          sequence_parallel=True, gather_outputs=False, **options)
    return model, sim


def _gathers(module: torch.nn.Module) -> list[Redistribute]:
    return [m for m in module.modules() if isinstance(m, Redistribute)
            and isinstance(m.src, Shard) and isinstance(m.dst, Replicate)]


@dataclass
class Saved:
    total: int  # bytes of every storage autograd keeps, parameters excluded
    gathered_saved: int  # gathered outputs (or views of them) among them
    gathered_bytes: int  # the bytes of all the gathered outputs
    shard_bytes: int  # the bytes of their shards
    shards_seen: int  # shards among the saved storages


def _saved(module: torch.nn.Module, call: Callable[[torch.nn.Module], Any]) -> Saved:
    """What one forward leaves for backward on this rank. The weak storage references are
    held to the end, so that no storage address is reused within the count."""
    gathered: dict[StorageWeakRef, int] = {}
    shards: dict[StorageWeakRef, int] = {}

    def note(_module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        gathered[StorageWeakRef(output.untyped_storage())] = output.untyped_storage().nbytes()
        shards[StorageWeakRef(inputs[0].untyped_storage())] = inputs[0].untyped_storage().nbytes()

    handles = [m.register_forward_hook(note) for m in _gathers(module)]
    try:
        with count_saved(exclude=module.parameters()) as saved:
            out = call(module)
    finally:
        for handle in handles:
            handle.remove()
    del out
    return Saved(saved.nbytes, len(saved.storages & gathered.keys()), sum(gathered.values()),
                 sum(shards.values()), len(saved.storages & shards.keys()))


@pytest.mark.parametrize("b, split", [(3, "S(1)"), (4, "S(0)")], ids=["sequence", "batch"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_saved_activations_hold_shards_not_gathered_inputs(name: str, b: int,
                                                           split: str) -> None:
    """Every input the plan all-gathers along the sequence (or, where tp divides the batch,
    along the batch) is read by a product that saves it: kept whole, the saved bytes
    include it; kept as the shard, no saved tensor views a gathered output and the bytes
    drop by the gathered inputs less their shards."""
    tp = 2
    _, whole = _simulate(name, tp, b, keep_gathered=True)
    _, kept = _simulate(name, tp, b)
    planned = [c for c in kept.plan.collectives
               if c.kind == "all_gather" and c.phase == "forward" and c.src.startswith("S")]
    assert len(planned) == 2 * 2 + 1, planned  # 2 layers, and the head's input
    assert {c.src for c in planned} == {split}, planned
    assert kept.plan.batch_tokens == (split == "S(0)")
    ids = batch(b=b + 2, t=12)

    def call(m: torch.nn.Module) -> Any:
        return m(input_ids=ids, labels=ids)

    before, after = whole.run(lambda m: _saved(m, call)), kept.run(lambda m: _saved(m, call))
    for b, a in zip(before, after):
        assert b.gathered_saved == len(planned), b
        assert a.gathered_saved == 0, a
        assert a.shards_seen == len(planned), a  # the outer hooks count what is kept
        assert a.gathered_bytes == b.gathered_bytes == tp * a.shard_bytes
        assert b.total - a.total == a.gathered_bytes - a.shard_bytes, (b, a)


def _step_matches(model: torch.nn.Module, sim: autotp.Simulation,
                  call: Callable[[torch.nn.Module], Any],
                  loss: Callable[[Any], torch.Tensor] = lambda out: out.loss,
                  logits: Callable[[Any], torch.Tensor] = lambda out: out.logits,
                  scale: float = 1.0) -> list[StepResult]:
    reference = reference_step(model, call, loss, logits)
    results = sim.run(lambda m: sharded_step(m, call, loss, logits))
    full_logits = unshard_tensor([r.output for r in results], parse_layout("S(2)"))
    for rank, result in enumerate(results):
        result.output = full_logits
        result.grads = {n: g / scale for n, g in result.grads.items()}
        cmp = compare(reference, result)
        assert cmp.output_diff <= ATOL and cmp.loss_diff <= ATOL, (rank, cmp)
        assert cmp.grad_diff <= ATOL and cmp.grad_rel <= ATOL, (rank, cmp)
    return results


def test_the_mlp_gathers_and_scatters_its_rows_along_dim_0() -> None:
    """Only row-wise ops read the MLP's gathered input up to its reduce-scatter: both run
    along dim 0 (the ranks' rows end to end, no interleaving copy), the attention's gather
    along the sequence. The step is exact; the values between hold rows in another order,
    named apart so that ``first_divergence`` does not compare them."""
    model, sim = _simulate("llama", 2)
    modules = [m for m in sim.ranks[0].program.modules() if isinstance(m, Redistribute)]
    rows = [m for m in modules if m.rank_rows]
    layers = 2
    assert len([m for m in rows if isinstance(m.src, Shard)]) == layers, rows
    assert len([m for m in rows if isinstance(m.dst, Shard)]) == layers, rows
    assert len(_gathers(sim.ranks[0].program)) == 2 * layers + 1
    ids = batch(t=12)
    _step_matches(model, sim, lambda m: m(input_ids=ids, labels=ids))
    moved = {k for k, v in sim.ranks[0].program.meta["autotp_values"].items()
             if v.endswith("(rank-major rows)")}
    assert len(moved) == 5 * layers, moved  # gate, silu, up, their product, down


def _regathers(sim: autotp.Simulation) -> list[int]:
    return [sum(1 for e in m.comm.log.events if e.label.endswith("re-gathered"))
            for m in sim.ranks]


def test_hooks_set_outside_get_the_shards_and_give_them_back() -> None:
    """save_on_cpu around the call: it stores copies of what the program keeps (the shards),
    the program gathers them again, and every gradient matches the unsharded model."""
    model, sim = _simulate("llama", 2)
    ids = batch(t=12)

    def call(m: torch.nn.Module) -> Any:
        with torch.autograd.graph.save_on_cpu():
            return m(input_ids=ids, labels=ids)

    _step_matches(model, sim, call)
    assert _regathers(sim) == [5, 5]  # one per gathered input: 2 per layer, and the head's


def test_activation_checkpointing_per_layer_and_around_the_model() -> None:
    """checkpoint_wrapper on each layer (its pair is innermost there: the layer stores
    nothing and recomputes), then torch.utils.checkpoint around the whole call (its pair is
    outermost: the program hands it the shards, the recomputation gathers them again)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    model, sim = _simulate("llama", 2)
    ids = batch(t=12)

    def around(m: torch.nn.Module) -> Any:
        return checkpoint(lambda: m(input_ids=ids, labels=ids), use_reentrant=False)

    _step_matches(model, sim, around)
    assert _regathers(sim) == [5, 5]

    def wrap(m: autotp.ShardedModule) -> None:
        for i, layer in enumerate(m.model.layers):
            m.model.layers[i] = checkpoint_wrapper(layer)
        m.comm.log.clear()

    sim.run(wrap)
    results = sim.run(lambda m: sharded_step(m, lambda x: x(input_ids=ids, labels=ids),
                                             lambda out: out.loss, lambda out: out.logits))
    reference = reference_step(model, lambda x: x(input_ids=ids, labels=ids),
                               lambda out: out.loss, lambda out: out.logits)
    for result in results:
        renamed = {n.replace("._checkpoint_wrapped_module", ""): g
                   for n, g in result.grads.items()}
        assert max_difference(reference.grads, renamed) <= ATOL  # the logits: vocab shards
    assert _regathers(sim) == [1, 1]  # only the head's input: the layers recompute theirs


def test_a_retained_graph_gathers_again_on_each_backward() -> None:
    """Two backwards of one retained graph: gradients twice the unsharded model's, the
    gathered inputs re-gathered once per backward."""
    model, sim = _simulate("gpt2", 2)
    ids = batch(t=12)

    def twice(m: torch.nn.Module) -> Any:
        out = m(input_ids=ids, labels=ids)
        out.loss.backward(retain_graph=True)
        return out

    def loss(out: Any) -> torch.Tensor:
        return out.loss

    reference = reference_step(model, lambda x: x(input_ids=ids, labels=ids), loss,
                               lambda out: out.logits)
    results = sim.run(lambda m: sharded_step(m, twice, loss, lambda out: out.logits))
    for result in results:
        halved = {n: g / 2 for n, g in result.grads.items()}
        assert max_difference(reference.grads, halved) <= ATOL
    assert _regathers(sim) == [10, 10]


# ---- the keeper on its own: a stand-in gather, a view saved at an offset --------------------


class _Doubling:
    """Gathers a shard as [shard; 2 * shard], counting the re-gathers."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        return torch.cat([shard, 2 * shard])

    def regather(self, shard: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self(shard)


def _products(keeper: ShardKeeper | None, gather: _Doubling, tamper: bool = False,
              frozen: bool = False) -> list[torch.Tensor]:
    """Two products read one view (at an offset) of a gathered tensor; their weights'
    gradients read the view back. ``frozen``: the shard needs no gradient."""
    generator = torch.Generator().manual_seed(0)
    shard = torch.randn(3, 4, generator=generator).requires_grad_(not frozen)
    w1 = torch.randn(3, 2, generator=generator).requires_grad_()
    w2 = torch.randn(3, 4, generator=generator).requires_grad_()
    with keeper.saving() if keeper is not None else torch.enable_grad():
        full = gather(shard)  # [6, 4]
        if keeper is not None:
            keeper.record(full, shard, gather)
        view = full.view(4, 6)[1:].t()  # [6, 3], strides (1, 6), at storage offset 6
        out = (view @ w1).sum() + (view @ w2).square().sum()
    if tamper:
        with torch.no_grad():
            shard.add_(1.0)
    out.backward()
    return [t.grad for t in (shard, w1, w2) if t.grad is not None]


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_saved_view_is_rebuilt_from_one_regather(frozen: bool) -> None:
    """Also when the gathered input needs no gradient (frozen layers below): the products
    still save it for their weights' gradients."""
    gather = _Doubling()
    expected = _products(None, gather, frozen=frozen)
    got = _products(ShardKeeper(), gather, frozen=frozen)
    assert len(got) == len(expected) == (2 if frozen else 3)
    for want, have in zip(expected, got):
        assert torch.allclose(want, have, atol=1e-6)
    assert gather.calls == 1  # two saves of one gathered tensor, one re-gather


def test_a_product_saves_its_weight_without_an_alias() -> None:
    """A product of a whole gathered input saves its shard without hooks
    (``ShardKeeper.product``); a product of a view of it runs under the keeper's hooks, which
    store its weight's transpose as it is (a product saves only its inputs, none holding the
    node that saves it). Neither detaches; one re-gather serves both; the gradients are the
    unkept products'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotp.runtime.regather import KeptReads

    class Detaches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: Any = None) -> Any:
            self.count += func is torch.ops.aten.detach.default
            return func(*args, **(kwargs or {}))

    def step(keeper: ShardKeeper | None) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        shard = torch.randn(2, 3, 4, requires_grad=True)
        w = torch.randn(5, 4, requires_grad=True)
        gather = _Doubling()
        counted = Detaches()
        linear = torch.ops.aten.linear.default
        if keeper is None:
            full = gather(shard)
            ys = [linear(full, w), linear(full[2:], w)]
        else:
            with keeper.saving():
                full = gather(shard)
                keeper.record(full, shard, gather)
                with counted:
                    ys = [KeptReads(keeper, linear)(x, w) for x in (full, full[2:])]
        sum(y.square().sum() for y in ys).backward()
        assert keeper is None or gather.calls == 1  # kept as the shard, gathered again
        return counted.count, [shard.grad, w.grad]

    keeper = ShardKeeper(scoped=True)
    detaches, grads = step(keeper)
    assert detaches == 0
    for want, have in zip(step(None)[1], grads):
        assert torch.allclose(want, have, atol=1e-6)


def test_a_shard_changed_in_place_after_the_save_is_refused() -> None:
    """Hooks turn autograd's version check off; the keeper checks what it holds instead."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _products(ShardKeeper(), _Doubling(), tamper=True)
    keeper = ShardKeeper()
    x = torch.randn(4, requires_grad=True)
    with keeper.saving():
        y = (x * 2).exp()  # exp saves its output, kept as it is
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("keep", [False, True])
def test_keep_gathered_holds_under_context_parallelism(keep: bool) -> None:
    """tp 2 with sequence parallelism inside cp 2: every rank keeps what it was asked to
    (the gathered inputs, or their shards and a keeper that re-gathers them)."""
    _, sim = _simulate("llama", 2, cp=2, keep_gathered=keep)
    assert len(sim.ranks) == 4
    assert all((rank._keeper is None) == keep for rank in sim.ranks)


def test_a_call_whose_batch_tp_does_not_divide_runs_a_program_of_its_own() -> None:
    """Traced at batch 4, tp 2 splits the batch between the products (no copy at its
    collectives); a call of batch 3 runs a program planned for it, which splits the
    sequence there, on the same parameters. Its first call comes inside
    ``torch.utils.checkpoint``: tracing it saves nothing the checkpoint counts. Both steps
    are exact (gradients, loss, logits)."""
    from torch.utils.checkpoint import checkpoint

    model, sim = _simulate("llama", 2, b=4)
    assert sim.plan.batch_tokens
    even = batch(b=6, t=12)
    _step_matches(model, sim, lambda m: m(input_ids=even, labels=even))
    odd = batch(b=3, t=12)

    def around(m: torch.nn.Module) -> Any:
        return checkpoint(lambda: m(input_ids=odd, labels=odd), use_reentrant=False)

    _step_matches(model, sim, around)
    for rank in sim.ranks:
        plans = [t.plan for t in rank._traced.values()]
        assert [p.batch_tokens for p in plans] == [True, False], plans
        assert rank._traced[next(iter(rank._traced))].program is rank.program
