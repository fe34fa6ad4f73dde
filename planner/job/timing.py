"""Step time of a training configuration, from the rank program's own ops and collectives.

    compute    each product at  (FLOPs + knee) / (peak x efficiency)  (small GEMMs run further
               from peak: the tensor-parallel slices of a small model), each other kernel at
               its bytes over the memory bandwidth plus a fixed overhead; backward = 2x forward
               (2.5x for fused attention); recomputation adds the forward it repeats
    tp comm    every collective of the plan: launch latency + one hop latency per ring step
               (2 (p - 1) for an all-reduce, p - 1 for an all-gather or reduce-scatter) +
               ring factor x bytes / bus bandwidth, within a node or across nodes as the
               group lies
    ep comm    with expert parallelism, each MoE layer's all-to-alls over the ep group (rows
               to their experts and back, twice each way): p - 1 steps, (p - 1) / p of the
               rows' bytes
    cp comm    with context parallelism, each attention's key/value blocks around the cp
               ranks (``runtime/ring.ring_attention``): cp - 1 shifts forward, and the
               blocks with their gradients backward, each shift overlapping the attention
               work of one step (1 / cp of the attention's) so that only what the transfer
               takes beyond it shows, plus the last gradient shift home; an eager
               attention's keys and values gathered over cp (not overlapped)
    pp bubble  1F1B: (pp - 1) micro-batch slots of the slowest stage, plus the stage-to-stage
               sends of activations and their gradients
    dp comm    the gradients' reduce (and FSDP's weight gathers), overlapped with backward
               except the last layer's share; experts split over ep ranks are summed over
               the dp / ep ranks holding the same experts, without gathers
    optimizer  one fused step over the rank's shard of the parameters and the zeroing of
               its gradients: memory-bound, ``Precision.optimizer_bytes_moved`` per element
               at the optimizer's achieved bandwidth

The ranks are laid out as a (pp, dp, cp, tp) mesh: tp innermost (adjacent GPUs, within a
node), then cp, dp and pp; an ep group is ep consecutive dp ranks. The parameters are whole
on every cp rank: their gradients are summed, and FSDP shards them, over dp x cp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autotp.planner.job.hardware import Hardware
from autotp.planner.job.memory import Precision
from autotp.planner.job.profile import Profile
from autotp.planner.transitions import Collective

BACKWARD = {"gemm": 2.0, "attention": 2.5, "memory": 2.0}


@dataclass
class StepTime:
    step: float
    compute: float
    tp_comm: float
    pp_bubble: float
    dp_comm: float
    optimizer: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0


@dataclass(frozen=True)
class MeshShape:
    """Where the groups of a (pp, dp, cp, tp) mesh lie."""

    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    ep: int = 1
    cp: int = 1

    @property
    def ep_within_node(self) -> bool:
        return self.tp * self.ep <= self.gpus_per_node

    @property
    def tp_within_node(self) -> bool:
        return self.tp <= self.gpus_per_node

    @property
    def cp_within_node(self) -> bool:
        return self.tp * self.cp <= self.gpus_per_node

    @property
    def dp_within_node(self) -> bool:
        return self.tp * self.cp * self.dp <= self.gpus_per_node

    @property
    def pp_within_node(self) -> bool:
        return self.tp * self.cp * self.dp * self.pp <= self.gpus_per_node

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters (their gradients summed): dp x cp."""
        return self.dp * self.cp


def ring_steps(kind: str, group: int) -> int:
    """Sequential steps of a ring collective: each waits for the neighbour's chunk."""
    return Collective(kind).ring_steps(group)


def collective_time(hw: Hardware, kind: str, nbytes: float, group: int, within: bool) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    _, bandwidth = hw.link(within)
    return hw.ring_latency(ring_steps(kind, group), within) + \
        Collective(kind).ring_factor(group) * nbytes / bandwidth


