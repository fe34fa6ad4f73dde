"""Which values autograd keeps for backward: the activations a plan's memory is made of.

A value costs activation memory past its last forward use only when some op that reads it
saves it for its backward. Many ops do not: a sum's backward needs no input
(d(a + b) = da + db), a view's or a copy's none, a cast's none, and a product needs only the
*other* factor (d(a * k) = k * da: the constant ``k`` is kept, not ``a``). Anything not
listed here is taken to save every input (linear, attention, norms, activations' inputs).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops whose backward reads none of their tensor inputs (linear in every input, or views)
_SAVES_NOTHING = {
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default, aten.stack.default,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.flatten.using_ints,
    aten.unflatten.int, aten.sum.dim_IntList, aten.sum.default, aten.mean.dim,
    aten.mean.default, aten.constant_pad_nd.default, aten.detach.default,
}
# ops whose backward reads their own output instead of their input (d softmax(x) = y (dy - ..))
_SAVES_OUTPUT = {
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
    aten.sigmoid.default, aten.tanh.default, aten.exp.default,
}
# binary products: an input is kept only for the gradient of another input (d(a*b) = b da + a db)
_PRODUCTS = {aten.mul.Tensor, aten.div.Tensor}


def saves_input(user: fx.Node, value: fx.Node, requires_grad: Callable[[fx.Node], bool]) -> bool:
    """Whether ``user``'s backward keeps ``value`` (one of its inputs)."""
    if user.op != "call_function" or not requires_grad(user):
        return False
    target = user.target
    if target in _SAVES_NOTHING or target in _SAVES_OUTPUT:
        return False
    if target in _PRODUCTS:
        operands = list(user.args[:2])
        mine = [i for i, a in enumerate(operands) if a is value]
        if len(mine) > 1 or (target == aten.div.Tensor and 1 in mine):
            return True  # x * x, and d(a / b)/db reads b
        return any(isinstance(a, fx.Node) and requires_grad(a)
                   for i, a in enumerate(operands) if i not in mine)
    return True


def saves_output(node: fx.Node) -> bool:
    """Whether ``node``'s backward reads its own output (softmax, sigmoid, exp...)."""
    return node.target in _SAVES_OUTPUT


def saved_values(graph: fx.Graph, requires_grad: Callable[[fx.Node], bool]) -> set[str]:
    """Names of the nodes whose value autograd keeps for backward: some reader saves it, or
    the op itself keeps its output."""
    return {node.name for node in graph.nodes
            if any(saves_input(user, node, requires_grad) for user in node.users)
            or (node.target in _SAVES_OUTPUT and requires_grad(node))}
