"""Pipeline stages: the rank program cut between its layers, one pipelining stage per part.

``autotp.pipeline_stages`` builds this rank's tensor-parallel program over the mesh's "tp"
dim (``parallelize``), cuts the root graph between the calls of its layers (``split_layers``
gives them; the cutting: ``autotp.integrations.cut``) and returns this rank's parts as
``torch.distributed.pipelining`` ``PipelineStage``s over the "pp" dim. Any of torch's
schedules runs them; autotp writes no schedule of its own.

    mesh = init_device_mesh("cuda", (pp, tp), mesh_dim_names=("pp", "tp"))
    stages = autotp.pipeline_stages(model, mesh, stages_per_rank=2, example_kwargs=...)
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(input_ids, target=labels)       # first stage: inputs; last: the loss

What a stage computes is where the program computes it: glue between layers runs where its
inputs are ready, so the embedding and everything derived from the inputs alone (position
embeddings, masks) run in the first stage, and the final norm and head in the last. Every
tensor a later stage reads travels with the activations, passed on by the stages between.
Sizes (SymInts) never travel: a stage re-reads them from a tensor it holds that has the same
size. Parameters go to the stages that read them; one read by several stages (tied
embeddings) has a copy in each, and the copies' gradients are summed after the last
backward of a step (``perform_reduce_grad``, ``_TiedGrads``).

Stage boundaries: ``split_points`` (the index of the first layer of each stage but the
first), or chosen so that the heaviest stage does the least work, counted as the weight
elements its matrix products read (the first and last stages carry the embedding and head).
Stages sit on the pp ranks in a loop (``s % pp``) or folded back as a V (``placement="v"``).

A model with real weights: the stages are checked once on construction; chained on the
example, they give the program's own first output. A model without weights (built under
``autotp.empty_weights()``, with ``checkpoint=`` or ``init=True``): the program is built with
meta parameters and each rank materializes only its own stages' slices (with
``checkpoint=`` it reads only those; ``init=True`` runs the initializers of the whole
modules it touches); the stages' shapes are then measured by running the example through
the stages where they live.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autotp.api import parallelize
from autotp.errors import ConfigError
from autotp.integrations.cut import cut, layer_calls, stage_bounds
from autotp.ops import path_attr
from autotp.sharded import ShardedStage, StagePart
from autotp.weights.materialize import DeferredWeights, deferred_weights, has_meta_parameters


def pipeline_stages(model: nn.Module, mesh: Any, *, stages_per_rank: int = 1,
                    split_points: Optional[Sequence[int]] = None, placement: str = "loop",
                    example_args: Optional[tuple[Any, ...]] = None,
                    example_kwargs: Optional[dict[str, Any]] = None,
                    **parallelize_options: Any) -> list[Any]:
    """This rank's pipeline stages of ``model``, tensor-parallel over ``mesh["tp"]``.

    ``mesh``: a DeviceMesh with dims "pp" and "tp" (and "dp", which the stages leave to the
    caller's FSDP2). ``stages_per_rank``: virtual stages per rank, for the interleaved and
    looped schedules. ``placement``: ``"loop"``, stage ``s`` on pp rank ``s % pp`` (GPipe,
    1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), or ``"v"``, two stages per
    rank folded back (rank ``r`` holds ``r`` and ``2 pp - 1 - r``: ZBVZeroBubble,
    DualPipeV). ``split_points``: the first layer
    of every stage but the first (``[4, 8, 12]`` for four stages of 16 layers); default:
    balanced by the cost model. The example (``example_args``/``example_kwargs``, default:
    from the model's config) is one microbatch: its shapes are the shapes the stages send.
    The first stage takes the model's tensor inputs positionally, in the order of
    ``forward``'s signature; the last returns the model's first output (logits).
    ``parallelize_options`` go to ``autotp.parallelize`` (default ``grad_sync="per_use"``:
    partial gradients are summed inside autograd, which pipelining's backward runs).
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names or "tp" not in names:
        raise ConfigError(f"pipeline_stages needs a DeviceMesh with dims 'pp' and 'tp', got "
                          f"{names or type(mesh).__name__}: init_device_mesh(device, (pp, tp), "
                          "mesh_dim_names=('pp', 'tp'))")
    if stages_per_rank < 1:
        raise ConfigError(f"stages_per_rank must be at least 1, got {stages_per_rank}")
    if placement not in ("loop", "v") or (placement == "v" and stages_per_rank != 2):
        raise ConfigError(f"placement must be 'loop' or 'v' (with stages_per_rank=2), got "
                          f"{placement!r} with stages_per_rank={stages_per_rank}")
    pp_mesh, tp_mesh = mesh["pp"], mesh["tp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    count = pp * stages_per_rank
    parallelize_options.setdefault("grad_sync", "per_use")
    parallelize_options.setdefault("check_plan", True)
    # a model without weights (empty_weights, checkpoint= or init=): the program is built
    # with meta parameters and each rank then reads only its own stages' slices
    deferring: contextlib.AbstractContextManager[list[DeferredWeights]] = \
        deferred_weights() if has_meta_parameters(model) else contextlib.nullcontext([])
    with deferring as deferred:
        sharded = parallelize(model, group=tp_mesh, example_args=example_args,
                              example_kwargs=example_kwargs, **parallelize_options)
        if not sharded._plan_checked:
            sharded.check_plan()
        program = sharded.program
        layers = layer_calls(program)
        if len(layers) < count:
            raise ConfigError(
                f"{count} pipeline stages (pp={pp} x stages_per_rank={stages_per_rank}) need "
                f"at least {count} layers; the model has {len(layers)} "
                f"{'(its blocks are not an nn.ModuleList)' if not layers else ''}".rstrip())
        bounds = stage_bounds(program, layers, count, split_points)
        parts = cut(program, layers, bounds, sharded._example)
        rank_of = [_rank_of(s, pp, placement) for s in range(count)]
        mine = [s for s in range(count) if rank_of[s] == pp_rank]
        if deferred:
            _load(parts, mine, deferred[0])
            metas = _measure_across(sharded, parts, rank_of, pp_mesh)
        else:
            metas = _check_and_measure(sharded, parts)
    ties = _TiedGrads(parts, mine, mesh, rank_of)
    # what every stage holds of the sharded model (autotp.clip_grad_norm_, expert_parameters)
    part = StagePart(sharded.plan, sharded.comm, sharded.ep_comm, pp_mesh.get_group(),
                     ties.first_holder)
    device, stage_class = sharded._device(), _stage_class()
    return [stage_class(parts[index], index, count, device, input_args=metas[index][0],
                        output_args=metas[index][1], group=pp_mesh.get_group(), part=part,
                        ties=ties)
            for index in mine]


def stage_layers(stage: Any) -> list[nn.Module]:
    """The layer modules a stage calls, in order, at the original blocks' paths inside
    ``stage.submod`` (for ``fully_shard`` or activation checkpointing per layer): each
    layer's rank program, or what wraps it once it has been wrapped."""
    module = stage.submod if hasattr(stage, "submod") else stage
    return [module.get_submodule(name) for name in module.meta["autotp_layers"]]


# ---- metadata, check and ties --------------------------------------------------------------


def _check_and_measure(sharded: Any, parts: list[fx.GraphModule]
                       ) -> dict[int, tuple[Any, Any]]:
    """Chain every stage on the example (all ranks of the tp group do, so its collectives
    match), compare with the program's own output, and keep each stage's inputs and outputs
    as meta tensors for PipelineStage (shapes, dtypes, whether they carry gradients)."""
    example = sharded._example
    names = [n for n in parts[0].graph.nodes if n.op == "placeholder"]
    args = tuple(example[str(n.target)] for n in names)
    with _streams_kept(sharded.program.modules(), sharded._device()) as rewind:
        with torch.no_grad():
            want = _first(sharded.program(**example))
        rewind()  # dropout draws the same masks in the chain
        metas = _chain(parts, args)
    got = metas.pop()
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4,
                                                     atol=1e-5):
        raise AssertionError("the pipeline stages chained do not compute the program's output "
                             f"(largest difference {(got.float() - want.float()).abs().max()})")
    return dict(enumerate(metas))


def _load(parts: list[fx.GraphModule], mine: list[int], weights: DeferredWeights) -> None:
    """Read the slices of the parameters this rank's stages hold (the rest stay on meta)."""
    loaded: dict[str, nn.Parameter] = {}
    for index in mine:
        for name, param in list(parts[index].named_parameters()):
            if not param.is_meta:
                continue
            if name not in loaded:
                loaded[name] = nn.Parameter(weights.load(name),
                                            requires_grad=param.requires_grad)
            owner, _, attr = name.rpartition(".")
            setattr(parts[index].get_submodule(owner) if owner else parts[index], attr,
                    loaded[name])


def _measure_across(sharded: Any, parts: list[fx.GraphModule], rank_of: list[int],
                    pp_mesh: Any) -> dict[int, tuple[Any, Any]]:
    """Each of this rank's stages' (inputs, outputs) as meta tensors, measured by running the
    example through the stages where they live: a stage's outputs go to the next stage's pp
    rank (no rank holds the weights of the others, so the whole program cannot run here)."""
    device = sharded._device()
    # a model without weights was captured on meta inputs: zeros of their shapes serve here
    example = {k: (torch.zeros(v.shape, dtype=v.dtype, device=device) if v.is_meta
                   else v.to(device)) if isinstance(v, torch.Tensor) else v
               for k, v in sharded._example.items()}
    names = [n for n in parts[0].graph.nodes if n.op == "placeholder"]
    current: Any = tuple(example[str(n.target)] for n in names)
    me, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    metas: dict[int, tuple[Any, Any]] = {}
    with _streams_kept((m for part in parts for m in part.modules()), device), \
            torch.enable_grad():
        for index, part in enumerate(parts):
            if rank_of[index] != me:
                continue
            if index > 0 and rank_of[index - 1] != me:
                current = _recv_tensors(group, rank_of[index - 1], device)
            out = part(*current)
            out = out if isinstance(out, tuple) else (out,)
            metas[index] = (tuple(_meta(x) for x in current), tuple(_meta(x) for x in out))
            current = tuple(x.detach().requires_grad_(x.requires_grad) for x in out)
            if index + 1 < len(parts) and rank_of[index + 1] != me:
                _send_tensors(current, group, rank_of[index + 1], device)
    return metas


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16]


def _send_tensors(values: tuple[torch.Tensor, ...], group: Any, dst: int,
                  device: torch.device) -> None:
    """Tensors to pp rank ``dst``: a header of plain integers (count; per tensor dtype,
    requires_grad, rank, sizes), then each tensor. Nothing is pickled."""
    header = [len(values)]
    for x in values:
        header += [_DTYPES.index(x.dtype), int(x.requires_grad), x.dim(), *x.shape]
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.send(size, group=group, group_dst=dst)
    dist.send(torch.tensor(header, dtype=torch.int64, device=device), group=group,
              group_dst=dst)
    for x in values:
        dist.send(x.detach().contiguous().to(device), group=group, group_dst=dst)


def _recv_tensors(group: Any, src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, group=group, group_src=src)
    header_t = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(header_t, group=group, group_src=src)
    header = header_t.tolist()
    count, at, out = header[0], 1, []
    for _ in range(count):
        code, grad, ndim = header[at:at + 3]
        shape = header[at + 3:at + 3 + ndim]
        at += 3 + ndim
        x = torch.empty(shape, dtype=_DTYPES[code], device=device)
        dist.recv(x, group=group, group_src=src)
        out.append(x.requires_grad_(bool(grad)))
    return tuple(out)


def _chain(parts: list[fx.GraphModule], args: tuple[Any, ...]) -> list[Any]:
    """Each stage's (inputs, outputs) as meta tensors, and last the final output."""
    metas: list[Any] = []
    current: Any = args
    with torch.enable_grad():
        for part in parts:
            inputs = tuple(_meta(x) for x in current)
            out = part(*current)
            out = out if isinstance(out, tuple) else (out,)
            metas.append((inputs, tuple(_meta(x) for x in out)))
            current = tuple(x.detach().requires_grad_(x.requires_grad) for x in out)
    metas.append(current[0].detach())
    return metas


@contextlib.contextmanager
def _streams_kept(modules: Any, device: torch.device) -> Iterator[Callable[[], None]]:
    """Random streams as they were on entry, again on exit (training starts from them): the
    global ones (forked) and the dropout trackers of ``modules``. Yields a function that
    rewinds the trackers inside the block."""
    trackers = {id(m.tracker): m.tracker for m in modules if hasattr(m, "tracker")}
    saved = [(t, {k: g.get_state() for k, g in t._generators.items()})
             for t in trackers.values()]

    def rewind() -> None:
        for tracker, states in saved:
            for key in list(tracker._generators):
                if key not in states:
                    del tracker._generators[key]
            for key, state in states.items():
                tracker._generators[key].set_state(state)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield rewind
        finally:
            rewind()


def _first(out: Any) -> torch.Tensor:
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return leaves[0]


def _meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta").requires_grad_(
        bool(x.requires_grad) and x.is_floating_point())


def _rank_of(stage: int, pp: int, placement: str) -> int:
    """The pp rank that holds ``stage``: looped, or folded back as a V."""
    if placement == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


class _TiedGrads:
    """Parameters that several stages read (a tied embedding and head). Every stage holds its
    own copy (two stages of one rank too, so FSDP2 may shard each stage). After the last
    ``perform_reduce_grad`` of a step on this rank, the copies' gradients are summed over
    this rank's stages and then over the pp ranks that hold the parameter (at this rank's
    position in the other mesh dims), and every copy gets the sum: the copies start equal
    and stay equal under any optimizer. The sum covers the whole ``.grad``: clear gradients
    between steps (``zero_grad``); accumulated over several steps, earlier sums would be
    added again."""

    def __init__(self, parts: list[fx.GraphModule], mine: list[int], mesh: Any,
                 rank_of: list[int]) -> None:
        holders: dict[str, list[int]] = {}
        for index, part in enumerate(parts):
            for name, param in part.named_parameters():
                if param.requires_grad:
                    holders.setdefault(name, []).append(index)
        dims = list(mesh.mesh_dim_names)
        pp = mesh["pp"].size()
        grid = mesh.mesh.movedim(dims.index("pp"), 0).reshape(pp, -1)
        me = dist.get_rank()
        self.count, self.seen = len(mine), 0
        self.ties: list[tuple[str, list[fx.GraphModule], Any]] = []
        # tied name -> the first stage holding a copy: the one whose copy counts once in
        # the model's gradient norm (the copies hold the same sum)
        self.first_holder: dict[str, int] = {}
        for name, stages in sorted(holders.items()):
            if len(stages) < 2:
                continue
            self.first_holder[name] = min(stages)
            ranks = sorted({rank_of[s] for s in stages})
            group = None
            if len(ranks) > 1:
                for column in range(grid.shape[1]):  # every rank creates every group, in order
                    members = [int(grid[r, column]) for r in ranks]
                    created = dist.new_group(members)
                    group = created if me in members else group
            local = [parts[s] for s in stages if s in mine]
            for part in local[1:]:  # a copy of its own for each further stage of this rank
                owner, _, attr = name.rpartition(".")
                param = path_attr(part, name)
                setattr(part.get_submodule(owner) if owner else part, attr,
                        nn.Parameter(param.detach().clone()))
            if local:
                self.ties.append((name, local, group))

    def reduced(self) -> None:
        """One stage of this rank has its gradients for the step; after the last, sum."""
        self.seen += 1
        if self.seen < self.count:
            return
        self.seen = 0
        for name, parts, group in self.ties:
            grads = []
            for part in parts:
                param = path_attr(part, name)  # by name: FSDP2 replaces parameters
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                # under FSDP2 each dp rank sums its shard (the same shard on every pp rank)
                grads.append(_local(param.grad))
            total, copies = grads[0], grads[1:]
            for grad in copies:
                total.add_(grad)
            if group is None:
                _copy_sum(total, copies)
                continue
            work = dist.all_reduce(total, group=group, async_op=True)
            if total.device.type == "cuda" and dist.get_backend(group) != "gloo":
                work.wait()  # the stream waits, not the host
                _copy_sum(total, copies)
            else:
                _PENDING.append((work, total, copies))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _copy_sum(total: torch.Tensor, copies: list[torch.Tensor]) -> None:
    for grad in copies:
        grad.copy_(total)


_PENDING: list[Any] = []  # tied-gradient sums still running (gloo)


def wait_tied_grads() -> None:
    """Wait for the sums of tied parameters' gradients over the pipeline ranks that the last
    ``schedule.step`` started. Every optimizer's ``step`` does this first; call it before
    reading such gradients yourself (``clip_grad_norm_``) with gloo. With NCCL the sums are
    ordered on the GPU stream and this returns at once."""
    while _PENDING:
        work, total, copies = _PENDING.pop()
        work.wait()
        _copy_sum(total, copies)


@functools.cache
def _stage_class() -> type:
    """torch's ``PipelineStage`` (loaded only once stages are built) built with its ``part``
    of the sharded model (``ShardedStage``) and the rank's ``_TiedGrads``, whose sum of tied
    parameters' gradients it starts after a step's last backward.

    The sum is started without waiting: the last stage reaches its last backward while the
    first still waits for gradients the last has yet to send, and a blocking collective
    there would never return. NCCL orders it on the stream; with gloo it completes in the
    background and ``wait_tied_grads`` (run before every optimizer step) waits for it."""
    # start-up: torch.distributed.pipelining is not loaded by torch (0.05 s on import autotp)
    from torch.distributed.pipelining import PipelineStage

    register_optimizer_step_pre_hook(lambda *_: wait_tied_grads())

    class AutotpPipelineStage(ShardedStage, PipelineStage):
        def __init__(self, *args: Any, part: StagePart, ties: _TiedGrads,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.part = part
            self._ties = ties
            self._fsdp_checked = False

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            super().perform_reduce_grad(grad_scale_factor)
            self._ties.reduced()

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            if not self._fsdp_checked:
                _refuse_nested_fsdp(self.submod)
                self._fsdp_checked = True
            return super().backward_weight_one_chunk(*args, **kwargs)

    AutotpPipelineStage.__qualname__ = AutotpPipelineStage.__name__
    return AutotpPipelineStage


def _refuse_nested_fsdp(module: nn.Module) -> None:
    """Schedules that split the backward (input, then weight: the zero-bubble ones) leave
    wrong weight gradients in layers that FSDP2 shards on their own inside a stage (torch
    2.13, measured: plain modules too); FSDP2 on the whole stage module is right. Raised on
    the first weight backward of each rank; a peer already waiting on that rank then stops
    at the process group's timeout."""
    if any(isinstance(m, FSDPModule) for m in module.modules() if m is not module):
        raise ConfigError(
            "a zero-bubble schedule (split input/weight backward) with fully_shard on the "
            "layers inside a pipeline stage computes wrong weight gradients in "
            f"torch {torch.__version__}: fully_shard only each stage's submod, or use a "
            "schedule without the split backward (1F1B, Interleaved1F1B, GPipe)")


__all__ = ["cut", "pipeline_stages", "stage_layers", "wait_tied_grads"]
