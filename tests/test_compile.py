"""compile= on process groups compiles the whole rank program: a training step of the
compiled program breaks no graph at tp 2, tp 2 with sequence parallelism and cp 2 (its
collectives, the ring and the causal attention traced: ``runtime/comm.py``), and equals the
unsharded model's step. Two gloo processes, the test LLaMA (GQA, sdpa, loss by labels),
the aot_eager backend (AOT autograd compiles backward too; no C++ toolchain). With dropout
(the test GPT-2, tp 2) no graph breaks either, and the compiled steps draw the eager rank
program's masks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autotp
from autotp.runtime.comm import ProcessGroupComm
from autotp.runtime.launch import run_processes
from autotp.verification.verify import compare, reference_step, sharded_step
from tests.models import BUILDERS, VOCAB

CASES = {"tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True},
         "cp2": {"tp": 1, "cp": 2}}


def compiled_step(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """The graph breaks of the first compiled training step (it traces), and the second
    step against the unsharded model's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    model = BUILDERS["llama"]().train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    sharded = autotp.parallelize(model, example_kwargs=kwargs, gather_outputs=False,
                                 compile={"backend": "aot_eager"}, **CASES[case])

    def call(m: torch.nn.Module) -> Any:
        return m(**kwargs)

    def loss(out: Any) -> torch.Tensor:
        return out.loss

    torch._dynamo.reset()
    counters.clear()
    sharded.comm.log.clear()
    sharded_step(sharded, call, loss, loss)
    breaks = {str(reason).splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    graphs = int(counters["stats"]["unique_graphs"])
    got = sharded_step(sharded, call, loss, loss)
    cmp = compare(reference_step(model, call, loss, loss), got)
    row = {"breaks": breaks, "graphs": graphs, "loss_diff": cmp.loss_diff,
           "grad_rel": cmp.grad_rel, "logged": len(sharded.comm.log.events)}
    if case == "tp2":  # another length: a graph of its own sizes, the mask decided again
        kwargs["input_ids"] = kwargs["labels"] = ids[:, :8]
        counters.clear()
        got = sharded_step(sharded, call, loss, loss)
        cmp = compare(reference_step(model, call, loss, loss), got)
        row["other_length"] = {"breaks": dict(counters["graph_break"]),
                               "loss_diff": cmp.loss_diff, "grad_rel": cmp.grad_rel}
    return row


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_training_step_breaks_no_graph_and_matches_the_unsharded_model(
        case: str) -> None:
    """0 graph breaks per rank; float32: loss within 1e-5, every gradient within 1e-4 of
    the largest (``verification.verify.compare``). The compiled program's collectives run
    in its graphs, not through the log. At tp 2 a shorter sequence after: compiled for its
    sizes, no break, as exact."""
    for row in run_processes(compiled_step, 2, case):
        assert row["breaks"] == {}, row["breaks"]
        assert row["graphs"] >= 1, row
        assert row["loss_diff"] <= 1e-5 and row["grad_rel"] <= 1e-4, row
        assert row["logged"] == 0, row
        other = row.get("other_length", {"breaks": {}, "loss_diff": 0.0, "grad_rel": 0.0})
        assert other["breaks"] == {} and other["loss_diff"] <= 1e-5 and \
            other["grad_rel"] <= 1e-4, other


def subgroup_collectives(rank: int, world_size: int) -> Any:
    """Ranks 1 and 2 of 3 as a group (group ranks 0 and 1): each collective eagerly and
    compiled whole (fullgraph)."""
    import torch.distributed as dist

    group = dist.new_group([1, 2])
    if rank not in (1, 2):
        return None
    comm = ProcessGroupComm(group)
    x = torch.arange(4.0) + 10 * rank
    ops = {"shift": lambda t: comm.shift(t), "all_gather": lambda t: comm.all_gather(t, 0),
           "all_reduce": lambda t: comm.all_reduce(t),
           "reduce_scatter": lambda t: comm.reduce_scatter(t, 0),
           "all_to_all": lambda t: comm.all_to_all(t, [2, 2], [2, 2])}
    return {name: (op(x).tolist(),
                   torch.compile(op, backend="aot_eager", fullgraph=True)(x).tolist())
            for name, op in ops.items()}


def test_traced_collectives_of_a_subgroup_match_the_eager_ones() -> None:
    """A group whose ranks are not the global ones: traced point-to-point ops name the
    group's ranks (eager ones global ranks); every traced collective gives what the eager
    one gives."""
    rows = run_processes(subgroup_collectives, 3)
    assert rows[0] is None
    for row in rows[1:]:
        for name, (eager, traced) in row.items():
            assert eager == traced, (name, eager, traced)
    assert rows[1]["shift"][0] == [20.0, 21.0, 22.0, 23.0]  # from the group's other rank


def dropout_steps(rank: int, world_size: int) -> dict[str, Any]:
    """Two training steps of the test GPT-2 with every dropout on (embeddings, attention in
    the kernel, residuals), tp 2: eagerly, then compiled from the same weights and seed (the
    first compiled step traces: its breaks and graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.models import batch, gpt2_config, quiet_transformers

    torch.set_num_threads(1)
    ids = batch()
    kwargs = {"input_ids": ids, "labels": ids}

    def call(m: torch.nn.Module) -> Any:
        return m(**kwargs)

    def loss(out: Any) -> torch.Tensor:
        return out.loss

    steps, row = {}, {}
    for compile in (False, {"backend": "aot_eager"}):
        torch.manual_seed(0)  # the same weights, and the same dropout seed (initial_seed)
        model = quiet_transformers().GPT2LMHeadModel(gpt2_config(
            resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)).train()
        sharded = autotp.parallelize(model, example_kwargs=kwargs, gather_outputs=False,
                                     tp=2, compile=compile)
        torch._dynamo.reset()
        counters.clear()
        steps[bool(compile)] = [sharded_step(sharded, call, loss, loss) for _ in range(2)]
        row["draws"] = sorted({type(m).__name__ for m in sharded.program.modules()
                               if type(m).__name__.startswith("Tracked")})
        if compile:
            row["breaks"] = {str(reason).splitlines()[0]: n
                             for reason, n in counters["graph_break"].items()}
            row["graphs"] = int(counters["stats"]["unique_graphs"])
    row["losses"] = [step.loss for step in steps[False]]
    row["diffs"] = [(c.loss_diff, c.grad_rel)
                    for c in map(compare, steps[False], steps[True])]
    return row


def test_a_compiled_step_with_dropout_breaks_no_graph_and_draws_the_eager_masks() -> None:
    """Dropout's draws are ops of the compiled graph (``runtime/random.py``): 0 breaks, and
    each compiled step draws the masks the eager rank program draws (loss within 1e-5, every
    gradient within 1e-4 of the largest; other masks would move them by far more). The two
    steps draw different masks: their losses differ."""
    for row in run_processes(dropout_steps, 2):
        assert row["draws"] == ["TrackedAttention", "TrackedDropout"], row
        assert row["breaks"] == {}, row["breaks"]
        assert row["graphs"] >= 1, row
        assert abs(row["losses"][0] - row["losses"][1]) > 1e-4, row
        for loss_diff, grad_rel in row["diffs"]:
            assert loss_diff <= 1e-5 and grad_rel <= 1e-4, row
