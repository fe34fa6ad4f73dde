"""Layer-invariant values: what a layer computes from the model's inputs and its own
parameters alone, never from the residual stream.

DiT's adaLN-Zero block is the example: ``shift, scale, gate = mod(silu(c)).chunk(3)`` reads
a per-sample conditioning vector ``c`` and the block's own ``mod`` weight, nothing the layers
before it computed. Megatron's plan shards ``mod`` column-parallel; its output must then be
gathered before it meets the replicated residual stream, one small all-gather per block. As
the value does not depend on any earlier layer, every block's can be computed before the
first layer runs and all of them gathered in one collective (``autotp.runtime.batching``):
each block keeps Megatron's two all-reduces per layer, and the model pays one all-gather of
a few KiB per step. The planner prices such a gather in bytes alone, as it does the
after-backward bucket of replicated parameters' gradients.

    value v in layer k is invariant  <=>  every node v reads is a placeholder, a parameter,
        a value computed before the first layer from those alone, or an invariant value of
        layer k; v is deterministic, writes nothing and sits outside autocast regions.

Layer 0 reads the model's inputs where later layers read the stream, so the rule alone
would call all of layer 0 invariant: a value of layer 0 counts only where the node at the
same position of layer 1 does (the layers of a repeated block have the same program).
"""

from __future__ import annotations

import operator
import re
from typing import Iterable, Optional

import networkx as nx
import torch
import torch.fx as fx

_ENTRY = re.compile(r"^(?P<list>.+)\.(?P<index>\d+)$")


def layer_invariant(graph: fx.Graph) -> frozenset[str]:
    """Names of the values of ``graph`` that the layers compute from inputs and their own
    parameters alone (see the module docstring). The layers are the entries of the module
    list with the most entries (the decoder layers, not a timestep MLP's ``nn.Sequential``)."""
    entry = {node: _entry(node) for node in graph.nodes if node.op == "call_function"}
    sizes: dict[str, set[int]] = {}
    for found in entry.values():
        if found is not None:
            sizes.setdefault(found[0], set()).add(found[1])
    if not sizes:
        return frozenset()
    main = max(sizes, key=lambda c: len(sizes[c]))
    layer = {n: (e[1] if e is not None and e[0] == main else None) for n, e in entry.items()}
    invariant: set[fx.Node] = set()
    before: set[fx.Node] = set()  # computed ahead of every layer, from inputs and parameters
    by_layer: dict[int, list[fx.Node]] = {}
    autocast = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            before.add(node)
            continue
        if node.op != "call_function":
            continue
        if node.target is torch.amp._enter_autocast:
            autocast += 1
            continue
        if node.target is torch.amp._exit_autocast:
            autocast -= 1
            continue
        k = layer[node]
        if k is not None:
            by_layer.setdefault(k, []).append(node)
        if autocast or not _pure(node):
            continue
        ins = node.all_input_nodes
        if k is None:
            if all(x in before for x in ins):
                before.add(node)
        elif all(x in before or (x in invariant and layer.get(x) == k) for x in ins):
            invariant.add(node)
    order = sorted(by_layer)
    first = by_layer[order[0]]
    second = by_layer[order[1]] if len(order) > 1 else []
    matched = len(first) == len(second) and all(
        a.target == b.target for a, b in zip(first, second))
    for a, b in zip(first, second):
        if a in invariant and not (matched and b in invariant):
            invariant.discard(a)
    if not second:
        invariant.difference_update(first)
    return frozenset(n.name for n in invariant)


def _entry(node: fx.Node) -> Optional[tuple[str, int]]:
    """(module list, index) of the outermost list entry whose forward produced ``node``."""
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        match = _ENTRY.match(str(path))
        if match:
            return match.group("list"), int(match.group("index"))
    return None


def _pure(node: fx.Node) -> bool:
    """Deterministic and writing nothing: free to run earlier than the program says."""
    if getattr(node.target, "__module__", None) == "_operator":  # getitem, size arithmetic
        return node.target not in (operator.setitem, operator.delitem)
    schema = getattr(node.target, "_schema", None)
    tags = getattr(node.target, "tags", None)
    if schema is None or tags is None:
        return False
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in tags


def closure(values: Iterable[fx.Node]) -> list[fx.Node]:
    """``values`` and every node they read, but placeholders, in graph order."""
    values = list(values)
    if not values:
        return []
    graph = values[0].graph
    reads = nx.DiGraph((x, n) for n in graph.nodes for x in n.all_input_nodes)
    seen = set(values).union(*(nx.ancestors(reads, v) for v in values if v in reads))
    return [n for n in graph.nodes if n in seen and n.op != "placeholder"]
