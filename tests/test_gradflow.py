"""The static gradient-flow check (planner/gradflow.py): it proves the plans of the standard
models, and it refuses plans corrupted the ways real bugs corrupt them, naming the parameter,
the node and the source line.

The algebra first (every redistribution autotp offers carries a right gradient to a right
gradient; without its backward collective it does not), then whole plans.
"""

from __future__ import annotations

import dataclasses
import warnings
from fractions import Fraction
from functools import lru_cache
from typing import Any

import pytest
import torch

import autotp
import autotp.planner.problem as problem
from autotp.capture.trace import Captured, capture
from autotp.layout import P, P_LSE, R, R_STAR, Layout, Shard
from autotp.planner.gradflow import (Form, Grad, check_gradient_flow, edge_backward, exact,
                                     form_of, gradient_flow)
from autotp.planner.plan import Edge, Plan
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.planner.transitions import transition
from tests.ckpt_cases import BUILDERS as CKPT_BUILDERS
from tests.ckpt_cases import MQA
from tests.models import BUILDERS, example
from tests.test_complex import HIDDEN, TOKENS, ComplexRopeAttention, without_complex_rules

LAYOUTS: list[Layout] = [R, R_STAR, Shard(1), P, P_LSE]
OFFERED = [(src, dst, sp) for src in LAYOUTS for dst in LAYOUTS for sp in (False, True)
           if src != dst and transition(src, dst, requires_grad=True, to_output=True,
                                        sequence_parallel=sp) is not None]


def _edge(src: Layout, dst: Layout, backward: Any) -> Edge:
    return Edge("x", "y", str(src), str(dst), None, backward, None)


@pytest.mark.parametrize("src,dst,sp", OFFERED, ids=lambda x: str(x))
def test_each_redistribution_carries_a_right_gradient_to_a_right_one(
        src: Layout, dst: Layout, sp: bool) -> None:
    step = transition(src, dst, requires_grad=True, to_output=True, sequence_parallel=sp)
    assert step is not None
    kind = step.backward.value if step.backward else None
    for tp in (2, 4):
        got = edge_backward(Grad(form_of(dst)), _edge(src, dst, kind), src, tp)
        assert exact(got, form_of(src), tp), (src, dst, got)
        if kind is not None:  # without its collective, the gradient is wrong
            dropped = edge_backward(Grad(form_of(dst)), _edge(src, dst, None), src, tp)
            assert not exact(dropped, form_of(src), tp), (src, dst, dropped)


def test_scales_follow_the_collectives() -> None:
    f_edge = _edge(R, R_STAR, "all_reduce")
    # identical gradients all-reduced: every rank counts them
    assert edge_backward(Grad(Form.WHOLE), f_edge, R, 4) == \
        Grad(Form.WHOLE, frozenset({Fraction(4)}))
    # R* -> R divides by tp; the R -> R* all-reduce restores the whole; without it, 1/tp
    divided = edge_backward(Grad(Form.WHOLE), _edge(R_STAR, R, None), R_STAR, 4)
    assert edge_backward(divided, f_edge, R, 4) == Grad(Form.WHOLE)
    assert edge_backward(divided, _edge(R, R_STAR, None), R, 4) == \
        Grad(Form.WHOLE, frozenset({Fraction(1, 4)}))


# ---- whole plans --------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _captured(name: str) -> tuple[torch.nn.Module, Captured]:
    model = BUILDERS[name]()
    args, kwargs = example(name)
    return model, capture(model, args, kwargs)


@lru_cache(maxsize=None)
def _plan(name: str, tp: int, sequence_parallel: bool) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_graph(_captured(name)[1], tp,
                          options=PlanOptions(sequence_parallel=sequence_parallel))


def _trainable(name: str) -> dict[str, str]:
    """Parameter -> its layout, for the parameters that train (the plan's names)."""
    plan = _plan(name, 2, False)
    return {t: p.layout for t, p in plan.params.items()
            if dict(_captured(name)[1].gm.named_parameters())[t].requires_grad}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama", "nanogpt"])
