"""Capture: an unmodified model -> a torch.fx GraphModule of ATen ops with symbolic B and T.

``torch.export.export(strict=False)`` is the tracer; its ``ep.module()`` is an ordinary
trainable GraphModule that shares the model's parameters and keeps its output structure.
Two normalizations follow, both exact:

* biases are split off their products (``linear(x, W, b)`` -> ``linear(x, W) + b``,
  ``addmm(b, x, W)`` -> ``mm(x, W) + b``), so that the planner can add the bias of a
  row-parallel product once, after the reduction;
* every example input is passed by keyword, so the sharded module can bind any call of the
  original signature.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import logging
import operator
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import sympy
import torch
import torch.fx as fx
from torch.export import Dim
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autotp.ops import PROJECTIONS, RESHAPES, node_arg, path_attr
from autotp.capture.branches import (Taken, branches_taken, data_dependent,
                                     decided_size_comparisons, example_branches,
                                     size_comparison_as_bool, ways_forward)
from autotp.capture.identities import drop_identities
from autotp.capture.sums import products_summed_first
from autotp.capture.repeat import Mismatch, Stack, every_layer, find_stacks, truncated, unroll
from autotp.errors import ConfigError, TraceError
from autotp.rules.registry import OpCall, TensorMeta

aten = torch.ops.aten
_log = logging.getLogger("autotp")


@dataclass
class Captured:
    gm: fx.GraphModule
    example_kwargs: dict[str, Any]
    signature: Optional[inspect.Signature]
    # sympy symbol of the export -> readable name ("B", "T")
    dim_names: dict[sympy.Symbol, str] = field(default_factory=dict)
    # graph parameter target -> every name the original model has for it (tied weights)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    # parameters the traced forward never reads: kept, replicated, so that state dicts match
    unused: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    # list of layers -> (entries traced, entries): the rest are copies (capture.repeat)
    traced_layers: dict[str, tuple[int, int]] = field(default_factory=dict)


def is_hf_model(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "to_dict") and hasattr(model, "main_input_name")


def default_example(model: torch.nn.Module) -> dict[str, Any]:
    """A small example for a transformers model: input_ids of shape (2, 16) within the vocab."""
    if not is_hf_model(model):
        raise ConfigError(
            "autotp needs example inputs to trace this model: pass example_args=(...) "
            "and/or example_kwargs={...} with tensors of the shapes the model takes"
        )
    config = model.config
    vocab = getattr(config, "vocab_size", None)
    if model.main_input_name != "input_ids" or not vocab:
        raise ConfigError(
            f"cannot derive an example input for {type(model).__name__} (main input "
            f"{model.main_input_name!r}); pass example_args or example_kwargs"
        )
    max_pos = (getattr(config, "max_position_embeddings", None)
               or getattr(config, "n_positions", None) or 16)
    seq = max(2, min(16, int(max_pos)))
    generator = torch.Generator().manual_seed(0)
    device = _model_device(model)
    ids = torch.randint(0, int(vocab), (2, seq), generator=generator)
    return {"input_ids": ids.to(device)}


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def normalize_example(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], Optional[inspect.Signature]]:
    """Bind the example to ``model.forward``'s signature so every input is a keyword."""
    try:
        signature: Optional[inspect.Signature] = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    if signature is None:
        if args:
            raise ConfigError("cannot read the model's forward signature; pass example_kwargs")
        return dict(kwargs), None
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and args:
        raise ConfigError("forward(*args) models need their inputs as example_kwargs")
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"the example inputs do not fit {type(model).__name__}.forward: {exc}"
        ) from None
    named = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    # a transformers model traces without its KV cache; so does a wrapper that passes
    # **kwargs on to one (peft's PeftModel)
    takes_cache = "use_cache" in signature.parameters or (
        inspect.Parameter.VAR_KEYWORD in kinds
        and getattr(getattr(model, "config", None), "use_cache", None) is not None)
    if is_hf_model(model) and takes_cache and "use_cache" not in named:
        named["use_cache"] = False
    return named, signature


def _batch_of_two(named: dict[str, Any]) -> dict[str, Any]:
    """An example of batch 1 is traced at batch 2: torch.export specializes a dim of size 1
    (its 0/1 rule), and a program fixed at batch 1 plans worse (its reshapes of the batch read
    as other ops: grouped k/v heads then stay whole, with two more all-reduces backward).
    Every tensor input's dim 0 is repeated, where all of them are 1."""
    tensors = [v for v in pytree.tree_leaves(named) if isinstance(v, torch.Tensor)]
    if not tensors or any(t.dim() == 0 or t.shape[0] != 1 for t in tensors):
        return named
    return pytree.tree_map(
        lambda v: v.repeat(2, *[1] * (v.dim() - 1)) if isinstance(v, torch.Tensor) else v,
        named)


