"""Reading a Plan's graph for the export (``autotp.integrations.export``): where each sharded
parameter is read (its site), which sites shard together (regions), and which of the plan's
collectives a style makes at a module's boundary. Decided from ops and layouts, never from a
module's name.

    site     an op reading a sharded parameter: aten.linear an nn.Linear's [out, in] weight
             (its bias in the add that reads the product, where the capture split it off),
             aten.embedding a [vocab, dim] table; a matrix read as the right operand of mm is
             stored [in, out] (transformers' Conv1D), which no style shards
    region   sites joined by values read sharded: between a colwise and a rowwise module the
             code runs on local slices, so they are expressible together or not at all
    gather   an all-gather of a colwise output, or of what a chain of ops that alone read it
             makes from it: gathering at the module's boundary computes the chain whole
    sum      an all-reduce of a partial sum made by rowwise sites (and ops linear in it):
             summing at each module's boundary gives the same value
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from autotp.integrations.styles import Kind, Placement
from autotp.planner.plan import Plan

LINEAR, EMBEDDING, ADD = "aten.linear.default", "aten.embedding.default", "aten.add.Tensor"
# ops that read a matrix stored [in, out] (transformers' Conv1D): operand index of the matrix
RIGHT_OPERAND = {"aten.mm.default": 1, "aten.addmm.default": 2, "aten.matmul.default": 1}
SHARDED_OUTPUT = (Kind.COLWISE, Kind.EMBEDDING_COLWISE, Kind.PACKED_COLWISE)


@dataclass(frozen=True)
class Site:
    op: str  # the node reading the weight
    module: str
    params: tuple[str, ...]  # the plan.params keys it holds, weight first
    boundary: str  # the node whose value the module returns
    placement: Optional[Placement]
    problem: Optional[str] = None  # why it is not expressible on its own

    @property
    def placed(self) -> bool:
        """Whether it has a style of its own (one with a problem is reported already)."""
        return self.placement is not None and self.problem is None

    def kind_in(self, kinds: tuple[Kind, ...]) -> bool:
        return self.placement is not None and self.placement.kind in kinds


def sharded(layout: str) -> bool:
    """``S(2)``, ``S(0)x3``, ``(S(2), S(2))``: some part held in slices."""
    return any(part.startswith("S") for part in layout.strip("()").split(", "))


class Graph:
    """The plan's dataflow as the export reads it: who reads what in which layout, and the
    regions (union-find over nodes joined where one reads the other sharded)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        names = {alias: key for key, p in plan.params.items() for alias in (key, *p.names)}
        self.param_of = {n: names[op] for n, op in plan.ops.items() if op in names}
        self.edge = {(e.value, e.consumer): e for e in plan.edges}
        self.readers: dict[str, list[tuple[str, int]]] = {}
        self.parent: dict[str, str] = {}
        for node, inputs in plan.graph.items():
            for index, value in enumerate(inputs):
                self.readers.setdefault(value, []).append((node, index))
                edge = self.edge.get((value, node))
                held = edge.src if edge is not None else plan.values.get(value, "R")
                if sharded(self.read(node, index)) and sharded(held):
                    self.join(node, value)

    def read(self, node: str, index: int) -> str:
        """The layout ``node`` reads its ``index``-th input in."""
        choice = self.plan.choices.get(node)
        if choice is not None and index < len(choice.inputs):
            return choice.inputs[index]
        value = self.plan.graph[node][index]
        edge = self.edge.get((value, node))
        return edge.dst if edge is not None else self.plan.values.get(value, "R")

    def root(self, node: str) -> str:
        while self.parent.get(node, node) != node:
            node = self.parent[node]
        return node

    def join(self, a: str, b: str) -> None:
        self.parent[self.root(a)] = self.root(b)

    def where(self, node: str) -> str:
        """The model's own line of ``node`` (``modeling_llama.py:244``), or the node."""
        choice = self.plan.choices.get(node)
        return os.path.basename(choice.source) if choice and choice.source else node

    def module(self, key: str) -> str:
        """The path of the module holding parameter ``key``."""
        return self.plan.params[key].names[0].rpartition(".")[0]

    def partial_from(self, node: str) -> set[str]:
        """The ops where what replicated ``node`` computes meets sharded values, through values
        whose gradient is partial (R*): where its own gradient turns partial."""
        out, stack, seen = set(), [node], {node}
        while stack:
            for reader, _ in self.readers.get(stack.pop(), []):
                made = self.plan.values.get(reader, "R").strip("()").split(", ")
                if any(not m.startswith("R") for m in made):
                    out.add(reader)
                elif "R*" in made and reader not in seen:
                    seen.add(reader)
                    stack.append(reader)
        return out


