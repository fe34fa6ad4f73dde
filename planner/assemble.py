"""From the DP's decisions to a Plan: layouts of every value, the redistributions each
consumer needs, and the collectives they execute (forward and backward), with layers and
source lines."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from autotp.capture.blocks import layer_of
from autotp.capture.trace import (Captured, batch_symbols, module_of, origin_of, size_expr,
                                  source_of)
from autotp.errors import PlanError
from autotp.ops import repeated_heads
from autotp.layout import R, Partial, Replicate, Shard, is_mixed, local_shape, whole_numel
from autotp.planner.coalesce import join_siblings
from autotp.planner.cost import CostModel, attention_strategy, parse_size_expr, readable
from autotp.planner.invariant import stages
from autotp.planner.masks import attention_mask, mask_region
from autotp.planner.plan import AxisPlan, Choice, CollectiveRecord, Edge, ParamPlan, Plan
from autotp.planner.problem import (PlanOptions, PNode, drop_grad_partial, is_custom_op,
                                    is_grouped, joins_ahead, output_layout, splits_batch)
from autotp.planner.transitions import Collective, transition
from autotp.rules.registry import format_output, output_layouts


def _splits(pnodes: list[PNode], values: dict[str, Any], symbols: frozenset) -> bool:
    """Whether a value is held sharded along a dim whose size is one of ``symbols``."""
    for pn in pnodes:
        val, layout = pn.node.meta.get("val"), values.get(pn.node.name)
        if isinstance(val, torch.Tensor) and isinstance(layout, Shard) and \
                size_expr(val.shape[layout.dim]) in symbols:
            return True
    return False


def assemble(captured: Captured, pnodes: list[PNode], decisions: dict[str, Any], total: float,
             tp: int, cost_model: CostModel, options: PlanOptions, model_name: str) -> Plan:
    layers = {layer_of(pn.node) for pn in pnodes}
    # the axis this search lays the values out over (autotp.planner.context plans cp inside tp)
    plan = Plan.over("cp" if options.context_parallel else "tp", tp, model=model_name,
                     layers=len({x for x in layers if x is not None}))
    plan.layer_paths = list(captured.layers.paths)
    plan.cost = total
    plan.sequence_parallel = options.sequence_parallel
    if options.expert_parallel > 1:
        plan.axes["ep"] = AxisPlan("ep", options.expert_parallel)
    plan.dims = {str(k): v for k, v in captured.dim_names.items()}
    values, origin = _layouts(plan, pnodes, decisions, options)
    plan.batch_tokens = splits_batch(captured, tp, options) and \
        _splits(pnodes, values, batch_symbols(captured.dim_names))
    params = dict(captured.gm.named_parameters(remove_duplicate=False))
    grad_sync, gathered = _redistributions(plan, pnodes, decisions, values, origin, captured,
                                           options)
    _joined_collectives(plan, captured, gathered)
    synced_bytes = {t: params[t].numel() * params[t].element_size() for t in grad_sync}
    plan.expert_params = expert_params(pnodes, plan.choices)
    _parameters(plan, pnodes, values, params, captured, grad_sync, synced_bytes)
    plan.experts = expert_stacks(pnodes, values)
    if "ep" in plan.axes:  # at tp 1 every layout is whole on the one tp rank: ep splits them
        for target in set(plan.experts) & set(plan.expert_params):
            plan.experts[target][1] = "whole"
        plan.axes["ep"].params = {t: plan.params[t] for t in plan.expert_params
                                  if t in plan.params}
    if grad_sync:
        plan.collectives.append(CollectiveRecord(
            kind=Collective.ALL_REDUCE.value, phase="backward", layer=None,
            bytes_expr=str(sum(synced_bytes.values())),
            node="grad sync: " + ", ".join(sorted(grad_sync)),
            source=None, src="R*", dst="R"))
    join_siblings(plan, captured.gm.graph)
    return plan


def _layouts(plan: Plan, pnodes: list[PNode], decisions: dict[str, Any], options: PlanOptions
             ) -> tuple[dict[str, Any], dict[str, fx.Node]]:
    """Every value's layout and every op's choice (into ``plan``); returns the layouts and,
    for each partial sum, the op that made it: a value that is still P after linear ops (a
    cast, a scale, a residual add) is reduced where it is read, but it is the product's sum."""
    values: dict[str, Any] = {}
    origin: dict[str, fx.Node] = {}
    local_heads = {name: (hq, hk) for name, hq, hk in options.local_heads}
    order = {pn.node: i for i, pn in enumerate(pnodes)}
    for pn in pnodes:
        name = pn.node.name
        if pn.kind == "input":
            values[name] = R
        elif pn.kind == "leaf":
            values[name] = decisions.get(name, R)
            if pn.is_state:
                plan.states[str(pn.node.target)] = str(values[name])
        elif pn.kind == "op":
            strategy = pn.strategies[decisions[name]]
            out = strategy.output if pn.requires_grad else drop_grad_partial(strategy.output)
            values[name] = out
            carried = [origin[i] for i, want in zip(pn.inputs, strategy.inputs)
                       if isinstance(want, Partial) and i in origin]
            if any(isinstance(x, Partial) for x in output_layouts(out)):
                # partial sums added together: the latest maker (a residual stream kept
                # partial since the embedding is reduced for the block that adds to it)
                origin[name] = max(carried, key=order.__getitem__) if carried else pn.node
            if pn.constant:
                plan.constants.append(f"{pn.node.target} at {name} ({origin_of(pn.node)})")
            if pn.fallback:
                how = " (a custom op with no rule: autotp.register_rule)" \
                    if is_custom_op(pn.node.target) else ""
                plan.fallbacks.append(f"{pn.node.target} at {name}: replicated{how} "
                                      f"({origin_of(pn.node)})")
            plan.choices[name] = Choice(
                op=str(pn.node.target), strategy=_attention_kind(pn.node, str(strategy),
                                                                 plan.degree, plan.attention,
                                                                 local_heads),
                inputs=tuple(str(x) for x in strategy.inputs),
                output=format_output(out), layer=layer_of(pn.node),
                source=source_of(pn.node), candidates=len(pn.strategies))
        elif pn.kind == "getitem":
            parent = values[pn.inputs[0]]
            values[name] = parent[pn.node.args[1]] if isinstance(parent, tuple) else parent
            if pn.inputs[0] in origin:
                origin[name] = origin[pn.inputs[0]]
    plan.values = {k: format_output(v) for k, v in values.items()}
    for pn in pnodes:
        if pn.kind in ("input", "leaf", "op", "getitem", "output"):
            name = pn.node.name
            plan.graph[name] = list(pn.inputs)
            plan.ops[name] = (str(pn.node.target) if pn.kind in ("op", "leaf") else pn.kind)
            plan.node_layers[name] = layer_of(pn.node)
    return values, origin


