"""A Plan in the plan formats the ecosystem runs: transformers' ``tp_plan`` strings and the
``torch.distributed.tensor.parallel`` styles of ``parallelize_module`` (``plan.to_tp_plan()``,
``autotp plan MODEL --tp N --format tp-plan``).

Invariant: a module is listed only where applying the listed styles to the unmodified model
computes what the unsharded model computes, with the plan's parameter layouts. What the styles
cannot say is in ``not_expressible`` with why, and so is every module that shards together
with it: the export leaves a module out rather than list it half right. Modules the plan
replicates are not listed (torch and transformers replicate what a plan leaves out).

A style acts at its module's boundary; the code between a colwise and a rowwise module runs
on each rank's local slices as written, which the plan cannot check: transformers' attention
reshapes to -1 heads and runs exactly (tests/test_export.py); diffusers' attention processor
takes head_dim from the local width with the full head count and runs wrong, silently. Run
an export of a model outside transformers' own plans against the unsharded model once. The
graph is read in ``export_graph``; the vocabulary is ``styles``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from autotp.errors import ConfigError
from autotp.integrations.export_graph import Graph, Site, collectives, sites
from autotp.integrations.styles import (STYLES, UNSAID, Placement, layer_pattern, style_text,
                                    torch_style, transformers_style)
from autotp.planner.plan import Plan


@dataclass(frozen=True)
class TpPlanExport:
    """``modules``: module path -> its style in ``style``'s vocabulary (transformers' strings,
    or the torch style's constructor). ``not_expressible``: parameter, module or source line
    -> why. ``placements``: the styles as data; ``paths``: every module the plan knows of
    (those holding a parameter, and the modules above them), which a transformers pattern
    with ``*`` may reach. Replicated modules are not listed."""

    style: str
    modules: dict[str, str]
    not_expressible: dict[str, str]
    placements: dict[str, Placement]
    paths: tuple[str, ...]

    def as_transformers(self) -> dict[str, str]:
        """A transformers ``tp_plan``: layer indices as ``*`` (transformers matches no other
        form), e.g. ``{"model.layers.*.self_attn.q_proj": "colwise"}``."""
        out: dict[str, str] = {}
        for pattern, paths in _by_pattern(self.paths).items():
            placed = [self.placements.get(path) for path in paths]
            if not any(placed):
                continue
            texts = {transformers_style(p) if p is not None else None for p in placed}
            said = texts.pop() if len(texts) == 1 else None
            if said is None:
                raise ConfigError(f"{pattern}: no single transformers style for every layer; "
                                  "export with plan.to_tp_plan(style='transformers'), which "
                                  "lists such modules as not expressible")
            out[pattern] = said
        return out

    def as_torch(self) -> dict[str, Any]:
        """Module path -> a ``torch.distributed.tensor.parallel`` style, for
        ``parallelize_module(model, mesh, export.as_torch())``."""
        from torch.distributed.tensor import Replicate, Shard, parallel

        layouts = {"Replicate()": Replicate, "Shard(-1)": lambda: Shard(-1)}
        out: dict[str, Any] = {}
        for path, placement in self.placements.items():
            found = torch_style(placement)
            if found is None:
                raise ConfigError(f"{path}: {UNSAID[placement.kind]}; export with "
                                  "plan.to_tp_plan(style='torch'), which lists it as not "
                                  "expressible")
            cls, given, made = found
            out[path] = getattr(parallel, cls)(input_layouts=layouts[given](),
                                               output_layouts=layouts[made]())
        return out

    def to_json(self) -> str:
        """``autotp plan --format tp-plan``, schema ``autotp.tp_plan/1``: {"schema", "style",
        "tp_plan": pattern -> style (transformers) or module -> style (torch),
        "not_expressible": name -> why}."""
        said = self.as_transformers() if self.style == "transformers" else self.modules
        return json.dumps({"schema": "autotp.tp_plan/1", "style": self.style,
                           "tp_plan": said, "not_expressible": self.not_expressible},
                          indent=1) + "\n"


def to_tp_plan(plan: Plan, *, style: str = "transformers") -> TpPlanExport:
    """The plan's parameter layouts as ``style``'s module styles ("transformers": the strings
    of a model's ``tp_plan``; "torch": ``ColwiseParallel``/``RowwiseParallel``). Replicated
    modules are not listed; what the style cannot say is in ``not_expressible``, with why."""
    if style not in STYLES:
        raise ConfigError(f"style must be one of {', '.join(STYLES)}; got {style!r}")
    paths = _module_paths(plan)
    whole = _plan_wide(plan)
    if whole:
        return TpPlanExport(style, {}, whole, {}, paths)
    graph = Graph(plan)
    found = sites(graph)
    gathered, problems = collectives(graph, found)
    found = _one_style_per_module([
        replace(s, placement=replace(s.placement, gathered=True))
        if s.placement is not None and s.boundary in gathered else s for s in found])
    said: dict[str, str] = {}
    bad: dict[str, str] = {}  # region -> the first key not expressible in it
    for node, key, text in problems:
        said[key] = text if key not in said else \
            said[key] if text in said[key] else f"{said[key]}; {text}"
        bad.setdefault(graph.root(node), key)
    changed = True
    while changed:  # a module left out takes its region out, which may break a layer pattern
        changed = False
        placed = {s.module: s.placement for s in found if s.placement is not None
                  and s.problem is None and graph.root(s.op) not in bad}
        uneven = _no_transformers_key(placed, paths) if style == "transformers" else {}
        for s in found:
            own = s.problem or uneven.get(s.module) or (
                UNSAID[s.placement.kind] if s.placement is not None and
                style_text(s.placement, style) is None else None)
            if own is None:
                continue
            said.update({k: own for k in s.params})
            if graph.root(s.op) not in bad:
                bad[graph.root(s.op)], changed = s.params[0], True
    for s in found:
        first = bad.get(graph.root(s.op))
        if first is not None and not any(k in said for k in s.params):
            said.update({k: f"shards together with {first}, which is not expressible"
                         for k in s.params})
    placements = {s.module: s.placement for s in found
                  if s.placement is not None and graph.root(s.op) not in bad}
    return TpPlanExport(style, {m: str(style_text(p, style)) for m, p in placements.items()},
                        said, placements, paths)


def _plan_wide(plan: Plan) -> dict[str, str]:
    if "cp" in plan.axes:
        return {"(context parallelism)": "the sequence is split over the ranks inside "
                "attention; neither torch's nor transformers' tp styles split it"}
    if plan.sequence_parallel:
        return {"(sequence parallelism)": "the activations between blocks are split along the "
                "sequence; torch's SequenceParallel needs each block's boundary layouts, which "
                "this export does not derive: plan without sequence_parallel to export the "
                "tensor-parallel layout"}
    return {}


def _one_style_per_module(found: list[Site]) -> list[Site]:
    """A module called twice is one module to the styles: its calls must agree."""
    placements: dict[str, set[Optional[Placement]]] = {}
    for s in found:
        placements.setdefault(s.module, set()).add(s.placement)
    return [s if len(placements[s.module]) == 1 or s.problem else
            replace(s, problem="called more than once, sharded differently each time")
            for s in found]


def _by_pattern(paths: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in paths:
        out.setdefault(layer_pattern(path), []).append(path)
    return out


def _module_paths(plan: Plan) -> tuple[str, ...]:
    """The modules holding a parameter and every module above them (the root left out)."""
    out: set[str] = set()
    for param in plan.params.values():
        for name in param.names:
            parts = name.split(".")[:-1]
            out.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return tuple(sorted(out))


def _no_transformers_key(placed: Mapping[str, Placement], known: tuple[str, ...]
                         ) -> dict[str, str]:
    """Module -> why no transformers key says its style alone: its pattern (every index
    written *) reaches modules of other styles, or it is itself an entry of a list or
    Sequential (``to_out.0``), whose other entries the plan may not know (parameterless)."""
    out = {}
    for pattern, paths in _by_pattern(known).items():
        texts = {str(transformers_style(placed[p])) if p in placed else "replicated"
                 for p in paths}
        if len(texts) > 1:
            out.update({p: f"{pattern} is {', '.join(sorted(texts))} across its layers: "
                           "transformers gives one style to every layer (its keys write each "
                           "index as *)" for p in paths if p in placed})
        elif pattern.endswith(".*"):
            out.update({p: f"an entry of a list ({p}): transformers' key {pattern} reaches "
                           "every entry, those without parameters too" for p in paths
                        if p in placed})
    return out