def sites(g: Graph) -> list[Site]:
    """One site per op reading a sharded parameter as a weight; a sharded parameter no site
    claims (a Conv1D's bias, a norm weight over sharded heads) gets one with a problem, and a
    replicated one with a partial gradient a GRAD_ALLREDUCE one (joined to the regions where
    its gradient turns partial), unless only colwise modules make it partial: their styles
    sum their inputs' gradients in eager, so it arrives whole there."""
    plan, found, claimed = g.plan, [], set[str]()
    reads = [(op, i, g.param_of[v]) for v, readers in g.readers.items() if v in g.param_of
             for op, i in readers]
    for op, index, key in reads:
        site = _site(g, op, index, key) if plan.params[key].layout.startswith("S") else None
        if site is not None:
            found.append(site)
            claimed.update(site.params)
    holders = {s.module: s.params[0] for s in found}
    colwise = {s.op for s in found if s.kind_in((Kind.COLWISE, Kind.PACKED_COLWISE))}
    for op, index, key in reads:
        param, module = plan.params[key], g.module(key)
        if key in claimed or not (param.grad_sync or param.layout.startswith("S")):
            continue
        claimed.add(key)
        if param.layout.startswith("S"):
            why = f"belongs with {holders[module]}, which is not expressible" \
                if module in holders else f"read by {plan.ops[op]} at {g.where(op)}: the " \
                "styles shard only nn.Linear weights (aten.linear) and nn.Embedding tables"
            found.append(Site(op, module, (key,), op, None, why))
            continue
        # in eager a colwise style sums its input's gradient: through one, it arrives whole
        meeting = g.partial_from(plan.graph[op][index])
        summed = {m for m in meeting if m in colwise}
        if meeting and summed == meeting:
            continue  # whole in eager: replicated, not listed
        for m in meeting:
            g.join(op, m)
        others = [k for k in plan.params if g.module(k) == module and not plan.params[k].grad_sync]
        reason: Optional[str] = None
        if not meeting:
            reason = "its gradient is partial where no sharded value reads it"
        elif summed:
            reason = f"its gradient is summed where a colwise module reads it " \
                f"({g.where(min(summed))}) and partial elsewhere: no style sums a part"
        elif others:
            reason = f"its module also holds {', '.join(others)}"
        found.append(Site(op, module, (key,), op, Placement(Kind.GRAD_ALLREDUCE), reason))
    return found


def _site(g: Graph, op: str, index: int, key: str) -> Optional[Site]:
    """The site of ``op`` reading sharded parameter ``key`` as its ``index``-th input: a
    weight (a linear's, an embedding's table, an [in, out] matrix), or None (a bias)."""
    plan, param, target = g.plan, g.plan.params[key], g.plan.ops[op]
    module, _, attribute = param.names[0].rpartition(".")
    layout = g.read(op, index)
    if param.names[1:]:
        return Site(op, module, (key,), op, None, f"tied to {', '.join(param.names[1:])}: the "
                    "plan does not say which module reads it where, and parallelize_module "
                    "would give each module its own sharded copy, untying them")
    if key in plan.expert_params or key in plan.experts:
        return Site(op, module, (key,), op, None, "stacked expert weights: transformers "
                    "shards experts with its ep_plan styles, torch with none")
    if RIGHT_OPERAND.get(target) == index:
        return Site(op, module, (key,), op, None, f"weight {layout} stored [in, out] (read by "
                    f"{target} at {g.where(op)}, as transformers' Conv1D stores it): the "
                    "colwise and rowwise styles shard an nn.Linear's [out, in] weight, none a "
                    "Conv1D's")
    if target == EMBEDDING and index == 0:
        tables = {"S(0)": Kind.EMBEDDING_ROWWISE, "S(1)": Kind.EMBEDDING_COLWISE}
        table = tables.get(layout)
        return _checked(g, Site(op, module, (key,), op, Placement(table) if table else None,
                                None if table else f"table {layout}"), attribute)
    if target != LINEAR or index != 1:
        return None
    bias, boundary, bias_layout = _bias(g, op, module)
    kind = {"S(0)": Kind.COLWISE, "S(1)": Kind.ROWWISE, "S(0)x2": Kind.PACKED_COLWISE}.get(layout)
    given, edge = g.read(op, 0), g.edge.get((plan.graph[op][0], op))
    why: Optional[str] = None
    if kind is None:
        why = f"fused segments ({layout}): transformers' packed_colwise slices 2 equal ones, " \
              "torch none" if "x" in layout else f"weight {layout}: the styles shard dim 0 or 1"
    elif bias is not None and (kind is Kind.PACKED_COLWISE or
                               bias_layout != ("R" if kind is Kind.ROWWISE else "S(0)")):
        why = f"bias {bias_layout} with weight {layout}: the style shards it otherwise"
    elif kind is not Kind.ROWWISE and not given.startswith("R"):
        why = f"input read as {given}: a colwise style takes it whole"
    whole = given.startswith("R") or (edge is not None and edge.src.startswith("R"))
    placement = Placement(kind, whole_input=whole and kind is Kind.ROWWISE) if kind else None
    params = (key,) if bias is None else (key, g.param_of[bias])
    return _checked(g, Site(op, module, params, boundary, placement, why), attribute)


