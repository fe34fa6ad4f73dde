"""The user API: ``plan``, ``parallelize``, ``full_state_dict``, and the in-process simulation.

``parallelize`` is called on every rank of an initialized process group with the same model
(same weights) and returns this rank's module: the original call signature and outputs,
parameters replaced by their local shards.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autotp.capture import Captured, capture
from autotp.collectives import GradBucket, gather
from autotp.comm import Communicator, ProcessGroupComm, ThreadComm, ThreadHub
from autotp.errors import AutotpError, ConfigError
from autotp.layout import Shard
from autotp.planner.cost import CostModel
from autotp.planner.plan import Plan
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.rewrite import rewrite
from autotp.rules.registry import Registry


def _check_tp(tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive int, got {tp!r}")
    return tp


def _model_name(model: nn.Module) -> str:
    return type(model).__name__


def prepare(
    model: nn.Module,
    tp: int,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
    registry: Optional[Registry] = None,
) -> tuple[Captured, Plan]:
    tp = _check_tp(tp)
    captured = capture(model, example_args, example_kwargs)
    plan = plan_graph(captured, tp, registry=registry, cost_model=cost_model,
                      options=PlanOptions(strict=strict), model_name=_model_name(model))
    return captured, plan


def plan(
    model: nn.Module,
    tp: int,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
) -> Plan:
    """The tensor-parallel plan of ``model`` at degree ``tp``; needs no process group."""
    return prepare(model, tp, example_args=example_args, example_kwargs=example_kwargs,
                   strict=strict, cost_model=cost_model)[1]


class ShardedModule(nn.Module):
    """One rank's part of a tensor-parallel model. Call it like the original model."""

    def __init__(self, program: torch.fx.GraphModule, plan: Plan, captured: Captured,
                 comm: Communicator, bucket: GradBucket):
        super().__init__()
        self.program = program
        self.__dict__["plan"] = plan
        self.__dict__["comm"] = comm
        self.__dict__["_bucket"] = bucket
        self.__dict__["_signature"] = captured.signature
        self.__dict__["_example"] = captured.example_kwargs

    @property
    def rank(self) -> int:
        return self.comm.rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.program(**self._bind(args, kwargs))

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        signature: Optional[inspect.Signature] = self._signature
        if signature is not None:
            try:
                named = dict(signature.bind_partial(*args, **kwargs).arguments)
            except TypeError as exc:
                raise ConfigError(f"the call does not fit the model's signature: {exc}") from None
            for name, param in signature.parameters.items():
                if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                    named.update(named.pop(name))
        else:
            if args:
                raise ConfigError("this model was captured with keyword inputs only")
            named = dict(kwargs)
        extra = sorted(set(named) - set(self._example))
        if extra:
            raise ConfigError(
                f"the sharded model was traced without {extra}; pass them in example_kwargs "
                "to autotp.parallelize so that they are part of the traced program"
            )
        call = {}
        for name, example in self._example.items():
            if name in named:
                call[name] = named[name]
            elif isinstance(example, torch.Tensor):
                raise ConfigError(f"missing input {name!r} (the example had it)")
            else:
                call[name] = example
        return call

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Plan parameter name -> this rank's piece (the program's parameter)."""
        out = {}
        for target in self.plan.params:
            module: Any = self.program
            for part in target.split("."):
                module = getattr(module, part)
            out[target] = module
        return out


def _build(captured: Captured, plan: Plan, rank: int, comm: Communicator,
           registry: Optional[Registry] = None) -> ShardedModule:
    program, bucket = rewrite(captured, plan, rank, comm, registry)
    return ShardedModule(program, plan, captured, comm, bucket)


def parallelize(
    model: nn.Module,
    tp: Optional[int] = None,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
) -> ShardedModule:
    """This rank's tensor-parallel version of ``model`` (call on every rank of ``group``)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "autotp.parallelize needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first (use autotp.simulate for a "
            "single-process run)"
        )
    world = dist.get_world_size(group)
    tp = world if tp is None else _check_tp(tp)
    if tp != world:
        raise ConfigError(
            f"tp={tp} but the process group has {world} ranks: pass group= a tensor-parallel "
            f"group of {tp} ranks (e.g. from a DeviceMesh), or tp={world}"
        )
    captured, the_plan = prepare(model, tp, example_args=example_args,
                                 example_kwargs=example_kwargs, strict=strict,
                                 cost_model=cost_model)
    comm = ProcessGroupComm(group)
    return _build(captured, the_plan, comm.rank, comm)


def full_state_dict(sharded: ShardedModule, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded parameters (or their gradients) under every original name.

    Collective: call it on every rank. Tied weights appear under each of their names.
    """
    if not isinstance(sharded, ShardedModule):
        raise ConfigError(f"full_state_dict takes the module autotp returned, "
                          f"got {type(sharded).__name__}")
    out: dict[str, torch.Tensor] = {}
    plan = sharded.plan
    for target, local in sharded.local_parameters().items():
        tensor = local.grad if grads else local.detach()
        if tensor is None:
            tensor = torch.zeros_like(local)
        layout = plan.param_layout(target)
        if isinstance(layout, Shard):
            tensor = gather(sharded.comm, tensor.contiguous(), layout)
        for name in plan.params[target].names:
            out[name] = tensor.detach().clone()
    return out


@dataclass
class Simulation:
    """Every rank of a tp group as a thread of this process, with in-memory collectives."""

    plan: Plan
    ranks: list[ShardedModule]
    captured: Optional[Captured] = None

    @property
    def tp(self) -> int:
        return len(self.ranks)

    def run(self, fn: Callable[[ShardedModule], Any]) -> list[Any]:
        """Call ``fn(module)`` on every rank concurrently; returns the results in rank order."""
        results: list[Any] = [None] * self.tp
        errors: list[Optional[BaseException]] = [None] * self.tp

        def target(rank: int) -> None:
            try:
                results[rank] = fn(self.ranks[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors[rank] = exc
                comm = self.ranks[rank].comm
                if isinstance(comm, ThreadComm):
                    comm.abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"autotp-rank{r}")
                   for r in range(self.tp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not _is_abort(e)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


def _is_abort(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "did not reach the same collective" in str(exc)


def simulate(
    model: nn.Module,
    tp: int,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
    timeout: float = 120.0,
) -> Simulation:
    """Build all ``tp`` ranks of ``model`` in this process (the same rewritten programs as
    ``parallelize``), connected by in-memory collectives."""
    captured, the_plan = prepare(model, tp, example_args=example_args,
                                 example_kwargs=example_kwargs, strict=strict,
                                 cost_model=cost_model)
    hub = ThreadHub(tp, timeout)
    ranks = [_build(captured, the_plan, comm.rank, comm) for comm in hub.comms()]
    return Simulation(the_plan, ranks, captured)


__all__: Sequence[str] = [
    "AutotpError",
    "ShardedModule",
    "Simulation",
    "full_state_dict",
    "parallelize",
    "plan",
    "simulate",
]
