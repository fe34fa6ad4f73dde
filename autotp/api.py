"""The user API: ``plan``, ``parallelize``, ``full_state_dict``, and the in-process simulation.

``parallelize`` is called on every rank of an initialized process group with the same model
(same weights) and returns this rank's module: the original call signature and outputs,
parameters replaced by their local shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autotp.capture.trace import Captured, capture, sequence_symbols, size_expr
from autotp.runtime.collectives import GradBucket, GradSync, gather
from autotp.runtime.comm import Communicator, ProcessGroupComm, ThreadComm, ThreadHub
from autotp.errors import AutotpError, ConfigError
from autotp.ops import path_attr, positive_int
from autotp.runtime.layers import split_layers
from autotp.layout import Shard
from autotp.weights.materialize import (CheckpointWeights, InitWeights, ModelWeights, Weights,
                                has_meta_parameters, maybe_deferred)
from autotp.planner.cost import CostModel
from autotp.planner.gradflow import check_gradient_flow
from autotp.planner.plan import Plan
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.runtime.regather import ShardKeeper
from autotp.runtime.rewrite import rewrite
from autotp.rules.registry import Registry


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
) -> tuple[Captured, Plan]:
    """``model`` traced and planned; ``share``: see ``plan_graph`` (one rank of a group
    plans)."""
    tp = positive_int("tp", tp)
    ep = positive_int("ep", ep)
    captured = capture(model, example_args, example_kwargs)
    options = PlanOptions(strict=strict, sequence_parallel=bool(sequence_parallel),
                          gather_outputs=bool(gather_outputs), expert_parallel=ep)
    plan = plan_graph(captured, tp, registry=registry, cost_model=cost_model,
                      options=options, model_name=_model_name(model), share=share)
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
) -> Plan:
    """The tensor-parallel plan of ``model`` at degree ``tp`` (with ``ep``: experts also split
    over ep data-parallel ranks); needs no process group."""
    return prepare(model, tp, example_args=example_args, example_kwargs=example_kwargs,
                   strict=strict, cost_model=cost_model, sequence_parallel=sequence_parallel,
                   gather_outputs=gather_outputs, ep=ep)[1]


class ShardedModule(nn.Module):
    """One rank's part of a tensor-parallel model. Call it like the original model.

    Its program keeps the original model's layers as submodules under their own paths
    (``sharded.model.layers[3]``): FSDP2's ``fully_shard``, activation checkpointing and
    ``torch.compile`` apply per layer (``autotp.runtime.layers``)."""

    plan: Plan
    comm: Communicator
    seed: int

    def __init__(self, program: torch.fx.GraphModule, plan: Plan, captured: Captured,
                 comm: Communicator, bucket: GradBucket, check_plan: bool = True,
                 seed: int = 0, compile: Any = False, keeper: Optional[ShardKeeper] = None,
                 ep_comm: Optional[Communicator] = None):
        super().__init__()
        self.program = program
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
        if plan.sequence_parallel:
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
            # (autotp.features.generate)
            from autotp.features.generate import decoder_of

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
        from autotp.features.generate import decoder_of

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
                    for dim in self._seq_dims.get(name, ()):
                        if value.shape[dim] % self.plan.tp:
                            raise ConfigError(
                                f"sequence parallelism needs the sequence length divisible by "
                                f"tp={self.plan.tp}, but {name!r} has {value.shape[dim]} "
                                f"along dim {dim}: pad the sequence to a multiple of "
                                f"{self.plan.tp}")
                call[name] = value
            elif isinstance(example, torch.Tensor):
                raise ConfigError(f"missing input {name!r} (the example had it)")
            else:
                call[name] = example
        return call

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


def _build(captured: Captured, plan: Plan, rank: int, comm: Communicator,
           registry: Optional[Registry] = None, check_plan: bool = True,
           seed: Optional[int] = None, grad_sync: str = "bucket",
           compile: Any = False, weights: Optional[Weights] = None,
           device: Optional[torch.device] = None, keep_gathered: bool = False,
           ep_comm: Optional[Communicator] = None) -> ShardedModule:
    seed = torch.initial_seed() if seed is None else seed
    if not isinstance(compile, (bool, dict)):
        raise ConfigError(f"compile= takes a bool or a dict of torch.compile options, got "
                          f"{type(compile).__name__}")
    keeper = ShardKeeper() if plan.sequence_parallel and not keep_gathered else None
    program, bucket = rewrite(captured, plan, rank, comm, registry, seed=seed,
                              grad_sync=_grad_sync(grad_sync), weights=weights, device=device,
                              keeper=keeper, ep_comm=ep_comm)
    split_layers(program)
    return ShardedModule(program, plan, captured, comm, bucket, check_plan, seed, compile,
                         keeper=keeper, ep_comm=ep_comm)


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
        names = {t: list(captured.aliases.get(t, [t])) for t in plan.params}
        names.update({n: [n] for n in captured.unused})
        return CheckpointWeights(checkpoint, model, names, device)
    if init:
        layouts = {t: (captured.aliases.get(t, [t]), plan.param_layout(t)) for t in plan.params}
        return InitWeights(model, layouts, rank, plan.tp, device)
    if has_meta_parameters(model):
        raise ConfigError(
            f"{type(model).__name__} is on the meta device (no weights): pass "
            "checkpoint=PATH (safetensors) to load each rank's slices, or init=True to "
            "initialize them with the model's own initializers")
    return ModelWeights(model, device)


def _agreed_seed(comm: Communicator, device: torch.device) -> int:
    """Rank 0's seed, for the replicated dropout stream: ranks that load their weights from a
    file need not have been seeded alike."""
    mine = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
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
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"autotp takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "autotp.parallelize needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first (use autotp.simulate for a "
            "single-process run)"
        )
    group = _process_group(group)
    group, ep_group = _expert_groups(tp, ep, group, _process_group(ep_group))
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
    meta = has_meta_parameters(model)
    if device is None and meta:
        device = default_device()
    device = torch.device(device) if device is not None else None
    weights = maybe_deferred(
        _weights(model, captured, the_plan, comm.rank, checkpoint, init, device))
    seed = None
    if checkpoint is not None:
        seed = _agreed_seed(comm, device if device is not None and device.type == "cuda"
                            else torch.device("cpu"))
    try:
        sharded = _build(captured, the_plan, comm.rank, comm, check_plan=check_plan,
                         grad_sync=grad_sync, compile=compile, weights=weights,
                         device=device if meta else None, seed=seed,
                         keep_gathered=keep_gathered, ep_comm=ep_comm)
    finally:
        weights.close()
    sharded.source = ModelInfo.of(model)
    sharded.strict = strict
    sharded.placed_on = device if meta else None
    return sharded


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
    world = dist.get_world_size()
    tp = world // ep if tp is None else positive_int("tp", tp)
    if tp * ep != world:
        raise ConfigError(f"tp={tp} x ep={ep} = {tp * ep} ranks, but the world has {world}: "
                          f"pass tp and ep whose product is {world}, or group= and ep_group=")
    rank = dist.get_rank()
    mine: Any = None
    mine_ep: Any = None
    for first in range(0, world, tp):  # every rank creates every group, in the same order
        made = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = made
    for offset in range(tp):
        made = dist.new_group(list(range(offset, world, tp)))
        if rank % tp == offset:
            mine_ep = made
    return mine, mine_ep


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
            dist.all_reduce(param.grad, group=_process_group(group))
        param.grad.div_(data_parallel)


def _process_group(group: Any) -> Optional[dist.ProcessGroup]:
    """A process group, or the group of a 1-D DeviceMesh (``mesh["tp"]``)."""
    from torch.distributed.device_mesh import DeviceMesh

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
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


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
        return len(self.ranks) // self.plan.ep

    def run(self, fn: Callable[[ShardedModule], Any]) -> list[Any]:
        """Call ``fn(module)`` on every rank concurrently; returns the results in rank order."""
        world = len(self.ranks)
        results: list[Any] = [None] * world
        errors: list[Optional[BaseException]] = [None] * world
        for rank_module in self.ranks:
            for comm in (rank_module.comm, rank_module.ep_comm):
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
                for comm in (self.ranks[rank].comm, self.ranks[rank].ep_comm):
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
) -> Simulation:
    """Build all ``tp`` ranks of ``model`` in this process (the same rewritten programs as
    ``parallelize``), connected by in-memory collectives. ``registry``: the rules (default
    ``Registry.default()``), e.g. one without some op's rule to exercise the fallback.
    ``check_plan``: prove first that every parameter's gradient arrives whole in its own
    layout (``autotp.planner.gradflow``), as ``parallelize`` does. ``ep``: expert
    parallelism over ep simulated data-parallel ranks too (tp * ep threads)."""
    ep = positive_int("ep", ep)
    captured, the_plan = prepare(model, tp, example_args=example_args,
                                 example_kwargs=example_kwargs, strict=strict,
                                 cost_model=cost_model, registry=registry,
                                 sequence_parallel=sequence_parallel,
                                 gather_outputs=gather_outputs, ep=ep)
    if check_plan:
        check_gradient_flow(the_plan, captured.gm)
    ep_hubs = [ThreadHub(ep, timeout) for _ in range(tp)] if ep > 1 else []
    ranks = []
    for e in range(ep):
        for comm in ThreadHub(tp, timeout).comms():
            ranks.append(_build(captured, the_plan, comm.rank, comm, registry=registry,
                                grad_sync=grad_sync, compile=compile,
                                keep_gathered=keep_gathered,
                                ep_comm=ThreadComm(ep_hubs[comm.rank], e) if ep > 1 else None))
    for rank in ranks:
        rank.source = ModelInfo.of(model)
        rank.strict = strict
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
