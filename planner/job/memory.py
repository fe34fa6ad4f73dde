"""Memory per GPU of a training configuration: weights, gradients, optimizer state and the
activations autograd keeps, as the plan, the data-parallel sharding and the pipeline stage
hold them.

    model states  = sum over the stage's parameters of  local numel x (weight + gradient +
                    optimizer bytes per element), divided by dp where FSDP shards them (not
                    experts split over ep ranks: each rank holds its own whole)
    activations   = in-flight micro-batches x (what the stage's layers keep for backward under
                    the recomputation policy) + the embeddings' / head's own
    peak          = model states + activations + the transient of the policy (a fully
                    recomputed layer's activations, rebuilt during its backward) + the
                    largest gradient pair one op's backward holds (the head's, over the
                    vocabulary, in float32) + FSDP's gathered weights of the layers in flight

Activations come from ``profile.py``, which reads them off the captured program and the plan
(the tensors autograd saves on one rank), not from a formula. Under 1F1B the first stage
holds ``pp`` micro-batches' activations, stage ``i`` holds ``pp - i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from autotp.errors import ConfigError

if TYPE_CHECKING:  # (the command line's parser reads PRECISIONS without the planner)
    from autotp.planner.job.profile import Param, Profile

POLICIES = ("none", "selective", "full")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element of each model state."""

    name: str
    weight: int
    grad: int
    optimizer: int  # master weights and moments
    master: int = 0  # of which a float32 master copy of the weights

    @property
    def optimizer_bytes_moved(self) -> int:
        """Bytes one fused optimizer step reads and writes per parameter element: the
        gradient read (and zeroed after), the state (master weights and moments) read and
        written, the weights written, and read too where they are their own master."""
        return 2 * self.grad + 2 * self.optimizer + (1 if self.master else 2) * self.weight


# name -> (weight, gradient, float32 master copy, bytes per moment element)
PRECISIONS = {
    # mixed precision with Adam: 16-bit weights and gradients, float32 master weights and
    # two float32 moments (Rajbhandari et al., ZeRO: 2 + 2 + 12 bytes per parameter)
    "bf16-mixed": (2, 2, 4, 4),
    "fp16-mixed": (2, 2, 4, 4),
    # everything in bfloat16, the moments too (model.to(torch.bfloat16) and torch's AdamW:
    # 2 + 2 + 4 bytes per parameter)
    "bf16": (2, 2, 0, 2),
    "fp32": (4, 4, 0, 4),
}
# moments per parameter element, by optimizer
OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1, "sgd-nomomentum": 0}
DATA_PARALLEL = ("fsdp", "optimizer", "none")  # what dp shards: everything, the optimizer, nothing


def precision(name: str, optimizer: str = "adam") -> Precision:
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of "
                          f"{', '.join(OPTIMIZER_MOMENTS)}")
    weight, grad, master, moment = PRECISIONS[name]
    return Precision(f"{name}/{optimizer}", weight, grad,
                     master + OPTIMIZER_MOMENTS[optimizer] * moment, master)


@dataclass
class Memory:
    """Bytes on the GPU of one pipeline stage (the fullest one when it is a result)."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    transient: float  # recomputation buffers, FSDP's gathered weights

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + \
            self.transient


def layer_activations(prof: Profile, policy: str) -> dict[int, float]:
    """Bytes one micro-batch leaves saved per layer under ``policy``."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown checkpointing {policy!r}; use one of {', '.join(POLICIES)}")
    key = ("activations", policy)
    if key not in prof.cache:
        prof.cache[key] = _layer_activations(prof, policy)
    return prof.cache[key]


def _layer_activations(prof: Profile, policy: str) -> dict[int, float]:
    out = {layer: 0.0 for layer in prof.layers}
    if policy == "full":
        for layer, nbytes in prof.layer_inputs.items():
            out[layer] = out.get(layer, 0.0) + nbytes
        return out
    for s in prof.saved:
        if s.layer is not None and not (policy == "selective" and s.quadratic):
            out[s.layer] = out.get(s.layer, 0.0) + s.nbytes
    return out


