"""The planner: one strategy per op, minimizing the cost model, by dynamic programming.

The problem. For each op node n pick a strategy s_n from the rules; for each parameter p pick
a stored layout L_p. A value v then has the layout out(s_producer); a consumer that wants it
in another layout pays the redistribution's collectives (``transitions``). Minimize

    sum_p mem(L_p)  +  sum_n compute(s_n)  +  sum_(v, L) redistribute(layout(v) -> L)

where each (value, target layout) pair is paid once however many consumers read it (the
rewriter reuses the redistributed tensor: one f for q, k and v).

The solver (``solve``). Nodes are visited in topological order; a DP state assigns a layout
(and the set of layouts already materialized) to every *live* value: produced, and read by a
node still to come. Liveness is a property of the graph, so each state holds the same values
and the DP is exact over this frontier. Parameters enter the frontier at their first use.
A bounded beam (``max_states``) keeps the work linear in the graph size; ties are broken by
the printed state so that plans are deterministic.
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from autotp.capture import (
    Captured,
    is_tensor_node,
    layer_of,
    make_call,
    size_expr,
    source_of,
    tensor_inputs,
)
from autotp.errors import NoRuleError, PlanError, where
from autotp.layout import R, R_STAR, Layout, Partial, Replicate, Shard, local_shape
from autotp.planner.cost import CostModel, readable
from autotp.planner.frontier import FrontierSolver, leaf_memory_cost
from autotp.planner.plan import Choice, CollectiveRecord, Edge, ParamPlan, Plan
from autotp.planner.transitions import Collective, transition
from autotp.rules.registry import Registry, Strategy, format_output, output_layouts

aten = torch.ops.aten
INF = math.inf


@dataclass
class PNode:
    node: fx.Node
    kind: str  # "input" | "leaf" | "op" | "getitem" | "output" | "skip"
    inputs: list[str] = field(default_factory=list)
    strategies: list[Strategy] = field(default_factory=list)
    requires_grad: bool = False
    nbytes: float = 0.0
    flops: float = 0.0
    is_param: bool = False
    ndim: int = 0
    fallback: bool = False
    is_output: bool = False  # the user receives it: gathering it is needed anyway
    live: bool = False  # some later node reads it
    split: Optional[list[bool]] = None  # per strategy: is the work divided among ranks


@dataclass(frozen=True)
class PlanOptions:
    strict: bool = True
    sequence_parallel: bool = False
    max_states: int = 64
    reuse_layers: bool = True
    # node name -> strategy index (ops) or stored layout (parameters): for ``explain``
    force: tuple[tuple[str, Any], ...] = ()


Entry = tuple[Any, frozenset]  # (layout or tuple of layouts, layouts materialized from it)


def plan_graph(
    captured: Captured,
    tp: int,
    *,
    registry: Optional[Registry] = None,
    cost_model: Optional[CostModel] = None,
    options: PlanOptions = PlanOptions(),
    model_name: str = "model",
) -> Plan:
    registry = registry or Registry.default()
    cost_model = cost_model or CostModel()
    gm = captured.gm
    fallbacks = check_heads(gm, tp, options.strict)
    blocks = block_counts(gm)
    pnodes = build_problem(captured, tp, blocks, registry, cost_model, options)
    decisions, total = solve(pnodes, tp, cost_model, options)
    plan = assemble(captured, pnodes, decisions, total, tp, cost_model, options, model_name)
    plan.fallbacks = fallbacks + plan.fallbacks
    check_divisibility(plan, tp, options.strict)
    note_replicated_products(plan, gm)
    for text in plan.fallbacks:
        warnings.warn(f"autotp: {text}", stacklevel=3)
    return plan


# ---- problem -------------------------------------------------------------------------------


def block_counts(gm: fx.GraphModule) -> tuple[int, ...]:
    """Segment counts worth considering for blocked shards: the arity of equal splits (a fused
    q|k|v or gate|up projection is split into its parts)."""
    counts = {1}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
                aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            val = node.meta.get("val")
            if isinstance(val, (list, tuple)) and len(val) > 1:
                counts.add(len(val))
    return tuple(sorted(counts))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(gm: fx.GraphModule, tp: int, strict: bool) -> list[str]:
    """tp must divide the attention heads (the query heads; k/v heads may be replicated).
    Returns the fallbacks taken with ``strict=False``."""
    fallbacks: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.scaled_dot_product_attention.default:
            q = node.args[0].meta["val"]
            if q.dim() != 4 or not isinstance(q.shape[1], int):
                continue
            heads = int(q.shape[1])
            if heads % tp == 0:
                continue
            valid = ", ".join(map(str, _divisors(heads)))
            if strict:
                raise PlanError(
                    f"tp={tp} does not divide the {heads} attention heads; use tp in "
                    f"{{{valid}}} (or strict=False to replicate the attention){where(node)}"
                )
            fallbacks.append(f"attention {node.name}: {heads} heads not divisible by tp={tp}, "
                             f"computed replicated ({source_of(node) or 'unknown source'})")
    return fallbacks


MATMULS = (aten.mm.default, aten.bmm.default, aten.linear.default, aten.matmul.default,
           aten.addmm.default)


def note_replicated_products(plan: Plan, gm: fx.GraphModule) -> None:
    """A matrix that tp could divide but that the plan keeps replicated *and computes
    replicated* (its gradient is not partial) means no exact sharding of its use was found,
    e.g. a fused projection split into unequal parts: said in the plan, not silent."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in plan.params:
            continue
        param = plan.params[node.target]
        if len(param.global_shape) < 2 or param.layout != "R" or param.grad_sync:
            continue
        if not any(size % plan.tp == 0 for size in param.global_shape):
            continue  # reported by check_divisibility
        products = [u for u in node.users if u.op == "call_function" and u.target in MATMULS]
        if products:
            plan.fallbacks.append(
                f"{node.target} {list(param.global_shape)} stays replicated and its product "
                f"runs on every rank: no exact sharding of {products[0].name} was found "
                f"({source_of(products[0]) or 'unknown source'})")


