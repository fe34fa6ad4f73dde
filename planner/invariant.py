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
        layer k; v is deterministic, writes nothing and sits outside autocast regions;
        and v reads a model input (a value of the parameters alone is a weight).

The first layer of a list reads the model's inputs where later layers read the stream, so
the rule alone would call all of it invariant: there, a value computed before the layers
counts only where more than one layer reads it (the conditioning vector, not the embedded
tokens that only the first layer reads).
"""

from __future__ import annotations

import operator
import re
from typing import Iterable, Optional

import networkx as nx
import torch
import torch.fx as fx

from autotp.capture.blocks import torch_leaf

_ENTRY = re.compile(r"^(?P<list>.+)\.(?P<index>\d+)$")


def layer_invariant(graph: fx.Graph) -> frozenset[str]:
    """Names of the values of ``graph`` that the layers compute from inputs and their own
    parameters alone (see the module docstring). A layer is an entry of a module list with
    two or more entries (DiT's blocks; Flux's double- and single-stream blocks are two
    lists), not a torch layer inside an ``nn.Sequential`` (a timestep MLP)."""
    entry = {node: _entry(node) for node in graph.nodes if node.op == "call_function"}
    sizes: dict[str, set[int]] = {}
    for found in entry.values():
        if found is not None:
            sizes.setdefault(found[0], set()).add(found[1])
    lists = {name for name, indices in sizes.items() if len(indices) > 1}
    if not lists:
        return frozenset()
    layer = {n: (e if e is not None and e[0] in lists else None) for n, e in entry.items()}
    firsts = {(name, min(sizes[name])) for name in lists}
    # what more than one layer reads: the conditioning (a timestep embedding), not a stream
    # that only the first layer reads (the embedded tokens)
    shared = {node for node in graph.nodes
              if len({layer.get(u) for u in node.users} - {None}) > 1}
    invariant: set[fx.Node] = set()
    before: set[fx.Node] = set()  # computed ahead of every layer, from inputs and parameters
    per_sample: set[fx.Node] = set()  # reads a model input
    autocast = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            before.add(node)
            if node.op == "placeholder":
                per_sample.add(node)
            continue
        if node.op != "call_function":
            continue
        if node.target is torch.amp._enter_autocast:
            autocast += 1
            continue
        if node.target is torch.amp._exit_autocast:
            autocast -= 1
            continue
        if any(x in per_sample for x in node.all_input_nodes):
            per_sample.add(node)
        k = layer[node]
        if autocast or not _pure(node):
            continue
        ins = node.all_input_nodes
        if k is None:
            if all(x in before for x in ins):
                before.add(node)
        elif all(x in invariant and layer.get(x) == k or
                 x in before and (k not in firsts or x in shared or x.op == "get_attr")
                 for x in ins):
            invariant.add(node)
    # a value of the parameters alone (a transposed or stacked weight) is a weight, not a
    # per-sample value: gathering weights ahead of the layers is not a plan to price as one
    # small collective
    return frozenset(n.name for n in invariant if n in per_sample)


def _entry(node: fx.Node) -> Optional[tuple[str, int]]:
    """(module list, index) of the outermost list entry whose forward produced ``node``."""
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        match = _ENTRY.match(str(path))
        if match and not torch_leaf(cls):
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


def stages(graph: fx.Graph, joined: set[tuple[str, str]]) -> dict[str, int]:
    """Per node, the most joined collectives on one path to it from the inputs: a value of
    stage k joins the (k+1)-th collective ahead of the layers (autotp.runtime.batching).
    ``joined`` holds (value, reader) pairs; a reader of a joined value reads what the
    collective returns, so it comes one stage later. One pass in graph order, which is
    topological (a longest-path count, weights 0 and 1)."""
    level: dict[str, int] = {}
    for node in graph.nodes:
        level[node.name] = max((level[x.name] + ((x.name, node.name) in joined)
                                for x in node.all_input_nodes), default=0)
    return level


def closure(values: Iterable[fx.Node]) -> list[fx.Node]:
    """``values`` and every node they read, but placeholders, in graph order."""
    values = list(values)
    if not values:
        return []
    graph = values[0].graph
    reads = nx.DiGraph((x, n) for n in graph.nodes for x in n.all_input_nodes)
    seen = set(values).union(*(nx.ancestors(reads, v) for v in values if v in reads))
    return [n for n in graph.nodes if n in seen and n.op != "placeholder"]
