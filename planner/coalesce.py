"""Sibling all-reduces joined: two collectives of one layer that neither waits for run as one.

Megatron's layer has one all-reduce each way per sublayer because a sublayer has one input
and one output. Some blocks have several: DeepSeek-V3's multi-latent attention keeps its two
low-rank down-projections whole, so backward sums two partial gradients (q after
``q_a_layernorm``, the compressed k/v), and a norm over the full width of q and of k (OLMo-2)
sums two statistics forward. Where neither input depends on the other's result, both sums
run as one all-reduce of a flat buffer of both:

    before:  q_a -> f -> q_b_proj ...   kv_a -> f -> kv_b_proj ...       (2 all-reduces bwd)
    after:   q_a, kv_a -> f(q_a, kv_a) -> q_b_proj ..., kv_b_proj ...    (1 all-reduce bwd)

The bytes are the same; each join saves a launch and the ring's 2(tp - 1) steps. The joined
call goes before the first op that reads any of its outputs, so the ops that compute a later
input move ahead of that op (``moved``): only pure ops, none that draws random numbers or
writes in place, and none that reads a joined output (that would be a cycle).

Only all-reduces of one direction each (a partial sum made whole forward, ``P -> R``;
Megatron's ``f``, a replicated value whose gradient is summed, ``R -> R*``) of one dtype are
joined; the plan marks them ``Edge.joined`` and records one collective for each join.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Callable, Iterable, Optional

import networkx as nx
import torch
import torch.fx as fx

from autotp.ops import DROPOUTS, node_arg
from autotp.planner.cost import parse_size_expr, readable
from autotp.planner.plan import JOINED, CollectiveRecord, Edge, Plan

Key = tuple[str, str]  # (value, layout read): one redistribution in the rank program


def movable(node: fx.Node) -> bool:
    """An op that may run earlier than the program has it: no effect, no random draw, no
    in-place write."""
    if node.op == "get_attr":
        return True
    if node.op == "call_module":
        # a rank program's redistributions and expert dispatches: collectives every rank
        # runs in the same order; the capture's guard check keeps its place
        return "guards" not in str(node.target)
    if node.op != "call_function":
        return False
    target = node.target
    if target in DROPOUTS and node_arg(node, "train") is False:
        return True  # in eval mode: the identity, no draw
    if node.is_impure():
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return not target._schema.is_mutable and \
        torch.Tag.nondeterministic_seeded not in target.tags



def moved(graph: fx.Graph, values: Iterable[fx.Node], consumers: Iterable[fx.Node],
          order: Optional[dict[fx.Node, int]] = None) -> Optional[list[fx.Node]]:
    """The nodes to move ahead of the first consumer so that every value is computed there
    (graph order), or None when one of them cannot move or reads a consumer's result."""
    order = order if order is not None else {n: i for i, n in enumerate(graph.nodes)}
    values, consumers = list(values), set(consumers)
    first = min(order[c] for c in consumers)
    late = [v for v in values if order[v] >= first]
    if not late:
        return []
    last = max(order[v] for v in late)
    window = [n for n in graph.nodes if first <= order[n] <= last]
    dag = nx.DiGraph()
    dag.add_nodes_from(window)
    dag.add_edges_from((i, n) for n in window for i in n.all_input_nodes if i in dag)
    need = set(late).union(*(nx.ancestors(dag, v) for v in late))
    if need & consumers or not all(movable(n) for n in need):
        return None
    return sorted(need, key=order.__getitem__)


def place(graph: fx.Graph, keys: list[Key], reads: list[tuple[Key, str]],
          call: Callable[[tuple[fx.Node, ...]], fx.Node]) -> None:
    """Put one join in ``graph``: ``call(values)`` (made at the insertion point) before the
    first op that reads a value as one of ``keys`` (``reads``: (key, consumer)), the ops that
    compute later values moved ahead of that op, and each such read taken from the call's
    output for its key. The planner joins on a copy of the program (so that each join is
    checked against the ones before it, which tie their values' readers together), the
    rewriter in the rank program, in the same order."""
    nodes = {n.name: n for n in graph.nodes}
    values = [nodes[value] for value, _ in keys]
    consumers = [nodes[consumer] for _, consumer in reads]
    order = {n: i for i, n in enumerate(graph.nodes)}
    ahead = moved(graph, values, consumers, order)
    if ahead is None:
        raise AssertionError(f"{keys} cannot run as one")
    first = min(consumers, key=order.__getitem__)
    for node in ahead:
        first.prepend(node)
    with graph.inserting_before(first):
        joined = call(tuple(values))
        outs = {}
        for i, key in enumerate(keys):
            out = graph.call_function(operator.getitem, (joined, i))
            out.meta["val"] = nodes[key[0]].meta.get("val")
            outs[key] = out
    for key, consumer in reads:
        nodes[consumer].replace_input_with(nodes[key[0]], outs[key])


