"""``autotp.clip_grad_norm_``: the whole model's gradient norm from each rank's shards, and
the gradients clipped by it, against ``torch.nn.utils.clip_grad_norm_`` on the unsharded
model (simulated ranks; the FSDP2 case runs in gloo processes in test_composition.py).

Tolerances: the norm and every clipped gradient within 1e-6 relative for norms of order 2
and infinity, 1e-5 for order 1 (``verify.compare``: the norm is compared as the loss, each
gradient relative to its largest entry). A 1-norm sums every |g| in float32, in another
order on the ranks than on the unsharded model: measured 1.1e-6 to 1.5e-6 relative.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import autotp
from autotp.verification.verify import StepResult, compare, reference_step
from tests.models import BUILDERS, batch, loss_of, qwen3_moe

RTOL = {2.0: 1e-6, 1.0: 1e-5, math.inf: 1e-6}  # by norm order


def _clipped_reference(model: torch.nn.Module, call, loss, max_fraction: float,
                       norm_type: float) -> tuple[StepResult, float]:
    reference = reference_step(model, call, loss, lambda out: torch.zeros(()))
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), norm_type))
    max_norm = max_fraction * norm
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    grads = {name: p.grad.detach().clone()
             for name, p in model.named_parameters(remove_duplicate=False)}
    return StepResult(reference.output, norm, grads), max_norm


NORMS = [2.0, 1.0, math.inf]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_norm_and_clipped_gradients_are_the_unsharded_models(name: str, tp: int) -> None:
    """GPT-2 (tied embeddings, Conv1D, biases kept whole) and LLaMA (GQA, 2 k/v heads: held
    whole at tp 4), norms of order 2, 1 and infinity: the norm every rank returns is the
    unsharded model's, and the gradients after clipping to a tenth of it are the unsharded
    model's clipped gradients."""
    model = BUILDERS[name]()
    ids = batch()

    def call(m: torch.nn.Module):
        return m(ids)

    def loss(out) -> torch.Tensor:
        return loss_of(out, ids)

    sim = autotp.simulate(model, tp, example_args=(ids,))
    wanted = [_clipped_reference(model, call, loss, 0.1, p) for p in NORMS]

    def step(module: autotp.ShardedModule) -> list[StepResult]:
        results = []
        for p, (_, max_norm) in zip(NORMS, wanted):
            module.zero_grad(set_to_none=True)
            loss(call(module)).backward()
            norm = autotp.clip_grad_norm_(module, max_norm, p)
            results.append(StepResult(torch.zeros(()), float(norm),
                                      autotp.full_state_dict(module, grads=True)))
        return results

    for rank, got in enumerate(sim.run(step)):
        for p, (want, _), result in zip(NORMS, wanted, got):
            result = compare(want, result)
            assert result.loss_diff <= RTOL[p] * want.loss, (rank, p, "norm", result)
            assert result.grad_rel <= RTOL[p], (rank, p, result)


def test_no_clipping_below_the_limit_and_torch_measures_the_whole_model() -> None:
    """Below ``max_norm`` nothing changes; torch's own clip over the rank's ``parameters()``
    measures the whole model's norm too (the sharded gradients are ``ShardGrad``s), where
    the same pieces as plain tensors measure another norm."""
    model = BUILDERS["gpt2"]()
    ids = batch()
    sim = autotp.simulate(model, 2, example_args=(ids,))

    def step(module: autotp.ShardedModule) -> tuple[float, float, bool]:
        module.zero_grad(set_to_none=True)
        loss_of(module(ids), ids).backward()
        before = {k: v.clone() for k, v in autotp.full_state_dict(module, grads=True).items()}
        norm = float(autotp.clip_grad_norm_(module, 1e9))
        after = autotp.full_state_dict(module, grads=True)
        by_torch = float(torch.nn.utils.clip_grad_norm_(module.parameters(), float("inf")))
        pieces = [p.grad.as_subclass(torch.Tensor) for p in module.parameters()
                  if p.grad is not None]
        local = float(torch.nn.utils.get_total_norm(pieces, float("inf")))
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        return norm, (by_torch, local), unchanged

    reference = reference_step(model, lambda m: m(ids), lambda out: loss_of(out, ids),
                               lambda out: torch.zeros(()))
    whole = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    assert reference.loss > 0
    for norm, (by_torch, _), unchanged in sim.run(step):
        assert unchanged
        assert abs(norm - whole) <= RTOL[2.0] * whole
        assert abs(by_torch - whole) <= RTOL[2.0] * whole
    pieces = [local for _, (_, local), _ in sim.run(step)]
    assert len(set(pieces)) > 1  # a rank's pieces alone are not the model


def test_experts_split_over_expert_parallel_ranks() -> None:
    """Qwen3-MoE at tp 2 x ep 2: the experts' shards differ over ep as well as tp; the dense
    gradients, averaged over the ep (data-parallel) ranks, count once."""
    pytest.importorskip("transformers")
    model = qwen3_moe()
    tp, ep, rows = 2, 2, 2
    ids = torch.randint(0, 128, (ep * rows, 8), generator=torch.Generator().manual_seed(3))

    def loss(out) -> torch.Tensor:
        return out.logits.float().pow(2).mean()

    want, max_norm = _clipped_reference(model, lambda m: m(input_ids=ids), loss, 0.1, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, tp, ep=ep, example_kwargs={"input_ids": ids[:rows]})

    def step(module: autotp.ShardedModule) -> StepResult:
        e = module.ep_comm.rank
        module.zero_grad(set_to_none=True)
        loss(module(input_ids=ids[e * rows:(e + 1) * rows])).backward()
        experts = module.expert_parameters()
        for target, param in module.local_parameters().items():
            if target not in experts and param.grad is not None:  # data parallelism's mean
                param.grad = module.ep_comm.all_reduce(param.grad) / ep
        module.finish_expert_gradients()
        norm = autotp.clip_grad_norm_(module, max_norm)
        return StepResult(torch.zeros(()), float(norm), autotp.full_state_dict(module,
                                                                               grads=True))

    assert sim.plan.ep == ep and sim.plan.expert_params
    for rank, got in enumerate(sim.run(step)):
        result = compare(want, got)
        assert result.loss_diff <= RTOL[2.0] * want.loss, (rank, "norm", result)
        assert result.grad_rel <= RTOL[2.0], (rank, result)


def test_bad_input_is_refused() -> None:
    with pytest.raises(autotp.ConfigError, match="torch.nn.utils.clip_grad_norm_"):
        autotp.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)  # type: ignore[arg-type]
    sim = autotp.simulate(BUILDERS["gpt2"](), 2, example_args=(batch(),))
    with pytest.raises(autotp.ConfigError, match="norm_type"):
        autotp.clip_grad_norm_(sim.ranks[0], 1.0, norm_type=0)