def _op_time(hw: Hardware, kind: str, flops: float, nbytes: float, dtype: str) -> float:
    if kind == "attention":
        return hw.attention_time(flops, dtype, nbytes)
    if kind == "gemm":
        return hw.gemm_time(flops, dtype, nbytes)
    return hw.memory_time(nbytes)


@dataclass
class StageWork:
    """One micro-batch through one stage: seconds of compute, of tp collectives and of
    expert parallelism's all-to-alls."""

    forward: float
    backward: float
    recompute: float
    comm: float
    exchange: float = 0.0
    ring: float = 0.0  # context parallelism's shifts and gathers, what the compute leaves


def _per_layer(prof: Profile, hw: Hardware, policy: str, dtype: str,
               tp_within_node: bool, ep_within_node: bool = True,
               cp_within_node: bool = True) -> dict[object, StageWork]:
    """Each layer's (and each end's: "first", "last") work for one micro-batch, computed once
    per profile and kept on it."""
    key = ("work", id(hw), policy, dtype, tp_within_node, ep_within_node, cp_within_node)
    if key in prof.cache:
        return prof.cache[key]
    out: dict[object, StageWork] = {}

    def slot(layer: object, side: str) -> StageWork:
        at = layer if layer is not None else side
        if at not in out:
            out[at] = StageWork(0.0, 0.0, 0.0, 0.0)
        return out[at]

    attention: dict[object, list[float]] = {}  # per slot: each attention's forward time
    for op in prof.ops:
        w = slot(op.layer, op.side)
        t = _op_time(hw, op.kind, op.flops, op.nbytes, dtype)
        w.forward += t
        w.backward += BACKWARD[op.kind] * t
        if op.layer is not None and (policy == "full" or (policy == "selective" and
                                                          op.quadratic)):
            w.recompute += t
        if op.kind == "attention":
            attention.setdefault(op.layer if op.layer is not None else op.side, []).append(t)
    shifts: dict[object, int] = {}
    for c in prof.comms:
        w = slot(c.layer, c.side)
        if c.group == "cp":
            at = c.layer if c.layer is not None else c.side
            t = _ring_time(hw, c, prof.cp, cp_within_node, attention.get(at, []),
                           shifts.get((at, c.kind, c.phase), 0))
            shifts[(at, c.kind, c.phase)] = shifts.get((at, c.kind, c.phase), 0) + 1
            w.ring += t
            if policy == "full" and c.layer is not None and c.phase == "forward":
                w.ring += t  # the recomputed forward goes around again
            continue
        if c.group == "ep":
            t = collective_time(hw, c.kind, c.nbytes, prof.ep, ep_within_node)
            w.exchange += t
            if policy == "full" and c.layer is not None and c.phase == "forward":
                w.exchange += t
            continue
        t = collective_time(hw, c.kind, c.nbytes, prof.tp, tp_within_node)
        w.comm += t
        if policy == "full" and c.layer is not None and c.phase == "forward":
            w.comm += t  # the recomputed forward communicates again
    prof.cache[key] = out
    return out


def _ring_time(hw: Hardware, c: Any, cp: int, within: bool, attention: list[float],
               index: int) -> float:
    """What one attention's ring (``c``: its forward or backward shifts, or the gradients'
    last shift home) adds to the step beyond the attention's own work, or an eager
    attention's gather over cp. ``attention``: the forward times of the slot's attentions,
    the ``index``-th of them this ring's."""
    if cp <= 1 or c.nbytes <= 0:
        return 0.0
    if c.kind not in ("shift", "shift_home"):
        return collective_time(hw, c.kind, c.nbytes, cp, within)
    _, bandwidth = hw.link(within)
    one = hw.ring_latency(1, within) + c.nbytes / bandwidth
    if c.kind == "shift_home":
        return one
    work = attention[index] if index < len(attention) else 0.0
    if c.phase == "backward":
        work *= BACKWARD["attention"]
    return (cp - 1) * max(0.0, one - work / cp)


