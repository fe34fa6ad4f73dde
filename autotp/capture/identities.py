"""Ops that return their input unchanged are taken out of the graph.

``dropout(x, p, train=False)``, ``dropout(x, 0.0, train)``, ``x + 0``, ``x * 1`` and
``cat([x])`` compute ``x`` exactly. Left in, they hide what the rules and passes after them
read: Python's ``sum([a, b])`` starts from ``0``, and eval-mode ``nn.Dropout`` wraps each
branch's output, so a chain of products and biases (vit-pytorch's parallel blocks) looks like
a chain of opaque terms, and ``products_summed_first`` cannot add the partial products before
the biases. Only an op whose output has its input's shape and dtype is removed (``int_tensor +
0.0`` promotes, and stays), and only on a computed value: a parameter's own arithmetic
(x-transformers' ``gamma + unit_offset``) is how the rules see that parameter, and stays.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _same_as_input(node: fx.Node, source: fx.Node) -> bool:
    val, src = node.meta.get("val"), source.meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and \
        val.shape == src.shape and val.dtype == src.dtype


def _identity_of(node: fx.Node) -> "fx.Node | None":
    """The input ``node`` returns unchanged, or None."""
    if node.op == "call_function" and node.target == aten.cat.default and node.args and \
            isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 1 and \
            isinstance(node.args[0][0], fx.Node) and node.args[0][0].op != "get_attr":
        return node.args[0][0]  # a concatenation of one tensor (a look-around of no window)
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    if x.op == "get_attr":
        return None
    if node.target == aten.dropout.default:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else None)
        return x if train is False or p == 0 else None
    if node.target in (aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
        other = node.args[1]
        return x if not isinstance(other, fx.Node) and other == 0 and \
            not isinstance(other, bool) else None
    if node.target in (aten.mul.Tensor, aten.div.Tensor) and len(node.args) == 2 and \
            not node.kwargs:
        other = node.args[1]
        return x if not isinstance(other, fx.Node) and other == 1 and \
            not isinstance(other, bool) else None
    return None


def drop_identities(gm: fx.GraphModule) -> None:
    """Replace each op that returns its input unchanged by that input."""
    graph = gm.graph
    for node in list(graph.nodes):
        source = _identity_of(node)
        if source is None or not _same_as_input(node, source):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
