"""Models too large for one rank: load only each rank's slices, save back, resume anywhere.

    from_pretrained    a transformers directory -> this rank's module; the model is built on
                       meta and each rank reads only its slices (autotp.weights.materialize)
    save_pretrained    transformers' layout (config.json, safetensors shards, index), gathered
                       one tensor at a time and written by rank 0; a mixture of experts' weights
                       per expert as the source checkpoint stored them, or stacked as the
                       model holds them
    save_checkpoint    torch.distributed.checkpoint: every rank writes its own shards (as
    load_checkpoint    DTensors over the tensor-parallel group) with the optimizer state;
                       loading at another tp is DCP's resharding

Checkpoints are safetensors files and JSON: nothing here pickles or unpickles.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from autotp.api import parallelize
from autotp.sharded import ShardedModule
from autotp.ops import path_attr
from autotp.runtime.collectives import gather
from autotp.runtime.comm import ProcessGroupComm
from autotp.errors import ConfigError
from autotp.layout import (
    Layout,
    Replicate,
    Shard,
    global_extent,
    parse_layout,
    shard_tensor,
    unshard_tensor,
)
from autotp.weights.materialize import Stacked, empty_weights, expert_keys, stacked_experts
from autotp.weights.tensorfile import (Spec, TensorFiles, file_names, parse_size, plan_files,
                               write_file, write_index)

META_NAME = "autotp.json"
SCHEMA = "autotp.weights.checkpoint/1"


# ---- loading a transformers directory -----------------------------------------------


def from_pretrained(path: str | Path, tp: Optional[int] = None, *, dtype: Any = None,
                    device: Any = None, group: Optional[dist.ProcessGroup] = None,
                    model_class: Optional[type] = None, training: bool = False,
                    **parallelize_options: Any) -> ShardedModule:
    """This rank's module of the transformers model saved in ``path`` (a local directory:
    config.json and safetensors weights), reading only this rank's slices.

    The model is built from its config with parameters on the meta device (buffers such as
    RoPE tables computed for real), captured and planned as ``autotp.parallelize`` does
    (``parallelize_options`` pass through: ``example_kwargs``, ``sequence_parallel``, ...),
    and each parameter is read as this rank's slice, converted to ``dtype`` on the slice.
    ``dtype``: None takes the config's dtype, else the checkpoint's. The module is traced in
    eval mode, as transformers returns a loaded model; ``training=True`` traces train mode.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{str(path)!r} is not a directory: from_pretrained takes a local "
                          "directory in transformers' layout (config.json and *.safetensors)")
    if not (directory / "config.json").exists():
        raise ConfigError(f"{directory} has no config.json: it is not a transformers model "
                          "directory (for a bare safetensors file, build the model on meta "
                          "and call autotp.parallelize(model, checkpoint=...))")
    files = TensorFiles(directory)  # checks the weights exist before anything is built
    try:
        import transformers
    except ImportError:
        raise ConfigError("from_pretrained needs the transformers package") from None
    config = transformers.AutoConfig.from_pretrained(directory)
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            raise ConfigError(f"{directory}/config.json names no transformers architecture "
                              f"({names}): pass model_class=, e.g. LlamaForCausalLM")
    dtype = _resolve_dtype(dtype, config, files)
    files.close()
    with empty_weights():
        model = model_class._from_config(config, dtype=dtype)
    if (directory / "generation_config.json").exists() and \
            getattr(model, "generation_config", None) is not None:
        # the defaults generate() uses (eos, sampling settings), as transformers loads them
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.train(training)
    sharded = parallelize(model, tp, group=group, checkpoint=directory, device=device,
                          **parallelize_options)
    # what save_pretrained writes back per expert by default (layout=None)
    sharded.checkpoint_experts = _checkpoint_experts(model, directory)
    return sharded


def _resolve_dtype(dtype: Any, config: Any, files: TensorFiles) -> torch.dtype:
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        raise ConfigError(f"dtype must be a torch.dtype, its name, or 'auto'; got {dtype!r}")
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if isinstance(stored, torch.dtype):
        return stored
    for name in files.names():
        if files.entry(name).dtype.is_floating_point:
            return files.entry(name).dtype
    return torch.float32


# ---- saving in transformers' layout -------------------------------------------------

LAYOUTS = ("model", "checkpoint")


