"""The user API: ``plan``, ``parallelize`` and the in-process simulation (``simulate``); the
module each rank gets is ``autotp.sharded.ShardedModule``.

``parallelize`` is called on every rank of an initialized process group with the same model
(same weights) and returns this rank's module: the original call signature and outputs,
parameters replaced by their local shards.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autotp.capture.trace import Captured, capture
from autotp.runtime.comm import Communicator, ProcessGroupComm, ThreadComm, ThreadHub
from autotp.errors import AutotpError, ConfigError
from autotp.layout import Layout
from autotp.ops import positive_int
from autotp.weights.materialize import (CheckpointWeights, InitWeights, ModelWeights, Weights,
                                has_meta_parameters, maybe_deferred)
from autotp.planner.context import plan_tp_cp
from autotp.planner.cost import CostModel
from autotp.planner.gradflow import check_gradient_flow
from autotp.planner.plan import Plan
from autotp.planner.solve import PlanOptions
from autotp.runtime.calls import Retracer, skeleton
from autotp.runtime.contract import describe
from autotp.runtime.grads import data_parallel_group
from autotp.rules.registry import Registry
from autotp.sharded import (ModelInfo, ShardedModule, build_rank, expert_parameters,
                            finish_expert_gradients, full_state_dict, process_group)


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
    sequence_parallel: bool = False,
    gather_outputs: bool = True,
    ep: int = 1,
    share: Any = None,
    cp: int = 1,
) -> tuple[Captured, Plan]:
    """``model`` traced and planned; ``share``: see ``plan_graph`` (one rank of a group
    plans). ``cp`` > 1: the group is a context-parallel group of cp ranks (tp 1)."""
    tp = positive_int("tp", tp)
    ep = positive_int("ep", ep)
    cp = positive_int("cp", cp)
    if cp > 1 and (ep != 1 or (sequence_parallel and tp == 1)):
        raise ConfigError("context parallelism shards the sequence itself: pass no ep with "
                          "cp, and sequence_parallel only with tp > 1")
    captured = capture(model, example_args, example_kwargs)
    options = PlanOptions(strict=strict, sequence_parallel=bool(sequence_parallel),
                          gather_outputs=bool(gather_outputs), expert_parallel=ep)
    plan = plan_tp_cp(captured, tp, cp, options, registry=registry, cost_model=cost_model,
                      model_name=_model_name(model), share=share)
    return captured, plan


def plan(
    model: nn.Module,
    tp: int,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
    sequence_parallel: bool = False,
    gather_outputs: bool = True,
    ep: int = 1,
    cp: int = 1,
) -> Plan:
    """The tensor-parallel plan of ``model`` at degree ``tp`` (with ``ep``: experts also split
    over ep data-parallel ranks; with ``cp`` and tp 1: the sequence split over cp ranks);
    needs no process group."""
    return prepare(model, tp, example_args=example_args, example_kwargs=example_kwargs,
                   strict=strict, cost_model=cost_model, sequence_parallel=sequence_parallel,
                   gather_outputs=gather_outputs, ep=ep, cp=cp)[1]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _weights(model: nn.Module, captured: Captured, plan: Plan, rank: int,
             checkpoint: Any, init: bool, device: Optional[torch.device]) -> Weights:
    if checkpoint is not None and init:
        raise ConfigError("pass checkpoint= or init=True, not both")
    if checkpoint is not None:
        names: dict[str, Sequence[str]] = {t: list(captured.aliases.get(t, [t]))
                                           for t in plan.params}
        names.update({n: [n] for n in captured.unused})
        return CheckpointWeights(checkpoint, model, names, device)
    if init:
        layouts: dict[str, tuple[Sequence[str], Layout]] = {
            t: (captured.aliases.get(t, [t]), plan.param_layout(t)) for t in plan.params}
        return InitWeights(model, layouts, rank, plan.tp, device)
    if has_meta_parameters(model):
        raise ConfigError(
            f"{type(model).__name__} is on the meta device (no weights): pass "
            "checkpoint=PATH (safetensors) to load each rank's slices, or init=True to "
            "initialize them with the model's own initializers")
    return ModelWeights(model, device)


def _agreed_seed(comm: Communicator, device: torch.device, seed: Optional[int] = None) -> int:
    """Rank 0's seed (this rank's ``seed``, default its initial one), for the replicated
    dropout stream: ranks that load their weights from a file need not have been seeded
    alike."""
    seed = torch.initial_seed() if seed is None else seed
    mine = torch.tensor([seed % 2**62], dtype=torch.int64, device=device)
    return int(comm.all_gather(mine, 0)[0].item())


def parallelize(
    model: nn.Module,
    tp: Optional[int] = None,
    *,
    example_args: Optional[tuple[Any, ...]] = None,
    example_kwargs: Optional[dict[str, Any]] = None,
    group: Any = None,
    strict: bool = True,
    cost_model: Optional[CostModel] = None,
    timeout: Optional[float] = 300.0,
    check_plan: bool = True,
    grad_sync: str = "bucket",
    sequence_parallel: bool = False,
    keep_gathered: bool = False,
    gather_outputs: bool = True,
    compile: Any = False,
    checkpoint: Any = None,
    init: bool = False,
    device: Any = None,
    ep: Optional[int] = None,
    ep_group: Any = None,
    cp: Optional[int] = None,
    cp_group: Any = None,
) -> ShardedModule:
    """This rank's tensor-parallel version of ``model`` (call on every rank of ``group``).

    ``model`` holds real weights (the same on every rank), or none: built on the meta device
    (or with ``autotp.empty_weights()``), with ``checkpoint=`` a safetensors file or
    directory from which each rank reads only its slices, or ``init=True`` to run the
    model's own initializers one module at a time, keeping only the local slices.
    ``device``: where the local shards live (default for a meta model: ``cuda:LOCAL_RANK``
    where CUDA is available, else the CPU; for a real model, where its weights are).

    ``sequence_parallel``: between the blocks, activations are sharded along the sequence
    (norms, dropout and residual adds run on sequence shards; all-gather before and
    reduce-scatter after the sharded matmuls instead of all-reduces). The sequence length of
    every call must then be divisible by tp. What autograd saves of a gathered input (the
    input of each column-parallel product) is kept as this rank's sequence shard and
    all-gathered again in backward, as Megatron-LM does.
    ``keep_gathered``: True keeps the gathered inputs for backward instead (more activation
    memory, one all-gather fewer per gathered input in backward).
    ``gather_outputs``: False returns outputs that the plan holds sharded (logits, sharded
    over the vocabulary) as this rank's shard; ``module.plan.outputs`` gives their layouts.
    With ``labels=`` the loss never needs the gathered logits: training loops that only read
    the loss should pass False and save the all-gather of batch x sequence x vocabulary.
    ``compile``: True (or a dict of ``torch.compile`` options, e.g. ``{"mode":
    "max-autotune"}``) compiles this rank's program; collectives stay eager.

    ``group``: the tensor-parallel process group, or a 1-D DeviceMesh (``mesh["tp"]`` of a
    (dp, tp) mesh); default: the whole world.
    ``timeout``: seconds a collective may wait for the other ranks before raising (a rank
    that failed or exited makes the others fail instead of hang); None waits forever.
    ``check_plan``: before building, prove that every parameter's gradient arrives whole in
    its own layout (``autotp.planner.gradflow``; ``GradientFlowError`` otherwise); on the
    first call, check that every rank holds the same plan. False skips both.
    ``grad_sync``: "bucket" sums the partial gradients of replicated parameters (k/v
    projections when tp exceeds the k/v heads) in one all-reduce after backward, into
    ``.grad``; "per_use" all-reduces them inside autograd, for ``torch.autograd.grad`` and
    for DDP/FSDP wrapped around the sharded module.

    ``ep``, ``ep_group``: expert parallelism. A mixture-of-experts model's experts are also
    split over ``ep`` data-parallel ranks (``ep_group``, e.g. ``mesh["dp"]``; each rank
    with its own tokens): every rank holds e / (tp * ep) experts whole, and the rows routed
    to an expert move to the rank that owns it and back by all-to-alls. Without groups, the
    world's tp * ep ranks are split into tp groups of consecutive ranks. The experts'
    gradients sum every ep rank's tokens: see ``ShardedModule.expert_parameters`` and
    ``finish_expert_gradients``.

    ``cp``, ``cp_group``: context parallelism: every rank of ``cp_group`` takes the same
    whole inputs and computes 1/cp of the sequence, chunks r and 2 cp - 1 - r of 2 cp on
    rank r (the same causal work on every rank); attention passes the key/value blocks
    around the group (ring attention, or Ulysses' all-to-alls where the plan says so:
    ``autotp.runtime.context``), parameters are held as the tp plan holds them (whole at tp
    1) and their gradients summed over the group. The sequence length of every call must be
    divisible by 2 x cp. With tp 1 (the default with cp) the cp group defaults to the whole
    world; with tp > 1 pass ``group=`` and ``cp_group=`` (``mesh["tp"]``, ``mesh["cp"]``),
    or neither: the world's tp * cp ranks form tp groups of consecutive ranks and cp groups
    across them. Not with sequence parallelism or ep.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "autotp.parallelize needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first (use autotp.simulate for a "
            "single-process run)"
        )
    cp = 1 if cp is None else positive_int("cp", cp)
    if cp > 1:
        return _context_parallel(model, cp, process_group(cp_group), tp, process_group(group), ep,
                                 example_args=example_args, example_kwargs=example_kwargs,
                                 strict=strict, cost_model=cost_model, timeout=timeout,
                                 check_plan=check_plan, grad_sync=grad_sync,
                                 sequence_parallel=sequence_parallel,
                                 gather_outputs=gather_outputs, compile=compile,
                                 keep_gathered=keep_gathered, checkpoint=checkpoint,
                                 init=init, device=device)
    if cp_group is not None:
        raise ConfigError("cp_group= without cp=: pass cp, the size of the group")
    mesh_group, group = group, process_group(group)
    group, ep_group = _expert_groups(tp, ep, group, process_group(ep_group))
    world = dist.get_world_size(group)
    tp = world if tp is None else positive_int("tp", tp)
    if tp != world:
        raise ConfigError(
            f"tp={tp} but the process group has {world} ranks: pass group= a tensor-parallel "
            f"group of {tp} ranks (e.g. from a DeviceMesh), or tp={world}"
        )
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    comm = ProcessGroupComm(group, timeout=timeout)
    # the group's rank 0 plans; the others check they traced the same program and receive it
    captured, the_plan = prepare(model, tp, example_args=example_args,
                                 example_kwargs=example_kwargs, strict=strict,
                                 cost_model=cost_model, sequence_parallel=sequence_parallel,
                                 gather_outputs=gather_outputs, ep=ep,
                                 share=comm.made_once if tp > 1 else None)
    if check_plan:
        check_gradient_flow(the_plan, captured.gm)
    ep_comm = ProcessGroupComm(ep_group, timeout=timeout) if ep > 1 else None
    retracer = _retracer(model, tp, 1, the_plan, strict=strict,
                         sequence_parallel=sequence_parallel, gather_outputs=gather_outputs,
                         cost_model=cost_model, check_plan=check_plan)
    return _built(model, captured, the_plan, comm, checkpoint=checkpoint, init=init,
                  device=device, strict=strict, check_plan=check_plan, grad_sync=grad_sync,
                  compile=compile, keep_gathered=keep_gathered, ep_comm=ep_comm,
                  retracer=retracer,
                  data_parallel=data_parallel_group(mesh_group) if ep == 1 else None)


