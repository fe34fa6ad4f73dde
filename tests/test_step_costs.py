"""A rank's training step runs the unsharded model's kernels plus its collectives: no host
synchronization for a mask the program can decide, no copy of the keys and values for grouped
queries, no zero-filled gradient of a whole-dim slice, no copy of an all-reduce's operand where
nothing else reads it, and a collective log that stays bounded. Every check also compares the
step with the unsharded model's (``benchmarks/step_costs.py`` measures the same on gloo)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp.verification.verify import assert_equivalent, compare, reference_step, sharded_step
from autotp.runtime.causal import SDPA_CALL, CausalWhereMasked
from autotp.runtime.collectives import Redistribute
from autotp.runtime.comm import LOG_EVENTS, CollectiveLog
from autotp.runtime.launch import run_processes
from autotp.runtime.layers import program_nodes
from tests.models import BUILDERS, VOCAB, llama_config, perturb, quiet_transformers

HOST_SYNCS = {"aten::equal", "aten::_local_scalar_dense", "aten::is_nonzero"}


class Ops(TorchDispatchMode):
    """The ops dispatched under it, by schema name (thread-local: one simulated rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return sum(self.ops[k] for k in HOST_SYNCS)


def _step_ops(module: torch.nn.Module, kwargs: dict[str, Any]) -> Ops:
    """The ops of one training step, after one that warms (traces, checks the plan)."""
    for counting in (False, True):
        module.zero_grad(set_to_none=True)
        ops = Ops()
        with ops if counting else torch.enable_grad():
            module(**kwargs).loss.backward()
    return ops


def _ids(t: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(0))


def test_a_causal_step_synchronizes_the_host_no_more_than_the_unsharded_model() -> None:
    """tp 2, no padding: the traced mask reads sizes alone, so the program decides it once
    per size (no mask op, no comparison after the first step); a padded batch compares its
    mask once per forward for all layers. Exact against the unsharded model either way."""
    model = BUILDERS["llama"]().train()
    ids = _ids()
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    for padded in (False, True):
        kwargs = {"input_ids": ids, "labels": ids}
        if padded:
            kwargs["attention_mask"] = padding
        reference = _step_ops(model, kwargs)
        sim = autotp.simulate(model, 2, example_kwargs=kwargs)
        assert_equivalent(model, sim, kwargs=kwargs, loss_fn=lambda out: out.loss,
                          pick=lambda out: out.logits)
        for ops in sim.run(lambda m, kw=kwargs: _step_ops(m, kw)):
            # padded: one comparison for all layers (transformers' eager run reads the
            # padding mask on the host itself)
            assert ops.ops["aten::equal"] == padded, ops.ops
            assert ops.syncs <= reference.syncs + padded, (ops.syncs, reference.syncs)
        (checker,) = {m for m in sim.ranks[0].program.modules()
                      if isinstance(m, CausalWhereMasked)}
        assert (checker.recipe is None) == padded
        if not padded:
            assert checker.checks == 1 and checker.masked_calls == 0  # one size, one check
            assert ops.ops["aten::tril"] == reference.ops["aten::tril"] == 0


def test_grouped_keys_and_values_reach_the_kernel_unrepeated() -> None:
    """tp 2 holds the 2 key/value heads as the 8 query heads (one each per rank): attention
    takes them with ``enable_gqa`` as the eager model does, and no whole-dim slice is left
    (its backward would zero-fill and copy a gradient). At tp 4 the key/value heads are
    not held as the queries: repeated as traced. Exact at both degrees."""
    model = BUILDERS["llama"]().train()
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    reference = _step_ops(model, kwargs)
    for tp, grouped in ((2, True), (4, False)):
        sim = autotp.simulate(model, tp, example_kwargs=kwargs)
        assert_equivalent(model, sim, kwargs=kwargs, loss_fn=lambda out: out.loss,
                          pick=lambda out: out.logits)
        nodes = list(program_nodes(sim.ranks[0].program))
        calls = [n for n in nodes if n.meta.get(SDPA_CALL)]
        assert calls and all(bool(n.kwargs.get("enable_gqa")) == grouped for n in calls)
        assert not any(n.target == torch.ops.aten.slice.Tensor and n.args[2:4] in
                       ((0, 2**63 - 1), (0, None)) for n in nodes)
        if grouped:
            ops = sim.run(lambda m: _step_ops(m, kwargs))[0]
            assert ops.ops["aten::slice_backward"] == reference.ops["aten::slice_backward"]


def test_attention_dropout_draws_its_seeds_on_the_host() -> None:
    """Dropout inside attention: each call's seed comes from the tracker's stream without a
    value read back from the device; ranks draw the same replicated masks (the loss agrees)
    and successive calls draw different ones."""
    tf = quiet_transformers()
    torch.manual_seed(0)
    model = perturb(tf.LlamaForCausalLM(llama_config(attention_dropout=0.5)), seed=1).train()
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    sim = autotp.simulate(model, 2, example_kwargs=kwargs)
    runs = sim.run(lambda m: _step_ops(m, kwargs))
    assert all(ops.ops["aten::_local_scalar_dense"] == 0 for ops in runs), runs[0].ops
    losses = sim.run(lambda m: [float(m(**kwargs).loss) for _ in range(2)])
    assert losses[0] == losses[1] and losses[0][0] != losses[0][1]


def test_the_collective_log_stays_bounded_and_keeps_totals() -> None:
    log = CollectiveLog()
    steps = 3 * LOG_EVENTS // 4
    for _ in range(steps):  # four collectives a step
        log.record("all_reduce", "forward", 0, 8, "a")
        log.record("all_reduce", "backward", 0, 8, "a")
        log.record("all_gather", "forward", 1, 16, "b")
        log.record("all_gather", "forward", 1, 16, "b")
    assert len(log.events) == LOG_EVENTS
    assert log.totals[("forward", "all_gather")].calls == 2 * steps
    assert log.totals[("forward", "all_gather")].nbytes == 32 * steps
    assert log.totals[("backward", "all_reduce")].calls == steps
    log.clear()
    assert not log.events and not log.totals


def test_all_reduces_sum_in_place_only_what_nothing_else_reads() -> None:
    """The row-parallel products' partial outputs are summed in place (read by their
    all-reduce alone); the f operators' gradients too (read by products alone); a partial
    value something else reads, the loss's logsumexp, is not. Exact (simulated, where an
    in-place sum writes the operand as a process group does)."""
    model = BUILDERS["llama"]().train()
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    sim = autotp.simulate(model, 2, example_kwargs=kwargs, gather_outputs=False)
    assert_equivalent(model, sim, kwargs=kwargs, loss_fn=lambda out: out.loss,
                      pick=lambda out: out.loss)
    reduces = [m for m in sim.ranks[0].program.modules() if isinstance(m, Redistribute)]
    forward = [m for m in reduces if m.reduce_in_place]
    backward = [m for m in reduces if m.grad_in_place]
    layers = llama_config().num_hidden_layers
    assert len(forward) >= 2 * layers and len(backward) >= 2 * layers, (forward, backward)
    assert not any(m.reduce_in_place for m in reduces if "logsumexp" in m.label)


# ---- on gloo: the communicator's own copies ----------------------------------------------

def costs_case(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Per option: the step's ops against the unsharded model's, and the comparison."""
    torch.set_num_threads(1)
    rows = []
    for options in ({}, {"sequence_parallel": True}):
        model = BUILDERS["llama"]().train()
        ids = _ids()
        kwargs = {"input_ids": ids, "labels": ids}
        reference_ops = _step_ops(model, kwargs)
        sharded = autotp.parallelize(model, example_kwargs=kwargs, gather_outputs=False,
                                     **options)
        ops = _step_ops(sharded, kwargs)
        def call(m: torch.nn.Module, kw: dict[str, Any] = kwargs) -> Any:
            return m(**kw)

        cmp = compare(reference_step(model, call, lambda o: o.loss, lambda o: o.loss),
                      sharded_step(sharded, call, lambda o: o.loss, lambda o: o.loss))
        rows.append({"options": options, "ops": dict(ops.ops),
                     "reference": dict(reference_ops.ops), "loss_diff": cmp.loss_diff,
                     "grad_rel": cmp.grad_rel, "events": len(sharded.comm.log.events)})
    return rows


def test_gloo_ranks_copy_no_all_reduce_operand_and_move_no_dims_twice() -> None:
    """Process groups reduce in place: at tp 2 the step clones no more than the unsharded
    one; with sequence parallelism each gather or scatter along the sequence copies once
    (no permute before or after). Exact against the unsharded model."""
    for rows in run_processes(costs_case, 2):
        plain, sequence = rows
        for row in rows:
            assert row["loss_diff"] <= 1e-5 and row["grad_rel"] <= 1e-4, row
        assert plain["ops"].get("c10d::allreduce_", 0) > 0
        assert plain["ops"].get("aten::clone", 0) <= plain["reference"].get("aten::clone", 0)
        assert sequence["ops"].get("aten::permute", 0) <= \
            sequence["reference"].get("aten::permute", 0), sequence["ops"]
        assert sequence["ops"].get("aten::detach", 0) - \
            sequence["reference"].get("aten::detach", 0) < 64, sequence["ops"]


def leading_ones_case(rank: int, world_size: int) -> dict[str, Any]:
    """A gather and a scatter along dim 1 of a batch of one, on gloo: values and ops."""
    from autotp.runtime.comm import ProcessGroupComm

    comm = ProcessGroupComm()
    full = torch.arange(24.0).view(1, 6, 4)
    shard = full[:, 3 * rank: 3 * rank + 3].contiguous()
    ops = Ops()
    with ops:
        gathered = comm.all_gather(shard, 1)
        scattered = comm.reduce_scatter(full * (rank + 1), 1)
    comm.native_reduce_scatter = False  # older gloo: an all-reduce (in place) and a slice
    operand = full * (rank + 1)
    sliced = comm.reduce_scatter(operand, 1)
    return {"gathered": gathered.equal(full), "gathered_shape": list(gathered.shape),
            "scattered": scattered.equal(3 * shard) and sliced.equal(3 * shard)
            and operand.equal(full * (rank + 1)), "ops": dict(ops.ops)}


def test_a_batch_of_one_gathers_and_scatters_along_the_sequence_without_a_copy() -> None:
    """Along a dim whose preceding dims are all 1 the ranks' blocks lie end to end, as along
    dim 0: the communicator neither splits nor concatenates around the collective."""
    for row in run_processes(leading_ones_case, 2):
        assert row["gathered"] and row["scattered"], row
        assert row["gathered_shape"] == [1, 6, 4]
        assert not row["ops"].get("aten::cat") and not row["ops"].get("aten::clone"), row
        # gloo's own reduce-scatter splits its result once (NCCL does not): none of ours
        assert row["ops"].get("aten::split", 0) <= 1, row["ops"]


@pytest.mark.parametrize("name", ["gpt2"])
def test_other_families_stay_exact(name: str) -> None:
    """A fused q|k|v (GPT-2's Conv1D) and no grouped heads: the passes leave it exact."""
    model = BUILDERS[name]().train()
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    for sp in (False, True):
        assert_equivalent(model, 2, kwargs=kwargs, loss_fn=lambda out: out.loss,
                          pick=lambda out: out.loss, sequence_parallel=sp)


def test_a_compiled_program_reads_a_decided_causal_mask_inside_its_graphs() -> None:
    """compile=: once a size's mask is known causal, the attention is traced into the
    compiled graph (no break at it); exact against the unsharded model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = BUILDERS["llama"]().train()
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    torch._dynamo.reset()
    sim = autotp.simulate(model, 2, example_kwargs=kwargs, compile={"backend": "eager"})
    sim.run(lambda m: m(**kwargs).loss.backward())
    (checker,) = {m for m in sim.ranks[0].program.modules() if isinstance(m, CausalWhereMasked)}
    eager_calls = checker.causal_calls  # the first step's, before the size was known
    counters.clear()
    assert_equivalent(model, sim, kwargs=kwargs, loss_fn=lambda out: out.loss,
                      pick=lambda out: out.logits, atol=1e-4)
    assert checker.causal_calls == eager_calls  # every later call ran compiled
    reasons = " ".join(str(k) for k in counters["graph_break"])
    assert "CausalWhereMasked" not in reasons, reasons
