"""Which tp x cp x pp x dp to run: every configuration's memory and step time, ranked.

    estimate = capture the model once (on meta: no weights)
             -> plan it at each tensor-parallel degree, with and without sequence parallelism
             -> profile each plan at each micro-batch and cp (profile.py: the rank
                program's ops, saved activations and collectives in numbers; with cp,
                the program on 1/cp of the sequence and attention's ring around cp)
             -> for each pp (stages balanced by time), dp, micro-batch and recomputation
                policy: peak memory per GPU (memory.py) and step time (timing.py)
             -> refuse what does not fit or cannot be built, with the reason; rank the rest
                by step time

Planning is the expensive part and depends only on (tp, sequence parallelism); everything
else is arithmetic over the profile, so a search over hundreds of configurations of a 70B
model takes seconds once its few plans exist.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from autotp.capture.trace import capture, default_example
from autotp.errors import AutotpError, ConfigError
from autotp.ops import positive_int
from autotp.planner.cost import CostModel
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.planner.job.hardware import Hardware, hardware as get_hardware
from autotp.planner.job.memory import (
    DATA_PARALLEL,
    POLICIES,
    Memory,
    Precision,
    balanced_stages,
    on_stage,
    precision as get_precision,
    stage_memory,
)
from autotp.planner.job.profile import Profile, build_profile
from autotp.planner.job.timing import MeshShape, StageWork, StepTime, stage_work, step_time
from autotp.progress import stage, step

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "tfloat32": 4}


@dataclass
class Config:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    sequence_parallel: bool
    checkpointing: str
    ep: int = 1  # experts split over ep of the dp ranks too (autotp.parallelize's ep)
    cp: int = 1  # the sequence split over cp ranks (context parallelism)
    fits: bool = False
    why: str = ""
    memory: Optional[Memory] = None
    time: Optional[StepTime] = None
    mfu: float = 0.0
    stages: list[list[int]] = field(default_factory=list)
    # experts held whole per rank: (experts, top-k, busiest rank's routed rows over the
    # mean under uniform routing; autotp.planner.job.expert_load), or None
    experts: Optional[tuple[int, int, float]] = None

    @property
    def mesh(self) -> str:
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        return f"pp={self.pp},dp={self.dp}{cp},tp={self.tp}"

    @property
    def flags(self) -> str:
        """The ``autotp estimate`` options that evaluate this configuration's mesh only."""
        return f"--mesh {self.mesh}" + (f" --ep {self.ep}" if self.ep > 1 else "")

    def device_mesh_kwargs(self) -> dict[str, tuple]:
        """``init_device_mesh("cuda", **config.device_mesh_kwargs())``: the mesh (pp, dp, tp),
        tp innermost, with those dim names, and a cp dim between dp and tp where cp > 1; an ep
        group is ep consecutive ranks of the dp dim (all of it where ep = dp)."""
        if self.cp > 1:
            return {"mesh_shape": (self.pp, self.dp, self.cp, self.tp),
                    "mesh_dim_names": ("pp", "dp", "cp", "tp")}
        return {"mesh_shape": (self.pp, self.dp, self.tp), "mesh_dim_names": ("pp", "dp", "tp")}

    def parallelize_kwargs(self) -> dict[str, Any]:
        """What ``autotp.parallelize`` takes from this configuration."""
        out: dict[str, Any] = {"tp": self.tp, "sequence_parallel": self.sequence_parallel}
        if self.ep > 1:
            out["ep"] = self.ep
        if self.cp > 1:
            out["cp"] = self.cp
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp,
            "micro_batch": self.micro_batch,
            "sequence_parallel": self.sequence_parallel, "checkpointing": self.checkpointing,
            "fits": self.fits, "why": self.why, "memory": None, "time": None,
            "mfu": round(self.mfu, 4)}
        if self.memory is not None:
            m = self.memory
            out["memory"] = {"parameters": int(m.parameters), "gradients": int(m.gradients),
                             "optimizer": int(m.optimizer), "activations": int(m.activations),
                             "transient": int(m.transient), "total": int(m.total),
                             "stage": m.stage}
        if self.time is not None:
            t = self.time
            out["time"] = {"step_s": t.step, "compute_s": t.compute, "tp_comm_s": t.tp_comm,
                           "pp_bubble_s": t.pp_bubble, "dp_comm_s": t.dp_comm,
                           "ep_comm_s": t.ep_comm, "cp_comm_s": t.cp_comm,
                           "optimizer_s": t.optimizer}
        if self.experts is not None:
            experts, top_k, imbalance = self.experts
            out["experts"] = {"experts": experts, "top_k": top_k,
                              "per_rank": experts // (self.tp * self.ep),
                              "imbalance": round(imbalance, 4)}
        return out


