"""The planning problem: one PNode per graph node, with its candidate strategies.

Values are named by their node. Each op node carries the strategies its rule offers (with
gradient semantics applied by the registry); parameters (leaves) carry the layouts they may be
stored in. Nothing here chooses: ``solve`` does.
"""

from __future__ import annotations

import operator
import enum
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from autotp.capture.outputs import loss_fields
from autotp.capture.trace import (Captured, batch_symbols, make_call, origin_of,
                                  sequence_symbols, size_expr, tensor_inputs)
from autotp.ops import arg_node
from autotp.errors import NoRuleError, PlanError, where
from autotp.layout import R, R_STAR, Layout, Partial, Replicate, Shard
from autotp.planner.cost import CostModel
from autotp.planner.invariant import layer_invariant
from autotp.planner.saved import saved_values
from autotp.planner.segmentations import block_counts  # noqa: F401 (re-exported)
from autotp.rules.matmul import GROUPED_MM
from autotp.rules.registry import Registry, Strategy, output_layouts

aten = torch.ops.aten


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
    is_output: bool = False  # the user receives it (gathered there, for the user only)
    # the output's inputs returned in the layout they are computed in where that is a shard
    # (``OutputGather``), each the field of the mapping returned it is
    returned_sharded: dict[str, Optional[str]] = field(default_factory=dict)
    live: bool = False  # some later node reads it
    # the solver's memo of what does not depend on the state: each strategy's own cost and
    # output entry, and each read (input, have, want, want already materialized, to the
    # output) -> its outcome (``solve._read``)
    own: Optional[list[tuple[float, Any]]] = None
    # strategies with a premium were left out (``PlanOptions.partial_statistics``)
    premium_dropped: bool = False
    reads: dict = field(default_factory=dict)
    seq_dims: frozenset = frozenset()  # dims of the sequence (sequence parallelism only)
    is_state: bool = False  # an input the caller keeps per rank in the planned layout (a cache)
    mutated: frozenset = frozenset()  # inputs an in-place op writes: read as they are stored
    saved: bool = False  # a reader keeps it for backward (autotp.planner.saved): activation memory
    constant: bool = False  # computed from no input, parameter or state: replicated, exact
    groups: int = 0  # the experts of a grouped product (one GEMM each)
    # computed from the inputs and its layer's own parameters alone (autotp.planner.invariant):
    # a gather or sum of it joins every layer's in one collective before the first layer
    invariant: bool = False

    def sequence_step(self, have: Any, want: Any, options: "PlanOptions") -> bool:
        """Whether have -> want moves a shard of the sequence (sequence parallelism's
        reduce-scatter and all-gather), as opposed to a shard of any other dim."""
        if not options.sequence_parallel:
            return False
        shard = have if isinstance(have, Shard) else want
        return isinstance(shard, Shard) and shard.dim in self.seq_dims


class OutputGather(enum.Enum):
    """Where the outputs the plan holds sharded (logits over the vocabulary) are gathered."""

    # in the program, unless the call computes a loss: then the tensor fields of the mapping
    # returned leave it sharded and are gathered when first read (autotp.runtime.outputs), as
    # Megatron and torchtitan never gather the logits a vocabulary-parallel loss reads
    READ = "read"
    ALWAYS = "always"  # in the program, in every call
    NEVER = "never"  # never: each rank receives its shard


