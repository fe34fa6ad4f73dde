"""The planning problem: one PNode per graph node, with its candidate strategies.

Values are named by their node. Each op node carries the strategies its rule offers (with
gradient semantics applied by the registry); parameters (leaves) carry the layouts they may be
stored in. Nothing here chooses: ``solve`` does.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from autotp.capture.trace import (Captured, make_call, origin_of, sequence_symbols, size_expr,
                                  tensor_inputs)
from autotp.ops import MATMULS, RESHAPES, arg_node, node_arg
from autotp.errors import NoRuleError, PlanError, where
from autotp.layout import (
    R,
    R_STAR,
    Blocks,
    Layout,
    Partial,
    Period,
    Replicate,
    Shard,
    proportions,
    smaller_whole,
)
from autotp.planner.cost import CostModel
from autotp.planner.invariant import layer_invariant
from autotp.planner.saved import saved_values
from autotp.rules.matmul import GROUPED_MM
from autotp.rules.registry import Registry, Strategy, output_layouts
from autotp.rules.view_algebra import view_groups, view_segmentations

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
    saved: bool = False  # a reader keeps it for backward (planner/saved.py): activation memory
    constant: bool = False  # computed from no input, parameter or state: replicated, exact
    groups: int = 0  # the experts of a grouped product (one GEMM each)
    # computed from the inputs and its layer's own parameters alone (planner/invariant.py):
    # a gather or sum of it joins every layer's in one collective before the first layer
    invariant: bool = False

    def sequence_step(self, have: Any, want: Any, options: "PlanOptions") -> bool:
        """Whether have -> want moves a shard of the sequence (sequence parallelism's
        reduce-scatter and all-gather), as opposed to a shard of any other dim."""
        if not options.sequence_parallel:
            return False
        shard = have if isinstance(have, Shard) else want
        return isinstance(shard, Shard) and shard.dim in self.seq_dims


@dataclass(frozen=True)
class PlanOptions:
    strict: bool = True
    sequence_parallel: bool = False
    # False: outputs the plan holds sharded are returned as each rank's shard (e.g. logits
    # sharded over the vocabulary), not gathered
    gather_outputs: bool = True
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
    # the first layer (planner/invariant.py, autotp.runtime.batching)
    batch_gathers: bool = True
    # the beam ranks states by their cost plus a lower bound on what they still owe
    # (FrontierSolver.ahead); the second search (solve._search_further) turns it on
    lookahead: bool = False
    # expert parallelism over this many data-parallel ranks (autotp.runtime.routed_rows): every
    # grouped product holds its experts whole, tp * ep ways
    expert_parallel: int = 1
    # context parallelism: the group shards the sequence of every value that has one
    # (attention by the ring, autotp.runtime.context); parameters are held whole, their
    # gradients summed over the group
    context_parallel: bool = False
    # context parallelism inside tensor parallelism: attention node -> the query and key/value
    # heads one rank of the tp plan holds ((0, 0): the tp plan splits q and k/v unlike, so
    # only the ring keeps their heads paired); an attention not listed holds them all
    local_heads: tuple[tuple[str, int, int], ...] = ()


def output_layout(have: Any, options: PlanOptions) -> Any:
    """The layout a graph output is returned in, given the layout it is computed in."""
    if not options.gather_outputs and isinstance(have, Shard):
        return have
    return R


def joins_ahead(src: PNode, reader: PNode, have: Any, want: Any, options: PlanOptions) -> bool:
    """A layer-invariant value made whole, joined with every other layer's into one
    collective ahead of the first layer (planner/invariant.py, autotp.runtime.batching): a
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


# a product, or a product with its bias added: the values a slice of one dim may tile
_PRODUCTS = MATMULS | {aten.add.Tensor}


def _sliced_segments(node: fx.Node) -> list[int]:
    """The sizes of slices of ``node`` along one dim that tile it (``qkv[..., :q]``,
    ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``), or [] when its slices do not."""
    val = node.meta.get("val")
    viewed = node.target in RESHAPES and isinstance(node.args[0], fx.Node) and \
        node.args[0].target in _PRODUCTS  # Falcon's qkv.view(B, T, heads + 2, head_dim)
    if not isinstance(val, torch.Tensor) or not (node.target in _PRODUCTS or viewed):
        return []  # only a product's output is a fused projection (not a KV cache's reads)
    by_dim: dict[int, set] = {}
    for user in node.users:
        if user.target != aten.slice.Tensor or user.args[0] is not node:
            continue
        dim = node_arg(user, "dim", 0) % val.ndim
        size = val.shape[dim]
        start, end = node_arg(user, "start") or 0, node_arg(user, "end")
        if node_arg(user, "step", 1) != 1 or not isinstance(size, int):
            continue
        end = size if end is None or (isinstance(end, int) and end >= size) else end
        if isinstance(start, int) and isinstance(end, int):
            by_dim.setdefault(dim, set()).add((start % size if start < 0 else start,
                                               end % size if end < 0 else end))
    for dim, ranges in by_dim.items():
        ordered = sorted(ranges)
        if len(ordered) > 1 and ordered[0][0] == 0 and ordered[-1][1] == val.shape[dim] and \
                all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            return [end - start for start, end in ordered]
    return []


