"""One rank's program in numbers: the work, the saved activations and the collectives of a
plan, per layer, at a given micro-batch and sequence length.

The captured graph knows every op with its shapes as expressions of the batch ``B`` and the
sequence ``T``; the plan knows the layout each op reads and writes. Together they say what
one rank of the sharded program does: the FLOPs of each product on its local shapes, the bytes
each memory-bound kernel moves, the tensors autograd keeps for backward (``autotp.planner.saved``:
which inputs each op keeps, plus the masks and statistics ops keep beside them), and the bytes
of each collective. The memory model (``memory.py``) and the time model (``timing.py``) read
nothing else.

Views allocate nothing: a saved view keeps its base's storage, counted once, as autograd's
own ``saved_tensors_hooks`` see it. Float tensors of the model's own dtype (its parameters')
are counted at the training dtype (``dtype_bytes``); masks, indices, the float32 statistics
of norms and the values a model computes in another float dtype keep theirs. The last are
found only where the model was traced in its training dtype: traced in float32, a bfloat16
model's upcasts (RMSNorm's ``.to(torch.float32)``, the loss's ``logits.float()``) cannot be
told from its own float32 (``configure.capture_for_training`` traces a copy on meta in the
training dtype).

Beside what is saved, backward needs room to work: while an op's backward runs, the gradient
of its output and the gradients of its inputs are alive together (the head's log-softmax over
the vocabulary: two float32 tensors of tokens x vocabulary). The largest such pair, per layer
and end, is ``backward_working``.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import networkx as nx
import torch
import torch.fx as fx

from autotp.capture.trace import Captured, tensor_inputs
from autotp.errors import ConfigError
from autotp.ops import ATTENTION, DROPOUTS, NORMS, PRODUCTS, VIEWS, node_arg
from autotp.layout import Layout, Routed, Shard
from autotp.planner.assemble import attention_kind
from autotp.planner.masks import MaskRegion, attention_mask, mask_region, ordered
from autotp.planner.cost import parse_size_expr
from autotp.planner.plan import Plan
from autotp.planner.problem import is_grouped
from autotp.planner.job.expert_load import routing_imbalance
from autotp.planner.saved import saves_input, saves_output
from autotp.planner.job.sizes import (Sizes, element_bytes, layout_of, local_numel,
                                      local_shape_at, model_dtype, out_numel)

aten = torch.ops.aten

# ops whose backward keeps only some inputs: (op, the tensor-input positions kept)
_KEEPS_ONLY: dict[Any, tuple[int, ...]] = {
    aten.masked_fill.Scalar: (1,), aten.masked_fill.Tensor: (1,), aten.where.self: (0,),
    aten.embedding.default: (1,), aten.index_select.default: (1,), aten.gather.default: (1,),
}


@dataclass
class Op:
    """One kernel of one rank's forward."""

    name: str
    layer: Optional[int]  # None: before the layers (embeddings) or after them (head, loss)
    kind: str  # "gemm" (FLOP-bound), "attention" or "memory" (bandwidth-bound)
    flops: float  # forward FLOPs on this rank
    nbytes: float  # bytes it reads and writes at least (operands and result, local shapes)
    quadratic: bool  # its size grows with the square of the sequence (attention core)
    side: str = "layer"  # "first" (before the layers) or "last" (after) when layer is None


@dataclass
class Saved:
    """One storage autograd keeps from the forward for the backward."""

    key: str
    layer: Optional[int]
    nbytes: float
    quadratic: bool
    side: str = "layer"


@dataclass
class Comm:
    kind: str  # all_reduce / all_gather / reduce_scatter / all_to_all
    phase: str  # forward / backward
    layer: Optional[int]
    nbytes: float  # the full tensor's bytes (what the ring factor applies to)
    side: str = "layer"
    group: str = "tp"  # over the tp group, or the ep group (expert parallelism's all-to-alls)


