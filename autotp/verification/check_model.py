"""``autotp verify``'s check of a model the command line names: built with random weights, run
unsharded and sharded (simulated ranks, or gloo processes) in eval mode, forward and
backward on its example, every rank compared with ``verify.compare``; on a mismatch, the
first value of the program that diverges, with its source line.

Eval mode, because dropout would draw other masks on the ranks than on the unsharded model.
The loss is the model's own where it returns one; otherwise a scalar that every floating
output feeds (``generic_loss``), so that every gradient is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autotp.api import Simulation, parallelize, simulate
from autotp.capture.named_models import load_model
from autotp.errors import ConfigError
from autotp.verification.verify import (Divergence, compare, first_divergence, layer_counts,
                                    reference_step, sharded_step, worst_outcome)
from autotp.planner.gradflow import check_gradient_flow
from autotp.runtime.launch import run_processes


@dataclass
class ModelCheck:
    outcome: dict[str, Any]  # verify.worst_outcome over the ranks
    proven: int  # parameters whose whole gradient the plan proves (simulation only)
    model: nn.Module
    loaded: Any  # what named_models.load_model built: the model and its example
    strict: bool
    sequence_parallel: bool
    sim: Optional[Simulation] = None

    def ok(self, atol: float) -> bool:
        o = self.outcome
        return (o["output_diff"] <= atol and o["loss_diff"] <= atol and o["grad_rel"] <= atol
                and o["counts_agree"])

    def first_divergence(self, atol: float) -> Optional[Divergence]:
        """In simulation: the same rewritten programs as the processes run."""
        if self.sim is None:
            self.sim = simulate(self.model, self.outcome["tp"],
                                       example_args=self.loaded.example_args,
                                       example_kwargs=self.loaded.example_kwargs,
                                       strict=self.strict,
                                       sequence_parallel=self.sequence_parallel)
        assert self.sim.captured is not None, "simulate keeps what it captured"
        args, kwargs = _example(self.loaded, self.sim.captured.example_kwargs)
        return first_divergence(self.sim, args, kwargs, atol=atol)


def check_model(spec: str, overrides: dict[str, Any], tp: int, *, strict: bool = True,
                sequence_parallel: bool = False, procs: bool = False,
                dtype: Optional[str] = None) -> ModelCheck:
    """``procs``: ``tp`` gloo processes, each planning with ``parallelize`` (which proves its
    plan's gradient flow); otherwise the ranks simulated in this process. ``dtype``: the
    model and its example in that dtype (``--dtype``; float32 by default)."""
    loaded = _built(spec, overrides, dtype)
    model = loaded.model.eval()
    if procs:
        outcome = worst_outcome(run_processes(_check_rank, tp, spec, overrides, strict,
                                              sequence_parallel, dtype))
        outcome["tp"] = tp
        return ModelCheck(outcome, 0, model, loaded, strict, sequence_parallel)
    sim = simulate(model, tp, example_args=loaded.example_args,
                          example_kwargs=loaded.example_kwargs, strict=strict,
                          sequence_parallel=sequence_parallel)
    assert sim.captured is not None, "simulate keeps what it captured"
    proven = len(check_gradient_flow(sim.plan, sim.captured.gm).params)
    call = _caller(*_example(loaded, sim.captured.example_kwargs))
    reference = reference_step(model, call, generic_loss, first_float)
    got = sim.run(lambda m: sharded_step(m, call, generic_loss, first_float))
    outcome = worst_outcome([_row(reference, rank_got, sim.ranks[rank].comm.log)
                             for rank, rank_got in enumerate(got)])  # every rank, not only 0
    outcome["tp"] = tp
    return ModelCheck(outcome, proven, model, loaded, strict, sequence_parallel, sim)


def _check_rank(rank: int, world_size: int, spec: str, overrides: dict[str, Any],
                strict: bool, sequence_parallel: bool,
                dtype: Optional[str] = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    loaded = _built(spec, overrides, dtype)
    model = loaded.model.eval()
    sharded = parallelize(model, world_size, example_args=loaded.example_args,
                                 example_kwargs=loaded.example_kwargs, strict=strict,
                                 sequence_parallel=sequence_parallel)
    call = _caller(*_example(loaded, sharded._example))
    reference = reference_step(model, call, generic_loss, first_float)
    got = sharded_step(sharded, call, generic_loss, first_float)
    return _row(reference, got, sharded.comm.log)


def _built(spec: str, overrides: dict[str, Any], dtype: Optional[str]) -> Any:
    """The model with random weights, it and the floating tensors of its example in
    ``dtype`` (float32 where None)."""
    return load_model(spec, overrides, meta=False).cast(dtype or "float32")


def _row(reference: Any, got: Any, log: Any) -> dict[str, Any]:
    cmp = compare(reference, got)
    return {"output_diff": cmp.output_diff, "loss_diff": cmp.loss_diff,
            "grad_diff": cmp.grad_diff, "grad_rel": cmp.grad_rel,
            "worst_param": cmp.worst_param, "counts": layer_counts(log)}


def _example(loaded: Any, traced: dict[str, Any]) -> tuple[tuple, dict]:
    """The model's own example, or the one capture traced with where it gave none."""
    if loaded.example_args is None and loaded.example_kwargs is None:
        return (), dict(traced)
    return tuple(loaded.example_args or ()), dict(loaded.example_kwargs or {})


def _caller(args: tuple, kwargs: dict) -> Callable[[nn.Module], Any]:
    def call(m: nn.Module) -> Any:
        return m(*args, **kwargs)

    return call


def float_leaves(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [x for x in pytree.tree_leaves(out)
            if isinstance(x, torch.Tensor) and x.is_floating_point()]


def generic_loss(out: Any) -> torch.Tensor:
    """A scalar touching every floating output (the model's own loss if it returns one)."""
    leaves = float_leaves(out)
    if not leaves:
        raise ConfigError("the model returns no floating-point tensor to compare")
    return sum(x.float().pow(2).mean() for x in leaves)  # type: ignore[return-value]


def first_float(out: Any) -> torch.Tensor:
    return torch.cat([x.detach().float().reshape(-1) for x in float_leaves(out)])


__all__ = ["ModelCheck", "check_model", "first_float", "generic_loss"]
