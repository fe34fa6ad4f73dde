"""The rewriter: a Plan and a rank -> that rank's GraphModule, as a sequence of small passes,
in the order ``rewrite`` runs them (tests/test_rewrite_passes.py holds the list to the code):

    drop_input_guards       export's checks of global sizes, where a state arrives as a shard
    shard_parameters        the local piece of every parameter (a fresh nn.Parameter)
    place_on_device         device arguments traced on meta name this rank's device
    route_rows              expert routing: each grouping's route and the moves of its rows
    insert_collectives      one Redistribute per (value, target layout), for each layout axis
    join_siblings           a layer's all-reduces that neither waits for, run as one
    join_ahead              layer-invariant values made whole in one collective, ahead of layers
    keep_sequence_shards    sequence all-gathers whose saved outputs backward re-gathers
    lower_ops               per-op lowerings (local sizes, masked vocab lookups), for each axis
    ring_attention_calls    context parallelism: attention over the sequence shards (ring/Ulysses)
    track_randomness        dropout: one stream for replicated values, one per rank for shards
    causal_attention_calls  a traced causal mask run by the kernel's causal path
    drop_full_slices        a slice of a whole dim read as its input
    fuse_logsumexp_gather   a logsumexp fused with the gather of its operand
    views_to_reshapes       views after a collective as reshapes (its output is contiguous)
    fuse_bias_adds          bias adds fused back into their product where no collective parts them
    drop_unread             pure values nothing reads (a traced mask's recipe the kernel replaced)
    reduce_in_place         all-reduces that may sum their own operand
    gather_rows             an MLP's sequence gather and scatter along dim 0, rows rank-major
    scope_saves             ops reading a sequence all-gather save its shard, not its output
    note_splits             how many ways each value's dims are split on this rank

Each pass keeps the graph valid (``graph.lint()``); the rewriter never decides a layout.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Optional, Sequence, cast

import torch
import torch.fx as fx
from torch import nn

from autotp.capture.trace import Captured, batch_symbols, sequence_symbols, size_expr
from autotp.ops import arg_node, node_arg, repeated_heads
from autotp.runtime.fusion import drop_full_slices, fuse_bias_adds, fuse_logsumexp_gather
from autotp.runtime.collectives import (
    DeferredGradReduce,
    GradBucket,
    GradSync,
    PartialSegmentsReduce,
    Redistribute,
    gather_rows,
    reduce_in_place,
)
from autotp.runtime.batching import join_ahead, join_siblings
from autotp.runtime.causal import causal_attention_calls
from autotp.runtime.comm import Communicator
from autotp.runtime.ring import MaskProgram, RingAttention, SequenceLayout, UlyssesAttention
from autotp.errors import PlanError
from autotp.layout import Layout, Partial, Replicate, Shard, is_mixed, parse_layout, \
    whole_slices
from autotp.weights.materialize import ModelWeights, Weights
from autotp.planner.context import grouped_source
from autotp.planner.masks import MaskRegion, mask_region
from autotp.planner.plan import AxisPlan, Plan
from autotp.runtime.lowerings import LowerContext, lowering_for
from autotp.runtime.random import RngTracker, Stream, TrackedAttention, TrackedDropout
from autotp.runtime.regather import ShardKeeper, scope_saves
from autotp.runtime.routed_rows import route_rows, routed_text
from autotp.rules.registry import Registry, Strategy, parse_output
from autotp.ops import path_attr


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    return graph


def _set(root: nn.Module, target: str, value: Any) -> None:
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, nn.Module):
        module.add_module(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)


def shard_parameters(captured: Captured, plan: Plan, graph: fx.Graph, rank: int,
                     weights: Weights, ep_rank: int = 0) -> nn.Module:
    """A fresh root module holding this rank's piece of every attribute the graph reads,
    as ``weights`` provides it (slices of real tensors, of checkpoint files, or of inits).
    With expert parallelism the experts are split tp * ep ways, this rank's share being
    number ``ep_rank * tp + rank``."""
    root = nn.Module()
    source = captured.gm
    for node in graph.nodes:
        if node.op == "get_attr":
            value = path_attr(source, node.target)
            if isinstance(value, nn.Parameter):
                layout = plan.param_layout(node.target)
                names = captured.aliases.get(node.target, [node.target])
                share, shares = (ep_rank * plan.degree + rank, plan.degree * plan.ep) \
                    if node.target in plan.expert_params else (rank, plan.degree)
                local = weights.parameter(node.target, names, layout, share, shares, value)
                expected = plan.params[node.target].local_shape
                if tuple(local.shape) != tuple(expected):
                    raise PlanError(f"{node.target}: local piece {list(local.shape)}, the plan "
                                    f"says {list(expected)}")
                value = nn.Parameter(local, requires_grad=value.requires_grad)
            elif isinstance(value, torch.Tensor):
                value = weights.buffer(node.target, value)
            elif isinstance(value, fx.GraphModule):  # a subgraph of a higher-order op
                value = copy.deepcopy(value)
            _set(root, node.target, value)
        elif node.op == "call_module":
            _set(root, node.target, path_attr(source, node.target))
    return root


def place_on_device(graph: fx.Graph, root: nn.Module, device: Optional[torch.device]) -> None:
    """Device arguments recorded while tracing on the meta device (``arange(...,
    device=meta)``, ``to(meta)``) name this rank's device instead, in the graph and in the
    subgraphs of higher-order ops."""
    if device is None:
        return

    def relocate(arg: Any) -> Any:
        if isinstance(arg, torch.device) and arg.type == "meta":
            return device
        return arg

    def visit(g: fx.Graph) -> None:
        for node in g.nodes:
            if node.op == "call_function":
                node.args = fx.node.map_aggregate(node.args, relocate)
                node.kwargs = fx.node.map_aggregate(node.kwargs, relocate)

    visit(graph)
    for module in root.modules():
        if isinstance(module, fx.GraphModule):
            visit(module.graph)
            module.recompile()


def insert_collectives(graph: fx.Graph, plan: Plan, comm: Communicator, root: nn.Module,
                       bucket: GradBucket, grad_sync: GradSync = GradSync.BUCKET, *,
                       axis: str = "", originals: Optional[set[str]] = None,
                       sequence: Optional[SequenceLayout] = None) -> int:
    """Redistribute each value once per target layout; returns the modules inserted.
    ``sequence``: how ``comm``'s ranks hold the sequence (context parallelism), which
    every slice and gather of a sequence shard follows.

    ``originals`` (the captured program's node names): a second axis's plan applied to a
    program another plan's collectives are already in (context parallelism inside tp,
    ``axis`` "cp"): each consumer's reading of a value is what it reads now, the value or
    the other axis's redistribution of it, and joined collectives run one by one."""
    if plan.degree == 1:  # one rank holds every layout whole: nothing to change or sum
        return 0
    nodes = {n.name: n for n in graph.nodes}
    made: dict[tuple[str, str], fx.Node] = {}
    moved: list[fx.Node] = []
    count = 0
    for edge in plan.edges:
        if (edge.batched or edge.joined is not None) and originals is None:
            continue  # one collective with others (batching)
        if edge.src != edge.dst and (routed_text(edge.src) or routed_text(edge.dst)):
            continue  # rows routed to experts: moved by route_rows
        value, consumer = nodes[edge.value], nodes[edge.consumer]
        src, dst = parse_layout(edge.src), parse_layout(edge.dst)
        if _reads_unchanged_size(consumer, src, dst):
            continue
        inner: Optional[fx.Node] = None
        if originals is not None:
            value = _reading(consumer, value, originals)
            if _slices_alike(root, value, src, dst):
                # tp splits this sequence too: cp's slice first, tp's split of each cp
                # shard after it
                inner, value = value, cast(fx.Node, value.args[0])
        key = (value.name, edge.dst)
        if key not in made:
            name = f"autotp_{axis}{edge.value}_to_{_slug(edge.dst)}"
            while hasattr(root, name):  # the same value read through two of tp's layouts
                name += "_"
            if value.op == "get_attr" and isinstance(src, Replicate) and \
                    isinstance(dst, Replicate) and dst.grad_partial and \
                    grad_sync is GradSync.BUCKET:
                param = path_attr(root, value.target)
                bucket.params[value.target] = param
                module: nn.Module = DeferredGradReduce(bucket, value.target)
            else:
                # the plan's layer for the edge's collectives: a reduction's is its partial
                # sum's maker's, and its conjugate is counted there too
                module = Redistribute(comm, src, dst, layer=edge.layer, bwd_layer=edge.layer,
                                      label=f"{axis}{' ' if axis else ''}{edge.value} "
                                            f"{edge.src}->{edge.dst}", sequence=sequence)
            root.add_module(name, module)
            anchor = value if value.op != "placeholder" else _last_placeholder(graph)
            with graph.inserting_after(anchor):
                new = graph.call_module(name, (value,))
            new.meta["val"] = value.meta.get("val")
            made[key] = new
            count += 1
        if inner is None:
            consumer.replace_input_with(value, made[key])
            continue
        outer_key = (inner.name, f"{edge.dst} inside")
        if outer_key not in made:
            with graph.inserting_after(made[key]):
                made[outer_key] = graph.call_module(str(inner.target), (made[key],))
            made[outer_key].meta["val"] = inner.meta.get("val")
        consumer.replace_input_with(inner, made[outer_key])
        moved.append(inner)
    for node in dict.fromkeys(moved):  # another plan's split, now after this one's slice
        if not node.users:
            graph.erase_node(node)
    return count + _sum_whole_segments(graph, plan, comm, root, bucket, grad_sync)