@dataclass
class Param:
    name: str
    layer: Optional[int]
    end: str  # "layer", "first" (before the layers), "last" (after them), "both" (tied)
    numel: int  # on this rank
    ndim: int
    grad_sync: bool
    # split along the experts over the ep ranks too: kept out of the data-parallel sharding
    # and average (autotp.expert_parameters), its gradient summed over dp / ep ranks only
    expert: bool = False


@dataclass
class Profile:
    """One rank's program at one micro-batch and sequence length."""

    tp: int
    sequence_parallel: bool
    micro_batch: int
    seq: int
    dtype_bytes: int
    layers: list[int]
    ops: list[Op] = field(default_factory=list)
    saved: list[Saved] = field(default_factory=list)
    comms: list[Comm] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)
    # per layer: the bytes of the values it reads from outside itself (what a fully
    # recomputed layer keeps), each value counted at the first layer that reads it
    layer_inputs: dict[int, float] = field(default_factory=dict)
    # per layer (and "first", "last"): the largest gradient pair of one op's backward
    backward_working: dict[Any, float] = field(default_factory=dict)
    # experts held whole per rank: how many, the top-k, and the busiest rank's routed rows
    # over the mean under uniform routing, which scales the ops on routed rows
    # (autotp.planner.job.expert_load)
    experts: int = 0
    top_k: int = 0
    expert_imbalance: float = 1.0
    ep: int = 1  # expert parallelism: the experts split over ep data-parallel ranks as well
    cp: int = 1  # context parallelism: the sequence split over cp ranks (``seq`` is the shard)
    # attention ops whose mask tensor keeps at most the causal half (``planner.masks.
    # ordered``), priced as causal: unpadded, such a mask is the causal one, which the
    # runtime attends under by the kernel's causal path (autotp.runtime.causal) or the ring
    causal_masks: set[str] = field(default_factory=set)
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)  # sums the models reuse


def build_profile(captured: Captured, plan: Plan, micro_batch: int, seq: int,
                  dtype_bytes: int = 2, mask_bytes: int = 1, cp: int = 1) -> Profile:
    """``mask_bytes``: what a dropout keeps per element (CUDA's kernel a bool mask; the CPU
    kernel a mask of the input's dtype).

    ``cp``: the program of one of cp ranks splitting the sequence (context parallelism) on
    top of the plan's tp: every value at ``seq / cp`` tokens, except what attention reads
    across the whole sequence. A fused attention's queries meet all ``seq`` keys, its key
    and value blocks going around the cp ranks (``runtime/ring.ring_attention``: cp - 1
    shifts forward; backward, the blocks with their gradients); the work of the attention
    core, a mask's rows and an eager attention's scores are ``seq / cp x seq``, cp times
    their size at the shard; an eager attention gathers its keys and values over cp."""
    if seq % cp:
        raise ConfigError(f"cp={cp} does not divide the sequence {seq}")
    builder = _ProfileBuilder(captured, plan, micro_batch, seq, dtype_bytes, mask_bytes, cp)
    gm, prof = captured.gm, builder.prof
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in plan.values:
            continue
        builder.op(node)
    prof.saved = list(builder.kept.values())
    prof.comms = _comms(plan, builder.nodes, builder.sizes, dtype_bytes, builder.side,
                        builder.own) + prof.comms
    if plan.ep > 1:
        prof.comms += _exchanges(gm, plan, builder.sizes, dtype_bytes, builder.own)
    prof.params = _params(gm, plan, builder.side)
    prof.layer_inputs = _layer_inputs(plan, builder.nodes, builder.local_bytes,
                                      builder.read_layout, builder.factors_of)
    return prof


