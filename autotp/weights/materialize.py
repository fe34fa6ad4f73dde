"""Where a rank's tensors come from: this rank's piece of every parameter, and every buffer.

The rewriter asks a ``Weights`` for each parameter the plan lays out (target, layout) and for
each buffer the program reads; it never touches the source itself. Three sources:

    ModelWeights       slices of the model's own tensors (a model built with real weights)
    CheckpointWeights  slices read from safetensors files (autotp.weights.tensorfile): a rank reads
                       only its shards, and never holds a full sharded tensor
    InitWeights        the model's own initializer run on one module's full tensors at a
                       time, keeping only the local slices

``deferred_weights()`` postpones the reads: every parameter is given as a meta tensor of its
local shape, and the caller loads the ones it keeps (a pipeline stage's) afterwards.

A model built on the meta device has no values: its buffers come from the model where they
are real (``empty_weights`` builds parameters on meta and buffers for real), from the
checkpoint, or from transformers' ``_init_weights`` of the module that owns them.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef

from autotp.errors import ConfigError
from autotp.layout import (
    Layout,
    Replicate,
    Shard,
    counted,
    segment_sizes,
    shard_tensor,
    whole_segments,
)
from autotp.weights.tensorfile import TensorFiles
from autotp.ops import path_attr

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers for real.

        with autotp.empty_weights():
            model = MyTransformer(cfg)      # no parameter memory; RoPE tables, masks computed

    Parameters are moved to meta as they are registered, before any initializer runs on
    them; buffers are computed exactly as the model computes them.
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def is_meta(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"


def has_meta_parameters(model: nn.Module) -> bool:
    return any(is_meta(p) for p in model.parameters())


def slice_ranges(global_size: int, layout: Shard, rank: int, tp: int) -> list[tuple[int, int]]:
    """The ranges of dim ``layout.dim`` that ``rank`` holds, one per block (as shard_tensor)."""
    ranges, start = [], 0
    blocks = counted(global_size, layout.blocks)
    for segment, whole in zip(segment_sizes(global_size, blocks), whole_segments(blocks)):
        piece = segment if whole else segment // tp
        first = start if whole else start + rank * piece
        ranges.append((first, first + piece))
        start += segment
    return ranges


class Weights:
    """A source of this rank's parameters and buffers, placed on ``device``."""

    def __init__(self, model: nn.Module, device: Optional[torch.device] = None):
        self.model = model
        self.device = device

    def _place(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and like.is_floating_point():
            tensor = tensor.to(like.dtype)
        device = self.device if self.device is not None else \
            (like.device if not is_meta(like) else torch.device("cpu"))
        return tensor.to(device)

    def parameter(self, target: str, names: Sequence[str], layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def buffer(self, target: str, like: torch.Tensor) -> torch.Tensor:
        """Buffers are replicated: the model's own value where it is real, else recomputed."""
        if not is_meta(like):
            return self._place(like.detach().clone(), like)
        own = model_tensor(self.model, target)
        if own is not None and not is_meta(own):
            return self._place(own.detach().clone(), like)
        value = self._stored_buffer(target, like)
        if value is None:
            value = hf_buffer(self.model, target)
        if value is None:
            raise ConfigError(
                f"buffer {target!r} of {type(self.model).__name__} is on the meta device and "
                "no checkpoint holds it, so autotp cannot compute it: build the model with "
                "`with autotp.empty_weights(): model = ...` instead of torch.device('meta') "
                "(parameters on meta, buffers computed as the model computes them), or save "
                "the buffer with the weights (register_buffer(..., persistent=True))")
        return self._place(value, like)

    def _stored_buffer(self, target: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def close(self) -> None:
        pass


class DeferredWeights(Weights):
    """``inner``'s parameters read later: ``parameter`` records the request and answers a
    meta tensor of the local shape; ``load(target)`` reads it for real. Buffers are real."""

    def __init__(self, inner: Weights):
        super().__init__(inner.model, inner.device)
        self.inner = inner
        self.requests: dict[str, tuple[Any, ...]] = {}

    def parameter(self, target: str, names: Sequence[str], layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        self.requests[target] = (names, layout, rank, tp, like)
        return shard_tensor(like.to("meta"), layout, rank, tp)

    def buffer(self, target: str, like: torch.Tensor) -> torch.Tensor:
        return self.inner.buffer(target, like)

    def load(self, target: str) -> torch.Tensor:
        return self.inner.parameter(target, *self.requests[target])

    def close(self) -> None:
        pass  # the caller closes ``inner`` once it has loaded what it keeps


_DEFERRING = threading.local()  # this thread's open deferred_weights() lists


@contextlib.contextmanager
def deferred_weights() -> Iterator[list[DeferredWeights]]:
    """Within it (on this thread), ``parallelize`` builds its program with meta parameters
    and appends its ``DeferredWeights`` to the yielded list; they are closed on exit."""
    made: list[DeferredWeights] = []
    stack = _DEFERRING.__dict__.setdefault("stack", [])
    stack.append(made)
    try:
        yield made
    finally:
        stack.remove(made)
        for weights in made:
            weights.inner.close()


def maybe_deferred(weights: Weights) -> Weights:
    """``weights``, deferred inside ``deferred_weights()``."""
    stack = getattr(_DEFERRING, "stack", None)
    if not stack:
        return weights
    deferred = DeferredWeights(weights)
    stack[-1].append(deferred)
    return deferred


def model_tensor(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The tensor at dotted path ``name`` of ``model``, or None."""
    try:
        value = path_attr(model, name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


class ModelWeights(Weights):
    """Slices of the real tensors of the traced model (every rank holds the whole model)."""

    def parameter(self, target: str, names: Sequence[str], layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        if is_meta(like):
            raise ConfigError(
                f"parameter {target!r} is on the meta device: pass checkpoint=PATH to load "
                "this rank's slices from safetensors files, or init=True to initialize them "
                "(or build the model with real weights)")
        whole = like.detach()
        local = shard_tensor(whole, layout, rank, tp)
        # a replicated piece is the model's own tensor: copy it, never share its storage
        return self._place(local.clone() if local is whole else local, like)


# ---- checkpoints ------------------------------------------------------------------------

# transformers drops these on load without a word (old checkpoints kept them as state)
IGNORED_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$", r"\.attn\.(masked_)?bias$")


class CheckpointWeights(Weights):
    """Slices read from safetensors files. Checkpoint keys are matched to the model's names
    directly, or through transformers' own key renamings (and ``base_model_prefix``) for a
    transformers model; tied parameters are read once, under whichever name the file has."""

    def __init__(self, path: Any, model: nn.Module, param_names: dict[str, Sequence[str]],
                 device: Optional[torch.device] = None):
        super().__init__(model, device)
        self.files = TensorFiles(path)
        state = set(model.state_dict().keys())
        # model name -> the per-expert file keys transformers stacks into it
        self.stacked: dict[str, Stacked] = {}
        self.keys = _match_keys(model, self.files.names(), state, self.stacked)
        self._check(param_names, state)

    def _check(self, param_names: dict[str, Sequence[str]], state: set[str]) -> None:
        missing = [names[0] for names in param_names.values()
                   if not any(n in self.keys or n in self.stacked for n in names)]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ConfigError(
                f"the checkpoint {str(self.files.path)!r} has no tensor for {shown}{more} of "
                f"{type(self.model).__name__}: it belongs to another model or config (autotp "
                "never initializes a missing weight at random; pass init=True to initialize "
                "the whole model instead)")
        used = {key for name, key in self.keys.items() if name in state}
        used |= {key for name, stack in self.stacked.items() if name in state
                 for group in stack.groups for key in group}
        ignored = [re.compile(p) for p in (*IGNORED_UNEXPECTED, *_hf_ignored(self.model))]
        unexpected = [k for k in self.files.names()
                      if k not in used and not any(p.search(k) for p in ignored)]
        if unexpected:
            shown = ", ".join(repr(u) for u in unexpected[:8])
            raise ConfigError(
                f"the checkpoint {str(self.files.path)!r} holds {len(unexpected)} tensor(s) "
                f"{type(self.model).__name__} has no place for: {shown}: it belongs to another "
                "model or config")
        for names in param_names.values():
            name = next(n for n in names if n in self.keys or n in self.stacked)
            if name in self.stacked:
                shape = self.stacked[name].shape(self.files)
                if shape != tuple(path_attr(self.model, name).shape):
                    raise ConfigError(
                        f"the experts stacked into {name!r} from the checkpoint have shape "
                        f"{list(shape)}, but the model's has "
                        f"{list(path_attr(self.model, name).shape)}: the checkpoint does not fit "
                        "this config")
                continue
            self._check_shape(name, path_attr(self.model, name))

    def _check_shape(self, name: str, like: torch.Tensor) -> None:
        key = self.keys[name]
        entry = self.files.entry(key)
        if tuple(entry.shape) != tuple(like.shape):
            raise ConfigError(
                f"checkpoint tensor {key!r} ({self.files.where[key].name}) has shape "
                f"{list(entry.shape)}, but {name!r} of {type(self.model).__name__} has "
                f"{list(like.shape)}: the checkpoint does not fit this config")

    def parameter(self, target: str, names: Sequence[str], layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        stacked = next((self.stacked[n] for n in names if n in self.stacked), None)
        if stacked is not None and not any(n in self.keys for n in names):
            return self._place(stacked.read(self.files, layout, rank, tp), like)
        key = self.keys[next(n for n in names if n in self.keys)]
        if isinstance(layout, Shard):
            size = self.files.entry(key).shape[layout.dim]
            parts = [self.files.read_range(key, layout.dim, start, stop)
                     for start, stop in slice_ranges(size, layout, rank, tp)]
            local = parts[0] if len(parts) == 1 else torch.cat(parts, dim=layout.dim)
        elif isinstance(layout, Replicate):
            local = self.files.read(key)
        else:
            raise ConfigError(f"parameter {target!r} has layout {layout}: parameters are "
                              "replicated or sharded")
        return self._place(local, like)

    def _stored_buffer(self, target: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        key = self.keys.get(target)
        if key is None:
            return None
        self._check_shape(target, like)
        return self.files.read(key)

    def close(self) -> None:
        self.files.close()


def _hf_ignored(model: nn.Module) -> list[str]:
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return [str(p) for p in patterns]


@dataclass
class Stacked:
    """A stacked expert weight that the checkpoint stores per expert: ``groups[g][e]`` is the
    file key of part g (gate, up) of expert e; the parts are concatenated along ``concat``
    (a dim of the stacked tensor) and the experts stacked along dim 0. Each rank reads only
    the ranges its layout holds: the experts it owns, or its slice of every expert."""

    groups: list[list[str]]
    concat: Optional[int] = None

    def shape(self, files: TensorFiles) -> tuple[int, ...]:
        shapes = [tuple(files.entry(group[0]).shape) for group in self.groups]
        part = list(shapes[0])
        if self.concat is not None:
            part[self.concat - 1] = sum(s[self.concat - 1] for s in shapes)
        return (len(self.groups[0]), *part)

    def read(self, files: TensorFiles, layout: Layout, rank: int, tp: int) -> torch.Tensor:
        shape = self.shape(files)
        dim = layout.dim if isinstance(layout, Shard) else None
        ranges = slice_ranges(shape[layout.dim], layout, rank, tp) if isinstance(layout, Shard) \
            else None
        experts = range(shape[0]) if dim != 0 or ranges is None else \
            [e for start, stop in ranges for e in range(start, stop)]
        return torch.stack([self._expert(files, e, dim, ranges) for e in experts])

    def _expert(self, files: TensorFiles, e: int, dim: Optional[int],
                ranges: Optional[list[tuple[int, int]]]) -> torch.Tensor:
        keys = [group[e] for group in self.groups]
        if dim is None or dim == 0:
            parts = [files.read(key) for key in keys]
        elif dim == self.concat:  # ranges of the concatenated parts, in the layout's order
            parts, edges = [], [0]
            for key in keys:
                edges.append(edges[-1] + files.entry(key).shape[dim - 1])
            for start, stop in ranges or []:
                for key, lo, hi in zip(keys, edges, edges[1:]):
                    a, b = max(start, lo), min(stop, hi)
                    if a < b:
                        parts.append(files.read_range(key, dim - 1, a - lo, b - lo))
            return torch.cat(parts, dim=dim - 1)
        else:
            parts = [torch.cat([files.read_range(key, dim - 1, a, b) for a, b in ranges or []],
                               dim=dim - 1) for key in keys]
        return torch.cat(parts, dim=self.concat - 1) if self.concat is not None else parts[0]


def _match_keys(model: nn.Module, checkpoint_keys: list[str], state: set[str],
                stacked: Optional[dict[str, Stacked]] = None) -> dict[str, str]:
    """Model state name -> checkpoint key; per-expert keys stacked into one model tensor are
    collected in ``stacked`` instead."""
    renamed = _hf_renamed(model, checkpoint_keys, state, stacked)
    out: dict[str, str] = {}
    for key in checkpoint_keys:
        name = renamed.get(key, key)
        if name in state and name not in (stacked or {}):
            out.setdefault(name, key)
    return out


def _hf_renamed(model: nn.Module, keys: list[str], state: set[str],
                stacked: Optional[dict[str, Stacked]] = None) -> dict[str, str]:
    """transformers' own renamings of checkpoint keys (legacy names, base-model prefixes),
    and its stacking of per-expert weights into one tensor per layer (gathered into
    ``stacked``: read by slices, as any other tensor); a combination autotp does not read
    is a clear error."""
    if not hasattr(model, "base_model_prefix") or not hasattr(model, "config"):
        return {}
    hf = cast("PreTrainedModel", model)
    try:  # optional: transformers, whose loading API changes between versions
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
        transforms = get_model_conversion_mapping(hf)
    except Exception:  # noqa: BLE001 - an older or newer transformers: plain names only
        return _prefix_renamed(hf.base_model_prefix, keys, state)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out, converted = {}, []
    lookup = dict.fromkeys(state, True)  # what rename_source_key reads (.get) of a state dict
    parts: dict[str, dict[str, dict[int, str]]] = {}  # name -> pattern -> expert -> key
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix,
                                          lookup)
        if pattern is not None:
            expert = _expert_index(key, pattern)
            if name not in state or expert is None or stacked is None:
                converted.append(key)
            else:
                parts.setdefault(name, {}).setdefault(pattern, {})[expert] = key
        out[key] = name
    for name, by_pattern in parts.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        recipe = _stacking(converter)
        groups = [by_pattern.get(p, {}) for p in converter.source_patterns]
        count = len(groups[0])
        if recipe is False or any(sorted(g) != list(range(count)) for g in groups):
            converted += [k for g in groups for k in g.values()]
            continue
        assert stacked is not None
        stacked[name] = Stacked([[g[e] for e in range(count)] for g in groups], recipe)
    if converted:
        raise ConfigError(
            f"{type(model).__name__}'s checkpoint stores {converted[:4]} in a form transformers "
            "combines into other tensors on load (e.g. per-expert weights fused into one); "
            "autotp reads tensors by slices and does not combine them: re-save the checkpoint "
            "in the model's own layout (model.save_pretrained after a transformers load)")
    return out


def _expert_index(key: str, pattern: str) -> Optional[int]:
    """The expert number a per-expert key holds, where ``pattern`` has ``*``."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    return int(match.group(1)) if match and match.groups() else None


def _stacking(converter: Any) -> Any:
    """The concatenation dim of a converter that stacks per-expert tensors (None: none, or
    ``False`` for one autotp does not read: anything but a stack along dim 0 and at most
    one concatenation)."""
    names = [type(op).__name__ for op in converter.operations]
    if not names or names[0] != "MergeModulelist" or \
            getattr(converter.operations[0], "dim", None) != 0:
        return False
    if names == ["MergeModulelist"]:
        return None
    if names == ["MergeModulelist", "Concatenate"]:
        return getattr(converter.operations[1], "dim", None)
    return False


def stacked_experts(model: nn.Module, keys: Sequence[str]) -> dict[str, Stacked]:
    """The model's stacked expert weights that a checkpoint with ``keys`` stores per expert,
    as ``CheckpointWeights`` reads them: model name -> the keys of its experts."""
    stacked: dict[str, Stacked] = {}
    _match_keys(model, list(keys), set(model.state_dict().keys()), stacked)
    return stacked


def _renamed(key: str, renamings: list[Any]) -> str:
    """``key`` through each of transformers' renamings in turn (``rename_source_key``, which
    every tested transformers has; the helper that loops over them came later)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def expert_keys(model: nn.Module) -> dict[str, Stacked]:
    """The per-expert keys that transformers' checkpoints store each stacked expert weight of
    ``model`` under (its conversion mapping reversed, as its own save_pretrained writes
    them); only those that ``CheckpointWeights`` reads back into the same tensor."""
    try:  # optional: transformers, whose loading API changes between versions
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter,
                                                     WeightRenaming)
        transforms = get_model_conversion_mapping(cast("PreTrainedModel", model),
                                                  add_legacy=False)
        renamings = [t.reverse_transform() for t in transforms[::-1]
                     if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)]
    except Exception:  # noqa: BLE001 - not a transformers model, or another transformers
        return {}
    state = model.state_dict()
    out: dict[str, Stacked] = {}
    for converter in transforms:
        if not isinstance(converter, WeightConverter) or len(converter.target_patterns) != 1 \
                or not all("*" in p for p in converter.source_patterns):
            continue
        recipe = _stacking(converter)
        target = converter.target_patterns[0]
        suffix = target if target.startswith(".") else "." + target
        for name, tensor in state.items() if recipe is not False else ():
            if name in out or tensor.dim() == 0 or not (name == target or name.endswith(suffix)):
                continue
            head = name[:len(name) - len(target)]
            stack = Stacked([[_renamed(head + p.replace("*", str(e)), renamings)
                              for e in range(tensor.shape[0])]
                             for p in converter.source_patterns], recipe)
            try:
                read = stacked_experts(model, [k for group in stack.groups for k in group])
            except ConfigError:
                continue
            if read.get(name) == stack:
                out[name] = stack
    return out


def _prefix_renamed(prefix: str, keys: list[str], state: set[str]) -> dict[str, str]:
    out = {}
    for key in keys:
        if key not in state and f"{prefix}.{key}" in state:
            out[key] = f"{prefix}.{key}"
        elif key.startswith(prefix + ".") and key[len(prefix) + 1:] in state:
            out[key] = key[len(prefix) + 1:]
    return out


# ---- transformers' buffers --------------------------------------------------------------


def _hf_owner(model: nn.Module, module_name: str) -> Optional[Callable[[nn.Module], None]]:
    """The ``_init_weights`` that transformers applies to the module ``module_name``: that of
    its nearest enclosing PreTrainedModel (as transformers' composite-model init does)."""
    try:
        from transformers import PreTrainedModel  # optional: transformers
    except ImportError:
        return None
    parts = module_name.split(".") if module_name else []
    for cut in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:cut]))
        if isinstance(owner, PreTrainedModel):
            return owner._init_weights
    return None


def hf_buffer(model: nn.Module, target: str) -> Optional[torch.Tensor]:
    """A transformers buffer (RoPE frequencies, position ids) recomputed by the model's own
    ``_init_weights`` on its module; None when that does not determine every element (run
    twice from different fills: the results must agree)."""
    module_name, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    init = _hf_owner(model, module_name)
    meta = module._buffers.get(leaf)
    if init is None or meta is None:
        return None
    results = []
    for fill in (0, 1):
        module._buffers[leaf] = torch.full(meta.shape, fill, dtype=meta.dtype)
        try:
            with torch.no_grad():
                init(module)
            results.append(module._buffers[leaf])
        except Exception:  # noqa: BLE001 - the initializer needs more than this buffer
            return None
        finally:
            module._buffers[leaf] = meta
    first, second = results
    assert first is not None and second is not None, "_init_weights keeps the buffer"
    if first.shape != meta.shape or not torch.equal(first, second):
        return None
    return first


# ---- initialization ---------------------------------------------------------------------


class _Writes(TorchDispatchMode):
    """Records the storages that ops write to (run on meta: no memory, no random draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        for i, argument in enumerate(schema.arguments):
            info = argument.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor):
                self.written.add(StorageWeakRef(value.untyped_storage()))
        return func(*args, **kwargs)


class InitWeights(Weights):
    """Every parameter from the model's own initializer, one module at a time.

    The order is the unsharded one: transformers models get ``_init_weights`` on each module
    in post-order (what ``initialize_weights`` does), other models ``reset_parameters()`` of
    each module that has parameters, in ``model.modules()`` order. For each call, the
    parameters it writes (found by a dry run on meta) get full tensors on the CPU, the call
    runs for real (the same random draws as unsharded), and only this rank's slices are
    kept. The result equals ``model.to_empty(device="cpu")`` followed by the same calls.
    """

    def __init__(self, model: nn.Module, layouts: dict[str, tuple[Sequence[str], Layout]],
                 rank: int, tp: int, device: Optional[torch.device] = None):
        super().__init__(model, device)
        self.rank, self.tp = rank, tp
        by_id: dict[int, Layout] = {}
        for names, layout in layouts.values():
            for name in names:
                by_id[id(path_attr(model, name))] = layout
        # parameter object -> every (module, attribute) holding it (tied weights: several)
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}
        self._params: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    self._owners.setdefault(id(param), []).append((module, attr))
                    self._params[id(param)] = param
        self._layouts = {pid: by_id.get(pid, Replicate()) for pid in self._params}
        self._by_storage = {StorageWeakRef(p.untyped_storage()): pid
                            for pid, p in self._params.items()}
        self._local: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for module_name, module, call in self._calls():
                self._run(module_name, module, call)
        name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        left = [name_of[pid] for pid in self._params
                if pid not in self._local or _has_nan(self._local[pid])]
        if left:
            raise ConfigError(
                f"init=True: the initializer of {type(model).__name__} leaves {left[:6]} "
                "uninitialized: give their modules a reset_parameters() (or transformers' "
                "_init_weights), or load weights with checkpoint=PATH")

    def _calls(self) -> Iterator[tuple[str, nn.Module, Callable[[], Any]]]:
        if _hf_owner(self.model, "") is not None:
            order: list[tuple[str, nn.Module]] = []

            def post_order(prefix: str, module: nn.Module) -> None:
                for name, child in module.named_children():
                    post_order(f"{prefix}.{name}" if prefix else name, child)
                order.append((prefix, module))

            post_order("", self.model)
            for name, module in order:
                init = _hf_owner(self.model, name)
                assert init is not None
                yield name, module, functools.partial(init, module)
            return
        bare = []
        for name, module in self.model.named_modules():
            if not any(p is not None for p in module._parameters.values()):
                continue
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                bare.append(f"{name} ({type(module).__name__})")
                continue
            yield name, module, reset
        if bare:
            raise ConfigError(
                f"init=True needs an initializer for every module with parameters, and "
                f"{bare[:6]} have no reset_parameters(): add one, or load weights with "
                "checkpoint=PATH")

    def _run(self, module_name: str, module: nn.Module, call: Callable[[], Any]) -> None:
        with _Writes() as writes:
            call()  # on meta: finds what the call writes, draws nothing
        touched = sorted({self._by_storage[w] for w in writes.written if w in self._by_storage})
        if not touched:
            return
        full = {pid: torch.full(self._params[pid].shape, float("nan"),
                                dtype=self._params[pid].dtype) for pid in touched}
        for pid in touched:
            for owner, attr in self._owners[pid]:
                owner._parameters[attr] = nn.Parameter(full[pid], requires_grad=False)
        try:
            call()
        finally:
            for pid in touched:
                for owner, attr in self._owners[pid]:
                    owner._parameters[attr] = self._params[pid]
        for pid in touched:
            local = shard_tensor(full.pop(pid), self._layouts[pid], self.rank, self.tp)
            old = self._local.get(pid)
            if old is not None and old.shape == local.shape:
                local = torch.where(torch.isnan(local), old, local)
            self._local[pid] = local.clone()

    def parameter(self, target: str, names: Sequence[str], layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        return self._place(self._local[id(path_attr(self.model, names[0]))], like)


def _has_nan(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and bool(torch.isnan(tensor).any())
