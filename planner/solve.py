"""The planner: one strategy per op, minimizing the cost model, by dynamic programming.

The problem. For each op node n pick a strategy s_n from the rules; for each parameter p pick
a stored layout L_p. A value v then has the layout out(s_producer); a consumer that wants it
in another layout pays the redistribution's collectives (``transitions``). Minimize

    sum_p mem(L_p)  +  sum_n compute(s_n)  +  sum_(v, L) redistribute(layout(v) -> L)

where each (value, target layout) pair is paid once however many consumers read it (the
rewriter reuses the redistributed tensor: one f for q, k and v). Where each term lives:

    mem(L_p)                     frontier.leaf_memory_cost, CostModel.memory_cost
    compute(s_n)                 _transitions (work divided by tp when the strategy splits it)
    redistribute(a -> b)         _read_inputs, with the table of autotp.planner.transitions
    "shards start at weights"    _read_inputs: a replicated activation is sliced only to meet
                                 an activation that already arrives sharded
    the candidates s_n, L_p      autotp.planner.problem (rules via the registry)

The solver (``solve``). Nodes are visited in topological order; a DP state assigns a layout
(and the set of layouts already materialized) to every *live* value: produced, and read by a
node still to come. Liveness is a property of the graph, so each state holds the same values
and the DP is exact over this frontier. Parameters enter the frontier at their first use.
A bounded beam (``max_states``) keeps the work linear in the graph size; ties keep their
insertion order (a stable sort), so plans are deterministic. Repeated layers are solved once
(autotp.planner.frontier).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import fields, replace
from typing import Any, Callable, Optional

import torch

from autotp.capture.trace import Captured, sequence_symbols
from autotp.layout import R, ROUTED, Partial, Replicate, Shard
from autotp.planner.cache import cached, plan_key
from autotp.planner.cost import CostModel, parse_size_expr
from autotp.planner.assemble import assemble
from autotp.planner.checks import (
    check_divisibility,
    check_heads,
    note_replicated_products,
    replicated_products,
)
from autotp.planner.column_row import column_row_layouts
from autotp.planner.segmentations import block_counts
from autotp.planner.frontier import FrontierSolver, leaf_memory_cost
from autotp.planner.problem import (
    Entry,
    PlanOptions,
    PNode,
    joins_ahead,
    build_problem,
    drop_grad_partial,
    is_grouped,
    leaf_candidates,
    output_layout,
)
from autotp.planner.plan import Plan
from autotp.planner.transitions import transition
from autotp.progress import stage, step as progress_step
from autotp.rules.registry import Registry, Strategy, output_layouts

aten = torch.ops.aten


def plan_graph(
    captured: Captured,
    tp: int,
    *,
    registry: Optional[Registry] = None,
    cost_model: Optional[CostModel] = None,
    options: PlanOptions = PlanOptions(),
    model_name: str = "model",
    share: Optional[Callable[[str, Callable[[], str]], str]] = None,
    problems: Optional[dict[str, list[PNode]]] = None,
) -> Plan:
    """The plan of ``captured`` at degree ``tp``. ``share``: (the program's key, make) -> the
    plan's JSON as every rank of a group holds it; one rank makes it (searching, or reading
    the cache) and the others receive it (``ProcessGroupComm.made_once``). ``problems``:
    the problems built so far, kept by the caller between plans of one ``captured``, ``tp``,
    registry and cost model (explain's forced alternatives)."""
    default_rules = registry is None
    registry = registry or Registry.default()
    cost_model = cost_model or CostModel()
    gm = captured.gm
    # (context parallelism splits the sequence: any head count runs by the ring)
    fallbacks = [] if options.context_parallel else check_heads(gm, tp, options.strict)
    blocks = block_counts(gm, sequence_symbols(captured.dim_names) if options.context_parallel
                          else frozenset())

    def problem(options: PlanOptions) -> list[PNode]:
        if problems is None:
            return build_problem(captured, tp, blocks, registry, cost_model, options)
        # the beam (its width, its ranking) and a leaf's forced layout are the solver's:
        # one problem serves them all, its memoized costs (PNode.own, .reads) too
        ops = {node.name for node in gm.graph.nodes if node.op == "call_function"}
        built = replace(options, max_states=0, lookahead=False,
                        force=tuple((name, c) for name, c in options.force if name in ops))
        key = repr(_options_key(built))  # (as the cache's key reads it)
        if key not in problems:
            problems[key] = build_problem(captured, tp, blocks, registry, cost_model, built)
        return problems[key]

    def plan_with(options: PlanOptions) -> tuple[Plan, bool]:
        """The plan under ``options``, and whether its search was exhaustive: the beam cut
        no state and no strategy was left out that a search with partial statistics
        offers."""
        pnodes = problem(options)
        progress_step(f"a search of {options.max_states} states"
                      + (", ranked by what they owe" if options.lookahead else ""))
        decisions, total, exhaustive = solve(pnodes, tp, cost_model, options)
        if not exhaustive and tp > 1 and not options.context_parallel:
            decisions, total = _no_worse_than_column_row(pnodes, decisions, total, tp,
                                                         cost_model, options)
        plan = assemble(captured, pnodes, decisions, total, tp, cost_model, options,
                        model_name)
        return plan, exhaustive and not any(pn.premium_dropped for pn in pnodes)

    def search() -> Plan:
        first = options
        if any(node.op == "call_function" and is_grouped(node) for node in gm.graph.nodes):
            # every op on a MoE block's rows may run on routed rows (S(0)@experts) too: as
            # many more plans of equal cost, which crowd a 64-state beam
            first = replace(options, max_states=4 * options.max_states)
        if tp == 1:  # every layout is whole on the one rank: no plan falls short of another
            return plan_with(first)[0]
        return _search_further(*plan_with(first), gm, first, cost_model, plan_with)

    key_parts = (tp, _options_key(options), repr(cost_model), model_name)

    def made() -> Plan:
        if default_rules:  # a registry of the caller's is code the cache key cannot see
            return cached(captured, key_parts, search)
        return search()

    with stage(f"planning tp={tp}"):
        if share is None:
            plan = made()
        else:
            plan = Plan.from_json(share(plan_key(captured, key_parts),
                                        lambda: made().to_json()))
    plan.fallbacks = fallbacks + plan.fallbacks
    if not options.context_parallel:  # (context parallelism holds every matrix whole)
        check_divisibility(plan, tp, options.strict)
        note_replicated_products(plan, gm, options.strict, options.reported,
                                 problem=lambda: problem(options))
    for text in plan.fallbacks:
        warnings.warn(f"autotp: {text}", stacklevel=3)
    return plan


def _options_key(options: PlanOptions) -> tuple:
    """``options`` as a key that reads the same in every process (a frozenset's order
    follows the string hashes, which differ between processes)."""
    return tuple((f.name, sorted(value) if isinstance(value, frozenset) else value)
                 for f in fields(options) for value in [getattr(options, f.name)])


def _search_further(plan: Plan, exhaustive: bool, gm: Any, options: PlanOptions,
                    cost_model: CostModel, plan_with: Any) -> Plan:
    """The plan kept when the first one falls short:

        shortfalls(p) = (p's last-resort redistributions, the matrices p leaves replicated
                         that tp could shard + the stacked experts p slices where tp
                         divides them)
        alt           = the plan with a 4x wider beam and, unless the options say otherwise,
                        partial statistics; where alt still falls short, the same ranked by
                        cost plus what states still owe (``FrontierSolver.ahead``) if it
                        falls short less (or as much, at a lower cost)
        keep alt  iff   shortfalls(alt) < shortfalls(first)  (none more, at least one fewer)
                   and alt has fewer last-resort redistributions than first, or,
                        per layer and direction,
                        large collectives(alt) <= max(4, large collectives(first))
                        bytes(alt) <= max(1.05 bytes(first), 2.05 largest(first))

    A large collective carries at least an eighth of the bytes of the first plan's largest
    of the layer (a norm's statistic does not); 4 is Megatron's count with sequence
    parallelism's pairs, 2 x largest its two all-reduces.

    The wider beam: plans of equal cost (rotary embeddings) fill 64 states while the plan
    that pays early to save later (a replicated k/v meeting sharded query heads, a MoE
    block's input all-reduced ahead of its router) is dropped. The ranking by what states
    owe keeps states that paid already ahead of those that saved a collective by leaving a
    value in a layout its later readers cannot take (a residual stream reduce-scattered
    along h, a norm ahead); neither ranking finds every plan the other does, so both are
    tried, the plain one first. Partial statistics: a norm over a sharded dim all-reduces
    its [.., 1] statistic instead of keeping the dim whole (q/k norms over all heads would
    otherwise hold the attention's output projection and the MLP's down projection whole);
    their premium keeps a plan from trading a replicated residual stream for k/v
    projections narrower than it.

    A first search that was exhaustive (its beam cut no state, and no premium strategy was
    left out) found the least cost already: the wider searches solve the same problem, so
    they are skipped (a k/v projection narrower than tp's heads is whole in every plan)."""
    def shortfalls(plan: Plan) -> tuple[int, int]:
        # wide matrices count even where their replication is Megatron's choice for the
        # plan at hand (q/k projections ahead of norms over all heads): a plan with partial
        # statistics may shard them
        stuck = [node for node, _, odd in replicated_products(plan, gm, options.reported,
                                                              wide_heads=True)
                 if not odd]
        # experts sliced (or whole on every rank) where tp divides them: e/tp whole experts
        # per rank run fewer, wider GEMMs at the same communication
        sliced = [t for t, (count, how) in plan.experts.items()
                  if how != "whole" and count % plan.degree == 0]
        return plan.last_resorts, len(stuck) + len(sliced)

    before = shortfalls(plan)
    if before == (0, 0) or exhaustive:
        return plan
    wider = replace(options, max_states=4 * options.max_states,
                    partial_statistics=options.partial_statistics is not False)
    alt = plan_with(wider)[0]
    after = shortfalls(alt)
    if after != (0, 0):
        ranked = plan_with(replace(wider, lookahead=True))[0]
        owes = shortfalls(ranked)
        if _fewer(owes, after) or (owes == after and ranked.cost < alt.cost):
            alt, after = ranked, owes
    if after == before or any(a > b for a, b in zip(after, before)):
        return plan
    # "large" against the first plan's largest collective of the layer: a plan whose own
    # largest is inflated (a hidden-sharded residual stream gathering expert inputs) must
    # not make its other collectives look small
    reference = _largest(plan, cost_model)
    counted_before = _large_collectives(plan, cost_model)
    for key, count in _large_collectives(alt, cost_model, reference).items():
        if count > max(4, counted_before.get(key, 0)):
            return plan
    if after[0] < before[0]:
        # fewer last-resort redistributions: those are taken only where no plan without
        # them exists (autotp.planner.transitions), and the first plan's bytes are no
        # reference (its gather moves a layer's collective elsewhere, or out of the layers)
        return alt
    # nor more bytes than the first plan or Megatron's two reductions of the layer's largest
    # tensor: a low-rank down-projection is sharded only by all-reducing every head's
    # output, several times Megatron's bytes, where Megatron keeps it whole
    bytes_before = {key: sum(v) for key, v in _layer_sizes(plan, cost_model).items()}
    for key, values in _layer_sizes(alt, cost_model).items():
        limit = max(1.05 * bytes_before.get(key, 0.0), 2.05 * reference.get(key[0], 0.0))
        if sum(values) > limit:
            return plan
    return alt


def _no_worse_than_column_row(pnodes: list[PNode], decisions: dict[str, Any], total: float,
                              tp: int, cost_model: CostModel, options: PlanOptions
                              ) -> tuple[dict[str, Any], float]:
    """The beam's decisions, or the column/row plan's where those cost less.

    The beam keeps a bounded number of states; plans of equal cost early in a layer
    (rotary embeddings, the blocks of a fused projection) can crowd out the one that pays a
    little early for the column/row pattern later (a residual stream left split along the
    hidden dim instead: several collectives a layer where Megatron has two). Where the
    beam's plan holds some matrix outside its role (``autotp.planner.column_row``), the problem
    is solved once more with every matrix that has a role held to it, and the cheaper of the
    two is kept: no plan costs more than the column/row plan of its problem."""
    allowed = column_row_layouts(pnodes)
    if all(decisions.get(name) in layouts for name, layouts in allowed.items()):
        return decisions, total  # the beam's plan is the column/row plan already
    progress_step("a search with the matrices as column/row")
    held, held_total, _ = solve(pnodes, tp, cost_model, options, allowed=allowed)
    if held_total < total * (1 - 1e-9):
        return held, held_total
    return decisions, total


def _fewer(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Shortfalls ``a`` are fewer than ``b``: none more, and not the same."""
    return a != b and all(x <= y for x, y in zip(a, b))


def record_bytes(record: Any, cost_model: CostModel) -> float:
    """A recorded collective's bytes at the cost model's reference batch and sequence (its
    sizes are named B and T: cost.readable)."""
    expr = parse_size_expr(record.bytes_expr)
    return cost_model.evaluate(expr, {sym: str(sym) for sym in expr.free_symbols})


def _layer_sizes(plan: Plan, cost_model: CostModel) -> dict[tuple, list[float]]:
    """(layer, phase) -> the bytes of each collective, at the reference batch and sequence."""
    sizes: dict[tuple, list[float]] = {}
    for record in plan.collectives:
        if record.layer is not None:
            sizes.setdefault((record.layer, record.phase), []).append(
                record_bytes(record, cost_model))
    return sizes


def _largest(plan: Plan, cost_model: CostModel,
             sizes: Optional[dict[tuple, list[float]]] = None) -> dict[Any, float]:
    """layer -> the bytes of its largest collective."""
    largest: dict[Any, float] = {}
    for (layer, _), values in (sizes or _layer_sizes(plan, cost_model)).items():
        largest[layer] = max(largest.get(layer, 0.0), *values)
    return largest


def _large_collectives(plan: Plan, cost_model: CostModel,
                       reference: Optional[dict[Any, float]] = None) -> dict[tuple, int]:
    """(layer, phase) -> the collectives carrying at least an eighth of the bytes of the
    layer's largest (``reference``'s where it has the layer, else this plan's own)."""
    sizes = _layer_sizes(plan, cost_model)
    largest = {**_largest(plan, cost_model, sizes), **(reference or {})}
    return {key: sum(1 for v in values if v * 8 >= largest[key[0]])
            for key, values in sizes.items()}


# ---- problem -------------------------------------------------------------------------------


# ---- solver --------------------------------------------------------------------------------


def _split_cost(strategy: Strategy) -> bool:
    layouts = list(strategy.inputs) + output_layouts(strategy.output)
    return any(isinstance(x, (Shard, Partial)) for x in layouts)


def solve(
    pnodes: list[PNode], tp: int, cost_model: CostModel, options: PlanOptions,
    allowed: Optional[dict[str, list[Any]]] = None,
) -> tuple[dict[str, Any], float, bool]:
    """Returns per node: the strategy index (ops) or stored layout (leaves), the cost, and
    whether the search was exhaustive (the beam cut no state). ``allowed``: leaf -> the
    stored layouts it may take (others' candidates as the problem gives them)."""
    by_name = {pn.node.name: pn for pn in pnodes}
    last_use: dict[str, int] = {}
    for i, pn in enumerate(pnodes):
        for name in pn.inputs:
            last_use[name] = i
    for pn in pnodes:
        pn.live = pn.node.name in last_use

    def transition(pn: PNode, entries: dict, cost: float):
        return _transitions(pn, entries, cost, by_name, tp, cost_model, options)

    candidates = leaf_candidates(pnodes, by_name)
    if options.context_parallel:  # every rank holds the parameters whole
        candidates = {name: [R] for name in candidates}
    for name, layouts in (allowed or {}).items():
        kept = [c for c in candidates.get(name, ()) if c in layouts]
        if kept:
            candidates[name] = kept
    for name, layout in options.force:
        leaf = by_name[name] if name in candidates else None
        if leaf is not None and (leaf.is_param or leaf.is_state or layout == R):
            candidates[name] = [layout]  # buffers are never stored sharded
    solver = FrontierSolver(pnodes, by_name, last_use, candidates,
                            leaf_memory_cost(tp, cost_model, pnodes), transition,
                            options.max_states,
                            reuse_layers=options.reuse_layers,
                            owed=_owed(pnodes, by_name, tp, cost_model, options)
                            if options.lookahead else None)
    decisions, cost = solver.run()
    return decisions, cost, not solver.ever_cut


def _owed(pnodes: list[PNode], by_name: dict[str, PNode], tp: int, cost_model: CostModel,
          options: PlanOptions) -> Callable[[int, str, Entry], float]:
    """(step i, value, its entry) -> the most one of the value's readers after step i must
    pay at least to read it: the cheapest of the layouts that reader's strategies take,
    from the value's layout or one it has already materialized (0 where it takes one)."""
    readers: dict[str, list[tuple[int, frozenset]]] = {}
    for i, pn in enumerate(pnodes):
        for k, name in enumerate(pn.inputs):
            if pn.kind == "op":
                takes = frozenset(s.inputs[k] for s in pn.strategies if len(s.inputs) > k)
            elif pn.kind == "output" and name not in pn.returned_sharded:
                takes = frozenset([R])
            else:
                continue
            if takes:
                readers.setdefault(name, []).append((i, takes))
    memo: dict[tuple, float] = {}

    def move(name: str, have: Any, want: Any) -> float:
        src = by_name[name]
        if not src.requires_grad and isinstance(have, Replicate) and \
                isinstance(want, Replicate):
            return 0.0  # as _read_inputs: no gradient to sum
        step = transition(have, want, requires_grad=src.requires_grad,
                          sequence_parallel=src.sequence_step(have, want, options))
        if step is None:
            return math.inf
        # joined with others (autotp.planner.invariant, the gradient bucket): no latency of its own
        joined = src.invariant or src.is_param
        cost = sum(cost_model.transfer_time(kind, src.nbytes, tp) if joined
                   else cost_model.collective_time(kind, src.nbytes, tp)
                   for kind in (step.forward, step.backward) if kind is not None)
        return cost + (cost_model.last_resort if step.last_resort else 0.0)

    def owed(i: int, name: str, entry: Entry) -> float:
        have, materialized = entry
        later = [takes for j, takes in readers.get(name, ()) if j > i]
        if not later or isinstance(have, tuple):
            return 0.0
        key = (name, have, materialized, len(later))
        if key not in memo:
            least = [0.0 if have in takes or takes & materialized else
                     min(move(name, have, want) for want in takes) for takes in later]
            memo[key] = max(least)
        return memo[key]

    return owed


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
        wants = [output_layout(_entry_layout(entries, by_name, name), pn, name)
                 for name in pn.inputs]
        result = _read_inputs(pn, wants, entries, cost, by_name, tp, cost_model, options,
                              to_output=True)
        if result is not None:
            yield None, result
        return
    if pn.own is None:
        pn.own = [_own_cost(pn, strategy, by_name, tp, cost_model, options)
                  for strategy in pn.strategies]
    for index, strategy in enumerate(pn.strategies):
        own, out = pn.own[index]
        result = _read_inputs(pn, strategy.inputs, entries, cost + own, by_name, tp,
                              cost_model, options)
        if result is None:
            continue
        new_cost, new_entries = result
        if options.sequence_parallel and pn.requires_grad and pn.saved and \
                not isinstance(out, tuple):
            held = pn.nbytes / (tp if isinstance(out, Shard) else 1)
            new_cost += cost_model.activation_weight * held
        if out is not None and pn.live:
            new_entries[pn.node.name] = (out, frozenset())
        yield index, (new_cost, new_entries)


def _own_cost(pn: PNode, strategy: Strategy, by_name: dict[str, PNode], tp: int,
              cost_model: CostModel, options: PlanOptions) -> tuple[float, Any]:
    """A strategy's own cost (its compute, a partial output's premium, the memory of the
    states it writes) and the layout of its output, whatever state it runs in."""
    own = cost_model.compute_time(pn.flops / (tp if _split_cost(strategy) else 1),
                                  pn.groups // tp if strategy.name == "experts" else pn.groups)
    if isinstance(strategy.output, Partial):
        own += cost_model.partial_output
    if strategy.premium:
        own += cost_model.premium_cost(strategy.premium, tp)
    for name, layout in zip(pn.inputs, strategy.inputs):
        state = by_name[name]
        if name in pn.mutated and state.is_state:  # the memory of the state it writes
            per_rank = state.nbytes / (tp if isinstance(layout, Shard) else 1)
            own += cost_model.memory_cost(per_rank, state.ndim)
    out = strategy.output
    if out is not None and not pn.requires_grad:
        out = drop_grad_partial(out)
    return own, out


def _entry_layout(entries: dict[str, Entry], by_name: dict[str, PNode], name: str) -> Any:
    return R if by_name[name].kind == "input" else entries[name][0]


_EMPTY: frozenset = frozenset()
_FAIL = None  # a read no transition makes


def _read_inputs(pn, wants, entries, cost, by_name, tp, cost_model, options, to_output=False):
    """Charge the redistributions that bring ``pn``'s inputs to the layouts it wants.

    Shards originate at parameters: a replicated activation is sliced only to meet another
    activation that already arrives sharded (a replicated k/v meeting sharded query heads),
    never to start a shard by itself (that would turn a free replicated op into a
    row-parallel one whose only gain is parameter memory, paid with an all-reduce). With
    context parallelism they originate at the inputs, sliced along the sequence.

    Each read's outcome depends on the read alone, not on the state: it is worked out once
    per plan (``_read``, memoized in ``pn.reads``) and its costs added in the same order.
    """
    new_entries = dict(entries)
    sliced = anchored = False
    reads = pn.reads
    for name, want in zip(pn.inputs, wants):
        if by_name[name].kind == "input":
            have: Any = R
            materialized: frozenset = _EMPTY
        else:
            have, materialized = new_entries[name]
        key = (name, have, want, want in materialized, to_output)
        outcome = reads.get(key, reads)
        if outcome is reads:
            outcome = reads[key] = _read(pn, by_name[name], have, want, key[3], tp,
                                         cost_model, options, to_output)
        if outcome is _FAIL:
            return None
        terms, slices, anchors, keeps = outcome
        sliced |= slices
        anchored |= anchors
        for term in terms:
            cost += term
        if keeps:
            new_entries[name] = (have, materialized | {want})
    if sliced and not anchored and not options.context_parallel:
        return None  # (context parallelism starts its sequence shards at the inputs)
    return cost, new_entries


def _read(pn: PNode, src_pn: PNode, have: Any, want: Any, materialized: bool, tp: int,
          cost_model: CostModel, options: PlanOptions, to_output: bool) -> Any:
    """One input read by ``pn`` as ``want`` where it is held as ``have`` (``materialized``:
    ``want`` was made from it already): None where no transition makes it, else (the costs
    to add, in order; it slices a replicated activation; it reads an activation's shard as
    it is; ``want`` joins the value's materialized layouts)."""
    name = src_pn.node.name
    if isinstance(have, tuple):
        return _FAIL
    if name in pn.mutated and have != want and not (
            isinstance(have, Replicate) and isinstance(want, Replicate)):
        return _FAIL  # an in-place op writes the tensor as it is stored, never a copy
    if have == want or materialized:
        return (), False, isinstance(want, Shard) and src_pn.kind != "leaf", False
    if not src_pn.requires_grad and isinstance(have, Replicate) and \
            isinstance(want, Replicate):
        return (), False, False, False
    # (routed rows are anchored by the experts that own them)
    sliced = isinstance(have, Replicate) and isinstance(want, Shard) and \
        src_pn.kind != "leaf" and want.blocks != ROUTED
    batched = joins_ahead(src_pn, pn, have, want, options)
    step = transition(have, want, requires_grad=src_pn.requires_grad,
                      to_output=to_output,
                      sequence_parallel=src_pn.sequence_step(have, want, options),
                      batched=batched)
    if step is None:
        return _FAIL
    # A replicated parameter's partial gradient joins the after-backward bucket, and a
    # layer-invariant value's gather every layer's: one collective for all of them, so
    # each pays bandwidth but no latency of its own.
    bucketed = batched or (src_pn.kind == "leaf" and src_pn.is_param and
                           isinstance(have, Replicate) and isinstance(want, Replicate))
    terms = [cost_model.transfer_time(kind, src_pn.nbytes, tp) if bucketed
             else cost_model.collective_time(kind, src_pn.nbytes, tp)
             for kind in (step.forward, step.backward) if kind is not None]
    if step.last_resort:
        terms.append(cost_model.last_resort)
    if src_pn.sequence_step(have, want, options) and _interleaves(src_pn, have, want):
        terms.extend(cost_model.copy_time(src_pn.nbytes)
                     for kind in (step.forward, step.backward) if kind is not None)
    return tuple(terms), sliced, False, src_pn.kind != "input"


def _interleaves(src_pn: PNode, have: Any, want: Any) -> bool:
    """A sequence collective along a dim after one of several indices (the sequence of a
    [B, T, H] batch): the ranks' pieces lie interleaved, and each collective copies its
    buffer (``ProcessGroupComm.all_gather``); along dim 0, or after dims of size 1, none."""
    shard = have if isinstance(have, Shard) else want
    val = src_pn.node.meta.get("val")
    return isinstance(shard, Shard) and isinstance(val, torch.Tensor) and \
        any(not (isinstance(size, int) and size == 1) for size in val.shape[:shard.dim])


__all__ = ["PlanOptions", "assemble", "block_counts", "build_problem", "plan_graph", "solve"]