def end_activations(prof: Profile, side: str) -> float:
    return sum(s.nbytes for s in prof.saved if s.layer is None and s.side == side)


def on_stage(param: Param, stage: int, stages: Sequence[Sequence[int]]) -> bool:
    """Whether pipeline stage ``stage`` holds ``param``: a layer's on the stage of its layer,
    the embeddings' on the first, the head's on the last, a tied pair's on both."""
    if param.end == "layer":
        return param.layer in stages[stage] if param.layer is not None else stage == 0
    return (stage == 0 and param.end in ("first", "both")) or \
        (stage == len(stages) - 1 and param.end in ("last", "both"))


def stage_memory(prof: Profile, stage: int, stages: Sequence[Sequence[int]], *,
                 micro_batches: int, policy: str, prec: Precision, dp: int,
                 dp_shard: str = "fsdp") -> Memory:
    """The memory of pipeline stage ``stage`` (``stages``: the layers of each stage)."""
    pp = len(stages)
    mine = set(stages[stage])
    numel = experts = 0.0
    largest_layer: dict[int, float] = {}
    for p in prof.params:
        if on_stage(p, stage, stages):
            if p.expert:  # outside FSDP (autotp.expert_parameters): never sharded or gathered
                experts += p.numel
                continue
            numel += p.numel
            key = p.layer if p.layer is not None else -1
            largest_layer[key] = largest_layer.get(key, 0.0) + p.numel
    shard = dp if dp_shard == "fsdp" else 1
    opt_shard = dp if dp_shard in ("fsdp", "optimizer") else 1
    per_layer = layer_activations(prof, policy)
    in_flight = max(1, min(pp - stage, micro_batches))
    act = sum(per_layer.get(layer, 0.0) for layer in mine)
    if stage == 0:
        act += end_activations(prof, "first")
    if stage == pp - 1:
        act += end_activations(prof, "last")
    transient = 0.0
    if policy == "full" and mine:
        full = layer_activations(prof, "none")
        transient += max(full.get(layer, 0.0) for layer in mine)
    ends = (["first"] if stage == 0 else []) + (["last"] if stage == pp - 1 else [])
    transient += max([prof.backward_working.get(at, 0.0) for at in [*mine, *ends]],
                     default=0.0)
    if dp_shard == "fsdp" and dp > 1 and largest_layer:
        # the unsharded weights of the layer in use and the one prefetched
        biggest = sorted(largest_layer.values(), reverse=True)[:2]
        transient += sum(biggest) * prec.weight
    return Memory(stage=stage, parameters=numel * prec.weight / shard + experts * prec.weight,
                  gradients=numel * prec.grad / shard + experts * prec.grad,
                  optimizer=numel * prec.optimizer / opt_shard + experts * prec.optimizer,
                  activations=act * in_flight, transient=transient)


def balanced_stages(layers: list[int], pp: int, weights: dict[int, float],
                    first: float = 0.0, last: float = 0.0) -> list[list[int]]:
    """Contiguous stages minimising the largest stage's weight (``first``/``last``: what the
    embeddings and the head add to the first and last stage), by dynamic programming."""
    n = len(layers)
    prefix = [0.0]
    for layer in layers:
        prefix.append(prefix[-1] + weights.get(layer, 0.0))
    inf = float("inf")
    # best[k][j]: the smallest largest stage of the first j layers in k stages
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in range(k, n - (pp - k) + 1):
            for i in range(k - 1, j):
                cost = prefix[j] - prefix[i] + (first if k == 1 else 0.0) + \
                    (last if k == pp else 0.0)
                value = max(best[k - 1][i], cost)
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    out, j = [], n
    for k in range(pp, 0, -1):
        i = cut[k][j]
        out.append(layers[i:j])
        j = i
    return out[::-1]
