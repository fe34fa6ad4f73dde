"""A plan is one AxisPlan per mesh axis (planner/plan.py): the axes a plan holds, in the order
planned, the degrees read off them, one axis's plan alone, and the JSON round trip of every
axis, against the plans autotp makes of the test LLaMA and Qwen3-MoE."""

from __future__ import annotations

import warnings

import torch

import autotp
from autotp.planner.plan import Plan
from tests import models

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))


def _plan(model: torch.nn.Module, tp: int, **degrees: int) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, tp, example_kwargs={"input_ids": IDS}, **degrees)


def test_cp_beside_tp_is_a_second_axis_and_cp_alone_leads() -> None:
    both = _plan(models.llama(), 2, cp=2)
    assert list(both.axes) == ["tp", "cp"] and (both.tp, both.cp, both.ep) == (2, 2, 1)
    assert both.degree == 2 and both.lead is both.axes["tp"]
    cp = both.on("cp")
    assert list(cp.axes) == ["cp"] and cp.values == both.axes["cp"].values
    # the tp axis holds the tp layouts, the cp axis every value's sequence split
    assert both.params == both.axes["tp"].params and both.axes["cp"].attention
    assert all(p.layout == "R" for p in both.axes["cp"].params.values())
    assert both.summary().startswith(
        "autotp plan: LlamaForCausalLM, tp=2 x cp=2 (context parallel inside tp)")
    alone = _plan(models.llama(), 1, cp=2)
    assert list(alone.axes) == ["cp"] and (alone.tp, alone.cp, alone.degree) == (1, 2, 2)
    # the cp plan is the same search beside tp or alone: the same attention choices
    assert alone.attention.keys() == both.axes["cp"].attention.keys()


def test_ep_is_an_axis_of_the_expert_parameters() -> None:
    plan = _plan(models.qwen3_moe(), 2, ep=2)
    assert list(plan.axes) == ["tp", "ep"] and (plan.tp, plan.ep, plan.degree) == (2, 2, 2)
    assert [a.name for a in plan.layout_axes()] == ["tp"]
    ep = plan.axes["ep"]
    assert sorted(ep.params) == sorted(plan.expert_params) and ep.params
    for target, param in ep.params.items():  # split along the experts tp * ep ways
        assert param.layout == "S(0)", (target, param)
        assert param.local_shape[0] * 4 == param.global_shape[0], (target, param)


def test_every_axis_round_trips_through_json() -> None:
    for plan in (_plan(models.llama(), 2, cp=2), _plan(models.qwen3_moe(), 2, ep=2)):
        again = Plan.from_json(plan.to_json())
        assert again == plan and again.to_json() == plan.to_json()
        assert list(again.axes) == list(plan.axes)