def block_counts(gm: fx.GraphModule, sequences: frozenset = frozenset()
                 ) -> tuple[Blocks, ...]:
    """Segmentations worth considering for blocked shards: those of the graph's splits (a
    fused q|k|v or gate|up projection split into its parts): their count when the parts
    are equal, their proportions when not (q|k|v with fewer k/v heads), and those with the
    smaller parts held whole (multi-query attention's single k/v head), and the proportions
    of concatenated pieces; and the ``sequences`` (context parallelism's size symbols) a
    reshape merges after the batch."""
    counts: set = {1}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
                aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            val = node.meta.get("val")
            if not isinstance(val, (list, tuple)) or len(val) < 2:
                continue
            dim = node_arg(node, "dim", 0)
            sizes = [v.shape[dim] for v in val if isinstance(v, torch.Tensor)]
            if len(sizes) == len(val) and all(isinstance(size, int) for size in sizes):
                counts.add(proportions(sizes))
                counts.add(smaller_whole(proportions(sizes)))
            else:
                counts.add(len(val))
        tiling = _sliced_segments(node)
        if tiling:
            counts.add(proportions(tiling))
            counts.add(smaller_whole(proportions(tiling)))
        if node.op == "call_function" and node.target == aten.cat.default:
            pieces = [a.meta.get("val") for a in node.args[0] if isinstance(a, fx.Node)]
            dim = node_arg(node, "dim", 0)
            sizes = [p.shape[dim] for p in pieces if isinstance(p, torch.Tensor)]
            if all(isinstance(size, int) and size > 0 for size in sizes) and \
                    len(set(sizes)) > 1:
                counts.add(proportions(sizes))  # Flux's cat([attention, mlp], -1): (1, 4)
        if node.op == "call_function" and node.target == aten.unbind.int:
            counts.add(len(node.meta.get("val") or ()))  # timm's qkv...unbind(0): 3 parts
        if node.op == "call_function" and node.target == aten.glu.default:
            counts.add(2)  # F.glu takes its input's halves: a gate|value projection's blocks
        counts.add(_selected_parts(node))
        if node.op == "call_function" and node.target in RESHAPES:
            counts.update(_merged_periods(node, sequences))
            counts.update(_view_segmentations(node, counts))
    counts.discard(None)
    counts.discard(0)
    return tuple(sorted(counts, key=lambda b: (
        isinstance(b, Period), isinstance(b, tuple),
        (isinstance(b.length, str), b.length) if isinstance(b, Period) else b)))


