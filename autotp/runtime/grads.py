"""Gradients as the tools around the model read them.

A rank holds a piece of a sharded parameter's gradient. Tools written for one device
(``torch.nn.utils.clip_grad_norm_``, accelerate's and transformers' Trainer's clipping,
Lightning's) measure ``parameters()``'s gradients with ``torch._foreach_norm`` or
``torch.linalg.vector_norm``: on the pieces, that is each rank's own norm, different on
every rank, and the clipping it decides is wrong and differs between ranks that must stay
equal. Two mechanisms keep such tools exact:

- ``ShardGrad``: after each backward, the gradient of a parameter split over groups of ranks
  is marked as a piece (the same tensor, viewed as a ``ShardGrad`` that knows its groups).
  A norm of a list of gradients (or of one) then counts each piece's ``|g|^p`` summed over
  its groups: the whole model's norm, the same on every rank, as DTensor's gradients give.
  Every other op sees a plain tensor and returns one. Collective: every rank of the groups
  must take the norm (clipping does); a norm on one rank alone waits for the others.
- ``DataParallelMean``: where the tensor-parallel group is an axis of a DeviceMesh with a
  "dp" axis and no wrapper reduces over it (transformers' Trainer leaves a tensor-parallel
  model unwrapped, as it does its own), the gradients are averaged over "dp" after each
  backward, as DDP would. Averaging is idempotent: a later mean or sum over the same ranks
  (a manual all-reduce) gives what it gave before.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.runtime.comm import Communicator

_ENGINE = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


class ShardGrad(torch.Tensor):
    """One rank's piece of a gradient split over ``over`` (communicators): its norm is the
    whole gradient's. Any other op treats it as a plain tensor."""

    over: tuple[Communicator, ...]

    @classmethod
    def of(cls, grad: torch.Tensor, over: tuple[Communicator, ...]) -> "ShardGrad":
        piece = grad.as_subclass(cls)
        piece.over = over
        return piece

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        whole = _NORMS.get(func)
        if whole is not None:
            found = whole(*args, **kwargs)
            if found is not None:
                return found
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, ShardGrad) else tensor


def _order(ord: Any) -> float:
    return math.inf if ord in ("inf", math.inf) else float(ord)


def _whole_norms(tensors: Sequence[torch.Tensor], ord: Any = 2.0) -> list[torch.Tensor]:
    """Each tensor's norm of order ``ord``; a ``ShardGrad``'s over all of its pieces (one
    collective per set of groups)."""
    p = _order(ord)
    plain = [_plain(t) for t in tensors]
    with torch._C.DisableTorchFunctionSubclass():
        norms = list(torch._foreach_norm(plain, p)) if plain else []
    by_groups: dict[tuple[int, ...], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, ShardGrad):
            by_groups.setdefault(tuple(id(c) for c in tensor.over), []).append(index)
    for indices in by_groups.values():
        over = tensors[indices[0]].over  # type: ignore[attr-defined]
        stacked = torch.stack([norms[i].float() for i in indices])
        if math.isinf(p):
            for comm in over:
                stacked = comm.all_gather(stacked.unsqueeze(0), 0).amax(0)
        else:
            stacked = stacked.pow(p)
            for comm in over:
                stacked = comm.all_reduce(stacked, in_place=True)  # our own buffer
            stacked = stacked.pow(1.0 / p)
        for slot, i in enumerate(indices):
            norms[i] = stacked[slot].to(norms[i].dtype)
    return norms


def _foreach_norm(tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: Any = None
                  ) -> Optional[list[torch.Tensor]]:
    if dtype is not None:
        return None
    return _whole_norms(tensors, ord)


def _vector_norm(tensor: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False,
                 *, dtype: Any = None, out: Any = None) -> Optional[torch.Tensor]:
    if dim is not None or dtype is not None or out is not None or \
            not isinstance(tensor, ShardGrad):
        return None  # a norm along dims is a norm of this piece's rows
    return _whole_norms([tensor], ord)[0]


def _tensor_norm(tensor: torch.Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False,
                 dtype: Any = None, out: Any = None) -> Optional[torch.Tensor]:
    if p == "fro":
        p = 2.0
    if isinstance(p, str) or dim is not None or dtype is not None or out is not None or \
            not isinstance(tensor, ShardGrad):
        return None
    return _whole_norms([tensor], p)[0]


_NORMS: dict[Any, Callable[..., Optional[Any]]] = {
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch.norm: _tensor_norm,
    torch.Tensor.norm: _tensor_norm,
}


def mark_pieces(params: Iterable[tuple[nn.Parameter, tuple[Communicator, ...]]]) -> None:
    """After each backward, the gradient of every ``(param, over)`` is its ``ShardGrad``
    (``over``: the communicators it is split over; a parameter split over none is left
    out). Held as a hook of the parameter: FSDP2, which swaps in its own parameters, holds
    DTensor gradients, which know their placement already."""
    for param, over in params:
        if not over or not param.requires_grad:
            continue

        def mark(param: torch.Tensor, over: tuple[Communicator, ...] = over) -> None:
            if type(param.grad) is torch.Tensor:
                param.grad = ShardGrad.of(param.grad, over)

        param.register_post_accumulate_grad_hook(mark)


class DataParallelMean:
    """Averages the gradients of ``params`` over ``group`` (the mesh's "dp" axis) at the end
    of each backward of a forward that ``arm`` armed (so a pipeline stage's backward, or a
    backward under DDP or FSDP2, which reduce over "dp" themselves, is left alone)."""

    def __init__(self, group: Any, params: Sequence[nn.Parameter],
                 before: Callable[[], None] = lambda: None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.params = list(params)
        # what completes the gradients first: the tp bucket's sums of replicated parameters'
        # partial gradients (a sequence-parallel norm's), which this mean may run before
        self.before = before
        self.armed = False
        self.queued = False
        for param in self.params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._ready)

    def arm(self) -> None:
        self.armed = True

    def _ready(self, param: torch.Tensor) -> None:
        if self.armed and not self.queued:
            self.queued = True
            _ENGINE.queue_callback(self.average)

    def average(self) -> None:
        self.queued = False
        self.armed = False
        self.before()
        grads = [p.grad for p in self.params if p.grad is not None and
                 not isinstance(p.grad, DTensor)]
        if not grads:
            return
        for bucket in _buckets([_plain(g) for g in grads]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _buckets(grads: list[torch.Tensor], limit: int = 64 * 2**20) -> list[list[torch.Tensor]]:
    """``grads`` in runs of one dtype and device of at most ``limit`` bytes (one tensor
    larger than that alone): one all-reduce each, without a copy of every gradient at
    once."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        last = out[-1] if out else None
        if last is None or last[0].dtype != g.dtype or last[0].device != g.device or \
                size + g.numel() * g.element_size() > limit:
            out.append([g])
            size = g.numel() * g.element_size()
        else:
            last.append(g)
            size += g.numel() * g.element_size()
    return out


def data_parallel_group(group: Any) -> Optional[Any]:
    """The process group of the "dp" axis of the DeviceMesh that ``group`` (a 1-D mesh, the
    tensor-parallel axis) was cut from, when it has one larger than 1; else None."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group, DeviceMesh):
        return None
    try:
        root = group._get_root_mesh()
    except AttributeError:
        return None
    names = root.mesh_dim_names or ()
    if "dp" not in names or root.size(names.index("dp")) == 1:
        return None
    return root["dp"].get_group()
