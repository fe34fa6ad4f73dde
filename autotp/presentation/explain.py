"""Why a plan chose a layout: every candidate of one parameter or op forced in turn, the rest
of the program re-planned around it, and what each costs beside the chosen one.

A parameter's candidates are the layouts it can be stored in (``leaf_candidates``); an op's
are its rules' strategies. Forcing one and re-planning everything else gives the least cost
the plan could have with that choice: the chosen candidate is the one whose cost is least,
and its plan is the plan explained (not searched again). The alternatives share the traced
program and the planning problems built for it (a forced layout is the solver's choice, not
the problem's): each costs its searches alone.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from autotp.capture.trace import Captured, make_call, sequence_symbols
from autotp.errors import ConfigError, PlanError
from autotp.presentation.report import to_dict, why_replicated_lines
from autotp.planner.cost import CostModel
from autotp.planner.plan import Plan
from autotp.planner.problem import build_problem, leaf_candidates
from autotp.planner.segmentations import block_counts
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.progress import stage, step
from autotp.rules.registry import Registry


@dataclass
class Alternative:
    label: str  # the layout or strategy forced
    chosen: bool
    infeasible: Optional[str] = None  # the planner's reason, when no plan takes it
    forward: int = 0  # collectives, relative to the chosen plan's
    backward: int = 0
    param_mib: float = 0.0  # parameters per rank, relative (fp32)
    cost: float = 0.0  # the plan's cost, relative


@dataclass
class Explanation:
    heading: str  # what the target is and what the plan chose
    alternatives: list[Alternative]
    kept_whole: list[str] = field(default_factory=list)  # what stops each way of sharding it


def explain(captured: Captured, plan: Plan, target: str, tp: int, cost_model: CostModel,
            options: PlanOptions, model_name: Optional[str] = None) -> Explanation:
    """``target``: a parameter (its name or any name tied to it) or a node of the program."""
    node = _find(captured, plan, target)
    registry = Registry.default()
    blocks = block_counts(captured.gm, sequence_symbols(captured.dim_names)
                          if options.context_parallel else frozenset())
    param = node.target if node.op == "get_attr" and node.target in plan.params else None
    if param is not None:
        pnodes = build_problem(captured, tp, blocks, registry, cost_model, options)
        by_name = {pn.node.name: pn for pn in pnodes}
        forced: list[Any] = leaf_candidates(pnodes, by_name)[node.name]
        labels = [str(c) for c in forced]
        chosen = plan.params[param].layout
        heading = f"{param} {list(plan.params[param].global_shape)}: stored {chosen}"
    else:
        choice = plan.choices.get(node.name)
        if choice is None:
            raise ConfigError(f"{node.name} is not an op with a layout choice")
        strategies = registry.strategies(make_call(node, tp, blocks))
        forced, labels = list(range(len(strategies))), [str(s) for s in strategies]
        chosen = str(choice.strategy)
        heading = f"{node.name} = {choice.op} (layer {choice.layer}, {choice.source}): {chosen}"
    base_fwd, base_bwd = _collective_counts(plan)
    base_bytes = _param_bytes(plan)
    alternatives = []
    problems: dict = {}  # shared by the alternatives (plan_graph's ``problems``)
    with stage(f"explaining {target}"):
        for index, (candidate, label) in enumerate(zip(forced, labels), 1):
            if label == chosen:  # its plan is the plan at hand
                alternatives.append(Alternative(label, True))
                continue
            step(f"forcing {label}", index, len(forced))
            try:
                alt = _forced(captured, tp, cost_model, options, node.name, candidate,
                              model_name, problems)
            except PlanError as exc:
                alternatives.append(Alternative(label, False,
                                                infeasible=str(exc).splitlines()[0]))
                continue
            alternatives.append(_relative(label, alt, plan, base_fwd, base_bwd, base_bytes))
    kept_whole = []
    if param is not None and param in plan.blocked:
        report = to_dict(plan, cost_model).get("why_replicated", {})
        kept_whole = [line.strip() for line in why_replicated_lines({param: report[param]})[1:]]
    return Explanation(heading, alternatives, kept_whole)


def _forced(captured: Captured, tp: int, cost_model: CostModel, options: PlanOptions,
            name: str, candidate: Any, model_name: Optional[str], problems: dict) -> Plan:
    """The plan with ``name`` forced to ``candidate``, everything else searched again."""
    # a forced alternative may replicate what strict mode refuses: show its cost
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_graph(captured, tp, cost_model=cost_model,
                          options=replace(options, strict=False, force=((name, candidate),)),
                          model_name=model_name or "model", problems=problems)


def _relative(label: str, alt: Plan, plan: Plan, base_fwd: int, base_bwd: int,
              base_bytes: int) -> Alternative:
    """``alt`` against the plan explained."""
    fwd, bwd = _collective_counts(alt)
    return Alternative(label, False, forward=fwd - base_fwd, backward=bwd - base_bwd,
                       param_mib=(_param_bytes(alt) - base_bytes) / 2**20,
                       cost=alt.cost - plan.cost)


def _find(captured: Captured, plan: Plan, target: str) -> Any:
    for node in captured.gm.graph.nodes:
        if node.op == "get_attr" and (node.target == target or node.target in plan.params
                                      and target in plan.params[node.target].names):
            return node
        if node.name == target:
            return node
    raise ConfigError(f"{target!r} is neither a parameter nor a node of the graph; "
                      f"parameters look like {next(iter(plan.params), '?')!r}")


def _collective_counts(plan: Plan) -> tuple[int, int]:
    fwd = sum(1 for c in plan.collectives if c.phase == "forward")
    return fwd, len(plan.collectives) - fwd


def _param_bytes(plan: Plan) -> int:
    return sum(math.prod(p.local_shape) * 4 for p in plan.params.values())


__all__ = ["Alternative", "Explanation", "explain"]
