"""The normalization passes capture runs on the exported program, each exact (the program
computes the same values) and each leaving a runnable module.

In the order capture runs them (``trace.capture``), with the passes of other modules:

    inline_autocast           autocast regions spliced into the program
    drop_metadata_asserts     export's dtype/device checks dropped (no value, no use)
    unroll (repeat.py)        layers traced once stamped to the model's depth
    merge_tied_parameters     one get_attr per parameter object (a tied weight, one layout)
    out_of_place              in-place arithmetic on a fresh intermediate, out of place
    constant_index_to_slice   x[..., [k], :] with a constant index -> x[..., k:k+1, :]
    broadcast_to_as_expand    broadcast_to(x, shape) -> x.expand(shape)
    histogram_of_floats       histc of integer counts reads them as floats
    copies_as_values          copy(dst, src) -> src cast and expanded (after decompositions)
    detach_factories          x.new_zeros(size) -> zeros(size, dtype=, device=)
    drop_identities           ops that return their input (identities.py)
    split_biases              linear(x, W, b) -> linear(x, W) + b; addmm(b, x, W) -> mm + b
    sink_bias_adds            view(mm(x, W) + b) -> view(mm(x, W)) + b
    products_summed_first     sums of products regrouped, the products first (sums.py)
    decompose_cross_entropy   cross_entropy(x, t) -> logsumexp(x) - x[t], masked and reduced
    decompose_feature_norms   a norm of a projection's whole output in means and rsqrt
    decompose_feature_statistics  a variance or 2-norm of a projection's features in sums

Splitting biases lets a row-parallel product add its bias once, after the reduction; the
decompositions let a norm or a loss run on shards with a partial statistic.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from autotp.errors import TraceError
from autotp.ops import ATTENTION, PROJECTIONS, RESHAPES, node_arg, path_attr
from autotp.rules.registry import Registry

aten = torch.ops.aten


def inline_autocast(gm: fx.GraphModule) -> None:
    """An autocast region (``with torch.autocast(...)``, a ``@disable_autocast`` function),
    which torch.export wraps whole in one higher-order op, -> its body spliced into the
    program between ``_enter_autocast`` and ``_exit_autocast``. The rules then see the body's
    ops one by one (its casts are pointwise ops like any other), and the rank program still
    runs the body under the same autocast state, whatever device it runs on."""
    try:
        from torch._higher_order_ops.wrap import wrap_with_autocast  # optional: private API
    except ImportError:  # pragma: no cover - older torch
        return
    # a region inside a region is spliced in with its parent's body, then in its turn
    regions = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.target is wrap_with_autocast]
    while regions:
        node = regions.pop(0)
        device_type, dtype, enabled, cache_enabled, body_node, *operands = node.args
        body = path_attr(gm, body_node.target)
        graph = gm.graph
        with graph.inserting_before(node):
            state = graph.call_function(torch.amp._enter_autocast,
                                        (device_type, dtype, enabled, cache_enabled))
            env: dict[fx.Node, Any] = {}
            inputs = iter(operands)
            results: tuple[Any, ...] = ()
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(inputs)
                elif inner.op == "output":
                    results = fx.map_arg(inner.args[0], env.__getitem__)
                elif inner.op == "get_attr":  # a nested region's body
                    name = f"{body_node.target}_{inner.target}"
                    setattr(gm, name, path_attr(body, inner.target))
                    env[inner] = graph.get_attr(name)
                else:
                    env[inner] = graph.node_copy(inner, env.__getitem__)
                    if inner.op == "call_function" and inner.target is wrap_with_autocast:
                        regions.append(env[inner])
            graph.call_function(torch.amp._exit_autocast, (state,))
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise TraceError(f"autotp cannot read the result of {node.format_node()}")
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            if not any(n.op == "get_attr" and n.target == body_node.target
                       for n in graph.nodes):
                delattr(gm, body_node.target)
    assert not any(n.target is wrap_with_autocast for n in gm.graph.nodes), \
        "an autocast region is left whole"
    gm.graph.lint()
    gm.recompile()


def broadcast_to_as_expand(gm: fx.GraphModule) -> None:
    """``torch.broadcast_to(x, shape)`` is ``x.expand(shape)`` (Falcon's grouped k/v heads
    broadcast over the query heads of their group): one op for the rules, the rewriter's
    size localization and the saved-tensor and kernel tables."""
    for node in gm.graph.nodes:
        if node.target == aten.broadcast_to.default:
            node.target = aten.expand.default
    gm.recompile()


def histogram_of_floats(gm: fx.GraphModule) -> None:
    """``histc`` of integers (the experts' row counts, traced where the library picks the
    integer form: CUDA, the meta device) counts their float values: the CPU kernel takes only
    floats, and ids below 2**24 fall in the same bins."""
    for node in list(gm.graph.nodes):
        val = node.args[0].meta.get("val") if node.target == aten.histc.default else None
        if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
            with gm.graph.inserting_before(node):
                cast = _emit(gm.graph, node, aten._to_copy.default, node.args[0])
                cast.kwargs = {"dtype": torch.float32}
                cast.meta["val"] = _fake_run(aten._to_copy.default, (node.args[0],)).float()
            node.args = (cast, *node.args[1:])
    gm.recompile()


def constant_index_to_slice(gm: fx.GraphModule) -> None:
    """``x[..., [k], :]`` (``index.Tensor`` with one constant one-element index, Falcon's
    multi-query k/v head) is ``x[..., k:k+1, :]``: the same values, as a slice, which the
    view rules map through shards (an index tensor's value is not part of an op's algebra)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target != aten.index.Tensor:
            continue
        x, indices = node.args[0], node.args[1]
        given = [(d, i) for d, i in enumerate(indices) if i is not None]
        if len(given) != 1 or not isinstance(x, fx.Node):
            continue
        dim, index = given[0]
        value = _constant(gm, index)
        shape = x.meta["val"].shape
        if value is None or value.numel() != 1 or value.dim() != 1 or \
                not isinstance(shape[dim], int) or value.dtype not in (torch.int64, torch.int32):
            continue
        k = int(value.item())
        if not -shape[dim] <= k < shape[dim]:
            continue  # out of range: left to fail as the model does
        k %= shape[dim]
        with gm.graph.inserting_before(node):
            sliced = gm.graph.call_function(aten.slice.Tensor, (x, dim, k, k + 1))
        sliced.meta.update(node.meta)
        node.replace_all_uses_with(sliced)
        for user in sliced.users:  # index copied; the slice is a view that may not be flat
            if user.target == aten.view.default:
                user.target = aten.reshape.default
        gm.graph.erase_node(node)
        while isinstance(index, fx.Node) and not index.users and index.op != "placeholder":
            source = index.args[0] if index.op == "call_function" else None
            gm.graph.erase_node(index)
            index = source
        changed = True
    if changed:
        gm.recompile()