def test_standard_models_are_proven(name: str, tp: int, sequence_parallel: bool) -> None:
    plan = _plan(name, tp, sequence_parallel)
    flow = check_gradient_flow(plan, _captured(name)[1].gm)
    assert set(flow.params) == set(_trainable(name))  # every trainable parameter is reached
    for target, grad in flow.params.items():
        layout = plan.params[target].layout
        assert grad == Grad(Form.OWN if layout.startswith("S") else Form.WHOLE), target


def test_segments_held_whole_are_proven_once_summed() -> None:
    """GPTBigCode's fused q|k|v with one k/v head: S(0)x8:1*:1*, its k/v rows summed after
    backward; without that sum the check refuses it."""
    torch.manual_seed(0)
    model = CKPT_BUILDERS["bigcode"]()
    ids = torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured, plan = autotp.api.prepare(model, 2, example_kwargs={"input_ids": ids})
    assert plan.params[MQA].layout == "S(0)x8:1*:1*" and plan.params[MQA].grad_sync
    assert check_gradient_flow(plan, captured.gm).params[MQA] == Grad(Form.OWN)
    plan.params[MQA] = dataclasses.replace(plan.params[MQA], grad_sync=False)
    with pytest.raises(autotp.GradientFlowError, match="(?s)" + MQA.replace(".", r"\.") +
                       r".*partial in the segments held whole"):
        check_gradient_flow(plan, captured.gm)


# ---- corrupted plans ----------------------------------------------------------------------


def _corrupted(name: str, tp: int) -> Plan:
    plan = _plan(name, tp, False)
    return Plan.from_json(plan.to_json())  # a copy: the cached plan stays right


def _node(name: str, target: str) -> str:
    gm = _captured(name)[1].gm
    return next(n.name for n in gm.graph.nodes if n.op == "get_attr" and n.target == target)


def _refused(name: str, plan: Plan) -> str:
    with pytest.raises(autotp.GradientFlowError) as info:
        check_gradient_flow(plan, _captured(name)[1].gm)
    return str(info.value)


def test_a_dropped_f_leaves_a_partial_gradient() -> None:
    """Megatron's f (R -> R*, all-reduce in backward) before the query projection, dropped:
    the norm's output gets the query's partial gradient, and so do the parameters above."""
    plan = _corrupted("llama", 4)
    i, edge = next((i, e) for i, e in enumerate(plan.edges)
                   if (e.src, e.dst, e.backward) == ("R", "R*", "all_reduce"))
    plan.edges[i] = dataclasses.replace(edge, backward=None)
    text = _refused("llama", plan)
    reader = plan.choices[edge.consumer]
    assert "model.layers.0.input_layernorm.weight (R) a wrong gradient" in text
    assert f"({edge.value}, R) is read as R* through R -> R* (no collective in backward)" in text
    assert f"node: %{edge.consumer} : " in text and "modeling_llama.py" in text
    assert reader.source is not None and reader.source.rsplit(":", 1)[-1] in text
    assert "comes back partial where it must be whole" in text


def test_a_grad_sync_parameter_not_summed_stays_partial() -> None:
    plan = _corrupted("llama", 4)  # k/v heads (2) fewer than tp: k/v projections replicated
    target = "model.layers.1.self_attn.k_proj.weight"
    assert plan.params[target].grad_sync
    plan.params[target] = dataclasses.replace(plan.params[target], grad_sync=False)
    text = _refused("llama", plan)
    assert text.startswith(f"the plan would give {target} (R) a wrong gradient: partial, "
                           "where it must be whole")
    assert f"({_node('llama', target)}, R) is read as R* through R -> R*" in text
    assert "model.layers.1.self_attn.k_proj at" in text