class _ProfileBuilder:
    """One profile's construction, op by op: its work, its collectives and what its backward
    keeps."""

    def __init__(self, captured: Captured, plan: Plan, micro_batch: int, seq: int,
                 dtype_bytes: int, mask_bytes: int, cp: int):
        gm = captured.gm
        self.plan, self.tp, self.cp = plan, plan.degree, cp
        self.dtype_bytes, self.mask_bytes = dtype_bytes, mask_bytes
        self.sizes = Sizes(captured, micro_batch, seq // cp)
        layers = sorted({x for x in plan.node_layers.values() if x is not None})
        self.prof = prof = Profile(tp=plan.degree, sequence_parallel=plan.sequence_parallel,
                                   micro_batch=micro_batch, seq=seq // cp,
                                   dtype_bytes=dtype_bytes, layers=layers, cp=cp)
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.reads = {(e.value, e.consumer): e for e in plan.edges}
        self.own = model_dtype(gm)
        prof.ep = plan.ep
        prof.experts, prof.top_k = _routing(gm, plan)
        if prof.experts:
            # with ep, a rank's experts take rows from the tokens of all ep ranks
            prof.expert_imbalance = routing_imbalance(micro_batch * seq * plan.ep,
                                                      prof.experts, prof.top_k,
                                                      plan.degree * plan.ep)
        self.grads = _requires_grad(gm, plan)
        self.kept: dict[str, Saved] = {}
        self.side = _sides(gm, plan)
        self.inputs = _inputs_of(gm)
        # masks the ring builds block by block from their factors (runtime/ring.
        # BlockMask): mask -> the factors held instead of its [s/cp, s] rows
        regions = _mask_regions(gm, cp, plan.degree)
        self.factors_of = {mask: [f for f in region.factors
                                  if isinstance(f.meta.get("val"), torch.Tensor)]
                           for mask, region in regions.items()}
        prof.causal_masks = _causal_masks(gm)

    def local_bytes(self, node: fx.Node, layout: Layout) -> float:
        """On this rank; routed rows as many as the busiest rank holds."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return 0.0
        return local_numel(self.sizes.shape(val), layout, self.tp) * \
            element_bytes(val, self.dtype_bytes, self.own) * \
            (self.prof.expert_imbalance if _routed(layout) else 1.0)

    def read_layout(self, value: fx.Node, consumer: fx.Node, position: int) -> Layout:
        edge = self.reads.get((value.name, consumer.name))
        if edge is not None:
            return layout_of(edge.dst)
        choice = self.plan.choices.get(consumer.name)
        if choice is not None and position < len(choice.inputs):
            return layout_of(choice.inputs[position])
        return layout_of(self.plan.values.get(value.name))

    def keep(self, key: str, node: fx.Node, nbytes: float, quadratic: bool) -> None:
        if key not in self.kept and nbytes > 0:
            self.kept[key] = Saved(key, self.plan.node_layers.get(node.name),
                                   nbytes * (self.cp if quadratic else 1), quadratic,
                                   self.side[node.name])

    def op(self, node: fx.Node) -> None:
        """The op's work and collectives, then what its backward keeps."""
        plan, sizes = self.plan, self.sizes
        val = node.meta.get("val")
        out_layout = layout_of(plan.values.get(node.name))
        ins = self.inputs[node]
        in_layouts = [self.read_layout(a, node, i) for i, a in enumerate(ins)]
        # the attention core: ops writing a (.., s, s) tensor, and the products reading one
        quadratic = sizes.quadratic(val) or (node.target in PRODUCTS and any(
            sizes.quadratic(a.meta.get("val")) for a in ins))
        if node.target not in VIEWS:
            self._work(node, ins, in_layouts, out_layout, quadratic)
        if self.grads.get(node.name, False):
            self._backward_keeps(node, ins, in_layouts, out_layout, quadratic)

    def _work(self, node: fx.Node, ins: list[fx.Node], in_layouts: list[Layout],
              out_layout: Layout, quadratic: bool) -> None:
        plan, prof, tp, cp = self.plan, self.prof, self.tp, self.cp
        val = node.meta.get("val")
        layer = plan.node_layers.get(node.name)
        side = self.side[node.name]
        # every kernel reads its operands and writes its result at least once: all a
        # memory-bound kernel costs, and the floor under a product (its roofline)
        moved = sum(self.local_bytes(a, lay) for a, lay in zip(ins, in_layouts))
        if isinstance(val, torch.Tensor):
            moved += self.local_bytes(node, out_layout)
        # rows routed to this rank's experts: the busiest rank's, which every rank awaits
        busiest = prof.expert_imbalance if any(
            _routed(x) for x in (*in_layouts, out_layout)) else 1.0
        flops = 0.0
        if node.target in PRODUCTS or node.target in ATTENTION or is_grouped(node):
            flops = busiest * _flops(node, ins, in_layouts, self.sizes, tp)
        if node.name in prof.causal_masks:
            # a causal mask tensor: the kernel's causal path (autotp.runtime.causal), or the
            # ring's skipped chunk pairs, do the causal half (no padding at run time)
            flops /= 2
        if cp > 1 and node.target in ATTENTION:  # this rank's queries, every key
            flops *= cp
            moved += self._across_cp(node, ins, in_layouts, out_layout, layer, side)
        elif cp > 1 and quadratic:  # scores, masks: seq / cp rows of seq columns
            flops, moved = flops * cp, moved * cp
            if node.target in PRODUCTS:  # an eager attention's keys or values, gathered
                self._gathered_keys(node, ins, in_layouts, layer, side)
        if node.target in PRODUCTS or node.target in ATTENTION or is_grouped(node):
            prof.ops.append(Op(node.name, layer, "attention" if node.target in ATTENTION
                               else "gemm", flops, moved, quadratic, side))
        else:
            prof.ops.append(Op(node.name, layer, "memory", 0.0, moved, quadratic, side))

    def _across_cp(self, node: fx.Node, ins: list[fx.Node], in_layouts: list[Layout],
                   out_layout: Layout, layer: Optional[int], side: str) -> float:
        """A fused attention at cp > 1: its all-to-alls (Ulysses) or ring shifts into the
        profile's collectives; returns the bytes the ring moves beside the kernel."""
        cp, plan = self.cp, self.plan
        sources = [_kv_source(a, self.sizes) for a in ins[1:3]]
        kv = [self.local_bytes(a, layout_of(plan.values.get(a.name))) if a is not b
              else self.local_bytes(a, self.read_layout(a, node, i))
              for i, (a, b) in enumerate(zip(sources, ins[1:3]), 1)]
        if attention_kind(node, cp, self.tp)[0] == "ulysses":
            # all-to-alls from sequence to head shards and back, forward and backward
            sent = self.local_bytes(ins[0], in_layouts[0]) + sum(kv) + \
                self.local_bytes(node, out_layout)
            self.prof.comms += [Comm("all_to_all", phase, layer, sent, side, group="cp")
                                for phase in ("forward", "backward")]
            return 0.0
        self.prof.comms += _ring(layer, side, sum(kv), cp, self.dtype_bytes)
        return (cp - 1) * sum(kv)

    def _gathered_keys(self, node: fx.Node, ins: list[fx.Node], in_layouts: list[Layout],
                       layer: Optional[int], side: str) -> None:
        """An eager attention's product at cp > 1: its keys or values gathered over cp."""
        sizes = self.sizes
        operand = 1 if sizes.quadratic(node.meta.get("val")) else next(
            (i for i, a in enumerate(ins) if not sizes.quadratic(a.meta.get("val"))), None)
        if operand is not None and operand < len(ins):
            gathered = self.cp * self.local_bytes(ins[operand], in_layouts[operand])
            self.prof.comms += [Comm("all_gather", "forward", layer, gathered, side,
                                     group="cp"),
                                Comm("reduce_scatter", "backward", layer, gathered, side,
                                     group="cp")]

    def _backward_keeps(self, node: fx.Node, ins: list[fx.Node], in_layouts: list[Layout],
                        out_layout: Layout, quadratic: bool) -> None:
        """The gradient pair its backward holds, and the storages it keeps."""
        plan, grads, keep = self.plan, self.grads, self.keep
        val = node.meta.get("val")
        layer = plan.node_layers.get(node.name)
        if node.target not in VIEWS and isinstance(val, torch.Tensor):
            pair = self.local_bytes(node, out_layout) + sum(
                self.local_bytes(a, lay) for a, lay in zip(ins, in_layouts)
                if grads.get(a.name, False) and a.op != "get_attr")
            at = layer if layer is not None else self.side[node.name]
            self.prof.backward_working[at] = max(self.prof.backward_working.get(at, 0.0), pair)
        only = _KEEPS_ONLY.get(node.target)
        for i, (arg, lay) in enumerate(zip(ins, in_layouts)):
            if node.target in DROPOUTS or arg.op == "get_attr" or (only and i not in only):
                continue
            if node.target in ATTENTION and arg.name in self.factors_of:
                for factor in self.factors_of[arg.name]:
                    keep(factor.name, factor, self.local_bytes(
                        factor, layout_of(plan.values.get(factor.name))), False)
                continue
            if only is None and not saves_input(node, arg, lambda n: grads.get(n.name, False)):
                continue
            self._keep_input(node, arg, lay, quadratic)
        tp, dtype_bytes = self.tp, self.dtype_bytes
        if not isinstance(val, torch.Tensor) and node.target not in DROPOUTS:
            if node.target in ATTENTION or node.target in NORMS:
                _keep_extras(node, ins, in_layouts, self.sizes, tp, dtype_bytes, keep)
            return
        if node.target in DROPOUTS:  # a mask of the input's shape
            shape = self.sizes.shape(ins[0].meta["val"])
            keep(f"{node.name}:mask", node,
                 local_numel(shape, in_layouts[0], tp) * self.mask_bytes, quadratic)
        elif node.target in NORMS or node.target in ATTENTION:
            _keep_extras(node, ins, in_layouts, self.sizes, tp, dtype_bytes, keep)
        elif saves_output(node):
            keep(node.name, node, self.local_bytes(node, out_layout), quadratic)

    def _keep_input(self, node: fx.Node, arg: fx.Node, lay: Layout, quadratic: bool) -> None:
        """An input its backward keeps: a redistributed copy's own storage, or the storage
        the input views."""
        edge = self.reads.get((arg.name, node.name))
        if edge is not None and edge.forward is not None:
            # a redistributed copy: its own storage (a sequence-parallel all-gather keeps
            # only the shard, gathered again in backward)
            if edge.forward == "all_gather" and self.plan.sequence_parallel:
                self.keep(f"{arg.name}:{edge.src}", arg,
                          self.local_bytes(arg, layout_of(edge.src)), quadratic)
            else:
                self.keep(f"{arg.name}:{edge.dst}", arg, self.local_bytes(arg, lay), quadratic)
            return
        base = arg
        while base.op == "call_function" and base.target in VIEWS and base.args and \
                isinstance(base.args[0], fx.Node):
            base = base.args[0]
        if base.op != "get_attr":
            self.keep(base.name, base,
                      self.local_bytes(base, layout_of(self.plan.values.get(base.name))),
                      self.sizes.quadratic(base.meta.get("val")))


def _causal_masks(gm: fx.GraphModule) -> set[str]:
    """The attention nodes whose mask keeps at most the causal half of the pairs, and that
    the runtime can attend by the causal path (no dropout: autotp.runtime.causal)."""
    out = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION and \
                not node_arg(node, "dropout_p", 0.0):
            region = mask_region(attention_mask(node))
            if region is not None and ordered(region):
                out.add(node.name)
    return out


def _mask_regions(gm: fx.GraphModule, cp: int, tp: int) -> dict[str, MaskRegion]:
    """Under context parallelism, each mask a ring attention reads that is made by
    elementwise ops (``autotp.planner.masks.mask_region``) -> those ops and their factors: the
    runtime builds the mask's blocks from the factors (evaluating the ops over all of its
    rows once, to find the pairs of chunks it hides, and again on the pairs it keeps part
    of)."""
    out: dict[str, MaskRegion] = {}
    if cp == 1:
        return out
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ATTENTION or \
                attention_kind(node, cp, tp)[0] == "ulysses":
            continue
        mask = attention_mask(node)
        region = mask_region(mask) if isinstance(mask, fx.Node) else None
        if region is not None and isinstance(mask, fx.Node):
            out[mask.name] = region
    return out


def _kv_source(node: fx.Node, sizes: Sizes) -> fx.Node:
    """Where a key or value operand was last its own size: through the views, copies and
    expansions that repeat grouped heads (transformers' ``repeat_kv``), which the ring reads
    through (it sends the kv heads, not the query heads)."""
    def numel(n: fx.Node) -> float:
        val = n.meta.get("val")
        return math.prod(sizes.shape(val)) if isinstance(val, torch.Tensor) else math.inf

    smallest = node
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and \
            (node.target in VIEWS or node.target in _COPIES):
        node = node.args[0]
        if numel(node) < numel(smallest):
            smallest = node
    return smallest


_COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten._unsafe_view.default,
                     aten.repeat_interleave.self_int, aten.repeat.default})


