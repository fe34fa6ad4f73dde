"""Gradient clipping by the whole model's norm, on the shards each rank holds.

``torch.nn.utils.clip_grad_norm_`` on one rank's parameters measures that rank's pieces: a
column-sharded weight contributes a slice, a replicated one its whole gradient, so the norm
differs from rank to rank and from the unsharded model's, and so does the clipping. Here
each piece counts once in the model's norm:

- a parameter sharded over the tensor-parallel ranks: its slices' ``|g|^p`` summed over them;
- a replicated parameter (its gradient is the same on every tensor-parallel rank once the
  backward has summed it): counted on tensor-parallel rank 0 only;
- experts split over expert-parallel ranks (``ep``): summed over those too;
- a gradient FSDP2 holds sharded over data-parallel ranks (a DTensor): its local shard,
  summed over the mesh dims it is sharded on; where those dims take in the tensor-parallel
  (or context-parallel) ranks too (FSDP2 over dp x cp, the parameters whole on every cp
  rank), every rank's shard is its own and counts once, with no sum over that group;
- pipeline stages (``autotp.pipeline_stages``): each stage's parameters, summed over the
  pipeline ranks; a parameter several stages read (a tied embedding and head) has a copy in
  each, holding the same summed gradient, and counts in the first of them only.

Every rank then scales its pieces by the same ``max_norm / total`` (when below 1), so the
clipped gradients are the unsharded model's clipped gradients, sliced.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.sharded import ShardedModule, ShardedStage
from autotp.runtime.comm import sharded_groups, spans_group
from autotp.errors import ConfigError
from autotp.integrations.pipeline import wait_tied_grads
from autotp.layout import Shard


class _Piece(NamedTuple):
    grad: torch.Tensor
    sharded: bool  # the tensor-parallel ranks hold different pieces of it
    expert: bool  # split over the expert-parallel ranks


class _Holder(NamedTuple):
    """What one rank holds: its pieces and the groups they are spread over."""

    pieces: list[_Piece]
    comm: Any  # the tensor-parallel communicator
    ep_comm: Any
    pp_group: Optional[Any]  # the pipeline ranks, for stages


def clip_grad_norm_(module: Any, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``module`` in place so that the whole model's gradient norm is
    at most ``max_norm``; returns that norm before clipping (the same on every rank), as
    ``torch.nn.utils.clip_grad_norm_`` does for an unsharded model.

    ``module``: what ``autotp.parallelize`` returned, or this rank's stages from
    ``autotp.pipeline_stages`` (the list, or one stage when the rank holds one).

    Collective: call it on every rank of the tensor-parallel group (and of the expert-,
    data- and pipeline-parallel ranks the gradients are spread over) after backward, before
    the optimizer step. ``norm_type`` is any p > 0 or ``math.inf``."""
    holder = _holder(module)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ConfigError(f"norm_type must be positive or math.inf, got {norm_type}")
    grads = [piece.grad for piece in holder.pieces]
    total = _total_norm(holder, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite "
            f"({float(total)}): the parameters cannot be clipped by it")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def _holder(module: Any) -> _Holder:
    if isinstance(module, ShardedModule):
        return _Holder(_module_pieces(module), module.comm, module.ep_comm, None)
    stages = list(module) if isinstance(module, (list, tuple)) else [module]
    if not stages or not all(isinstance(s, ShardedStage) for s in stages):
        found = ", ".join(sorted({type(s).__name__ for s in stages})) or "an empty list"
        raise ConfigError(
            f"autotp.clip_grad_norm_ takes the module autotp.parallelize returned or this "
            f"rank's stages of autotp.pipeline_stages, got {found}; for an unsharded model "
            "use torch.nn.utils.clip_grad_norm_")
    wait_tied_grads()  # the tied copies' sums over the pipeline ranks (gloo) must be in
    part = stages[0].part  # the same for every stage of this rank
    pieces = [piece for stage in stages for piece in _stage_pieces(stage)]
    return _Holder(pieces, part.comm, part.ep_comm, part.pp_group)


