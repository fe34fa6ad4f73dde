"""Communicators: the collectives autotp needs, over a process group or over threads.

``ProcessGroupComm`` uses torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors).
``ThreadComm`` runs every rank as a thread of one process and exchanges tensors in memory;
the simulation uses it to check whole models cheaply and deterministically. Reductions sum
in rank order on every rank, so replicated results are bitwise identical across ranks.

Every executed collective is appended to the communicator's ``log`` with its phase and the
transformer layer it serves: tests count collectives from what actually ran.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from autotp.errors import AutotpError, ConfigError


@dataclass(frozen=True)
class CollectiveEvent:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    phase: str  # forward | backward
    layer: Optional[int]
    nbytes: int
    label: str


@dataclass
class CollectiveLog:
    events: list[CollectiveEvent] = field(default_factory=list)
    enabled: bool = True

    def record(self, kind: str, phase: str, layer: Optional[int], nbytes: int, label: str) -> None:
        if self.enabled:
            self.events.append(CollectiveEvent(kind, phase, layer, nbytes, label))

    def clear(self) -> None:
        self.events.clear()

    def count(self, phase: str, layer: Optional[int] = None, kind: Optional[str] = None,
              any_layer: bool = False) -> int:
        return sum(
            1 for e in self.events
            if e.phase == phase and (any_layer or e.layer == layer)
            and (kind is None or e.kind == kind)
        )


class Communicator:
    rank: int
    world_size: int
    log: CollectiveLog

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
        raise NotImplementedError

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/world_size slice of ``dim``."""
        raise NotImplementedError

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]
                   ) -> torch.Tensor:
        """Rows ``tensor[sum(send[:d]) : sum(send[:d + 1])]`` go to rank d; the result holds
        the ``recv[s]`` rows from each rank s, in rank order (expert dispatch)."""
        raise NotImplementedError


class CollectiveError(AutotpError, RuntimeError):
    """A collective did not complete: another rank failed, exited, or is stuck."""


class ProcessGroupComm(Communicator):
    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 timeout: Optional[float] = None):
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # gloo in recent torch reduce-scatters tensors natively; older gloo: all-reduce + slice
        self.native_reduce_scatter = True
        self.log = CollectiveLog()

    def _check_device(self, tensor: torch.Tensor) -> None:
        # gloo takes CUDA tensors too (staged through host memory): slower than NCCL, but it
        # runs several ranks on one GPU, which NCCL refuses
        if self.backend == "nccl" and tensor.device.type != "cuda":
            raise ConfigError(
                f"the process group uses NCCL but the model runs on {tensor.device}: move the "
                "model and inputs to this rank's GPU, or use a gloo group for CPU"
            )

    def _uses_nccl(self, tensor: torch.Tensor) -> bool:
        """Whether the collective on ``tensor`` runs on NCCL: a CUDA tensor on any backend
        but gloo ("nccl", "cpu:gloo,cuda:nccl", or the default group of init_process_group()
        without a backend)."""
        return tensor.device.type == "cuda" and self.backend != "gloo"

    def _wait(self, work: Any, what: str, nccl: bool = False) -> None:
        """Wait for an async collective, at most ``timeout`` seconds.

        NCCL: ``wait()`` only orders the current CUDA stream after the collective; the host
        goes on. ``wait(timeout)`` would block the host until the GPU has finished everything
        queued before the collective: a device synchronization at every collective. There
        the process group's own timeout (``init_process_group(timeout=...)``), enforced by
        NCCL's watchdog, bounds the wait instead."""
        try:
            if self.timeout is None or nccl:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise several types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            limit = "" if self.timeout is None else f" within {self.timeout:g} s"
            raise CollectiveError(
                f"rank {self.rank}: {what} did not complete{limit}: another rank of the "
                f"tensor-parallel group failed, exited or is stuck ({first})"
            ) from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check_device(tensor)
        out = tensor.contiguous().clone()
        self._wait(dist.all_reduce(out, group=self.group, async_op=True), "all_reduce",
                   self._uses_nccl(out))
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._check_device(tensor)
        moved = tensor.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * self.world_size, *moved.shape[1:]))
        self._wait(_all_gather_single(out, moved, group=self.group, async_op=True),
                   "all_gather", self._uses_nccl(moved))
        return out.movedim(0, dim).contiguous()  # views of it must work as in the original

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._check_device(tensor)
        moved = tensor.movedim(dim, 0).contiguous()
        nccl = self._uses_nccl(moved)
        if nccl or self.native_reduce_scatter:
            out = moved.new_empty((moved.shape[0] // self.world_size, *moved.shape[1:]))
            try:
                work = _reduce_scatter_single(out, moved, group=self.group, async_op=True)
            except (RuntimeError, NotImplementedError, ValueError):
                if nccl:
                    raise
                # this gloo has no reduce-scatter of tensors (every rank learns so at once)
                self.native_reduce_scatter = True
                return self.reduce_scatter(tensor, dim)
            self._wait(work, "reduce_scatter", nccl=nccl)
        else:  # older gloo has no reduce-scatter of tensors: all-reduce and keep the slice
            if moved.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                moved = moved.clone()  # all_reduce works in place: never on the caller's tensor
            self._wait(dist.all_reduce(moved, group=self.group, async_op=True), "reduce_scatter")
            out = moved.chunk(self.world_size, dim=0)[self.rank]
        return out.movedim(0, dim).contiguous()


    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]
                   ) -> torch.Tensor:
        self._check_device(tensor)
        out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        self._wait(dist.all_to_all_single(out, tensor.contiguous(), recv, send,
                                          group=self.group, async_op=True),
                   "all_to_all", self._uses_nccl(out))
        return out


# newer torch names these *_single (the *_into_tensor / *_tensor forms are deprecated
# there); older releases (2.11 included) have only the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ThreadHub:
    """The meeting point of the ranks of one simulated group."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size)
        self.slots: list[object] = [None] * world_size

    def comms(self) -> list["ThreadComm"]:
        return [ThreadComm(self, rank) for rank in range(self.world_size)]


class ThreadComm(Communicator):
    def __init__(self, hub: ThreadHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.log = CollectiveLog()

    def _exchange(self, obj: object, combine: Any = list) -> Any:
        """Publish ``obj``; ``combine`` reads every rank's object while all ranks wait, so no
        rank can change its tensor before the others have used it."""
        hub = self.hub
        hub.slots[self.rank] = obj
        try:
            hub.barrier.wait(hub.timeout)
            got = combine(list(hub.slots))
            hub.barrier.wait(hub.timeout)
        except threading.BrokenBarrierError:
            raise RuntimeError(
                f"simulated rank {self.rank}: another rank failed or did not reach the same "
                f"collective within {hub.timeout:.0f} s"
            ) from None
        return got

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        def total(parts: list) -> torch.Tensor:
            out = parts[0].clone()
            for part in parts[1:]:
                out += part
            return out

        return self._exchange(tensor, total)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return self._exchange(tensor, lambda parts: torch.cat(parts, dim=dim))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        total = self.all_reduce(tensor)
        return total.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]
                   ) -> torch.Tensor:
        def mine(parts: list) -> torch.Tensor:
            return torch.cat([rows.split(splits)[self.rank] for rows, splits in parts])

        out = self._exchange((tensor, list(send)), mine)
        if out.shape[0] != sum(recv):
            raise RuntimeError(f"simulated rank {self.rank}: {out.shape[0]} rows arrived, "
                               f"{sum(recv)} expected")
        return out

    def abort(self) -> None:
        self.hub.barrier.abort()
