"""Capture: an unmodified model -> a torch.fx GraphModule of ATen ops with symbolic B and T.

``torch.export.export(strict=False)`` is the tracer; its ``ep.module()`` is an ordinary
trainable GraphModule that shares the model's parameters and keeps its output structure.
Every example input is passed by keyword, so the sharded module can bind any call of the
original signature, and the model's own output containers (a dataclass it returns) are
registered with pytree while it is traced (``autotp.capture.outputs``). The normalization passes
that follow, each exact, are listed in
``autotp.capture.passes``; this module holds the export driver (examples, dynamic shapes,
branches the trace cannot decide) and the graph facts the later stages read (a node's
source line, module, tensor inputs and op call; its layer is ``autotp.capture.blocks``'s).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import logging
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import sympy
import torch
import torch.fx as fx
from torch.export import Dim
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autotp.capture.passes import (broadcast_to_as_expand, constant_index_to_slice,
                                   copies_as_values,
                                   decompose_cross_entropy,
                                   detach_factories, drop_metadata_asserts,
                                   histogram_of_floats, inline_autocast,
                                   merge_tied_parameters, out_of_place, sink_bias_adds,
                                   split_biases, unruled_decompositions, unruled_mutations)
from autotp.progress import staged
from autotp.ops import path_attr
from autotp.capture.branches import (Taken, branches_taken, data_dependent,
                                     decided_size_comparisons, example_branches,
                                     size_comparison_as_bool, ways_forward)
from autotp.capture.blocks import Layers, find_layers
from autotp.capture.identities import drop_identities
from autotp.capture.outputs import registered_outputs
from autotp.capture.sums import products_summed_first
from autotp.capture.repeat import Mismatch, Stack, every_layer, find_stacks, truncated, unroll
from autotp.capture.shared_buffers import merge_shared_buffers, name_shared_buffers
from autotp.capture.traceable import traceable_calls
from autotp.capture.feature_norms import decompose_feature_norms, decompose_feature_statistics
from autotp.capture.op_calls import (  # noqa: F401 (re-exported)
    is_tensor_node, make_call, size_expr, tensor_inputs, tensor_meta)
from autotp.errors import ConfigError, TraceError

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
    # traced at the example's sizes only (no symbolic batch or sequence would trace)
    fixed_sizes: bool = False
    # the repeated blocks' calls, each node labelled with its own (capture.blocks)
    layers: Layers = field(default_factory=Layers)
    # the batch of the caller's example (the commonest dim 0 of its tensors; a batch of 1 is
    # traced at 2): what a plan that splits the batch checks its divisibility on
    example_batch: Optional[int] = None


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
    dims0 = _leading_sizes(kwargs)
    batch = _commonest(dims0) if one_batch else None
    if batch is None or batch == 1 or dims0.count(batch) < 2:
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


# the last attempt's spec: every size as the example has it (torch.export's dynamic_shapes=None)
_FIXED: Any = object()


def _sizes_may_be_why(exc: BaseException) -> bool:
    """Whether a trace with symbolic sizes may have failed for want of plain ints (a size
    hashed, as ``functools.lru_cache`` does): not a branch on a tensor's value, nor a
    comparison of sizes, each of which has its own ways forward."""
    return not data_dependent(exc) and not size_comparison_as_bool(exc)


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


@staged("tracing with torch.export")
def capture(
    model: torch.nn.Module,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    dynamic_shapes: Optional[dict[str, Any]] = None,
    layers_once: bool = True,
) -> Captured:
    """``dynamic_shapes`` (torch.export's, by input name) replaces the default: dims 0 and 1
    of every tensor input symbolic. ``layers_once``: a list of identical layers is traced
    in part and the rest stamped from it (``autotp.capture.repeat``)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    tracer = _Tracer(model, example_args, example_kwargs, dynamic_shapes)
    stacks = find_stacks(model) if layers_once and not every_layer() else []
    gm = None
    if stacks:
        try:  # the repeated layers traced a few times, the rest stamped from them
            gm = tracer.export(stacks)
        except Exception as exc:  # noqa: BLE001 - what fails cut short is retried whole
            _log.info("tracing every layer of %s: %s: %s", type(model).__name__,
                      type(exc).__name__, exc)
            gm, stacks = None, []
    if gm is None:
        gm = tracer.export([])
    with _recompiled_once(gm):
        detach_factories(gm)
        drop_identities(gm)
        split_biases(gm)
        sink_bias_adds(gm)
        products_summed_first(gm)
        decompose_cross_entropy(gm)
        decompose_feature_norms(gm)
        decompose_feature_statistics(gm)
    gm.recompile()
    fixed, as_given = tracer.fixed, tracer.as_given
    if fixed is not None:
        warnings.warn(
            f"autotp: {type(model).__name__} is traced at the example's sizes only "
            f"({_sizes_text(as_given)}): with a symbolic batch and sequence, "
            f"{_failure_text(fixed)}\n  a call of other sizes is traced and planned again, "
            "once per size", stacklevel=3)
    captured = Captured(gm=gm, example_kwargs=as_given if fixed is not None else tracer.named,
                        signature=tracer.signature,
                        traced_layers={s.path: (s.prefix, s.length) for s in stacks},
                        fixed_sizes=fixed is not None)
    captured.layers = find_layers(gm.graph)
    captured.dim_names = _name_dims(gm)
    captured.example_batch = _commonest(_leading_sizes(as_given))
    captured.aliases = _aliases(model, gm)
    used = {id(path_attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    captured.unused = {name: p for name, p in model.named_parameters(remove_duplicate=False)
                       if id(p) not in used}
    return captured


class _Tracer:
    """One model's export: the example inputs made ready, the attempts of symbolic sizes
    (then fixed ones), and the rounds that decompose and functionalize what has no rule."""

    def __init__(self, model: torch.nn.Module, example_args: Optional[tuple[Any, ...]],
                 example_kwargs: Optional[dict[str, Any]],
                 dynamic_shapes: Optional[dict[str, Any]]):
        self.model = model
        if example_args is not None and not isinstance(example_args, tuple):
            example_args = (example_args,)
        if example_args is None and example_kwargs is None:
            named = default_example(model)
            named, signature = normalize_example(model, (), named)
        else:
            named, signature = normalize_example(model, example_args or (),
                                                 example_kwargs or {})
        # Fresh contiguous copies: an example that is a view, or two inputs that are one
        # tensor, would otherwise become stride and aliasing guards of the traced program.
        named = pytree.tree_map(
            lambda v: v.detach().clone(memory_format=torch.contiguous_format)
            if isinstance(v, torch.Tensor) else v, named)
        self.meta = any(p.device.type == "meta" for p in model.parameters())
        if self.meta:  # a model without weights traces with inputs (and buffers) on meta too
            named = pytree.tree_map(
                lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, named)
        self.as_given = named  # the sizes a program of fixed sizes takes: the caller's
        if dynamic_shapes is None:
            named = _batch_of_two(named)
        self.named, self.signature = named, signature
        # One batch symbol for all inputs; where the program treats them apart (an input of
        # the batch's size that is not batched), each its own; last, the example's sizes
        # fixed (a forward that hashes a size: ``functools.lru_cache`` on the sequence
        # length), the program then taking those sizes only (``Captured.fixed_sizes``).
        self.specs = [dynamic_shapes] if dynamic_shapes is not None else \
            [_dynamic_shapes(named), _dynamic_shapes(named, one_batch=False), _FIXED]
        self.fixed: Optional[BaseException] = None  # why the sizes are fixed

    def export(self, stacks: list[Stack]) -> fx.GraphModule:
        ep = self._exported(stacks)
        return self._decomposed_rounds(ep, _normalized(ep, self.model, stacks), stacks)

    def _exported(self, stacks: list[Stack]) -> torch.export.ExportedProgram:
        model, meta = self.model, self.meta
        failures: list[BaseException] = []
        for attempt, spec in enumerate(self.specs, 1):
            try:
                with _state_kept(model), \
                        _buffers_on_meta(model) if meta else contextlib.nullcontext(), \
                        _ListIndexKept() if meta else contextlib.nullcontext(), \
                        _named_forward(model, list(self.named), self.signature), \
                        registered_outputs(model), truncated(model, stacks), \
                        traceable_calls(model):
                    # each attempt on new tensor objects: a failed export leaves its dim
                    # markings on the ones it was given, and the next would read them
                    example = pytree.tree_map(
                        lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                        self.as_given if spec is _FIXED else self.named)
                    ep = _export(model, example, None if spec is _FIXED else spec,
                                 follow_example=not meta)
                self.fixed = failures[0] if spec is _FIXED else None
                return ep
            except Mismatch:  # the cut-short trace proves nothing (logged by the caller)
                raise
            except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a TraceError
                failures.append(exc)
                if attempt < len(self.specs) and (self.specs[attempt] is not _FIXED
                                                  or _sizes_may_be_why(exc)):
                    _log.info("tracing %s %s: %s: %s", type(model).__name__,
                              "with the example's sizes fixed"
                              if self.specs[attempt] is _FIXED
                              else "with a batch per input", type(exc).__name__, exc)
                    continue
                raise TraceError(_trace_failure_message(model, exc)) from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _decomposed_rounds(self, ep: torch.export.ExportedProgram, gm: fx.GraphModule,
                           stacks: list[Stack]) -> fx.GraphModule:
        """Writes through views or into inputs (a slice filled by ``copy_``) are
        functionalized, so they become ``slice_scatter``/``index_put``/``copy`` and get the
        ordinary rules; ops with no rule are replaced by their decompositions (which
        functionalizing may reveal, hence the rounds)."""
        model = self.model
        table: dict = {}
        for _ in range(4):
            more = unruled_decompositions(gm)
            mutations = unruled_mutations(gm)
            if not more and not mutations:
                break
            try:
                ep, gm = _decomposed(ep, {**table, **more}, model, stacks)
                table.update(more)
            except Mismatch:
                raise
            except Exception as exc:  # noqa: BLE001 - the ops with no rule are named later
                # a decomposition torch cannot run here: those ops stay as they are
                _log.info("decomposing %s: %s: %s", sorted(map(str, more)),
                          type(exc).__name__, exc)
                if not mutations:
                    break
                try:
                    ep, gm = _decomposed(ep, table, model, stacks)
                except Mismatch:
                    raise
                except Exception as exc:  # noqa: BLE001 - the unfunctionalized ops are named
                    raise TraceError(f"torch.export could not functionalize "
                                     f"{type(model).__name__}'s in-place ops: "
                                     f"{type(exc).__name__}: {exc}") from exc
        # after the last round: a round that only decomposes re-exports the functionalized
        # program, and its copies come back
        copies_as_values(gm)
        return gm


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
    # a no-op, where recompile() returns the new code: the passes discard it
    gm.recompile = lambda: None  # type: ignore[method-assign, assignment, return-value]
    try:
        yield
    finally:
        del gm.recompile


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
    take it, checked at run time (``autotp.capture.branches``; with real weights only)."""
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
    import autotp.planner  # layer: the top package and the planner import this module
    import autotp.rules  # layer: binds the top package, as above

    return tuple(os.path.dirname(os.path.realpath(m.__file__ or "")) + os.sep
                 for m in (torch, autotp, autotp.planner, autotp.rules))


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    """A frame of torch or of autotp itself (its package folders, whatever the checkout's
    folder is called), not of the user's model."""
    path = os.path.realpath(filename)
    return any(path.startswith(root) for root in _library_roots())


def _trace_failure_message(model: torch.nn.Module, exc: BaseException) -> str:
    return f"torch.export could not trace {type(model).__name__}: {_failure_text(exc)}" + \
        ways_forward(exc)


def _failure_text(exc: BaseException) -> str:
    """``TypeError: unhashable type: non-nested SymInt`` and, on the next line, the
    innermost line of the user's code it was raised from."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _library_file(f.filename)]
    text = f"{type(exc).__name__}: "
    text += str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if user:
        frame = user[-1]
        text += f"\n  at {frame.filename}:{frame.lineno}: {frame.line}"
    return text


def _sizes_text(named: dict[str, Any]) -> str:
    """``input_ids [1, 16], mask [1, 16]``: each tensor input's sizes."""
    return ", ".join(f"{name} {list(value.shape)}" for name, value in named.items()
                     if isinstance(value, torch.Tensor))


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


def _leading_sizes(named: dict[str, Any]) -> list[int]:
    """Dim 0 of every tensor input that has one."""
    return [int(v.shape[0]) for v in pytree.tree_leaves(named)
            if isinstance(v, torch.Tensor) and v.dim()]


def _commonest(sizes: list[int]) -> Optional[int]:
    return max(set(sizes), key=sizes.count) if sizes else None


def batch_symbols(dim_names: dict[sympy.Symbol, str]) -> frozenset:
    """The symbols of the batch dims (dim 0 of the inputs)."""
    return frozenset(sym for sym, name in dim_names.items() if name.startswith("B"))


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


def _decomposed(ep: Any, table: dict, model: torch.nn.Module,
                stacks: list) -> tuple[Any, fx.GraphModule]:
    """``ep`` run through ``table``'s decompositions and functionalized, and its graph (a
    buffer shared by several modules one input while it is: ``autotp.capture.shared_buffers``)."""
    ep = merge_shared_buffers(ep).run_decompositions(table)
    gm = _normalized(ep, model, stacks)
    name_shared_buffers(gm, model)
    return ep, gm


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
