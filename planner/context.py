"""Context parallelism inside tensor parallelism: two plans of one program.

A (cp, tp) mesh runs the tp plan on the tp axis and a context-parallel plan on the cp axis
(``PlanOptions.context_parallel``: every value's sequence split over cp, parameters whole).
The rewriter applies both to one rank program (``autotp.runtime.rewrite``): each value's
local shape is divided on the tp plan's dim and on the cp plan's, and each collective runs
over its own group. That is exact when every value is split on two different dims (or
summed on one axis and split on the other): collectives over the tp group then act on
whole rows of the cp shard and the reverse, so they commute. ``check_composable`` proves it
value by value; ``local_heads`` tells the cp plan how many heads each attention keeps on one
tp rank, for the choice between the ring and Ulysses.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx

from autotp.errors import PlanError
from autotp.layout import Shard, parse_layout
from autotp.ops import ATTENTION, repeated_heads
from autotp.capture.trace import Captured, sequence_symbols, size_expr
from autotp.planner.plan import Plan
from autotp.planner.problem import OutputGather, PlanOptions
from autotp.planner.solve import plan_graph
from autotp.rules.registry import output_layouts, parse_output


def plan_tp_cp(captured: Captured, tp: int, cp: int, options: PlanOptions,
               **plan_args: Any) -> Plan:
    """The plan of ``captured`` over tp x cp ranks (``plan_args``: ``plan_graph``'s): the tp
    plan, as without cp; at tp 1 the cp group's plan alone (its lead axis "cp"); with both,
    the tp plan with the cp axis beside it (``plan.axes["cp"]``), each attention's choice of
    ring or Ulysses made on the heads one tp rank holds."""
    degree, outer = outer_search(tp, cp, options)
    plan = plan_graph(captured, degree, options=outer, **plan_args)
    if cp == 1 or tp == 1:
        return plan
    context = plan_graph(captured, cp, options=replace(
        context_options(options), local_heads=local_heads(plan, captured.gm)), **plan_args)
    check_composable(plan, context, captured.gm, sequence_symbols(captured.dim_names))
    plan.axes["cp"] = context.axes["cp"]
    return plan


def outer_search(tp: int, cp: int, options: PlanOptions) -> tuple[int, PlanOptions]:
    """The degree and options of the search whose plan ``plan_tp_cp`` returns (the one
    ``explain`` runs again): the tp plan's; at tp 1 with cp, the cp group's."""
    if tp == 1 and cp > 1:
        return cp, context_options(options)
    # inside cp, tp's sequence parallelism splits each cp shard of the sequence again
    return tp, replace(gathered_in_program(options), batch_tokens=False) if cp > 1 \
        else options


def context_options(options: PlanOptions) -> PlanOptions:
    """The options of a cp plan: every value's sequence split, parameters whole."""
    return replace(gathered_in_program(options), context_parallel=True,
                   sequence_parallel=False, force=())


def gathered_in_program(options: PlanOptions) -> PlanOptions:
    """``options`` with the outputs of a call that computes a loss gathered in the program:
    with cp, whose sequence shards the program gathers over the cp group (the outputs
    are gathered when read only over the tp group, ``autotp.runtime.outputs``)."""
    if options.gather_outputs is not OutputGather.READ:
        return options
    return replace(options, gather_outputs=OutputGather.ALWAYS)


def local_heads(tp_plan: Plan, gm: fx.GraphModule) -> tuple[tuple[str, int, int], ...]:
    """Attention node -> (query heads, key/value heads) one rank of ``tp_plan`` holds: 1/tp
    of each where the plan splits q, k and v over heads (the key/value heads read through
    transformers' repeat for grouped queries where their source is split alike, else the
    repeated ones), all of them where it holds all three whole, (0, 0) otherwise."""
    out = []
    for node in gm.graph.nodes:
        choice = tp_plan.choices.get(node.name)
        if node.op != "call_function" or node.target not in ATTENTION or choice is None or \
                len(node.args) < 3 or len(choice.inputs) < 3:
            continue
        q, k = node.args[0], node.args[1]
        if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)):
            continue
        q_val = q.meta.get("val")
        if not isinstance(q_val, torch.Tensor) or q_val.dim() != 4:
            continue
        layouts = set(choice.inputs[:3])
        if len(layouts) != 1:
            out.append((node.name, 0, 0))
            continue
        split = tp_plan.degree if parse_layout(choice.inputs[0]) == Shard(1) else 1
        if split == 1 and choice.inputs[0] != "R":
            out.append((node.name, 0, 0))
            continue
        source = grouped_source(tp_plan, node, k)
        heads_k = int((source or k).meta["val"].shape[1])
        out.append((node.name, int(q_val.shape[1]) // split, heads_k // split))
    return tuple(out)


def grouped_source(tp_plan: Plan, node: fx.Node, k: fx.Node) -> Optional[fx.Node]:
    """The key/value heads ``k`` repeats for grouped queries where ``tp_plan`` holds them as
    it holds the queries (so that each rank's query heads keep their own key/value heads);
    None where there is no repeat or the plan holds them otherwise."""
    source = repeated_heads(k)
    if source is None:
        return None
    choice = tp_plan.choices.get(node.name)
    held = tp_plan.values.get(source.name)
    return source if choice is not None and held == choice.inputs[0] else None


def check_composable(tp_plan: Plan, cp_plan: Plan, gm: fx.GraphModule,
                     sequence: frozenset) -> None:
    """Every value the two plans both split, and every read of one, is split on different
    dims, or both split a sequence dim (``sequence``: its symbols; sequence parallelism
    inside cp: tp splits each rank's cp shard again, contiguously); a read tp splits along
    the sequence cp splits too. A PlanError names the first value that breaks this."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}

    def is_sequence(name: str, dim: int) -> bool:
        val = vals.get(name)
        return isinstance(val, torch.Tensor) and dim < val.dim() and \
            size_expr(val.shape[dim]) in sequence

    def check(name: str, tp_layout: Any, cp_layout: Any, what: str) -> None:
        if not isinstance(tp_layout, Shard):
            return
        along = is_sequence(name, tp_layout.dim)
        if isinstance(cp_layout, Shard) and cp_layout.dim == tp_layout.dim and not along:
            raise PlanError(
                f"{what} {name} ({tp_plan.ops.get(name, 'a value')}): the tp plan and the cp "
                f"plan both split its dim {tp_layout.dim}, which is no sequence dim")
        if along and not (isinstance(cp_layout, Shard) and cp_layout.dim == tp_layout.dim):
            raise PlanError(
                f"{what} {name} ({tp_plan.ops.get(name, 'a value')}): the tp plan splits its "
                f"sequence dim {tp_layout.dim}, which the cp plan holds {cp_layout}: "
                "sequence parallelism inside cp splits only the cp shards; pass no "
                "sequence_parallel with cp")

    for name, cp_text in cp_plan.values.items():
        tp_text = tp_plan.values.get(name)
        if tp_text is not None:
            for tp_layout, cp_layout in zip(output_layouts(parse_output(tp_text)),
                                            output_layouts(parse_output(cp_text))):
                check(name, tp_layout, cp_layout, "value")
    for name, choice in tp_plan.choices.items():
        other = cp_plan.choices.get(name)
        if other is None:
            continue
        for value, tp_text, cp_text in zip(tp_plan.graph.get(name, []), choice.inputs,
                                           other.inputs):
            check(value, parse_layout(tp_text), parse_layout(cp_text), f"{name}'s read of")

