"""The frontier dynamic program, with repeated transformer layers solved once.

A state assigns a layout (and the layouts already materialized from it) to every live value.
Steps visit the nodes in topological order (``transition``); each keeps, per distinct state,
the cheapest way to reach it and a back-pointer.

Repeated layers. A layer is a contiguous run of steps labelled with one block index. Two
layers are interchangeable when their steps have the same *signature*: the same ops, the same
strategies, inputs referenced relative to the layer start (values of the layer itself, the
previous layer, parameters first used in it) or by name (values shared by all layers, like
rotary tables). When a layer's signature and its incoming states (renamed the same way, costs
relative to the cheapest) equal those of a layer already solved, its outgoing states and its
back-pointers are that layer's, renamed: the result is what solving it would give (costs
equal to a relative 1e-6, ``_same_result``, which also allows states that no best path
started from to cost more).

A layer is solved once only where the states entering each layer stop changing. A state
that costs a few microseconds more in every layer than the cheapest (with sequence
parallelism: the per-call cast rotary tables of a bfloat16 model sharded by sequence, or the
residual stream as a partial sum) keeps any two layers' incoming states from being exactly
equal; no best path starts from such a state, and its drift is far below 1e-6 of the cost.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from autotp.capture.blocks import layer_of
from autotp.errors import PlanError, where
from autotp.layout import R, Replicate, Shard, is_mixed, whole_numel
from autotp.ops import MATMULS, RESHAPES
from autotp.planner.checks import narrow_matrices
from autotp.planner.transitions import Collective
from autotp.progress import step as progress_step

aten = torch.ops.aten

Entry = tuple[Any, frozenset]
DEFERRED = "deferred"  # a size read's choice, made once its leaf's layout is known
Key = frozenset
States = dict  # Key -> (cost, entries)
Transition = Callable[[Any, dict, float], Any]  # (pnode, entries, cost) -> [(choice, (c, e))]
Owed = Callable[[int, str, Entry], float]  # (step, value, entry) -> its least cost still due


@dataclass
class Segment:
    layer: int
    start: int
    end: int  # exclusive
    prev_start: int


@dataclass
class _Solved:
    segment: Segment
    incoming: dict  # canonical entries -> cost above the cheapest incoming state
    min_in: float
    outgoing: States
    names: dict[Any, str]  # canonical reference -> name in this segment
    useful: frozenset  # the incoming states some outgoing state's best path starts from
    whole: bool  # no state was cut by the beam inside the segment


class FrontierSolver:
    def __init__(self, pnodes: list[Any], by_name: dict[str, Any], last_use: dict[str, int],
                 leaf_candidates: dict[str, list], memory_cost: Callable[[Any, Any], float],
                 transition: Transition, max_states: int, reuse_layers: bool = True,
                 owed: Optional[Owed] = None):
        self.pnodes = pnodes
        self.owed = owed
        self.by_name = by_name
        self.last_use = last_use
        self.leaf_candidates = leaf_candidates
        self.memory_cost = memory_cost
        self.transition = transition
        self.max_states = max_states
        self.reuse_layers = reuse_layers
        self.index = {pn.node.name: i for i, pn in enumerate(pnodes)}
        # A leaf enters the states at its first use that is not a size read. A size read
        # (``sym_size``, a metadata check: no tensor out) takes every layout, so entering
        # there would carry each of the leaf's candidates along, at equal cost, until its
        # writer or reader tells them apart: a decoding step reads every layer's cache size
        # first, and 5 candidates per cache crowd the beam out of the heads-sharded caches.
        # The read's strategy follows the layout chosen later (``_backtrack``).
        self.size_reads = {i for i, pn in enumerate(pnodes) if pn.kind == "op" and
                           pn.strategies and all(s.output is None for s in pn.strategies)}
        self.first_use: dict[str, int] = {}
        for i, pn in enumerate(pnodes):
            for name in pn.inputs:
                if i not in self.size_reads or by_name[name].kind != "leaf":
                    self.first_use.setdefault(name, i)
        for i in sorted(self.size_reads):  # leaves only ever read for their size
            for name in pnodes[i].inputs:
                self.first_use.setdefault(name, i)
        self.history: list[Any] = [None] * len(pnodes)
        self.reused_layers = 0
        self.cut = False  # the beam dropped a state (since the flag was last cleared)
        self.ever_cut = False  # the beam dropped a state anywhere: the search was not exhaustive

    # ---- the plain DP step -------------------------------------------------------------

    def step(self, i: int, states: States) -> States:
        pn = self.pnodes[i]
        if pn.kind not in ("op", "getitem", "output"):
            return states
        by_name, last_use = self.by_name, self.last_use
        if i in self.size_reads and any(by_name[n].kind == "leaf" and self.first_use[n] > i
                                        for n in pn.inputs):
            self.history[i] = {key: (key, (DEFERRED, ())) for key in states}
            return states
        entering = [n for n in dict.fromkeys(pn.inputs) if by_name[n].kind == "leaf"]
        dying = [n for n in dict.fromkeys(pn.inputs) if last_use[n] == i]
        record: dict[Key, tuple[Key, Any]] = {}
        new_states: States = {}
        for key, (cost, entries) in states.items():
            fresh = [n for n in entering if n not in entries]
            for leaf_choice in itertools.product(*(self.leaf_candidates[n] for n in fresh)):
                base = dict(entries) if fresh else entries  # transitions copy what they change
                base_cost = cost
                for name, layout in zip(fresh, leaf_choice):
                    base[name] = (layout, frozenset())
                    base_cost += self.memory_cost(by_name[name], layout)
                for choice, (new_cost, new_entries) in self.transition(pn, base, base_cost):
                    for name in dying:
                        new_entries.pop(name, None)
                    new_key = frozenset(new_entries.items())
                    old = new_states.get(new_key)
                    if old is None or new_cost < old[0] - 1e-15:
                        new_states[new_key] = (new_cost, new_entries)
                        record[new_key] = (key, (choice, tuple(zip(fresh, leaf_choice))))
        if not new_states:
            raise PlanError(f"no exact tensor-parallel plan reaches {pn.node.name} "
                            f"({pn.node.target}){where(pn.node)}")
        if len(new_states) > self.max_states // 2:  # cheap enough only where it matters
            new_states = _drop_dominated(new_states)
        if len(new_states) > self.max_states:
            self.cut = self.ever_cut = True
            # a stable sort: ties keep their deterministic insertion order
            kept = sorted(new_states.items(), key=lambda kv: kv[1][0] + self.ahead(i, kv[1][1]))
            new_states = dict(kept[: self.max_states])
        self.history[i] = record
        return new_states

    def ahead(self, i: int, entries: dict) -> float:
        """A lower bound on what the state's values still cost to redistribute: for each
        value, the most that one of its later readers must pay at least (the cheapest layout
        that reader accepts). The beam ranks states by their cost plus this, so a state
        that saved a collective only by leaving a value in a layout a later reader cannot
        take (a residual stream reduce-scattered along h, a norm ahead) does not crowd
        out the states that paid for it already (as A*'s bound, it never overestimates:
        each value pays at least its dearest reader's cheapest redistribution)."""
        if self.owed is None:
            return 0.0
        return sum(self.owed(i, name, entry) for name, entry in entries.items())

    # ---- the whole graph ---------------------------------------------------------------

    def run(self) -> tuple[dict[str, Any], float]:
        segments = {s.start: s for s in self.segments()} if self.reuse_layers else {}
        order = {start: k for k, start in enumerate(segments, 1)}  # (for the progress)
        solved: dict[Any, _Solved] = {}
        states: States = {frozenset(): (0.0, {})}
        i = 0
        while i < len(self.pnodes):
            segment = segments.get(i)
            if segment is None:
                states = self.step(i, states)
                i += 1
                continue
            signature = self.signature(segment)
            incoming, min_in = self._canonical(states, segment)
            earlier = solved.get(signature)
            if earlier is not None and _same_result(earlier, incoming, min_in):
                states = self._reuse(earlier, segment, min_in)
                self.reused_layers += 1
            else:
                self.cut = False
                entering = states
                progress_step(f"layer {segment.layer}", order[segment.start], len(order))
                for j in range(segment.start, segment.end):
                    states = self.step(j, states)
                useful = self._origins(segment, states, entering)
                solved[signature] = _Solved(segment, incoming, min_in, states,
                                            self._names(segment), useful, not self.cut)
            i = segment.end
        best_key = min(states, key=lambda k: states[k][0])
        return self._backtrack(best_key), states[best_key][0]

    def _backtrack(self, key: Key) -> dict[str, Any]:
        decisions: dict[str, Any] = {}
        for i in range(len(self.pnodes) - 1, -1, -1):
            record = self.history[i]
            if record is None:
                continue
            if isinstance(record, _Link):
                prev, payload = record.lookup(self.history, key)
            else:
                prev, payload = record[key]
            choice, leaves = payload
            decisions[self.pnodes[i].node.name] = choice
            for name, layout in leaves:
                decisions.setdefault(name, layout)
            key = prev
        for i in self.size_reads:
            pn = self.pnodes[i]
            if decisions.get(pn.node.name) == DEFERRED:
                decisions[pn.node.name] = self._size_read_choice(pn, decisions)
        return decisions

    def _size_read_choice(self, pn: Any, decisions: dict[str, Any]) -> Any:
        """The strategy of a size read whose leaf entered later: the cheapest one that reads
        the leaf in the layout it was given (a size along a sharded dim is the local size
        times tp)."""
        entries: dict[str, Entry] = {name: (decisions[name], frozenset()) for name in pn.inputs
                   if self.by_name[name].kind == "leaf"}
        options = list(self.transition(pn, entries, 0.0))
        if not options:
            raise PlanError(f"no strategy of {pn.node.target} reads {list(entries)} in the "
                            f"layouts {[str(e[0]) for e in entries.values()]}{where(pn.node)}")
        return min(options, key=lambda option: option[1][0])[0]

    # ---- repeated layers ---------------------------------------------------------------

    def segments(self) -> list[Segment]:
        runs: dict[int, list[int]] = {}
        for i, pn in enumerate(self.pnodes):
            if pn.kind in ("op", "getitem"):
                layer = layer_of(pn.node)
                if layer is not None:
                    runs.setdefault(layer, []).append(i)
        out: list[Segment] = []
        prev_start = 0
        for layer in sorted(runs, key=lambda k: runs[k][0]):
            steps = runs[layer]
            start, end = steps[0], steps[-1] + 1
            inside = [pn for pn in self.pnodes[start:end] if pn.kind in ("op", "getitem")]
            if len(inside) != len(steps):
                continue  # interleaved with other layers: solve it step by step
            if out and start < out[-1].end:
                continue
            out.append(Segment(layer, start, end, prev_start))
            prev_start = start
        return out

    def ref(self, name: str, segment: Segment) -> Any:
        """A name as seen from ``segment``: relative to it, or absolute when shared."""
        pn = self.by_name[name]
        if pn.kind == "leaf":
            first = self.first_use[name]
            if first >= segment.start:
                return ("leaf", first - segment.start, self.pnodes[first].inputs.index(name))
            return ("abs", name)
        p = self.index[name]
        if p >= segment.start:
            return ("in", p - segment.start)
        if p >= segment.prev_start:
            return ("prev", segment.start - p)
        return ("abs", name)

    def signature(self, segment: Segment) -> Any:
        parts = []
        for i in range(segment.start, segment.end):
            pn = self.pnodes[i]
            inputs = []
            for name in pn.inputs:
                src = self.by_name[name]
                ref = self.ref(name, segment)
                extra: Any = None
                if ref[0] != "in":
                    extra = (src.kind, src.requires_grad, round(src.nbytes), src.is_output,
                             src.ndim, src.is_param,
                             tuple(self.leaf_candidates.get(name, ())))
                inputs.append((ref, self.last_use[name] == i, extra))
            getitem = pn.node.args[1] if pn.kind == "getitem" else None
            parts.append((pn.kind, str(pn.node.target) if pn.kind == "op" else None,
                          tuple(pn.strategies), tuple(inputs), pn.live, pn.requires_grad,
                          pn.is_output, round(pn.nbytes), round(pn.flops), getitem))
        return tuple(parts)

    def _canonical(self, states: States, segment: Segment) -> tuple[dict, float]:
        min_in = min(cost for cost, _ in states.values())
        canon = {frozenset((self.ref(n, segment), e) for n, e in entries.items()):
                 cost - min_in for cost, entries in states.values()}
        return canon, min_in

    def _origins(self, segment: Segment, outgoing: States, incoming: States) -> frozenset:
        """The incoming states (canonical) that the best path to some outgoing state of the
        segment starts from, found by following the back-pointers of its steps."""
        origins = set()
        for key in outgoing:
            for i in range(segment.end - 1, segment.start - 1, -1):
                if self.history[i] is not None:
                    key = self.history[i][key][0]
            origins.add(frozenset((self.ref(n, segment), e) for n, e in incoming[key][1].items()))
        return frozenset(origins)

    def _names(self, segment: Segment) -> dict[Any, str]:
        """Canonical reference -> name, for every name the segment's states can hold."""
        names: dict[Any, str] = {}
        for i in range(segment.prev_start, segment.end):
            pn = self.pnodes[i]
            if pn.kind in ("op", "getitem", "input") or (pn.kind == "leaf"
                                                         and pn.node.name in self.first_use):
                names[self.ref(pn.node.name, segment)] = pn.node.name
            for name in pn.inputs:
                names[self.ref(name, segment)] = name
        return names

    def _reuse(self, earlier: _Solved, segment: Segment, min_in: float) -> States:
        mine = self._names(segment)
        to_mine = {earlier.names[r]: mine[r] for r in earlier.names if r in mine}
        to_theirs = {v: k for k, v in to_mine.items()}
        shift = min_in - earlier.min_in
        out: States = {}
        for _, (cost, entries) in earlier.outgoing.items():
            renamed = {to_mine.get(n, n): e for n, e in entries.items()}
            out[frozenset(renamed.items())] = (cost + shift, renamed)
        offset = earlier.segment.start - segment.start
        for i in range(segment.start, segment.end):
            if self.history[i + offset] is not None:
                self.history[i] = _Link(i + offset, to_mine, to_theirs)
        return out


# Costs are sums of thousands of floating-point terms: two that differ by less than this
# fraction of the cost so far are the same cost.
COST_RTOL = 1e-6


def _same_result(earlier: _Solved, incoming: dict, min_in: float) -> bool:
    """Whether solving the segment from ``incoming`` gives ``earlier``'s outgoing states and
    back-pointers, renamed (costs equal within ``COST_RTOL`` of the cost so far).

    Equal incoming states do. So do incoming states equal but for costlier states that no
    best path of ``earlier`` started from: every outgoing state's cost is a minimum over
    the incoming states of (incoming cost + path cost), and raising a term that was not the
    minimum changes neither the minimum nor where it is reached. That needs every path
    evaluated, so it holds only where the beam cut no state inside ``earlier``."""
    if incoming.keys() != earlier.incoming.keys():
        return False
    tol = COST_RTOL * max(1.0, abs(min_in))

    def same(k: Any) -> bool:
        return abs(incoming[k] - earlier.incoming[k]) <= tol

    if all(same(k) for k in incoming):
        return True
    return earlier.whole and all(same(k) if k in earlier.useful else
                                 incoming[k] >= earlier.incoming[k] - tol for k in incoming)


def _drop_dominated(states: States) -> States:
    """Drop a state when another holds every value at least as well (``_covers``) and costs
    no more: whatever follows, it can do no better.

    Holding a value as R* (its gradient a partial sum, summed where the stream began) serves
    every later reader at no more cost than holding it as R: R* -> R and R* -> S are free in
    both directions, R -> R* and R -> S pay a backward collective. Without this, a chain of
    replicated ops whose gradient is summed once at its start (a shared q/k projection and its
    rotary embedding, Megatron's f ahead of them) leaves, at every op, a state that drops back
    to R at equal cost: as many states as places to drop, which crowd the chain out of the beam
    before its saving shows (the partial sums of the attention's inputs, each all-reduced).

    Covering is a preorder, so what stays is the states no other dominates, whatever the order
    they are compared in. Within a group of layouts equal up to R/R* they are visited cheapest
    first, and at equal cost the more covering first (``_score`` grows strictly with
    covering): a state's dominators come before it, and one that is dominated is dominated by
    one that stays (domination is transitive), so each is compared with those kept so far
    alone."""
    groups: dict[frozenset, list[Key]] = {}
    for key, (_, entries) in states.items():
        layouts = frozenset((name, R if type(layout) is Replicate and layout.grad_partial
                             else layout) for name, (layout, _) in entries.items())
        groups.setdefault(layouts, []).append(key)
    dropped: set[Key] = set()
    for keys in groups.values():
        if len(keys) < 2:
            continue
        keys.sort(key=lambda k: states[k][0])
        _order_ties(keys, states)
        kept: list[tuple[float, dict]] = []
        for b in keys:
            cost_b, entries_b = states[b]
            if any(cost_a <= cost_b and _dominates(entries_a, entries_b)
                   for cost_a, entries_a in kept):
                dropped.add(b)
            else:
                kept.append((cost_b, entries_b))
    if not dropped:
        return states
    return {k: v for k, v in states.items() if k not in dropped}


def _order_ties(keys: list[Key], states: States) -> None:
    """Within each run of equal cost in ``keys`` (sorted by cost), the more covering first."""
    start = 0
    while start < len(keys):
        end = start + 1
        cost = states[keys[start]][0]
        while end < len(keys) and states[keys[end]][0] == cost:
            end += 1
        if end - start > 1:
            keys[start:end] = sorted(keys[start:end], key=lambda k: -sum(
                _score(e) for e in states[k][1].values()))
        start = end


def _dominates(entries_a: dict, entries_b: dict) -> bool:
    """``_covers`` for every value, of two states whose layouts are equal up to R/R*: where
    ``a`` made at least what ``b`` did, only an R against an R* is not covered."""
    for name, b in entries_b.items():
        a = entries_a[name]
        if a is b or (a[1] >= b[1] and (not _is_r_star(b[0]) or _is_r_star(a[0]))):
            continue
        if not _covers(a, b):
            return False
    return True


def _is_r_star(layout: Any) -> bool:
    return type(layout) is Replicate and layout.grad_partial


def _free(layout: Any, made: Any) -> bool:
    """A layout read from ``layout`` at no cost and anchoring nothing (solve._read): a
    replicated one, from R*. Having made it already says nothing."""
    return _is_r_star(layout) and type(made) is Replicate


def _covers(a: Entry, b: Entry) -> bool:
    """Every read of a value held as ``b`` costs no less than the same read held as ``a``:
    the same layout, or R* for R, with every layout ``b`` made already made in ``a`` too or
    free from it. (A slice made already is read as it is, and anchors: solve._read_inputs.)"""
    (la, made_a), (lb, made_b) = a, b
    if la != lb and not (_is_r_star(la) and lb == R):
        return False
    return all(m in made_a or _free(la, m) for m in made_b)


def _score(entry: Entry) -> int:
    """Grows strictly with ``_covers``: R* over R counts 2, each layout made that is not free
    from the value's layout 1 (an R that made R* already is covered by an R* that made
    nothing: 1 against 2)."""
    layout, made = entry
    return 2 * _is_r_star(layout) + sum(1 for m in made if not _free(layout, m))


@dataclass
class _Link:
    """Back-pointers of a reused step: those of the solved step, renamed."""

    target: int
    to_mine: dict[str, str]
    to_theirs: dict[str, str]

    def lookup(self, history: list[Any], key: Key) -> tuple[Key, Any]:
        theirs = frozenset((self.to_theirs.get(n, n), e) for n, e in key)
        record = history[self.target]
        prev, (choice, leaves) = record[theirs]
        prev_mine = frozenset((self.to_mine.get(n, n), e) for n, e in prev)
        leaves_mine = tuple((self.to_mine.get(n, n), layout) for n, layout in leaves)
        return prev_mine, (choice, leaves_mine)


def leaf_memory_cost(tp: int, cost_model: Any,
                     pnodes: Sequence[Any] = ()) -> Callable[[Any, Any], float]:
    """The memory price of holding a parameter in a layout. A *narrow* matrix
    (``checks.narrow_matrices``: a rank-r adapter, a router over a few experts) is priced as
    a vector: sharding it saves next to nothing and would buy a collective (lora_A split along
    its rank of 4, or lora_B beside a replicated k/v projection: an all-reduce per adapter).
    An embedding or LM head, narrow only because the vocabulary is large, and k/v
    projections (a quarter of the width with 8 k/v heads of 32) stay matrices."""
    shapes = {pn.node.name: tuple(pn.node.meta["val"].shape) for pn in pnodes
              if pn.kind == "leaf" and pn.is_param and pn.ndim == 2}
    narrow_names = narrow_matrices(shapes)
    few_heads = {pn.node.name for pn in pnodes if pn.kind == "leaf" and pn.is_param and
                 pn.ndim == 2 and _fewer_heads_than(pn.node, tp)}

    def cost(leaf: Any, layout: Any) -> float:
        # state is charged where it is written (``solve._transitions``): a cache whose size
        # is read first gets no preference before its writer says which layouts can hold it
        if not leaf.is_param:
            return 0.0
        ndim = 1 if leaf.node.name in narrow_names else leaf.ndim
        if not isinstance(layout, Shard) and leaf.node.name in few_heads:
            # k/v heads fewer than tp: whole by design, as Megatron holds them, priced as
            # the fused case's whole segments below. Priced at full memory where it enters,
            # the search would prefer a row-parallel k/v (partial sums of q, k and v, the
            # norm's output sliced along h) whose saving is repaid only later, by o_proj
            # held whole, and a bounded beam drops Megatron's plan before it is (tp 8 with
            # 8 query heads of 256 against 4 k/v heads).
            return cost_model.memory_cost(leaf.nbytes / tp, leaf.ndim) + \
                cost_model.transfer_time(Collective.ALL_REDUCE, leaf.nbytes, tp)
        if not isinstance(layout, Shard):
            return cost_model.memory_cost(leaf.nbytes, ndim)
        if not is_mixed(layout.blocks):
            return cost_model.memory_cost(leaf.nbytes / tp, ndim)
        # Segments held whole are k/v heads tp cannot divide, whole by design as in Megatron
        # (and as narrow matrices are): their memory is counted as if sharded, and the sum
        # of their partial gradients after backward is paid as communication (bandwidth; the
        # bucket's latency is shared).
        shape = tuple(leaf.node.meta["val"].shape)
        whole = leaf.nbytes * whole_numel(shape, layout) / math.prod(shape)
        return cost_model.memory_cost(leaf.nbytes / tp, leaf.ndim) + \
            cost_model.transfer_time(Collective.ALL_REDUCE, whole, tp)

    return cost


def _fewer_heads_than(weight: fx.Node, tp: int) -> bool:
    """Whether a product of ``weight`` is split into fewer heads than tp, [.., n] -> [.., H, d]
    with H < tp (k/v projections with 4 k/v heads at tp 8): tp cannot shard its output."""
    readers = [u for u in weight.users if u.target in (aten.t.default, aten.permute.default)]
    for product in [u for u in (*weight.users, *(r for t in readers for r in t.users))
                    if u.op == "call_function" and u.target in MATMULS]:
        n = product.meta["val"].shape[-1]
        for view in product.users:
            shape = view.meta["val"].shape if view.target in RESHAPES else None
            if shape is not None and len(shape) >= 2 and isinstance(shape[-2], int) and \
                    shape[-2] * shape[-1] == n and 1 < shape[-1] < n and shape[-2] < tp:
                return True
    return False


__all__ = ["FrontierSolver", "Segment", "leaf_memory_cost"]
