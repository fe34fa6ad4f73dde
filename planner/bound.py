"""Megatron's bound, judged on a Plan: the one verdict that the plan's summary, ``autotp plan``
(table and JSON) and the HTML page print.

Megatron-LM shards every large matrix of a transformer layer and communicates twice per layer
each way. A plan is at the bound when it has layers (``autotp.capture.blocks``: the calls of the
model's repeated blocks) and every layer L meets all three of:

    collectives   per phase, count(L) <= 2 (Megatron's all-reduces: attention's output and
                  the MLP's down projection); 4 with sequence parallelism (each all-reduce an
                  all-gather and a reduce-scatter). A joined collective counts once. Counted
                  are L's large collectives: at least an eighth of the bytes of L's largest
                  (the planner's own measure, at the cost model's reference batch and
                  sequence). A norm over sharded features all-reduces its statistics, one or
                  two numbers a row (1/h of an activation), and one head's probabilities
                  returned beside the output are reduced alone: these are listed apart, as
                  the small collectives, not counted against the bound.
    no matrix     no large matrix of L is held whole (layout R): a parameter of two or more
    whole         dims (3-D expert and per-head weights included) whose width is at least
                  half L's width, where
                      width(shape) = max over splits of the dims into two groups A | B of
                                     min(prod A, prod B)   (a 2-D matrix: its smaller side)
                      width(L)     = the largest width of L's 2-D parameters (the hidden size
                                     of a transformer block; of all its parameters where none
                                     is 2-D)
                  Narrower ones are Megatron's to keep whole too (a router over the experts,
                  rank-r adapters, k/v projections of fewer heads than tp).
    its share     each rank holds about 1/tp of L's parameters:
                      local(L) <= 1.25 * large(L) / tp + small(L)
                  bytes of L's parameters as one rank holds them (local), of its large
                  matrices (large) and of the rest, whole (small: norms, biases, the narrow
                  matrices). The slack covers segments held whole (a fused projection's
                  unequal blocks).

A parameter is L's when L is the first layer that reads it. The parameter criteria hold at
tp 1 (nothing to split) and for a context-parallel group (its ranks hold the parameters whole
by design). Bytes are not judged here: a layer's bytes are Megatron's when it has his
collectives of the same values (``within_bound`` takes a measured ratio, for benchmarks).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

if TYPE_CHECKING:  # the plan imports this module for its summary
    from autotp.planner.plan import ParamPlan, Plan

# Megatron-LM's bound, per transformer layer and direction: two all-reduces (attention's
# output projection, the MLP's down projection) of B x T x h each
MEGATRON_BOUND = {"forward": 2, "backward": 2}
# sequence parallelism splits each all-reduce into a reduce-scatter and an all-gather
SEQUENCE_PARALLEL_BOUND = {"forward": 4, "backward": 4}
# bytes may exceed Megatron's by this factor and still be at the bound (float rounding of
# sizes, a norm's [.., 1] statistic joined in)
BOUND_BYTES = 1.01
# a rank may hold this many times 1/tp of a layer's large matrices (see the docstring)
SHARE_SLACK = 1.25
PHASES = ("forward", "backward")


def within_bound(count: int, bytes_ratio: Optional[float], bound: int) -> bool:
    """One layer's (or block's) collectives in one direction are at Megatron's bound: at most
    ``bound`` of them (Megatron's own count for the block, e.g. ``MEGATRON_BOUND``) carrying
    at most ``BOUND_BYTES`` times Megatron's bytes (``bytes_ratio``; None: not known)."""
    return count <= bound and bytes_ratio is not None and bytes_ratio <= BOUND_BYTES


def width(shape: Sequence[int]) -> int:
    """The smaller side of the squarest matrix ``shape`` folds into (its dims split in two
    groups): a 2-D matrix's smaller side; [experts, h, f] -> min(experts * h, f) or so."""
    dims = list(shape)
    if len(dims) < 2:
        return 0
    best = 0
    for k in range(1, len(dims)):
        for group in itertools.combinations(range(len(dims)), k):
            inside = math.prod(dims[i] for i in group)
            best = max(best, min(inside, math.prod(dims) // max(inside, 1)))
    return best


@dataclass(frozen=True)
class LayerVerdict:
    """One layer against the bound: its collectives per phase, its large matrices held whole
    (names relative to the layer), and its parameter bytes (see the module docstring)."""

    layer: int
    counts: tuple[int, int]  # forward, backward: the large collectives
    whole: tuple[str, ...]
    local_bytes: int
    large_bytes: int
    small_bytes: int
    tp: int
    small: tuple[int, int] = (0, 0)  # forward, backward: the statistics' all-reduces

    @property
    def allowed_bytes(self) -> float:
        return SHARE_SLACK * self.large_bytes / self.tp + self.small_bytes

    @property
    def total_bytes(self) -> int:
        return self.large_bytes + self.small_bytes

    def share_ok(self) -> bool:
        return self.local_bytes <= self.allowed_bytes

    def problems(self, bound: dict[str, int]) -> list[str]:
        """What keeps this layer off the bound, in words (none: it is at the bound)."""
        out = [f"{n} {phase} collectives (Megatron: {bound[phase]})"
               for phase, n in zip(PHASES, self.counts) if n > bound[phase]]
        if self.whole:
            out.append(f"large matrices held whole: {', '.join(self.whole)}")
        if not self.share_ok():
            total = max(self.total_bytes, 1)
            out.append(f"each rank holds {self.local_bytes / total:.0%} of the layer's "
                       f"parameters (at most {self.allowed_bytes / total:.0%}: "
                       f"{SHARE_SLACK:g}/tp of its large matrices and its small tensors)")
        return out


@dataclass(frozen=True)
class Verdict:
    """The plan against Megatron's bound: ``met`` and, where not, why (``reasons``)."""

    bound: dict[str, int]  # collectives per layer and phase
    layers: tuple[LayerVerdict, ...]

    @property
    def met(self) -> bool:
        return bool(self.layers) and not any(v.problems(self.bound) for v in self.layers)

    def reasons(self) -> list[str]:
        """``layers 0-5: ...`` for each group of layers with the same problems."""
        if not self.layers:
            return ["no repeated layers found: nothing to hold to Megatron's per-layer bound"]
        groups: dict[tuple[str, ...], list[int]] = {}
        for verdict in self.layers:
            problems = tuple(verdict.problems(self.bound))
            if problems:
                groups.setdefault(problems, []).append(verdict.layer)
        out = []
        for problems, layers in groups.items():
            head = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layer_ranges(layers)}"
            out += [f"{head}: {problem}" for problem in problems]
        return out

    def heading(self) -> str:
        """``Megatron bound (2, 2): met`` or ``... not met``."""
        return (f"Megatron bound ({self.bound['forward']}, {self.bound['backward']}): "
                f"{'met' if self.met else 'not met'}")

    def lines(self) -> list[str]:
        """The heading, then each reason indented (none when met), then the small
        collectives left out of the count."""
        return [self.heading()] + [f"  {reason}" for reason in self.reasons()
                                   if not self.met] + [f"  {note}" for note in self.notes()]

    def notes(self) -> list[str]:
        """``layers 0-5: 4 forward, 4 backward small collectives (...)`` where any."""
        groups: dict[tuple[int, int], list[int]] = {}
        for verdict in self.layers:
            if any(verdict.small):
                groups.setdefault(verdict.small, []).append(verdict.layer)
        out = []
        for (forward, backward), layers in groups.items():
            head = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layer_ranges(layers)}"
            out.append(f"{head}: also {forward} forward, {backward} backward small collectives "
                       "(under an eighth of the layer's largest: a norm's statistics, a "
                       "returned slice), not counted")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"met": self.met, "text": self.heading(),
                "reasons": [] if self.met else self.reasons(), "notes": self.notes()}