def _built(model: nn.Module, captured: Captured, the_plan: Plan, comm: Communicator, *,
           checkpoint: Any, init: bool, device: Any, strict: bool, retracer: Retracer,
           data_parallel: Any = None, **build_options: Any) -> ShardedModule:
    """This rank's module of a planned model: its weights (the model's, a checkpoint's
    slices or initialized), placed on ``device`` where the model has none."""
    meta = has_meta_parameters(model)
    if device is None and meta:
        device = default_device()
    device = torch.device(device) if device is not None else None
    weights = maybe_deferred(
        _weights(model, captured, the_plan, comm.rank, checkpoint, init, device))
    seed = None
    if checkpoint is not None:
        on = device if device is not None and device.type == "cuda" else torch.device("cpu")
        seed = _agreed_seed(comm, on)
        if build_options.get("cp_comm") is not None:  # and rank 0's of the tp groups too
            seed = _agreed_seed(build_options["cp_comm"], on, seed)
    try:
        sharded = build_rank(captured, the_plan, comm.rank, comm, weights=weights,
                             device=device if meta else None, seed=seed,
                             model_class=type(model), **build_options)
    finally:
        weights.close()
    _finish(sharded, model, strict, retracer, data_parallel)
    sharded.placed_on = device if meta else None
    return sharded


