"""Calls in a forward that change how it runs, not what it computes, made plain while the model
is traced: torch.export cannot trace them as they are, and the program needs none of them.

    reentrant checkpointing   ``checkpoint(fn, *args)`` (``use_reentrant=True``, the old
                              default) -> ``fn(*args)``. Export records the reentrant body,
                              run under ``no_grad``, as a no-grad region, and what follows
                              it too; recomputing is a memory policy, and autotp has its own
                              (``autotp.integrations.checkpoint``). The non-reentrant form
                              traces as is.
    a module moved in place   ``module.to(device, dtype)``, ``.cpu()``, ``.cuda()`` where
                              every parameter and buffer is already there -> the module
                              (export cannot swap a parameter it traces). A move that would
                              move something runs as it is, and its error stands.

And one the trace changes that must not outlast it:

    the model's lru caches    ``functools.lru_cache`` entries a trace adds (a decay mask made
                              for a length, ``lru_cache(maxsize=1)``: a fake tensor) are
                              cleared when it ends, else the next trace lifts that fake tensor
                              as a constant and an eager call computes with it. A cache hit
                              within one trace is the same node of the program, as it is the
                              same tensor in the model.

Each is undone when the trace ends; the model's own code never changes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
import sysconfig
import weakref
from typing import Any, Callable, Iterator, Optional

import sympy
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as checkpointing


@contextlib.contextmanager
def traceable_calls(model: nn.Module) -> Iterator[None]:
    """Every replacement and cleanup of this module, while ``model`` is traced."""
    with reentrant_checkpoints_inlined(), moves_in_place_skipped(), caches_left_clean(model):
        yield


@contextlib.contextmanager
def reentrant_checkpoints_inlined() -> Iterator[None]:
    """``CheckpointFunction.apply(fn, preserve_rng_state, *args)``, which every reentrant
    checkpoint calls however ``checkpoint`` was imported, as ``fn(*args)``: the same values,
    and gradients by the same chain rule (a replay under the saved RNG state draws what the
    first run drew). Where no tensor argument requires grad, the reentrant form's outputs
    require none either (the body's parameters get no gradient through it): detached."""
    function = checkpointing.CheckpointFunction

    def apply(run: Callable[..., Any], _preserve_rng_state: bool, *args: Any) -> Any:
        out = run(*args)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return out
        return pytree.tree_map(
            lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)

    with _replaced(function, "apply", staticmethod(apply)):
        yield


@contextlib.contextmanager
def moves_in_place_skipped() -> Iterator[None]:
    """``nn.Module.to``/``cpu``/``cuda`` return the module unchanged where it is already on
    that device (and in that dtype)."""
    to, cpu, cuda = nn.Module.to, nn.Module.cpu, nn.Module.cuda

    def to_in_place(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):  # not a move: Module.to's own error
            return to(self, *args, **kwargs)
        if memory_format is None and _already_there(self, device, dtype):
            return self
        return to(self, *args, **kwargs)

    def cpu_in_place(self: nn.Module) -> nn.Module:
        return self if _already_there(self, torch.device("cpu"), None) else cpu(self)

    def cuda_in_place(self: nn.Module, device: Any = None) -> nn.Module:
        index = device.index if isinstance(device, torch.device) else device
        target = torch.device("cuda", index) if index is not None else torch.device("cuda")
        return self if _already_there(self, target, None) else cuda(self, device)

    with _replaced(nn.Module, "to", to_in_place), _replaced(nn.Module, "cpu", cpu_in_place), \
            _replaced(nn.Module, "cuda", cuda_in_place):
        yield


def _already_there(module: nn.Module, device: Optional[torch.device],
                   dtype: Optional[torch.dtype]) -> bool:
    """Whether ``module.to(device, dtype)`` would leave every tensor of it as it is: each on
    ``device`` (an index left out: the current one, as the move would take), each floating
    or complex one of ``dtype`` (the only ones ``Module.to`` converts)."""
    if device is not None and device.index is None and device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    for tensor in [*module.parameters(), *module.buffers()]:
        if device is not None and tensor.device != device:
            return False
        if dtype is not None and (tensor.is_floating_point() or tensor.is_complex()) and \
                tensor.dtype != dtype:
            return False
    return True


@contextlib.contextmanager
def _replaced(owner: type, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside; afterwards what ``owner`` itself held, or the
    inherited attribute where it held none."""
    missing = object()
    saved = vars(owner).get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


@contextlib.contextmanager
def caches_left_clean(model: nn.Module) -> Iterator[None]:
    """Every ``functools.lru_cache`` of the model's code and the libraries it uses that
    misses while the model is traced is cleared after: its new entries hold the trace's
    values."""
    loaded = (ref() for ref in _loaded_caches(len(sys.modules)))
    caches = {id(cache): cache for cache in [*loaded, *_model_caches(model)]
              if cache is not None}.values()
    before = {id(cache): cache.cache_info().misses for cache in caches}
    try:
        yield
    finally:
        for cache in caches:
            if cache.cache_info().misses != before[id(cache)]:
                cache.cache_clear()


@functools.lru_cache(maxsize=1)
def _loaded_caches(_modules: int) -> list[weakref.ref]:
    """The lru caches of the model's code and the libraries it uses that the process holds
    (not the tracer's: the standard library, torch, sympy, autotp), found again when modules
    were imported since (``_modules``: how many are loaded; most caches are made as their
    module is imported)."""
    from autotp.capture.trace import _library_file  # layer: trace imports this module

    def root(path: str) -> str:
        return os.path.realpath(path) + os.sep

    paths = sysconfig.get_paths()
    packages = (root(paths["purelib"]), root(paths["platlib"]))
    found = []
    for obj in gc.get_objects():
        if type(obj) is _LRU_CACHE:
            code = getattr(inspect.unwrap(obj), "__code__", None)
            if code is None or _library_file(code.co_filename):
                continue
            path = os.path.realpath(code.co_filename)
            if path.startswith(root(os.path.dirname(sympy.__file__))) or (
                    path.startswith(root(paths["stdlib"])) and not path.startswith(packages)):
                continue
            found.append(weakref.ref(obj))
    return found


def _model_caches(model: nn.Module) -> list[Any]:
    """The lru caches a model's modules hold as attributes, or their classes as methods."""
    modules = list(model.modules())
    classes = {cls for module in modules for cls in type(module).__mro__}
    found: dict[int, Any] = {}
    for attributes in [*map(vars, modules), *map(vars, classes)]:
        for value in attributes.values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if type(value) is _LRU_CACHE:
                found[id(value)] = value
    return list(found.values())


_LRU_CACHE = type(functools.lru_cache(maxsize=None)(lambda: None))