def _ring(layer: Optional[int], side: str, blocks: float, cp: int,
          dtype_bytes: int) -> list[Comm]:
    """One attention's shifts around the cp ranks: forward, the key and value blocks (cp - 1
    shifts); backward, the blocks with their gradients (cp - 1 shifts) and the gradients
    home (one more), in the model's dtype (``autotp.runtime.ring`` sums each rank's share in
    float32 and sends the sum in the inputs' dtype). ``nbytes`` is one shift's message."""
    grads = blocks  # dK, dV travel in the model's dtype
    return [Comm("shift", "forward", layer, blocks, side, group="cp"),
            Comm("shift", "backward", layer, blocks + grads, side, group="cp"),
            Comm("shift_home", "backward", layer, grads, side, group="cp")]


def _routed(layout: Layout) -> bool:
    return isinstance(layout, Shard) and isinstance(layout.blocks, Routed)


def _exchanges(gm: fx.GraphModule, plan: Plan, sizes: Sizes, dtype_bytes: int,
               own: Optional[torch.dtype]) -> list[Comm]:
    """Expert parallelism's all-to-alls over the ep group (autotp.runtime.routed_rows): per MoE
    layer, the rows to the experts' owners and their outputs back, forward, and the same
    two reversed in backward. Each tp rank sends the rows of its own share of the experts:
    the rows a grouped product reads (its first in the layer) and writes (its last), over
    tp. The row counts exchanged first are a few integers per expert, left out."""
    first: dict[int, fx.Node] = {}
    last: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        layer = plan.node_layers.get(node.name)
        choice = plan.choices.get(node.name)
        if layer is not None and choice is not None and \
                choice.strategy.endswith("[experts]") and is_grouped(node):
            first.setdefault(layer, node)
            last[layer] = node
    out = []
    for layer, node in first.items():
        rows = node.args[0]
        for val in (rows.meta.get("val") if isinstance(rows, fx.Node) else None,
                    last[layer].meta.get("val")):
            if isinstance(val, torch.Tensor):
                moved = math.prod(sizes.shape(val)) / plan.degree * \
                    element_bytes(val, dtype_bytes, own)
                for phase in ("forward", "backward"):
                    out.append(Comm("all_to_all", phase, layer, moved, group="ep"))
    return out