def _bias(g: Graph, op: str, module: str) -> tuple[Optional[str], str, str]:
    """The bias of the linear ``op`` (its third input, or read by the add after it, where the
    capture split it off): (its node, the module's output node, its layout read), or
    (None, op, "")."""
    inputs = g.plan.graph[op]
    if len(inputs) > 2 and inputs[2] in g.param_of:
        return inputs[2], op, g.read(op, 2)
    for reader, index in g.readers.get(op, []):
        inputs = g.plan.graph[reader]
        if g.plan.ops.get(reader) == ADD and index == 0 and len(inputs) == 2 and \
                inputs[1] in g.param_of and g.module(g.param_of[inputs[1]]) == module:
            return inputs[1], reader, g.read(reader, 1)
    return None, op, ""


def _checked(g: Graph, site: Site, attribute: str) -> Site:
    """The styles shard the attributes called weight and bias, and every parameter of the
    module: a module holding others is not expressible."""
    extra = sorted({k for k in g.plan.params if g.module(k) == site.module} - set(site.params))
    if site.problem is None and not site.module:
        return replace(site, problem="a parameter of the model itself: styles apply to "
                       "submodules")
    if site.problem is None and attribute != "weight":
        return replace(site, problem=f"its matrix is called {attribute}, not weight")
    if site.problem is None and extra:
        return replace(site, problem=f"the module also holds {', '.join(extra)}")
    return site


def collectives(g: Graph, found: list[Site]) -> tuple[set[str], list[tuple[str, str, str]]]:
    """The boundaries whose outputs are gathered, and (node, key, why) for each collective of
    the plan that no style makes at a module's boundary."""
    plan, boundary, by_op = g.plan, {s.boundary: s for s in found}, {s.op: s for s in found}
    module = {c.node: c.module for c in plan.collectives if c.module}
    gathered: set[str] = set()
    problems: list[tuple[str, str, str]] = []

    def problem(node: str, text: str) -> None:
        problems.append((node, module.get(node) or g.where(node), text))

    for e in plan.edges:
        index = plan.graph[e.consumer].index(e.value) if e.consumer in plan.graph else -1
        site = by_op.get(e.consumer) if index == 0 else None  # the module's input, if any
        if e.forward == "all_reduce" and e.src == "P":
            for source in _partial_sources(g, e.value) - set(by_op):
                problem(source, f"{plan.ops.get(source)} at {g.where(source)} makes a partial "
                        "sum that no style sums")
        elif e.forward == "all_gather" and e.dst.startswith("R"):
            end = _gathered(g, e.value, boundary)
            if end is None:
                problem(e.value, f"all-gathered inside the module at {g.where(e.value)}: the "
                        "styles gather only a colwise module's output")
            elif boundary[end].placed:
                gathered.add(end)
        elif e.forward is not None:
            problem(e.value, f"a forward {e.forward} at {g.where(e.value)}: no style makes it")
        elif e.src.startswith("R") and e.dst.startswith("S") and \
                not (site is not None and site.kind_in((Kind.ROWWISE,))):
            problem(e.consumer, f"{g.where(e.consumer)} slices a whole value: the styles slice "
                    "only a rowwise module's input")
        if e.backward is not None and not (site is not None and (
                not site.placed or site.kind_in((Kind.COLWISE, Kind.ROWWISE,
                                                 Kind.PACKED_COLWISE)))):
            problem(e.consumer, f"a backward {e.backward} where {g.where(e.consumer)} reads "
                    "its input: the styles sum input gradients only at a module's input")
    return gathered, problems


def _partial_sources(g: Graph, value: str) -> set[str]:
    """The ops that made the partial sum ``value``: back through ops that read a partial
    input (linear in it) to those that read none."""
    out, stack, seen = set(), [value], set()
    while stack:
        node = stack.pop()
        if node in seen or node in g.param_of:
            continue
        seen.add(node)
        partial = [v for i, v in enumerate(g.plan.graph.get(node, [])) if g.read(node, i) == "P"]
        if partial:
            stack.extend(partial)
        else:
            out.add(node)
    return out


def _gathered(g: Graph, value: str, boundary: dict[str, Site]) -> Optional[str]:
    """The boundary of a colwise site (or of one without a style) whose output ``value`` is, or
    derives from by a chain of ops that alone read it: None if none."""
    if any(sharded(g.read(r, i)) for r, i in g.readers.get(value, [])):
        return None  # also read sharded: gathering it at the boundary would change that
    node = value
    while node not in boundary:
        inputs = enumerate(g.plan.graph.get(node, []))
        slices = {v for i, v in inputs if sharded(g.read(node, i))}
        if len(slices) != 1:
            return None
        node = slices.pop()
        if node in g.param_of or len(g.readers.get(node, [])) != 1:
            return None
    site = boundary[node]
    return node if site.placement is None or site.kind_in(SHARDED_OUTPUT) else None