def _constant(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The value of a constant the program made (``torch.tensor([-2])``, lifted by export and
    read through ``lift_fresh_copy``); not a buffer of the model, which may change."""
    while isinstance(node, fx.Node) and node.target in (aten.detach.default,
                                                       aten.detach_.default):
        node = node.args[0]  # an index made on the CPU while traced on meta is detached
    if not isinstance(node, fx.Node) or node.target != aten.lift_fresh_copy.default:
        return None
    node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = path_attr(gm, str(node.target), None)
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or \
            isinstance(value, torch.nn.Parameter):
        return None
    return value


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """torch.export's ``_assert_tensor_metadata`` (a dtype/device check of the traced run,
    no value) is dropped: it would be a use of the tensor it checks, and a parameter's first
    use is where the planner fixes the parameter's layout."""
    for node in list(gm.graph.nodes):
        if node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def unruled_mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """In-place ops left after ``out_of_place`` that no rule computes (a KV cache's
    ``index_copy_`` has one)."""
    registry = _default_registry()
    return [node for node in gm.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.is_mutable and node.target not in registry]


def unruled_decompositions(gm: fx.GraphModule) -> dict[Any, Callable[..., Any]]:
    """Functional ops with no rule (hand-written, derived or the user's) that torch can
    decompose, each with its decomposition: capture re-runs the program through them, so
    the planner sees the ops they are made of, which have rules (``F.hardswish`` as a
    clamp and a product, ``reshape_as`` as a view)."""
    registry = _default_registry()
    table: dict[Any, Callable[..., Any]] = {}
    if any(node.target is torch.amp._enter_autocast for node in gm.graph.nodes):
        # re-tracing would lose the autocast regions' markers (their casts are the
        # program's numbers); their ops keep the fallback
        return table
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
                op in table or op._schema.is_mutable or op in registry or \
                not node.all_input_nodes:  # a factory: computed replicated as a constant
            continue
        decomposition = _decomposition(op)
        if decomposition is not None:
            table[op] = decomposition
    return table