def _dynamic_shapes(kwargs: dict[str, Any], one_batch: bool = True) -> dict[str, Any]:
    """Batch and sequence (dims 0 and 1) of every tensor input are symbolic; the spec has the
    inputs' own structure (a dict holding no tensor is a dict of None, as export wants).

    ``one_batch``: the inputs whose dim 0 has the batch's size (the commonest dim 0) share
    one symbol. Left to itself, export gives each input its own batch unless the program
    ties them, and a mask that is only reshaped by the batch of another input
    (``mask.view(batch, -1, 1, T)``) gets heads of ``(heads * B') // B``, which no rule can
    shard."""
    dims0 = [v.shape[0] for v in pytree.tree_leaves(kwargs)
             if isinstance(v, torch.Tensor) and v.dim()]
    batch = max(set(dims0), key=dims0.count) if one_batch and dims0 else None
    if batch == 1 or dims0.count(batch) < 2:
        # a batch of 1 is specialized (export's 0/1 rule), and one input shares with no
        # other: a named dim only costs export its constraint solving
        batch = None
    shared = Dim("batch")

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: shared if d == 0 and value.shape[0] == batch else Dim.AUTO
                    for d in range(min(value.dim(), 2))} or None
        return None

    return {name: pytree.tree_map(spec, value) if isinstance(value, (dict, list, tuple))
            or _has_tensor(value) else None for name, value in kwargs.items()}