@dataclass(frozen=True)
class PlanOptions:
    strict: bool = True
    sequence_parallel: bool = False
    # sequence parallelism's regions may split the batch where the example's batch divides by
    # tp: a token-wise region holds whole sequences, and its all-gathers and reduce-scatters
    # run along dim 0, with no copy to interleave the ranks' pieces (Megatron's [s, b, h]
    # layout gets the same from its sequence dim first). A call whose batch does not divide
    # runs a program planned without (``autotp.runtime.calls``).
    batch_tokens: bool = True
    # where outputs the plan holds sharded (logits over the vocabulary) are gathered
    gather_outputs: OutputGather = OutputGather.READ
    max_states: int = 64
    # placeholders that are state the caller allocates on each rank in the layout the plan
    # gives (a KV cache written in place): like parameters, they may be stored sharded
    state_inputs: tuple[str, ...] = ()
    reuse_layers: bool = True
    # parameters another plan of the same weights already keeps replicated and reported (a
    # decoding program reads the training program's): not reported again
    reported: frozenset[str] = frozenset()
    # node name -> strategy index (ops) or stored layout (parameters): for ``explain``
    force: tuple[tuple[str, Any], ...] = ()
    # Strategies outside Megatron's pattern that carry a premium (a norm's statistic over a
    # sharded dim): None offers them only to a plan that falls short without them
    # (solve._search_further); True always; False never.
    partial_statistics: Optional[bool] = None
    # gathers of layer-invariant values (adaLN modulation) joined into one collective before
    # the first layer (autotp.planner.invariant, autotp.runtime.batching)
    batch_gathers: bool = True
    # the beam ranks states by their cost plus a lower bound on what they still owe
    # (FrontierSolver.ahead); the second search (solve._search_further) turns it on
    lookahead: bool = False
    # expert parallelism over this many data-parallel ranks (autotp.runtime.routed_rows): every
    # grouped product holds its experts whole, tp * ep ways
    expert_parallel: int = 1
    # context parallelism: the group shards the sequence of every value that has one
    # (attention by the ring, autotp.runtime.ring); parameters are held whole, their
    # gradients summed over the group
    context_parallel: bool = False
    # context parallelism inside tensor parallelism: attention node -> the query and key/value
    # heads one rank of the tp plan holds ((0, 0): the tp plan splits q and k/v unlike, so
    # only the ring keeps their heads paired); an attention not listed holds them all
    local_heads: tuple[tuple[str, int, int], ...] = ()


def output_layout(have: Any, output: PNode, name: str) -> Any:
    """The layout the graph output ``name`` is returned in, given the layout it is computed
    in, ``have``."""
    if name in output.returned_sharded and isinstance(have, Shard):
        return have
    return R


def returned_sharded(gm: Any, names: list[str], options: PlanOptions
                     ) -> dict[str, Optional[str]]:
    """The inputs ``names`` of ``gm``'s output that leave the program in their computed
    layout (``OutputGather``), each with the field of the mapping returned it is (None:
    returned as the shard, ``NEVER``)."""
    if options.gather_outputs is OutputGather.NEVER:
        return {name: None for name in names}
    if options.gather_outputs is OutputGather.ALWAYS:
        return {}
    return dict(loss_fields(gm)) if isinstance(gm, fx.GraphModule) else {}


def joins_ahead(src: PNode, reader: PNode, have: Any, want: Any, options: PlanOptions) -> bool:
    """A layer-invariant value made whole, joined with every other layer's into one
    collective ahead of the first layer (autotp.planner.invariant, autotp.runtime.batching): a
    shard gathered where it meets the stream (a reader that is not invariant itself), or a
    partial sum summed wherever it is read (a row-parallel timestep MLP's output, which the
    chain reads on: ``silu``, then the column-parallel modulation). A value whose chain holds
    such a sum is joined in a later collective than the sum."""
    if not (src.invariant and options.batch_gathers and isinstance(want, Replicate)):
        return False
    if isinstance(have, Shard):
        return not reader.invariant
    return isinstance(have, Partial) and have.reduce == "sum"


Entry = tuple[Any, frozenset]  # (layout or tuple of layouts, layouts materialized from it)


def _flops(node: fx.Node, cost_model: CostModel, dims: dict) -> float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    numel = 1.0
    for size in val.shape:
        numel *= cost_model.evaluate(size_expr(size), dims)
    if node.target in (aten.mm.default, aten.bmm.default, aten.linear.default,
                       aten.matmul.default) or is_grouped(node):
        k = arg_node(node, 0).meta["val"].shape[-1]
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
    builder = _Builder(captured, tp, blocks, registry, cost_model, options)
    gm = captured.gm
    pnodes: list[PNode] = []
    for node in gm.graph.nodes:
        pn = builder.node(node, pnodes)
        builder.grad[node.name] = pn.requires_grad
        if _is_constant(pn, builder.constants):
            builder.constants.add(node.name)
        builder.measure(pn)
        pnodes.append(pn)
    grad = builder.grad
    kept = saved_values(gm.graph, lambda n: grad.get(n.name, False))
    invariant = layer_invariant(gm.graph) if options.batch_gathers else frozenset()
    for pn in pnodes:
        pn.saved = pn.node.name in kept
        pn.invariant = pn.node.name in invariant
    if options.context_parallel:
        _shard_the_sequence(pnodes, builder.split)
    elif not options.sequence_parallel:
        _replicate_input_constants(pnodes, grad)
    return pnodes