def _routing(gm: fx.GraphModule, plan: Plan) -> tuple[int, int]:
    """(experts, top-k) of the experts the plan holds whole per rank, or (0, 0): the
    experts from the plan, k from the top-k over that many scores (not a grouped router's
    top-k over its groups)."""
    counts = [count for count, how in plan.experts.values() if how == "whole"]
    if not counts or plan.degree * plan.ep == 1:
        return 0, 0
    experts = max(counts)
    for node in gm.graph.nodes:
        if node.target is aten.topk.default:
            scores = node.args[0].meta.get("val")
            k = node_arg(node, "k")
            if isinstance(scores, torch.Tensor) and isinstance(k, int) and \
                    scores.shape[-1] == experts:
                return experts, k
    return 0, 0


def _keep_extras(node: fx.Node, ins: list[fx.Node], layouts: list[Layout], sizes: Sizes,
                 tp: int, dtype_bytes: int, keep: Any) -> None:
    """Norm statistics (float32 per row); attention's output and logsumexp."""
    x = sizes.shape(ins[0].meta["val"])
    if node.target in NORMS:
        normalized = node_arg(node, "normalized_shape", ()) \
            if node.target != aten.group_norm.default else ()
        rows: float = math.prod(x[:len(x) - len(normalized)]) if normalized else math.prod(x[:-1])
        if isinstance(layouts[0], Shard) and layouts[0].dim < len(x) - len(normalized):
            rows /= tp
        keep(f"{node.name}:stats", node, NORMS[node.target] * 4.0 * rows, False)
    else:  # q (B, H, Tq, D): the output and a float32 logsumexp per query row
        heads = local_numel(x, layouts[0], tp) / x[-1]
        keep(f"{node.name}:out", node, local_numel(x, layouts[0], tp) * dtype_bytes, False)
        keep(f"{node.name}:lse", node, heads * 4.0, False)


