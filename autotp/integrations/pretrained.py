"""Models too large for one rank, in transformers' own layout (training checkpoints that
resume at any tp: autotp.integrations.checkpoint):

    from_pretrained    a transformers directory -> this rank's module; the model is built on
                       meta and each rank reads only its slices (autotp.weights.materialize)
    save_pretrained    transformers' layout (config.json, safetensors shards, index), gathered
                       one tensor at a time and written by rank 0; a mixture of experts' weights
                       per expert as the source checkpoint stored them, or stacked as the
                       model holds them

Checkpoints are safetensors files and JSON: nothing here pickles or unpickles.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from autotp.api import parallelize
from autotp.errors import ConfigError
from autotp.integrations.checkpoint import barrier, check_sharded, global_shape, rank_tensors, \
    split_over_ep
from autotp.layout import Layout, Shard
from autotp.runtime.collectives import gather
from autotp.sharded import ShardedModule
from autotp.weights.materialize import Stacked, empty_weights, expert_keys, stacked_experts
from autotp.weights.tensorfile import Spec, TensorFiles, file_names, parse_bytes, plan_files, \
    write_file, write_index

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# ---- loading a transformers directory -----------------------------------------------


def from_pretrained(path: str | Path, tp: Optional[int] = None, *, dtype: Any = None,
                    device: Any = None, group: Optional[dist.ProcessGroup] = None,
                    model_class: Optional[type[PreTrainedModel]] = None, training: bool = False,
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
        import transformers  # optional: transformers
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
    if sharded.source is not None:
        sharded.source = dataclasses.replace(
            sharded.source, checkpoint_experts=_checkpoint_experts(model, directory))
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
    loaded = sharded.source.checkpoint_experts if sharded.source is not None else {}
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
    sharded = check_sharded(sharded, "save_pretrained")
    max_bytes = parse_bytes(max_shard_size)
    directory = Path(path)
    # one writer: tp rank 0 of ep rank 0 (the other ranks run the same collectives)
    rank = sharded.comm.rank + (sharded.ep_comm.rank if sharded.ep_comm is not None else 0)
    tensors = rank_tensors(sharded)
    order = _ordered(sharded, tensors)
    plan = sharded.plan
    over_ep = split_over_ep(sharded)
    shapes = {name: tuple(global_shape(local, where, plan.degree))
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
    barrier(sharded)


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
