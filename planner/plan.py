"""The Plan: one layout per value, one strategy per op, and the collectives they imply.

A Plan is plain data keyed by graph node names, one ``AxisPlan`` per mesh axis it was planned
over (DTensor's one placement per mesh dim): code reads an axis's plan by its name, or loops
over the axes, rather than asking which combination of axes it is in. It round-trips through
JSON and explains itself; the rewriter executes it and never decides anything on its own.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from autotp.layout import Layout, parse_layout
from autotp.planner.bound import megatron_verdict

if TYPE_CHECKING:  # the export is a feature, a layer above the planner
    from autotp.integrations.export import TpPlanExport
    from autotp.planner.cost import CostModel


@dataclass(frozen=True)
class ParamPlan:
    layout: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    names: tuple[str, ...]  # every name the original model has for it (tied weights)
    grad_sync: bool = False  # replicated, read where its gradient is partial: summed after backward
    layer: Optional[int] = None  # the layer of its first use (for display)
    dtype: str = "float32"  # torch dtype name, for byte counts


@dataclass(frozen=True)
class Edge:
    """Value ``value`` (layout ``src``) is read by ``consumer`` as ``dst``."""

    value: str
    consumer: str
    src: str
    dst: str
    forward: Optional[str]  # collective kind, or None
    backward: Optional[str]
    layer: Optional[int]
    # a layer-invariant value's gather, joined with the others in one collective before the
    # first layer (autotp.runtime.batching)
    batched: bool = False
    # an all-reduce run as one with its siblings' of the same layer (autotp.planner.coalesce):
    # the join's index, shared by every member
    joined: Optional[int] = None


JOINED = "joined: "  # a CollectiveRecord's node when it carries several values


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str
    phase: str
    layer: Optional[int]
    bytes_expr: str
    node: str
    source: Optional[str]
    src: str
    dst: str
    module: Optional[str] = None  # the module path of the source line (None: top level)

    @property
    def members(self) -> tuple[str, ...]:
        """The values it carries: its node's, or a join's (``"joined: a, b"``,
        autotp.planner.coalesce)."""
        if self.node.startswith(JOINED):
            return tuple(self.node.removeprefix(JOINED).split(", "))
        return (self.node,)


@dataclass(frozen=True)
class Choice:
    op: str
    strategy: str
    inputs: tuple[str, ...]
    output: str
    layer: Optional[int]
    source: Optional[str]
    candidates: int


# the axes a plan lays the program's values out over; "ep" splits parameters only
LAYOUT_AXES = ("tp", "cp")


@dataclass
class AxisPlan:
    """What was planned over one mesh axis (DTensor's placements, one entry per mesh dim):
    ``name`` ("tp", "cp" or "ep") and ``degree``; on an axis the values are laid out over
    ("tp", "cp"), each value's layout, each op's strategy, the parameters' layouts and the
    collectives over the axis's group; on "ep", the parameters split over it (the experts,
    tp * ep ways with tp)."""

    name: str
    degree: int = 1
    values: dict[str, str] = field(default_factory=dict)  # node -> layout (or tuple) as text
    choices: dict[str, Choice] = field(default_factory=dict)
    params: dict[str, ParamPlan] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    # ops with no layout rule whose inputs are all constants (no input, parameter or state):
    # computed replicated, exactly, at no communication; listed, not counted as fallbacks
    constants: list[str] = field(default_factory=list)
    cost: float = 0.0
    # tp: the sequence also split between the tensor-parallel ops (sequence parallelism)
    sequence_parallel: bool = False
    # tp: sequence parallelism's regions split the batch (whole sequences): a call's batch
    # must divide by the degree, or it runs a program planned without (runtime.calls)
    batch_tokens: bool = False
    # cp: each attention node -> "ring: why" or "ulysses: why" (how it crosses the shards)
    attention: dict[str, str] = field(default_factory=dict)
    last_resorts: int = 0  # redistributions outside Megatron's pattern (gathers, in fallbacks)
    # stacked expert weights -> [experts, "whole" | "sliced" | "replicated"]
    experts: dict[str, list] = field(default_factory=dict)
    # the parameters split along the experts (stacked weights, per-expert tables): with an
    # "ep" axis, tp * ep ways
    expert_params: list[str] = field(default_factory=list)
    # matrices kept whole that tp could shard -> the ops that stop each way of sharding them
    # (autotp.planner.blockers): direction, layout, node, op, source
    blocked: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    @property
    def lays_out_values(self) -> bool:
        """Whether the program's values are laid out over this axis, not only parameters
        split (``LAYOUT_AXES``)."""
        return self.name in LAYOUT_AXES

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AxisPlan":
        return cls(
            name=data["name"], degree=int(data["degree"]), values=dict(data["values"]),
            choices={k: Choice(**{**v, "inputs": tuple(v["inputs"])})
                     for k, v in data["choices"].items()},
            params={k: ParamPlan(v["layout"], tuple(v["global_shape"]),
                                 tuple(v["local_shape"]), tuple(v["names"]), v["grad_sync"],
                                 v.get("layer"), v.get("dtype", "float32"))
                    for k, v in data["params"].items()},
            edges=[Edge(**e) for e in data["edges"]],
            collectives=[CollectiveRecord(**c) for c in data["collectives"]],
            fallbacks=list(data["fallbacks"]), constants=list(data.get("constants", [])),
            cost=data["cost"], sequence_parallel=bool(data.get("sequence_parallel", False)),
            batch_tokens=bool(data.get("batch_tokens", False)),
            attention=dict(data.get("attention", {})),
            last_resorts=int(data.get("last_resorts", 0)),
            experts={k: list(v) for k, v in data.get("experts", {}).items()},
            expert_params=list(data.get("expert_params", [])),
            blocked={k: [dict(b) for b in v] for k, v in data.get("blocked", {}).items()})


def _led(name: str) -> property:
    """``Plan.<name>``: the lead axis's (``Plan.lead``), read and set."""

    def get(plan: "Plan") -> Any:
        return getattr(plan.lead, name)

    def put(plan: "Plan", value: Any) -> None:
        setattr(plan.lead, name, value)

    return property(get, put, doc=f"The lead axis's {name} (``AxisPlan.{name}``).")


