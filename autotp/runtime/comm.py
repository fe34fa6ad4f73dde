"""Communicators: the collectives autotp needs, over a process group or over threads.

``ProcessGroupComm`` uses torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors).
``ThreadComm`` runs every rank as a thread of one process and exchanges tensors in memory;
the simulation uses it to check whole models cheaply and deterministically. Reductions sum
in rank order on every rank, so replicated results are bitwise identical across ranks.

Every executed collective is appended to the communicator's ``log`` with its phase and the
transformer layer it serves (the newest ``LOG_EVENTS`` kept) and counted in its totals by
phase and kind (calls and bytes, never dropped): tests count collectives from what actually
ran, and a long training run holds a bounded log. The collectives of a compiled program
(``compile=``) are not logged: they run inside its graphs, where the log's Python state is
not (``CollectiveLog.record`` does nothing while torch.compile traces).

Under torch.compile ``ProcessGroupComm`` issues traceable functional collectives
(``torch.ops._c10d_functional``: ``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``batch_p2p_ops``, each followed by
``wait_tensor``), addressed by the group's name, so that the compiled program holds them in
its graphs instead of breaking around them; its eager path is the one described below.

Copies: ``all_reduce`` reduces the caller's own buffer where the caller says it may
(``in_place=True``: a fresh tensor nothing else reads), else a copy of it; ``all_gather`` and
``reduce_scatter`` along a dim other than 0 go through the transport's dim-0 collectives with
one copy at most (none where the dims before it are all 1), never a copy on both sides.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

import autotp.errors as errors
from autotp.errors import AutotpError, ConfigError


@dataclass(frozen=True)
class CollectiveEvent:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | shift
    phase: str  # forward | backward
    layer: Optional[int]
    nbytes: int
    label: str


# the events a log keeps: the newest, so that a long training run holds a bounded log
LOG_EVENTS = 10_000


@dataclass
class CollectiveTotal:
    calls: int = 0
    nbytes: int = 0


@dataclass
class CollectiveLog:
    """The newest ``LOG_EVENTS`` collectives, and the totals of all of them since the last
    ``clear`` by (phase, kind)."""
    events: deque[CollectiveEvent] = field(default_factory=lambda: deque(maxlen=LOG_EVENTS))
    enabled: bool = True
    # its communicator's collectives may be traced by torch.compile (a process group's)
    traceable: bool = True
    totals: dict[tuple[str, str], CollectiveTotal] = field(default_factory=dict)

    def record(self, kind: str, phase: str, layer: Optional[int], nbytes: int, label: str) -> None:
        # traced by torch.compile: the program's graphs run the collective, the log is not
        # in them (a Python side effect would break the graph)
        if self.enabled and not (self.traceable and torch.compiler.is_compiling()):
            self.events.append(CollectiveEvent(kind, phase, layer, nbytes, label))
            total = self.totals.get((phase, kind))
            if total is None:
                total = self.totals[(phase, kind)] = CollectiveTotal()
            total.calls += 1
            total.nbytes += nbytes

    def clear(self) -> None:
        self.events.clear()
        self.totals.clear()

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
    # whether torch.compile can hold its collectives in a graph
    traceable: bool = False

    def all_reduce(self, tensor: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """The sum over ranks of ``tensor``. ``in_place``: the caller's tensor is a fresh
        buffer nothing else reads (not saved for backward, no view of a parameter): the sum
        may be written into it and it returned."""
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

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        """One step around the ring: ``tensor`` goes to rank + 1; the result is what rank - 1
        sent (context parallelism's key/value blocks). Every rank sends a tensor of the same
        shape and dtype."""
        raise NotImplementedError

    def start_shift(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``shift`` begun now and finished by calling what it returns, so that work between
        the two overlaps the transfer (the ring's next block travels while this one is
        computed). ``tensor`` must not change until then. Where the transport cannot wait
        apart from starting (threads), the shift is done here."""
        out = self.shift(tensor)
        return lambda: out


def tracing(comm: Communicator) -> bool:
    """Whether torch.compile is tracing a collective of ``comm`` now. (Its flag is one per
    process: while one simulated rank's thread compiles, another's eager code reads it set;
    a simulated rank's collectives are never traced.)"""
    return comm.traceable and torch.compiler.is_compiling()


_Forward = TypeVar("_Forward", bound=Callable[..., Any])


def compiled_where_traceable(forward: _Forward) -> _Forward:
    """A module's ``forward`` that torch.compile traces where the module's ``comm`` is
    ``traceable``, and runs eagerly otherwise (simulated ranks: one graph break around the
    whole module, its Python state, a shard keeper's record or a gradient bucket, kept as
    in an eager program)."""
    eager = torch.compiler.disable(forward)

    @functools.wraps(forward)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.comm.traceable:
            return forward(self, *args, **kwargs)
        return eager(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class CollectiveError(AutotpError, RuntimeError):
    """A collective did not complete: another rank failed, exited, or is stuck."""


class ProcessGroupComm(Communicator):
    traceable = True  # functional collectives under torch.compile

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
        # what traced collectives name
        whole = group if group is not None else dist.group.WORLD
        assert whole is not None  # get_rank above found the default group
        self.group_name = whole.group_name

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

    def _wait(self, work: Any, what: str, nccl: bool = False,
              timeout: Optional[float] = None) -> None:
        """Wait for an async collective, at most ``timeout`` seconds.

        NCCL: ``wait()`` only orders the current CUDA stream after the collective; the host
        goes on. ``wait(timeout)`` would block the host until the GPU has finished everything
        queued before the collective: a device synchronization at every collective. There
        the process group's own timeout (``init_process_group(timeout=...)``), enforced by
        NCCL's watchdog, bounds the wait instead."""
        timeout = self.timeout if timeout is None or self.timeout is None else timeout
        try:
            if timeout is None or nccl:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise several types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            limit = "" if timeout is None else f" within {timeout:g} s"
            raise CollectiveError(
                f"rank {self.rank}: {what} did not complete{limit}: another rank of the "
                f"tensor-parallel group failed, exited or is stuck ({first})"
            ) from exc

    def all_reduce(self, tensor: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        self._check_device(tensor)
        if torch.compiler.is_compiling():  # functional: a new tensor, whatever in_place says
            return _traced.wait_tensor(_traced.all_reduce(tensor, "sum", self.group_name))
        if in_place and tensor.is_contiguous():
            out = tensor
        else:  # c10d reduces in place: a contiguous copy, the caller's tensor untouched
            out = tensor.clone(memory_format=torch.contiguous_format)
        self._wait(dist.all_reduce(out, group=self.group, async_op=True), "all_reduce",
                   self._uses_nccl(out))
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._check_device(tensor)
        send = tensor.contiguous()
        shape = send.shape
        if torch.compiler.is_compiling():
            out = _traced.wait_tensor(_traced.all_gather_into_tensor(
                send if send.dim() else send.reshape(1), self.world_size, self.group_name))
        else:
            out = send.new_empty((self.world_size * shape[0], *shape[1:])) if send.dim() \
                else send.new_empty((self.world_size,))
            self._wait(_all_gather_single(out, send, group=self.group, async_op=True),
                       "all_gather", self._uses_nccl(send))
        if dim == 0 or not send.dim():
            return out
        if _leading_ones(shape, dim):  # the ranks' blocks lie end to end along dim too
            full = list(shape)
            full[dim] *= self.world_size
            return out.view(full)
        # the ranks' blocks, end to end along dim 0, side by side along dim: one copy
        # (contiguous, as views of it expect)
        return torch.cat(out.chunk(self.world_size, 0), dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self._check_device(tensor)
        shape = list(tensor.shape)
        shape[dim] //= self.world_size
        # rank r's block of dim as the r-th block of dim 0: one copy for a dim other than 0,
        # none where the dims before it are 1 (the blocks lie end to end already)
        if dim == 0:
            send = tensor.contiguous()
        elif _leading_ones(tensor.shape, dim):
            send = tensor.contiguous().view(self.world_size * shape[0], *shape[1:])
        else:
            send = torch.cat(tensor.chunk(self.world_size, dim), 0)
        if torch.compiler.is_compiling():
            return self._traced_reduce_scatter(send).view(shape)
        nccl = self._uses_nccl(send)
        if nccl or self.native_reduce_scatter:
            out = send.new_empty(shape)
            try:
                work = _reduce_scatter_single(out, send, group=self.group, async_op=True)
            except (RuntimeError, NotImplementedError, ValueError):
                if nccl:
                    raise
                # this gloo has no reduce-scatter of tensors (every rank learns so at once)
                self.native_reduce_scatter = False
                return self.reduce_scatter(tensor, dim)
            self._wait(work, "reduce_scatter", nccl=nccl)
            return out
        # older gloo has no reduce-scatter of tensors: all-reduce and keep the slice
        if send.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            send = send.clone()  # all_reduce works in place: never on the caller's tensor
        self._wait(dist.all_reduce(send, group=self.group, async_op=True), "reduce_scatter")
        return send.chunk(self.world_size, 0)[self.rank]

    def _traced_reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        """The functional reduce-scatter of ``send`` along dim 0; where this gloo has none
        (``native_reduce_scatter``, learnt by an eager call), the functional all-reduce and
        this rank's block of it: the same sums (a transport adds the same ranks' values),
        world_size times the bytes."""
        if self.native_reduce_scatter or self._uses_nccl(send):
            return _traced.wait_tensor(_traced.reduce_scatter_tensor(
                send, "sum", self.world_size, self.group_name))
        total = _traced.wait_tensor(_traced.all_reduce(send, "sum", self.group_name))
        return total.chunk(self.world_size, 0)[self.rank]

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]
                   ) -> torch.Tensor:
        self._check_device(tensor)
        if torch.compiler.is_compiling():
            return _traced.wait_tensor(_traced.all_to_all_single(
                tensor.contiguous(), list(recv), list(send), self.group_name))
        out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        self._wait(dist.all_to_all_single(out, tensor.contiguous(), recv, send,
                                          group=self.group, async_op=True),
                   "all_to_all", self._uses_nccl(out))
        return out

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.start_shift(tensor)()

    def start_shift(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_device(tensor)
        send = tensor.contiguous()
        if self.world_size == 1:
            out = send.clone()
            return lambda: out
        to, source = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        if torch.compiler.is_compiling():  # the wait where the caller finishes: it overlaps
            # traced point-to-point ops name the group's ranks
            sent, coming = _traced.batch_p2p_ops(["isend", "irecv"], [to, source], [0, 0],
                                                 [send, torch.empty_like(send)],
                                                 self.group_name)
            return lambda: (_traced.wait_tensor(sent), _traced.wait_tensor(coming))[1]
        if self.group is not None:  # eager point-to-point ops name global ranks
            to, source = dist.get_global_rank(self.group, to), \
                dist.get_global_rank(self.group, source)
        out = torch.empty_like(send)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to, self.group),
                                        dist.P2POp(dist.irecv, out, source, self.group)])

        def finish() -> torch.Tensor:
            for work in works:
                self._wait(work, "shift", self._uses_nccl(out))
            return out
        return finish

    def made_once(self, key: str, make: Callable[[], str]) -> str:
        """What ``make`` returns on rank 0, on every rank: rank 0 makes it (a plan, minutes
        of search for a large model) and sends its UTF-8 bytes; the others wait and receive
        them (plain bytes, never unpickled). ``key`` names what each rank would make (a
        hash of its inputs: the traced program, tp, the options): ranks whose keys differ
        would make different things, and every rank raises ConfigError saying which. An
        error of ``make`` on rank 0 is raised on every rank."""
        device = (torch.device("cuda", torch.cuda.current_device())
                  if self.backend == "nccl" else torch.device("cpu"))
        nccl = device.type == "cuda"
        mine = torch.tensor([[int(key[:15], 16), int(key[15:30], 16)]], dtype=torch.int64,
                            device=device)
        keys = [tuple(row) for row in self.all_gather(mine, 0).tolist()]
        if len(set(keys)) > 1:
            groups: dict[tuple, list[int]] = {}
            for rank, k in enumerate(keys):
                groups.setdefault(k, []).append(rank)
            raise ConfigError(
                f"the ranks traced different programs ({len(groups)} kinds: ranks "
                f"{' / '.join(str(ranks) for ranks in groups.values())}): call the same "
                "model with the same tp, options and example inputs on every rank")
        failure: Optional[BaseException] = None
        if self.rank == 0:
            try:
                text = make()
                status = 0
            except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then raised
                failure = exc
                text = f"{type(exc).__module__}.{type(exc).__qualname__}\n{exc}"
                status = 1
            payload = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)
            header = torch.tensor([status, payload.numel()], dtype=torch.int64, device=device)
        else:
            header = torch.zeros(2, dtype=torch.int64, device=device)
        # rank 0 may search for minutes before it sends: the others wait up to an hour (a
        # rank that exits closes its connections, which ends the wait at once)
        self._wait(dist.broadcast(header, group_src=0, group=self.group, async_op=True),
                   "waiting for rank 0's plan", nccl, timeout=max(self.timeout or 0, 3600.0))
        status, length = header.tolist()
        if self.rank != 0:
            payload = torch.empty(length, dtype=torch.uint8, device=device)
        self._wait(dist.broadcast(payload, group_src=0, group=self.group, async_op=True),
                   "receiving rank 0's plan", nccl)
        if failure is not None:
            raise failure
        text = bytes(payload.cpu().tolist()).decode() if self.rank != 0 else text
        if status:
            raise _remote_error(text)
        return text


