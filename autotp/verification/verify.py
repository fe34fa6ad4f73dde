"""Equivalence checks: run the unsharded and the sharded model on the same weights and inputs,
forward and backward, and report the largest differences and the collectives executed.

``assert_equivalent`` is the one check of a simulation against the unsharded model: outputs,
loss, every gradient, and one optimizer step (``measure_equivalence``: the same numbers, for a
report); ``perturb`` moves weights off their initial values first, so that zeros and ones
cannot hide a wrong sharding; ``max_difference`` is the measure for the values that are not a
training step (loaded weights, a decoding step's logits).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from autotp.api import Simulation, simulate
from autotp.sharded import ShardedModule, full_state_dict
from autotp.capture.trace import source_of
from autotp.layout import Partial, Shard, unshard_tensor
from autotp.ops import node_arg
from autotp.rules.registry import parse_output
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
    output_diff = max_difference(reference.output, got.output)
    worst, grad_diff, grad_rel = "", 0.0, 0.0
    # Relative to the parameter's largest gradient, but never to less than 1% of the model's:
    # a gradient that is zero in exact arithmetic (a key bias) is all rounding noise.
    floor = 0.01 * max((float(g.abs().max()) for g in reference.grads.values() if g.numel()),
                       default=0.0)
    for name, ref in reference.grads.items():
        if name not in got.grads:
            raise AssertionError(f"the sharded model has no gradient for {name}")
        diff = max_difference(ref, got.grads[name])
        rel = diff / max(float(ref.abs().max()) if ref.numel() else 0.0, floor, 1e-12)
        grad_diff = max(grad_diff, diff)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    return Comparison(output_diff, abs(reference.loss - got.loss), grad_diff, grad_rel, worst)


Values = Union[torch.Tensor, Mapping[str, torch.Tensor]]


def max_difference(want: Values, got: Values, *, relative: bool = False) -> float:
    """The largest ``|got - want|`` over a tensor, or over every entry of a state dict (an
    entry of ``want`` that ``got`` lacks is an infinite difference, and so is a NaN on either
    side), compared in fp32;
    ``relative``: each entry's divided by its largest ``|want|``. ``compare``'s measure for
    what is not a training step (loaded weights, a second step's logits, a cache)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        want, got = {"": want}, {"": got}
    assert not isinstance(got, torch.Tensor), type(got)
    worst = 0.0
    for name, a in want.items():
        if name not in got:
            return float("inf")
        a, b = a.detach().float(), got[name].detach().float()
        # equal entries differ by 0 (the same infinity too: a mask's -inf in both)
        diff = float(torch.where(a == b, 0.0, (a - b).abs()).max()) if a.numel() else 0.0
        if relative:
            diff /= max(float(a.abs().max()) if a.numel() else 0.0, 1e-30)
        if math.isnan(diff):  # a NaN on either side: never within a tolerance
            return float("inf")
        worst = max(worst, diff)
    return worst


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
        if isinstance(out, torch.Tensor):  # a copy: an all-reduce may sum it in place later
            self.values[n.name] = out.detach().clone()
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
        if not diff <= atol * (1.0 + scale):  # NaN diverges too
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


# ---- one check of a simulation against the unsharded model --------------------------------


def main_output(out: Any) -> torch.Tensor:
    """The tensor a model's call is judged by: the output itself, the first entry of a tuple
    (``return_dict=False``), or a model output's ``logits``, ``last_hidden_state`` or
    ``sample`` (transformers, diffusers)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return main_output(out[0])
    for key in ("logits", "last_hidden_state", "sample"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"no tensor to compare in a {type(out).__name__}: pass pick=")


@dataclass(frozen=True)
class Equivalence:
    """One simulated rank against the unsharded model.

    ``step``: one forward and backward (outputs, loss, every parameter's gradient).
    ``after_step``: the same SGD step taken on both, then a second forward: its outputs and
    loss, and in the gradient fields every parameter after the step, relative to its own
    largest entry (floor 1% of the model's largest): a gradient applied to the wrong piece of
    a parameter, or to a parameter that two ranks share, shows there and nowhere before."""

    rank: int
    step: Comparison
    after_step: Comparison
    lr: float  # the step's

    def failures(self, atol: float, grad_rtol: float) -> list[str]:
        """What differs beyond the tolerances: a line per phase that does (none: nothing)."""
        lines = []
        for when, cmp, what in (("forward and backward", self.step, "gradient"),
                                (f"after one SGD step (lr {self.lr:g})", self.after_step,
                                 "parameter")):
            found = []
            if cmp.output_diff > atol:
                found.append(f"output off by {cmp.output_diff:.2e} (atol {atol:g})")
            if cmp.loss_diff > atol:
                found.append(f"loss off by {cmp.loss_diff:.2e} (atol {atol:g})")
            if cmp.grad_rel > grad_rtol:
                found.append(f"{what}s off by {cmp.grad_rel:.2e} relative "
                             f"(grad_rtol {grad_rtol:g})")
            if found:
                lines.append(f"rank {self.rank}, {when}: " + ", ".join(found) +
                             f"; worst {what}: {cmp.worst_param} ({cmp.grad_rel:.2e} relative)")
        return lines


def assert_equivalent(
    model: nn.Module,
    tp: Union[int, Simulation],
    *,
    args: tuple[Any, ...] = (),
    kwargs: Optional[dict[str, Any]] = None,
    call: Optional[Call] = None,
    loss_fn: Optional[LossFn] = None,
    pick: Pick = main_output,
    atol: float = 1e-5,
    grad_rtol: float = 1e-4,
    lr: float = 0.1,
    **simulate_options: Any,
) -> list[Equivalence]:
    """Every rank of ``model`` sharded at ``tp`` (``autotp.simulate(model, tp, example_args=args,
    example_kwargs=kwargs, **simulate_options)``, or a Simulation of it made before) against
    an unsharded copy, on the inputs ``args`` and ``kwargs`` (or ``call(module)``, which runs
    the model however it is run: by default ``module(*args, **kwargs)``):

    - the output (``pick`` of the call's result) and the loss (``loss_fn`` of the result; by
      default the mean square of the picked output), within ``atol`` (max abs);
    - every parameter's gradient, within ``grad_rtol`` of its largest entry (``compare``);
    - one plain SGD step (``p -= lr * p.grad``) on the copy and on every rank, then the call
      again: its output and loss within ``atol``, every parameter within ``grad_rtol`` of its
      largest entry.

    Raises AssertionError naming each failing rank, quantity and worst parameter; returns
    every rank's Equivalence. ``model`` is not changed; the ranks' parameters are restored
    after the step and their gradients cleared, and their collective logs hold the one
    forward and backward. ``measure_equivalence`` measures the same without judging."""
    results = measure_equivalence(model, tp, args=args, kwargs=kwargs, call=call,
                                  loss_fn=loss_fn, pick=pick, lr=lr, **simulate_options)
    lines = [line for r in results for line in r.failures(atol, grad_rtol)]
    if lines:
        raise AssertionError("the sharded model differs from the unsharded one:\n" +
                             "\n".join(lines))
    return results


def measure_equivalence(
    model: nn.Module,
    tp: Union[int, Simulation],
    *,
    args: tuple[Any, ...] = (),
    kwargs: Optional[dict[str, Any]] = None,
    call: Optional[Call] = None,
    loss_fn: Optional[LossFn] = None,
    pick: Pick = main_output,
    lr: float = 0.1,
    **simulate_options: Any,
) -> list[Equivalence]:
    """``assert_equivalent``'s measurements, every rank's, without tolerances: for a report
    (``Equivalence.failures`` judges them)."""
    kwargs = dict(kwargs or {})
    run: Call = call if call is not None else (lambda module: module(*args, **kwargs))
    loss = loss_fn or (lambda out: _mean_square(pick(out)))
    reference = copy.deepcopy(model)  # before simulate sees the model
    if isinstance(tp, Simulation):
        if simulate_options:
            raise TypeError(f"{sorted(simulate_options)} are options of autotp.simulate; "
                            "this simulation is built already")
        sim = tp
    else:
        if not args and not kwargs:
            raise TypeError("pass the inputs (args=, kwargs=): the model is traced on them")
        sim = simulate(model, tp, example_args=tuple(args) or None,
                       example_kwargs=kwargs or None, **simulate_options)
    if sim.plan.ep != 1:
        raise ValueError("the equivalence check runs every rank on the same inputs: with expert "
                         "parallelism each data-parallel rank needs its own batch")
    draws = _random_draws(sim.captured.gm) if sim.captured is not None else []
    if draws:
        raise ValueError(f"{type(model).__name__} draws random numbers ({'; '.join(draws[:3])}): "
                         "the sharded ranks draw their own dropout masks, so no run can match "
                         "the unsharded model's. Compare in eval mode (model.eval()) or with "
                         "dropout probabilities of 0")

    want = reference_step(reference, run, loss, pick)
    got = sim.run(lambda module: sharded_step(module, run, loss, pick))
    saved = sim.run(lambda module: [p.detach().clone() for p in module.parameters()])
    try:
        # every rank steps before any calls again: a parameter two ranks share would move
        # twice, as it would under a real optimizer
        sim.run(lambda module: _sgd_step(module, lr))
        got_after = sim.run(lambda module: _quietly(module, lambda: _second_step(
            module, run, loss, pick, full_state_dict(module))))
    finally:
        for module, params in zip(sim.ranks, saved):
            _restore(module, params)
    _sgd_step(reference, lr)
    want_after = _second_step(reference, run, loss, pick,
                              dict(reference.named_parameters(remove_duplicate=False)))
    return [Equivalence(rank, compare(want, got[rank]), compare(want_after, got_after[rank]), lr)
            for rank in range(len(got))]


def _random_draws(gm: torch.fx.GraphModule) -> list[str]:
    """The dropouts the traced program runs (capture drops the inactive ones: eval mode, a
    probability of 0), each as ``op at file:line``."""
    aten = torch.ops.aten
    found = []
    for node in gm.graph.nodes:
        active = node.target in (aten.dropout.default, aten.native_dropout.default,
                                 aten.bernoulli.p, aten.bernoulli.default) or (
            node.target == aten.scaled_dot_product_attention.default
            and node_arg(node, "dropout_p", 0.0))
        if node.op == "call_function" and active:
            found.append(f"{node.target.__name__} at {source_of(node) or node.name}")
    return found


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    """In float32 at least: a bfloat16 output's squares are summed in float32, a float64
    output's in float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).square().mean()


def _sgd_step(module: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for param in module.parameters():  # a tied parameter once, with its summed gradient
            if param.grad is not None:
                param.add_(param.grad, alpha=-lr)


def _restore(module: nn.Module, params: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, before in zip(module.parameters(), params):
            param.copy_(before)
    module.zero_grad(set_to_none=True)


def _second_step(module: nn.Module, call: Call, loss_fn: LossFn, pick: Pick,
                 params: dict[str, torch.Tensor]) -> StepResult:
    """The call after the step; the parameters (whole) in the gradients' place. Gradients
    stay on: the same program as the first call (a compiled one is not compiled again)."""
    out = call(module)
    return StepResult(pick(out).detach().clone(), float(loss_fn(out).detach()),
                      {name: p.detach().clone() for name, p in params.items()})


def _quietly(module: ShardedModule, fn: Callable[[], StepResult]) -> StepResult:
    """``fn()`` with the rank's collectives left out of its logs."""
    logs = [c.log for c in (module.comm, module.ep_comm) if c is not None]
    enabled = [log.enabled for log in logs]
    for log in logs:
        log.enabled = False
    try:
        return fn()
    finally:
        for log, was in zip(logs, enabled):
            log.enabled = was


def perturb(model: nn.Module, *, seed: Optional[int] = None, std: float = 0.02,
            bias_std: Optional[float] = None, norm_std: Optional[float] = None) -> nn.Module:
    """Add N(0, std^2) noise to every parameter of ``model`` (in place; returns it), so that
    zero biases, unit norm scales and zero-initialised layers cannot hide a bias added on
    every rank, a norm scale sliced wrong or a gradient path that is never taken.

    Biases (1-D parameters named ``*bias``) take ``bias_std``, other 1-D parameters (norm
    scales) ``norm_std``, both ``std`` unless given; a parameter whose std is 0 is left as it
    is and draws nothing. ``seed``: noise from a generator of its own (the same model in
    every process, whatever was drawn before); None draws from torch's global generator."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            vector_std = bias_std if name.endswith("bias") else norm_std
            sigma = vector_std if param.dim() == 1 and vector_std is not None else std
            if sigma == 0:
                continue
            noise = torch.randn(param.shape, generator=generator)
            param.add_(sigma * noise.to(param.device, param.dtype))
    return model