class _Builder:
    """One problem's construction: a ``PNode`` per graph node, with the memos that let
    repeated layers share their strategies and sizes."""

    def __init__(self, captured: Captured, tp: int, blocks: tuple[int, ...],
                 registry: Registry, cost_model: CostModel, options: PlanOptions):
        self.tp, self.blocks, self.registry = tp, blocks, registry
        self.cost_model, self.options = cost_model, options
        self.params = dict(captured.gm.named_parameters(remove_duplicate=False))
        self.dims = captured.dim_names
        self.grad: dict[str, bool] = {}
        self.strategy_memo: dict[Any, list[Strategy]] = {}
        self.call_memo: dict[Any, Any] = {}  # _shared_key -> _call_key, sparing make_call
        self.size_memo: dict[Any, float] = {}
        self.split = sequence_symbols(self.dims) \
            if options.sequence_parallel or options.context_parallel else frozenset()
        if splits_batch(captured, tp, options):
            self.split |= batch_symbols(self.dims)
        self.routed_rows = _expert_rows(captured.gm)
        self.constants: set[str] = set()  # values that read no input, parameter or state

    def node(self, node: fx.Node, pnodes: list[PNode]) -> PNode:
        val = node.meta.get("val")
        pn = PNode(node=node, kind="skip")
        options = self.options
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor) and node.target in options.state_inputs:
                pn.kind = "leaf"
                pn.is_state = True
                pn.ndim = val.dim()
            elif isinstance(val, torch.Tensor):
                pn.kind = "input"
                pn.requires_grad = bool(val.requires_grad)
        elif node.op == "get_attr":
            if isinstance(val, torch.Tensor):
                pn.kind = "leaf"
                pn.is_param = node.target in self.params
                pn.requires_grad = pn.is_param and self.params[str(node.target)].requires_grad
                pn.ndim = val.dim()
        elif node.op == "output":
            pn.kind = "output"
            pn.inputs = [n.name for n in tensor_inputs(node)]
            pn.returned_sharded = returned_sharded(node.graph.owning_module, pn.inputs, options)
            for pred in pnodes:
                if pred.node.name in pn.inputs:
                    pred.is_output = True
        elif node.op == "call_function":
            ins = tensor_inputs(node)
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
                    isinstance(node.args[0].meta.get("val"), (tuple, list)):
                pn.kind = "getitem" if isinstance(val, torch.Tensor) else "skip"
                pn.inputs = [node.args[0].name]
            elif node.target in self.registry:
                self._ruled(pn, ins)
            elif _deterministic(node) and all(n.name in self.constants for n in ins):
                # a constant (a mask built by a Python loop, a factory with no rule): the
                # same values on every rank, whatever it computes, so replicated is exact
                pn.kind = "op"
                pn.constant = True
                pn.inputs = [n.name for n in ins]
                out = make_call(node, self.tp, self.blocks).output
                pn.strategies = [Strategy((R,) * len(ins), _map_out(out, R) if
                                          isinstance(out, tuple) else R, name="constant")]
            elif ins or isinstance(val, (torch.Tensor, tuple, list)):
                self._fallback(pn, ins)
            pn.requires_grad = any(self.grad.get(n, False) for n in pn.inputs) and \
                _floating(val)
        return pn

    def _ruled(self, pn: PNode, ins: list[fx.Node]) -> None:
        """An op with a rule: its strategies (memoized across repeated layers)."""
        node, options = pn.node, self.options
        pn.kind = "op"
        pn.inputs = [n.name for n in ins]
        pn.mutated = mutated_inputs(node)
        shared = _shared_key(node)
        memo_key = self.call_memo.get(shared) if shared is not None else None
        if memo_key is None:
            call = make_call(node, self.tp, self.blocks, self.split)
            rows = _routed_rows(node, self.routed_rows)
            call = replace(call, routed=rows, experts=self.routed_rows.get(rows),
                           ep=options.expert_parallel, context=options.context_parallel)
            memo_key = _call_key(call)
            if memo_key not in self.strategy_memo:  # repeated layers repeat their calls
                self.strategy_memo[memo_key] = self.registry.strategies(call)
            if shared is not None:
                self.call_memo[shared] = memo_key
        pn.strategies = self.strategy_memo[memo_key]
        if options.expert_parallel > 1 and is_grouped(node):
            pn.strategies = _experts_whole(node, pn.strategies, self.tp, options)
        forced = dict(options.force).get(node.name)
        if forced is not None:
            pn.strategies = [pn.strategies[forced]]
        elif not options.partial_statistics:
            kept = [s for s in pn.strategies if not s.premium]
            pn.premium_dropped = len(kept) < len(pn.strategies)
            pn.strategies = kept

    def _fallback(self, pn: PNode, ins: list[fx.Node]) -> None:
        """An op with no rule: replicated (refused under ``strict``, unless it is a custom
        op, which runs replicated and is named in the plan)."""
        node = pn.node
        if self.options.strict and not is_custom_op(node.target):
            raise NoRuleError(
                f"autotp has no layout rule for {node.target}{where(node)}\n  pass "
                "strict=False to compute it replicated (recorded in the plan), or "
                f"teach autotp how it shards: autotp.register_rule("
                f"{_op_name(node.target)!r}, [...]) (docs/custom-ops.md)"
            )
        pn.kind = "op"
        pn.fallback = True
        pn.inputs = [n.name for n in ins]
        call = make_call(node, self.tp, self.blocks)
        out = (tuple(None if o is None else R for o in call.output)
               if isinstance(call.output, tuple) else
               (R if call.output is not None else None))
        pn.strategies = [Strategy((R,) * len(ins), out, name="fallback"),
                         Strategy((R_STAR,) * len(ins), _map_out(out, R_STAR),
                                  name="fallback")]

    def measure(self, pn: PNode) -> None:
        """The node's bytes, flops, sequence dims and expert groups (memoized)."""
        node, val, memo = pn.node, pn.node.meta.get("val"), self.size_memo
        if ("bytes", id(val)) not in memo:
            memo[("bytes", id(val))] = _nbytes(val, self.cost_model, self.dims)
        pn.nbytes = memo[("bytes", id(val))]
        if self.split and isinstance(val, torch.Tensor):
            pn.seq_dims = frozenset(d for d, size in enumerate(val.shape)
                                    if size_expr(size) in self.split)
        if pn.kind == "op" and is_grouped(node) and len(node.args) > 1 and \
                isinstance(node.args[1], fx.Node):
            weight = node.args[1].meta.get("val")
            if isinstance(weight, torch.Tensor) and weight.ndim == 3:
                pn.groups = int(weight.shape[0])
        if pn.kind == "op":
            shared = _shared_key(node)
            if shared is None:
                pn.flops = _flops(node, self.cost_model, self.dims)
            else:
                if ("flops", shared) not in memo:
                    memo[("flops", shared)] = _flops(node, self.cost_model, self.dims)
                pn.flops = memo[("flops", shared)]