@contextlib.contextmanager
def _named_forward(model: torch.nn.Module, names: list[str],
                   signature: Optional[inspect.Signature]) -> Iterator[None]:
    """Inputs that ``forward(..., **kwargs)`` collects become named parameters while the
    model is exported: torch.export's dynamic shapes cannot address them under ``kwargs``
    (x-transformers' ``context=``, peft's ``PeftModel(**inputs)``). The module is the same
    object, so the program's parameter and module paths do not change."""
    var_keyword = signature is not None and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not var_keyword or "forward" in model.__dict__:
        yield
        return
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])
    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def capture(
    model: torch.nn.Module,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    dynamic_shapes: Optional[dict[str, Any]] = None,
    layers_once: bool = True,
) -> Captured:
    """``dynamic_shapes`` (torch.export's, by input name) replaces the default: dims 0 and 1
    of every tensor input symbolic. ``layers_once``: a list of identical layers is traced
    in part and the rest stamped from it (``capture.repeat``)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    if example_args is not None and not isinstance(example_args, tuple):
        example_args = (example_args,)
    if example_args is None and example_kwargs is None:
        named = default_example(model)
        named, signature = normalize_example(model, (), named)
    else:
        named, signature = normalize_example(model, example_args or (), example_kwargs or {})
    # Fresh contiguous copies: an example that is a view, or two inputs that are one tensor,
    # would otherwise become stride and aliasing guards of the traced program.
    named = pytree.tree_map(
        lambda v: v.detach().clone(memory_format=torch.contiguous_format)
        if isinstance(v, torch.Tensor) else v, named)
    if dynamic_shapes is None:
        named = _batch_of_two(named)
    meta = any(p.device.type == "meta" for p in model.parameters())
    if meta:  # a model without weights traces with inputs (and buffers) on meta too
        named = pytree.tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, named)

    # One batch symbol for all inputs; where the program treats them apart (an input of
    # the batch's size that is not batched), each its own.
    specs = [dynamic_shapes] if dynamic_shapes is not None else \
        [_dynamic_shapes(named), _dynamic_shapes(named, one_batch=False)]

    def export(stacks: list[Stack]) -> fx.GraphModule:
        for attempt, spec in enumerate(specs, 1):
            try:
                with _state_kept(model), \
                        _buffers_on_meta(model) if meta else contextlib.nullcontext(), \
                        _ListIndexKept() if meta else contextlib.nullcontext(), \
                        _named_forward(model, list(named), signature), truncated(model, stacks):
                    ep = _export(model, named, spec, follow_example=not meta)
                break
            except Mismatch:  # the cut-short trace proves nothing (logged by the caller)
                raise
            except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
                if attempt < len(specs):
                    _log.info("tracing %s with a batch per input: %s: %s",
                              type(model).__name__, type(exc).__name__, exc)
                    continue
                raise TraceError(_trace_failure_message(model, exc)) from exc
        gm = _normalized(ep, model, stacks)
        if _unruled_mutations(gm):
            # Writes through views or into inputs (a slice filled by ``copy_``):
            # functionalize the whole program, so they become ``slice_scatter``/
            # ``index_put``/``copy`` and get the ordinary rules.
            try:
                gm = _normalized(ep.run_decompositions({}), model, stacks)
            except Mismatch:
                raise
            except Exception as exc:  # noqa: BLE001 - the unfunctionalized ops are named later
                raise TraceError(f"torch.export could not functionalize "
                                 f"{type(model).__name__}'s in-place ops: "
                                 f"{type(exc).__name__}: {exc}") from exc
            copies_as_values(gm)
        return gm

    stacks = find_stacks(model) if layers_once and not every_layer() else []
    gm = None
    if stacks:
        try:  # the repeated layers traced a few times, the rest stamped from them
            gm = export(stacks)
        except Exception as exc:  # noqa: BLE001 - what fails cut short is retried whole
            _log.info("tracing every layer of %s: %s: %s", type(model).__name__,
                      type(exc).__name__, exc)
            gm, stacks = None, []
    if gm is None:
        gm = export([])
    with _recompiled_once(gm):
        detach_factories(gm)
        drop_identities(gm)
        split_biases(gm)
        sink_bias_adds(gm)
        products_summed_first(gm)
        decompose_cross_entropy(gm)
        decompose_feature_norms(gm)
    gm.recompile()
    captured = Captured(gm=gm, example_kwargs=named, signature=signature,
                        traced_layers={s.path: (s.prefix, s.length) for s in stacks})
    captured.dim_names = _name_dims(gm)
    captured.aliases = _aliases(model, gm)
    used = {id(path_attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    captured.unused = {name: p for name, p in model.named_parameters(remove_duplicate=False)
                       if id(p) not in used}
    return captured


def _normalized(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                stacks: list[Stack]) -> fx.GraphModule:
    gm = ep.module()
    with _recompiled_once(gm):
        inline_autocast(gm)
        drop_metadata_asserts(gm)
        unroll(gm, model, stacks)
        merge_tied_parameters(gm)
        out_of_place(gm)
        constant_index_to_slice(gm)
        broadcast_to_as_expand(gm)
        histogram_of_floats(gm)
    return gm


@contextlib.contextmanager
def _recompiled_once(gm: fx.GraphModule) -> Iterator[None]:
    """Passes end in ``gm.recompile()`` so that each leaves a runnable module; inside, they
    skip it, and capture recompiles once after the last (generating the code of
    LLaMA-2-70B's 6,000 nodes takes a third of a second)."""
    gm.recompile = lambda: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del gm.recompile


def inline_autocast(gm: fx.GraphModule) -> None:
    """An autocast region (``with torch.autocast(...)``, a ``@disable_autocast`` function),
    which torch.export wraps whole in one higher-order op, -> its body spliced into the
    program between ``_enter_autocast`` and ``_exit_autocast``. The rules then see the body's
    ops one by one (its casts are pointwise ops like any other), and the rank program still
    runs the body under the same autocast state, whatever device it runs on."""
    try:
        from torch._higher_order_ops.wrap import wrap_with_autocast
    except ImportError:  # pragma: no cover - older torch
        return
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_autocast:
            continue
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
    value = path_attr(gm, node.target, None)
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


def _unruled_mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """In-place ops left after ``out_of_place`` that no rule computes (a KV cache's
    ``index_copy_`` has one)."""
    registry = _default_registry()
    return [node for node in gm.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target._schema.is_mutable and node.target not in registry]


@functools.lru_cache(maxsize=1)
def _default_registry() -> Any:
    from autotp.rules.registry import Registry

    return Registry.default()


class _ListIndexKept(TorchFunctionMode):
    """Traced on meta, ``x[..., [-2], :]`` would make its index tensor on meta, holding no
    value; this makes it on the CPU (from the same list, so the same index), where export
    keeps it as a constant with its value and ``constant_index_to_slice`` can read it."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = args[1]
            args = (args[0], tuple(_on_cpu(i) for i in index) if isinstance(index, tuple)
                    else _on_cpu(index))
        return func(*args, **(kwargs or {}))


def _on_cpu(index: Any) -> Any:
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return torch.tensor(index)
    return index


def _export(model: torch.nn.Module, named: dict[str, Any], spec: Any,
            follow_example: bool) -> Any:
    """torch.export, non-strict, and again where the model's forward takes a branch the trace
    cannot decide but autotp can, exactly: a comparison of sizes that every traced size
    answers alike (``is_causal=T > 1``); a branch on a tensor's value, as the example inputs
    take it, checked at run time (``capture.branches``; with real weights only)."""
    def export() -> Any:
        return torch.export.export(model, (), named, strict=False, dynamic_shapes=spec)

    try:
        return export()
    except TypeError as exc:
        if not size_comparison_as_bool(exc):
            raise
        with decided_size_comparisons():
            return export()
    except Exception as exc:  # noqa: BLE001 - re-raised unless the example decides it
        if not (follow_example and data_dependent(exc)):
            raise
        try:
            taken = branches_taken(lambda: model(**named))
        except Exception:  # noqa: BLE001 - the example does not run: the trace's error stands
            raise exc from None
        followed: list[Taken] = []
        with example_branches(taken, followed):
            ep = export()
        for branch in dict.fromkeys(followed):
            warnings.warn(
                f"autotp: {branch.where}: {_source_text(branch)}: a branch on a tensor's "
                f"value, traced as the example inputs take it (bool(...) is {branch.value}); "
                "an input that takes the other side is refused when it runs (an assertion "
                "at that line), never run on the traced side", stacklevel=4)
        return ep


def _source_text(branch: Taken) -> str:
    return linecache.getline(branch.filename, branch.lineno).strip()


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module) -> Iterator[None]:
    """What a forward stores on its modules while it is traced (a causal mask or positions
    cached with ``register_buffer`` on the first call, PaLM's ``pos_emb``; a rotary table and
    the length it was made for) holds the trace's fake tensors and symbolic sizes: the model
    gets back the buffers and attributes it had, so it runs eagerly, copies and plans again
    as before."""
    saved = [(module, dict(module._buffers), dict(vars(module))) for module in model.modules()]
    try:
        yield
    finally:
        for module, buffers, attributes in saved:
            module._buffers.clear()
            module._buffers.update(buffers)
            # a cache the forward filled (a rotary table and the length it was made for,
            # ESM's) holds the trace's values: every attribute gets back what it held
            for name, value in list(vars(module).items()):
                if name in attributes and attributes[name] is value:
                    continue
                if name in attributes:
                    object.__setattr__(module, name, attributes[name])
                else:
                    delattr(module, name)


@contextlib.contextmanager
def _buffers_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Real buffers of a model whose parameters are on meta (``autotp.empty_weights``) are
    traced as meta tensors, so no op mixes devices; the model keeps its real buffers."""
    saved = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type != "meta":
                saved.append((module, name, buf))
                module._buffers[name] = buf.to("meta")
    try:
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf


@functools.lru_cache(maxsize=None)
def _library_roots() -> tuple[str, ...]:
    import autotp
    from autotp import planner, rules

    return tuple(os.path.dirname(os.path.realpath(m.__file__ or "")) + os.sep
                 for m in (torch, autotp, planner, rules))


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    """A frame of torch or of autotp itself (its package folders, whatever the checkout's
    folder is called), not of the user's model."""
    path = os.path.realpath(filename)
    return any(path.startswith(root) for root in _library_roots())


def _trace_failure_message(model: torch.nn.Module, exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _library_file(f.filename)]
    text = f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: "
    text += str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if user:
        frame = user[-1]
        text += f"\n  at {frame.filename}:{frame.lineno}: {frame.line}"
    return text + ways_forward(exc)


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
    """linear(x, W, b) -> linear(x, W) + b and addmm(b, x, W) -> mm(x, W) + b (exact)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, weight, bias = node.args[:3]
            product_target, product_args = aten.linear.default, (x, weight)
        elif (node.target == aten.addmm.default and not node.kwargs
              and len(node.args) == 3):
            bias, x, weight = node.args
            product_target, product_args = aten.mm.default, (x, weight)
        else:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(product_target, product_args)
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
        if not (isinstance(x, fx.Node) and len(shape) == 1 and len(x.users) == 1
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


def _feature_mean(call: Callable[..., fx.Node], t: fx.Node) -> fx.Node:
    """sum(t, -1, keepdim) / width: a mean the rules shard as a partial sum."""
    total = call(aten.sum.dim_IntList, t, [-1], True)
    return call(aten.div.Scalar, total, t.meta["val"].shape[-1])


def _projected(x: fx.Node) -> bool:
    """``x`` is a product's output (or that plus a bias parameter the product alone reads)
    at least half as wide as the product's input."""
    if x.target == aten.add.Tensor:
        product, bias = x.args[:2]
        if not (isinstance(product, fx.Node) and isinstance(bias, fx.Node)
                and bias.op == "get_attr" and len(product.users) == 1):
            return False
        x = product
    # the products whose output features a norm may normalize: column-parallel ones shard them
    if x.target not in PROJECTIONS or not isinstance(x.args[0], fx.Node):
        return False
    width, reads = x.meta["val"].shape[-1], x.args[0].meta["val"].shape[-1]
    return isinstance(width, int) and isinstance(reads, int) and 2 * width >= reads


def _emit(graph: fx.Graph, template: fx.Node, op: Any, *args: Any) -> fx.Node:
    """A new call of ``op`` with ``template``'s stack/source metadata and a fake value."""
    new = graph.call_function(op, args)
    new.meta.update({k: v for k, v in template.meta.items() if k != "val"})
    new.meta["val"] = _fake_run(op, args)
    return new


def _fake_run(target: Any, args: tuple[Any, ...]) -> Any:
    from torch._guards import detect_fake_mode

    flat, _ = pytree.tree_flatten(list(args))
    fake_mode = detect_fake_mode([a.meta["val"] for a in flat if isinstance(a, fx.Node)])
    real_args = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                list(args))
    with fake_mode:
        return target(*real_args)


