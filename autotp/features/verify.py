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
from autotp.runtime.comm import CollectiveLog

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
    grad_rel: float  # the same, / max(max |g_ref| of that parameter, 1% of the model's max)
    worst_param: str  # the parameter with the largest relative difference
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
    # Relative to the parameter's largest gradient, but never to less than 1% of the model's:
    # a gradient that is zero in exact arithmetic (a key bias) is all rounding noise.
    floor = 0.01 * max((float(g.abs().max()) for g in reference.grads.values() if g.numel()),
                       default=0.0)
    for name, ref in reference.grads.items():
        if name not in got.grads:
            raise AssertionError(f"the sharded model has no gradient for {name}")
        diff = float((ref - got.grads[name]).abs().max()) if ref.numel() else 0.0
        rel = diff / max(float(ref.abs().max()) if ref.numel() else 0.0, floor, 1e-12)
        grad_diff = max(grad_diff, diff)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    return Comparison(output_diff, abs(reference.loss - got.loss), grad_diff, grad_rel, worst)


def layer_counts(log: CollectiveLog) -> dict[Optional[int], dict[str, int]]:
    """Collectives executed, per layer and phase (None: outside the repeated layers)."""
    table: dict[Optional[int], dict[str, int]] = defaultdict(lambda: {"forward": 0, "backward": 0})
    for event in log.events:
        table[event.layer][event.phase] += 1
    return dict(table)


# ---- localizing a mismatch ----------------------------------------------------------------


class _Recorder(torch.fx.Interpreter):
    """Runs a program node by node, keeping every tensor it makes by node name (the nodes of
    the layers it calls too)."""

    def __init__(self, gm: torch.fx.GraphModule, values: Optional[dict[str, Any]] = None):
        super().__init__(gm)
        self.values: dict[str, Any] = {} if values is None else values

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach()
        return out

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if isinstance(module, torch.fx.GraphModule):  # a layer: record inside it
            return _Recorder(module, self.values).run(*args, **kwargs)
        return super().call_module(target, args, kwargs)


@dataclass
class Divergence:
    node: str
    op: str
    layout: str
    diff: float
    source: Optional[str]

    def __str__(self) -> str:
        where = f"\n  source: {self.source}" if self.source else ""
        return (f"first diverging value: {self.node} = {self.op} (layout {self.layout}), "
                f"max |diff| {self.diff:.3e}{where}")


def first_divergence(sim: Any, args: tuple = (), kwargs: Optional[dict] = None,
                     atol: float = 1e-4) -> Optional[Divergence]:
    """Run the unsharded graph and every rank's program on the same inputs, reassemble each
    value from the ranks as its layout says, and return the first value that differs."""
    from autotp.capture.trace import source_of
    from autotp.layout import Partial, Shard, unshard_tensor
    from autotp.rules.registry import parse_output

    kwargs = kwargs or {}
    captured = sim.captured
    call = sim.ranks[0]._bind(args, kwargs)
    placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    flat = [call[name] for name in placeholders]
    reference = _Recorder(captured.gm)
    with torch.no_grad():
        reference.run(*flat)

    def record(module: ShardedModule) -> dict[str, Any]:
        recorder = _Recorder(module.program)
        with torch.no_grad():
            recorder.run(*flat)
        renamed = module.program.meta.get("autotp_values", {})
        return {name: recorder.values.get(renamed.get(name, name)) for name in reference.values}

    per_rank = sim.run(record)
    for node in captured.gm.graph.nodes:
        expected = reference.values.get(node.name)
        text = sim.plan.values.get(node.name)
        if expected is None or text is None or not expected.is_floating_point():
            continue
        layout = parse_output(text)
        pieces = [values.get(node.name) for values in per_rank]
        if any(p is None for p in pieces) or isinstance(layout, tuple) or layout is None:
            continue
        if isinstance(layout, (Shard, Partial)):
            got = unshard_tensor(pieces, layout)
        else:
            got = pieces[0]
        if got.shape != expected.shape:
            diff = float("inf")
        else:
            diff = float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        if diff > atol * (1.0 + scale):
            return Divergence(node.name, str(node.target), text, diff, source_of(node))
    return None


def worst_outcome(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for all ranks: each difference is the largest over the ranks, the worst
    parameter and ``rank`` are those of the rank with the largest relative gradient error,
    and ``counts_agree`` says whether every rank executed the same collectives."""
    worst_rank = max(range(len(outcomes)), key=lambda r: (outcomes[r]["grad_rel"],
                                                          outcomes[r]["output_diff"]))
    out = dict(outcomes[worst_rank])
    for key in ("output_diff", "loss_diff", "grad_diff", "grad_rel"):
        out[key] = max(o[key] for o in outcomes)
    out["rank"] = worst_rank
    out["counts_agree"] = all(o["counts"] == outcomes[0]["counts"] for o in outcomes)
    return out


def assert_simulation_matches(model: nn.Module, sim: Any, call: Call,
                              loss_fn: Optional[LossFn] = None, *, atol: float = 1e-5,
                              grad_rtol: float = 1e-4) -> list[Comparison]:
    """Every rank of ``sim`` (``autotp.simulate``) against ``model`` on one step: outputs
    (``call``'s result), the loss (``loss_fn``, by default the mean square of the output) and
    every parameter's gradient, within ``atol`` and ``grad_rtol`` (``Comparison.ok``).
    Raises AssertionError naming the worst difference; returns each rank's comparison."""
    loss_fn = loss_fn or (lambda out: out.float().square().mean())
    reference = reference_step(model, call, loss_fn, lambda out: out)
    results = [compare(reference, got) for got in
               sim.run(lambda module: sharded_step(module, call, loss_fn, lambda out: out))]
    for rank, result in enumerate(results):
        if not result.ok(atol, grad_rtol):
            raise AssertionError(f"rank {rank} differs from the unsharded model: {result}")
    return results