def _retracer(model: nn.Module, tp: int, cp: int, the_plan: Plan, *, strict: bool,
              sequence_parallel: bool, gather_outputs: bool, cost_model: Optional[CostModel],
              registry: Optional[Registry] = None, check_plan: bool = True) -> Retracer:
    """What a call of another input structure is traced and planned with: the model's
    structure without its weights, and the options of the first plan."""
    options = PlanOptions(strict=strict, sequence_parallel=bool(sequence_parallel),
                          gather_outputs=bool(gather_outputs), expert_parallel=the_plan.ep)
    return Retracer(skeleton(model), tp, cp, options, registry=registry,
                    cost_model=cost_model, check_flow=check_plan,
                    model_name=_model_name(model))


def _finish(sharded: ShardedModule, model: nn.Module, strict: bool,
            retracer: Optional[Retracer], data_parallel: Any = None) -> None:
    """What the rank's module takes of the model besides its program: what saving needs,
    what Trainer reads (``runtime.contract``), and what tracing another structure needs."""
    sharded.source = ModelInfo.of(model)
    sharded.strict = strict
    sharded.retracer = retracer if retracer is not None and retracer.model is not None \
        else None
    describe(sharded, model, data_parallel)
    if data_parallel is not None:
        sharded.average_over(data_parallel)