def _slices_alike(root: nn.Module, node: fx.Node, src: Layout, dst: Layout) -> bool:
    """``node`` is another plan's redistribution to S(d) (a slice R -> S(d), a
    reduce-scatter P -> S(d)) of the dim that ``src`` -> ``dst`` slices."""
    if node.op != "call_module" or not (isinstance(src, Replicate) and isinstance(dst, Shard)):
        return False
    module = path_attr(root, str(node.target))
    return isinstance(module, Redistribute) and isinstance(module.dst, Shard) and \
        module.dst.dim == dst.dim


def _reading(consumer: fx.Node, value: fx.Node, originals: set[str]) -> fx.Node:
    """The input of ``consumer`` that carries ``value``: the value itself, or the last of
    the collectives an earlier pass put between them (a redistribution reads its value as
    its first argument; the i-th output of a joined one is its i-th argument's)."""
    def source(node: fx.Node) -> Optional[fx.Node]:
        while node.name not in originals:
            if node.op == "call_function" and node.target is operator.getitem and \
                    isinstance(node.args[0], fx.Node) and node.args[0].op == "call_module" \
                    and isinstance(node.args[1], int):
                arg = node.args[0].args[node.args[1]]
            elif node.op == "call_module" and node.args:
                arg = node.args[0]
            else:
                return None
            if not isinstance(arg, fx.Node):
                return None
            node = arg
        return node

    for node in consumer.all_input_nodes:
        if source(node) is value:
            return node
    raise PlanError(f"{consumer.name} does not read {value.name} (the two plans' programs "
                    "differ)")


