"""The column/row plan: Megatron's layouts read off a layer's dataflow, the search's yardstick.

Megatron shards the matrices that read a layer's residual stream along their output features
(column) and the matrices that write into it along their input features (row); between the
two, everything runs on the shards. Which matrix is which is a fact of the dataflow, not of
the names:

    stream        the values computed before a layer that reach its output through no
                  matrix of the layer (the residual: ``x -> x + f(x) -> ...``); a causal
                  mask or a rotary table reaches the output only through a projection
    column        a product of a 2-D parameter whose input the stream reaches through no
                  other such product (q/k/v, gate/up, after their norms)
    row           a product whose output reaches the layer's output through no other such
                  product (the attention's output projection, the MLP's down projection)

A product that is both (a single gate on the stream) or neither (the middle of a chain of
three, MLA's low-rank up-projections) is left to the search, as is everything outside the
layers (embeddings, the head). ``column_row_layouts`` turns the roles into the stored layouts
the product's own strategies give its weight (a column strategy: the weight sharded, the
output sharded; a row strategy: the output a partial sum), several where the rules offer
several (blocks of a fused projection). ``autotp.planner.solve`` solves the problem once more
with those layouts and keeps the cheaper plan, so no plan costs more than the column/row plan
where the latter exists.
"""

from __future__ import annotations

from typing import Iterable

import networkx as nx

from autotp.capture.blocks import layer_of
from autotp.layout import Layout, Partial, Replicate, Shard
from autotp.ops import MATMULS
from autotp.planner.problem import PNode
from autotp.rules.registry import output_layouts


def column_row_layouts(pnodes: list[PNode]) -> dict[str, list[Layout]]:
    """parameter leaf -> the stored layouts of its role (see the module docstring); a
    parameter with no role, or with roles that disagree between its readers, is absent."""
    by_name = {pn.node.name: pn for pn in pnodes}
    flow = nx.DiGraph()
    for pn in pnodes:
        flow.add_node(pn.node.name)
        flow.add_edges_from((name, pn.node.name) for name in pn.inputs if name in by_name)
    layers: dict[int, set[str]] = {}
    for pn in pnodes:
        layer = layer_of(pn.node) if pn.kind in ("op", "getitem") else None
        if layer is not None:
            layers.setdefault(layer, set()).add(pn.node.name)
    allowed: dict[str, set[Layout]] = {}
    refused: set[str] = set()
    for members in layers.values():
        for weight, layouts in _layer_roles(flow, by_name, members):
            if weight in refused:
                continue
            if weight in allowed and not (allowed[weight] & layouts):
                refused.add(weight)
                del allowed[weight]
                continue
            allowed[weight] = allowed[weight] & layouts if weight in allowed else layouts
    return {name: sorted(layouts, key=str) for name, layouts in allowed.items() if layouts}


def _weight(pn: PNode, by_name: dict[str, PNode]) -> str | None:
    """The 2-D parameter a product reads (None: not a product of one)."""
    if pn.kind != "op" or pn.node.target not in MATMULS:
        return None
    weights = [name for name in pn.inputs
               if by_name[name].kind == "leaf" and by_name[name].is_param
               and by_name[name].ndim == 2]
    return weights[0] if len(set(weights)) == 1 else None


def _layer_roles(flow: nx.DiGraph, by_name: dict[str, PNode], members: set[str]
                 ) -> Iterable[tuple[str, set[Layout]]]:
    """(weight, its layouts) for each product of one layer with a role."""
    products = {name: weight for name in members
                for weight in [_weight(by_name[name], by_name)] if weight is not None}
    if not products:
        return
    # the layer's outputs: its values read after it (or returned)
    outputs = {name for name in members
               if any(reader not in members for reader in flow.successors(name))
               or by_name[name].is_output}
    # the stream: values computed before the layer (not parameters or tables) that reach
    # an output through no product
    inner = flow.subgraph(members - set(products))
    entries = {source for name in members for source in flow.predecessors(name)
               if source not in members and by_name[source].kind in ("op", "getitem", "input")}
    opened = nx.DiGraph(inner)
    opened.add_edges_from((source, reader) for source in entries
                          for reader in flow.successors(source) if reader in inner)
    stream = {source for source in entries
              if source in opened and nx.descendants(opened, source) & outputs}
    if not stream:
        return  # no residual path: nothing marks which product reads the stream
    from_stream = set(stream).union(*(nx.descendants(opened, s) for s in stream))
    to_output = set(outputs).union(*(nx.ancestors(inner, o) for o in outputs if o in inner))
    for product, weight in products.items():
        pn = by_name[product]
        activations = [name for name in pn.inputs if name != weight]
        reads = any(name in from_stream for name in activations)
        writes = product in outputs or any(reader in to_output
                                           for reader in flow.successors(product))
        if reads == writes:
            continue
        layouts = _weight_layouts(pn, weight, column=reads)
        if layouts:
            yield weight, layouts


def _weight_layouts(pn: PNode, weight: str, column: bool) -> set[Layout]:
    """The layouts of ``weight`` in the product's column (or row) strategies: the weight
    sharded, its activation whole (column) or sharded (row), the output sharded (column)
    or a partial sum (row)."""
    at = [i for i, name in enumerate(pn.inputs) if name == weight]
    found: set[Layout] = set()
    for strategy in pn.strategies:
        layouts = {strategy.inputs[i] for i in at}
        if len(layouts) != 1 or not isinstance(next(iter(layouts)), Shard):
            continue
        others = [layout for i, layout in enumerate(strategy.inputs) if i not in at]
        outputs = output_layouts(strategy.output)
        if column and all(isinstance(o, Shard) for o in outputs) and \
                all(isinstance(x, Replicate) for x in others):
            found |= layouts
        if not column and all(isinstance(o, Partial) for o in outputs) and \
                any(isinstance(x, Shard) for x in others):
            found |= layouts
    return found
