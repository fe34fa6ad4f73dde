"""One rank's part of a tensor-parallel model (``ShardedModule``), as ``parallelize`` and
``simulate`` build it (``build_rank``): its program, its plan, its communicators, and what
it offers beyond the original model's calls: the plan check across ranks, its local and
expert parameters, the experts' gradients summed over the expert-parallel group, and the
whole state gathered back (``full_state_dict``)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autotp.capture.trace import Captured, sequence_symbols, size_expr
from autotp.errors import ConfigError
from autotp.layout import Shard
from autotp.ops import path_attr
from autotp.planner.plan import Plan
from autotp.rules.registry import Registry
from autotp.runtime.collectives import GradBucket, GradSync, gather
from autotp.runtime.context import SequenceLayout
from autotp.runtime.comm import Communicator
from autotp.runtime.layers import split_layers
from autotp.runtime.regather import ShardKeeper
from autotp.runtime.rewrite import rewrite
from autotp.weights.materialize import Weights

if TYPE_CHECKING:
    from autotp.features.pretrained import PerExpert


class ShardedModule(nn.Module):
    """One rank's part of a tensor-parallel model. Call it like the original model.

    Its program keeps the original model's layers as submodules under their own paths
    (``sharded.model.layers[3]``): FSDP2's ``fully_shard``, activation checkpointing and
    ``torch.compile`` apply per layer (``autotp.runtime.layers``)."""

    plan: Plan
    comm: Communicator
    seed: int
    # set where a feature needs them (read with getattr until then)
    placed_on: Optional[torch.device]  # parallelize: where weights loaded later go
    checkpoint_experts: dict[str, PerExpert]  # from_pretrained: how save_pretrained splits
    _checkpoint_group: tuple[list[int], Optional[dist.ProcessGroup]]  # features.checkpoint

    def __init__(self, program: torch.fx.GraphModule, plan: Plan, captured: Captured,
                 comm: Communicator, bucket: GradBucket, check_plan: bool = True,
                 seed: int = 0, compile: Any = False, keeper: Optional[ShardKeeper] = None,
                 ep_comm: Optional[Communicator] = None,
                 cp_comm: Optional[Communicator] = None):
        super().__init__()
        self.program = program
        # context parallelism inside tp (``plan.context``): the cp group
        self.cp_comm = cp_comm
        # expert parallelism: the ranks the experts are split over besides the tp group
        self.ep_comm = ep_comm
        # sequence parallelism: saved gathered inputs are kept as shards (autotp.runtime.regather)
        self._keeper = keeper
        # torch.compile of the program: the compute between collectives is compiled, the
        # collectives and tracked dropouts run eagerly (graph breaks around them)
        self._run: Any = program
        if compile:
            options = dict(compile) if isinstance(compile, dict) else {}
            self._run = torch.compile(program, **options)
        self.plan = plan
        self.comm = comm
        self.seed = seed
        self._bucket = bucket
        self._unused = list(captured.unused)
        self.source: Optional[ModelInfo] = None  # set by parallelize: what saving needs
        self.strict = True  # whether ops with no rule were refused (also for decoding)
        self._signature: Optional[inspect.Signature] = captured.signature
        self._example: dict[str, Any] = captured.example_kwargs
        self._plan_checked = not check_plan
        # input -> its sequence dims, whose sizes tp must divide (sequence parallelism)
        self._seq_dims: dict[str, list[int]] = {}
        if plan.sequence_parallel or plan.cp > 1:
            symbols = sequence_symbols(captured.dim_names)
            for node in captured.gm.graph.nodes:
                val = node.meta.get("val")
                if node.op == "placeholder" and isinstance(val, torch.Tensor):
                    dims = [d for d, size in enumerate(val.shape) if size_expr(size) in symbols]
                    if dims:
                        self._seq_dims[str(node.target)] = dims

    @property
    def rank(self) -> int:
        return self.comm.rank

    def __getattr__(self, name: str) -> Any:
        """The original model's top-level modules, as the program holds them:
        ``sharded.model.layers[3]``, ``sharded.get_submodule("model.layers.3")``."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            program = self._modules.get("program")
            if program is not None and not name.startswith("autotp_") and \
                    name in program._modules:
                return program._modules[name]
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_cache") or any(kwargs.get(key) is not None
                                          for key in ("cache", "past_key_values")):
            # a transformers causal LM with a cache: the decoding programs
            from autotp.features.generate import decoder_of  # layer: it imports this module

            return decoder_of(self).host(*args, **kwargs)
        call = self._bind(args, kwargs)
        if not self._plan_checked:
            self.check_plan()
        with self._keeper.saving() if self._keeper is not None else contextlib.nullcontext():
            return self._run(**call)

    def generate(self, inputs: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        """transformers' ``generate`` (same arguments, same outputs) on this rank's shards,
        with a KV cache of this rank's heads. Collective: call it on every rank with the same
        inputs (and, for sampling, the same seed)."""
        from autotp.features.generate import decoder_of  # layer: it imports this module

        if self.plan.cp > 1:
            raise ConfigError(
                f"generate() on a context-parallel model (cp={self.plan.cp}): decoding adds "
                "one token at a time, which context parallelism does not split; parallelize "
                "the model again without cp (tp=...) to generate")
        return decoder_of(self).generate(inputs, **kwargs)

    def check_plan(self) -> None:
        """Collective: every rank must hold the same plan (a hash exchanged over the group).
        Different models, degrees or examples on different ranks would otherwise run
        mismatched collectives: a hang or a silently wrong result."""
        digest = hashlib.sha256(self.plan.to_json().encode()).hexdigest()[:15]
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
        self._plan_checked = True

    def _device(self) -> torch.device:
        tensors = itertools.chain(self.program.parameters(), self.program.buffers())
        found = next((t.device for t in tensors if t.device.type != "meta"), None)
        # every parameter still on meta (loading deferred): where parallelize places them
        return found or getattr(self, "placed_on", None) or torch.device("cpu")

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
                value = named[name]
                if isinstance(example, torch.Tensor):
                    _check_input(name, value, example)
                    multiple, what = self._sequence_multiple()
                    for dim in self._seq_dims.get(name, ()):
                        if value.shape[dim] % multiple:
                            raise ConfigError(
                                f"{what}, but {name!r} has {value.shape[dim]} along dim "
                                f"{dim}: pad the sequence to a multiple of {multiple}")
                call[name] = value
            elif isinstance(example, torch.Tensor):
                raise ConfigError(f"missing input {name!r} (the example had it)")
            else:
                call[name] = example
        return call

    def _sequence_multiple(self) -> tuple[int, str]:
        """What every sequence length must divide by, and why."""
        plan, order = self.plan, (self.cp_comm or self.comm).sequence
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


@dataclass
class ModelInfo:
    """What saving needs of the original model, without holding its weights."""

    model_class: type
    config: Any  # a transformers config, or None
    state_keys: list[str]  # the model's state_dict names, in order
    buffers: list[str]  # its persistent buffers (saved with the weights)
    generation_config: Any = None  # a transformers model's, for generate()

    @classmethod
    def of(cls, model: nn.Module) -> "ModelInfo":
        config = getattr(model, "config", None)
        state = list(model.state_dict(keep_vars=True).keys())
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        return cls(type(model), config if hasattr(config, "save_pretrained") else None,
                   state, [k for k in state if k not in params],
                   getattr(model, "generation_config", None))


def _check_input(name: str, value: Any, example: torch.Tensor) -> None:
    """Batch and sequence sizes may change; the rank and dtype of an input may not."""
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"input {name!r} must be a tensor (the example was one), "
                          f"got {type(value).__name__}")
    if value.dim() != example.dim() or value.dtype != example.dtype:
        raise ConfigError(
            f"input {name!r} is {value.dtype} with {value.dim()} dims, but the model was "
            f"traced with {example.dtype} and {example.dim()} dims: other batch and sequence "
            "sizes work, another rank or dtype needs autotp.parallelize with such an example"
        )