def _context_parallel(model: nn.Module, cp: int, cp_group: Any, tp: Optional[int], group: Any,
                      ep: Optional[int], **options: Any) -> ShardedModule:
    """``parallelize`` with context parallelism: with tp 1, the plan of the cp group, built
    as a tensor-parallel group's is; with tp > 1, the tp plan over ``group`` with a cp plan
    inside it over ``cp_group`` (``planner/context.py``)."""
    if ep not in (None, 1):
        raise ConfigError("cp with ep: expert parallelism across context-parallel ranks is "
                          "not there yet; pass no ep")
    tp = 1 if tp is None and group is None else tp
    group, cp_group = _context_groups(tp, cp, group, cp_group)
    world = dist.get_world_size(cp_group)
    if world != cp:
        raise ConfigError(f"cp={cp} but the context-parallel group has {world} ranks: pass "
                          f"cp_group= a group of {cp} ranks (e.g. mesh['cp']), or cp={world}")
    size = 1 if group is None else dist.get_world_size(group)
    tp = size if tp is None else positive_int("tp", tp)
    if tp != size:
        raise ConfigError(f"tp={tp} with cp={cp}, but the tensor-parallel group has {size} "
                          f"ranks: pass group= a group of {tp} ranks (e.g. mesh['tp']), or "
                          f"tp={size}")
    timeout = options.pop("timeout")
    cp_comm = ProcessGroupComm(cp_group, timeout=timeout)
    comm = cp_comm if tp == 1 else ProcessGroupComm(group, timeout=timeout)
    check_plan = options.pop("check_plan")
    cost_model = options.pop("cost_model")
    sequence_parallel = options.pop("sequence_parallel")
    gather_outputs = options.pop("gather_outputs")
    captured, the_plan = prepare(
        model, tp, cp=cp, example_args=options.pop("example_args"),
        example_kwargs=options.pop("example_kwargs"), strict=options["strict"],
        cost_model=cost_model, sequence_parallel=sequence_parallel,
        gather_outputs=gather_outputs, share=comm.made_once)
    if check_plan:
        check_gradient_flow(the_plan, captured.gm)
    retracer = _retracer(model, tp, cp, the_plan, strict=options["strict"],
                         sequence_parallel=sequence_parallel, gather_outputs=gather_outputs,
                         cost_model=cost_model, check_plan=check_plan)
    return _built(model, captured, the_plan, comm, checkpoint=options["checkpoint"],
                  init=options["init"], device=options["device"], strict=options["strict"],
                  check_plan=check_plan, grad_sync=options["grad_sync"],
                  compile=options["compile"], keep_gathered=options["keep_gathered"],
                  cp_comm=cp_comm if tp > 1 else None, retracer=retracer)