def _sum_whole_segments(graph: fx.Graph, plan: Plan, comm: Communicator, root: nn.Module,
                        bucket: GradBucket, grad_sync: GradSync) -> int:
    """A parameter blocked with segments every rank holds whole (multi-query attention's
    k/v rows of a fused q|k|v, S(0)x8:1*:1*): those segments' gradients are partial, summed
    like a replicated parameter's (in the bucket, or at each use)."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in plan.params:
            continue
        layout = plan.param_layout(node.target)
        if not (isinstance(layout, Shard) and is_mixed(layout.blocks)):
            continue
        param = path_attr(root, node.target)
        spans = whole_slices(param.shape[layout.dim], layout.blocks, plan.degree)
        name = f"autotp_{node.name}_whole_segments"
        if grad_sync is GradSync.BUCKET:
            bucket.params[node.target] = param
            bucket.partial[node.target] = (layout.dim, spans)
            module: nn.Module = DeferredGradReduce(bucket, node.target)
        else:
            module = PartialSegmentsReduce(comm, layout.dim, spans,
                                           label=f"grad sync {node.target}")
        root.add_module(name, module)
        users = list(node.users)
        with graph.inserting_after(node):
            new = graph.call_module(name, (node,))
        new.meta["val"] = node.meta.get("val")
        for user in users:
            user.replace_input_with(node, new)
        count += 1
    return count


def token_symbols(captured: Captured, plan: Plan) -> frozenset:
    """The symbols of the dims sequence parallelism splits: the sequence's, and the batch's
    where the plan splits it (``Plan.batch_tokens``)."""
    symbols = sequence_symbols(captured.dim_names)
    return symbols | batch_symbols(captured.dim_names) if plan.batch_tokens else symbols


def keep_sequence_shards(graph: fx.Graph, root: nn.Module, keeper: ShardKeeper,
                         sequence: frozenset) -> int:
    """The all-gathers along a sequence dim (``sequence``: its symbols) report their outputs
    to ``keeper``, which stores what autograd saves of them as the shard (autotp.runtime.regather);
    returns how many."""
    count = 0
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        module = path_attr(root, node.target)
        if not (isinstance(module, Redistribute) and isinstance(module.src, Shard)
                and isinstance(module.dst, Replicate)):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and size_expr(val.shape[module.src.dim]) in sequence:
            module.keeper = keeper
            count += 1
    return count


def _reads_unchanged_size(consumer: fx.Node, src: Layout, dst: Layout) -> bool:
    """``consumer`` reads one size of a replicated value, a size the layout change keeps:
    it reads the value as it is (no slice copied to read a shape)."""
    if consumer.op != "call_function" or consumer.target != torch.ops.aten.sym_size.int or \
            not isinstance(src, Replicate):
        return False
    dim = consumer.args[1]
    ndim = getattr(arg_node(consumer, 0).meta.get("val"), "ndim", None)
    if not isinstance(dim, int) or ndim is None:
        return False
    return not (isinstance(dst, Shard) and dst.dim == dim % ndim)


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    last = None
    for node in graph.nodes:
        if node.op == "placeholder":
            last = node
    assert last is not None
    return last


def _slug(text: str) -> str:
    """A module-name form of a layout: R* -> Rstar, S(1)x3 -> S_1_x3 (distinct layouts give
    distinct names: a value redistributed to both R and R* gets two modules)."""
    text = text.replace("*", "star")
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_") or "x"


def lower_ops(graph: fx.Graph, plan: Plan, registry: Registry, rank: int,
              routes: Optional[dict[str, fx.Node]] = None) -> dict[str, str]:
    """Lower every op; returns original node -> the node now holding its value."""
    ctx = LowerContext(graph, rank, plan.degree, routes)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in plan.choices:
            continue
        lowering = lowering_for(node.target)
        if lowering is None:
            continue
        choice = plan.choices[node.name]
        strategy = Strategy(tuple(parse_layout(x) for x in choice.inputs),
                            parse_output(choice.output))
        lowering(ctx, node, strategy)
    return {node.name: new.name for node, new in ctx.lowered.items()}


def ring_attention_calls(graph: fx.Graph, plan: Plan, root: nn.Module, comm: Communicator,
                         tp_plan: Optional[Plan] = None,
                         sequence: Optional[SequenceLayout] = None) -> dict[str, str]:
    """Context parallelism: attention whose plan takes q, k, v sharded along the sequence
    (the ``ring`` strategy) runs as ``autotp.runtime.ring.ring_attention`` over the group,
    or as ``ulysses_attention`` where the plan chose it (``[ulysses]``); returns original
    node -> the node now holding its value. ``tp_plan``: the tp plan the context-parallel
    ``plan`` runs inside (its heads split over tp); ``sequence``: how the group holds the
    sequence (contiguous shards where None). A mask made by elementwise ops
    (``autotp.planner.masks.mask_region``) goes to the ring as their program and its factors,
    and its [s/cp, s] rows are no longer computed."""
    renamed: dict[str, str] = {}
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    kinds = {"[ring]": ("ring", RingAttention), "[ulysses]": ("ulysses", UlyssesAttention)}
    calls = {}
    for node in graph.nodes:
        choice = plan.choices.get(node.name)
        kind = next((k for k in kinds if choice is not None and choice.strategy.endswith(k)),
                    None)
        if node.op == "call_function" and node.target == sdpa and kind is not None:
            calls[node] = kind
    # the masks' programs, read before the graph changes
    programs: dict[fx.Node, tuple[MaskProgram, MaskRegion]] = {}
    for node, kind in calls.items():
        mask = node_arg(node, "attn_mask")
        if kind == "[ring]" and isinstance(mask, fx.Node) and mask not in programs:
            region = mask_region(mask)
            if region is not None:
                programs[mask] = (MaskProgram(region, root), region)
    for node, kind in calls.items():
        prefix, module = kinds[kind]
        name = f"autotp_{prefix}_{node.name}"
        args, kwargs = _grouped_kv(node, tp_plan)
        mask = node_arg(node, "attn_mask")
        program = None
        if kind == "[ring]" and isinstance(mask, fx.Node):
            if mask in programs:
                program, region = programs[mask]
                args = args[:3] + (None,) + args[4:] if len(args) > 3 else args
                kwargs = {**{k: v for k, v in kwargs.items() if k != "attn_mask"},
                          "mask_factors": region.factors}
        root.add_module(name, module(comm, node.name, program, sequence=sequence))
        with graph.inserting_before(node):
            new = graph.call_module(name, args, kwargs)
        new.meta.update(node.meta)
        repeated = [a for a in node.args[1:3] if isinstance(a, fx.Node)]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for value in repeated:  # the repeated keys and values no reader takes any more
            _erase_unread(graph, value)
        renamed[node.name] = new.name
    for _, region in programs.values():  # the mask's ops, as far as nothing else reads them
        for op in reversed(region.nodes):
            if not op.users:
                graph.erase_node(op)
    return renamed


def _gathers_for(node: fx.Node, root: nn.Module, keeper: ShardKeeper) -> bool:
    """``node`` is a sequence all-gather whose output ``keeper`` stores as the shard."""
    if node.op != "call_module":
        return False
    module = path_attr(root, str(node.target))
    return isinstance(module, Redistribute) and module.keeper is keeper


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """``node`` and the views it was made of, as far as nothing else reads them."""
    views = {torch.ops.aten.reshape.default, torch.ops.aten.expand.default,
             torch.ops.aten.slice.Tensor, torch.ops.aten.unsqueeze.default}
    while node.op == "call_function" and node.target in views and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        if not isinstance(source, fx.Node):
            return
        node = source


def _grouped_kv(node: fx.Node, tp_plan: Optional[Plan] = None) -> tuple[tuple, dict]:
    """An attention call's arguments with keys and values whose heads were repeated for
    grouped-query attention replaced by the unrepeated ones (``enable_gqa``): the ring sends
    and saves hk heads, not hq. Inside a tp plan, only where it holds them as it holds the
    queries (``autotp.planner.context.grouped_source``)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) < 3:
        return tuple(args), kwargs
    if tp_plan is not None:
        k, v = (grouped_source(tp_plan, node, a) if isinstance(a, fx.Node) else None
                for a in args[1:3])
    else:
        k, v = repeated_heads(args[1]), repeated_heads(args[2])
    if k is None or v is None:
        return tuple(args), kwargs
    k_val, v_val = k.meta["val"], v.meta["val"]
    if k_val.shape[1] != v_val.shape[1]:
        return tuple(args), kwargs
    args[1], args[2] = k, v
    kwargs["enable_gqa"] = True
    return tuple(args), kwargs