def _grad_sync(value: Any) -> GradSync:
    try:
        return GradSync(value)
    except ValueError:
        raise ConfigError(f"grad_sync must be one of {[g.value for g in GradSync]}, "
                          f"got {value!r}") from None


def build_rank(captured: Captured, plan: Plan, rank: int, comm: Communicator,
           registry: Optional[Registry] = None, check_plan: bool = True,
           seed: Optional[int] = None, grad_sync: str = "bucket",
           compile: Any = False, weights: Optional[Weights] = None,
           device: Optional[torch.device] = None, keep_gathered: bool = False,
           ep_comm: Optional[Communicator] = None,
           cp_comm: Optional[Communicator] = None) -> ShardedModule:
    seed = torch.initial_seed() if seed is None else seed
    if not isinstance(compile, (bool, dict)):
        raise ConfigError(f"compile= takes a bool or a dict of torch.compile options, got "
                          f"{type(compile).__name__}")
    keeper = ShardKeeper() if plan.sequence_parallel and not keep_gathered else None
    sequence_comm = cp_comm if plan.context is not None else comm
    if plan.cp > 1 and sequence_comm is not None and sequence_comm.sequence is None:
        # each rank two chunks of 2 x cp, head and tail: the same causal work on every rank
        sequence_comm.sequence = SequenceLayout(sequence_comm.world_size, balanced=True)
    program, bucket = rewrite(captured, plan, rank, comm, registry, seed=seed,
                              grad_sync=_grad_sync(grad_sync), weights=weights, device=device,
                              keeper=keeper, ep_comm=ep_comm, cp_comm=cp_comm)
    split_layers(program)
    return ShardedModule(program, plan, captured, comm, bucket, check_plan, seed, compile,
                         keeper=keeper, ep_comm=ep_comm, cp_comm=cp_comm)


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
    plan = getattr(module, "_autotp_plan", None)
    if plan is None:
        raise ConfigError(f"expert_parameters takes the module autotp.parallelize returned or "
                          f"a stage of autotp.pipeline_stages, got {type(module).__name__}")
    wanted = set(plan.expert_params)
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
    plan = module.plan if isinstance(module, ShardedModule) else \
        getattr(module, "_autotp_plan", None)
    if plan is None:
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