def _shard_the_sequence(pnodes: list[PNode], split: frozenset) -> None:
    """Context parallelism: what the parameters reach (the activations) keeps the sequence
    sharded wherever an op can; values of the inputs alone (positions, masks, shifted labels)
    may also be computed whole on every rank, and are sliced where an activation reads them."""
    from_params: set[str] = set()
    for pn in pnodes:
        if pn.is_param or any(n in from_params for n in pn.inputs):
            from_params.add(pn.node.name)
        if pn.kind == "op" and pn.node.name in from_params:
            pn.strategies = _sequence_sharded(pn.strategies, pn.node.meta.get("val"), split)


def splits_batch(captured: Captured, tp: int, options: PlanOptions) -> bool:
    """Whether sequence parallelism's regions may split the batch (``batch_tokens``): the
    example's batch divides by tp, and no context parallelism splits the sequence."""
    batch = captured.example_batch
    return options.sequence_parallel and options.batch_tokens and \
        not options.context_parallel and tp > 1 and not captured.fixed_sizes and \
        batch is not None and batch % tp == 0 and bool(batch_symbols(captured.dim_names))


def sequence_dims(val: Any, split: frozenset) -> frozenset:
    """The dims of ``val`` whose size holds a sequence symbol (the sequence, or a dim it is
    merged into: [B * T] rows)."""
    if not isinstance(val, torch.Tensor) or not split:
        return frozenset()
    return frozenset(d for d, size in enumerate(val.shape)
                     if isinstance(size_expr(size), sympy.Expr)
                     and size_expr(size).free_symbols & split)