def _flops(node: fx.Node, ins: list[fx.Node], layouts: list[Layout], sizes: Sizes,
           tp: int) -> float:
    """Forward FLOPs of a product or an attention on this rank's local shapes."""
    local = [local_shape_at(sizes.shape(a.meta["val"]), lay, tp) for a, lay in zip(ins, layouts)]
    if node.target in ATTENTION:
        q, k = local[0], local[1]
        flops = 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]  # QK^T and PV
        causal = node_arg(node, "is_causal", False) is True
        return flops / 2 if causal else flops
    if node.target == aten.einsum.default:
        val = node.meta["val"]
        return 2.0 * math.prod(sizes.shape(val)) / tp
    if is_grouped(node):  # rows [S, k] sorted by expert, each times its expert's [k, n]
        x, w = local[0], local[1]
        return 2.0 * math.prod(x[:-1]) * w[-2] * w[-1]
    a = local[-2] if node.target in (aten.addmm.default, aten.baddbmm.default,
                                     aten.addbmm.default) else local[0]
    # the output's size from the local operands: a row-parallel product's partial output is
    # full size, its contraction local
    return 2.0 * out_numel(node, local) * a[-1]


_INPUTS: "weakref.WeakKeyDictionary[fx.GraphModule, dict[fx.Node, list[fx.Node]]]" = \
    weakref.WeakKeyDictionary()


