"""Every call the model takes (autotp.runtime.calls): a call of another input structure than
the traced one is traced on first use and runs exact on the same parameters; the module
shows the model's signature and parameter names.

Tolerances as in test_equivalence (``assert_equivalent``): outputs and loss <= 1e-5 abs,
gradients <= 1e-4 of each parameter's largest entry."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import autotp
from autotp.verification.verify import assert_equivalent
from tests.models import BUILDERS, VOCAB


def _inputs(batch: int = 2, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def test_a_call_with_inputs_the_example_lacked_runs_exact() -> None:
    """Traced with input_ids alone; called with labels and an attention mask."""
    model = BUILDERS["llama"]()
    ids, mask = _inputs()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})
    assert_equivalent(model, sim, kwargs={"input_ids": ids, "labels": ids,
                                          "attention_mask": mask},
                      loss_fn=lambda out: out.loss)
    assert len(sim.ranks[0]._traced) == 2  # the first program and the one of this call


def test_a_model_traced_with_labels_runs_without_them() -> None:
    model = BUILDERS["gpt2"]()
    ids, _ = _inputs()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids})
    assert_equivalent(model, sim, kwargs={"input_ids": ids})  # an evaluation forward
    assert_equivalent(model, sim, kwargs={"input_ids": ids, "labels": ids},
                      loss_fn=lambda out: out.loss)


def test_every_program_trains_the_same_parameters() -> None:
    """Backward through two programs sums into one ``.grad``; an optimizer step over
    ``parameters()`` changes what both programs compute."""
    model = BUILDERS["gpt2"]()
    reference = copy.deepcopy(model)
    ids, mask = _inputs()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})

    def loss(module: torch.nn.Module) -> torch.Tensor:
        first = module(input_ids=ids).logits.square().mean()
        second = module(input_ids=ids, labels=ids, attention_mask=mask).loss
        return first + second

    loss(reference).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    want = reference(input_ids=ids, labels=ids).loss

    def step(module: autotp.ShardedModule) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        loss(module).backward()
        grads = autotp.full_state_dict(module, grads=True)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        optimizer.step()
        return grads, module(input_ids=ids, labels=ids).loss.detach()

    for grads, got in sim.run(step):
        for name, p in reference.named_parameters():
            assert (grads[name] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), name
        assert abs(got - want) <= 1e-5


def test_the_module_shows_the_models_signature_and_names() -> None:
    model = BUILDERS["gpt2"]()
    ids, _ = _inputs()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})
    rank = sim.ranks[0]
    assert inspect.signature(rank.forward) == inspect.signature(model.forward)
    # tools read the signature from the class too (transformers' Trainer finds "labels")
    assert "labels" in inspect.signature(type(rank).forward).parameters
    assert [n for n, _ in rank.named_parameters()] == [n for n, _ in model.named_parameters()]
    state = rank.state_dict()
    assert set(state) - {"_extra_state"} <= set(model.state_dict())
    # another rank's pieces (same names, same shapes) are refused
    with pytest.raises(autotp.ConfigError, match="pieces of rank 0 of 2, and this is rank 1"):
        sim.ranks[1].load_state_dict(state)
    sim.ranks[0].load_state_dict(state)
    assert rank.tp_size == 2 and rank._get_name() == type(model).__name__
    assert rank.config.distributed_config.tp_size == 2
    assert model.config is not rank.config and not hasattr(model.config, "autotp")


def test_another_batch_and_sequence_run_in_the_first_program() -> None:
    """Batch and sequence are symbolic: other sizes trace nothing new."""
    model = BUILDERS["gpt2"]()
    ids, _ = _inputs()
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids})
    longer, _ = _inputs(batch=3, length=24)
    assert_equivalent(model, sim, kwargs={"input_ids": longer})
    assert len(sim.ranks[0]._traced) == 1