def _joined(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stands for a join in the planner's copy of the program (never run)."""
    return values


def join_siblings(plan: Plan, graph: fx.Graph) -> None:
    """Mark the plan's joinable all-reduces (``Edge.joined``) and record one collective per
    join in place of its members'. Each join is built from the first candidate left and
    every later one of its layer, direction and dtype that can run with it, then placed in a
    copy of the program before the next is looked for."""
    if plan.degree == 1:
        return
    nodes = {n.name: n for n in graph.nodes}
    readers: dict[Key, list[Edge]] = {}
    for edge in plan.edges:
        readers.setdefault((edge.value, edge.dst), []).append(edge)
    buckets: dict[tuple, list[Key]] = {}
    for key, edges in readers.items():
        phase = _single_all_reduce(edges[0])
        if phase is None or edges[0].layer is None or key[0] not in nodes or \
                len({e.layer for e in edges}) > 1 or \
                any(nodes[e.consumer].target == torch.ops.aten.sym_size.int for e in edges):
            continue  # a size read runs on the value itself (runtime.rewrite)
        val = nodes[key[0]].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        buckets.setdefault((edges[0].layer, phase, str(val.dtype)), []).append(key)
    if not any(len(keys) > 1 for keys in buckets.values()):
        return
    work = fx.Graph()
    work.output(work.graph_copy(graph, {}))
    copied = {n.name: n for n in work.nodes}
    assert set(copied) >= set(nodes), "a copy of the program renamed its nodes"
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    groups: list[tuple[str, list[Key]]] = []
    for (_, phase, _), keys in sorted(buckets.items()):
        left = sorted(keys, key=lambda k: position[k[0]])
        while left:
            group = [left.pop(0)]
            order = {n: i for i, n in enumerate(work.nodes)}
            for key in list(left):
                candidate = group + [key]
                if moved(work, (copied[k[0]] for k in candidate),
                         (copied[e.consumer] for k in candidate for e in readers[k]),
                         order) is not None:
                    group.append(key)
                    left.remove(key)
            if len(group) > 1:
                place(work, group, [(k, e.consumer) for k in group for e in readers[k]],
                      lambda values: work.call_function(_joined, values))
                groups.append((phase, group))
    if not groups:
        return
    member: dict[Key, int] = {}
    for index, (_, keys) in enumerate(groups):
        member.update((k, index) for k in keys)
    plan.edges = [replace(e, joined=member[(e.value, e.dst)])
                  if (e.value, e.dst) in member else e for e in plan.edges]
    records = {(c.node, c.dst, c.phase): c for c in plan.collectives}
    merged: dict[int, CollectiveRecord] = {}
    for index, (phase, keys) in enumerate(groups):
        parts = [records[(value, dst, phase)] for value, dst in keys]
        merged[index] = CollectiveRecord(
            kind="all_reduce", phase=phase, layer=parts[0].layer,
            bytes_expr=readable(sum(parse_size_expr(p.bytes_expr) for p in parts), {}),
            node=JOINED + ", ".join(p.node for p in parts), source=parts[0].source,
            src=parts[0].src, dst=parts[0].dst, module=parts[0].module)
    out: list[CollectiveRecord] = []
    for c in plan.collectives:
        join = member.get((c.node, c.dst))
        if join is None or c.phase != groups[join][0]:
            out.append(c)
        elif join in merged:
            out.append(merged.pop(join))
    plan.collectives = out


def _single_all_reduce(edge: Edge) -> Optional[str]:
    """The direction of the edge's one collective when it is an all-reduce, else None."""
    if edge.batched or "@" in edge.src or "@" in edge.dst:  # joined ahead, or routed rows
        return None
    kinds = [(phase, kind) for phase, kind in (("forward", edge.forward),
                                                ("backward", edge.backward)) if kind]
    if len(kinds) != 1 or kinds[0][1] != "all_reduce":
        return None
    return kinds[0][0]