def _inputs_of(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """Each node's tensor inputs, worked out once per program (an estimate profiles the same
    program at every tp, micro-batch and cp)."""
    out = _INPUTS.get(gm)
    if out is None or len(out) != len(gm.graph.nodes):
        out = _INPUTS[gm] = {n: tensor_inputs(n) for n in gm.graph.nodes}
    return out


def _requires_grad(gm: fx.GraphModule, plan: Plan) -> dict[str, bool]:
    params = dict(gm.named_parameters(remove_duplicate=False))
    grad: dict[str, bool] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr":
            grad[node.name] = node.target in params and params[node.target].requires_grad
        elif node.op == "placeholder":
            grad[node.name] = isinstance(val, torch.Tensor) and bool(val.requires_grad)
        elif node.op == "call_function":
            floating = any(isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or
                                                            v.dtype.is_complex)
                           for v in (val if isinstance(val, (tuple, list)) else (val,)))
            grad[node.name] = floating and any(grad.get(a.name, False)
                                               for a in _inputs_of(gm)[node])
            if node.target is operator.getitem:
                grad[node.name] = grad.get(node.args[0].name, False) and floating
    return grad


def _sides(gm: fx.GraphModule, plan: Plan) -> dict[str, str]:
    """Each node's place: in a layer, or before the first layer's first op ("first"), or
    after it ("last")."""
    order = [n.name for n in gm.graph.nodes]
    inside = [i for i, name in enumerate(order) if plan.node_layers.get(name) is not None]
    first = inside[0] if inside else len(order)
    return {name: ("layer" if plan.node_layers.get(name) is not None else
                   "first" if i < first else "last") for i, name in enumerate(order)}