def _redistributions(plan: Plan, pnodes: list[PNode], decisions: dict[str, Any],
                     values: dict[str, Any], origin: dict[str, fx.Node], captured: Captured,
                     options: PlanOptions) -> tuple[set[str], list[tuple[str, Any, str]]]:
    """Every consumer's redistributions into ``plan`` (edges, collectives, last resorts);
    returns the replicated parameters whose gradients are summed after backward, and the
    layer-invariant values gathered all at once (name, step, bytes)."""
    dims = captured.dim_names
    by_name = {pn.node.name: pn for pn in pnodes}
    grad_sync: set[str] = set()
    seen: set[tuple[str, str]] = set()
    gathered: list[tuple[str, Any, str]] = []
    for pn in pnodes:
        if pn.kind not in ("op", "output"):
            continue
        if pn.kind == "op":
            wants = list(pn.strategies[decisions[pn.node.name]].inputs)
        else:
            wants = [output_layout(values[name], pn, name) for name in pn.inputs]
            plan.outputs = [format_output(w) for w in wants]
            plan.gathered_when_read = {
                pn.returned_sharded[name]: format_output(want)
                for name, want in zip(pn.inputs, wants)
                if isinstance(want, Shard) and pn.returned_sharded[name] is not None}
        for name, want in zip(pn.inputs, wants):
            src = by_name[name]
            have = values[name]
            if have == want:
                continue
            if not src.requires_grad and isinstance(have, Replicate) and \
                    isinstance(want, Replicate):
                continue
            batched = joins_ahead(src, pn, have, want, options)
            step = transition(have, want, requires_grad=src.requires_grad,
                              to_output=pn.kind == "output",
                              sequence_parallel=src.sequence_step(have, want, options),
                              batched=batched)
            assert step is not None, (name, have, want)
            if batched:  # one collective for every layer's, before the first layer
                plan.edges.append(Edge(
                    value=name, consumer=pn.node.name, src=str(have), dst=str(want),
                    forward=step.forward.value, layer=None, batched=True,
                    backward=step.backward.value if step.backward else None))
                if (name, str(want)) not in seen:
                    seen.add((name, str(want)))
                    gathered.append((name, step, _bytes_expr(src.node, dims)))
                continue
            made = origin.get(name, src.node)  # a reduction belongs to the partial's maker
            fwd_layer = layer_of(made) if src.kind == "op" or name in origin else \
                layer_of(pn.node)
            # a reduction's conjugate belongs where the reduction is (the producer's side);
            # a gradient-only collective (Megatron's f) to the consumer
            bwd_layer = fwd_layer if step.forward else \
                (layer_of(pn.node) if pn.kind == "op" else layer_of(src.node))
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
                plan.last_resorts += 1
                plan.fallbacks.append(
                    f"{name} ({have}) is gathered for {pn.node.target} at {pn.node.name}, "
                    f"which only runs replicated ({origin_of(pn.node)})")
            if (name, str(want)) in seen:
                continue
            seen.add((name, str(want)))
            nbytes = _bytes_expr(src.node, dims)
            if isinstance(have, Partial) and have.reduce == "logsumexp":  # one value per rank
                nbytes = str(parse_size_expr(nbytes) * plan.degree)
            for kind, phase, layer in ((step.forward, "forward", fwd_layer),
                                       (step.backward, "backward", bwd_layer)):
                if kind is not None:
                    # forward: where the value is produced; backward: where it is read
                    at = pn.node if phase == "backward" else made
                    plan.collectives.append(CollectiveRecord(
                        kind=kind.value, phase=phase, layer=layer, bytes_expr=nbytes,
                        node=name, source=source_of(at), src=str(have), dst=str(want),
                        module=module_of(at)))
    return grad_sync, gathered


