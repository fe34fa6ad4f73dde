"""One rank's part of a tensor-parallel model (``ShardedModule``), as ``parallelize`` and
``simulate`` build it (``build_rank``): its program, its plan, its communicators, and what
it offers beyond the original model's calls: the plan check across ranks, its local and
expert parameters, the experts' gradients summed over the expert-parallel group, and the
whole state gathered back (``full_state_dict``); and what a pipeline stage holds of it
(``StagePart``, which the stages of ``autotp.pipeline_stages`` are built with)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autotp.capture.trace import Captured
from autotp.errors import ConfigError
from autotp.layout import Shard
from autotp.mesh import plan_sharing
from autotp.ops import path_attr
from autotp.planner.plan import Plan
from autotp.rules.registry import Registry
from autotp.runtime.async_tp import compile_options
from autotp.runtime.collectives import GradBucket, GradSync, gather
from autotp.runtime.ring import SequenceLayout, held_sequence
from autotp.runtime.calls import (HeldWeights, Retracer, Structure, Traced, adopt,
                                  batch_dims, held_tensors, sequence_dims, significant,
                                  structure)
from autotp.runtime.comm import Communicator
from autotp.runtime.grads import DataParallelMean, mark_pieces
from autotp.runtime.layers import split_layers
from autotp.runtime.outputs import gathered_when_read
from autotp.runtime.regather import ShardKeeper
from autotp.runtime.rewrite import rewrite
from autotp.runtime.wrappers import WrapperCheck
from autotp.weights.materialize import Weights

if TYPE_CHECKING:
    from autotp.integrations.pretrained import PerExpert


class ShardedModule(nn.Module):
    """One rank's part of a tensor-parallel model. Call it like the original model.

    It holds the model's modules under their own paths (``sharded.model.layers[3]``;
    ``named_parameters()`` and ``state_dict()`` give the model's names, with this rank's
    pieces): FSDP2's ``fully_shard``, activation checkpointing and ``torch.compile`` apply
    per layer (``autotp.runtime.layers``). A call of another input structure than the
    traced one (without ``labels``, with an ``attention_mask``) is traced and planned on
    first use and runs on the same parameters (``autotp.runtime.calls``)."""

    plan: Plan
    comm: Communicator
    seed: int
    program: torch.fx.GraphModule  # the first traced structure's program (not a submodule)

    def __init__(self, program: torch.fx.GraphModule, plan: Plan, captured: Captured,
                 comm: Communicator, bucket: GradBucket, check_plan: bool = True,
                 seed: int = 0, compile: Any = False, keeper: Optional[ShardKeeper] = None,
                 ep_comm: Optional[Communicator] = None,
                 cp_comm: Optional[Communicator] = None,
                 sequence: Optional[SequenceLayout] = None,
                 placed_on: Optional[torch.device] = None):
        super().__init__()
        # the program's modules and tensors are this module's, under the model's paths
        object.__setattr__(self, "program", program)
        self._modules.update(program._modules)
        self._parameters.update(program._parameters)
        self._buffers.update(program._buffers)
        # the group of the cp axis beside tp (``plan.axes["cp"]``)
        self.cp_comm = cp_comm
        # expert parallelism: the ranks the experts are split over besides the tp group
        self.ep_comm = ep_comm
        # context parallelism: how the cp group holds the sequence (``held_sequence``),
        # passed to the collectives of every program this module builds
        self.sequence = sequence
        self._compile = compile
        # where weights loaded later go while every parameter is still on meta
        self.placed_on = placed_on
        self.plan = plan
        self.comm = comm
        self.seed = seed
        self._unused = list(captured.unused)
        self.source: Optional[ModelInfo] = None  # set by parallelize: what saving needs
        self.strict = True  # whether ops with no rule were refused (also for decoding)
        self._signature: Optional[inspect.Signature] = captured.signature
        # a program of the example's sizes only: a call of other sizes gets its own
        self._fixed_sizes = captured.fixed_sizes
        first = Traced(program, plan, _compiled(program, compile), bucket, keeper,
                       captured.example_kwargs, checked=not check_plan)
        if plan.splits_sequence:
            first.seq_dims = sequence_dims(captured)
        if plan.batch_tokens:
            first.batch_dims = batch_dims(captured)
        self._first = first
        self._traced: dict[Structure, Traced] = {self._structure(first.example): first}
        # what tracing another structure takes (set by parallelize and simulate)
        self.retracer: Optional[Retracer] = None
        self._rebuild: dict[str, Any] = {}
        self._wrappers = WrapperCheck(self)
        self._dp_mean: Optional[DataParallelMean] = None
        mark_pieces(self._pieces())

    # what the first program's attributes were, read by features (pipelines, decoding)
    @property
    def _run(self) -> Any:
        return self._first.run

    @property
    def _bucket(self) -> GradBucket:
        return self._first.bucket

    @property
    def _keeper(self) -> Optional[ShardKeeper]:
        return self._first.keeper

    @property
    def _example(self) -> dict[str, Any]:
        return self._first.example

    @property
    def _plan_checked(self) -> bool:
        return self._first.checked

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def tp_size(self) -> Optional[int]:
        """The tensor-parallel degree (transformers' and accelerate's name for it): None for
        a single rank, as an unsharded transformers model says."""
        return self.plan.degree if self.plan.degree > 1 else None

    _tp_size = tp_size

    def _get_name(self) -> str:
        # the model's own class name: transformers' Trainer picks a loss by it
        return self.source.model_class.__name__ if self.source is not None else \
            super()._get_name()

    def train(self, mode: bool = True) -> "ShardedModule":
        super().train(mode)
        for traced in self._traced.values():
            traced.program.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "ShardedModule":
        super()._apply(fn, recurse)
        # the program's own tensors where conversion made new ones; the other structures'
        for name in list(self.program._buffers):
            if name in self._buffers:
                self.program._buffers[name] = self._buffers[name]
        for name in self.program._parameters:
            self.program._parameters[name] = self._parameters[name]
        for traced in self._traced.values():
            if traced is not self._first:
                traced.program._apply(fn, recurse)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_cache") or any(kwargs.get(key) is not None
                                          for key in ("cache", "past_key_values")):
            # a transformers causal LM with a cache: the decoding programs
            from autotp.integrations.generate import decoder_of  # layer: it imports this module

            return decoder_of(self).host(*args, **kwargs)
        self._wrappers.check()
        named = self._named(args, kwargs)
        traced = self._program_for(named)
        call = self._call(traced, named)
        if not traced.checked:
            self.check_plan(traced.plan)
            traced.checked = True
        if self._dp_mean is not None and torch.is_grad_enabled() and \
                not self._wrappers.reduce_over_dp():
            self._dp_mean.arm()
        with traced.keeper.saving(whole=bool(self._compile)) if traced.keeper is not None else \
                contextlib.nullcontext():
            out = traced.run(**call)
        fields = traced.plan.gathered_when_read  # the call computes a loss
        return gathered_when_read(out, fields, self.comm) if fields else out

    def generate(self, inputs: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        """transformers' ``generate`` (same arguments, same outputs) on this rank's shards,
        with a KV cache of this rank's heads. Collective: call it on every rank with the same
        inputs (and, for sampling, the same seed)."""
        from autotp.integrations.generate import decoder_of  # layer: it imports this module

        if self.plan.cp > 1:
            raise ConfigError(
                f"generate() on a context-parallel model (cp={self.plan.cp}): decoding adds "
                "one token at a time, which context parallelism does not split; parallelize "
                "the model again without cp (tp=...) to generate")
        return decoder_of(self).generate(inputs, **kwargs)

    def check_plan(self, plan: Optional[Plan] = None) -> None:
        """Collective: every rank must hold the same plan (a hash exchanged over the group).
        Different models, degrees or examples on different ranks would otherwise run
        mismatched collectives: a hang or a silently wrong result."""
        plan = plan or self.plan
        digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:15]
        # plain integers in a tensor: nothing exchanged between ranks is ever unpickled
        mine = torch.tensor([int(digest, 16), self.seed % 2**62, self.seed >> 62],
                            dtype=torch.int64, device=self._device())
        rows = self.comm.all_gather(mine.unsqueeze(0), 0).tolist()
        if self.ep_comm is not None:
            others = self.ep_comm.all_gather(mine[:1].unsqueeze(0), 0).tolist()
            if len({d for (d,) in others}) > 1:
                raise ConfigError(
                    "the expert-parallel ranks hold different plans: call autotp.parallelize "
                    "with the same model, tp, ep and example inputs on every rank")
        seeds = [lo + (hi << 62) for _, lo, hi in rows]
        digests = [f"{d:015x}" for d, _, _ in rows]
        if len(set(seeds)) > 1:
            raise ConfigError(
                f"the ranks were seeded differently ({seeds}): seed every rank the same "
                "(torch.manual_seed) before building the model, so that weights and the "
                "dropout masks of replicated values agree"
            )
        if len(set(digests)) > 1:
            groups: dict[object, list[int]] = {}
            for rank, d in enumerate(digests):
                groups.setdefault(d, []).append(rank)
            text = "; ".join(f"ranks {ranks}: plan {d}" for d, ranks in groups.items())
            raise ConfigError(
                f"the ranks hold different tensor-parallel plans ({text}): call "
                "autotp.parallelize with the same model, tp and example inputs on every rank"
            )
        if plan is self.plan:
            self._first.checked = True

    def _device(self) -> torch.device:
        tensors = itertools.chain(self.program.parameters(), self.program.buffers())
        found = next((t.device for t in tensors if t.device.type != "meta"), None)
        # every parameter still on meta (loading deferred): where parallelize places them
        return found or self.placed_on or torch.device("cpu")

    # ---- calls -------------------------------------------------------------------------

    def _structure(self, named: dict[str, Any]) -> Structure:
        return structure(significant(named, self._signature), sizes=self._fixed_sizes)

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's inputs by name, as the model's signature binds them."""
        signature = self._signature
        if signature is None:
            if args:
                raise ConfigError("this model was captured with keyword inputs only")
            return dict(kwargs)
        try:
            named = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError as exc:
            raise ConfigError(f"the call does not fit the model's signature: {exc}") from None
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
        return named

    def _program_for(self, named: dict[str, Any]) -> Traced:
        key = self._structure(named)
        found = self._traced.get(key)
        if found is None:
            found = self._built(key, named)
        odd = self._odd_batch(found, named)
        if odd is None:
            return found
        # sequence parallelism splits this program's batch, which this call's does not
        # divide: the program planned for this call's batch keeps whole batches
        key = (*key, ("batch", "whole"))
        whole = self._traced.get(key)
        if whole is None:
            if self.retracer is None:
                raise ConfigError(
                    f"this model's sequence-parallel regions split the batch over "
                    f"tp={found.plan.degree}, and this call's batch of {odd} does not divide "
                    f"by it (another program could not be planned: the model's structure "
                    f"could not be copied): pass batches that {found.plan.degree} divides")
            whole = self._built(key, named)
        return whole

    def _built(self, key: Structure, named: dict[str, Any]) -> Traced:
        """The program of ``key``, traced, planned and built now. What tracing saves for
        backward goes to hooks of its own: inside ``torch.utils.checkpoint`` (a first call
        of another structure in a checkpointed forward) the checkpoint's hooks would count
        it, and its recomputation, which finds the program built, would save fewer."""
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            traced = self._trace(key, named)
        self._traced[key] = traced
        return traced

    @staticmethod
    def _odd_batch(traced: Traced, named: dict[str, Any]) -> Optional[int]:
        """The call's batch where ``traced`` splits the batch and the degree does not divide
        it; else None."""
        for name, dims in traced.batch_dims.items():
            value = named.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            for dim in dims:
                if value.shape[dim] % traced.plan.degree:
                    return int(value.shape[dim])
        return None

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The first program's inputs for this call."""
        return self._call(self._first, self._named(args, kwargs))

    def _call(self, traced: Traced, named: dict[str, Any]) -> dict[str, Any]:
        """``traced``'s inputs: the call's, and the traced values of what it leaves out (the
        inputs that change nothing: ``significant``)."""
        call = {}
        for name, example in traced.example.items():
            if name not in named:
                call[name] = example
                continue
            value = named[name]
            if isinstance(example, torch.Tensor):
                multiple, what = self._sequence_multiple(traced.plan)
                for dim in traced.seq_dims.get(name, ()):
                    if value.shape[dim] % multiple:
                        raise ConfigError(
                            f"{what}, but {name!r} has {value.shape[dim]} along dim "
                            f"{dim}: pad the sequence to a multiple of {multiple}")
            call[name] = value
        return call

    def _trace(self, key: Structure, named: dict[str, Any]) -> Traced:
        """The program of a new input structure, on this module's parameters."""
        retracer = self.retracer
        if retracer is None:
            raise ConfigError(
                f"the sharded model was traced with inputs {sorted(self._first.example)}; "
                f"this call has {sorted(significant(named, self._signature))}, and this module "
                "cannot trace another structure (autotp.parallelize could not copy the model's "
                "structure): pass this call's inputs as example_kwargs")
        held, buffers = held_tensors(self.program, self.plan, self._unused)
        dtype = next((p.dtype for p in held.values() if p.is_floating_point()),
                     torch.float32)
        share = plan_sharing(self.comm)
        if not retracer.example:
            retracer.example = significant(self._first.example, self._signature)
        captured, plan = retracer.plan(key, significant(named, self._signature), self.plan,
                                       dtype, share)
        device = self._device()
        weights = HeldWeights(retracer.skeleton, held, buffers, device)
        program, bucket, keeper = rank_program(
            captured, plan, self.comm.rank, self.comm, weights=weights, device=device,
            seed=self.seed, ep_comm=self.ep_comm, cp_comm=self.cp_comm,
            sequence=self.sequence, **self._rebuild)
        adopt(program, plan, bucket, held, buffers)
        program.train(self.training)
        traced = Traced(program, plan, _compiled(program, self._compile), bucket, keeper,
                        captured.example_kwargs)
        if plan.splits_sequence:
            traced.seq_dims = sequence_dims(captured)
        if plan.batch_tokens:
            traced.batch_dims = batch_dims(captured)
        return traced

    def _sequence_multiple(self, plan: Optional[Plan] = None) -> tuple[int, str]:
        """What every sequence length must divide by, and why."""
        plan, order = plan or self.plan, self.sequence
        if order is None:
            return plan.tp, f"sequence parallelism needs the sequence length divisible by " \
                            f"tp={plan.tp}"
        why = f"2 x cp = {order.chunks} (cp={plan.cp}, each rank two chunks of it: the same " \
              "causal work on every rank)"
        if not plan.sequence_parallel:
            return order.chunks, f"context parallelism needs the sequence length divisible by " \
                                 f"{why}"
        split = plan.cp * plan.tp  # tp splits each rank's cp shard again
        multiple = math.lcm(order.chunks, split)
        return multiple, (f"context parallelism with sequence parallelism needs the sequence "
                          f"length divisible by {multiple}: by {why} and by cp x tp = {split} "
                          f"(tp={plan.tp} splits each rank's shard again)")

    # ---- parameters ----------------------------------------------------------------------

    def _pieces(self) -> list[tuple[nn.Parameter, tuple[Communicator, ...]]]:
        """Each parameter and the groups its gradient is split over (runtime.grads)."""
        experts = set(self.plan.expert_params) if self.ep_comm is not None else set()
        out = []
        for target, param in self.local_parameters().items():
            over: list[Communicator] = []
            if isinstance(self.plan.param_layout(target), Shard) and self.plan.degree > 1:
                over.append(self.comm)
            if target in experts and self.ep_comm is not None:
                over.append(self.ep_comm)
            out.append((param, tuple(over)))
        return out

    def average_over(self, group: Any) -> None:
        """Average the gradients over ``group`` (a DeviceMesh's "dp" axis) after each
        backward that no DDP or FSDP2 over it reduces (``runtime.grads.DataParallelMean``)."""
        self._dp_mean = DataParallelMean(group, list(self.parameters()), self._flush_buckets)

    def _flush_buckets(self) -> None:
        """Every program's pending sums of partial gradients into ``.grad`` now."""
        for traced in self._traced.values():
            traced.bucket.flush()

    def get_extra_state(self) -> torch.Tensor:
        """Which piece of the model ``state_dict()`` holds (saved under ``_extra_state``,
        torch's key for it): this rank and the degree. Its tensors have the model's names
        and this rank's shapes, the same on every rank: a file of one rank's pieces read on
        another would load without an error."""
        return torch.tensor([self.comm.rank, self.plan.degree], dtype=torch.int64)

    def set_extra_state(self, state: Any) -> None:
        rank, tp = (int(v) for v in torch.as_tensor(state).tolist())
        if (rank, tp) != (self.comm.rank, self.plan.degree):
            raise ConfigError(
                f"this state dict holds the pieces of rank {rank} of {tp}, and this is rank "
                f"{self.comm.rank} of {self.plan.degree}: each rank loads its own state_dict(); "
                "to save and load the whole model use autotp.save_checkpoint / "
                "load_checkpoint (any tp) or autotp.save_pretrained (transformers' format)")

    def expert_parameters(self) -> dict[str, nn.Parameter]:
        """Plan parameter name -> this rank's share of the experts: ``expert_parameters``."""
        return expert_parameters(self)

    def finish_expert_gradients(self, data_parallel: Optional[int] = None,
                                group: Any = None) -> None:
        """See ``autotp.finish_expert_gradients``."""
        finish_expert_gradients(self, data_parallel, group)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Plan parameter name -> this rank's piece (the program's parameter)."""
        out = {}
        for target in self.plan.params:
            out[target] = path_attr(self.program, target)
        return out


@dataclass(frozen=True)
class StagePart:
    """What one pipeline stage (``autotp.pipeline_stages``) holds of a sharded model, read by
    ``expert_parameters``, ``finish_expert_gradients`` and ``autotp.clip_grad_norm_``: the
    plan its parameters follow, the groups their gradients are spread over, and which
    stage counts each parameter several stages read (tied: every stage holding it has a
    copy with the same summed gradient, counted in the first of them only)."""

    plan: Plan
    comm: Communicator  # the tensor-parallel group
    ep_comm: Optional[Communicator]  # the expert-parallel group, with ep > 1
    pp_group: Any  # the pipeline ranks' process group
    first_holder: Mapping[str, int]  # tied parameter -> the first stage holding a copy


class ShardedStage:
    """The base autotp's pipeline stages take beside torch's ``PipelineStage``
    (``autotp.integrations.pipeline``): each is built with its ``part`` of the sharded model."""

    part: StagePart
    submod: nn.Module  # PipelineStage's: the stage's program
    stage_index: int  # PipelineStage's


_CLASSES: dict[tuple[type, str], type] = {}


def sharded_class(model_class: type, signature: Optional[inspect.Signature]) -> type:
    """The class of a sharded ``model_class``: ``ShardedModule`` whose ``forward`` shows the
    model's signature (tools read it from the class: transformers' Trainer finds the label
    inputs there)."""
    if signature is None:
        return ShardedModule
    key = (model_class, str(signature))
    found = _CLASSES.get(key)
    if found is None:
        def forward(self: ShardedModule, *args: Any, **kwargs: Any) -> Any:
            return ShardedModule.forward(self, *args, **kwargs)

        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_param, *signature.parameters.values()])
        forward.__doc__ = getattr(getattr(model_class, "forward", None), "__doc__", None)
        name = f"Sharded{model_class.__name__}"
        found = type(name, (ShardedModule,), {"forward": forward, "__qualname__": name,
                                              "__module__": ShardedModule.__module__})
        _CLASSES[key] = found
    return found


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _compiled(program: torch.fx.GraphModule, compile: Any) -> Any:
    """The program, or its torch.compile: on a process group the whole rank program, its
    collectives included (traceable functional collectives: ``autotp.runtime.comm``), the ring,
    the causal attention and dropout's draws (custom ops: ``autotp.runtime.random``). Still
    eager, a graph break each: the experts' row routing (sizes read on the host), attention
    dropout with a mask that needs a gradient, and every collective of simulated ranks
    (``ThreadComm``). The graphs are specialised to their sizes (``dynamic=False`` unless
    ``compile`` says otherwise): the causal attention and the ring decide what a mask of
    sizes alone keeps while tracing, once per size."""
    if not compile:
        return program
    options = {"dynamic": False, **(compile if isinstance(compile, dict) else {})}
    return torch.compile(program, **options)


@dataclass
class ModelInfo:
    """What saving needs of the original model, without holding its weights."""

    model_class: type
    config: Any  # a transformers config, or None
    state_keys: list[str]  # the model's state_dict names, in order
    buffers: list[str]  # its persistent buffers (saved with the weights)
    generation_config: Any = None  # a transformers model's, for generate()
    # how save_pretrained writes stacked experts back by default: as the checkpoint loaded
    # (from_pretrained) held them
    checkpoint_experts: dict[str, PerExpert] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelInfo":
        config = getattr(model, "config", None)
        state = list(model.state_dict(keep_vars=True).keys())
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        return cls(type(model), config if hasattr(config, "save_pretrained") else None,
                   state, [k for k in state if k not in params],
                   getattr(model, "generation_config", None))


def _grad_sync(value: Any) -> GradSync:
    try:
        return GradSync(value)
    except ValueError:
        raise ConfigError(f"grad_sync must be one of {[g.value for g in GradSync]}, "
                          f"got {value!r}") from None


def rank_program(captured: Captured, plan: Plan, rank: int, comm: Communicator,
                 registry: Optional[Registry] = None, seed: Optional[int] = None,
                 grad_sync: str = "bucket", weights: Optional[Weights] = None,
                 device: Optional[torch.device] = None, keep_gathered: bool = False,
                 ep_comm: Optional[Communicator] = None, cp_comm: Optional[Communicator] = None,
                 sequence: Optional[SequenceLayout] = None
                 ) -> tuple[torch.fx.GraphModule, GradBucket, Optional[ShardKeeper]]:
    """This rank's program of a planned capture, split by layer; its gradient bucket and,
    with sequence parallelism, its keeper of gathered inputs. ``sequence``: with context
    parallelism, how the cp group holds the sequence (``held_sequence(plan.cp)``)."""
    seed = torch.initial_seed() if seed is None else seed
    keeper = ShardKeeper() if plan.sequence_parallel and not keep_gathered else None
    program, bucket = rewrite(captured, plan, rank, comm, registry, seed=seed,
                              grad_sync=_grad_sync(grad_sync), weights=weights, device=device,
                              keeper=keeper, ep_comm=ep_comm, cp_comm=cp_comm,
                              sequence=sequence)
    split_layers(program)
    return program, bucket, keeper


def build_rank(captured: Captured, plan: Plan, rank: int, comm: Communicator,
               registry: Optional[Registry] = None, check_plan: bool = True,
               seed: Optional[int] = None, grad_sync: str = "bucket",
               compile: Any = False, async_tp: bool = False,
               weights: Optional[Weights] = None,
               device: Optional[torch.device] = None, keep_gathered: bool = False,
               ep_comm: Optional[Communicator] = None,
               cp_comm: Optional[Communicator] = None,
               model_class: Optional[type] = None) -> ShardedModule:
    seed = torch.initial_seed() if seed is None else seed
    if not isinstance(compile, (bool, dict)):
        raise ConfigError(f"compile= takes a bool or a dict of torch.compile options, got "
                          f"{type(compile).__name__}")
    sequence = held_sequence(plan.cp)
    program, bucket, keeper = rank_program(
        captured, plan, rank, comm, registry, seed=seed, grad_sync=grad_sync, weights=weights,
        device=device, keep_gathered=keep_gathered, ep_comm=ep_comm, cp_comm=cp_comm,
        sequence=sequence)
    if async_tp:
        compile = compile_options(compile, comm, plan.sequence_parallel,
                                  _placed(program, device))
    cls = sharded_class(model_class, captured.signature) if model_class is not None else \
        ShardedModule
    sharded = cls(program, plan, captured, comm, bucket, check_plan, seed, compile,
                  keeper=keeper, ep_comm=ep_comm, cp_comm=cp_comm, sequence=sequence,
                  placed_on=device)
    # what a program of another input structure is built with (runtime.calls)
    sharded._rebuild = {"registry": registry, "grad_sync": grad_sync,
                        "keep_gathered": keep_gathered}
    return sharded


def _placed(program: torch.fx.GraphModule, device: Optional[torch.device]) -> torch.device:
    """Where the rank's program runs: ``device``, else where its weights are."""
    if device is not None:
        return torch.device(device)
    first = next(iter(program.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def expert_parameters(module: Any) -> dict[str, nn.Parameter]:
    """Plan parameter name -> this rank's share of the experts (``plan.expert_params``), of a
    ``ShardedModule`` or of a pipeline stage (``autotp.pipeline_stages``), its layers wrapped
    (activation checkpointing) or not.

    With expert parallelism (``ep`` > 1) each ep rank holds different experts, and their
    gradients already sum every ep rank's tokens (the dispatch's backward brings them):
    keep them out of the data-parallel gradient average (``fully_shard(...,
    ignored_params=set(expert_parameters(module).values()))``) and call
    ``finish_expert_gradients`` after backward instead."""
    if isinstance(module, ShardedModule):
        params = module.local_parameters()
        return {target: params[target] for target in module.plan.expert_params}
    if not isinstance(module, ShardedStage):
        raise ConfigError(f"expert_parameters takes the module autotp.parallelize returned or "
                          f"a stage of autotp.pipeline_stages, got {type(module).__name__}")
    wanted = set(module.part.plan.expert_params)
    out = {}
    for name, param in module.submod.named_parameters():
        plain = name.replace("_checkpoint_wrapped_module.", "")
        if plain in wanted:
            out[plain] = param
    return out


def finish_expert_gradients(module: Any, data_parallel: Optional[int] = None,
                            group: Any = None) -> None:
    """Make the experts' gradients of ``module`` (a ``ShardedModule``, a pipeline stage or a
    list of stages) those of the data-parallel mean loss, as the dense parameters' average
    over
    ``data_parallel`` ranks (default: ep) makes theirs: sum over ``group`` (the ranks
    holding the same experts with other tokens, when the data-parallel ranks outnumber ep;
    collective), then divide by ``data_parallel``. Without expert parallelism it does
    nothing: the experts are then replicated over the data-parallel ranks, averaged with the
    other parameters."""
    if isinstance(module, (list, tuple)):
        for stage in module:
            finish_expert_gradients(stage, data_parallel, group)
        return
    if isinstance(module, ShardedModule):
        plan = module.plan
    elif isinstance(module, ShardedStage):
        plan = module.part.plan
    else:
        raise ConfigError(f"finish_expert_gradients takes the module autotp.parallelize "
                          f"returned or stages of autotp.pipeline_stages, got "
                          f"{type(module).__name__}")
    ep = plan.ep
    if ep == 1:
        return
    data_parallel = ep if data_parallel is None else data_parallel
    if data_parallel % ep:
        raise ConfigError(f"data_parallel={data_parallel} is not a multiple of ep={ep}: "
                          "the expert-parallel ranks are data-parallel ranks")
    if data_parallel > ep and group is None:
        raise ConfigError(
            f"data_parallel={data_parallel} > ep={ep}: pass group=, the ranks holding the "
            f"same experts ({data_parallel // ep} of them), to sum their gradients")
    for param in expert_parameters(module).values():
        if param.grad is None:
            continue
        if group is not None:
            dist.all_reduce(param.grad, group=process_group(group))
        param.grad.div_(data_parallel)


def process_group(group: Any) -> Optional[dist.ProcessGroup]:
    """A process group, or the group of a 1-D DeviceMesh (``mesh["tp"]``)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ConfigError(
                f"group= takes a 1-D DeviceMesh, the tensor-parallel axis (e.g. mesh['tp']); "
                f"this one has dims {group.mesh_dim_names or group.ndim}")
        return group.get_group()
    return group


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
        tensor = _whole_over_dp(tensor)
        layout = plan.param_layout(target)
        if isinstance(layout, Shard):
            tensor = gather(sharded.comm, tensor.contiguous(), layout)
        if sharded.ep_comm is not None and target in plan.expert_params:
            tensor = sharded.ep_comm.all_gather(tensor.contiguous(), 0)
        for name in plan.params[target].names:
            out[name] = tensor.detach().clone()
    for name in sharded._unused:  # parameters the forward never reads (replicated)
        module = path_attr(sharded.program, name)
        tensor = module.grad if grads else module.detach()
        tensor = tensor if tensor is not None else torch.zeros_like(module)
        out[name] = _whole_over_dp(tensor).detach().clone()
    return out


def _whole_over_dp(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel piece of a parameter that FSDP2 holds sharded over the
    data-parallel ranks (a DTensor): gathered over them (collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