def _comms(plan: Plan, nodes: dict[str, fx.Node], sizes: Sizes, dtype_bytes: int,
           side: dict[str, str], own: Optional[torch.dtype] = None) -> list[Comm]:
    out = []
    for c in plan.collectives:
        members = [nodes[name] for name in c.members if name in nodes]
        # not every member a node: the after-backward sum of replicated parameters' gradients
        if len(members) < len(c.members):
            nbytes = float(parse_size_expr(c.bytes_expr)) / 4 * dtype_bytes
        else:
            nbytes = 0.0
            for node in members:  # one, or a join's values (autotp.planner.coalesce)
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    numel = math.prod(sizes.shape(val))
                    nbytes += numel * element_bytes(val, dtype_bytes, own) if numel else 0.0
            if c.src.startswith("P(") and c.src != "P":
                nbytes *= plan.degree
        where = "layer" if c.layer is not None else side.get(c.node, "last")
        out.append(Comm(c.kind, c.phase, c.layer, float(nbytes), where))
        if plan.sequence_parallel and c.kind == "all_gather" and c.phase == "forward" and \
                c.src.startswith("S("):
            # the runtime keeps the sequence shard and gathers it again for backward
            out.append(Comm("all_gather", "backward", c.layer, float(nbytes), where))
    return out


def _params(gm: fx.GraphModule, plan: Plan, side: dict[str, str]) -> list[Param]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in plan.params:
            continue
        p = plan.params[node.target]
        sides = {side[u.name] for u in node.users}
        if p.layer is not None or "layer" in sides:
            end = "layer"
        else:
            end = "both" if sides == {"first", "last"} else (sides.pop() if sides else "last")
        out.append(Param(node.target, p.layer if end == "layer" else None, end,
                         math.prod(p.local_shape), len(p.global_shape), p.grad_sync,
                         expert=plan.ep > 1 and node.target in plan.expert_params))
    return out


def _layer_inputs(plan: Plan, nodes: dict[str, fx.Node], local_bytes: Any,
                  read_layout: Any, factors_of: Optional[dict[str, list[fx.Node]]] = None
                  ) -> dict[int, float]:
    """The activations each layer reads from outside itself (what a fully recomputed layer
    keeps): edges of the dataflow graph that enter the layer from an earlier op (a mask
    built block by block: its factors, ``factors_of``)."""
    factors_of = factors_of or {}
    graph = nx.DiGraph()
    for consumer, inputs in plan.graph.items():
        for value in inputs:
            graph.add_edge(value, consumer)
    entering: dict[str, tuple[int, float]] = {}
    for value, consumer in sorted(graph.edges, key=lambda e: plan.node_layers.get(e[1]) or 0):
        layer = plan.node_layers.get(consumer)
        src = nodes.get(value)
        if layer is None or src is None or src.op == "get_attr" or \
                plan.node_layers.get(value) == layer:
            continue
        node = nodes.get(consumer)
        if node is None or node.op != "call_function":
            continue
        if value in factors_of:
            for factor in factors_of[value]:
                if factor.name not in entering:
                    entering[factor.name] = (layer, local_bytes(
                        factor, layout_of(plan.values.get(factor.name))))
            continue
        position = tensor_inputs(node).index(src) if src in tensor_inputs(node) else 0
        if value not in entering:
            entering[value] = (layer, local_bytes(src, read_layout(src, node, position)))
    out: dict[int, float] = {}
    for layer, nbytes in entering.values():
        out[layer] = out.get(layer, 0.0) + nbytes
    return out
