"""The user API: ``plan``, ``parallelize`` and the in-process simulation (``simulate``); the
module each rank gets is ``autotp.sharded.ShardedModule``.

``parallelize`` is called on every rank of an initialized process group with the same model
(same weights) and returns this rank's module: the original call signature and outputs,
parameters replaced by their local shards. Each entry point reads its parallel axes as one
``autotp.mesh.Mesh`` (``resolve_mesh``: from a DeviceMesh or the degrees and groups, checked
there) and its options as one ``autotp.options.Options``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autotp.progress import note
from autotp.capture.trace import Captured, capture
from autotp.runtime.async_tp import refuse_where_it_cannot_run
from autotp.runtime.comm import Communicator, ThreadComm
from autotp.errors import AutotpError, ConfigError
from autotp.layout import Layout
from autotp.mesh import Mesh, check_axes, plan_sharing, resolve_mesh
from autotp.options import (PARALLELIZING, PLANNING, SIMULATING, Options, gather_options,
                            takes_options)
from autotp.weights.materialize import (CheckpointWeights, InitWeights, ModelWeights, Weights,
                                has_meta_parameters, maybe_deferred)
from autotp.planner.context import plan_tp_cp
from autotp.planner.gradflow import check_gradient_flow
from autotp.planner.plan import Plan
from autotp.runtime.calls import Retracer, skeleton
from autotp.runtime.contract import describe
from autotp.sharded import (ModelInfo, ShardedModule, build_rank, expert_parameters,
                            finish_expert_gradients, full_state_dict)


def _model_name(model: nn.Module) -> str:
    return type(model).__name__


def _mesh(mesh: Any, tp: Optional[int], cp: Optional[int], ep: Optional[int],
          options: Options) -> Mesh:
    """The axes of a planned or simulated job: ``mesh`` an autotp Mesh (checked again) or
    a DeviceMesh (its sizes), else the degrees."""
    if isinstance(mesh, Mesh):
        check_axes(mesh, sequence_parallel=options.sequence_parallel)
        return mesh
    if mesh is None and tp is None:
        raise ConfigError("pass the tensor-parallel degree tp= (or a DeviceMesh as mesh=)")
    return resolve_mesh(mesh=mesh, tp=tp, cp=cp, ep=ep,
                        sequence_parallel=options.sequence_parallel)


@takes_options(PLANNING)
def prepare(model: nn.Module, tp: Optional[int] = None, *, mesh: Any = None,
            ep: Optional[int] = None, cp: Optional[int] = None, share: Any = None,
            model_name: Optional[str] = None, options: Optional[Options] = None,
            **keywords: Any) -> tuple[Captured, Plan]:
    """``model`` traced and planned: ``plan``'s capture beside its plan. ``share``: see
    ``plan_graph`` (one rank of a group plans); ``model_name``: what the plan calls the
    model (default its class)."""
    opts = gather_options(PLANNING, "prepare", options, keywords)
    return _prepare(model, _mesh(mesh, tp, cp, ep, opts), opts, share=share,
                    model_name=model_name)


def _prepare(model: nn.Module, the_mesh: Mesh, options: Options, *, share: Any = None,
             model_name: Optional[str] = None) -> tuple[Captured, Plan]:
    captured = capture(model, options.example_args, options.example_kwargs)
    for path, (traced, total) in captured.traced_layers.items():
        note(f"{path}: {traced} of {total} layers traced, the rest stamped from them")
    plan = plan_tp_cp(captured, the_mesh.tp, the_mesh.cp, options.plan_options(the_mesh.ep),
                      registry=options.registry, cost_model=options.cost_model,
                      model_name=model_name or _model_name(model), share=share)
    return captured, plan


@takes_options(PLANNING)
def plan(model: nn.Module, tp: Optional[int] = None, *, mesh: Any = None,
         ep: Optional[int] = None, cp: Optional[int] = None,
         options: Optional[Options] = None, **keywords: Any) -> Plan:
    """The tensor-parallel plan of ``model`` at degree ``tp`` (with ``ep``: experts also split
    over ep data-parallel ranks; with ``cp``: the sequence split over cp ranks, inside tp, or
    alone at tp 1); ``mesh``: a DeviceMesh whose dim sizes give the degrees. Needs no
    process group."""
    opts = gather_options(PLANNING, "plan", options, keywords)
    return _prepare(model, _mesh(mesh, tp, cp, ep, opts), opts)[1]


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
        return InitWeights(model, layouts, rank, plan.degree, device)
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


@takes_options(PARALLELIZING)
def parallelize(model: nn.Module, tp: Optional[int] = None, *, mesh: Any = None,
                group: Any = None, ep: Optional[int] = None, ep_group: Any = None,
                cp: Optional[int] = None, cp_group: Any = None,
                timeout: Optional[float] = 300.0, options: Optional[Options] = None,
                **keywords: Any) -> ShardedModule:
    """This rank's tensor-parallel version of ``model`` (call on every rank of the mesh).

    ``model`` holds real weights (the same on every rank), or none: built on the meta device
    (or with ``autotp.empty_weights()``) with ``checkpoint=`` or ``init=True``.

    ``mesh``: a DeviceMesh whose dims are named among "dp", "pp", "cp", "tp" and "ep", as
    torchtitan names them (``init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp", "cp",
    "tp"))``): autotp plans over "tp" and "cp" and splits experts over "ep"; "dp" is left to
    your FSDP2 (``fully_shard(layer, mesh=mesh["dp", "cp"]._flatten())``) or DDP, "pp" to
    ``autotp.pipeline_stages``. Or the groups one by one: ``group``, the tensor-parallel
    process group or 1-D DeviceMesh (default: the whole world); ``tp``, ``cp``, ``ep``:
    the degrees (checked against the groups; given alone, the world is split into tp groups
    of consecutive ranks and cp or ep groups across them).
    ``timeout``: seconds a collective may wait for the other ranks before raising; None
    waits forever.

    ``ep``, ``ep_group`` (or an "ep" dim): expert parallelism. A mixture-of-experts model's
    experts are also split over ep data-parallel ranks (e.g. ``mesh['dp']``, each rank with
    its own tokens): every rank holds e / (tp * ep) experts whole, the rows routed to an
    expert move to its rank and back by all-to-alls; the experts' gradients sum every ep
    rank's tokens (``ShardedModule.expert_parameters``, ``finish_expert_gradients``).

    ``cp``, ``cp_group`` (or a "cp" dim): context parallelism. Every rank of the cp group
    takes the same whole inputs and computes 1/cp of the sequence, chunks r and 2 cp - 1 - r
    of 2 cp on rank r; attention passes the key/value blocks around the group (ring
    attention, or Ulysses' all-to-alls where the plan says so: ``autotp.runtime.ring``);
    parameters are held as the tp plan holds them (whole at tp 1), their gradients summed
    over the group. Every sequence length must divide by 2 x cp. Not with ep, nor with
    sequence parallelism at tp 1.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "autotp.parallelize needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first (use autotp.simulate for a "
            "single-process run)"
        )
    opts = gather_options(PARALLELIZING, "parallelize", options, keywords)
    the_mesh = resolve_mesh(mesh=mesh, tp=tp, cp=cp, ep=ep, group=group, cp_group=cp_group,
                            ep_group=ep_group, sequence_parallel=opts.sequence_parallel,
                            distributed=True).connected(timeout)
    comms = the_mesh.rank_comms()
    if opts.async_tp:  # before tracing and planning, which can take minutes
        refuse_where_it_cannot_run(opts.compile, comms.comm, opts.sequence_parallel,
                                   _known_device(model, opts.device))
    # the group's rank 0 plans; the others check they traced the same program and receive it
    captured, the_plan = _prepare(model, the_mesh, opts, share=plan_sharing(comms.comm))
    if opts.check_plan:
        check_gradient_flow(the_plan, captured.gm)
    return _built(model, captured, the_plan, the_mesh, opts)