def _context_groups(tp: Optional[int], cp: int, group: Any, cp_group: Any
                    ) -> tuple[Any, Any]:
    """The tp group (None with tp 1) and the cp group. Given neither, the world's tp * cp
    ranks form tp groups of consecutive ranks and cp groups of the ranks at the same place
    in each, tp innermost as in a (dp, cp, tp) mesh (collective: every rank creates every
    group)."""
    if tp == 1:
        if group is not None:
            raise ConfigError("group= with tp=1 and cp: the cp group is cp_group=")
        return None, cp_group
    if group is not None and cp_group is not None:
        return group, cp_group
    if group is not None or cp_group is not None:
        raise ConfigError("tp with cp: pass both group= and cp_group= (e.g. mesh['tp'] and "
                          "mesh['cp'] of a (dp, cp, tp) DeviceMesh), or neither to split the "
                          "world")
    return _split_world(tp, cp, "cp")


def _split_world(tp: Optional[int], outer: int, name: str) -> tuple[Any, Any]:
    """The world's tp * ``outer`` ranks as tp groups of consecutive ranks and groups of the
    ranks at the same place in each (``name``: "ep" or "cp"), tp by default the rest of the
    world (collective)."""
    world = dist.get_world_size()
    tp = world // outer if tp is None else positive_int("tp", tp)
    if tp * outer != world:
        raise ConfigError(f"tp={tp} x {name}={outer} = {tp * outer} ranks, but the world has "
                          f"{world}: pass tp and {name} whose product is {world}, or group= "
                          f"and {name}_group=")
    return _grid_groups(tp, outer)


def _grid_groups(inner: int, outer: int) -> tuple[Any, Any]:
    """This rank's group of ``inner`` consecutive ranks and its group of the ``outer`` ranks
    at its place in each (collective: every rank creates every group, in the same order)."""
    world, rank = inner * outer, dist.get_rank()
    mine: Any = None
    mine_outer: Any = None
    for first in range(0, world, inner):
        made = dist.new_group(list(range(first, first + inner)))
        if first <= rank < first + inner:
            mine = made
    for offset in range(inner):
        made = dist.new_group(list(range(offset, world, inner)))
        if rank % inner == offset:
            mine_outer = made
    return mine, mine_outer


def _expert_groups(tp: Optional[int], ep: Optional[int], group: Any, ep_group: Any
                   ) -> tuple[Any, Any]:
    """The tp group and the ep group (None without expert parallelism). Given ``ep`` and no
    groups, the world's tp * ep ranks form tp groups of consecutive ranks and ep groups of
    the ranks at the same place in each (collective: every rank creates every group)."""
    if ep is not None:
        ep = positive_int("ep", ep)
    if ep_group is not None:
        size = dist.get_world_size(ep_group)
        if ep is not None and ep != size:
            raise ConfigError(f"ep={ep} but ep_group has {size} ranks: pass ep={size}, or an "
                              f"ep_group of {ep} ranks")
        if group is None:  # the default group, the world, would hold the ep ranks' tokens too
            raise ConfigError("with ep_group=, pass group= too: the tensor-parallel ranks "
                              "(e.g. mesh['tp'] beside mesh['dp'])")
        return group, ep_group
    if ep is None or ep == 1:
        return group, None
    if group is not None:
        raise ConfigError(f"ep={ep} with a tp group= needs ep_group=, the ranks the experts "
                          "are split over (e.g. mesh['dp'] of a (dp, tp) DeviceMesh)")
    return _split_world(tp, ep, "ep")