def test_an_all_reduce_done_twice_counts_the_gradient_tp_times() -> None:
    """The k projection's partial gradient all-reduced at its read and again after backward
    (grad_sync): 4 times the true gradient at tp = 4."""
    plan = _corrupted("llama", 4)
    target = "model.layers.0.self_attn.k_proj.weight"
    node = _node("llama", target)
    i, edge = next((i, e) for i, e in enumerate(plan.edges) if e.value == node)
    plan.edges[i] = dataclasses.replace(edge, backward="all_reduce")
    text = _refused("llama", plan)
    assert text.startswith(f"the plan would give {target} (R) a wrong gradient: whole, 4 "
                           "times the true gradient")
    assert f"node: %{edge.consumer} : " in text


def test_g_with_an_all_reduce_in_backward_double_counts() -> None:
    plan = _corrupted("gpt2", 2)
    i, edge = next((i, e) for i, e in enumerate(plan.edges)
                   if (e.src, e.dst) == ("P", "R") and e.consumer != "output")
    plan.edges[i] = dataclasses.replace(edge, backward="all_reduce")
    text = _refused("gpt2", plan)
    assert "2 times the true gradient" in text
    assert f"({edge.value}, P) is read as R through P -> R (all-reduce in backward)" in text
    assert f"node: %{edge.consumer} : " in text


def test_complex_values_taken_as_not_differentiable_are_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner once treated complex tensors as carrying no gradient: the R -> R* read
    into a replicated rotary region went without its all-reduce, and the q/k gradients came
    out partly 1/tp of the true ones. The check reads differentiability from the graph, so it
    refuses that plan, naming the read."""
    def floats_only(val: Any) -> bool:
        if isinstance(val, torch.Tensor):
            return val.dtype.is_floating_point
        return isinstance(val, (tuple, list)) and any(floats_only(v) for v in val)

    monkeypatch.setattr(problem, "_floating", floats_only)
    registry = without_complex_rules()
    torch.manual_seed(0)
    model = ComplexRopeAttention().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured, plan = autotp.api.prepare(model, 2, example_args=(
            torch.randn(2, TOKENS, HIDDEN),), strict=False, registry=registry)
    with pytest.raises(autotp.GradientFlowError) as info:
        check_gradient_flow(plan, captured.gm)
    text = str(info.value)
    assert "wk.weight (R)" in text and "wq.weight" in text and "1/2" in text
    assert "is read as R* with no redistribution in between" in text
    assert "type_as" in text and "test_complex.py" in text
    # the same plan made with complex values differentiable passes
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured, plan = autotp.api.prepare(model, 2, example_args=(
            torch.randn(2, TOKENS, HIDDEN),), strict=False, registry=registry)
    flow = gradient_flow(plan, captured.gm)
    assert all(grad in (Grad(Form.WHOLE), Grad(Form.OWN)) for grad in flow.params.values())


def test_simulate_checks_the_plan_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_plan=True (the default) refuses a plan the check refuses; False builds it."""
    import autotp.api as api

    real = api._prepare  # what simulate and parallelize call: the plan before building

    def corrupted(*args: Any, **kwargs: Any) -> Any:
        captured, plan = real(*args, **kwargs)
        for i, edge in enumerate(plan.edges):
            if (edge.src, edge.dst) == ("P", "R") and edge.consumer != "output":
                plan.edges[i] = dataclasses.replace(edge, backward="all_reduce")
        return captured, plan

    monkeypatch.setattr(api, "_prepare", corrupted)
    model = BUILDERS["nanogpt"]()
    args, _ = example("nanogpt")
    with pytest.raises(autotp.GradientFlowError, match="2 times the true gradient"):
        autotp.simulate(model, 2, example_args=args)
    assert autotp.simulate(model, 2, example_args=args, check_plan=False).tp == 2


class _ParametersUnread(torch.nn.Module):
    """Its forward reads none of its parameters (a branch traced on its other side)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_program_no_trainable_parameter_reaches_is_proved_and_runs() -> None:
    x = torch.randn(2, 4, 8)
    sim = autotp.simulate(_ParametersUnread(), 2, example_args=(x,))
    for out in sim.run(lambda m: m(x)):
        torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
