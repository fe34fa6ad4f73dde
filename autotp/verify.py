"""Equivalence checks: run the unsharded and the sharded model on the same weights and inputs,
forward and backward, and report the largest differences and the collectives executed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from autotp.api import ShardedModule, full_state_dict
from autotp.comm import CollectiveLog

Call = Callable[[nn.Module], Any]  # runs the model on the inputs, returns its output
LossFn = Callable[[Any], torch.Tensor]  # output -> scalar
Pick = Callable[[Any], torch.Tensor]  # output -> the tensor to compare


@dataclass
class StepResult:
    output: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]


@dataclass
class Comparison:
    output_diff: float
    loss_diff: float
    grad_diff: float  # max over parameters of max |g - g_ref|
    grad_rel: float  # the same, divided by (max |g_ref| of that parameter + 1e-6)
    worst_param: str
    counts: dict[Optional[int], dict[str, int]] = field(default_factory=dict)

    def ok(self, atol: float = 1e-4, grad_rtol: float = 1e-4) -> bool:
        return (self.output_diff <= atol and self.loss_diff <= atol
                and self.grad_rel <= grad_rtol)


def reference_step(model: nn.Module, call: Call, loss_fn: LossFn, pick: Pick) -> StepResult:
    model.zero_grad(set_to_none=True)
    out = call(model)
    loss = loss_fn(out)
    loss.backward()
    grads = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        grads[name] = (param.grad if param.grad is not None
                       else torch.zeros_like(param)).detach().clone()
    return StepResult(pick(out).detach().clone(), float(loss.detach()), grads)


def sharded_step(module: ShardedModule, call: Call, loss_fn: LossFn, pick: Pick) -> StepResult:
    """Collective: every rank of the group must call it."""
    module.zero_grad(set_to_none=True)
    out = call(module)
    loss = loss_fn(out)
    loss.backward()
    grads = full_state_dict(module, grads=True)
    return StepResult(pick(out).detach().clone(), float(loss.detach()), grads)


def compare(reference: StepResult, got: StepResult) -> Comparison:
    output_diff = float((reference.output - got.output).abs().max())
    worst, grad_diff, grad_rel = "", 0.0, 0.0
    for name, ref in reference.grads.items():
        if name not in got.grads:
            raise AssertionError(f"the sharded model has no gradient for {name}")
        diff = float((ref - got.grads[name]).abs().max())
        rel = diff / (float(ref.abs().max()) + 1e-6)  # exact zeros (a key bias) stay zero
        if rel > grad_rel:
            worst, grad_diff, grad_rel = name, diff, rel
    return Comparison(output_diff, abs(reference.loss - got.loss), grad_diff, grad_rel, worst)


def layer_counts(log: CollectiveLog) -> dict[Optional[int], dict[str, int]]:
    """Collectives executed, per layer and phase (None: outside the repeated layers)."""
    table: dict[Optional[int], dict[str, int]] = defaultdict(lambda: {"forward": 0, "backward": 0})
    for event in log.events:
        table[event.layer][event.phase] += 1
    return dict(table)
