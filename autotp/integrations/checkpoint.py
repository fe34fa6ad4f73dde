"""Training checkpoints that resume at any tp (transformers' own layout:
``autotp.integrations.pretrained``), and the helpers both read:

    save_checkpoint    torch.distributed.checkpoint: every rank writes its own shards (as
    load_checkpoint    DTensors over the tensor-parallel group) with the optimizer state;
                       loading at another tp is DCP's resharding

Checkpoints are safetensors files and JSON: nothing here pickles or unpickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard

from autotp.sharded import ShardedModule
from autotp.ops import path_attr
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

META_NAME = "autotp.json"
SCHEMA = "autotp.weights.checkpoint/1"
# a sharded module -> the ranks that save or load its checkpoint together and their group,
# made once (``dist.new_group`` is itself a collective of those ranks)
_GROUPS: "weakref.WeakKeyDictionary[ShardedModule, tuple[list[int], dist.ProcessGroup]]" = \
    weakref.WeakKeyDictionary()


def check_sharded(sharded: Any, what: str) -> ShardedModule:
    if not isinstance(sharded, ShardedModule):
        raise ConfigError(f"{what} takes the module autotp returned, got {type(sharded).__name__}")
    return sharded


def rank_tensors(sharded: ShardedModule) -> dict[str, tuple[torch.Tensor, Layout]]:
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


def split_over_ep(sharded: ShardedModule) -> set[str]:
    """The names of the tensors whose experts are split over the ep ranks as well."""
    if sharded.ep_comm is None:
        return set()
    plan = sharded.plan
    return {name for target in plan.expert_params for name in plan.params[target].names}


def barrier(sharded: ShardedModule) -> None:
    device = next((p.device for p in sharded.parameters()), torch.device("cpu"))
    sharded.comm.all_reduce(torch.zeros(1, device=device))
    if sharded.ep_comm is not None:
        sharded.ep_comm.all_reduce(torch.zeros(1, device=device))


# ---- resumable checkpoints (torch.distributed.checkpoint) ---------------------------


def _mesh(sharded: ShardedModule) -> Any:
    """The DeviceMesh the DCP state dict lives on: the tp group, or with expert parallelism
    the (ep, tp) grid of global ranks (collective)."""
    comm, ep_comm = sharded.comm, sharded.ep_comm
    if not isinstance(comm, ProcessGroupComm) or \
            not isinstance(ep_comm, (ProcessGroupComm, type(None))):
        raise ConfigError("save_checkpoint/load_checkpoint need a process group (autotp."
                          "parallelize), not a simulation")
    group = _process_group(comm)
    device = next((p.device.type for p in sharded.parameters()), "cpu")
    if ep_comm is None:
        return DeviceMesh.from_group(group, device)
    return DeviceMesh.from_group([_process_group(ep_comm), group], device, mesh=_grid(sharded),
                                 mesh_dim_names=("ep", "tp"))


def _process_group(comm: ProcessGroupComm) -> dist.ProcessGroup:
    """``comm``'s group (None: the world)."""
    group = comm.group if comm.group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is initialized"
    return group


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
    made = _GROUPS.get(sharded)
    if made is None or made[0] != ranks:
        made = _GROUPS[sharded] = (ranks, dist.new_group(ranks, use_local_synchronization=True))
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
    pieces = [torch.empty_like(local) for _ in range(sharded.plan.degree)]
    dist.all_gather(pieces, local.detach().contiguous(), group=_group(sharded))
    return unshard_tensor(pieces, layout)


def _describe(sharded: ShardedModule) -> dict[str, Any]:
    plan = sharded.plan
    over_ep = split_over_ep(sharded)
    params = {}
    for name, (local, layout) in rank_tensors(sharded).items():
        shape = global_shape(local, layout, plan.degree)
        if name in over_ep:
            shape[0] *= plan.ep
        params[name] = {"global_shape": shape,
                        "dtype": str(local.dtype).replace("torch.", ""), "layout": str(layout)}
    return params


def _fingerprint(params: dict[str, Any]) -> str:
    text = json.dumps({k: v["global_shape"] for k, v in sorted(params.items())})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def global_shape(local: torch.Tensor, layout: Layout, tp: int) -> list[int]:
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
        full = self.whole.reshape(global_shape(self.target, self.layout, tp))
        self.target.copy_(shard_tensor(full, self.layout, rank, tp))


def _state_dict(sharded: ShardedModule, mesh: Any, saved_layouts: dict[str, Layout],
                opt_state: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[_Entry]]:
    """The DCP state dict (``model.<name>``, ``optim.<name>.<key>``) over the tp mesh, or
    with expert parallelism the (ep, tp) mesh: the experts sharded over both, every other
    tensor replicated over ep as over the tp mesh."""
    tp = sharded.plan.degree
    tensors = rank_tensors(sharded)
    over_ep = split_over_ep(sharded)
    state: dict[str, Any] = {}
    entries: list[_Entry] = []

    def add(key: str, name: str, local: torch.Tensor) -> None:
        layout = tensors[name][1]
        if name in over_ep:
            state[key] = _expert_dtensor(name, local, layout, saved_layouts.get(name, layout),
                                         mesh)
            return
        shape, placement, local_shape = _dcp_form(global_shape(local, layout, tp),
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
    names = {id(local): name for name, (local, _) in rank_tensors(sharded).items()}
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
    # start-up: torch.distributed.checkpoint is not loaded by torch (0.15 s on import autotp)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sharded = check_sharded(sharded, "save_checkpoint")
    directory = Path(path)
    described = _describe(sharded)
    opt_state, groups = _optimizer_state(sharded, optimizer) if optimizer is not None \
        else ({}, [])
    mesh = _mesh(sharded)
    state, _ = _state_dict(sharded, mesh, {}, opt_state)
    meta = {
        "schema": SCHEMA, "model": sharded.plan.model, "tp": sharded.plan.degree,
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
    barrier(sharded)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(directory),
                                                            save_distributed=True),
             process_group=_dcp_group(sharded, mesh))
    if _writer(sharded):
        (directory / META_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True))
    barrier(sharded)


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
    # start-up: torch.distributed.checkpoint is not loaded by torch (0.15 s on import autotp)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sharded = check_sharded(sharded, "load_checkpoint")
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
            entry.copy_back(sharded.comm.rank, sharded.plan.degree)
    if optimizer is not None:
        _restore_optimizer(sharded, optimizer, saved["optimizer"], opt_state)


def _empty_optimizer_state(sharded: ShardedModule, saved_state: dict[str, Any]
                           ) -> dict[str, dict[str, Any]]:
    """Tensors for DCP to load the optimizer state into: shaped like the local parameter
    piece, or 0-d for step counts; JSON values as saved."""
    tensors = rank_tensors(sharded)
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
    names = {id(local): name for name, (local, _) in rank_tensors(sharded).items()}
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
