"""Sums of three or more terms add the products' outputs first.

A parallel block written ``x = attn(h) + x; x = mlp(h) + x`` (litgpt's) adds the residual
stream between the two branches' outputs. Under tensor parallelism each branch's output is a
partial sum (``P``), and a replicated value added to a partial sum would be counted ``tp``
times, so each partial must be reduced on its own: two all-reduces of ``B x T x h`` where
Megatron's parallel block sums the partials first and reduces once. Addition is associative
and commutative, so

    (a + x) + b  ==  (a + b) + x

and the pass rebuilds such a chain with the terms computed by products with a weight first,
where another term of the output's shape (the residual) is in the chain. It only
regroups a chain whose inner sums nobody else reads and have the output's shape, whose terms
broadcast to it (a bias split off its product is a term too) in its dtype, and that adds with
``alpha = 1``; what the chain computes is the same sum (rounded in another order: the last
bits may differ from the unsharded model's).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from autotp.ops import PROJECTIONS, RESHAPES

aten = torch.ops.aten
_log = logging.getLogger("autotp")

# products of an activation with a weight: a row-parallel one gives a partial sum (a product
# of two activations, attention's, is sharded by heads instead, never partial)
_PRODUCTS = PROJECTIONS | {aten.addmm.default, aten.einsum.default}
_WEIGHT_VIEWS = RESHAPES | {aten.t.default, aten.transpose.int, aten.permute.default,
                            aten.contiguous.default, aten.clone.default, aten._to_copy.default}
# ops a product's output passes through and stays the product's, as the rules see it
_CARRIERS = RESHAPES | {aten.transpose.int, aten.permute.default, aten.clone.default,
                        aten.contiguous.default, aten.dropout.default, aten.flatten.using_ints,
                        aten.unflatten.int, aten.squeeze.dim, aten.unsqueeze.default,
                        aten.mul.Scalar, aten.div.Scalar, aten._to_copy.default, aten.to.dtype}


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target == aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs
            and all(isinstance(a, fx.Node) for a in node.args))


def _same(node: fx.Node, like: torch.Tensor) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.shape == like.shape and \
        val.dtype == like.dtype


def _terms(node: fx.Node, out: torch.Tensor, inner: list[fx.Node]) -> list[fx.Node]:
    """The terms of the chain that ends at ``node``, left to right."""
    terms: list[fx.Node] = []
    for arg in node.args:
        assert isinstance(arg, fx.Node)
        if _is_add(arg) and len(arg.users) == 1 and _same(arg, out):
            inner.append(arg)
            terms += _terms(arg, out, inner)
        else:
            terms.append(arg)
    return terms


def _broadcasts(node: fx.Node, out: torch.Tensor) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == out.dtype and \
        val.ndim <= out.ndim and all(a in (1, b) for a, b in zip(reversed(val.shape),
                                                               reversed(out.shape)))


def _is_weight(node: fx.Node, hops: int = 6) -> bool:
    """A parameter, or a view of one (TransformerLens' ``rearrange(W_O, "h d m -> m (h d)")
    .contiguous()``: permute, view, clone)."""
    for _ in range(hops):
        if node.op == "get_attr":
            return True
        if node.op != "call_function" or node.target not in _WEIGHT_VIEWS or \
                not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return False


def _from_product(node: fx.Node, hops: int = 6) -> bool:
    for _ in range(hops):
        if node.op != "call_function":
            return False
        if node.target in _PRODUCTS:
            operands = node.args[1] if node.target == aten.einsum.default else node.args
            return isinstance(operands, (list, tuple)) and \
                any(_is_weight(arg) for arg in operands if isinstance(arg, fx.Node))
        first = node.args[0] if node.args else None
        if node.target == aten.add.Tensor and len(node.args) == 2 and \
                isinstance(first, fx.Node) and isinstance(node.args[1], fx.Node) and \
                _is_weight(node.args[1]):
            node = first  # a product's bias, split off its linear
            continue
        if node.target not in _CARRIERS or not node.args or \
                not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return False


def _grouped(node: fx.Node, out: torch.Tensor, products: list[fx.Node]) -> bool:
    """Whether the chain already adds its products before any other term."""
    left = node.args[0]
    assert isinstance(left, fx.Node)
    inner: list[fx.Node] = []
    if left in products:
        return len(products) == 1
    return _is_add(left) and _terms(left, out, inner) == products if len(left.users) == 1 \
        else False


def products_summed_first(gm: fx.GraphModule) -> None:
    """Regroup each sum of three or more terms so its products' outputs are added first."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not _is_add(node) or node not in graph.nodes:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or any(
                _is_add(user) and _same(user, out) and len(node.users) == 1
                for user in node.users):
            continue  # not the end of its chain
        inner: list[fx.Node] = []
        terms = _terms(node, out, inner)
        if len(terms) < 3 or not all(_broadcasts(t, out) for t in terms):
            continue
        # the terms of the output's own shape computed by products, then the rest (the
        # residual, biases broadcast over it), in their order
        products = [t for t in terms if _same(t, out) and _from_product(t)]
        others = [t for t in terms if t not in products]
        ordered = products + others
        # regrouped only around a term of the output's shape that no product computes (the
        # residual stream): two products and their biases alone keep the order they have
        if len(products) < 2 or not any(_same(t, out) for t in others) or \
                _grouped(node, out, products):
            continue
        _log.debug("sum regrouped, products first: %s", node.meta.get("stack_trace", ""))
        with graph.inserting_before(node):
            total = ordered[0]
            for term in ordered[1:-1]:
                total = graph.call_function(aten.add.Tensor, (total, term))
                total.meta = {**node.meta, "val": out}
        node.args = (total, ordered[-1])
        for dead in inner:
            if not dead.users:
                graph.erase_node(dead)
    graph.lint()
    gm.recompile()

