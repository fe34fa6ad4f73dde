"""Attention masks evaluated block by block.

transformers builds its causal, sliding-window, padding and packed-sequence masks by
elementwise ops from vectors of positions, each lined up with the queries or with the keys,
and materializes an [s, s] tensor. Elementwise ops commute with slicing, so a block of the
mask for some queries and some keys is the same ops evaluated on those rows and columns of
the vectors. ``mask_region`` finds the ops; context parallelism's ring
(``runtime/ring.BlockMask``) builds each block it meets from them, and the estimate
(``autotp.planner.job.profile``) keeps the vectors where the mask's rows were. ``ordered``
recognizes a mask that keeps at most a causal half of the pairs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional, cast

import networkx as nx
import torch
import torch.fx as fx

from autotp.ops import node_arg
from autotp.rules.pointwise import ELEMENTWISE

aten = torch.ops.aten


@dataclass(frozen=True)
class MaskRegion:
    """An attention mask written as elementwise ops of operands each lined up with the
    queries or with the keys (transformers builds its causal, sliding-window, padding and
    packed-sequence masks so, from position vectors): ``nodes`` in the graph's order, the
    mask last, and ``factors``, what they read from outside. Elementwise ops commute with
    slicing, so the mask's block for some queries and some keys is ``nodes`` evaluated on
    those rows and columns of the factors: the ring builds each block it meets and the
    [s/cp, s] rows are never held."""
    nodes: tuple[fx.Node, ...]
    factors: tuple[fx.Node, ...]


def attention_mask(node: fx.Node) -> Any:
    """An attention op's ``attn_mask`` argument; None for the fused kernels that take none."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or "attn_mask" not in [a.name for a in schema.arguments]:
        return None
    return node_arg(node, "attn_mask")


def mask_region(mask: Any) -> Optional[MaskRegion]:
    """The elementwise ops that make ``mask`` (an attention's ``attn_mask`` argument), back
    to the first op that is not one; None where ``mask`` is not made by one (an input)."""
    if not isinstance(mask, fx.Node) or not blockwise(mask):
        return None
    ops = _blockwise_ops(mask.graph)
    region = nx.ancestors(ops, mask) | {mask} if mask in ops else {mask}
    nodes = tuple(n for n in mask.graph.nodes if n in region)
    factors = tuple(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                  if a not in region))
    return MaskRegion(nodes, factors)


_ORDERS = frozenset({aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor})
_KEEPS_ALL_OF = frozenset({aten.__and__.Tensor, aten.logical_and.default,
                           aten.bitwise_and.Tensor, aten.expand.default, aten.unsqueeze.default,
                           aten.to.dtype, aten.to.dtype_layout, aten.to.device,
                           aten._to_copy.default, aten.alias.default, aten.clone.default,
                           aten.contiguous.default, aten.slice.Tensor})


def ordered(region: MaskRegion) -> bool:
    """Whether the mask keeps only pairs that one order comparison of a query-side and a
    key-side operand keeps (each operand broadcast along the other side): a boolean
    comparison joined into the mask by conjunctions alone. Where the operands are positions,
    as in transformers' causal and sliding-window masks, that is at most the causal half of
    the pairs, and the ring skips the chunk pairs it hides."""
    def sides(node: fx.Node) -> bool:
        vals: list[torch.Tensor] = [
            v for v in (a.meta.get("val") for a in node.args[:2] if isinstance(a, fx.Node))
            if isinstance(v, torch.Tensor) and v.dim() >= 1]
        if len(vals) != 2:
            return False
        query = [v.dim() >= 2 and v.shape[-1] == 1 for v in vals]
        key = [v.dim() == 1 or v.shape[-2] == 1 for v in vals]
        return (query[0] and key[1]) or (query[1] and key[0])

    inside = set(region.nodes)
    joins = nx.DiGraph((a, n) for n in region.nodes if n.target in _KEEPS_ALL_OF
                       for a in n.all_input_nodes if a in inside)
    mask = region.nodes[-1]
    reached = nx.ancestors(joins, mask) | {mask} if mask in joins else {mask}
    return any(n.target in _ORDERS and sides(n) for n in reached)


# graph -> (its node count when read, the dataflow among its blockwise ops): made once per
# graph (a model's layers all read one mask), again where nodes were added or erased since
_OPS: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, nx.DiGraph]]" = \
    weakref.WeakKeyDictionary()


def _blockwise_ops(graph: fx.Graph) -> nx.DiGraph:
    known = _OPS.get(graph)
    if known is None or known[0] != len(graph.nodes):
        ops = nx.DiGraph((a, n) for n in graph.nodes if blockwise(n)
                         for a in n.all_input_nodes if blockwise(a))
        known = _OPS[graph] = (len(graph.nodes), ops)
    return known[1]


def blockwise(node: fx.Node) -> bool:
    """Whether each element of ``node``'s value reads its operands at the same (query, key)
    index alone, the last two dims of every operand lined up with the output's: an
    elementwise op; a broadcast (``expand``); a view that adds a dim before the last two
    or slices nothing off."""
    if node.op != "call_function":
        return False
    if node.target in ELEMENTWISE or node.target == aten.expand.default:
        return True
    val, src = node.meta.get("val"), node.args[0] if node.args else None
    src_val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
        return False
    if node.target == aten.unsqueeze.default:
        return unsqueezed_dim(node) <= val.dim() - 3
    if node.target in (aten.slice.Tensor, aten.alias.default):
        return [str(s) for s in val.shape] == [str(s) for s in src_val.shape]
    return False


def unsqueezed_dim(node: fx.Node) -> int:
    """The position of the dim an ``unsqueeze`` adds, counted from the front of its result."""
    dim = int(cast(int, node.args[1]))
    return dim if dim >= 0 else dim + node.meta["val"].dim()
