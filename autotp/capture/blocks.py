"""Layers found by structure: the repeated blocks of a captured program, and which one each
node runs in.

A layer is one call of a repeated block. The blocks are read off the program, never off what
the modules are called: the module stack export records on every node (``nn_module_stack``:
each module's path and the call it is, ``@n``) and the parameters the program reads.

    list entry     a path ending in an index (``layers.3``, ``h.3``), the outermost index of
                   a list inside a list (x-transformers' ``layers.3.1`` is entry 3): an entry
                   of a module list, holding a matrix; a list of one entry is one layer
    indexed twins  siblings named by an index (``layer_0``/``layer_1``, ``block1``/``block2``)
                   holding at least two matrices, each with a sibling of the same parameters
                   (the same relative names and shapes)
    repeated call  a module holding at least two matrices, called two or more times outside
                   the blocks above (``for _ in range(n): x = self.block(x)``, ALBERT's
                   shared layer): each call is a layer

torch.nn's own layers are never blocks (an entry of ``nn.Sequential(Linear, SiLU, Linear)``),
nor modules holding fewer matrices (norms, activations). A node belongs to the outermost
block on its module stack. Layers are numbered 0, 1, ... in the order the program first runs
them, across all blocks (an encoder's 6 layers then a decoder's 6 are layers 0-11), so one
number names one layer, whatever its path: every consumer (the planner's repeated layers,
the plan's collectives and parameters, the verdict on Megatron's bound) reads
``layer_of(node)``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

LAYER = "autotp_layer"  # node.meta key: the node's layer (None: outside the layers)

_NAMED = re.compile(r"^(?P<stem>.*\D)(?P<index>\d+)$")  # layer_0, block1 -> layer_, block
_CALL = re.compile(r"@(\d+)$")


@dataclass(frozen=True)
class Layers:
    """The layers of one program in the order it first runs them: ``paths[k]`` is layer k's
    module path, ``@n`` added for the n-th call (from 0) of a block called more than once."""

    paths: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.paths)


def layer_of(node: fx.Node) -> Optional[int]:
    """The layer ``node`` runs in, None outside the layers (see the module docstring). Read
    from the labels ``find_layers`` leaves; a graph not labelled yet (or a node added since)
    is labelled now."""
    if LAYER not in node.meta:
        find_layers(node.graph)
    return node.meta.get(LAYER)


def find_layers(graph: fx.Graph) -> Layers:
    """Label every node of ``graph`` with its layer (``node.meta[LAYER]``); the layers."""
    nodes = list(graph.nodes)
    shapes = _parameter_shapes(graph)
    under = _by_prefix(shapes)
    stacks = {node: _stack(node) for node in nodes}
    fixed = _fixed_blocks(stacks, under)
    unit = {node: _outermost(stacks[node], fixed) for node in nodes}
    # modules called more than once outside the blocks above: each call a layer
    called: dict[str, set[int]] = {}
    for node in nodes:
        if unit[node] is None:
            for path, key, cls in stacks[node]:
                if not torch_leaf(cls) and _matrices(under.get(path, {})) >= 2:
                    called.setdefault(path, set()).add(_call(key))
    repeated = {path: path for path, calls in called.items() if len(calls) > 1}
    for node in nodes:
        if unit[node] is None:
            unit[node] = _outermost(stacks[node], repeated)
    if not any(unit.values()):
        unit = _by_parameters(nodes, under, set(shapes))
    order: dict[tuple[str, int], int] = {}
    for node in nodes:
        found = unit[node]
        if found is not None:
            order.setdefault(found, len(order))
        node.meta[LAYER] = None if found is None else order[found]
    calls = Counter(path for path, _ in order)
    return Layers(tuple(f"{path}@{call}" if calls[path] > 1 else path for path, call in order))


def _by_parameters(nodes: list[fx.Node], under: dict[str, dict[str, tuple[int, ...]]],
                   params: set[str]) -> dict[fx.Node, Optional[tuple[str, int]]]:
    """The layers of a program whose module stack shows none (blocks run by a method other
    than ``forward``, as ``layer.forward_parallel(x)``): a node reading the parameters of a
    list entry holding a matrix runs in that entry, and a node reading no parameter in the
    layer of the latest of its inputs in one; a node reading any other parameter (an
    embedding, a final norm, a head) is outside, and so are the nodes that follow only it."""
    unit: dict[fx.Node, Optional[tuple[str, int]]] = {}
    position = {node: k for k, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "get_attr":
            parts = str(node.target).split(".")[:-1]
            index = next((k for k, part in enumerate(parts) if part.isdigit()), None)
            block = None if index is None else ".".join(parts[:index + 1])
            unit[node] = (block, 0) if block is not None and \
                _matrices(under.get(block, {})) else None
            continue
        inputs = node.all_input_nodes
        read = [unit.get(a) for a in inputs if a.op == "get_attr" and str(a.target) in params]
        if read:
            unit[node] = read[0] if all(r is not None and r == read[0] for r in read) else None
            continue
        carried = [a for a in inputs if unit.get(a) is not None]
        unit[node] = unit[max(carried, key=position.__getitem__)] if carried and \
            node.op == "call_function" else None
    return unit


def _outermost(stack: list[tuple[str, str, Any]],
               blocks: dict[str, str]) -> Optional[tuple[str, int]]:
    """(block, call) of the outermost module on ``stack`` that is or is in one of
    ``blocks`` (module path -> its block's path); None where none is."""
    for path, key, _cls in stack:
        block = blocks.get(path)
        if block is not None:
            return block, _call(key)
    return None


def _entry(path: str) -> Optional[str]:
    """The list entry ``path`` is or is inside of: ``layers.3`` for ``layers.3`` and for
    ``layers.3.1`` (a list inside a list's entry); None for a path not ending in an index."""
    parts = path.split(".")
    k = len(parts)
    while k and parts[k - 1].isdigit():
        k -= 1
    return None if k == len(parts) else ".".join(parts[:k + 1])


def _stack(node: fx.Node) -> list[tuple[str, str, Any]]:
    """(path, key, class) of each module on ``node``'s stack, outermost first, the root
    (path "") left out."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(str(path), str(key), cls) for key, (path, cls) in stack.items() if path]


def _call(key: str) -> int:
    match = _CALL.search(key)
    return int(match.group(1)) if match else 0


def _parameter_shapes(graph: fx.Graph) -> dict[str, tuple[int, ...]]:
    """Target -> shape of every parameter the program reads (every tensor it reads by
    ``get_attr`` where the graph has no module to tell parameters from buffers)."""
    owner = graph.owning_module
    params = None if owner is None else {name for name, _ in
                                         owner.named_parameters(remove_duplicate=False)}
    out: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr" and isinstance(val, torch.Tensor) and \
                (params is None or node.target in params):
            out[str(node.target)] = tuple(int(s) for s in val.shape)
    return out


def _by_prefix(shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Module path -> {name relative to it: shape} of the parameters under it."""
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for target, shape in shapes.items():
        parts = target.split(".")
        for k in range(1, len(parts)):
            out.setdefault(".".join(parts[:k]), {})[".".join(parts[k:])] = shape
    return out


def _matrices(params: dict[str, tuple[int, ...]]) -> int:
    return sum(1 for shape in params.values() if len(shape) >= 2)


def _fixed_blocks(stacks: dict[fx.Node, list[tuple[str, str, Any]]],
                  under: dict[str, dict[str, tuple[int, ...]]]) -> dict[str, str]:
    """Module path on some stack -> the block it is (or is inside, as a list's entry is),
    for list entries and indexed twins."""
    modules: dict[str, Any] = {}
    for stack in stacks.values():
        for path, _key, cls in stack:
            modules.setdefault(path, cls)
    out: dict[str, str] = {}
    twins: dict[tuple[str, str], list[str]] = {}
    for path, cls in modules.items():
        block = _entry(path)
        if block is not None:
            # an entry of torch's own (a Linear of a Sequential) is no block; a torch layer
            # inside a custom entry (x-transformers' norm, ``layers.3.0``) is in it
            if (block != path or not torch_leaf(cls)) and _matrices(under.get(block, {})):
                out[path] = block
            continue
        parent, _, name = path.rpartition(".")
        named = _NAMED.match(name)
        if named and not torch_leaf(cls) and _matrices(under.get(path, {})) >= 2:
            twins.setdefault((parent, named.group("stem")), []).append(path)
    for members in twins.values():
        kinds = [frozenset(under.get(path, {}).items()) for path in members]
        for path, kind in zip(members, kinds):
            if kinds.count(kind) > 1:
                out[path] = path
    return out


def torch_leaf(cls: Any) -> bool:
    """One of torch.nn's own layers (``nn.Linear``, ``nn.SiLU``), not a container or a
    whole block: an entry of ``nn.Sequential(nn.Linear, nn.SiLU, nn.Linear)`` (a timestep
    MLP) is no layer; an ``nn.TransformerEncoderLayer`` of ``encoder.layers`` is one."""
    name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return name.startswith("torch.nn.modules.") and not name.startswith(
        ("torch.nn.modules.container.", "torch.nn.modules.transformer."))
