"""autotp's vocabulary of ops and graph nodes, each fact defined once and imported by the
capture passes, the rules, the planner and the runtime alike.

Op families (sets of ATen overloads), from the narrowest:

    RESHAPES      one tensor's elements in another shape (view, reshape, _unsafe_view)
    PROJECTIONS   a matrix applied to the features of the last dim (linear, mm, matmul)
    MATMULS       PROJECTIONS, batched products (bmm) and a product with its bias (addmm)
    PRODUCTS      every op that multiplies matrices: MATMULS, baddbmm, addbmm, einsum
    ATTENTION     scaled dot-product attention and its fused kernels
    DROPOUTS      the dropouts (``train=False`` makes each the identity)
    ROW_NORMS     norms over each row's last dim -> float32 statistics they keep per row
    NORMS         ROW_NORMS and group_norm
    STATISTICS    reductions a norm is written with (mean, sum, var, std, vector norm)
    VIEWS         ops whose output shares its input's storage: they allocate nothing

Node facts: ``argument`` / ``node_arg`` read an op's argument by its schema name,
``arg_node`` / ``arg_seq`` one given by position as the node or the list it must be; ``attr``
walks a dotted attribute path (``model.layers.0.mlp.weight``). ``positive_int`` checks a
degree (tp, ep, pp, ...) given by a user.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from autotp.errors import ConfigError, where

aten = torch.ops.aten

RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
PROJECTIONS = frozenset({aten.linear.default, aten.mm.default, aten.matmul.default})
MATMULS = PROJECTIONS | {aten.bmm.default, aten.addmm.default}
PRODUCTS = MATMULS | {aten.baddbmm.default, aten.addbmm.default, aten.einsum.default}
ATTENTION = frozenset({
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
})
DROPOUTS = frozenset({aten.dropout.default, aten.native_dropout.default,
                      aten.feature_dropout.default, aten.alpha_dropout.default})
# norm -> the float32 statistics it keeps per normalized row (mean and rstd, or rstd)
ROW_NORMS = {aten.layer_norm.default: 2, aten.native_layer_norm.default: 2,
             aten.rms_norm.default: 1}
NORMS = {**ROW_NORMS, aten.group_norm.default: 2}
STATISTICS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.var.correction,
                        aten.var_mean.correction, aten.var.dim, aten.std.dim,
                        aten.std.correction, aten.linalg_vector_norm.default})
VIEWS = RESHAPES | {
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.alias.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.detach.default,
    aten.view_as_real.default, aten.view_as_complex.default, aten.unflatten.int,
    aten.as_strided.default, aten.expand_as.default, aten.view_as.default, aten.sym_size.int,
    operator.getitem, aten.flatten.using_ints, aten.lift_fresh_copy.default,
}


def argument(op: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str,
             default: Any = None) -> Any:
    """The argument of ``op(*args, **kwargs)`` that its schema calls ``name``, however it was
    passed (by position, by keyword, or left to its default). ``default`` stands for an
    argument left out whose schema default is None or absent (``pad``'s ``value=None`` means
    0). Reading by name, never by a position written in the caller, is what keeps a rule from
    reading ``ord`` as ``dim`` (``linalg_vector_norm(x, ord, dim, keepdim)``)."""
    if name in kwargs:
        return kwargs[name]
    index, spec = _schema_argument(op, name)
    if not spec.kwarg_only and index < len(args):
        return args[index]
    value = spec.default_value if spec.has_default_value() else None
    return default if value is None else value


def _schema_argument(op: Any, name: str) -> tuple[int, Any]:
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise TypeError(f"{op} has no schema to read argument {name!r} by")
    for index, spec in enumerate(schema.arguments):
        if spec.name == name:
            return index, spec
    raise KeyError(f"{schema.name} has no argument {name!r}: {schema}")


def node_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """The argument of an op call that its schema calls ``name``, however it was passed."""
    return argument(node.target, node.args, node.kwargs, name, default)


def arg_node(node: fx.Node, index: int) -> fx.Node:
    """``node.args[index]``, a node: the value (a tensor) the op reads there."""
    arg = node.args[index]
    if not isinstance(arg, fx.Node):
        raise TypeError(f"argument {index} is {arg!r}, not a node{where(node)}")
    return arg


def arg_seq(node: fx.Node, index: int) -> Sequence[Any]:
    """``node.args[index]``, a list or tuple (a shape, the dims of a reduction)."""
    arg = node.args[index]
    if not isinstance(arg, (list, tuple)):
        raise TypeError(f"argument {index} is {arg!r}, not a list or tuple{where(node)}")
    return arg


_MISSING = object()


def path_attr(root: Any, path: str, default: Any = _MISSING) -> Any:
    """``root.a.b.c`` for ``path`` "a.b.c" (a parameter's or a module's qualified name);
    ``default`` where some step is missing (without one, AttributeError)."""
    try:
        return operator.attrgetter(path)(root)
    except AttributeError:
        if default is _MISSING:
            raise
        return default


def positive_int(name: str, value: Any) -> int:
    """``value`` as a degree of parallelism: a positive int (not a bool), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def repeated_heads(value: Any) -> Optional[fx.Node]:
    """``x`` where ``value`` is ``x`` [b, h, t, d] with each head repeated g times
    (transformers' ``repeat_kv``: unsqueeze at dim 2, expand to [b, h, g, t, d], reshape to
    [b, h * g, t, d], full slices between them); None otherwise."""
    aten = torch.ops.aten

    def whole(n: fx.Node) -> bool:  # slice(x, dim, 0 or None, None or the largest int)
        start = n.args[2] if len(n.args) > 2 else None
        end = n.args[3] if len(n.args) > 3 else None
        return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2**62))

    def through_full_slices(n: Any) -> Any:
        while isinstance(n, fx.Node) and n.target == aten.slice.Tensor and whole(n):
            n = n.args[0]
        return n

    if not (isinstance(value, fx.Node) and value.target == aten.reshape.default):
        return None
    expand = value.args[0]
    if not (isinstance(expand, fx.Node) and expand.target == aten.expand.default):
        return None
    unsqueeze = through_full_slices(expand.args[0])
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target == aten.unsqueeze.default
            and unsqueeze.args[1] == 2):
        return None
    source = through_full_slices(unsqueeze.args[0])
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    return source if isinstance(val, torch.Tensor) and val.dim() == 4 else None