def stage_work(prof: Profile, hw: Hardware, layers: Sequence[int], *, first: bool, last: bool,
               policy: str, dtype: str, mesh: MeshShape) -> StageWork:
    per = _per_layer(prof, hw, policy, dtype, mesh.tp_within_node, mesh.ep_within_node,
                     mesh.cp_within_node)
    keys: list[int | str] = list(layers) + (["first"] if first else []) + \
        (["last"] if last else [])
    total = StageWork(0.0, 0.0, 0.0, 0.0)
    for key in keys:
        w = per.get(key)
        if w is not None:
            total.forward += w.forward
            total.backward += w.backward
            total.recompute += w.recompute
            total.comm += w.comm
            total.exchange += w.exchange
            total.ring += w.ring
    return total


def step_time(works: Sequence[StageWork], hw: Hardware, *, micro_batches: int,
              mesh: MeshShape, prec: Precision, stage_params: Sequence[float],
              boundary_bytes: float, layers_per_stage: Sequence[int],
              dp_shard: str = "fsdp", stage_experts: Sequence[float] = ()) -> StepTime:
    """The step of ``micro_batches`` micro-batches through the stages of ``works``;
    ``stage_experts``: of each stage's parameters, those split over the ep ranks."""
    slots = [w.forward + w.backward + w.recompute + w.comm + w.exchange + w.ring
             for w in works]
    slowest = max(range(len(works)), key=lambda i: slots[i])
    w = works[slowest]
    m = micro_batches
    compute = m * (w.forward + w.backward + w.recompute)
    tp_comm = m * w.comm
    ep_comm = m * w.exchange
    cp_comm = m * w.ring
    experts = stage_experts[slowest] if stage_experts else 0.0
    pp = mesh.pp
    bubble = 0.0
    if pp > 1:
        _, bandwidth = hw.link(mesh.pp_within_node)
        send = hw.ring_latency(1, mesh.pp_within_node) + boundary_bytes / bandwidth
        bubble = (pp - 1) * slots[slowest] + (m + pp - 1) * 2 * send
    replicas_all = mesh.replicas  # dp x cp: the ranks summing each gradient
    shard = replicas_all if dp_shard in ("fsdp", "optimizer") else 1
    # experts split over ep ranks are outside the data-parallel sharding: each rank steps
    # its own whole
    optimizer = hw.optimizer_time((stage_params[slowest] - experts) / shard *
                                  prec.optimizer_bytes_moved +
                                  experts * prec.optimizer_bytes_moved)
    dp_comm = 0.0
    replicas = mesh.dp // mesh.ep * mesh.cp  # ranks holding the same experts
    if experts and replicas > 1:
        _, bandwidth = hw.link(mesh.dp_within_node)
        dp_comm += hw.ring_latency(ring_steps("all_reduce", replicas), mesh.dp_within_node) + \
            2.0 * (replicas - 1) / replicas * experts * prec.grad / bandwidth
    if replicas_all > 1:
        params = stage_params[slowest] - experts
        ring = 2.0 * (replicas_all - 1) / replicas_all
        _, bandwidth = hw.link(mesh.dp_within_node)
        latency = hw.ring_latency(ring_steps("all_reduce", replicas_all), mesh.dp_within_node)
        total = latency + ring * params * prec.grad / bandwidth  # reduce-scatter + all-gather
        if dp_shard == "fsdp":  # weights gathered for each micro-batch's forward and backward
            total += m * 2 * (replicas_all - 1) / replicas_all * params * prec.weight / \
                bandwidth
        overlap = m * w.backward + (m * w.forward if dp_shard == "fsdp" else 0.0)
        total += dp_comm  # the experts' sum, overlapped alike
        tail = total / max(1, layers_per_stage[slowest])
        dp_comm = max(total - overlap, tail)
    return StepTime(step=compute + tp_comm + ep_comm + cp_comm + bubble + dp_comm + optimizer,
                    compute=compute, tp_comm=tp_comm, pp_bubble=bubble, dp_comm=dp_comm,
                    optimizer=optimizer, ep_comm=ep_comm, cp_comm=cp_comm)