def _known_device(model: nn.Module, device: Any) -> Optional[torch.device]:
    """Where the rank's shards will live, where that is known before building: the
    ``device=`` given, or the model's own (not meta) device."""
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    return first.device if first is not None and first.device.type != "meta" else None


def _built(model: nn.Module, captured: Captured, the_plan: Plan, the_mesh: Mesh,
           options: Options) -> ShardedModule:
    """This rank's module of a planned model: its weights (the model's, a checkpoint's
    slices or initialized), placed on ``options.device`` where the model has none."""
    comms = the_mesh.rank_comms()
    meta = has_meta_parameters(model)
    device = options.device
    if device is None and meta:
        device = default_device()
    device = torch.device(device) if device is not None else None
    weights = maybe_deferred(_weights(model, captured, the_plan, comms.comm.rank,
                                      options.checkpoint, options.init, device))
    seed = None
    if options.checkpoint is not None:  # the ranks that compute one sample share its dropout
        on = device if device is not None and device.type == "cuda" else torch.device("cpu")
        for axis in the_mesh.sample_axes:
            assert axis.comm is not None
            seed = _agreed_seed(axis.comm, on, seed)
    try:
        sharded = build_rank(captured, the_plan, comms.comm.rank, comms.comm, weights=weights,
                             device=device if meta else None, seed=seed,
                             model_class=type(model), check_plan=options.check_plan,
                             cp_comm=comms.cp_comm, ep_comm=comms.ep_comm,
                             **options.build_options())
    finally:
        weights.close()
    _finish(sharded, model, options.strict, _retracer(model, the_mesh, options),
            the_mesh.mean_group)
    return sharded