@dataclass
class Plan:
    """The plan of one program over the mesh axes it runs on: ``axes`` (name ->
    ``AxisPlan``) in the order they were planned. The first is the lead axis (``lead``):
    its plan holds the parameters and runs over the rank's own group ("tp"; "cp" where the
    sequence is the only split); a further layout axis ("cp" beside "tp") lays the same
    program's values out over its own group, and "ep" splits the experts further. The
    program's own facts (its graph, layers, inputs' dims, outputs) are the plan's."""

    model: str
    layers: int
    axes: dict[str, AxisPlan] = field(default_factory=dict)
    dims: dict[str, str] = field(default_factory=dict)  # symbol -> B/T
    # the dataflow graph: node -> the tensor nodes it reads; node -> op (for display)
    graph: dict[str, list[str]] = field(default_factory=dict)
    ops: dict[str, str] = field(default_factory=dict)
    node_layers: dict[str, Optional[int]] = field(default_factory=dict)
    # layer -> its module path (``model.layers.3``; ``block@2`` for a block's third call):
    # the repeated blocks' calls, numbered as the program runs them (capture.blocks)
    layer_paths: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # the layout each output is returned in
    # the call computes a loss: field of the mapping returned -> the layout it leaves the
    # program in, gathered when first read (autotp.runtime.outputs)
    gathered_when_read: dict[str, str] = field(default_factory=dict)
    # state inputs (a KV cache): placeholder -> the layout each rank keeps it in
    states: dict[str, str] = field(default_factory=dict)

    values = _led("values")
    choices = _led("choices")
    params = _led("params")
    edges = _led("edges")
    collectives = _led("collectives")
    fallbacks = _led("fallbacks")
    constants = _led("constants")
    cost = _led("cost")
    sequence_parallel = _led("sequence_parallel")
    batch_tokens = _led("batch_tokens")
    attention = _led("attention")
    last_resorts = _led("last_resorts")
    experts = _led("experts")
    expert_params = _led("expert_params")
    blocked = _led("blocked")

    @classmethod
    def over(cls, axis: str, degree: int, *, model: str, layers: int, **facts: Any) -> "Plan":
        """A plan whose one axis is ``axis`` of ``degree`` (filled in by who makes it)."""
        return cls(model=model, layers=layers, axes={axis: AxisPlan(axis, degree)}, **facts)

    # ---- the axes --------------------------------------------------------------------

    @property
    def lead(self) -> AxisPlan:
        """The first axis planned: its layouts are ``values``, ``params``, ``choices``."""
        return next(iter(self.axes.values()))

    @property
    def degree(self) -> int:
        """How many ways the lead axis splits (the degree ``values``' layouts are over)."""
        return self.lead.degree

    def replaced(self, **changes: Any) -> "Plan":
        """A copy with ``changes``: the program's fields on the plan, the others on the lead
        axis (``dataclasses.replace`` across the two)."""
        mine = {k: v for k, v in changes.items() if k in {f.name for f in fields(self)}}
        lead = replace(self.lead, **{k: v for k, v in changes.items() if k not in mine})
        return replace(self, **mine, axes={**self.axes, lead.name: lead})

    def on(self, axis: str) -> "Plan":
        """The plan of ``axis`` alone, on the same program (its lead is ``axis``): what a
        pass that applies one axis's layouts over that axis's group reads."""
        return replace(self, axes={axis: self.axes[axis]})

    def layout_axes(self) -> list[AxisPlan]:
        """The axes the program's values are laid out over, the lead first."""
        return [a for a in self.axes.values() if a.lays_out_values]

    @property
    def splits_sequence(self) -> bool:
        """Whether an axis splits the sequence: tp with sequence parallelism, or cp."""
        return any(a.sequence_parallel or a.name == "cp" for a in self.layout_axes())

    def degree_of(self, axis: str) -> int:
        """``axis``'s degree: 1 where the plan has no such axis."""
        return self.axes[axis].degree if axis in self.axes else 1

    @property
    def tp(self) -> int:
        return self.degree_of("tp")

    @property
    def cp(self) -> int:
        return self.degree_of("cp")

    @property
    def ep(self) -> int:
        return self.degree_of("ep")

    def degrees_text(self) -> str:
        """``tp=2``; ``cp=2 (context parallel, tp=1)``; ``tp=2 x cp=2 (context parallel
        inside tp)``: the layout axes' degrees, and where the sequence split sits."""
        text = " x ".join(f"{a.name}={a.degree}" for a in self.layout_axes())
        if "cp" in self.axes:
            text += " (context parallel, tp=1)" if self.lead.name == "cp" else \
                " (context parallel inside tp)"
        return text

    # ---- queries ---------------------------------------------------------------------

    def layout(self, node: str) -> Layout:
        return parse_layout(self.values[node])

    def param_layout(self, target: str) -> Layout:
        return parse_layout(self.params[target].layout)

    def edges_into(self, consumer: str) -> list[Edge]:
        return [e for e in self.edges if e.consumer == consumer]

    def count(self, phase: str, layer: Optional[int] = None, kind: Optional[str] = None) -> int:
        return sum(
            1 for c in self.collectives
            if c.phase == phase and (layer is None or c.layer == layer)
            and (kind is None or c.kind == kind)
        )

    def per_layer(self) -> dict[Optional[int], Counter]:
        return _per_layer(self.collectives)

    def summary(self) -> str:
        degree = self.degrees_text()
        lines = [f"autotp plan: {self.model}, {degree}, {self.layers} layer(s)"]
        sharded = [n for n, p in self.params.items() if p.layout.startswith("S")]
        lines.append(f"  parameters: {len(sharded)} sharded, {len(self.params) - len(sharded)} "
                     "replicated")
        attention = {node: why for axis in self.layout_axes()
                     for node, why in axis.attention.items()}
        kinds = Counter(why.split(":")[0] for why in attention.values())
        if kinds:  # context parallelism: how each attention crosses the shards, and why
            lines.append("  attention: " + ", ".join(f"{n} by {kind}" for kind, n in
                                                     sorted(kinds.items())))
            lines += [f"    {why}" for why in dict.fromkeys(attention.values())]
        table = self.per_layer()
        layer_keys = sorted((k for k in table if k is not None))
        for key in layer_keys + ([None] if None in table else []):
            label = f"layer {key}" if key is not None else "outside the layers"
            phases = "; ".join(f"{phase}: {_counted(table[key], phase)}"
                               for phase in ("forward", "backward"))
            lines.append(f"  {label}: {phases}")
        lines += [f"  {line}" for line in megatron_verdict(self).lines()]
        for axis in self.layout_axes()[1:]:  # the axes beside the lead (cp inside tp)
            counts = _per_layer(axis.collectives)
            per_layer = {k: v for k, v in counts.items() if k is not None}
            if per_layer:  # every layer's collectives alike, as a rule: the first's
                first = min(per_layer)
                lines.append(f"  over {axis.name}, layer {first}: " + "; ".join(
                    f"{phase}: {_counted(per_layer[first], phase)}"
                    for phase in ("forward", "backward")))
        if self.experts:
            lines.append(f"  experts: {self.experts_summary()}")
        lines += [f"  {line}" for line in self.output_lines()]
        if self.constants:
            lines.append(f"  constants with no rule, computed replicated: {len(self.constants)}")
        if self.fallbacks:
            lines.append(f"  fallbacks (replicated): {len(self.fallbacks)}")
            lines += [f"    {f}" for f in self.fallbacks]
        return "\n".join(lines)

    def experts_summary(self) -> str:
        """How the stacked expert weights are held: ``whole, 16 of 128 per rank`` (expert
        parallelism), ``sliced`` (tensor parallel inside each expert), ``replicated``."""
        kinds = Counter((count, how) for count, how in self.experts.values())
        parts = []
        for (count, how), n in sorted(kinds.items()):
            text = f"whole, {count // (self.degree * self.ep)} of {count} per rank" if \
                how == "whole" else \
                f"{how}, {count} per rank"
            parts.append(f"{text} ({n} stacked weight{'s' if n != 1 else ''})")
        return "; ".join(parts)

    def table(self, cost_model: Optional["CostModel"] = None) -> str:
        """Every parameter's layout and every collective (with its bytes and time under
        ``cost_model``, default ``CostModel()``), as ``autotp plan`` prints them."""
        from autotp.presentation.report import to_table  # a layer above: imported when called
        from autotp.planner.cost import CostModel

        return to_table(self, cost_model or CostModel())

    def report(self, cost_model: Optional["CostModel"] = None) -> dict[str, Any]:
        """The plan as ``autotp plan --format json`` writes it (schema ``autotp.plan/1``,
        docs/command-line.md); ``to_json`` is the plan's own round-trip form."""
        from autotp.presentation.report import to_dict  # a layer above: imported when called
        from autotp.planner.cost import CostModel

        return to_dict(self, cost_model or CostModel())

    def to_html(self, cost_model: Optional["CostModel"] = None) -> str:
        """The one-page HTML view ``autotp plan --format html`` writes."""
        from autotp.presentation.page import to_html  # a layer above: imported when called
        from autotp.planner.cost import CostModel

        return to_html(self, cost_model or CostModel())

    def to_tp_plan(self, *, style: str = "transformers") -> "TpPlanExport":
        """This plan as ``style``'s module styles: "transformers" (a model's ``tp_plan``
        strings) or "torch" (``parallelize_module`` styles); what they cannot say is in
        ``not_expressible`` (``autotp.integrations.export``)."""
        from autotp.integrations.export import to_tp_plan  # a layer above: imported when called

        return to_tp_plan(self, style=style)

    # ---- JSON ------------------------------------------------------------------------

    def output_lines(self) -> list[str]:
        """What leaves the program sharded, in words (nothing: every output gathered)."""
        if self.gathered_when_read:
            fields = ", ".join(f"{k} {v}" for k, v in self.gathered_when_read.items())
            return [f"outputs gathered when read (the call computes a loss): {fields}"]
        if any(x.startswith("S") for x in self.outputs):
            return [f"outputs returned sharded (not gathered): {', '.join(self.outputs)}"]
        return []

    def to_json(self) -> str:
        # insertion order is the graph's execution order, and deterministic
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data: dict[str, Any] = json.loads(text)
        return cls(
            model=data["model"], layers=data["layers"],
            axes={name: AxisPlan.from_dict(axis) for name, axis in data["axes"].items()},
            dims=dict(data["dims"]),
            graph={k: list(v) for k, v in data.get("graph", {}).items()},
            ops=dict(data.get("ops", {})), node_layers=dict(data.get("node_layers", {})),
            layer_paths=list(data.get("layer_paths", [])),
            outputs=list(data.get("outputs", [])), states=dict(data.get("states", {})),
            gathered_when_read=dict(data.get("gathered_when_read", {})))


def _per_layer(collectives: list[CollectiveRecord]) -> dict[Optional[int], Counter]:
    table: dict[Optional[int], Counter] = {}
    for c in collectives:
        table.setdefault(c.layer, Counter())[(c.phase, c.kind)] += 1
    return table


def _counted(counts: Counter, phase: str) -> str:
    """``2 all-reduces``, ``1 all-gather, 1 all-reduce`` or ``none``: the collectives of one
    phase in ``counts`` ((phase, kind) -> number)."""
    parts = [f"{n} {kind.replace('_', '-')}{'' if n == 1 else 's'}"
             for (ph, kind), n in sorted(counts.items()) if ph == phase]
    return ", ".join(parts) or "none"