def _decomposition(op: torch._ops.OpOverload) -> Optional[Callable[..., Any]]:
    """torch.export's own decomposition of ``op`` (its table holds the composite ops' as
    export runs them), else the op's composite kernel (``reshape_as``: a view)."""
    found = _export_decompositions().get(op)
    if found is None and torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"):
        found = op.decompose
    return found


@functools.lru_cache(maxsize=1)
def _export_decompositions() -> dict[Any, Callable[..., Any]]:
    return dict(torch.export.default_decompositions().items())


@functools.lru_cache(maxsize=1)
def _default_registry() -> Any:
    return Registry.default()


def merge_tied_parameters(gm: fx.GraphModule) -> None:
    """One get_attr node per parameter object: a tied weight gets one layout, one shard."""
    graph = gm.graph
    canonical: dict[int, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        tensor = path_attr(gm, node.target)
        if not isinstance(tensor, torch.Tensor):
            continue
        first = canonical.setdefault(id(tensor), node)
        if first is not node:
            node.replace_all_uses_with(first)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def out_of_place(gm: fx.GraphModule) -> None:
    """In-place arithmetic on a fresh intermediate (``h += residual``, ``w /= w.sum()``) ->
    its out-of-place form, where that is exact: the tensor written owns its storage (no view,
    no input, parameter or buffer), nothing reads it after the write (later reads already
    name the in-place node), and the result keeps its dtype. Other in-place ops are left for
    the rules (a KV cache's ``index_copy_``) or refused by name."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        if not schema.name.endswith("_") or not node.args or \
                not isinstance(node.args[0], fx.Node):
            continue
        written = [a for a in schema.arguments if a.alias_info is not None and
                   a.alias_info.is_write]
        if len(written) != 1 or written[0] is not schema.arguments[0]:
            continue
        packet = getattr(torch.ops.aten, schema.name.split("::")[-1][:-1], None)
        functional = getattr(packet, node.target._overloadname, None)
        if functional is None or not _owns_storage(node.args[0]):
            continue
        target = node.args[0]
        if any(order[user] > order[node] for user in target.users if user is not node):
            continue
        val, self_val = node.meta.get("val"), target.meta.get("val")
        out = _fake_run(functional, node.args) if isinstance(val, torch.Tensor) else None
        if not isinstance(out, torch.Tensor) or not isinstance(self_val, torch.Tensor) or \
                out.dtype != self_val.dtype or out.shape != self_val.shape:
            continue
        node.target = functional
    gm.recompile()


def _owns_storage(node: fx.Node) -> bool:
    """A fresh tensor: the output of an op that returns no alias, or one output of such an
    op returning several (``topk``'s values)."""
    if node.op == "call_function" and node.target is operator.getitem and \
            isinstance(node.args[0], fx.Node):
        producer = node.args[0]
        return (producer.op == "call_function" and
                isinstance(producer.target, torch._ops.OpOverload) and
                all(r.alias_info is None for r in producer.target._schema.returns))
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is None


_FACTORIES = {aten.new_empty.default: aten.empty.memory_format,
              aten.new_zeros.default: aten.zeros.default,
              aten.new_ones.default: aten.ones.default,
              aten.new_full.default: aten.full.default}


def detach_factories(gm: fx.GraphModule) -> None:
    """``x.new_zeros(size)`` -> ``zeros(size, dtype=, device=)``: the tensor ``x`` lends only
    its dtype and device, so the new tensor must not tie ``x``'s layout to its own (a buffer
    filled with sharded heads, beside ``x``'s sharded projection)."""
    for node in gm.graph.nodes:
        factory = _FACTORIES.get(node.target)
        val = node.meta.get("val")
        if factory is None or not isinstance(val, torch.Tensor):
            continue
        node.target = factory
        node.args = tuple(node.args[1:])
        node.kwargs = {**{k: v for k, v in node.kwargs.items() if k != "layout"},
                       "dtype": val.dtype, "device": val.device}
    gm.recompile()


def copies_as_values(gm: fx.GraphModule) -> None:
    """``copy(dst, src)`` (functionalization's form of ``dst.copy_(src)``) -> ``src``, cast
    to ``dst``'s dtype and expanded to its shape: the same value, and differentiable (ATen's
    ``copy`` has no derivative). ``dst``'s values are never read."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target != aten.copy.default:
            continue
        dst, src = node.args[:2]
        dv, sv = dst.meta["val"], src.meta["val"]
        call = functools.partial(_emit, graph, node)
        with graph.inserting_before(node):
            value = src
            if sv.dtype != dv.dtype:
                value = call(aten._to_copy.default, value)
                value.kwargs = {"dtype": dv.dtype}
                value.meta["val"] = sv.to(dv.dtype)
            if tuple(sv.shape) != tuple(dv.shape):
                sizes = [d if isinstance(d, int) else call(aten.sym_size.int, dst, i)
                         for i, d in enumerate(dv.shape)]
                value = call(aten.expand.default, value, sizes)
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def split_biases(gm: fx.GraphModule) -> None:
    """linear(x, W, b) -> linear(x, W) + b, addmm(b, x, W) -> mm(x, W) + b and
    conv(x, W, b, ...) -> conv(x, W, None, ...) + b[:, None, ...] (exact): the product alone
    may then be row-parallel, its partial sums all-reduced before the bias is added once."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        spatial = 0
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, weight, bias = node.args[:3]
            product_target, product_args = aten.linear.default, (x, weight)
        elif (node.target == aten.addmm.default and not node.kwargs
              and len(node.args) == 3):
            bias, x, weight = node.args
            product_target, product_args = aten.mm.default, (x, weight)
        elif node.target in _CONVS and not node.kwargs and len(node.args) > 2 and \
                isinstance(node.args[2], fx.Node):
            x, weight, bias = node.args[:3]
            product_target = node.target
            product_args = (x, weight, None, *node.args[3:])
            spatial = node.meta["val"].ndim - 2
        else:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(product_target, product_args)
            if spatial:  # [C] -> [C, 1, ...]: broadcast over the positions
                column = graph.call_function(aten.view.default,
                                             (bias, [-1] + [1] * spatial))
                column.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                column.meta["val"] = _fake_run(aten.view.default, (bias, [-1] + [1] * spatial))
                bias = column
            added = graph.call_function(aten.add.Tensor, (product, bias))
        for new in (product, added):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        product.meta["val"] = _fake_run(product_target, product_args)
        added.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(added)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def sink_bias_adds(gm: fx.GraphModule) -> None:
    """view(mm(x, W) + b, shape) -> view(mm(x, W), shape) + b, when the view keeps the last
    dim (exact: b broadcasts over it). Conv1D-style layers flatten [B, T, C] to [B*T, C]
    around the product; with the bias added after the view, a partial product can be
    reduce-scattered along the sequence before the bias (sequence parallelism)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target != aten.add.Tensor or len(node.users) != 1:
            continue
        product, bias = node.args[:2]
        view = next(iter(node.users))
        if not (isinstance(product, fx.Node) and isinstance(bias, fx.Node)
                and product.target in (aten.mm.default, aten.linear.default)
                and bias.op == "get_attr" and view.target in RESHAPES and view.args[0] is node):
            continue
        bval, vval = bias.meta["val"], view.meta["val"]
        if bval.ndim != 1 or vval.ndim < 1 or vval.shape[-1] != bval.shape[0] \
                or node.meta["val"].shape[-1] != bval.shape[0]:
            continue
        with graph.inserting_before(view):
            moved = graph.call_function(view.target, (product, *view.args[1:]), view.kwargs)
            added = graph.call_function(aten.add.Tensor, (moved, bias))
        for new in (moved, added):
            new.meta.update({k: v for k, v in view.meta.items() if k != "val"})
        moved.meta["val"] = _fake_run(view.target, (product, *view.args[1:]))
        added.meta["val"] = vval
        view.replace_all_uses_with(added)
        graph.erase_node(view)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def decompose_cross_entropy(gm: fx.GraphModule) -> None:
    """cross_entropy(x, t) -> logsumexp(x) - x[t], masked and reduced (exact).

    With the loss written as a reduction and a lookup, the planner can keep the logits
    sharded over the classes: ``logsumexp`` over a sharded dim leaves a partial logsumexp
    and the lookup a partial sum, so only per-row numbers are communicated. Class weights,
    label smoothing and probability targets keep the fused op (computed replicated).
    """
    graph = gm.graph
    reductions = {0: "none", 1: "mean", 2: "sum"}
    for node in list(graph.nodes):
        if node.target != aten.cross_entropy_loss.default:
            continue
        x, target = node.args[:2]
        weight = node_arg(node, "weight")
        reduction = node_arg(node, "reduction", 1)
        ignore = node_arg(node, "ignore_index", -100)
        smoothing = node_arg(node, "label_smoothing", 0.0)
        xv, tv = x.meta["val"], target.meta["val"]
        if (weight is not None or smoothing or reduction not in reductions or xv.ndim != 2
                or tv.ndim != 1 or tv.dtype.is_floating_point):
            continue
        call = functools.partial(_emit, graph, node)
        with graph.inserting_before(node):
            lse = call(aten.logsumexp.default, x, [1], False)
            ignored = call(aten.eq.Scalar, target, ignore)
            safe = call(aten.masked_fill.Scalar, target, ignored, 0)
            column = call(aten.unsqueeze.default, safe, 1)
            picked = call(aten.squeeze.dim, call(aten.gather.default, x, 1, column), 1)
            loss = call(aten.masked_fill.Scalar, call(aten.sub.Tensor, lse, picked), ignored,
                        0.0)
            if reductions[reduction] != "none":
                loss = call(aten.sum.default, loss)
            if reductions[reduction] == "mean":
                kept = call(aten.logical_not.default, ignored)
                loss = call(aten.div.Tensor, loss, call(aten.sum.default, kept))
        node.replace_all_uses_with(loss)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


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
        call = functools.partial(_emit, graph, node)
        with graph.inserting_before(node):
            xf = call(aten._to_copy.default, x) if upcast else x
            if upcast:
                xf.kwargs = {"dtype": torch.float32}
                xf.meta["val"] = xv.float()
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
                out = call(aten._to_copy.default, out)
                out.kwargs = {"dtype": xv.dtype}
                out.meta["val"] = node.meta["val"]
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
                    out = _emit(graph, node, aten.div.Scalar, _emit(
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
        call = functools.partial(_emit, graph, node)
        with graph.inserting_before(node):
            xf = call(aten._to_copy.default, x) if upcast else x
            if upcast:
                xf.kwargs = {"dtype": torch.float32}
                xf.meta["val"] = xv.float()
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
                out = call(aten._to_copy.default, out)
                out.kwargs = {"dtype": xv.dtype}
                out.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


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


_CONVS = frozenset({aten.conv1d.default, aten.conv2d.default, aten.conv3d.default})
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


def _emit(graph: fx.Graph, template: fx.Node, op: Any, *args: Any) -> fx.Node:
    """A new call of ``op`` with ``template``'s stack/source metadata and a fake value."""
    new = graph.call_function(op, args)
    new.meta.update({k: v for k, v in template.meta.items() if k != "val"})
    new.meta["val"] = _fake_run(op, args)
    return new


def _fake_run(target: Any, args: tuple[Any, ...]) -> Any:
    flat, _ = pytree.tree_flatten(list(args))
    fake_mode = detect_fake_mode([a.meta["val"] for a in flat if isinstance(a, fx.Node)])
    real_args = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                list(args))
    assert fake_mode is not None, "the args of a pass's new node hold fake tensors"
    with fake_mode:
        return target(*real_args)