def check_divisibility(plan: Plan, tp: int, strict: bool) -> None:
    """A matrix that tp divides along no dimension is replicated on every rank: an error
    naming the parameter and the valid tp values (strict), or a recorded fallback."""
    for target, param in plan.params.items():
        shape = param.global_shape
        if len(shape) < 2 or not param.layout.startswith("R"):
            continue
        if any(size % tp == 0 and size > 1 for size in shape):
            continue  # shardable, replicated by the plan's choice (e.g. k/v heads < tp)
        valid = sorted({d for size in shape for d in _divisors(size)})
        text = (f"tp={tp} divides no dimension of {target} {list(shape)}: it would be "
                f"replicated on every rank; use tp in {{{', '.join(map(str, valid))}}}")
        if strict:
            raise PlanError(text + ", or strict=False to replicate it")
        plan.fallbacks.append(text)


def _flops(node: fx.Node, cost_model: CostModel, dims: dict) -> float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    numel = 1.0
    for size in val.shape:
        numel *= cost_model.evaluate(size_expr(size), dims)
    if node.target in (aten.mm.default, aten.bmm.default, aten.linear.default,
                       aten.matmul.default):
        k = node.args[0].meta["val"].shape[-1]
        return 2.0 * numel * cost_model.evaluate(size_expr(k), dims)
    return numel


def _nbytes(val: Any, cost_model: CostModel, dims: dict) -> float:
    if not isinstance(val, torch.Tensor):
        return 0.0
    total = float(val.element_size())
    for size in val.shape:
        total *= cost_model.evaluate(size_expr(size), dims)
    return total