def _sequence_sharded(strategies: list[Strategy], val: Any, split: frozenset
                      ) -> list[Strategy]:
    """Context parallelism: the strategies that keep every output holding the sequence
    sharded along it. An op with none (one that mixes the sequence: a cumulative sum over
    it) keeps them all, and the plan gathers what it reads. An output whose sequence is only
    merged with the batch ([B * T] rows) is not bound to keep it sharded: the cost decides
    (its rows sharded by sequence where they are made so, else whole)."""
    vals = val if isinstance(val, (tuple, list)) else (val,)

    def sharded(strategy: Strategy) -> bool:
        outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
        for out, v in zip(outs, vals):
            dims = sequence_dims(v, split)
            plain = any(size_expr(v.shape[d]) in split for d in dims)
            if plain and not (isinstance(out, Shard) and out.dim in dims):
                return False
        return True

    kept = [s for s in strategies if sharded(s)]
    return kept or strategies


def _replicate_input_constants(pnodes: list[PNode], grad: dict[str, bool]) -> None:
    """Without sequence parallelism, values computed from the inputs and buffers alone (no
    parameter, no state such as a KV cache), without gradient (rotary cos/sin from the
    positions, masks from the attention mask), are computed replicated, as when they sit
    in a no-grad region: a reader that shards meets them with a free slice, so sharding
    them saves nothing, while the search could shard them along the sequence and land on a
    plan that gathers more (rotary tables sharded along the sequence, then gathered or
    all-reduced in every layer). With sequence parallelism a sequence shard of cos/sin is
    what a sequence-sharded region reads, and they stay free."""
    from_params: set[str] = set()
    for pn in pnodes:
        name = pn.node.name
        if pn.is_param or pn.is_state or any(n in from_params for n in pn.inputs):
            from_params.add(name)
            continue
        if pn.kind != "op" or grad.get(name, False) or pn.fallback:
            continue
        replicated = [s for s in pn.strategies
                      if all(isinstance(x, Replicate) for x in s.inputs)
                      and all(isinstance(x, Replicate) for x in output_layouts(s.output))]
        if replicated:
            pn.strategies = replicated


def _is_constant(pn: PNode, constants: set[str]) -> bool:
    """A buffer, or a deterministic op (or an element of its result) that reads and writes
    only constants: the same values on every rank."""
    if pn.node.op == "get_attr":
        return not pn.is_param
    if pn.kind == "getitem":
        return pn.inputs[0] in constants
    return pn.kind == "op" and _deterministic(pn.node) and not pn.mutated - constants and \
        all(n in constants for n in pn.inputs)


def _deterministic(node: fx.Node) -> bool:
    """An ATen op that draws no random numbers (randomness is planned by its own rules)."""
    tags = getattr(node.target, "tags", None)
    return tags is not None and torch.Tag.nondeterministic_seeded not in tags


def mutated_inputs(node: fx.Node) -> frozenset:
    """Names of the tensor inputs an in-place op writes (from its schema's alias info)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return frozenset()
    written = set()
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, fx.Node):
            written.add(value.name)
    return frozenset(written)


def is_custom_op(op: Any) -> bool:
    """An op of a library other than torch's own (``torch.library``, a C++ extension): with
    no rule it runs replicated, named in the plan, whatever ``strict`` says; its author can
    register a rule (``autotp.register_rule``)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.name.split("::")[0] not in ("aten", "prims")


def _op_name(op: Any) -> str:
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else str(op)