def track_randomness(graph: fx.Graph, plan: Plan, root: nn.Module, tracker: RngTracker,
                     beside: Sequence[tuple[Plan, RngTracker]] = ()) -> dict[str, str]:
    """Dropout draws from the replicated stream on replicated values and from this rank's
    own stream on sharded ones; returns original node -> the node now holding its value.
    ``beside``: the plan of each axis beside the lead's (cp inside tp) and this rank's
    tracker on it, used for values that axis splits (streams that differ across its ranks,
    alike across tp ranks where tp holds the value whole)."""
    renamed: dict[str, str] = {}
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.dropout.default,
                                                              sdpa):
            continue
        layout = parse_output(plan.values[node.name])
        stream = Stream.SHARDED if isinstance(layout, Shard) else Stream.REPLICATED
        drawing = tracker
        for other, its_tracker in beside:
            if isinstance(parse_output(other.values[node.name]), Shard):
                drawing = its_tracker
        name = f"autotp_random_{node.name}"
        if node.target == sdpa:
            dropout_p = node_arg(node, "dropout_p", 0.0)
            if not dropout_p:
                continue
            root.add_module(name, TrackedAttention(drawing, stream))
            args, kwargs = node.args, node.kwargs
        else:
            root.add_module(name, TrackedDropout(drawing, stream))
            args, kwargs = tuple((list(node.args) + [0.5, True])[:3]), {}
        with graph.inserting_before(node):
            new = graph.call_module(name, args, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        renamed[node.name] = new.name
    return renamed


def views_to_reshapes(graph: fx.Graph) -> None:
    """``view`` -> ``reshape``: a collective returns a contiguous tensor where the original
    program may have had another memory layout (attention outputs are often laid out
    [B, T, H, D] under a [B, H, T, D] shape, and the model's ``transpose(1, 2).view(B, T, C)``
    relies on it). ``reshape`` is the same view where one exists and copies otherwise."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def drop_unread(graph: fx.Graph) -> int:
    """Erase the pure values no op reads, and returns how many: what the passes before left
    unread (a traced mask's recipe once the kernel's causal path stands for it, export's
    leftovers) would otherwise run in every step. Kept: placeholders, ops that write or draw
    random numbers, and every module call (collectives, the ring, tracked dropout). Before
    ``reduce_in_place``, which counts a value's readers."""
    before = len(graph.nodes)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op == "call_module" or n.is_impure())
    return before - len(graph.nodes)