@dataclass
class Estimate:
    model: str
    hardware: Hardware
    gpus: int
    global_batch: int
    seq: int
    dtype: str
    precision: str
    configs: list[Config]
    seconds: float = 0.0  # how long the search took

    @property
    def best(self) -> Optional[Config]:
        return next((c for c in self.configs if c.fits), None)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "autotp.estimate/1", "model": self.model,
                "hardware": asdict(self.hardware), "gpus": self.gpus,
                "global_batch": self.global_batch, "seq": self.seq, "dtype": self.dtype,
                "precision": self.precision,
                "configs": [c.to_dict() for c in self.configs]}


@dataclass(frozen=True)
class Request:
    """What the user asks: the job and which knobs are free (None: searched)."""

    gpus: int
    global_batch: int
    seq: int
    gpus_per_node: Optional[int] = None
    micro_batch: Optional[int] = None
    mesh: Optional[tuple[int, int, int]] = None  # (pp, dp, tp)
    ep: Optional[int] = None  # expert parallelism over dp ranks (None: searched, for MoE)
    cp: Optional[int] = None  # context parallelism (None: searched; 1: none)
    checkpointing: Optional[str] = None
    sequence_parallel: Optional[bool] = None
    dtype: str = "bfloat16"
    precision: str = "bf16-mixed"
    optimizer: str = "adam"
    dp_shard: str = "fsdp"
    tp_across_nodes: bool = False
    max_micro_batch: int = 8


def parse_mesh(text: str) -> tuple[int, int, int]:
    """``pp=2,dp=4,tp=8`` (any order; a missing dim is 1) -> (pp, dp, tp)."""
    sizes = parse_mesh_dims(text)
    return sizes["pp"], sizes["dp"], sizes["tp"]


def parse_mesh_dims(text: str) -> dict[str, int]:
    """``pp=2,dp=4,cp=2,tp=8`` (any order; a missing dim is 1) -> each dim's size."""
    sizes = {"pp": 1, "dp": 1, "cp": 1, "tp": 1}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh takes pp=P,dp=D,tp=T (and cp=C) with positive sizes, "
                              f"got {text!r}")
        sizes[key] = int(value)
    return sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attention_heads(model: Any) -> Optional[int]:
    """The model's query heads where its config names them (transformers, nanoGPT)."""
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "n_head", "num_heads", "n_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class Planner:
    """The plans and profiles of one captured model, made once each and kept."""

    def __init__(self, captured: Any, model_name: str, seq: int, heads: Optional[int] = None,
                 planned: Any = None):
        """``captured``: the program profiled; ``planned``: the same program in another dtype
        to plan (a float32 trace plans faster: see ``capture_for_training``)."""
        self.captured = captured
        self.planned = planned if planned is not None else captured
        self.model_name = model_name
        self.seq = seq
        self.heads = heads
        self.plans: dict[tuple[int, bool, int], Any] = {}
        self.errors: dict[tuple[int, bool, int], str] = {}
        self.profiles: dict[tuple[int, bool, int, int, int], Profile] = {}

    def plan(self, tp: int, sp: bool, ep: int = 1) -> Any:
        key = (tp, sp, ep)
        if self.heads and self.heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {self.heads} attention heads")
        if key not in self.plans and key not in self.errors:
            try:
                self.plans[key] = plan_graph(
                    self.planned, tp, cost_model=CostModel(batch=1, seq=self.seq),
                    options=PlanOptions(sequence_parallel=sp, expert_parallel=ep),
                    model_name=self.model_name)
            except AutotpError as exc:
                self.errors[key] = str(exc).splitlines()[0]
        if key in self.errors:
            raise ConfigError(self.errors[key])
        return self.plans[key]

    def profile(self, tp: int, sp: bool, micro_batch: int, dtype_bytes: int,
                ep: int = 1, cp: int = 1) -> Profile:
        """The program of one rank; with ``cp``, on its 1/cp of the sequence (the tp plan
        is the same: context parallelism adds the ring around attention, not a layout)."""
        key = (tp, sp, micro_batch, ep, cp)
        if key not in self.profiles:
            self.profiles[key] = build_profile(self.captured, self.plan(tp, sp, ep),
                                               micro_batch, self.seq, dtype_bytes, cp=cp)
        return self.profiles[key]

    def experts(self) -> int:
        """The experts of the model's grouped expert products (0: none), from its tp 1 plan."""
        try:
            plan = self.plan(1, False)
        except ConfigError:
            return 0
        return max((count for count, _ in plan.experts.values()), default=0)