def _joined_collectives(plan: Plan, captured: Captured,
                        gathered: list[tuple[str, Any, str]]) -> None:
    """The joined collectives of layer-invariant values (autotp.runtime.batching): per
    phase, one of each kind per stage."""
    stage_of = stages(captured.gm.graph, {(e.value, e.consumer) for e in plan.edges
                                          if e.batched})
    for stage in sorted({stage_of[name] for name, _, _ in gathered}):
        for phase, kind, src_text in (("forward", Collective.ALL_REDUCE, "P"),
                                      ("forward", Collective.ALL_GATHER, "S"),
                                      ("backward", Collective.ALL_REDUCE, "P"),
                                      ("backward", Collective.REDUCE_SCATTER, "S")):
            joined = [(name, nbytes) for name, step, nbytes in gathered
                      if stage_of[name] == stage and
                      (step.forward if phase == "forward" else step.backward) is kind]
            if joined:
                plan.collectives.append(CollectiveRecord(
                    kind=kind.value, phase=phase, layer=None,
                    bytes_expr=readable(sum(parse_size_expr(b) for _, b in joined), {}),
                    node="batched: " + ", ".join(name for name, _ in joined),
                    source=None, src=src_text, dst="R"))


def _parameters(plan: Plan, pnodes: list[PNode], values: dict[str, Any],
                params: dict[str, torch.nn.Parameter], captured: Captured, grad_sync: set[str],
                synced_bytes: dict[str, int]) -> None:
    """Every parameter's ``ParamPlan``; mixed layouts add to ``grad_sync``."""
    for pn in pnodes:
        if pn.kind == "leaf" and pn.is_param:
            target = pn.node.target
            layout = values[pn.node.name]
            global_shape = tuple(int(s) for s in params[target].shape)
            if isinstance(layout, Shard) and is_mixed(layout.blocks):
                # the segments every rank holds whole have partial gradients: summed after
                # backward, as a replicated parameter's are
                grad_sync.add(target)
                synced_bytes[target] = whole_numel(global_shape, layout) * \
                    params[target].element_size()
            degree = plan.degree
            if plan.ep > 1 and target in plan.expert_params:
                # split along the experts tp * ep ways; at tp 1 the plan's own layout of the
                # weight is whole on the one tp rank (every layout is), so it is set here
                if plan.degree > 1 and layout != Shard(0):
                    raise PlanError(f"{target}: experts read whole by their grouped products "
                                    f"but stored as {layout}; ep needs them split along the "
                                    "experts")
                layout, degree = Shard(0), plan.degree * plan.ep
            plan.params[target] = ParamPlan(
                layout=str(layout), global_shape=global_shape,
                local_shape=local_shape(global_shape, layout, degree),
                names=tuple(captured.aliases.get(target, [target])),
                grad_sync=target in grad_sync,
                layer=_first_use_layer(pn.node),
                dtype=str(params[target].dtype).removeprefix("torch."))