def build_problem(
    captured: Captured,
    tp: int,
    blocks: tuple[int, ...],
    registry: Registry,
    cost_model: CostModel,
    options: PlanOptions,
) -> list[PNode]:
    gm = captured.gm
    params = dict(gm.named_parameters(remove_duplicate=False))
    dims = captured.dim_names
    pnodes: list[PNode] = []
    grad: dict[str, bool] = {}
    strategy_memo: dict[Any, list[Strategy]] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        pn = PNode(node=node, kind="skip")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                pn.kind = "input"
                pn.requires_grad = bool(val.requires_grad)
        elif node.op == "get_attr":
            if isinstance(val, torch.Tensor):
                pn.kind = "leaf"
                pn.is_param = node.target in params
                pn.requires_grad = pn.is_param and params[node.target].requires_grad
                pn.ndim = val.dim()
        elif node.op == "output":
            pn.kind = "output"
            pn.inputs = [n.name for n in tensor_inputs(node)]
            for pred in pnodes:
                if pred.node.name in pn.inputs:
                    pred.is_output = True
        elif node.op == "call_function":
            ins = tensor_inputs(node)
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
                    isinstance(node.args[0].meta.get("val"), (tuple, list)):
                pn.kind = "getitem" if isinstance(val, torch.Tensor) else "skip"
                pn.inputs = [node.args[0].name]
            elif node.target in registry:
                pn.kind = "op"
                pn.inputs = [n.name for n in ins]
                call = make_call(node, tp, blocks)
                memo_key = _call_key(call)
                if memo_key not in strategy_memo:  # repeated layers repeat their calls
                    strategy_memo[memo_key] = registry.strategies(call)
                pn.strategies = strategy_memo[memo_key]
                forced = dict(options.force).get(node.name)
                if forced is not None:
                    pn.strategies = [pn.strategies[forced]]
            elif ins or isinstance(val, (torch.Tensor, tuple, list)):
                if options.strict:
                    raise NoRuleError(
                        f"autotp has no layout rule for {node.target}{where(node)}\n  pass "
                        "strict=False to compute it replicated (recorded in the plan), or "
                        "register a rule for it"
                    )
                pn.kind = "op"
                pn.fallback = True
                pn.inputs = [n.name for n in ins]
                call = make_call(node, tp, blocks)
                out = (tuple(None if o is None else R for o in call.output)
                       if isinstance(call.output, tuple) else
                       (R if call.output is not None else None))
                pn.strategies = [Strategy((R,) * len(ins), out, name="fallback"),
                                 Strategy((R_STAR,) * len(ins),
                                          _map_out(out, R_STAR), name="fallback")]
            pn.requires_grad = any(grad.get(n, False) for n in pn.inputs) and _floating(val)
        grad[node.name] = pn.requires_grad
        pn.nbytes = _nbytes(val, cost_model, dims)
        if pn.kind == "op":
            pn.flops = _flops(node, cost_model, dims)
        pnodes.append(pn)
    return pnodes


def _call_key(call: Any) -> Any:
    try:
        return (call.op, repr(call.args), repr(sorted(call.kwargs.items())), call.inputs,
                call.output)
    except TypeError:  # unhashable argument: no memo
        return object()


def _map_out(out: Any, layout: Layout) -> Any:
    if isinstance(out, tuple):
        return tuple(None if o is None else layout for o in out)
    return None if out is None else layout


