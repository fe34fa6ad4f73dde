"""Layer structure: the rank program split at its repeated blocks, under the original names.

A captured transformer is one flat graph, but every node remembers the module that produced
it. Here the rewritten program is cut at the entries of its ``nn.ModuleList`` (the decoder
layers): each layer's nodes, collectives and local parameters become one submodule at the
layer's own path (``model.layers.3``), called by the root graph, and ``model.layers`` becomes
an ``nn.ModuleList`` of them. Parameter names do not change (the layer holds the same
parameter objects at the same paths), so the plan, ``full_state_dict``, checkpoints and the
collective log read as before, and the recipes written for eager models apply per layer:
``fully_shard(layer)``, ``checkpoint_wrapper(layer)``, ``torch.compile(layer)``.

    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh["dp"])

A layer's boundary is where its module stack says it is; a node of the enclosing module
placed between two of the layer's nodes (glue reading the layer's values) joins the layer.
A collective the rewriter inserted goes with the values it acts on while those are one
layer's and nothing outside the layer has read them yet; one acting on two layers' values
(a joined all-reduce) goes to the layer it runs in. A program whose blocks interleave, or
whose layers could not each run as one call where their last node is, is left flat.
"""

from __future__ import annotations

import operator
import re
from typing import Iterator, Optional

import torch.fx as fx
from torch import nn

from autotp.runtime.batching import HOISTED

_ENTRY = re.compile(r"^(?P<list>.+)\.(?P<index>\d+)$")


def layer_path(node: fx.Node) -> Optional[str]:
    """The path of the outermost ModuleList entry whose forward produced ``node``
    (``model.layers.3``), or None."""
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        if _ENTRY.match(str(path)):
            return str(path)
    return None


def split_layers(gm: fx.GraphModule) -> list[str]:
    """Split ``gm`` in place at its layers; returns their paths (none when left flat)."""
    owner = _owners(gm)
    if owner is None:
        return []
    order = list(gm.graph.nodes)
    members: dict[str, list[fx.Node]] = {}
    for node in order:
        path = owner.get(node)
        if path is not None:
            members.setdefault(path, []).append(node)
    # an entry that holds no parameter (an activation, x-transformers' Residual) is not a
    # module of the program: its nodes stay in the root, between the layers around it
    for path in [p for p in members if not _has_submodule(gm, p)]:
        for node in members.pop(path):
            del owner[node]
    # each layer is called where its last node is: what it reads must be computed by then
    if not members or not _runs_in_order(order, owner):
        return []
    # the layers' containers must exist in the program (they hold the layers' parameters)
    containers = {_ENTRY.match(p).group("list") for p in members}  # type: ignore[union-attr]
    for container in containers:
        try:
            gm.get_submodule(container)
        except AttributeError:
            return []
    new = fx.Graph()
    new._codegen = gm.graph._codegen  # the model's input and output structure (pytree)
    env: dict[fx.Node, fx.Node] = {}
    built: dict[str, fx.GraphModule] = {}
    last = {path: nodes[-1] for path, nodes in members.items()}
    for node in order:
        path = owner.get(node)
        if path is None:
            env[node] = new.node_copy(node, lambda x: env[x])
            continue
        if node is not last[path]:
            continue
        module, inputs, outputs = _layer_module(gm, path, members[path])
        built[path] = module
        call = new.call_module(path, tuple(env[x] for x in inputs))
        call.meta["nn_module_stack"] = {path: (path, type(module))}
        if len(outputs) == 1:
            env[outputs[0]] = call
        else:
            for i, out in enumerate(outputs):
                env[out] = new.call_function(operator.getitem, (call, i))
    _install(gm, built)
    for nodes in members.values():  # the layers' collectives now live in the layers
        for node in nodes:
            if node.op == "call_module" and hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    gm.graph = new
    gm.graph.lint()
    gm.recompile()
    return list(built)