def _name_dims(gm: fx.GraphModule) -> dict[sympy.Symbol, str]:
    names: dict[sympy.Symbol, str] = {}
    readable = {0: "B", 1: "T"}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in names:
                    base = readable.get(d, f"D{d}")
                    name = base if base not in names.values() else f"{base}{len(names)}"
                    names[expr] = name
    return names


def sequence_symbols(dim_names: dict[sympy.Symbol, str]) -> frozenset:
    """The symbols of the sequence dims (dim 1 of the inputs)."""
    return frozenset(sym for sym, name in dim_names.items() if name.startswith("T"))


def _aliases(model: torch.nn.Module, gm: fx.GraphModule) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(tensor), []).append(name)
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = path_attr(gm, node.target)
            if isinstance(tensor, torch.nn.Parameter):
                out[node.target] = by_id.get(id(tensor), [node.target])
    return out


# ---- graph facts the planner and rewriter share ----------------------------------------


def size_expr(size: Any) -> Any:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if isinstance(expr, sympy.Integer) else expr
    return int(size)


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


# an entry of a module list: the first of the trailing indices, so that a list of lists
# (x-transformers' ``layers.3`` = [norm, block, residual], whose block is ``layers.3.1``)
# is labelled by its outer entry
_LAYER = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.\d+)*$")