def megatron_verdict(plan: "Plan") -> Verdict:
    """The one verdict on ``plan`` (see the module docstring)."""
    bound = SEQUENCE_PARALLEL_BOUND if plan.sequence_parallel else MEGATRON_BOUND
    counts: dict[int, list[int]] = {}
    small: dict[int, list[int]] = {}
    sizes = _sizes(plan)
    largest: dict[int, float] = {}
    for c, size in zip(plan.collectives, sizes):
        if c.layer is not None:
            largest[c.layer] = max(largest.get(c.layer, 0.0), size)
    for c, size in zip(plan.collectives, sizes):
        if c.layer is not None:
            kind = counts if size * 8 >= largest[c.layer] else small
            kind.setdefault(c.layer, [0, 0])[PHASES.index(c.phase)] += 1
    params: dict[int, dict[str, "ParamPlan"]] = {}
    for name, p in plan.params.items():
        if p.layer is not None:
            params.setdefault(p.layer, {})[name] = p
    layers = sorted(set(plan.node_layers.values()) - {None} | set(counts) | set(params))
    judged_params = plan.tp > 1  # (a cp axis alone holds every parameter whole)
    out = []
    for layer in layers:
        mine = params.get(layer, {}) if judged_params else {}
        large = _large(mine)
        path = plan.layer_paths[layer].split("@")[0] if layer < len(plan.layer_paths) else ""
        out.append(LayerVerdict(
            layer=layer, counts=(counts.get(layer, [0, 0])[0], counts.get(layer, [0, 0])[1]),
            whole=tuple(_relative(name, path) for name in large
                        if mine[name].layout.startswith("R")),
            local_bytes=sum(_bytes(p, p.local_shape) for p in mine.values()),
            large_bytes=sum(_bytes(mine[name], mine[name].global_shape) for name in large),
            small_bytes=sum(_bytes(p, p.global_shape) for name, p in mine.items()
                            if name not in large),
            tp=plan.degree, small=tuple(small.get(layer, [0, 0]))))  # type: ignore[arg-type]
    return Verdict(bound=dict(bound), layers=tuple(out))


def _sizes(plan: "Plan") -> list[float]:
    """Each collective's bytes at the cost model's reference batch and sequence."""
    from autotp.planner.cost import CostModel, parse_size_expr

    cost_model = CostModel()
    out = []
    for record in plan.collectives:
        try:
            expr = parse_size_expr(record.bytes_expr)
            out.append(float(cost_model.evaluate(expr, {s: str(s) for s in expr.free_symbols})))
        except Exception:  # noqa: BLE001 - a size the model cannot read: counted as large
            out.append(float("inf"))
    return out


def _large(params: dict[str, "ParamPlan"]) -> list[str]:
    """The large matrices among one layer's parameters (see the module docstring)."""
    matrices = {name: p.global_shape for name, p in params.items() if len(p.global_shape) >= 2}
    flat = [shape for shape in matrices.values() if len(shape) == 2]
    widest = max((width(shape) for shape in flat or matrices.values()), default=0)
    return [name for name, shape in matrices.items() if 2 * width(shape) >= widest]


def _bytes(p: "ParamPlan", shape: Sequence[int]) -> int:
    return math.prod(shape) * getattr(torch, p.dtype).itemsize


def _relative(name: str, path: str) -> str:
    return name[len(path) + 1:] if path and name.startswith(path + ".") else name


def layer_ranges(layers: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    out, start, prev = [], None, None
    for x in sorted(layers):
        if prev is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = x
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ", ".join(out)