def search(planner: Planner, hw: Hardware, req: Request) -> list[Config]:
    """Every configuration ``req`` leaves open, evaluated; fitting ones first, fastest first."""
    g = req.gpus_per_node or hw.gpus_per_node
    if req.dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {req.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    if req.dp_shard not in DATA_PARALLEL:
        raise ConfigError(f"unknown data-parallel sharding {req.dp_shard!r}; use one of "
                          f"{', '.join(DATA_PARALLEL)}")
    prec = get_precision(req.precision, req.optimizer)
    hw.peak(req.dtype)
    if req.cp is not None and positive_int("cp", req.cp) > 1:
        if req.ep is not None and req.ep > 1:
            raise ConfigError(f"cp={req.cp} with ep={req.ep}: context parallelism does not "
                              "combine with expert parallelism; leave one out")
        if req.seq % req.cp:
            raise ConfigError(f"cp={req.cp} does not divide the sequence {req.seq}: each cp "
                              "rank holds an equal share of it")
    if req.mesh is not None:
        pp, dp, tp = req.mesh
        cp = req.cp or 1
        if pp * dp * cp * tp != req.gpus:
            raise ConfigError(f"the mesh pp={pp} x dp={dp} x cp={cp} x tp={tp} = "
                              f"{pp * dp * cp * tp} GPUs, not the {req.gpus} of --gpus")
        meshes = [(pp, dp, cp, tp)]
    else:
        tps = [t for t in _divisors(req.gpus) if req.tp_across_nodes or t <= g]
        meshes = [(pp, req.gpus // (tp * cp * pp), cp, tp) for tp in tps
                  for cp in _context_degrees(req, req.gpus // tp)
                  for pp in _divisors(req.gpus // (tp * cp))]
    policies = [req.checkpointing] if req.checkpointing else list(POLICIES)
    for policy in policies:
        if policy not in POLICIES:
            raise ConfigError(f"unknown checkpointing {policy!r}; use one of "
                              f"{', '.join(POLICIES)}")
    dtype_bytes = DTYPE_BYTES[req.dtype]
    model_flops = _model_flops(planner, req, dtype_bytes)
    experts = planner.experts() if req.ep != 1 else 0
    if req.ep is not None and req.ep > 1 and not experts:
        raise ConfigError(f"ep={req.ep}: the model has no grouped experts to split; leave ep "
                          "out")
    with stage(f"ranking {len(meshes)} meshes"):
        configs = _evaluated(planner, hw, req, prec, meshes, policies, experts, dtype_bytes,
                             model_flops, g)
    configs.sort(key=lambda c: (not c.fits, c.time.step if c.time else math.inf,
                                c.memory.total if c.memory else math.inf))
    return configs


def _evaluated(planner: Planner, hw: Hardware, req: Request, prec: Precision,
               meshes: list[tuple[int, int, int, int]], policies: list[str], experts: int,
               dtype_bytes: int, model_flops: float, g: int) -> list[Config]:
    """Every configuration of ``meshes`` (pp, dp, cp, tp), evaluated or refused."""
    configs: list[Config] = []
    for index, (pp, dp, cp, tp) in enumerate(meshes, 1):
        step(f"pp={pp} dp={dp} cp={cp} tp={tp}", index, len(meshes))
        sps = [req.sequence_parallel] if req.sequence_parallel is not None else \
            ([False, True] if tp > 1 else [False])
        for sp in sps:
            if sp and tp == 1:
                continue
            if req.global_batch % dp:
                configs.append(Config(tp, pp, dp, req.micro_batch or 1, sp, policies[0],
                                      cp=cp, why=f"global batch {req.global_batch} is not "
                                                 f"divisible by dp={dp}"))
                continue
            eps = _expert_degrees(req, experts, tp, dp, g) if cp == 1 else [1]
            if isinstance(eps, str):
                configs.append(Config(tp, pp, dp, req.micro_batch or 1, sp, policies[0],
                                      ep=req.ep or 1, why=eps))
                continue
            per_replica = req.global_batch // dp
            mbs = [req.micro_batch] if req.micro_batch else \
                [m for m in _divisors(per_replica) if m <= req.max_micro_batch]
            for ep in eps:
                for mb in mbs:
                    for policy in policies:
                        config = _evaluate(planner, hw, req, prec, tp, pp, dp, mb, sp, policy,
                                           dtype_bytes, g, model_flops,
                                           asked=bool(req.checkpointing), ep=ep, cp=cp)
                        if config is not None:
                            configs.append(config)
    return configs


def _context_degrees(req: Request, ranks: int) -> list[int]:
    """The cp to evaluate with ``ranks`` GPUs left beside tp: the asked one, or every cp that
    divides them and leaves each rank an equal, even share of the sequence (the causal
    balance holds two chunks of 2 x cp per rank) of at least ``MIN_CP_TOKENS``; 1 for a
    mixture of experts with ep searched or asked (they do not combine yet)."""
    if req.cp is not None:
        return [req.cp] if ranks % req.cp == 0 else []
    if req.ep is not None and req.ep > 1:
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or (
        req.seq % (2 * c) == 0 and req.seq // c >= MIN_CP_TOKENS)]


# Below this many tokens per rank the ring's shifts outweigh the attention they hide behind
# (a 4k shard of LLaMA-8B's keys and values takes about as long to send as its attention
# takes to compute): shorter shards are not searched (``--mesh ...,cp=C`` evaluates any).
MIN_CP_TOKENS = 1024


def _expert_degrees(req: Request, experts: int, tp: int, dp: int,
                    gpus_per_node: int) -> "list[int] | str":
    """The ep to evaluate at (tp, dp), or why not as text: the asked one, or 1 and the
    largest ep of the dp ranks that splits the experts whole (experts / (tp x ep) each) with
    its all-to-alls within a node (each ep is a plan of its own: others are left to
    ``--ep``)."""
    if req.ep is None:
        within = [ep for ep in _divisors(dp)[1:] if experts and experts % (tp * ep) == 0 and
                  tp * ep <= gpus_per_node]
        return [1, *within[-1:]]
    if dp % req.ep:
        return f"ep={req.ep} does not divide dp={dp}: expert parallelism splits the dp ranks"
    if req.ep > 1 and experts % (tp * req.ep):
        return (f"tp={tp} x ep={req.ep} does not divide the {experts} experts: each rank holds "
                "whole experts")
    return [req.ep]


def _model_flops(planner: Planner, req: Request, dtype_bytes: int) -> float:
    """Training FLOPs of one sample: 3 x the forward products of the unsharded program."""
    try:
        prof = planner.profile(1, False, 1, dtype_bytes)
    except ConfigError:
        return 0.0
    return 3.0 * sum(op.flops for op in prof.ops if op.kind != "memory")


def _evaluate(planner: Planner, hw: Hardware, req: Request, prec: Precision, tp: int, pp: int,
              dp: int, mb: int, sp: bool, policy: str, dtype_bytes: int, g: int,
              model_flops: float, asked: bool = True, ep: int = 1,
              cp: int = 1) -> Optional[Config]:
    """One configuration evaluated; None for selective recomputation where the attention
    keeps nothing quadratic (a fused attention): the same as none, left out unless asked."""
    config = Config(tp, pp, dp, mb, sp, policy, ep=ep, cp=cp)
    per_replica = req.global_batch // dp
    if per_replica % mb:
        config.why = (f"the global batch {req.global_batch} over dp={dp} is {per_replica}, "
                      f"not a multiple of micro-batch {mb}")
        return config
    if sp and (req.seq // cp) % tp:
        config.why = (f"sequence parallelism needs tp={tp} to divide the sequence "
                      f"{req.seq // cp}" + (f" each of cp={cp} holds" if cp > 1 else ""))
        return config
    if req.seq % cp:
        config.why = f"cp={cp} does not divide the sequence {req.seq}"
        return config
    try:
        prof = planner.profile(tp, sp, mb, dtype_bytes, ep, cp)
    except ConfigError as exc:
        config.why = str(exc)
        return config
    if policy == "selective" and not asked and not any(
            s.quadratic and s.layer is not None for s in prof.saved):
        return None
    if prof.experts:
        config.experts = (prof.experts, prof.top_k, prof.expert_imbalance)
    if pp > len(prof.layers):
        config.why = f"pp={pp} is more than the {len(prof.layers)} layers"
        return config
    mesh = MeshShape(tp=tp, pp=pp, dp=dp, gpus_per_node=g, ep=ep, cp=cp)
    m = per_replica // mb
    # stages balanced by each layer's time (the embeddings and head weigh on the ends)
    one = {layer: stage_work(prof, hw, [layer], first=False, last=False, policy=policy,
                             dtype=req.dtype, mesh=mesh) for layer in prof.layers}
    weight = {k: w.forward + w.backward + w.recompute + w.comm + w.ring
              for k, w in one.items()}
    ends = [stage_work(prof, hw, [], first=side == "first", last=side == "last",
                       policy=policy, dtype=req.dtype, mesh=mesh) for side in ("first", "last")]
    stages = balanced_stages(list(prof.layers), pp, weight,
                             *(w.forward + w.backward + w.comm + w.ring for w in ends))
    config.stages = stages
    memories = [stage_memory(prof, i, stages, micro_batches=m, policy=policy, prec=prec,
                             dp=dp * cp, dp_shard=req.dp_shard) for i in range(pp)]
    config.memory = max(memories, key=lambda x: x.total)
    works: list[StageWork] = [
        stage_work(prof, hw, stage, first=i == 0, last=i == pp - 1, policy=policy,
                   dtype=req.dtype, mesh=mesh) for i, stage in enumerate(stages)]
    stage_params = [_stage_param_numel(prof, stages, i) for i in range(pp)]
    stage_experts = [_stage_param_numel(prof, stages, i, experts=True) for i in range(pp)]
    boundary = max(prof.layer_inputs.values(), default=0.0)
    config.time = step_time(works, hw, micro_batches=m, mesh=mesh, prec=prec,
                            stage_params=stage_params, boundary_bytes=boundary,
                            layers_per_stage=[len(s) for s in stages], dp_shard=req.dp_shard,
                            stage_experts=stage_experts)
    peak = hw.peak(req.dtype)
    if config.time.step > 0 and model_flops:
        config.mfu = model_flops * req.global_batch / (config.time.step * req.gpus * peak)
    usable = hw.usable_memory
    if config.memory.total > usable:
        config.why = (f"{_gb(config.memory.total)} on GPU "
                      f"{config.memory.stage * tp * cp * dp} "
                      f"(stage {config.memory.stage}) > {_gb(usable)} usable of "
                      f"{_gb(hw.memory)}: " + _largest_part(config.memory))
    else:
        config.fits = True
    return config


def _stage_param_numel(prof: Profile, stages: Sequence[Sequence[int]], stage: int,
                       experts: bool = False) -> float:
    """The stage's parameter elements on a rank (``experts``: only those split over ep)."""
    return float(sum(p.numel for p in prof.params if on_stage(p, stage, stages) and
                     (p.expert or not experts)))


def _largest_part(m: Memory) -> str:
    parts = {"activations": m.activations, "optimizer state": m.optimizer,
             "parameters": m.parameters, "gradients": m.gradients,
             "recompute/gather buffers": m.transient}
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {_gb(parts[name])}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def estimate(model: torch.nn.Module, *, gpus: int, global_batch: int, seq: int,
             hardware: Any = "h100", example_args: Optional[tuple] = None,
             example_kwargs: Optional[dict] = None, model_name: Optional[str] = None,
             **options: Any) -> Estimate:
    """Rank every tp x pp x dp (x micro-batch, sequence parallelism, recomputation) of
    training ``model`` on ``gpus`` GPUs of ``hardware`` (a preset name, a ``Hardware`` or a
    JSON/TOML file): memory per GPU and step time of each, best first. Options are the
    fields of ``Request`` (``mesh=(pp, dp, tp)``, ``micro_batch``, ``checkpointing``,
    ``sequence_parallel``, ``gpus_per_node``, ``dtype``, ``precision``, ``optimizer``,
    ``dp_shard``); the ones left out are searched. The model may be on the meta device."""
    start = time.perf_counter()
    hw = get_hardware(hardware)
    req = Request(gpus=positive_int("gpus", gpus), global_batch=positive_int("global_batch",
                                                                          global_batch),
                  seq=positive_int("seq", seq), **options)
    if example_args is None and example_kwargs is None:
        example_kwargs = training_example(model)
    profiled, planned = capture_for_training(model, example_args, example_kwargs, req.dtype)
    planner = Planner(profiled, model_name or type(model).__name__, seq,
                      attention_heads(model), planned)
    configs = search(planner, hw, req)
    return Estimate(model=model_name or type(model).__name__, hardware=hw, gpus=req.gpus,
                    global_batch=req.global_batch, seq=seq, dtype=req.dtype,
                    precision=get_precision(req.precision, req.optimizer).name,
                    configs=configs, seconds=time.perf_counter() - start)


def capture_for_training(model: torch.nn.Module, example_args: Optional[tuple],
                         example_kwargs: Optional[dict], dtype: str) -> tuple[Any, Any]:
    """(the program to profile, the program to plan). The first is traced in the training
    dtype where that costs nothing: a model on meta is copied and cast, so the values it
    computes in float32 (an RMSNorm's upcast, the loss's ``logits.float()``) count 4 bytes,
    not the training dtype's. A model with weights is traced as it is.

    The plan comes from the model as given when its program has the same ops in the same
    order (the profiled program's nodes then take its names): a plan does not depend on the
    dtype, and the search is faster where every float is one width (in bfloat16, the float32
    norms make layouts of equal communication differ by a few bytes, the beam keeps a
    different subset of them in each layer, and no layer's solution is reused: 53 s instead
    of 5 s for a LLaMA-2-70B shape at tp 8)."""
    target = torch.float32 if dtype == "tfloat32" else getattr(torch, dtype, None)
    params = list(model.parameters())
    floats = {p.dtype for p in params if p.dtype.is_floating_point}
    planned = capture(model, example_args, example_kwargs)
    if not (isinstance(target, torch.dtype) and floats and floats != {target} and
            all(p.device.type == "meta" for p in params)):
        return planned, planned
    profiled = capture(copy.deepcopy(model).to(target), example_args, example_kwargs)

    mine, theirs = list(planned.gm.graph.nodes), list(profiled.gm.graph.nodes)
    if [(n.op, n.target) for n in mine] != [(n.op, n.target) for n in theirs]:
        return profiled, profiled
    for a, b in zip(mine, theirs):  # read only from here on: no code is generated from it
        b.name = a.name
    return profiled, planned


def training_example(model: torch.nn.Module) -> dict[str, Any]:
    """A transformers model's example with ``labels=`` when it computes its own loss."""
    example = default_example(model)
    if "labels" in inspect.signature(model.forward).parameters:
        example["labels"] = example["input_ids"]
    return example