def drop_input_guards(graph: fx.Graph, plan: Plan) -> None:
    """torch.export's input guards check global sizes; a state input (a KV cache) arrives as
    this rank's shard, so a program with sharded state inputs does not run them."""
    if any(isinstance(parse_layout(x), Shard) for x in plan.states.values()):
        erase_input_guards(graph)


def erase_input_guards(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            graph.erase_node(node)


SPLIT = "autotp_split"  # node meta: dim -> how many ways this rank's value is split along it


def note_splits(graph: fx.Graph, root: nn.Module, plans: list[tuple[Plan, Communicator]],
                lowered: dict[str, str]) -> None:
    """``SPLIT`` on every tensor node whose layout the plans give (each plan over its own
    group): how many ways each dim of its value is split on this rank, for whoever reads a
    size from it later (the pipeline cut re-reads sizes from the tensors a stage holds; its
    meta holds global sizes)."""
    original = {new: old for old, new in lowered.items()}
    held: dict[fx.Node, dict[int, Layout]] = {}
    for node in graph.nodes:
        name = original.get(node.name, node.name)
        layouts: dict[int, Layout] = {}
        module = path_attr(root, str(node.target)) if node.op == "call_module" else None
        if isinstance(module, Redistribute) and isinstance(node.args[0], fx.Node):
            layouts = dict(held.get(node.args[0], {}))
            for axis, (_, comm) in enumerate(plans):
                if module.comm is comm:
                    layouts[axis] = module.dst
        else:
            for axis, (plan, _) in enumerate(plans):
                text = plan.values.get(name)
                layout = parse_output(text) if text is not None else None
                if isinstance(layout, (Replicate, Shard, Partial)):
                    layouts[axis] = layout
        if not layouts:
            continue
        held[node] = layouts
        split: dict[int, int] = {}
        for axis, layout in layouts.items():
            if isinstance(layout, Shard):
                split[layout.dim] = split.get(layout.dim, 1) * plans[axis][0].degree
        node.meta[SPLIT] = split


def rewrite(captured: Captured, plan: Plan, rank: int, comm: Communicator,
            registry: Optional[Registry] = None, seed: int = 0,
            grad_sync: GradSync = GradSync.BUCKET, weights: Optional[Weights] = None,
            device: Optional[torch.device] = None, keeper: Optional[ShardKeeper] = None,
            ep_comm: Optional[Communicator] = None, cp_comm: Optional[Communicator] = None,
            sequence: Optional[SequenceLayout] = None) -> tuple[fx.GraphModule, GradBucket]:
    """This rank's program: each layout axis of ``plan`` applied over its own group, the
    lead axis's over ``comm``, the one beside it ("cp" inside "tp") over ``cp_comm``
    (``autotp.planner.context``). ``keeper``: with sequence parallelism, where the sequence
    all-gathers record their outputs so that backward re-gathers what it saved of them.
    ``ep_comm``: with expert parallelism (an "ep" axis), the group of ranks the experts
    are split over besides the tp group, whose tokens differ. ``sequence``: with context
    parallelism, how the cp group holds the sequence (``held_sequence``): the collectives
    over that group and the ring attention follow it."""
    lead, *beside = plan.layout_axes()
    groups = {lead.name: comm, **({"cp": cp_comm} if cp_comm is not None else {})}
    if set(groups) != {lead.name, *(axis.name for axis in beside)}:
        raise PlanError(f"a plan over {plan.degrees_text()} needs one group per axis; "
                        f"given groups for {', '.join(groups)} (cp_comm= is the cp group "
                        "beside tp)")

    def held(axis: AxisPlan) -> Optional[SequenceLayout]:  # the sequence axis's layout
        return sequence if axis.name == "cp" else None

    registry = registry or Registry.default()
    weights = weights or ModelWeights(captured.gm)
    graph = copy_graph(captured.gm)
    drop_input_guards(graph, plan)
    root = shard_parameters(captured, plan, graph, rank, weights,
                            ep_comm.rank if ep_comm is not None else 0)
    place_on_device(graph, root, device)
    bucket = GradBucket(comm)
    routes = route_rows(graph, plan, comm, root, ep_comm)
    insert_collectives(graph, plan, comm, root, bucket, grad_sync, sequence=held(lead))
    join_siblings(graph, plan, comm, root)
    join_ahead(graph, plan, comm, root, held(lead))
    originals = {n.name for n in captured.gm.graph.nodes}
    for axis in beside:  # after the lead's collectives, each over its own group
        group = groups[axis.name]
        insert_collectives(graph, plan.on(axis.name), group, root, GradBucket(group),
                           grad_sync, axis=f"{axis.name}_", originals=originals,
                           sequence=held(axis))
    if keeper is not None:
        keep_sequence_shards(graph, root, keeper, token_symbols(captured, plan))
    lowered = lower_ops(graph, plan, registry, rank, routes)
    for axis in beside:
        lowered.update(lower_ops(graph, plan.on(axis.name), registry, groups[axis.name].rank))
    if "cp" in groups:  # attention across the sequence shards, inside the lead's plan if cp
        lowered.update(ring_attention_calls(   # is not the lead
            graph, plan.on("cp"), root, groups["cp"], sequence=sequence,
            tp_plan=plan if lead.name != "cp" else None))
    tracker = RngTracker(seed, rank)
    lowered.update(track_randomness(graph, plan, root, tracker, [
        (plan.on(axis.name), RngTracker(seed + 7_919 * (groups[axis.name].rank + 1), rank))
        for axis in beside]))
    lowered.update(causal_attention_calls(graph, root, plan))
    lowered.update(drop_full_slices(graph))
    lowered.update(fuse_logsumexp_gather(graph))
    views_to_reshapes(graph)
    lowered.update(fuse_bias_adds(graph))
    drop_unread(graph)
    reduce_in_place(graph, root)
    lowered.update(gather_rows(graph, root))
    if keeper is not None:
        scope_saves(graph, root, keeper, [n for n in graph.nodes if _gathers_for(n, root, keeper)])
    note_splits(graph, root, [(plan.on(axis.name), groups[axis.name])
                              for axis in (lead, *beside)], lowered)
    graph.lint()
    gm = fx.GraphModule(root, graph)
    for name, param in captured.unused.items():  # never read by the forward: replicated
        local = weights.parameter(name, [name], Replicate(), rank, plan.degree, param)
        _set(gm, name, nn.Parameter(local, requires_grad=param.requires_grad))
    gm.meta["autotp_values"] = lowered
    gm.recompile()
    return gm, bucket