@dataclass
class PerExpert:
    """A stacked expert weight written one tensor per expert and part: ``keys[g][e]`` is the
    key of part g (gate, up) of expert e, the slice ``sizes[g]`` long along dim ``concat``
    of the stacked tensor (None: a single part, the whole expert); experts along dim 0."""

    keys: list[list[str]]
    concat: Optional[int]
    sizes: list[int]

    @classmethod
    def of(cls, stack: Stacked, shape: tuple[int, ...]) -> "PerExpert":
        """Parts of equal size (transformers' reverse of its Concatenate: a Chunk)."""
        if stack.concat is None:
            return cls(stack.groups, None, [])
        parts, extent = len(stack.groups), shape[stack.concat]
        if extent % parts:
            raise ConfigError(f"the {extent} rows of dim {stack.concat} of the experts stacked "
                              f"from {stack.groups[0][0]!r}, ... do not split into {parts} parts")
        return cls(stack.groups, stack.concat, [extent // parts] * parts)

    def pieces(self) -> Iterator[tuple[str, int, int]]:
        """(key, part, expert), expert by expert."""
        for e in range(len(self.keys[0])):
            for g, group in enumerate(self.keys):
                yield group[e], g, e

    def shape(self, stacked: tuple[int, ...], part: int) -> tuple[int, ...]:
        shape = list(stacked[1:])
        if self.concat is not None:
            shape[self.concat - 1] = self.sizes[part]
        return tuple(shape)

    def piece(self, stacked: torch.Tensor, part: int, expert: int) -> torch.Tensor:
        if self.concat is None:
            return stacked[expert]
        return stacked[expert].narrow(self.concat - 1, sum(self.sizes[:part]),
                                      self.sizes[part])


def _checkpoint_experts(model: nn.Module, directory: Path) -> dict[str, PerExpert]:
    """The model's stacked expert weights that the checkpoint in ``directory`` stores per
    expert, under its keys and in its parts' sizes."""
    files = TensorFiles(directory)
    try:
        return {name: PerExpert(stack.groups, stack.concat,
                                [files.entry(group[0]).shape[stack.concat - 1]
                                 for group in stack.groups]
                                if stack.concat is not None else [])
                for name, stack in stacked_experts(model, files.names()).items()}
    finally:
        files.close()


def _per_expert(sharded: ShardedModule, layout: Optional[str],
                shapes: dict[str, tuple[int, ...]]) -> dict[str, PerExpert]:
    """The stacked tensors ``layout`` writes per expert (see save_pretrained)."""
    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {list(LAYOUTS)} or None (the layout of the "
                          f"checkpoint the module was loaded from), got {layout!r}")
    loaded = getattr(sharded, "checkpoint_experts", None) or {}
    if layout == "model":
        return {}
    if loaded:
        return dict(loaded)
    source = sharded.source
    if layout is None or source is None or source.config is None or \
            not hasattr(source.model_class, "_from_config"):
        return {}
    with empty_weights():  # transformers' conversion mapping is read off a model
        model = source.model_class._from_config(copy.deepcopy(source.config))
    out = {name: PerExpert.of(stack, shapes[name])
           for name, stack in expert_keys(model).items() if name in shapes}
    if layout == "checkpoint" and sharded.plan.experts and not out:
        raise ConfigError(
            f"layout='checkpoint': the installed transformers names no per-expert tensors for "
            f"{source.model_class.__name__}'s stacked experts "
            f"({', '.join(sorted(sharded.plan.experts)[:2])}, ...); save with layout='model'")
    return out


def _check_sharded(sharded: Any, what: str) -> ShardedModule:
    if not isinstance(sharded, ShardedModule):
        raise ConfigError(f"{what} takes the module autotp returned, got {type(sharded).__name__}")
    return sharded


def _tensors(sharded: ShardedModule) -> dict[str, tuple[torch.Tensor, Layout]]:
    """Every tensor of the model's state dict by its first name: (local piece, layout)."""
    plan = sharded.plan
    out: dict[str, tuple[torch.Tensor, Layout]] = {}
    for target, local in sharded.local_parameters().items():
        out[plan.params[target].names[0]] = (local, plan.param_layout(target))
    for name in sharded._unused:
        out[name] = (path_attr(sharded.program, name, None), Replicate())
    source = sharded.source
    for name in source.buffers if source is not None else []:
        value = path_attr(sharded.program, name, None)
        if isinstance(value, torch.Tensor):
            out[name] = (value, Replicate())
    return out



def _ordered(sharded: ShardedModule, tensors: dict[str, Any]) -> list[str]:
    """The model's own state-dict order where it is known."""
    keys = sharded.source.state_keys if sharded.source is not None else []
    first = [k for k in keys if k in tensors]
    known = set(first)
    return first + [k for k in tensors if k not in known]


def _global(sharded: ShardedModule, local: torch.Tensor, layout: Layout,
            over_ep: bool = False) -> torch.Tensor:
    """The whole tensor (collective): gathered over tp, and for experts split over ep
    data-parallel ranks too (``over_ep``), over them."""
    whole = gather(sharded.comm, local.detach().contiguous(), layout) \
        if isinstance(layout, Shard) else local.detach()
    if over_ep and sharded.ep_comm is not None:
        whole = sharded.ep_comm.all_gather(whole.contiguous(), 0)
    return whole


def _split_over_ep(sharded: ShardedModule) -> set[str]:
    """The names of the tensors whose experts are split over the ep ranks as well."""
    if sharded.ep_comm is None:
        return set()
    plan = sharded.plan
    return {name for target in plan.expert_params for name in plan.params[target].names}


def save_pretrained(sharded: ShardedModule, path: str | Path, *,
                    max_shard_size: int | str = "5GB", layout: Optional[str] = None) -> None:
    """Write the unsharded model in transformers' layout (collective: call on every rank).

    Tensors are gathered one at a time, and rank 0 streams each into its file as it arrives:
    no rank ever holds more than one full tensor. Tied weights are written once, under the
    first name (transformers re-ties them on load). ``transformers`` and
    ``autotp.from_pretrained`` at any tp load the result.

    ``layout`` is how a mixture of experts' weights, which the model holds stacked (one
    tensor per layer: gate|up [experts, 2 * inner, hidden], down), are written:

        "model"        stacked, as the model holds them
        "checkpoint"   one tensor per expert and part (experts.3.gate_proj.weight, ...), as
                       transformers' checkpoints store them: under the keys of the checkpoint
                       ``from_pretrained`` read, else of transformers' conversion mapping
        None           the layout of the checkpoint ``from_pretrained`` read (a load and a
                       save reproduce its keys and tensors); "model" for a module built
                       otherwise

    Every other tensor is written as the model holds it, whatever the layout.
    """
    sharded = _check_sharded(sharded, "save_pretrained")
    max_bytes = parse_size(max_shard_size)
    directory = Path(path)
    # one writer: tp rank 0 of ep rank 0 (the other ranks run the same collectives)
    rank = sharded.comm.rank + (sharded.ep_comm.rank if sharded.ep_comm is not None else 0)
    tensors = _tensors(sharded)
    order = _ordered(sharded, tensors)
    plan = sharded.plan
    over_ep = _split_over_ep(sharded)
    shapes = {name: tuple(_global_shape(local, where, plan.tp))
              for name, (local, where) in tensors.items()}
    for name in over_ep & set(shapes):
        shapes[name] = (shapes[name][0] * plan.ep,) + shapes[name][1:]
    experts = _per_expert(sharded, layout, shapes)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    specs: list[Spec] = []
    pieces: dict[str, tuple[str, int, int]] = {}  # per-expert key -> (stacked name, part, expert)
    for name in order:
        if name not in experts:
            specs.append(Spec(name, tensors[name][0].dtype, shapes[name]))
            continue
        for key, part, expert in experts[name].pieces():
            specs.append(Spec(key, tensors[name][0].dtype, experts[name].shape(shapes[name], part)))
            pieces[key] = (name, part, expert)
    groups = plan_files(specs, max_bytes)
    names = file_names(len(groups))
    held: dict[str, torch.Tensor] = {}  # the stacked tensor whose experts are being written

    def produce(spec: Spec) -> Optional[torch.Tensor]:
        if spec.name not in pieces:
            held.clear()
            return _global(sharded, *tensors[spec.name], spec.name in over_ep)
        name, part, expert = pieces[spec.name]
        if name not in held:
            held.clear()
            held[name] = _global(sharded, *tensors[name], name in over_ep)
        return experts[name].piece(held[name], part, expert)

    for file_name, group in zip(names, groups):
        if rank == 0:
            write_file(directory / file_name, group, produce)
        else:
            for spec in group:  # the same collectives, in the same order
                produce(spec)
    held.clear()
    if rank == 0:
        if len(groups) > 1:
            write_index(directory, names, groups)
        _save_config(sharded, directory, specs)
    _barrier(sharded)


def _save_config(sharded: ShardedModule, directory: Path, specs: list[Spec]) -> None:
    source = sharded.source
    if source is None or source.config is None:
        return
    config = copy.deepcopy(source.config)
    config.architectures = [source.model_class.__name__]
    floats = [s.dtype for s in specs if s.dtype.is_floating_point]
    if floats and hasattr(config, "dtype"):
        config.dtype = floats[0]
    config.save_pretrained(directory)


def _barrier(sharded: ShardedModule) -> None:
    device = next((p.device for p in sharded.parameters()), torch.device("cpu"))
    sharded.comm.all_reduce(torch.zeros(1, device=device))
    if sharded.ep_comm is not None:
        sharded.ep_comm.all_reduce(torch.zeros(1, device=device))


# ---- resumable checkpoints (torch.distributed.checkpoint) ---------------------------


def _mesh(sharded: ShardedModule) -> Any:
    """The DeviceMesh the DCP state dict lives on: the tp group, or with expert parallelism
    the (ep, tp) grid of global ranks (collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    comm, ep_comm = sharded.comm, sharded.ep_comm
    if not isinstance(comm, ProcessGroupComm) or \
            not isinstance(ep_comm, (ProcessGroupComm, type(None))):
        raise ConfigError("save_checkpoint/load_checkpoint need a process group (autotp."
                          "parallelize), not a simulation")
    group = comm.group if comm.group is not None else dist.group.WORLD
    device = next((p.device.type for p in sharded.parameters()), "cpu")
    if ep_comm is None:
        return DeviceMesh.from_group(group, device)
    ep_group = ep_comm.group if ep_comm.group is not None else dist.group.WORLD
    return DeviceMesh.from_group([ep_group, group], device, mesh=_grid(sharded),
                                 mesh_dim_names=("ep", "tp"))


def _grid(sharded: ShardedModule) -> torch.Tensor:
    """The global ranks as an [ep, tp] grid, the same on every rank (collective): row e is
    the tp group of the ep group's rank e, in tp rank order."""
    comm, ep_comm = sharded.comm, sharded.ep_comm
    assert ep_comm is not None
    device = next((p.device for p in sharded.parameters()), torch.device("cpu"))
    me = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    row = comm.all_gather(me, 0)
    # each row with its rank's tp rank: the ep group must join ranks of the same tp rank
    rows = ep_comm.all_gather(torch.cat([row, row.new_tensor([comm.rank])]).unsqueeze(0), 0)
    grid = rows[:, :-1].contiguous()
    agreed = comm.all_gather(grid.reshape(1, -1), 0)
    if bool((rows[:, -1] != comm.rank).any()) or bool((agreed != agreed[:1]).any()):
        raise ConfigError(
            "save_checkpoint/load_checkpoint with ep > 1 need the tp and ep groups to form a "
            "grid: each ep group the ranks of one tp rank in every tp group (as "
            "autotp.parallelize(tp=, ep=) makes them, or mesh['tp'] and mesh['dp'] of a "
            "DeviceMesh)")
    return grid.cpu()


def _dcp_group(sharded: ShardedModule, mesh: Any) -> Optional[dist.ProcessGroup]:
    """The ranks that save or load the checkpoint together: the tp group, or with expert
    parallelism every rank of the (ep, tp) grid (the world, or a group of its ranks made
    once)."""
    if sharded.ep_comm is None:
        return _group(sharded)
    ranks = sorted(mesh.mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        return None
    made = getattr(sharded, "_checkpoint_group", None)
    if made is None or made[0] != ranks:
        made = (ranks, dist.new_group(ranks, use_local_synchronization=True))
        sharded._checkpoint_group = made
    return made[1]


def _writer(sharded: ShardedModule) -> bool:
    """Whether this rank writes the description (one rank of the tp x ep ranks)."""
    return sharded.comm.rank == 0 and (sharded.ep_comm is None or sharded.ep_comm.rank == 0)


def _dcp_form(global_shape: list[int], saved: Layout, current: Layout, tp: int
              ) -> tuple[list[int], Any, list[int]]:
    """How a tensor is stored in DCP, and how this rank reads it: a dim that was blocked
    (fused q|k|v) when saved is stored split into (blocks, size / blocks), so that each
    rank's piece is a plain shard of the second, and the checkpoint reshards at any tp.
    Returns (stored global shape, this rank's DTensor placement, this rank's local shape);
    a rank whose layout does not line up with the stored one reads it whole (Replicate)."""
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard

    shape = list(global_shape)
    if _unequal(saved) or _unequal(current):  # unequal segments: stored whole
        return shape, DReplicate(), shape
    split = isinstance(saved, Shard) and saved.blocks != 1
    if split:
        assert isinstance(saved, Shard) and isinstance(saved.blocks, int)
        shape[saved.dim:saved.dim + 1] = [saved.blocks, shape[saved.dim] // saved.blocks]
    if isinstance(current, Shard) and (current == saved or (not split and current.blocks == 1)):
        dim = current.dim + 1 if split else current.dim
        local = list(shape)
        local[dim] //= tp
        return shape, DShard(dim), local
    return shape, DReplicate(), shape


def _unequal(layout: Layout) -> bool:
    """Blocked into unequal segments (q|k|v with fewer k/v heads): no rank's piece is a
    plain shard of any stored form, so the tensor is stored whole."""
    return isinstance(layout, Shard) and isinstance(layout.blocks, tuple)


def _gathered(sharded: ShardedModule, local: torch.Tensor, layout: Layout) -> torch.Tensor:
    pieces = [torch.empty_like(local) for _ in range(sharded.plan.tp)]
    dist.all_gather(pieces, local.detach().contiguous(), group=_group(sharded))
    return unshard_tensor(pieces, layout)


def _describe(sharded: ShardedModule) -> dict[str, Any]:
    plan = sharded.plan
    over_ep = _split_over_ep(sharded)
    params = {}
    for name, (local, layout) in _tensors(sharded).items():
        shape = _global_shape(local, layout, plan.tp)
        if name in over_ep:
            shape[0] *= plan.ep
        params[name] = {"global_shape": shape,
                        "dtype": str(local.dtype).replace("torch.", ""), "layout": str(layout)}
    return params


def _fingerprint(params: dict[str, Any]) -> str:
    text = json.dumps({k: v["global_shape"] for k, v in sorted(params.items())})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _global_shape(local: torch.Tensor, layout: Layout, tp: int) -> list[int]:
    shape = list(local.shape)
    if isinstance(layout, Shard):
        shape[layout.dim] = global_extent(shape[layout.dim], layout.blocks, tp)
    return shape


class _Entry:
    """A tensor DCP reads whole (its stored form does not line up with this rank's layout):
    after the load, this rank keeps its piece."""

    def __init__(self, target: torch.Tensor, whole: torch.Tensor, layout: Layout):
        self.target, self.whole, self.layout = target, whole, layout

    def copy_back(self, rank: int, tp: int) -> None:
        full = self.whole.reshape(_global_shape(self.target, self.layout, tp))
        self.target.copy_(shard_tensor(full, self.layout, rank, tp))


def _state_dict(sharded: ShardedModule, mesh: Any, saved_layouts: dict[str, Layout],
                opt_state: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[_Entry]]:
    """The DCP state dict (``model.<name>``, ``optim.<name>.<key>``) over the tp mesh, or
    with expert parallelism the (ep, tp) mesh: the experts sharded over both, every other
    tensor replicated over ep as over the tp mesh."""
    from torch.distributed.tensor import DTensor, Replicate as DReplicate

    tp = sharded.plan.tp
    tensors = _tensors(sharded)
    over_ep = _split_over_ep(sharded)
    state: dict[str, Any] = {}
    entries: list[_Entry] = []

    def add(key: str, name: str, local: torch.Tensor) -> None:
        layout = tensors[name][1]
        if name in over_ep:
            state[key] = _expert_dtensor(name, local, layout, saved_layouts.get(name, layout),
                                         mesh)
            return
        shape, placement, local_shape = _dcp_form(_global_shape(local, layout, tp),
                                                  saved_layouts.get(name, layout), layout, tp)
        if placement.is_shard():
            # a view of the local piece: DCP loads into it in place
            placements = [placement] if mesh.ndim == 1 else [DReplicate(), placement]
            state[key] = DTensor.from_local(local.detach().reshape(local_shape), mesh,
                                            placements, run_check=False,
                                            shape=torch.Size(shape), stride=_strides(shape))
        elif local.numel() == math.prod(shape):  # a plain tensor is DCP's replicated value
            state[key] = local.detach().reshape(shape)  # loaded in place, like the shards
        elif _unequal(layout):  # saved whole (gathered), loaded whole, then this rank's piece
            state[key] = _gathered(sharded, local, layout)
            entries.append(_Entry(local.detach(), state[key], layout))
        else:  # read whole, then keep this rank's piece
            state[key] = torch.empty(shape, dtype=local.dtype, device=local.device)
            entries.append(_Entry(local.detach(), state[key], layout))

    for name, (local, _) in tensors.items():
        add(f"model.{name}", name, local)
    for name, values in opt_state.items():
        local = tensors[name][0]
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() > 0 and value.shape == local.shape:
                add(f"optim.{name}.{key}", name, value)
            else:  # step counts and other scalars: replicated plain tensors
                state[f"optim.{name}.{key}"] = value
    return state, entries


def _expert_dtensor(name: str, local: torch.Tensor, layout: Layout, saved: Layout,
                    mesh: Any) -> Any:
    """An expert tensor split into ep * tp shares along the experts (dim 0), share e * tp + r
    on the rank of ep rank e and tp rank r: Shard(0) over both dims of the (ep, tp) mesh
    (DTensor splits along the mesh dims in order: ep's shares, then tp's within each). A dim
    blocked when saved is stored split as _dcp_form splits it."""
    from torch.distributed.tensor import DTensor, Shard as DShard

    if layout != Shard(0):
        raise ConfigError(f"{name!r} is split over the ep ranks but laid out {layout} over "
                          "tp, not S(0): save_checkpoint/load_checkpoint need the experts "
                          "split along dim 0 only")
    shape = [local.shape[0] * mesh.size(), *local.shape[1:]]
    local_shape = list(local.shape)
    if isinstance(saved, Shard) and saved.blocks != 1 and not _unequal(saved):
        if saved.dim == 0 or not isinstance(saved.blocks, int):
            raise ConfigError(f"{name!r} was saved laid out {saved}, which cannot be read "
                              "split over ep ranks: load the checkpoint with ep=1, and "
                              "save_checkpoint again")
        for dims in (shape, local_shape):
            dims[saved.dim:saved.dim + 1] = [saved.blocks, dims[saved.dim] // saved.blocks]
    return DTensor.from_local(local.detach().reshape(local_shape), mesh, [DShard(0)] * 2,
                              run_check=False, shape=torch.Size(shape), stride=_strides(shape))


def _strides(shape: list[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _optimizer_state(sharded: ShardedModule, optimizer: torch.optim.Optimizer
                     ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The optimizer's per-parameter state and param groups, keyed by parameter names."""
    names = {id(local): name for name, (local, _) in _tensors(sharded).items()}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        members = []
        for param in group["params"]:
            if id(param) not in names:
                raise ConfigError("the optimizer holds a parameter that is not one of the "
                                  "sharded module's: build it from sharded.parameters()")
            members.append(names[id(param)])
            if param in optimizer.state:
                state[names[id(param)]] = dict(optimizer.state[param])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    return state, groups


def save_checkpoint(sharded: ShardedModule, path: str | Path, *,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Save parameters (and ``optimizer``'s state) with torch.distributed.checkpoint: every
    rank writes its own shards, in parallel, as safetensors files; rank 0 adds a JSON
    description. Collective: call on every rank. ``load_checkpoint`` reads it at any tp, and
    with expert parallelism at any tp and ep (a model's experts split over the ep ranks are
    stored as the whole stacked tensors, each rank writing its own experts)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sharded = _check_sharded(sharded, "save_checkpoint")
    directory = Path(path)
    described = _describe(sharded)
    opt_state, groups = _optimizer_state(sharded, optimizer) if optimizer is not None \
        else ({}, [])
    mesh = _mesh(sharded)
    state, _ = _state_dict(sharded, mesh, {}, opt_state)
    meta = {
        "schema": SCHEMA, "model": sharded.plan.model, "tp": sharded.plan.tp,
        "ep": sharded.plan.ep,
        "fingerprint": _fingerprint(described), "params": described,
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "param_groups": _jsonable(groups),
            "state": {name: {k: ("tensor" if isinstance(v, torch.Tensor) else _jsonable(v))
                             for k, v in values.items()}
                      for name, values in opt_state.items()},
        },
    }
    if _writer(sharded):
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.safetensors"):  # a checkpoint saved here at another tp
            old.unlink()
    _barrier(sharded)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(directory),
                                                            save_distributed=True),
             process_group=_dcp_group(sharded, mesh))
    if _writer(sharded):
        (directory / META_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True))
    _barrier(sharded)


def _group(sharded: ShardedModule) -> Optional[dist.ProcessGroup]:
    comm = sharded.comm
    return comm.group if isinstance(comm, ProcessGroupComm) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(f"optimizer setting {value!r} cannot be saved as JSON")


def load_checkpoint(sharded: ShardedModule, path: str | Path, *,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load a ``save_checkpoint`` directory into ``sharded`` (and ``optimizer``), whatever the
    tp and ep it was saved at. Collective: call on every rank. The optimizer must be built over
    ``sharded.parameters()`` (a fresh one is fine: its state is created)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sharded = _check_sharded(sharded, "load_checkpoint")
    directory = Path(path)
    meta_file = directory / META_NAME
    if not meta_file.exists():
        raise ConfigError(f"{directory} is not an autotp checkpoint (no {META_NAME}); "
                          "for weights use autotp.from_pretrained or parallelize(checkpoint=)")
    try:
        saved = json.loads(meta_file.read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{meta_file} is not JSON") from None
    if saved.get("schema") != SCHEMA:
        raise ConfigError(f"{meta_file}: unknown schema {saved.get('schema')!r}")
    described = _describe(sharded)
    if saved["fingerprint"] != _fingerprint(described):
        ours, theirs = set(described), set(saved["params"])
        diff = sorted(ours ^ theirs) or sorted(
            n for n in ours
            if described[n]["global_shape"] != saved["params"][n]["global_shape"])
        raise ConfigError(f"{directory} holds a checkpoint of another model ({saved['model']}, "
                          f"tensors that differ: {diff[:6]})")
    opt_state: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        if saved["optimizer"] is None:
            raise ConfigError(f"{directory} was saved without optimizer state")
        opt_state = _empty_optimizer_state(sharded, saved["optimizer"]["state"])
    saved_layouts = {n: parse_layout(v["layout"]) for n, v in saved["params"].items()}
    mesh = _mesh(sharded)
    state, entries = _state_dict(sharded, mesh, saved_layouts, opt_state)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)),
             process_group=_dcp_group(sharded, mesh))
    with torch.no_grad():
        for entry in entries:
            entry.copy_back(sharded.comm.rank, sharded.plan.tp)
    if optimizer is not None:
        _restore_optimizer(sharded, optimizer, saved["optimizer"], opt_state)


def _empty_optimizer_state(sharded: ShardedModule, saved_state: dict[str, Any]
                           ) -> dict[str, dict[str, Any]]:
    """Tensors for DCP to load the optimizer state into: shaped like the local parameter
    piece, or 0-d for step counts; JSON values as saved."""
    tensors = _tensors(sharded)
    out: dict[str, dict[str, Any]] = {}
    for name, values in saved_state.items():
        if name not in tensors:
            raise ConfigError(f"the checkpoint has optimizer state for {name!r}, which the "
                              "model does not have")
        local = tensors[name][0]
        out[name] = {key: (torch.zeros((), dtype=torch.float32) if key == "step"
                           else torch.zeros_like(local)) if kind == "tensor" else kind
                     for key, kind in values.items()}
    return out


def _restore_optimizer(sharded: ShardedModule, optimizer: torch.optim.Optimizer,
                       saved: dict[str, Any], opt_state: dict[str, dict[str, Any]]) -> None:
    names = {id(local): name for name, (local, _) in _tensors(sharded).items()}
    index: dict[str, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index[names[id(param)]] = len(index)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError("the optimizer has another number of parameter groups than the "
                          "checkpoint")
    groups = []
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        if [names[id(p)] for p in group["params"]] != saved_group["params"]:
            raise ConfigError("the optimizer's parameter groups differ from the checkpoint's")
        settings = {k: _as_held(v, group.get(k)) for k, v in saved_group.items()
                    if k != "params"}
        groups.append({**settings, "params": [index[n] for n in saved_group["params"]]})
    state = {index[name]: dict(values) for name, values in opt_state.items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _as_held(saved: Any, held: Any) -> Any:
    """A saved setting in the form the optimizer holds it: JSON has no tuples, and Adam's
    betas come back from it as a list."""
    return tuple(saved) if isinstance(held, tuple) and isinstance(saved, list) else saved