def _leading_ones(shape: Sequence[int], dim: int) -> bool:
    """Every dim before ``dim`` has size 1: blocks of ``dim`` lie end to end in memory, as
    blocks of dim 0 do."""
    return all(size == 1 for size in shape[:dim])


def _remote_error(text: str) -> Exception:
    """Rank 0's error, ``module.Class\nmessage``, as raised on another rank: autotp's own
    errors as themselves, anything else as an AutotpError that names it."""
    name, _, message = text.partition("\n")
    module, _, cls = name.rpartition(".")
    found = getattr(errors, cls, None) if module == errors.__name__ else None
    if isinstance(found, type) and issubclass(found, AutotpError):
        return found(message)
    return AutotpError(f"rank 0 of the tensor-parallel group failed to plan: {name}: {message}")


# newer torch names these *_single (the *_into_tensor / *_tensor forms are deprecated
# there); older releases (2.11 included) have only the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# traceable collectives (``torch.distributed._functional_collectives``' ops): each returns a
# tensor that ``wait_tensor`` completes
_traced = torch.ops._c10d_functional


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
    """One simulated rank. Its exchanges wait on a barrier, which no graph holds: under
    torch.compile each collective runs eagerly, with a graph break around it (the
    simulation checks values; a compiled program's graphs are a process group's)."""

    def __init__(self, hub: ThreadHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.log = CollectiveLog(traceable=False)

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

    @torch.compiler.disable
    def all_reduce(self, tensor: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        def total(parts: list) -> torch.Tensor:
            out = parts[0].clone()
            for part in parts[1:]:
                out += part
            return out

        out = self._exchange(tensor, total)
        if in_place and tensor.is_contiguous():  # as a process group does: the caller's buffer
            return tensor.copy_(out)
        return out

    @torch.compiler.disable
    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return self._exchange(tensor, lambda parts: torch.cat(parts, dim=dim))

    @torch.compiler.disable
    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        total = self.all_reduce(tensor)
        return total.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    @torch.compiler.disable
    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]
                   ) -> torch.Tensor:
        def mine(parts: list) -> torch.Tensor:
            return torch.cat([rows.split(splits)[self.rank] for rows, splits in parts])

        out = self._exchange((tensor, list(send)), mine)
        if out.shape[0] != sum(recv):
            raise RuntimeError(f"simulated rank {self.rank}: {out.shape[0]} rows arrived, "
                               f"{sum(recv)} expected")
        return out

    @torch.compiler.disable
    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        source = (self.rank - 1) % self.world_size
        return self._exchange(tensor, lambda parts: parts[source].clone())

    def abort(self) -> None:
        self.hub.barrier.abort()


def sharded_groups(tensor: Any) -> list[Any]:
    """The process groups of the mesh dims a DTensor (FSDP2's parameter or gradient) is
    sharded on; none for a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard as DShard

    if not isinstance(tensor, DTensor):
        return []
    return [tensor.device_mesh.get_group(dim) for dim, placement in
            enumerate(tensor.placements) if isinstance(placement, DShard)]


def spans_group(groups: Sequence[Any], comm: Optional[Communicator]) -> bool:
    """Whether the process groups ``groups`` (FSDP2's sharded mesh dims) take in every rank
    of ``comm``'s group: FSDP2 over dp x cp holds each cp rank's shard apart and sums over
    the cp ranks itself."""
    if not groups or comm is None or comm.world_size == 1 or \
            not isinstance(comm, ProcessGroupComm):
        return False  # simulated ranks: no process group, no FSDP2 over them
    ranks = set(dist.get_process_group_ranks(comm.group) if comm.group is not None
                else range(dist.get_world_size()))
    held = {r for group in groups for r in dist.get_process_group_ranks(group)}
    return ranks <= held
