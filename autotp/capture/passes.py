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

Splitting biases lets a row-parallel product add its bias once, after the reduction; the
decompositions let a loss run on shards with a partial statistic (a norm's: feature_norms.py).
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
from autotp.ops import RESHAPES, node_arg, path_attr
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
                cast = emit(gm.graph, node, aten._to_copy.default, node.args[0])
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
        call = functools.partial(emit, graph, node)
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
        elif node.target in CONVS and not node.kwargs and len(node.args) > 2 and \
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
        call = functools.partial(emit, graph, node)
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


CONVS = frozenset({aten.conv1d.default, aten.conv2d.default, aten.conv3d.default})


def emit(graph: fx.Graph, template: fx.Node, op: Any, *args: Any) -> fx.Node:
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