def _shared_key(node: fx.Node) -> Any:
    """Equal for two nodes whose call the rules see alike without building it: the same op
    on the same metadata objects (a layer stamped from a traced one shares its template's,
    ``autotp.capture.repeat``) and equal other arguments; None when an argument is unhashable."""
    def key(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            val = arg.meta.get("val")
            return ("val", id(val)) if isinstance(val, torch.Tensor) else ("node", arg.name)
        if isinstance(arg, (tuple, list)):
            return (type(arg), tuple(key(a) for a in arg))
        if isinstance(arg, dict):
            return (dict, tuple((k, key(v)) for k, v in arg.items()))
        return (type(arg), repr(arg))

    val = node.meta.get("val")
    values = tuple(id(v) for v in val) if isinstance(val, (tuple, list)) else id(val)
    try:
        return (node.target, key(node.args), key(node.kwargs), values)
    except TypeError:
        return None


def _expert_rows(gm: fx.GraphModule) -> dict[Any, Optional[int]]:
    """The row counts of the grouped products' inputs (rows sorted by expert) -> the count of
    experts they are sorted by (None where two groupings of as many rows disagree)."""
    rows: dict[Any, Optional[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_grouped(node) and \
                all(isinstance(a, fx.Node) for a in node.args[:2]):
            val, weight = node.args[0].meta.get("val"), node.args[1].meta.get("val")
            if isinstance(val, torch.Tensor) and val.ndim == 2 and \
                    isinstance(weight, torch.Tensor) and weight.ndim == 3:
                count, experts = size_expr(val.shape[0]), size_expr(weight.shape[0])
                rows[count] = experts if rows.get(count, experts) == experts else None
    return rows


def is_grouped(node: fx.Node) -> bool:
    """A grouped product of rows sorted by expert (a mixture of experts' stacked weights)."""
    schema = getattr(node.target, "_schema", None)
    name = schema.name if schema is not None else None
    return node.target in GROUPED_MM or name in GROUPED_MM


def _routed_rows(node: fx.Node, rows: dict) -> Any:
    """The routed row count this op reads or writes along dim 0, if any."""
    vals = [n.meta.get("val") for n in tensor_inputs(node)]
    out = node.meta.get("val")
    vals += list(out) if isinstance(out, (tuple, list)) else [out]
    for val in vals:
        if isinstance(val, torch.Tensor) and val.ndim and size_expr(val.shape[0]) in rows:
            return size_expr(val.shape[0])
    return None


def _experts_whole(node: fx.Node, strategies: list[Strategy], tp: int,
                   options: PlanOptions) -> list[Strategy]:
    """With expert parallelism a grouped product holds its experts whole: the only layout
    in which the rows routed to an expert can move to the rank that owns it."""
    kept = [s for s in strategies if s.name == "experts"]
    if not kept:
        ep = options.expert_parallel
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        experts = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None
        fits = "" if experts is None else f" it has {experts} experts; at tp={tp}, ep in " \
            f"{[d for d in range(1, experts + 1) if experts % (d * tp) == 0]} divide them"
        raise PlanError(f"ep={ep} needs the experts of {node.name} whole on each of tp * ep = "
                        f"{tp * ep} ranks, rows sorted by expert ({origin_of(node)}):{fits}")
    return kept


def _call_key(call: Any) -> Any:
    try:
        return (call.op, repr(call.args), repr(sorted(call.kwargs.items())), call.inputs,
                call.output, repr(call.routed), call.ep)
    except TypeError:  # unhashable argument: no memo
        return object()


def _map_out(out: Any, layout: Layout) -> Any:
    if isinstance(out, tuple):
        return tuple(None if o is None else layout for o in out)
    return None if out is None else layout


def _floating(val: Any) -> bool:
    """Whether ``val`` can carry a gradient: floating point or complex (a complex tensor is
    a float tensor with a trailing dim of 2: rotary embeddings differentiate through it)."""
    if isinstance(val, torch.Tensor):
        return val.dtype.is_floating_point or val.dtype.is_complex
    if isinstance(val, (tuple, list)):
        return any(_floating(v) for v in val)
    return False


def leaf_candidates(pnodes: list[PNode], by_name: dict[str, PNode]) -> dict[str, list[Layout]]:
    wanted: dict[str, set[Layout]] = {}
    for pn in pnodes:
        for strategy in pn.strategies:
            for name, layout in zip(pn.inputs, strategy.inputs):
                leaf = by_name[name]
                # parameters and state are stored sharded; buffers stay whole on every rank
                if leaf.kind == "leaf" and (leaf.is_param or leaf.is_state) and \
                        isinstance(layout, Shard):
                    wanted.setdefault(name, set()).add(layout)
    out: dict[str, list[Layout]] = {}
    for pn in pnodes:
        if pn.kind == "leaf":
            out[pn.node.name] = [R] + sorted(wanted.get(pn.node.name, ()))
    return out


def drop_grad_partial(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(R if isinstance(o, Replicate) else o for o in out)
    return R if isinstance(out, Replicate) else out


