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
  summed over the mesh dims it is sharded on.

Every rank then scales its pieces by the same ``max_norm / total`` (when below 1), so the
clipped gradients are the unsharded model's clipped gradients, sliced.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autotp.api import ShardedModule
from autotp.errors import ConfigError
from autotp.layout import Shard


def clip_grad_norm_(module: ShardedModule, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``module`` (what ``autotp.parallelize`` returned) in place so
    that the whole model's gradient norm is at most ``max_norm``; returns that norm before
    clipping (the same on every rank), as ``torch.nn.utils.clip_grad_norm_`` does for an
    unsharded model.

    Collective: call it on every rank of the tensor-parallel group (and of the expert- and
    data-parallel ranks the gradients are spread over) after backward, before the optimizer
    step. ``norm_type`` is any p > 0 or ``math.inf``."""
    if not isinstance(module, ShardedModule):
        raise ConfigError(
            f"autotp.clip_grad_norm_ takes the module autotp.parallelize returned, got "
            f"{type(module).__name__}; for an unsharded model use "
            "torch.nn.utils.clip_grad_norm_")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ConfigError(f"norm_type must be positive or math.inf, got {norm_type}")
    pieces = _pieces(module)
    grads = [grad for grad, _, _ in pieces]
    if not grads:
        return torch.tensor(0.0)
    total = _total_norm(module, pieces, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite "
            f"({float(total)}): the parameters cannot be clipped by it")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def _pieces(module: ShardedModule) -> list[tuple[torch.Tensor, bool, bool]]:
    """Each parameter's local gradient tensor (a DTensor's local shard), whether the tensor-
    parallel ranks hold different pieces of it, and whether it is an expert split over ep."""
    plan = module.plan
    experts = set(plan.expert_params) if module.ep_comm is not None else set()
    out: list[tuple[torch.Tensor, bool, bool]] = []
    params: list[tuple[str, nn.Parameter]] = list(module.local_parameters().items())
    params += [(name, module.program.get_parameter(name)) for name in module._unused]
    for target, param in params:
        if param.grad is None:
            continue
        sharded = target in plan.params and isinstance(plan.param_layout(target), Shard)
        out.append((param.grad, sharded, target in experts))
    return out


def _local(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


def _sharded_mesh_groups(grad: torch.Tensor) -> list[Any]:
    """The process groups of the mesh dims a DTensor gradient is sharded on (FSDP2)."""
    from torch.distributed.tensor import DTensor, Shard as DShard

    if not isinstance(grad, DTensor):
        return []
    return [grad.device_mesh.get_group(dim) for dim, placement in enumerate(grad.placements)
            if isinstance(placement, DShard)]


def _total_norm(module: ShardedModule, pieces: list[tuple[torch.Tensor, bool, bool]],
                p: float) -> torch.Tensor:
    import torch.distributed as dist

    infinite = math.isinf(p)
    first_tp_rank = module.comm.rank == 0
    device = _local(pieces[0][0]).device
    # one running value per set of groups the pieces must still be combined over
    buckets: dict[tuple[bool, tuple[Any, ...]], torch.Tensor] = {}
    for grad, sharded, expert in pieces:
        local = _local(grad).detach().float()
        if infinite:
            value = local.abs().max() if local.numel() else torch.zeros((), device=device)
        else:
            value = local.norm(p).pow(p) if local.numel() else torch.zeros((), device=device)
            if not (sharded or expert or first_tp_rank):
                value = value * 0  # replicated: tp rank 0 counts it (every rank keeps the
                #                    bucket, so that all make the same collectives)
        key = (expert, tuple(_sharded_mesh_groups(grad)))
        held = buckets.get(key)
        if held is None:
            buckets[key] = value.to(device)
        else:
            buckets[key] = torch.maximum(held, value) if infinite else held + value
    combined = torch.zeros((), device=device)
    # every rank walks the same buckets in the same order: the collectives match
    for (expert, groups), value in sorted(buckets.items(), key=lambda kv: (kv[0][0],
                                                                            len(kv[0][1]))):
        value = _over(module.comm, value, infinite)
        if expert:
            value = _over(module.ep_comm, value, infinite)
        for group in groups:
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            value = value.clone()
            dist.all_reduce(value, op=op, group=group)
        combined = torch.maximum(combined, value) if infinite else combined + value
    return combined if infinite else combined.pow(1.0 / p)


def _over(comm: Any, value: torch.Tensor, infinite: bool) -> torch.Tensor:
    """``value`` combined over a communicator's ranks: the largest, or the sum."""
    if comm is None or comm.world_size == 1:
        return value
    if infinite:
        return comm.all_gather(value.reshape(1), 0).max()
    return comm.all_reduce(value.clone())