@dataclass
class Simulation:
    """Every rank of a tp group (with expert parallelism, of ep tp groups: rank
    ``e * tp + r`` is tp rank r of ep rank e) as a thread of this process, with in-memory
    collectives."""

    plan: Plan
    ranks: list[ShardedModule]
    captured: Optional[Captured] = None

    @property
    def tp(self) -> int:
        return len(self.ranks) // self.plan.ep // self.plan.cp

    def run(self, fn: Callable[[ShardedModule], Any]) -> list[Any]:
        """Call ``fn(module)`` on every rank concurrently; returns the results in rank order."""
        world = len(self.ranks)
        results: list[Any] = [None] * world
        errors: list[Optional[BaseException]] = [None] * world
        for rank_module in self.ranks:
            for comm in (rank_module.comm, rank_module.ep_comm, rank_module.cp_comm):
                if isinstance(comm, ThreadComm):
                    comm.hub.barrier.reset()  # a failed earlier run may have broken it

        def target(rank: int) -> None:
            try:
                # Backward of CUDA tensors runs on autograd's worker thread for the device,
                # one per process and shared by every simulated rank: a rank waiting in a
                # collective there would keep the other ranks' backward from running. Each
                # rank runs its own backward in its own thread instead.
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = fn(self.ranks[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors[rank] = exc
                for comm in (self.ranks[rank].comm, self.ranks[rank].ep_comm,
                             self.ranks[rank].cp_comm):
                    if isinstance(comm, ThreadComm):
                        comm.abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"autotp-rank{r}")
                   for r in range(world)]
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
    grad_sync: str = "bucket",
    sequence_parallel: bool = False,
    keep_gathered: bool = False,
    gather_outputs: bool = True,
    compile: Any = False,
    registry: Optional[Registry] = None,
    check_plan: bool = True,
    ep: int = 1,
    cp: int = 1,
) -> Simulation:
    """Build all ``tp`` ranks of ``model`` in this process (the same rewritten programs as
    ``parallelize``), connected by in-memory collectives. ``registry``: the rules (default
    ``Registry.default()``), e.g. one without some op's rule to exercise the fallback.
    ``check_plan``: prove first that every parameter's gradient arrives whole in its own
    layout (``autotp.planner.gradflow``), as ``parallelize`` does. ``ep``: expert
    parallelism over ep simulated data-parallel ranks too (tp * ep threads). ``cp``: context
    parallelism over cp simulated ranks: each takes the whole inputs and computes its share
    of the sequence (with tp > 1, tp * cp threads: rank ``c * tp + t`` is tp rank t of cp
    rank c)."""
    ep = positive_int("ep", ep)
    captured, the_plan = prepare(model, tp, example_args=example_args,
                                 example_kwargs=example_kwargs, strict=strict,
                                 cost_model=cost_model, registry=registry,
                                 sequence_parallel=sequence_parallel,
                                 gather_outputs=gather_outputs, ep=ep, cp=cp)
    asked_tp = tp
    tp = the_plan.tp
    if check_plan:
        check_gradient_flow(the_plan, captured.gm)
    retracer = _retracer(model, asked_tp, cp, the_plan, strict=strict,
                         sequence_parallel=sequence_parallel, gather_outputs=gather_outputs,
                         cost_model=cost_model, registry=registry, check_plan=check_plan)
    ranks = []
    if the_plan.context is not None:  # rank c * tp + t: tp rank t of cp rank c
        cp_hubs = [ThreadHub(cp, timeout) for _ in range(tp)]
        for c in range(cp):
            for comm in ThreadHub(tp, timeout).comms():
                ranks.append(build_rank(captured, the_plan, comm.rank, comm, registry=registry,
                                        grad_sync=grad_sync, compile=compile,
                                        keep_gathered=keep_gathered,
                                        cp_comm=ThreadComm(cp_hubs[comm.rank], c),
                                        model_class=type(model)))
    ep_hubs = [ThreadHub(ep, timeout) for _ in range(tp)] if ep > 1 else []
    for e in range(ep if the_plan.context is None else 0):
        for comm in ThreadHub(tp, timeout).comms():
            ranks.append(build_rank(captured, the_plan, comm.rank, comm, registry=registry,
                                grad_sync=grad_sync, compile=compile,
                                keep_gathered=keep_gathered,
                                ep_comm=ThreadComm(ep_hubs[comm.rank], e) if ep > 1 else None,
                                model_class=type(model)))
    for rank in ranks:  # one retracer: the ranks share each new structure's capture and plan
        _finish(rank, model, strict, retracer)
    return Simulation(the_plan, ranks, captured)


__all__: Sequence[str] = [
    "AutotpError",
    "ShardedModule",
    "Simulation",
    "expert_parameters",
    "finish_expert_gradients",
    "full_state_dict",
    "parallelize",
    "plan",
    "simulate",
]