def _floating(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return val.dtype.is_floating_point
    if isinstance(val, (tuple, list)):
        return any(_floating(v) for v in val)
    return False


# ---- solver --------------------------------------------------------------------------------


def _split_cost(strategy: Strategy) -> bool:
    layouts = list(strategy.inputs) + output_layouts(strategy.output)
    return any(isinstance(x, (Shard, Partial)) for x in layouts)


def solve(
    pnodes: list[PNode], tp: int, cost_model: CostModel, options: PlanOptions
) -> tuple[dict[str, Any], float]:
    """Returns per node: the strategy index (ops) or stored layout (leaves), and the cost."""
    by_name = {pn.node.name: pn for pn in pnodes}
    last_use: dict[str, int] = {}
    for i, pn in enumerate(pnodes):
        for name in pn.inputs:
            last_use[name] = i
    for pn in pnodes:
        pn.live = pn.node.name in last_use

    def transition(pn: PNode, entries: dict, cost: float):
        return _transitions(pn, entries, cost, by_name, tp, cost_model, options)

    candidates = _leaf_candidates(pnodes, by_name)
    for name, layout in options.force:
        if name in candidates and (by_name[name].is_param or layout == R):
            candidates[name] = [layout]  # buffers are never stored sharded
    solver = FrontierSolver(pnodes, by_name, last_use, candidates,
                            leaf_memory_cost(tp, cost_model), transition, options.max_states,
                            reuse_layers=options.reuse_layers)
    return solver.run()


def _leaf_candidates(pnodes: list[PNode], by_name: dict[str, PNode]) -> dict[str, list[Layout]]:
    wanted: dict[str, set[Layout]] = {}
    for pn in pnodes:
        for strategy in pn.strategies:
            for name, layout in zip(pn.inputs, strategy.inputs):
                leaf = by_name[name]
                # only parameters are stored sharded; buffers stay whole on every rank
                if leaf.kind == "leaf" and leaf.is_param and isinstance(layout, Shard):
                    wanted.setdefault(name, set()).add(layout)
    out: dict[str, list[Layout]] = {}
    for pn in pnodes:
        if pn.kind == "leaf":
            out[pn.node.name] = [R] + sorted(wanted.get(pn.node.name, ()))
    return out


def _key(entries: dict[str, Entry]) -> frozenset:
    """Order-free and hashable; never iterated, so hash randomization cannot reorder plans."""
    return frozenset(entries.items())


def _transitions(pn: PNode, entries: dict[str, Entry], cost: float, by_name: dict[str, PNode],
                 tp: int, cost_model: CostModel, options: PlanOptions):
    """Yield (choice, (cost, entries)) for every feasible strategy of ``pn``."""
    if pn.kind == "getitem":
        (name,) = pn.inputs
        layout, _ = entries[name]
        index = pn.node.args[1]
        out = dict(entries)
        element = layout[index] if isinstance(layout, tuple) else layout
        out[pn.node.name] = (element, frozenset())
        yield None, (cost, out)
        return
    if pn.kind == "output":
        wants = [R] * len(pn.inputs)
        result = _read_inputs(pn, wants, entries, cost, by_name, tp, cost_model, options,
                              to_output=True)
        if result is not None:
            yield None, result
        return
    if pn.split is None:
        pn.split = [_split_cost(s) for s in pn.strategies]
    for index, strategy in enumerate(pn.strategies):
        extra = pn.flops / (tp if pn.split[index] else 1)
        own = cost_model.compute_time(extra)
        if isinstance(strategy.output, Partial):
            own += cost_model.partial_output
        result = _read_inputs(pn, list(strategy.inputs), entries, cost + own, by_name, tp,
                              cost_model, options)
        if result is None:
            continue
        new_cost, new_entries = result
        out = strategy.output
        if out is not None and pn.live:
            if not pn.requires_grad:
                out = _drop_grad_partial(out)
            new_entries[pn.node.name] = (out, frozenset())
        yield index, (new_cost, new_entries)


def _drop_grad_partial(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(R if isinstance(o, Replicate) else o for o in out)
    return R if isinstance(out, Replicate) else out


def _read_inputs(pn, wants, entries, cost, by_name, tp, cost_model, options, to_output=False):
    """Charge the redistributions that bring ``pn``'s inputs to the layouts it wants.

    Shards originate at parameters: a replicated activation is sliced only to meet another
    activation that already arrives sharded (a replicated k/v meeting sharded query heads),
    never to start a shard by itself (that would turn a free replicated op into a
    row-parallel one whose only gain is parameter memory, paid with an all-reduce).
    """
    new_entries = dict(entries)
    sliced = anchored = False
    for name, want in zip(pn.inputs, wants):
        src_pn = by_name[name]
        if src_pn.kind == "input":
            have: Any = R
            materialized: frozenset = frozenset()
        else:
            have, materialized = new_entries[name]
        if isinstance(have, tuple):
            return None
        if have == want or want in materialized:
            anchored |= isinstance(want, Shard) and src_pn.kind != "leaf"
            continue
        if not src_pn.requires_grad and isinstance(have, Replicate) and \
                isinstance(want, Replicate):
            continue
        if isinstance(have, Replicate) and isinstance(want, Shard) and src_pn.kind != "leaf":
            sliced = True
        step = transition(have, want, requires_grad=src_pn.requires_grad,
                          to_output=to_output or src_pn.is_output,
                          sequence_parallel=options.sequence_parallel)
        if step is None:
            return None
        for kind in (step.forward, step.backward):
            if kind is not None:
                cost += cost_model.collective_time(kind, src_pn.nbytes, tp)
        if step.last_resort:
            cost += cost_model.last_resort
        if src_pn.kind != "input":
            new_entries[name] = (have, materialized | {want})
    if sliced and not anchored:
        return None
    return cost, new_entries


# ---- plan assembly -------------------------------------------------------------------------


def assemble(captured: Captured, pnodes: list[PNode], decisions: dict[str, Any], total: float,
             tp: int, cost_model: CostModel, options: PlanOptions, model_name: str) -> Plan:
    dims = captured.dim_names
    by_name = {pn.node.name: pn for pn in pnodes}
    layers = {layer_of(pn.node) for pn in pnodes}
    plan = Plan(model=model_name, tp=tp, layers=len({x for x in layers if x is not None}))
    plan.cost = total
    plan.dims = {str(k): v for k, v in dims.items()}
    values: dict[str, Any] = {}
    for pn in pnodes:
        name = pn.node.name
        if pn.kind == "input":
            values[name] = R
        elif pn.kind == "leaf":
            values[name] = decisions.get(name, R)
        elif pn.kind == "op":
            strategy = pn.strategies[decisions[name]]
            out = strategy.output if pn.requires_grad else _drop_grad_partial(strategy.output)
            values[name] = out
            if pn.fallback:
                plan.fallbacks.append(f"{pn.node.target} at {name}: replicated "
                                      f"({source_of(pn.node) or 'unknown source'})")
            plan.choices[name] = Choice(
                op=str(pn.node.target), strategy=str(strategy),
                inputs=tuple(str(x) for x in strategy.inputs),
                output=format_output(out), layer=layer_of(pn.node),
                source=source_of(pn.node), candidates=len(pn.strategies))
        elif pn.kind == "getitem":
            parent = values[pn.inputs[0]]
            values[name] = parent[pn.node.args[1]] if isinstance(parent, tuple) else parent
    plan.values = {k: format_output(v) for k, v in values.items()}
    for pn in pnodes:
        if pn.kind in ("input", "leaf", "op", "getitem", "output"):
            name = pn.node.name
            plan.graph[name] = list(pn.inputs)
            plan.ops[name] = (str(pn.node.target) if pn.kind in ("op", "leaf") else pn.kind)
            plan.node_layers[name] = layer_of(pn.node)

    params = dict(captured.gm.named_parameters(remove_duplicate=False))
    grad_sync: set[str] = set()
    seen: set[tuple[str, str]] = set()
    for pn in pnodes:
        if pn.kind not in ("op", "output"):
            continue
        if pn.kind == "op":
            wants = list(pn.strategies[decisions[pn.node.name]].inputs)
        else:
            wants = [R] * len(pn.inputs)
        for name, want in zip(pn.inputs, wants):
            src = by_name[name]
            have = values[name]
            if have == want:
                continue
            if not src.requires_grad and isinstance(have, Replicate) and \
                    isinstance(want, Replicate):
                continue
            step = transition(have, want, requires_grad=src.requires_grad,
                              to_output=pn.kind == "output" or src.is_output,
                              sequence_parallel=options.sequence_parallel)
            assert step is not None, (name, have, want)
            fwd_layer = layer_of(src.node) if src.kind == "op" else layer_of(pn.node)
            bwd_layer = layer_of(pn.node) if pn.kind == "op" else layer_of(src.node)
            is_param_sync = (src.kind == "leaf" and src.is_param and isinstance(have, Replicate)
                             and isinstance(want, Replicate) and want.grad_partial)
            plan.edges.append(Edge(
                value=name, consumer=pn.node.name, src=str(have), dst=str(want),
                forward=step.forward.value if step.forward else None,
                backward=None if is_param_sync else (step.backward.value if step.backward
                                                     else None),
                layer=fwd_layer if step.forward else bwd_layer))
            if is_param_sync:
                grad_sync.add(src.node.target)
                continue
            if step.last_resort and (name, str(want)) not in seen:
                plan.fallbacks.append(
                    f"{name} ({have}) is gathered for {pn.node.target} at {pn.node.name}, "
                    f"which only runs replicated ({source_of(pn.node) or 'unknown source'})")
            if (name, str(want)) in seen:
                continue
            seen.add((name, str(want)))
            nbytes = _bytes_expr(src.node, dims)
            for kind, phase, layer in ((step.forward, "forward", fwd_layer),
                                       (step.backward, "backward", bwd_layer)):
                if kind is not None:
                    plan.collectives.append(CollectiveRecord(
                        kind=kind.value, phase=phase, layer=layer, bytes_expr=nbytes,
                        node=name, source=source_of(pn.node if phase == "backward" else src.node),
                        src=str(have), dst=str(want)))
    for pn in pnodes:
        if pn.kind == "leaf" and pn.is_param:
            target = pn.node.target
            layout = values[pn.node.name]
            global_shape = tuple(int(s) for s in params[target].shape)
            plan.params[target] = ParamPlan(
                layout=str(layout), global_shape=global_shape,
                local_shape=local_shape(global_shape, layout, tp),
                names=tuple(captured.aliases.get(target, [target])),
                grad_sync=target in grad_sync,
                layer=_first_use_layer(pn.node))
    if grad_sync:
        numel = sum(math.prod(params[t].shape) * params[t].element_size() for t in grad_sync)
        plan.collectives.append(CollectiveRecord(
            kind=Collective.ALL_REDUCE.value, phase="backward", layer=None,
            bytes_expr=str(numel), node="grad sync: " + ", ".join(sorted(grad_sync)),
            source=None, src="R*", dst="R"))
    return plan


def _first_use_layer(node: fx.Node) -> Optional[int]:
    for user in node.users:
        layer = layer_of(user)
        if layer is not None:
            return layer
    return None


def _bytes_expr(node: fx.Node, dims: dict) -> str:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "0"
    expr: Any = val.element_size()
    for size in val.shape:
        expr = expr * size_expr(size)
    return readable(expr, dims)


__all__ = ["plan_graph", "PlanOptions", "is_tensor_node"]