def layer_of(node: fx.Node) -> Optional[int]:
    """The index of the repeated block (an entry of an nn.ModuleList) ``node`` belongs to.

    Used for labels only (which layer a collective belongs to), never for layout decisions.
    """
    stack = node.meta.get("nn_module_stack") or {}
    for path, cls in stack.values():
        match = _LAYER.match(str(path))
        if match and not torch_leaf(cls):
            return int(match.group("index"))
    return None


def torch_leaf(cls: Any) -> bool:
    """One of torch.nn's own layers (``nn.Linear``, ``nn.SiLU``), not a container or a
    whole block: an entry of ``nn.Sequential(nn.Linear, nn.SiLU, nn.Linear)`` (a timestep
    MLP) is no layer; an ``nn.TransformerEncoderLayer`` of ``encoder.layers`` is one."""
    name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return name.startswith("torch.nn.modules.") and not name.startswith(
        ("torch.nn.modules.container.", "torch.nn.modules.transformer."))


def source_of(node: fx.Node) -> Optional[str]:
    """``file:line`` of the model's own code that produced ``node``: the innermost frame
    outside torch and autotp (``attn_output = self.o_proj(...)``, not ``F.linear`` inside
    ``torch/nn/modules/linear.py``); the innermost frame when every frame is torch's."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return None
    own = [frame for frame in found if not _library_file(frame[0])]
    filename, line = (own or found)[-1]
    return f"{filename}:{line}"


def module_of(node: fx.Node) -> Optional[str]:
    """The path of the innermost module whose forward produced ``node``
    (``model.layers.0.self_attn.o_proj``); None for code of the top-level module."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(path) for path, _cls in stack.values()]
    return paths[-1] if paths and paths[-1] else None


def origin_of(node: fx.Node) -> str:
    """Where ``node`` comes from in the user's terms, for messages:
    ``model.layers.0.mlp.down_proj at /path/modeling_llama.py:160``."""
    module, source = module_of(node), source_of(node)
    if module and source:
        return f"{module} at {source}"
    return module or source or "unknown source"
