"""A graph node as the rules see it: its sizes as ints or sympy expressions of the program's
size symbols (``size_expr``), its tensors as ``TensorMeta`` and the call as an ``OpCall``."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._sympy.functions import FloorDiv

from autotp.rules.registry import OpCall, TensorMeta


def size_expr(size: Any) -> Any:
    """A size as an int or a sympy expression of the program's size symbols. A quotient is
    simplified by what the trace proved divisible (einops' ``'b (n g) d'`` at g = 8: the
    sequence a multiple of 8, so ``T // (T // 8)`` is 8)."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        if expr.has(FloorDiv, sympy.Mod) and size.node.shape_env is not None:
            expr = _simplified(size.node.shape_env, expr)
        return int(expr) if isinstance(expr, sympy.Integer) else expr
    return int(size)


_SIMPLIFIED: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()


def _simplified(shape_env: Any, expr: Any) -> Any:
    memo = _SIMPLIFIED.setdefault(shape_env, {})
    if expr not in memo:
        memo[expr] = shape_env.simplify(expr)
    return memo[expr]


def tensor_meta(val: Any, split: frozenset = frozenset()) -> Optional[TensorMeta]:
    if isinstance(val, torch.Tensor):
        shape = tuple(size_expr(s) for s in val.shape)
        return TensorMeta(shape, val.dtype, split & frozenset(shape) if split else frozenset())
    return None


def is_tensor_node(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes ``node`` reads, in flatten order (args, then kwargs)."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if is_tensor_node(a)]


def make_call(node: fx.Node, tp: int, blocks: tuple[int, ...],
              split: frozenset = frozenset()) -> OpCall:
    """The op call as the rules see it; ``split``: symbolic sizes that may be sharded."""
    def convert(arg: Any) -> Any:
        if is_tensor_node(arg):
            return tensor_meta(arg.meta["val"], split)
        return arg

    args = tuple(pytree.tree_map(convert, list(node.args)))
    kwargs = {k: pytree.tree_map(convert, v) for k, v in node.kwargs.items()}
    inputs = tuple(tensor_meta(n.meta["val"], split) for n in tensor_inputs(node))
    val = node.meta.get("val")
    output: Any
    if isinstance(val, torch.Tensor):
        output = tensor_meta(val, split)
    elif isinstance(val, (tuple, list)):
        output = tuple(tensor_meta(v, split) for v in val)
    else:
        output = None
    return OpCall(node.target, args, kwargs, inputs, output, tp, blocks)  # type: ignore[arg-type]