def _module_pieces(module: ShardedModule) -> list[_Piece]:
    """Each parameter's local gradient tensor (a DTensor's local shard)."""
    params: list[tuple[str, nn.Parameter]] = list(module.local_parameters().items())
    params += [(name, module.program.get_parameter(name)) for name in module._unused]
    return _pieces(module.plan, params, module.ep_comm is not None)


def _stage_pieces(stage: ShardedStage) -> list[_Piece]:
    """A stage's parameters, a tied one only in the first stage that holds a copy."""
    part = stage.part
    params = []
    for name, param in stage.submod.named_parameters():
        plain = name.replace("_checkpoint_wrapped_module.", "")
        if part.first_holder.get(plain, stage.stage_index) == stage.stage_index:
            params.append((plain, param))
    return _pieces(part.plan, params, part.ep_comm is not None)


def _pieces(plan: Any, params: list[tuple[str, nn.Parameter]], ep: bool) -> list[_Piece]:
    experts = set(plan.expert_params) if ep else set()
    return [_Piece(param.grad, target in plan.params and
                   isinstance(plan.param_layout(target), Shard), target in experts)
            for target, param in params if param.grad is not None]


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _total_norm(holder: _Holder, p: float) -> torch.Tensor:
    infinite = math.isinf(p)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    first_tp_rank = holder.comm.rank == 0
    device = _local(holder.pieces[0].grad).device if holder.pieces else _device(holder)
    # one running value per set of groups the pieces must still be combined over
    buckets: dict[tuple[bool, tuple[Any, ...], bool], torch.Tensor] = {}
    for grad, sharded, expert in holder.pieces:
        local = _local(grad).detach().float()
        groups = tuple(sharded_groups(grad))
        within = spans_group(groups, holder.comm)  # FSDP2's shards span the tp group's ranks
        if infinite:
            value = local.abs().max() if local.numel() else torch.zeros((), device=device)
        else:
            value = local.norm(p).pow(p) if local.numel() else torch.zeros((), device=device)
            if not (sharded or expert or first_tp_rank or within):
                value = value * 0  # replicated: tp rank 0 counts it (every rank keeps the
                #                    bucket, so that all make the same collectives)
        key = (expert, groups, within)
        held = buckets.get(key)
        if held is None:
            buckets[key] = value.to(device)
        else:
            buckets[key] = torch.maximum(held, value) if infinite else held + value
    combined = torch.zeros((), device=device)
    # the ranks of one tp group (and one pipeline stage) hold the same buckets and walk them
    # in the same order: their collectives match
    for (expert, groups, within), value in sorted(
            buckets.items(), key=lambda kv: (kv[0][0], len(kv[0][1]), kv[0][2])):
        if not within:
            value = _over(holder.comm, value, infinite)
        if expert:
            value = _over(holder.ep_comm, value, infinite)
        for group in groups:
            value = value.clone()
            dist.all_reduce(value, op=op, group=group)
        combined = torch.maximum(combined, value) if infinite else combined + value
    if holder.pp_group is not None:  # one collective on every rank, whatever it holds
        dist.all_reduce(combined, op=op, group=holder.pp_group)
    return combined if infinite else combined.pow(1.0 / p)


def _device(holder: _Holder) -> torch.device:
    """Where the norm is computed when this rank holds no gradient: the pipeline group's
    device (NCCL's collectives take CUDA tensors only)."""
    if holder.pp_group is not None and dist.get_backend(holder.pp_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _over(comm: Any, value: torch.Tensor, infinite: bool) -> torch.Tensor:
    """``value`` combined over a communicator's ranks: the largest, or the sum."""
    if comm is None or comm.world_size == 1:
        return value
    if infinite:
        return comm.all_gather(value.reshape(1), 0).max()
    return comm.all_reduce(value.clone())