def _selected_parts(node: fx.Node) -> Optional[int]:
    """k when ``node`` is taken apart along a static dim of size k by a ``select`` of each
    index, as ``unbind`` does (torch's attention: ``proj[0], proj[1], proj[2]`` of a fused
    projection unflattened into (3, h)); None otherwise."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    taken: dict[int, set] = {}
    for user in node.users:
        if user.target == aten.select.int and user.args[0] is node:
            dim = node_arg(user, "dim", 0) % val.ndim
            index = node_arg(user, "index")
            size = val.shape[dim]
            if isinstance(size, int) and isinstance(index, int):
                taken.setdefault(dim, set()).add(index % size)
    for dim, indices in taken.items():
        if val.shape[dim] >= 2 and indices == set(range(val.shape[dim])):
            return val.shape[dim]
    return None


def _merged_periods(node: fx.Node, sequences: frozenset = frozenset()) -> set[Period]:
    """The periods of static dims a reshape merges after a symbolic one, or splits back out
    of it (Bloom's [B, H, T, D] <-> [B*H, T, D]): heads sharded inside the batch; and of one
    of the ``sequences`` merged after the batch ([B, T, V] -> [B*T, V])."""
    src, dst = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(dst, torch.Tensor) or \
            not isinstance(src.meta.get("val"), torch.Tensor):
        return set()
    shapes = ([size_expr(s) for s in src.meta["val"].shape],
              [size_expr(s) for s in dst.shape])
    try:
        groups = view_groups(*shapes)
    except ValueError:
        return set()
    periods = set()
    for dims in groups:
        for many, one in ((0, 1), (1, 0)):
            majors = [d for d in dims[many] if shapes[many][d] != 1]
            single = [d for d in dims[one] if shapes[one][d] != 1]
            if len(single) != 1 or len(majors) < 2 or isinstance(shapes[one][single[0]], int):
                continue
            for k in range(1, len(majors)):
                inner = [shapes[many][d] for d in majors[k:]]
                if all(isinstance(size, int) for size in inner) and math.prod(inner) > 1:
                    periods.add(Period(int(math.prod(inner))))
            last = shapes[many][majors[-1]]
            if last in sequences:  # batch x sequence rows, split by context parallelism
                periods.add(Period(str(last)))
    return periods


def _view_segmentations(node: fx.Node, counts: set) -> set:
    """The periods a shard takes across a reshape, by the view algebra, from a plain shard
    or a period found so far (fairseq's [T, B, h] -> [T, B*heads, d]: segments of heads)."""
    src, dst = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(dst, torch.Tensor) or \
            not isinstance(src.meta.get("val"), torch.Tensor):
        return set()
    known = {1} | {b for b in counts if isinstance(b, Period) and not b.symbolic}
    return view_segmentations([size_expr(s) for s in src.meta["val"].shape],
                              [size_expr(s) for s in dst.shape], known)


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
    gm = captured.gm
    params = dict(gm.named_parameters(remove_duplicate=False))
    dims = captured.dim_names
    pnodes: list[PNode] = []
    grad: dict[str, bool] = {}
    strategy_memo: dict[Any, list[Strategy]] = {}
    call_memo: dict[Any, Any] = {}  # _shared_key -> _call_key, sparing make_call
    size_memo: dict[Any, float] = {}
    split = sequence_symbols(dims) if options.sequence_parallel or options.context_parallel \
        else frozenset()
    routed_rows = _expert_rows(gm)
    constants: set[str] = set()  # values that read no input, parameter or state
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        pn = PNode(node=node, kind="skip")
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
                pn.mutated = mutated_inputs(node)
                shared = _shared_key(node)
                memo_key = call_memo.get(shared) if shared is not None else None
                if memo_key is None:
                    call = make_call(node, tp, blocks, split)
                    rows = _routed_rows(node, routed_rows)
                    call = replace(call, routed=rows, experts=routed_rows.get(rows),
                                   ep=options.expert_parallel,
                                   context=options.context_parallel)
                    memo_key = _call_key(call)
                    if memo_key not in strategy_memo:  # repeated layers repeat their calls
                        strategy_memo[memo_key] = registry.strategies(call)
                    if shared is not None:
                        call_memo[shared] = memo_key
                pn.strategies = strategy_memo[memo_key]
                if options.expert_parallel > 1 and is_grouped(node):
                    pn.strategies = _experts_whole(node, pn.strategies, tp, options)
                forced = dict(options.force).get(node.name)
                if forced is not None:
                    pn.strategies = [pn.strategies[forced]]
                elif not options.partial_statistics:
                    kept = [s for s in pn.strategies if not s.premium]
                    pn.premium_dropped = len(kept) < len(pn.strategies)
                    pn.strategies = kept

            elif _deterministic(node) and all(n.name in constants for n in ins):
                # a constant (a mask built by a Python loop, a factory with no rule): the
                # same values on every rank, whatever it computes, so replicated is exact
                pn.kind = "op"
                pn.constant = True
                pn.inputs = [n.name for n in ins]
                out = make_call(node, tp, blocks).output
                pn.strategies = [Strategy((R,) * len(ins), _map_out(out, R) if
                                          isinstance(out, tuple) else R, name="constant")]
            elif ins or isinstance(val, (torch.Tensor, tuple, list)):
                if options.strict and not is_custom_op(node.target):
                    raise NoRuleError(
                        f"autotp has no layout rule for {node.target}{where(node)}\n  pass "
                        "strict=False to compute it replicated (recorded in the plan), or "
                        f"teach autotp how it shards: autotp.register_rule("
                        f"{_op_name(node.target)!r}, [...]) (docs/custom-ops.md)"
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
        if _is_constant(pn, constants):
            constants.add(node.name)
        if ("bytes", id(val)) not in size_memo:
            size_memo[("bytes", id(val))] = _nbytes(val, cost_model, dims)
        pn.nbytes = size_memo[("bytes", id(val))]
        if split and isinstance(val, torch.Tensor):
            pn.seq_dims = frozenset(d for d, size in enumerate(val.shape)
                                    if size_expr(size) in split)
        if pn.kind == "op" and is_grouped(node) and len(node.args) > 1 and \
                isinstance(node.args[1], fx.Node):
            weight = node.args[1].meta.get("val")
            if isinstance(weight, torch.Tensor) and weight.ndim == 3:
                pn.groups = int(weight.shape[0])
        if pn.kind == "op":
            shared = _shared_key(node)
            if shared is None:
                pn.flops = _flops(node, cost_model, dims)
            else:
                if ("flops", shared) not in size_memo:
                    size_memo[("flops", shared)] = _flops(node, cost_model, dims)
                pn.flops = size_memo[("flops", shared)]
        pnodes.append(pn)
    kept = saved_values(gm.graph, lambda n: grad.get(n.name, False))
    invariant = layer_invariant(gm.graph) if options.batch_gathers else frozenset()
    for pn in pnodes:
        pn.saved = pn.node.name in kept
        pn.invariant = pn.node.name in invariant
    if options.context_parallel:
        _shard_the_sequence(pnodes, split)
    elif not options.sequence_parallel:
        _replicate_input_constants(pnodes, grad)
    return pnodes


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
    ``capture.repeat``) and equal other arguments; None when an argument is unhashable."""
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


