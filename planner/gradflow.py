"""Gradient flow: every trainable parameter's gradient arrives in its own layout, summed once.

A static proof on a finished Plan, independent of the search that made it: backward is
interpreted on the plan. What the ranks hold of one value's gradient is a ``Grad``, a form

    WHOLE   the gradient of the whole tensor, the same on every rank
    SUM     parts of it, one per rank, that sum to it
    OWN     the gradient of this rank's own piece (its slice of S(d), its term of P(lse))
    MIXED   OWN in the sliced segments, SUM in the segments held whole (S(d)x8:1*:1*)
    WRONG   none of these

and the scales of the parts of the true gradient it is made of: {1} is the truth, {1/tp}
what a division by tp leaves unsummed, {tp} what every rank counts. Identical gradients are
also partial ones: WHOLE{c} reads as SUM{tp c} (``read_as``).

A layout fixes its gradient's form (autotp/layout.py; ``form_of``): R WHOLE, R* SUM, S(d)
OWN, P WHOLE, P(lse) OWN. Starting from the outputs (WHOLE, or OWN where returned sharded),
in reverse topological order of the plan's dataflow graph:

    op, strategy replicated throughout   the same backward on every rank: the gradient passes
                                         to the inputs as it is (linearity)      op_backward
    op, any other strategy               exact for an output gradient in its layout's form:
                                         each input gets its read layout's form  op_backward
    redistribution                       its recorded backward collective, then the local step
                                         (slice, zero-pad, / tp) to the source   edge_backward
    several readers                      their gradients add                     add
    parameter with grad_sync             its partial reads summed after backward _settle_param

Proven (``check_gradient_flow``): every trainable parameter ends WHOLE (R) or OWN (S), {1}.
Which values carry a gradient is read from the graph (floating or complex, computed from a
trainable parameter), not from the plan's own flags, so a plan that forgot a gradient's
collective because it judged the value constant is caught.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, Optional

import networkx as nx
import torch
import torch.fx as fx

from autotp.capture.trace import origin_of
from autotp.errors import GradientFlowError, where
from autotp.layout import R_STAR, Layout, Partial, Replicate, Shard, is_mixed, parse_layout
from autotp.planner.plan import Edge, Plan
from autotp.planner.transitions import Collective
from autotp.rules.registry import parse_output


class Form(enum.Enum):
    WHOLE = "whole"
    SUM = "partial"
    OWN = "this rank's piece"
    MIXED = "this rank's piece, partial in the segments held whole"
    WRONG = "scrambled (the ranks' gradients make no layout's gradient)"


ONE = frozenset({Fraction(1)})


@dataclass(frozen=True)
class Grad:
    """A gradient in ``form``, made of parts of the true one, each times one of ``scales``
    (a single part where nothing went wrong: {1})."""

    form: Form
    scales: frozenset[Fraction] = ONE

    def times(self, factor: Fraction) -> "Grad":
        return Grad(self.form, frozenset(s * factor for s in self.scales))

    def __str__(self) -> str:
        if self.form is Form.WRONG or self.scales == ONE:
            return self.form.value
        ordered = sorted(self.scales)
        if len(ordered) > 1:
            return (f"{self.form.value}, in parts at {', '.join(map(str, ordered))} times the "
                    "true gradient")
        if ordered[0] < 1:
            return f"{self.form.value}, {ordered[0]} of the true gradient"
        return f"{self.form.value}, {ordered[0]} times the true gradient"


WRONG = Grad(Form.WRONG, frozenset())


def form_of(layout: Layout) -> Form:
    """The form a value's gradient takes in ``layout`` (the layout.py docstring)."""
    if isinstance(layout, Replicate):
        return Form.SUM if layout.grad_partial else Form.WHOLE
    if isinstance(layout, Partial):  # sum: every piece's gradient is the whole one
        return Form.OWN if layout.reduce == "logsumexp" else Form.WHOLE
    if isinstance(layout, Shard):
        return Form.MIXED if is_mixed(layout.blocks) else Form.OWN
    raise TypeError(f"not a layout: {layout!r}")


