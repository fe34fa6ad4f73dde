"""Count the collectives one training step executes, and the memory it allocates.

``StepProbe`` is a ``TorchDispatchMode``: it sees every ATen op, including the c10d ops that
``torch.distributed.all_reduce`` and friends dispatch (``torch.ops.c10d.*``, Megatron's and
autotp's collectives, also when they run inside an autograd Function's backward) and the
functional collectives DTensor uses (``torch.ops._c10d_functional.*``). For ops on DTensors
it returns ``NotImplemented`` first, so that DTensor desugars them into local ops and
collectives, which the probe then sees (as ``CommDebugMode`` does).

The caller sets ``probe.phase`` ("forward", "backward", "optimizer") as the step proceeds.

Bytes of a collective: all-reduce, the tensor; all-gather, the gathered (full) tensor;
reduce-scatter, the full input; other kinds, the tensors passed in.

Memory: the peak, during the probed region, of the bytes of storages created by ops inside it
(activations, gradients, temporaries, collective buffers) that are still alive; storages that
existed before (parameters, optimizer state, inputs) are not counted. It needs no allocator
support, so it works on CPU, where torch keeps no allocation statistics.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# op schema name -> collective kind
COLLECTIVE_KINDS: dict[str, str] = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::allgather_": "all_gather",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_coalesced_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
    "c10d::scatter_": "scatter",
    "c10d::gather_": "gather",
    "c10d::reduce_": "reduce",
    "c10d::alltoall_": "all_to_all",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::barrier": "barrier",
    "c10d::send": "send",
    "c10d::recv_": "recv",
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_reduce_": "all_reduce",
    "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "_c10d_functional::all_reduce_coalesced_": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_gather_into_tensor_out": "all_gather",
    "_c10d_functional::all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional::broadcast": "broadcast",
    "_c10d_functional::broadcast_": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    phase: str
    kind: str
    nbytes: int
    op: str


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def collective_bytes(op: str, args: tuple, kind: str) -> int:
    """Payload of one collective call (see the module docstring for the convention)."""
    if op == "_c10d_functional::all_gather_into_tensor":
        return _nbytes(args[0]) * int(args[1])  # (input, group_size, group_name)
    if op == "_c10d_functional::all_gather_into_tensor_coalesced":
        return _nbytes(args[0]) * int(args[1])
    if kind == "all_gather" and op.startswith("c10d::"):
        return _nbytes(args[0])  # (outputs, inputs, ...): the gathered tensors
    if kind == "reduce_scatter" and op.startswith("c10d::"):
        return _nbytes(args[1])  # (outputs, inputs, ...): the full inputs
    return _nbytes(args[0])


class StepProbe(TorchDispatchMode):
    """Collectives and allocated memory of the ops run under it (one training step)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.calls: list[CollectiveCall] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[int, weakref.ref]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first; its local ops come back here
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload):
            op = func._schema.name
            kind = COLLECTIVE_KINDS.get(op)
            if kind is not None:
                self.calls.append(CollectiveCall(self.phase, kind,
                                                 collective_bytes(op, args, kind), op))
            self._track(args, kwargs, out)
        return out

    def _track(self, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = {ptr for ptr, _ in map(_storage, _tensors((args, kwargs))) if ptr}
        for t in _tensors(out):
            ptr, storage = _storage(t)
            if storage is None:
                continue
            nbytes = storage.nbytes()
            if ptr in inputs or ptr in self._live or nbytes == 0:
                continue  # a view or in-place result, or already counted
            self._live[ptr] = (nbytes, weakref.ref(storage, partial(self._freed, ptr)))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, ptr: int, _ref: weakref.ref) -> None:
        entry = self._live.pop(ptr, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    # ---- summaries --------------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, int]]:
        """phase -> kind -> number of calls."""
        out: dict[str, Counter] = {}
        for call in self.calls:
            out.setdefault(call.phase, Counter())[call.kind] += 1
        return {phase: dict(sorted(c.items())) for phase, c in sorted(out.items())}

    def bytes(self) -> dict[str, dict[str, int]]:
        """phase -> kind -> bytes moved (payload)."""
        out: dict[str, Counter] = {}
        for call in self.calls:
            out.setdefault(call.phase, Counter())[call.kind] += call.nbytes
        return {phase: dict(sorted(c.items())) for phase, c in sorted(out.items())}


def _storage(t: torch.Tensor) -> tuple[int, Optional[torch.UntypedStorage]]:
    """(data pointer, storage) of a plain tensor; (0, None) for one without real storage
    (DTensor wrappers, meta tensors, functional-collective placeholders)."""
    if isinstance(t, DTensor) or t.device.type == "meta":
        return 0, None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage
    except (RuntimeError, NotImplementedError):
        return 0, None
