"""Peephole fusions of a rank's rewritten program: the same math in fewer passes and buffers.

They run after the collectives are in place and change no value and no collective; they only
replace a few op patterns by one kernel-level function with a hand-written backward.

* ``logsumexp(x, d)`` and ``gather(x, d, i)`` of the same ``x`` (a cross-entropy: the
  logsumexp of the logits and the target logit, over the vocabulary shard) become one
  function whose backward writes ``exp(x - lse) * g`` into a single buffer and adds the
  target-logit gradient into it in place, instead of three or four logits-sized temporaries.
* ``linear(x, W) + b`` -> ``linear(x, W, b)`` and ``mm(x, W) + b`` -> ``addmm(b, x, W)`` (also
  through a view that keeps the last dim), where capture had split the bias off and the plan
  put no collective between product and bias: the original fused kernel again.
* ``x[:, a:b]`` where the range is the whole dim (``slice(x, d, 0, MAX)``, what export
  writes for ``:``) -> ``x``: eager indexing skips such slices; kept, each would cost a
  view in forward and a zero-filled copy of the gradient (``slice_backward``) in backward.
* (inference programs only) attention on k/v heads repeated to the query heads
  (``reshape(expand(k[:, :, None]))``, transformers' ``repeat_kv`` when a mask is given) ->
  ``scaled_dot_product_attention(..., enable_gqa=True)`` on the k/v heads themselves: the
  same grouping, without copying the whole KV cache once per layer and step.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.node import Argument

from autotp.ops import RESHAPES, arg_node, arg_seq, argument, node_arg
from autotp.runtime.causal import SDPA_CALL

aten = torch.ops.aten


class _LogsumexpAndGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, index: torch.Tensor,
                keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(x, dim, keepdim=True)
        picked = x.gather(dim, index)
        ctx.save_for_backward(x, lse, index)
        ctx.dim, ctx.keepdim = dim, keepdim
        return (lse if keepdim else lse.squeeze(dim)), picked

    @staticmethod
    def backward(ctx: Any, g_lse: Optional[torch.Tensor],
                 g_picked: Optional[torch.Tensor]) -> tuple[Any, None, None, None]:
        x, lse, index = ctx.saved_tensors
        dim = ctx.dim
        if g_lse is not None:
            grad = torch.sub(x, lse).exp_()
            grad.mul_(g_lse if ctx.keepdim else g_lse.unsqueeze(dim))
        else:
            grad = torch.zeros_like(x)
        if g_picked is not None:
            grad.scatter_add_(dim, index, g_picked)
        return grad, None, None, None


def logsumexp_and_gather(x: torch.Tensor, dim: int, index: torch.Tensor,
                         keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _LogsumexpAndGather.apply(x, dim, index, keepdim)


def _single_dim(node: fx.Node) -> Optional[int]:
    dims = node_arg(node, "dim")
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return None
    ndim = arg_node(node, 0).meta["val"].ndim
    return dims[0] + ndim if dims[0] < 0 else dims[0]


def fuse_logsumexp_gather(graph: fx.Graph) -> dict[str, str]:
    """Fuse each logsumexp with a gather of the same tensor along the same dim; returns
    original node -> the node now holding its value."""
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.logsumexp.default:
            continue
        dim = _single_dim(node)
        x = node.args[0]
        if dim is None or not isinstance(x, fx.Node):
            continue
        keepdim = bool(node_arg(node, "keepdim", False))
        gathers = [u for u in x.users if u.op == "call_function"
                   and u.target == aten.gather.default and not u.kwargs
                   and len(u.args) == 3 and u.args[1] in (dim, dim - x.meta["val"].ndim)]
        if len(gathers) != 1:
            continue
        gather = gathers[0]
        index = gather.args[2]
        if not isinstance(index, fx.Node) or not _hoist_before(index, node):
            continue
        with graph.inserting_before(node):
            both = graph.call_function(logsumexp_and_gather, (x, dim, index, keepdim))
            lse = graph.call_function(operator.getitem, (both, 0))
            picked = graph.call_function(operator.getitem, (both, 1))
        both.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        lse.meta.update(node.meta)
        picked.meta.update(gather.meta)
        node.replace_all_uses_with(lse)
        gather.replace_all_uses_with(picked)
        renamed[node.name], renamed[gather.name] = lse.name, picked.name
        graph.erase_node(node)
        graph.erase_node(gather)
    return renamed


def _hoist_before(value: fx.Node, anchor: fx.Node) -> bool:
    """Move the pure ops computing ``value`` that come after ``anchor`` to just before it (in
    their order); False, moving nothing, when ``value`` depends on ``anchor`` or on a
    module call (a collective)."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    late: list[fx.Node] = []
    stack, seen = [value], set()
    while stack:
        n = stack.pop()
        if n in seen or order[n] < order[anchor]:
            continue
        seen.add(n)
        if n is anchor or n.op != "call_function":
            return False
        late.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        anchor.prepend(n)
    return True