def _is_mixed(layout: Any) -> bool:
    return isinstance(layout, Shard) and is_mixed(layout.blocks)


def read_as(grad: Grad, form: Form, tp: int) -> Grad:
    """``grad`` seen in ``form``: identical gradients on tp ranks are partial ones summing to
    tp times one of them; no other form is another without communication."""
    if grad.form is form:
        return grad
    if grad.form is Form.WHOLE and form is Form.SUM:
        return Grad(Form.SUM, grad.scales).times(Fraction(tp))
    return WRONG


def exact(grad: Grad, form: Form, tp: int) -> bool:
    """Whether ``grad`` is the true gradient, held in ``form``."""
    return read_as(grad, form, tp) == Grad(form)


def add(a: Optional[Grad], b: Grad, form: Form, tp: int) -> Grad:
    """A contribution ``b`` added to a value's gradient ``a`` (None: none yet), in the value's
    form."""
    if a is None:
        return b
    if a.form is not b.form:
        a, b = read_as(a, form, tp), read_as(b, form, tp)
    if Form.WRONG in (a.form, b.form):
        return WRONG
    return Grad(a.form, a.scales | b.scales)


def collective_backward(grad: Grad, kind: Optional[Collective], tp: int) -> Grad:
    """An all-reduce sums the ranks' tensors; an all-gather concatenates their pieces; a
    reduce-scatter sums, then keeps this rank's piece."""
    if kind is None or grad.form is Form.WRONG:
        return grad
    if kind is Collective.ALL_GATHER:
        return Grad(Form.WHOLE, grad.scales) if grad.form is Form.OWN else WRONG
    if grad.form not in (Form.WHOLE, Form.SUM):
        return WRONG
    summed = read_as(grad, Form.SUM, tp).scales
    if kind is Collective.ALL_REDUCE:
        return Grad(Form.WHOLE, summed)
    if kind is Collective.REDUCE_SCATTER:
        return Grad(Form.OWN, summed)
    raise ValueError(f"unknown collective {kind!r}")


def local_step(grad: Grad, start: Form, end: Form, tp: int) -> Grad:
    """The step without communication from ``start`` to ``end`` (collectives.Redistribute.
    run_backward), applied to what arrives, right or not: a slice of a whole gradient (or a
    logsumexp's local derivative) is this rank's piece; a piece padded with zeros is this
    rank's part of the whole; whole gradients divided by tp are parts of it. No local step
    reaches any other form: the gradient is left as it is, to be reported."""
    if grad.form is Form.WRONG or start is end:
        return grad
    if (start, end) == (Form.WHOLE, Form.SUM):
        return grad.times(Fraction(1, tp))
    if (start, end) == (Form.WHOLE, Form.OWN):
        return Grad(Form.OWN, grad.scales) if grad.form is Form.WHOLE else WRONG
    if (start, end) == (Form.OWN, Form.SUM):
        return Grad(Form.SUM, grad.scales) if grad.form is Form.OWN else WRONG
    return grad


def edge_backward(grad: Grad, edge: Optional[Edge], source: Layout, tp: int) -> Grad:
    """The gradient of a value read through ``edge`` (None: read as it is stored): the
    recorded backward collective, then the local step that takes a right gradient from where
    that collective leaves it to the source layout's form. Both act on what arrives."""
    if edge is None:
        return grad
    kind = Collective(edge.backward) if edge.backward else None
    landed = collective_backward(Grad(form_of(parse_layout(edge.dst))), kind, tp).form
    return local_step(collective_backward(grad, kind, tp), landed, form_of(source), tp)