def expert_stacks(pnodes: list[PNode], values: dict[str, Any]) -> dict[str, list]:
    """Stacked expert weights (read by a grouped product) -> [experts, how each rank holds
    them]: "whole" (sharded along the experts), "sliced" (tensor parallel inside every
    expert) or "replicated"."""
    params = {pn.node.name: pn for pn in pnodes if pn.kind == "leaf" and pn.is_param}
    out: dict[str, list] = {}
    for pn in pnodes:
        if pn.kind != "op" or not is_grouped(pn.node) or len(pn.node.args) < 2:
            continue
        weight = pn.node.args[1]
        while isinstance(weight, fx.Node) and weight.name not in params and \
                weight.op == "call_function" and len(weight.all_input_nodes) == 1:
            weight = weight.all_input_nodes[0]  # a transpose, a cast
        if not isinstance(weight, fx.Node) or weight.name not in params:
            continue
        layout = values[weight.name]
        how = "whole" if layout == Shard(0) else \
            "replicated" if isinstance(layout, Replicate) else "sliced"
        out[str(weight.target)] = [int(weight.meta["val"].shape[0]), how]
    return out


def expert_params(pnodes: list[PNode], choices: dict[str, Choice]) -> list[str]:
    """The parameters split along the experts with the rows routed to them: the stacked
    weights of grouped products that hold experts whole, and per-expert tables read at the
    routed rows' expert ids (gpt-oss's biases)."""
    out: list[str] = []
    for pn in pnodes:
        choice = choices.get(pn.node.name)
        if choice is None:
            continue
        if choice.strategy.endswith("[experts]"):
            arg = pn.node.args[1]
        elif choice.strategy.endswith("[expert rows]"):
            arg = pn.node.args[0]
        else:
            continue
        while isinstance(arg, fx.Node) and arg.op == "call_function" and \
                len(arg.all_input_nodes) == 1:
            arg = arg.all_input_nodes[0]  # a transpose, a cast
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) not in out:
            out.append(str(arg.target))
    return out


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


def _attention_kind(node: fx.Node, strategy: str, cp: int, why: dict[str, str],
                    local_heads: dict[str, tuple[int, int]]) -> str:
    """A ring-planned attention's strategy, ``[ulysses]`` where ``attention_kind`` says so
    (``local_heads``: node -> the heads one tp rank holds, where a tp plan splits them);
    ``why`` records each attention's kind and reason."""
    if not strategy.endswith("[ring]"):
        return strategy
    kind, reason = attention_kind(node, cp, heads=local_heads.get(node.name))
    why[node.name] = f"{kind}: {reason}"
    return strategy[:-len("[ring]")] + "[ulysses]" if kind == "ulysses" else strategy


def attention_kind(node: fx.Node, cp: int, tp: int = 1,
                   heads: Optional[tuple[int, int]] = None) -> tuple[str, str]:
    """("ring" or "ulysses", why) for an attention node sharded along the sequence over cp
    ranks (each holding 1/tp of the heads, for the estimate, or ``heads``: the query and
    key/value heads a tp plan leaves each rank, (0, 0) where it splits them unlike): Ulysses'
    all-to-alls where the
    attention takes no mask tensor and they send fewer bytes (``attention_strategy``: query
    and key/value heads that divide by cp, the key/value heads read through transformers'
    repeat for grouped queries). With a mask tensor the ring stays: it reads the mask's rows
    for this rank's queries (or builds its blocks: ``autotp.planner.masks``), where the
    all-to-all's head shards would need it whole."""
    q = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    k_arg = node.args[1] if len(node.args) > 1 else None
    source = repeated_heads(k_arg) or k_arg
    k = source.meta.get("val") if isinstance(source, fx.Node) else None
    mask = attention_mask(node)
    if mask is not None and mask_region(mask) is not None:
        return "ring", ("the attention reads a mask made by elementwise ops, which the ring "
                        "builds block by block from their operands")
    if mask is not None or not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "ring", "the attention reads a mask tensor, whose rows the ring takes"
    if heads == (0, 0):
        return "ring", ("the tp plan splits the query and key/value heads unlike: the ring "
                        "keeps each rank's heads paired")
    if heads is not None:
        return attention_strategy(heads[0], heads[1], cp)
    return attention_strategy(max(1, int(q.shape[1]) // tp), max(1, int(k.shape[1]) // tp), cp)