def _has_submodule(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_submodule(path)
        return True
    except AttributeError:
        return False


def program_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """The nodes of ``gm`` and of the layers it calls, in the order they run (each layer's
    nodes where the root calls it)."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            inner = getattr(module, "_checkpoint_wrapped_module", module)
            if isinstance(inner, fx.GraphModule):
                yield from program_nodes(inner)
                continue
        yield node


def _owners(gm: fx.GraphModule) -> Optional[dict[fx.Node, str]]:
    """node -> the layer it belongs to (absent: the root), or None when the layers
    interleave."""
    order = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    owner: dict[fx.Node, str] = {}
    for node in order:
        if node.op in ("call_function", "call_method") and not node.meta.get(HOISTED):
            path = layer_path(node)
            if path is not None:
                owner[node] = path
    spans: dict[str, list[int]] = {}
    for node, path in owner.items():
        if node.op != "call_function":  # parameters and their markers sit at the top
            continue
        span = spans.setdefault(path, [position[node], position[node]])
        span[0], span[1] = min(span[0], position[node]), max(span[1], position[node])
    # inserted modules (collectives, dropout, joined all-reduces) go with the values they
    # act on when those are one layer's and the module runs before anything outside the
    # layer reads them; a module on values of two layers (a backward all-reduce joining the
    # previous block's output with one of this block's values) stays in the root, from
    # where the glue rule below moves it into the layer it runs in. Modules on a parameter
    # or an input go with their readers when those are all in one layer.
    reach = _reach(order, owner, spans)
    for node in order:
        if node.op != "call_module" or not node.all_input_nodes:
            continue
        values = [x for x in node.all_input_nodes if x.op not in ("get_attr", "placeholder")]
        if values:
            layers = {owner.get(x) for x in values}
            path = layers.pop() if len(layers) == 1 else None
            if path is not None and position[node] >= reach.get(path, len(order)):
                path = None
        else:
            readers = {owner.get(u) for u in node.users}
            path = readers.pop() if len(readers) == 1 else None
        if path is not None:
            owner[node] = path
    # parameters and submodules read by one layer only move into it
    for node in order:
        if node.op == "get_attr":
            readers = {owner.get(u) for u in node.users}
            path = readers.pop() if len(readers) == 1 else None
            if path is not None and str(node.target).startswith(path + "."):
                owner[node] = path
    # glue of the enclosing module placed inside a layer's span joins it when it reads it
    for path, (first, end) in spans.items():
        for node in order[first:end + 1]:
            mine = owner.get(node)
            if mine is None and node.op not in ("placeholder", "output") and \
                    any(owner.get(x) == path for x in node.all_input_nodes):
                owner[node] = path
            elif mine is not None and mine != path and node.op == "call_function":
                return None  # two layers interleave
    return owner


def _reach(order: list[fx.Node], owner: dict[fx.Node, str],
           spans: dict[str, list[int]]) -> dict[str, int]:
    """layer -> the position of the first node after its last op that needs the layer to
    have run: an op of another layer, or a node of the root reading one of its ops (an
    inserted module on its values alone is a candidate member, not a reader)."""
    reach = {}
    for path, (_, end) in spans.items():
        reach[path] = len(order)
        for i in range(end + 1, len(order)):
            node, mine = order[i], owner.get(order[i])
            if mine is not None and mine != path:
                reach[path] = i
                break
            reads = {owner.get(x) for x in node.all_input_nodes
                     if x.op not in ("get_attr", "placeholder")}
            if mine is None and path in reads and \
                    not (node.op == "call_module" and reads == {path}):
                reach[path] = i
                break
    return reach


def _runs_in_order(order: list[fx.Node], owner: dict[fx.Node, str]) -> bool:
    """Postcondition of the assignment: every node of the root, and every layer called
    where its last node is, finds the values it reads already computed."""
    members: dict[str, list[fx.Node]] = {}
    for node in order:
        if node in owner:
            members.setdefault(owner[node], []).append(node)
    ready: set[fx.Node] = set()
    for node in order:
        path = owner.get(node)
        if path is None:
            if any(x not in ready for x in node.all_input_nodes):
                return False
            ready.add(node)
        elif node is members[path][-1]:
            inside = set(members[path])
            if any(x not in ready and x not in inside
                   for m in members[path] for x in m.all_input_nodes):
                return False
            ready.update(inside)
    return True


def _layer_module(gm: fx.GraphModule, path: str,
                  nodes: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The layer's graph module, the values it reads and the values it gives back."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for x in node.all_input_nodes:
            if x not in inside and x not in inputs:
                inputs.append(x)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env = {x: graph.placeholder(x.name) for x in inputs}
    for x, placeholder in env.items():
        placeholder.meta = dict(x.meta)
    prefix = path + "."
    holder = gm.get_submodule(path)
    for node in nodes:
        copy = graph.node_copy(node, lambda x: env[x])
        if node.op == "get_attr":
            copy.target = str(node.target)[len(prefix):]
        elif node.op == "call_module":
            holder.add_module(str(node.target), gm.get_submodule(str(node.target)))
        env[node] = copy
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    module = fx.GraphModule(holder, graph, class_name=f"Layer{path.rsplit('.', 1)[-1]}")
    _keep_subtree(module, holder)
    return module, inputs, outputs


def _keep_subtree(module: nn.Module, original: nn.Module) -> None:
    """Everything under ``original`` stays reachable at its path in ``module``: what the
    layer's graph does not read (unused parameters, buffers), and what the root reads of the
    layer (DiT's final conditioning runs ``blocks[0].norm1.emb`` again). fx copies only the
    attributes a graph reads, into fresh containers; the rest is put back here."""
    for name, param in original.named_parameters(recurse=False):
        if name not in module._parameters:
            module.register_parameter(name, param)
    for name, buf in original.named_buffers(recurse=False):
        if name not in module._buffers:
            module.register_buffer(name, buf)
    for name, child in original.named_children():
        mine = module._modules.get(name)
        if mine is None:
            module.add_module(name, child)
        elif mine is not child:
            _keep_subtree(mine, child)


def _install(gm: fx.GraphModule, built: dict[str, fx.GraphModule]) -> None:
    """Put each layer at its path; a container of layers becomes an ``nn.ModuleList``."""
    for container_path in sorted({p.rsplit(".", 1)[0] for p in built}):
        container = gm.get_submodule(container_path)
        names = list(container._modules)
        entries = []
        for name in names:
            full = f"{container_path}.{name}"
            entries.append(built.get(full, container._modules[name]))
        if all(n.isdigit() for n in names) and \
                [int(n) for n in names] == list(range(len(names))):
            # ModuleList keeps a None entry as add_module does; its stub takes modules only
            replacement: nn.Module = nn.ModuleList(entries)  # type: ignore[arg-type]
        else:
            replacement = container
            for name, entry in zip(names, entries):
                replacement._modules[name] = entry
        parent_path, _, attr = container_path.rpartition(".")
        parent = gm.get_submodule(parent_path) if parent_path else gm
        parent._modules[attr] = replacement
