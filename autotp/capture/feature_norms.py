"""Norms and statistics between two matrices written out as partial sums.

A norm (or a hand-written statistic: a mean, a variance, a 2-norm) over the features a
product computed (``_projected``: reached back through what maps each feature on its own)
sits between two matrices, not on the residual stream. Its fused kernel needs the features
whole; written out in sums, each statistic over a sharded width is one number per row,
all-reduced, and both matrices stay sharded.

    decompose_feature_norms       a norm of a projection's whole output in means and rsqrt
    decompose_feature_statistics  a mean, variance, std or 2-norm of its features in sums
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from autotp.capture.passes import emit
from autotp.ops import ATTENTION, PROJECTIONS, RESHAPES, node_arg

aten = torch.ops.aten


def decompose_feature_norms(gm: fx.GraphModule) -> None:
    """``rms_norm`` / ``layer_norm`` of a projection's whole output -> the same arithmetic in
    means, products and ``rsqrt`` (exact: torch's own decomposition, upcast included).

    A q/k norm over all heads at once (``nn.RMSNorm(heads * head_dim)`` after ``to_q``:
    LTX-Video, Lumina-Next, Wan) reads the features a column-parallel q projection shards.
    The fused op needs them whole (a gather of q per layer); written out, each statistic is
    a partial sum over the local features, all-reduced as one number per token, then divided
    by the width. Sums, not means: the premium the rules put on a mean over sharded features
    keeps a residual stream's norm from sharding the stream along h, and these norms read a
    projection's own output.

    Only a norm that is the projection's sole reader (its bias add aside), normalizes the
    last dim alone and is at least half as wide as the projection's input is rewritten: a
    residual stream's norm keeps the fused kernel, and so does a low-rank down-projection
    normalized whole (MLA's q_a / kv_a latents), kept whole by design as Megatron-Core keeps
    it rather than sharded at the price of gathering its normalized output.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target not in (aten.rms_norm.default, aten.layer_norm.default):
            continue
        x, shape = node.args[:2]
        if not (isinstance(x, fx.Node) and len(shape) == 1 and len(_value_readers(x)) == 1
                and _projected(x)):
            continue
        xv = x.meta["val"]
        rms = node.target == aten.rms_norm.default
        weight = node_arg(node, "weight")
        bias = None if rms else node_arg(node, "bias")
        eps = node_arg(node, "eps") if rms else node_arg(node, "eps", 1e-5)
        upcast = xv.dtype in (torch.float16, torch.bfloat16)
        if eps is None:  # rms_norm's default: its computation dtype's epsilon
            eps = torch.finfo(torch.float32 if upcast else xv.dtype).eps
        call = functools.partial(emit, graph, node)
        with graph.inserting_before(node):
            xf = _cast(call, x, torch.float32, xv.float()) if upcast else x
            centred = xf if rms else call(aten.sub.Tensor, xf, _feature_mean(call, xf))
            square = call(aten.mul.Tensor, centred, centred)
            rstd = call(aten.rsqrt.default,
                        call(aten.add.Scalar, _feature_mean(call, square), eps))
            out = call(aten.mul.Tensor, centred, rstd)
            if weight is not None:
                out = call(aten.mul.Tensor, out, weight)
            if bias is not None:
                out = call(aten.add.Tensor, out, bias)
            if upcast:
                out = _cast(call, out, xv.dtype, node.meta["val"])
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


# statistics over a dim, and what they are in sums
_STATISTICS = frozenset({aten.var.correction, aten.var.dim, aten.std.correction, aten.std.dim,
                         aten.linalg_vector_norm.default, aten.mean.dim})


def decompose_feature_statistics(gm: fx.GraphModule) -> None:
    """A mean, variance, standard deviation or 2-norm over the last dim of a projection's
    features (a norm written by hand between two matrices: ``torch.var`` and ``torch.mean``,
    ``F.normalize``) -> the same in sums, which the rules shard as partial sums (sums, not
    means, as in ``decompose_feature_norms``):

        mean(x) = sum(x) / n
        var(x)  = sum((x - sum(x) / n)^2) / (n - correction)
        std(x)  = sqrt(var(x))
        |x|_2   = sqrt(sum(x * x))

    Each sum over a sharded width is one number per row all-reduced, where the statistic's
    own kernel needs the width whole (a gather of the activation, or both matrices whole).
    Half-precision inputs are summed in float32, as torch's kernels accumulate. Only a
    statistic over the last dim alone of a projection's features (``_projected``) is written
    out: a residual stream's keeps its kernel."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target not in _STATISTICS or not isinstance(node.args[0], fx.Node):
            continue
        x = node.args[0]
        xv = x.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not xv.dtype.is_floating_point or \
                not isinstance(xv.shape[-1], int) or not _projected(x):
            continue
        dims = node_arg(node, "dim")
        dims = [dims] if isinstance(dims, int) else list(dims or ())
        if [d % xv.ndim for d in dims] != [xv.ndim - 1]:
            continue
        if node.target == aten.mean.dim:
            if node_arg(node, "dtype") is None:
                with graph.inserting_before(node):
                    out = emit(graph, node, aten.div.Scalar, emit(
                        graph, node, aten.sum.dim_IntList, x, [-1],
                        bool(node_arg(node, "keepdim", False))), xv.shape[-1])
                node.replace_all_uses_with(out)
                graph.erase_node(node)
            continue
        norm = node.target == aten.linalg_vector_norm.default
        if norm and (node_arg(node, "ord", 2) != 2 or node_arg(node, "dtype") is not None):
            continue
        keepdim = bool(node_arg(node, "keepdim", False))
        width = xv.shape[-1]
        if node.target in (aten.var.dim, aten.std.dim):
            correction = 1 if node_arg(node, "unbiased", True) else 0
        elif not norm:
            correction = node_arg(node, "correction")
            correction = 1 if correction is None else correction
        upcast = xv.dtype in (torch.float16, torch.bfloat16)
        call = functools.partial(emit, graph, node)
        with graph.inserting_before(node):
            xf = _cast(call, x, torch.float32, xv.float()) if upcast else x
            if norm:
                centred, divisor = xf, 1
            else:
                centred, divisor = call(aten.sub.Tensor, xf, _feature_mean(call, xf)), \
                    width - correction
            out = call(aten.sum.dim_IntList, call(aten.mul.Tensor, centred, centred), [-1],
                       keepdim)
            if divisor != 1:
                out = call(aten.div.Scalar, out, divisor)
            if node.target != aten.var.correction and node.target != aten.var.dim:
                out = call(aten.sqrt.default, out)
            if upcast:
                out = _cast(call, out, xv.dtype, node.meta["val"])
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _cast(call: Callable[..., fx.Node], t: fx.Node, dtype: torch.dtype, val: Any) -> fx.Node:
    """``t.to(dtype)`` as a node, its fake value ``val``."""
    out = call(aten._to_copy.default, t)
    out.kwargs = {"dtype": dtype}
    out.meta["val"] = val
    return out


def _feature_mean(call: Callable[..., fx.Node], t: fx.Node) -> fx.Node:
    """sum(t, -1, keepdim) / width: a mean the rules shard as a partial sum."""
    total = call(aten.sum.dim_IntList, t, [-1], True)
    return call(aten.div.Scalar, total, t.meta["val"].shape[-1])


def _projected(x: fx.Node, depth: int = 8) -> bool:
    """``x`` holds features a product computed: a product's output at least half as wide as
    its input, or attention's heads merged, reached back through what maps each feature on
    its own (a bias add of a parameter the product alone reads, an activation, a cast, a
    gate of two such values, a reshape or transpose that keeps the feature order). A norm
    there sits between two matrices (NormFormer's and sub-LN's FFN and attention-output
    norms), not on the residual stream, which an add of two streams makes."""
    if depth == 0:
        return False
    if x.target in ATTENTION or _weighs_values(x):
        return True
    if x.target is operator.getitem and isinstance(x.args[0], fx.Node) and \
            x.args[0].target in _SPLITS and isinstance(x.args[0].args[0], fx.Node):
        whole = x.args[0].args[0]  # a part of a fused projection (gMLP's gate half)
        return len(_value_readers(whole)) == 1 and _projected(whole, depth - 1)
    if x.target in PROJECTIONS and isinstance(x.args[0], fx.Node):
        width, reads = x.meta["val"].shape[-1], x.args[0].meta["val"].shape[-1]
        return isinstance(width, int) and isinstance(reads, int) and 2 * width >= reads
    if x.target == aten.add.Tensor:
        product, bias = x.args[:2]
        return isinstance(product, fx.Node) and isinstance(bias, fx.Node) and \
            bias.op == "get_attr" and len(_value_readers(product)) == 1 and \
            _projected(product, depth - 1)
    sources = [a for a in x.all_input_nodes
               if a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)]
    if x.target in _CAST_LIKE:  # the second tensor gives its dtype only
        sources = sources[:1]
    if not sources or any(len(_value_readers(a)) != 1 for a in sources):
        return False
    if x.target == aten.mul.Tensor and len(sources) == 2:  # a gate: act(x W) * (x V)
        return all(_projected(a, depth - 1) for a in sources)
    if len(sources) == 1 and (_maps_each_feature(x.target) or x.target in _MERGES_HEADS):
        return _projected(sources[0], depth - 1)
    return False


_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})


def _weighs_values(x: fx.Node) -> bool:
    """Attention written out: a batched product of two computed values (``probs @ v``,
    heads in the batch dims), neither a parameter."""
    if x.target not in (aten.bmm.default, aten.matmul.default):
        return False
    operands = [a for a in x.args[:2] if isinstance(a, fx.Node)]
    return len(operands) == 2 and all(a.op != "get_attr" and a.meta["val"].ndim >= 3
                                      for a in operands)


# views that keep features in order: attention's [B, H, T, D] -> [B, T, H * D]
_MERGES_HEADS = frozenset({aten.transpose.int, aten.permute.default, aten.clone.default,
                           aten.contiguous.default, *RESHAPES})


_CAST_LIKE = frozenset({aten.type_as.default, aten.to.other})
_CASTS = frozenset({aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
                    aten.to.device, aten.dropout.default, *_CAST_LIKE})


def _maps_each_feature(op: Any) -> bool:
    """An elementwise map of one tensor (an activation, a cast, dropout in eval)."""
    return torch.Tag.pointwise in getattr(op, "tags", ()) or op in _CASTS


def _value_readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s values, not only its shape or dtype (``x.size(1)``,
    ``y.type_as(x)``)."""
    return [u for u in node.users
            if u.target not in (aten.sym_size.int, aten.sym_numel.default)
            and not (u.target in _CAST_LIKE and u.args[0] is not node)]