def op_backward(outputs: list[Optional[Grad]], out_layouts: list[Optional[Layout]],
                in_layouts: tuple[Layout, ...], tp: int) -> list[Optional[Grad]]:
    """The gradient each input of an op gets from the gradients of its outputs."""
    pairs = [(g, lay) for g, lay in zip(outputs, out_layouts) if g is not None and lay is not None]
    total: Optional[Grad] = None
    if all(isinstance(x, Replicate) for x in (*in_layouts, *(lay for _, lay in pairs))):
        for g, lay in pairs:  # the same backward on every rank: the gradient passes as it is
            total = add(total, g, form_of(lay), tp)
        return [total] * len(in_layouts)
    seen = [read_as(g, form_of(lay), tp) for g, lay in pairs]
    if not seen or any(g.form is Form.WRONG for g in seen):
        return [WRONG if seen else None] * len(in_layouts)
    scales = frozenset().union(*(g.scales for g in seen))
    return [Grad(form_of(x), scales) for x in in_layouts]


# ---- the walk over the plan ----------------------------------------------------------------


@dataclass(frozen=True)
class Contribution:
    """What ``reader`` sends back into ``value``'s gradient (element ``index`` of a tuple)."""

    value: str
    index: Optional[int]
    reader: str
    read: Optional[Layout]  # the layout the reader wants (None: a getitem)
    edge: Optional[Edge]
    grad: Grad
    expected: Form  # the form the value's gradient must have here
    deferred: bool = False  # a grad_sync parameter's partial gradient, summed after backward


@dataclass
class Flow:
    """The gradients backward gives: per value (and tuple element), per parameter."""

    grads: dict[tuple[str, Optional[int]], Grad] = field(default_factory=dict)
    contributions: list[Contribution] = field(default_factory=list)  # in backward order
    params: dict[str, Optional[Grad]] = field(default_factory=dict)  # target -> after sync


@lru_cache(maxsize=1024)
def _parsed(text: str) -> Any:
    return parse_output(text)


def dataflow(plan: Plan) -> nx.DiGraph:
    """The plan's dataflow graph: an arc from each value to each node reading it."""
    graph = nx.DiGraph()
    graph.add_nodes_from(plan.graph)
    graph.add_edges_from((value, reader) for reader, values in plan.graph.items()
                         for value in values)
    return graph


def _carries_gradient(node: Optional[fx.Node]) -> bool:
    def differentiable(val: Any) -> bool:
        if isinstance(val, torch.Tensor):
            return val.dtype.is_floating_point or val.dtype.is_complex
        return isinstance(val, (tuple, list)) and any(differentiable(v) for v in val)

    return node is not None and differentiable(node.meta.get("val"))