def fuse_bias_adds(graph: fx.Graph) -> dict[str, str]:
    """Re-fuse bias adds into their product where no collective separates them."""
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.add.Tensor or node.kwargs:
            continue
        product, bias = node.args[:2] if len(node.args) == 2 else (None, None)
        if not (isinstance(product, fx.Node) and isinstance(bias, fx.Node)):
            continue
        view = None
        if product.target in RESHAPES and len(product.users) == 1:
            view, product = product, product.args[0]
        if not (isinstance(product, fx.Node) and product.op == "call_function"
                and len(product.users) == 1 and _is_vector(bias)
                and _same_shape(node, view or product)):
            continue
        args: tuple[Argument, ...]
        if product.target == aten.linear.default and len(product.args) == 2:
            target, args = aten.linear.default, (*product.args, bias)
        elif product.target == aten.mm.default:
            target, args = aten.addmm.default, (bias, *product.args)
        else:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(target, args)
            fused.meta.update(product.meta)
            out = fused
            if view is not None:
                out = graph.create_node("call_function", view.target,
                                        (fused, *view.args[1:]), view.kwargs)
                out.meta.update(view.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if view is not None:
            graph.erase_node(view)
        graph.erase_node(product)
        renamed[node.name] = out.name
    return renamed


def _is_vector(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.ndim == 1


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and \
        tuple(va.shape) == tuple(vb.shape)


def full_slice(node: fx.Node) -> bool:
    """``node`` slices a whole dim: the same tensor, as a view."""
    return (node.op == "call_function" and node.target == aten.slice.Tensor
            and node_arg(node, "start", 0) in (0, None)
            and node_arg(node, "end", None) in (None, 2**63 - 1)
            and node_arg(node, "step", 1) == 1)


def drop_full_slices(graph: fx.Graph) -> dict[str, str]:
    """Read each slice of a whole dim's input instead of the slice (not where the slice is
    returned: the caller gets a view as from the eager model); returns slice -> input."""
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if not full_slice(node) or any(u.op == "output" for u in node.users):
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        renamed[node.name] = source.name
    return renamed


def _repeated_heads(node: Any) -> Optional[fx.Node]:
    """``x`` where ``node`` is ``reshape(expand(x[:, :, None], [B, H, n, S, D]), [B, H*n, S, D])``
    (full slices anywhere on the way), else None."""
    if not isinstance(node, fx.Node) or node.target != aten.reshape.default:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target != aten.expand.default or \
            len(arg_seq(expand, 1)) != 5 or len(arg_seq(node, 1)) != 4:
        return None
    inner = arg_node(expand, 0)
    while full_slice(inner):
        inner = arg_node(inner, 0)
    if inner.target != aten.unsqueeze.default or inner.args[1] != 2:
        return None
    base = arg_node(inner, 0)
    while full_slice(base):
        base = arg_node(base, 0)
    return base


def fuse_repeated_kv_attention(graph: fx.Graph) -> int:
    """sdpa(q, repeat(k), repeat(v)) -> sdpa(q, k, v, enable_gqa=True); returns the count.
    Also where the call is a module taking sdpa's arguments (``causal.SDPA_CALL``)."""
    count = 0
    sdpa = aten.scaled_dot_product_attention.default
    for node in list(graph.nodes):
        if not ((node.op == "call_function" and node.target == sdpa) or
                node.meta.get(SDPA_CALL)):
            continue
        if argument(sdpa, node.args, node.kwargs, "enable_gqa", False) or len(node.args) > 7:
            continue
        key, value = _repeated_heads(node.args[1]), _repeated_heads(node.args[2])
        if key is None or value is None:
            continue
        old = node.args[1:3]
        node.args = (node.args[0], key, value, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for dead in old:
            _erase_chain(graph, dead)
        count += 1
    return count


def _erase_chain(graph: fx.Graph, node: Argument) -> None:
    """Erase ``node`` and the producers only it read, while they have no other reader."""
    while isinstance(node, fx.Node) and not node.users and node.op == "call_function" and \
            node.target in (aten.reshape.default, aten.expand.default, aten.slice.Tensor,
                            aten.unsqueeze.default):
        producer = node.args[0]
        graph.erase_node(node)
        node = producer