def _retracer(model: nn.Module, the_mesh: Mesh, options: Options) -> Retracer:
    """What a call of another input structure is traced and planned with: the model's
    structure without its weights, the mesh's degrees and the options of the first plan."""
    return Retracer(skeleton(model), the_mesh.tp, the_mesh.cp,
                    options.plan_options(the_mesh.ep), registry=options.registry,
                    cost_model=options.cost_model, check_flow=options.check_plan,
                    model_name=_model_name(model))


def _finish(sharded: ShardedModule, model: nn.Module, strict: bool,
            retracer: Optional[Retracer], data_parallel: Any = None) -> None:
    """What the rank's module takes of the model besides its program: what saving needs,
    what Trainer reads (``autotp.runtime.contract``), and what tracing another structure needs."""
    sharded.source = ModelInfo.of(model)
    sharded.strict = strict
    sharded.retracer = retracer if retracer is not None and retracer.model is not None \
        else None
    describe(sharded, model, data_parallel)
    if data_parallel is not None:
        sharded.average_over(data_parallel)


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
        return self.plan.tp

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


@takes_options(SIMULATING)
def simulate(model: nn.Module, tp: Optional[int] = None, *, mesh: Any = None,
             ep: Optional[int] = None, cp: Optional[int] = None, timeout: float = 120.0,
             options: Optional[Options] = None, **keywords: Any) -> Simulation:
    """Build all ranks of ``model`` in this process (the same rewritten programs as
    ``parallelize``), connected by in-memory collectives: the tp ranks, and with ``ep``
    (expert parallelism over ep simulated data-parallel ranks) or ``cp`` (context
    parallelism: each rank takes the whole inputs and computes its share of the sequence)
    that many copies of them, rank ``c * tp + t`` tp rank t of copy c (at tp 1, the cp
    ranks alone). ``mesh``: a DeviceMesh whose dim sizes give the degrees."""
    opts = gather_options(SIMULATING, "simulate", options, keywords)
    the_mesh = _mesh(mesh, tp, cp, ep, opts)
    if opts.async_tp:  # before tracing and planning, which can take minutes
        refuse_where_it_cannot_run(opts.compile, None, opts.sequence_parallel)
    captured, the_plan = _prepare(model, the_mesh, opts)
    if opts.check_plan:
        check_gradient_flow(the_plan, captured.gm)
    ranks = []
    for rank_mesh in the_mesh.simulated(timeout):
        comms = rank_mesh.rank_comms()
        ranks.append(build_rank(captured, the_plan, comms.comm.rank, comms.comm,
                                cp_comm=comms.cp_comm, ep_comm=comms.ep_comm,
                                model_class=type(model), **opts.build_options()))
    retracer = _retracer(model, the_mesh, opts)
    for rank in ranks:  # one retracer: the ranks share each new structure's capture and plan
        _finish(rank, model, opts.strict, retracer)
    return Simulation(the_plan, ranks, captured)


__all__: Sequence[str] = [
    "AutotpError",
    "Options",
    "ShardedModule",
    "Simulation",
    "expert_parameters",
    "finish_expert_gradients",
    "full_state_dict",
    "parallelize",
    "plan",
    "simulate",
]