def _trainable(plan: Plan, gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Parameter target -> the graph nodes reading it, for parameters that train."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in plan.params and \
                params.get(node.target) is not None and params[node.target].requires_grad:
            found.setdefault(str(node.target), []).append(node)
    return found


def _with_gradient(graph: nx.DiGraph, nodes: dict[str, fx.Node],
                   sources: list[str]) -> set[str]:
    """Values that carry a gradient: differentiable, and computed from a trainable parameter
    through differentiable values only."""
    carrying = graph.subgraph(n for n in graph if _carries_gradient(nodes.get(n))).copy()
    source = object()
    carrying.add_node(source)  # a program no trainable parameter reaches carries none
    carrying.add_edges_from((source, name) for name in sources if name in carrying)
    return nx.descendants(carrying, source)


class _Walk:
    """One backward pass over the plan, from the outputs to the parameters."""

    def __init__(self, plan: Plan, gm: fx.GraphModule):
        self.plan, self.tp = plan, plan.degree
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.graph = dataflow(plan)
        self.trainable = _trainable(plan, gm)
        self.param_of = {n.name: t for t, ns in self.trainable.items() for n in ns}
        self.live = _with_gradient(self.graph, self.nodes, list(self.param_of))
        self.edges = {(e.value, e.consumer, e.dst): e for e in plan.edges}
        self.flow = Flow()
        self.into: dict[str, list[Contribution]] = {}  # value -> contributions to it

    def layout(self, value: str, index: Optional[int] = None) -> Layout:
        """The layout of a value (of element ``index`` of a tuple-valued one)."""
        layout = _parsed(self.plan.values[value])
        if isinstance(layout, tuple) and index is not None:
            layout = layout[index]
        assert layout is not None and not isinstance(layout, tuple), (value, index)
        return layout

    def run(self) -> Flow:
        for name in reversed(list(nx.topological_sort(self.graph))):
            if name in self.plan.choices and name in self.live:
                self._op(name)
            elif self.plan.ops.get(name) == "getitem" and name in self.live:
                self._getitem(name)
            elif self.plan.ops.get(name) == "output":
                wants = [_parsed(text) for text in self.plan.outputs]
                for value, want in zip(self.plan.graph[name], wants):
                    self._send(value, name, want, Grad(form_of(want)))
        for target, nodes in self.trainable.items():
            self.flow.params[target] = self._settle_param(target, [n.name for n in nodes])
        return self.flow

    def _op(self, name: str) -> None:
        choice = self.plan.choices[name]
        out = _parsed(choice.output)
        outs = list(out) if isinstance(out, tuple) else [out]
        keys = [i if isinstance(out, tuple) else None for i in range(len(outs))]
        got = [self.flow.grads.get((name, key)) for key in keys]
        reads = tuple(_parsed(text) for text in choice.inputs)
        for value, read, grad in zip(self.plan.graph[name], reads,
                                     op_backward(got, outs, reads, self.tp)):
            if grad is not None:
                self._send(value, name, read, grad)

    def _getitem(self, name: str) -> None:
        grad = self.flow.grads.get((name, None))
        parent = self.plan.graph[name][0]
        if grad is None or parent not in self.live:
            return
        index = self.nodes[name].args[1] if isinstance(_parsed(self.plan.values[parent]),
                                                       tuple) else None
        self._receive(Contribution(parent, index, name, None, None, grad,
                                   form_of(self.layout(parent, index))))

    def _send(self, value: str, reader: str, read: Layout, grad: Grad) -> None:
        if value not in self.live:
            return
        have = self.layout(value)
        edge = None if have == read else self.edges.get((value, reader, str(read)))
        back = edge_backward(grad, edge, have, self.tp)
        target = self.param_of.get(value)
        # summed after backward: a replicated parameter's reads as R*, every read of one with
        # segments held whole
        deferred = target is not None and self.plan.params[target].grad_sync and \
            (_is_mixed(have) or (isinstance(have, Replicate) and read == R_STAR))
        expected = form_of(read) if deferred and isinstance(have, Replicate) else form_of(have)
        self._receive(Contribution(value, None, reader, read, edge, back, expected, deferred))

    def _receive(self, c: Contribution) -> None:
        self.flow.contributions.append(c)
        self.into.setdefault(c.value, []).append(c)
        if c.deferred:
            return  # summed apart, after backward (_settle_param)
        key = (c.value, c.index)
        self.flow.grads[key] = add(self.flow.grads.get(key), c.grad, c.expected, self.tp)

    def _settle_param(self, target: str, names: list[str]) -> Optional[Grad]:
        """A parameter's gradient: its direct contributions, plus its partial ones summed
        across ranks after backward (grad_sync): all of them, or only the segments every rank
        holds whole of a blocked one."""
        layout = _parsed(self.plan.params[target].layout)
        final = Form.OWN if isinstance(layout, Shard) else Form.WHOLE
        direct: Optional[Grad] = None
        deferred: Optional[Grad] = None
        for c in (c for name in names for c in self.into.get(name, ())):
            if c.deferred:
                deferred = add(deferred, c.grad, c.expected, self.tp)
            else:
                direct = add(direct, c.grad, form_of(layout), self.tp)
        if deferred is not None and deferred.form is Form.MIXED:
            deferred = Grad(Form.OWN, deferred.scales)
        elif deferred is not None:
            deferred = collective_backward(deferred, Collective.ALL_REDUCE, self.tp)
        return direct if deferred is None else add(direct, deferred, final, self.tp)


def gradient_flow(plan: Plan, gm: fx.GraphModule) -> Flow:
    """Backward, interpreted on the plan: every value's and every trainable parameter's
    gradient. ``gm`` is the captured graph the plan was made from (dtypes, parameters)."""
    return _Walk(plan, gm).run()


def check_gradient_flow(plan: Plan, gm: fx.GraphModule) -> Flow:
    """Raise ``GradientFlowError`` unless every trainable parameter's gradient arrives whole
    in its own layout (R: the same on every rank; S(d): each rank its slice), at scale 1.
    A plan over two layout axes (cp beside tp) is proven on each axis alone: the two axes'
    collectives commute (autotp.planner.context)."""
    for axis in plan.layout_axes()[1:]:
        check_gradient_flow(plan.on(axis.name), gm)
    if plan.degree == 1:  # one rank holds every layout whole: nothing to sum
        return Flow()
    flow = gradient_flow(plan, gm)
    wrong = {target: grad for target, grad in flow.params.items()
             if grad is not None and not exact(grad, _final_form(plan, target), plan.degree)}
    if wrong:
        raise GradientFlowError(_explain(plan, gm, flow, wrong))
    return flow


def _final_form(plan: Plan, target: str) -> Form:
    return Form.OWN if isinstance(_parsed(plan.params[target].layout), Shard) else Form.WHOLE


# ---- the report: which parameters, and the read where it goes wrong ------------------------


def _explain(plan: Plan, gm: fx.GraphModule, flow: Flow, wrong: dict[str, Grad]) -> str:
    """The first wrong read in backward order that a wrong parameter feeds (its reader's own
    gradient was right: the fault is in this read), the parameter nearest to it, and how
    many others it spoils."""
    nodes = {n.name: n for n in gm.graph.nodes}
    reads = {n.name: str(n.target) for n in nodes.values()
             if n.op == "get_attr" and n.target in wrong}
    upstream = dataflow(plan).reverse(copy=False)
    order = list(plan.params)
    cause, target = None, next(iter(wrong))
    for c in flow.contributions:
        if exact(c.grad, c.expected, plan.degree):
            continue
        steps = nx.single_source_shortest_path_length(upstream, c.value)
        fed = [(d, order.index(reads[n]), reads[n]) for n, d in steps.items() if n in reads]
        if fed:
            cause, target = c, min(fed)[2]
            break
    param = plan.params[target]
    text = (f"the plan would give {param.names[0]} ({param.layout}) a wrong gradient: "
            f"{wrong[target]}, where it must be {_final_form(plan, target).value}")
    if param.grad_sync:
        text += " once its partial gradient is summed across ranks"
    others = [plan.params[t].names[0] for t in wrong if t != target]
    if others:
        text += (f"; {len(others)} other parameter(s) too: {', '.join(others[:3])}"
                 + (", ..." if len(others) > 3 else ""))
    if cause is not None:
        text += "\n  cause: " + _describe(plan, nodes, cause)
    return text + ("\n  This is a fault of autotp's plan (a rule or the planner), not of the "
                   "model: please report it with this message. check_plan=False skips this "
                   "check, for inference only (the gradients would be wrong).")


def _describe(plan: Plan, nodes: dict[str, fx.Node], c: Contribution) -> str:
    value, reader = nodes.get(c.value), nodes.get(c.reader)
    if value is not None and value.op == "get_attr" and value.target in plan.params:
        what = f"{plan.params[str(value.target)].names[0]} ({c.value}, {plan.values[c.value]})"
    else:
        made = origin_of(value) if value is not None else "unknown source"
        what = f"the value of {made} ({c.value}, {plan.values[c.value]})"
    if c.read is None:
        how = "is taken apart"
    elif c.edge is None:
        how = f"is read as {c.read} with no redistribution in between"
    else:
        bwd = c.edge.backward.replace("_", "-") if c.edge.backward else "no collective"
        how = f"is read as {c.read} through {c.edge.src} -> {c.edge.dst} ({bwd} in backward)"
    by = "the output" if reader is None or reader.op == "output" else origin_of(reader)
    later = ", then summed across ranks after backward," if c.deferred else ""
    return (f"{what} {how} by {by}: its gradient comes back {c.grad}{later} where it must "
            f"be {c.expected.value}{where(reader)}")
