"""Repeated layers: trace a few, stamp the rest.

A transformer is mostly one block repeated (LLaMA-2-70B's 80 identical layers), and the cost
of torch.export grows with every one of them. Before tracing, the entries of each outermost
``nn.ModuleList`` / ``nn.Sequential`` are grouped by a structural signature (``signature``:
the class of every submodule, parameter and buffer shapes, dtypes and trainability, plain
attributes, no hooks, no forward set on the instance). The model is exported with the list
cut to the shortest prefix that holds every (previous group, group) pair of the list at
least twice and ends in the last entry's group (``Stack.prefix``). ``unroll`` then copies,
for every entry past the prefix, the nodes of a traced entry with the same pair, reading
its own parameters and its predecessor's nodes.

Invariant: the unrolled program is the program a full export gives: the same ops in the
same order, the same node names, the same module paths on every node. It is checked, not
assumed (``_template_of`` and ``_regions``): every traced entry of a pair is the same
program as the one copied (ops, constants, parameter names, and what it reads from outside
itself: its predecessor's nodes by position, or the very same outside node), the entries
are contiguous in the graph, and what follows the list reads only its last entry. A failed
check makes the caller export the whole model.

What the check cannot see: a forward that branches on its own index in the list at an
index past the prefix (``if self.layer_idx == 40``). ``AUTOTP_TRACE_EVERY_LAYER=1`` exports
every layer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Optional

import torch
import torch.fx as fx

from autotp.ops import path_attr

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
_CALLS = ("call_function", "call_method", "call_module")
_LIFTED = re.compile(r"^(.*?)(lifted_tensor_|_tensor_constant)(\d+)$")


class Mismatch(Exception):
    """The traced entries do not prove the rest: export the whole model."""


@dataclass(frozen=True)
class Stack:
    """One list of layers: ``groups[i]`` is entry i's signature group; entries before
    ``prefix`` are traced, entry ``i >= prefix`` is a copy of ``template[i]``."""

    path: str
    groups: tuple[int, ...]
    prefix: int

    @property
    def length(self) -> int:
        return len(self.groups)

    def pair(self, index: int) -> tuple[int, int]:
        return self.groups[index - 1], self.groups[index]

    def traced_with(self, index: int) -> list[int]:
        """The traced entries (past the first) with entry ``index``'s pair."""
        return [j for j in range(1, self.prefix) if self.pair(j) == self.pair(index)]

    def entry(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)


def every_layer() -> bool:
    return os.environ.get("AUTOTP_TRACE_EVERY_LAYER", "") not in ("", "0")


def find_stacks(model: torch.nn.Module) -> list[Stack]:
    """The outermost lists of layers that can be traced in part."""
    stacks: list[Stack] = []
    for path, module in model.named_modules():
        if any(path == s.path or path.startswith(f"{s.path}.") or not s.path
               for s in stacks):
            continue
        if not _is_list(module) or len(module) < 4:
            continue
        entries = [_signature(entry) for entry in module]
        indexes = _index_attributes(entries)
        keys: dict[Hashable, int] = {}
        groups = tuple(keys.setdefault(_without(entry, indexes), len(keys))
                       for entry in entries)
        prefix = _shortest_prefix(groups)
        if prefix < len(groups):
            stacks.append(Stack(path, groups, prefix))
    return stacks


def _is_list(module: torch.nn.Module) -> bool:
    if type(module) is torch.nn.ModuleList:
        return True
    return (isinstance(module, torch.nn.Sequential)
            and type(module).forward is torch.nn.Sequential.forward)


def _shortest_prefix(groups: tuple[int, ...]) -> int:
    """The fewest leading entries such that every later entry's (previous group, group) pair
    occurs at least twice among them (one to copy, one to check it against) and the last
    traced entry is of the last entry's group (what follows the list reads it)."""
    n = len(groups)
    pairs = [(groups[i - 1], groups[i]) for i in range(1, n)]
    for prefix in range(3, n):
        seen = collections.Counter(pairs[:prefix - 1])
        if groups[prefix - 1] == groups[-1] and all(
                seen[pair] >= 2 for pair in pairs[prefix - 1:]):
            return prefix
    return n


Signature = dict[tuple[str, str], Any]


def _signature(layer: Optional[torch.nn.Module]) -> Signature:
    """What two entries of a list must share to be one program: every submodule's class,
    parameters (shape, dtype, trainable), buffers and plain attributes. A hook or a forward
    set on an instance makes the entry unlike any other."""
    parts: Signature = {}
    if layer is None:  # a ModuleList may hold None (x-transformers' absent norms)
        return {("", "class"): None}
    for name, module in layer.named_modules(remove_duplicate=False):
        if any(getattr(module, hooks, None) for hooks in _HOOKS) or "forward" in vars(module):
            parts[(name, "unique")] = object()
        parts[(name, "class")] = type(module)
        parts[(name, "params")] = tuple(
            (key, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad,
                                          p.device.type))
            for key, p in module._parameters.items())
        parts[(name, "buffers")] = tuple(
            (key, None if b is None else (tuple(b.shape), b.dtype))
            for key, b in module._buffers.items())
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS:
                parts[(name, key)] = _value(value)
    return parts


def _index_attributes(entries: list[Signature]) -> set[tuple[str, str]]:
    """Attributes that hold the entry's own index in every entry (``layer_idx``)."""
    keys = set.intersection(*(set(entry) for entry in entries))
    return {key for key in keys
            if all(entry[key] == (int, index) for index, entry in enumerate(entries))}


def _without(entry: Signature, indexes: set[tuple[str, str]]) -> Hashable:
    return tuple(sorted(((k, v) for k, v in entry.items() if k not in indexes),
                        key=lambda item: item[0]))


def _value(value: Any) -> Hashable:
    if value is None or isinstance(value, (bool, float, str, complex, torch.dtype,
                                           torch.device)):
        return (type(value), repr(value))
    if isinstance(value, int):
        return (int, value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((repr(k), _value(v)) for k, v in value.items()))
    if isinstance(value, functools.partial):  # an activation: gelu with approximate="tanh"
        return (functools.partial, _value(value.func), _value(value.args),
                _value(value.keywords))
    return ("object", id(value))  # shared objects (a config) match; per-entry ones do not


@contextlib.contextmanager
def truncated(model: torch.nn.Module, stacks: list[Stack]) -> Iterator[None]:
    """Each list cut to its traced prefix (the same module objects), restored after. A
    forward that reads a cut list's length (``len(self.layers)``, ``self.layers[-1]``)
    would see the prefix's: that raises ``Mismatch`` once the body is done."""
    saved = []
    for stack in stacks:
        module = model.get_submodule(stack.path)
        saved.append((module, module._modules, type(module)))
        kept = list(module._modules.items())[:stack.prefix]
        module.__dict__["_modules"] = collections.OrderedDict(kept)
        module.__class__ = _length_watched(type(module))  # type: ignore[arg-type]
    try:
        yield
    finally:
        read = [stack.path for stack, (module, _, _) in zip(stacks, saved)
                if module.__dict__.pop("_autotp_length_read", False)]
        for module, modules, cls in saved:
            module.__dict__["_modules"] = modules
            module.__class__ = cls
    if read:
        raise Mismatch(f"the forward reads the length of {', '.join(read)}")


@functools.lru_cache(maxsize=None)
def _length_watched(cls: Any) -> type:
    def length(self: torch.nn.Module) -> int:
        self.__dict__["_autotp_length_read"] = True
        return cls.__len__(self)  # type: ignore[attr-defined]

    return type(cls.__name__, (cls,), {"__len__": length, "__module__": cls.__module__})


def unroll(gm: fx.GraphModule, model: torch.nn.Module, stacks: list[Stack]) -> None:
    """``gm``, traced with ``stacks`` cut to their prefixes, -> the program of the whole
    ``model``; raises ``Mismatch`` (leaving ``gm`` as it was) when the traced entries do not
    prove the copies."""
    for stack in stacks:
        _unroll_stack(gm, model, stack)


def _unroll_stack(gm: fx.GraphModule, model: torch.nn.Module, stack: Stack) -> None:
    graph = gm.graph
    regions, after = _regions(graph, stack)
    programs: dict[int, tuple[Any, ...]] = {}
    templates = {i: _template_of(gm, stack, i, regions, programs)
                 for i in range(stack.prefix, stack.length)}
    last = stack.prefix - 1
    new = fx.Graph()
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    stamped: dict[int, list[fx.Node]] = {}
    last_entry = {n: pos for pos, n in enumerate(regions[last])}

    def read_last(arg: fx.Node) -> fx.Node:  # after the list, its last entry is the model's
        if arg in last_entry:
            return stamped[stack.length - 1][last_entry[arg]]
        return env[arg]

    # export puts every parameter's get_attr first, entry by entry, then every buffer's: the
    # copies' go after the last traced entry's of each kind
    attrs = {j: [n for n in graph.nodes if n.op == "get_attr"
                 and str(n.target).startswith(f"{stack.entry(j)}.")] for j in range(stack.prefix)}

    is_param = {n: isinstance(path_attr(gm, str(n.target)), torch.nn.Parameter)
                for nodes in attrs.values() for n in nodes}
    ends = {kind: [n for n in attrs[last] if is_param[n] == kind][-1:] for kind in (True, False)}
    placed: dict[tuple[int, fx.Node], fx.Node] = {}
    past = False
    for node in graph.nodes:
        if node is after:
            past = True
            for index in range(stack.prefix, stack.length):
                stamped[index] = _stamp(new, gm, model, stack, index, templates[index],
                                        regions, stamped, env, placed)
        env[node] = (_copy(new, node, read_last, rename=True) if past
                     else new.node_copy(node, env.__getitem__))
        for kind, end in ends.items():
            if end and node is end[0]:
                for index in range(stack.prefix, stack.length):
                    for attr in attrs[templates[index]]:
                        if is_param[attr] == kind:
                            placed[(index, attr)] = _stamp_attr(new, gm, model, stack, index,
                                                                templates[index], attr)
    new.lint()
    gm.graph = new


def _regions(graph: fx.Graph, stack: Stack) -> tuple[list[list[fx.Node]], Optional[fx.Node]]:
    """The call nodes of each traced entry, in order, and the first node after the list;
    the entries must follow one another with nothing between them, and nothing after the
    list may read any entry but the last."""
    regions: list[list[fx.Node]] = [[] for _ in range(stack.prefix)]
    order: list[Optional[int]] = []
    # export's input guards carry the module path of the first op; they belong to no entry
    calls = [n for n in graph.nodes if n.op in _CALLS and n.target != "_guards_fn"]
    for node in calls:
        index = _entry_of(node, stack)
        if index is not None:
            regions[index].append(node)
        order.append(index)
    if any(not region for region in regions):
        raise Mismatch(f"an entry of {stack.path} has no ops")
    inside = [pos for pos, index in enumerate(order) if index is not None]
    first, end = inside[0], inside[-1]
    run = order[first:end + 1]
    if None in run or run != sorted(run):  # type: ignore[type-var]
        raise Mismatch(f"ops outside {stack.path} run between its entries")
    after = calls[end + 1] if end + 1 < len(calls) else _output(graph)
    inner = {n for region in regions[1:-1] for n in region}  # neither first nor last
    for node in calls[end + 1:] + [_output(graph)]:
        if any(arg in inner for arg in node.all_input_nodes):
            raise Mismatch(f"{node.format_node()} reads an inner entry of {stack.path}")
    return regions, after


def _output(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "output")


def _entry_of(node: fx.Node, stack: Stack) -> Optional[int]:
    prefix = f"{stack.path}." if stack.path else ""
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        path = str(path)
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _template_of(gm: fx.GraphModule, stack: Stack, index: int, regions: list[list[fx.Node]],
                 programs: dict[int, tuple[Any, ...]]) -> int:
    """The traced entry that entry ``index`` copies, after checking that every traced entry
    of its pair is the same program."""
    for j in stack.traced_with(index):
        if j not in programs:
            programs[j] = _program(gm, stack, j, regions)
    traced = stack.traced_with(index)
    template = traced[-1]
    shape = programs[template]
    for other in traced[:-1]:
        theirs = programs[other]
        if theirs != shape:
            at = next((pos for pos, (a, b) in enumerate(zip(theirs, shape)) if a != b),
                      min(len(theirs), len(shape)))
            where = (f": {regions[other][at].format_node()} against "
                     f"{regions[template][at].format_node()}"
                     if at < min(len(theirs), len(shape)) else ": not as many ops")
            raise Mismatch(f"{stack.entry(other)} and {stack.entry(template)} trace to "
                           f"different programs{where}")
    return template


def _program(gm: fx.GraphModule, stack: Stack, index: int,
             regions: list[list[fx.Node]]) -> tuple[Any, ...]:
    own = {n: pos for pos, n in enumerate(regions[index])}
    prev = _from_end(regions[index - 1])
    mine, theirs = f"{stack.entry(index)}.", f"{stack.entry(index - 1)}."

    def key(arg: Any) -> Hashable:
        if isinstance(arg, fx.Node):
            if arg in own:
                return ("own", own[arg])
            if _symbolic(arg):
                return ("outside", arg)
            if arg in prev:
                return ("prev", prev[arg])
            if arg.op == "get_attr" and str(arg.target).startswith(mine):
                suffix = str(arg.target)[len(mine):]
                lifted = _LIFTED.match(suffix)
                if lifted:  # numbered by export in order: the same value, another number
                    return ("constant", lifted.group(1),
                            _constant_key(path_attr(gm, str(arg.target))))
                return ("param", suffix)
            if arg.op == "get_attr" and str(arg.target).startswith(theirs):
                raise Mismatch(f"{stack.entry(index)} reads its predecessor's parameters")
            return ("outside", arg)
        if isinstance(arg, (tuple, list)):
            return (type(arg), tuple(key(a) for a in arg))
        if isinstance(arg, dict):
            return (dict, tuple((k, key(v)) for k, v in arg.items()))
        return (type(arg), repr(arg))

    return tuple((n.op, _base(n.name), repr(n.target), key(n.args), key(n.kwargs))
                 for n in regions[index])


def _constant_key(tensor: Any) -> Hashable:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" \
            or tensor.numel() > 4096:
        return ("object", id(tensor))
    return (tuple(tensor.shape), tensor.dtype, tuple(tensor.flatten().tolist()))


def _symbolic(node: fx.Node) -> bool:
    """A size (``B * heads``): export computes it once, where first needed, and every later
    entry reads that one node."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt, torch.SymFloat, torch.SymBool))


def _from_end(region: list[fx.Node]) -> dict[fx.Node, int]:
    """Positions counted from the entry's end (-1 its last op): what an entry reads of its
    predecessor is its output, at the end, while the first entry may also hold ops that the
    model runs on its first call alone."""
    return {n: pos - len(region) for pos, n in enumerate(region)}


def _stamp(new: fx.Graph, gm: fx.GraphModule, model: torch.nn.Module, stack: Stack,
           index: int, template: int, regions: list[list[fx.Node]],
           stamped: dict[int, list[fx.Node]], env: dict[fx.Node, fx.Node],
           placed: dict[tuple[int, fx.Node], fx.Node]) -> list[fx.Node]:
    """Entry ``index`` as a copy of traced entry ``template``: its own parameters, its
    predecessor's nodes where the template reads its predecessor's."""
    source = regions[template]
    own = {n: pos for pos, n in enumerate(source)}
    prev = _from_end(regions[template - 1])
    before = stamped.get(index - 1) or [env[n] for n in regions[index - 1]]
    read_back = -min(prev.values(), default=0)  # how far back from its end
    if read_back and ([_op(n) for n in before[-read_back:]]
                      != [_op(n) for n in regions[template - 1][-read_back:]]):
        raise Mismatch(f"{stack.entry(index - 1)} differs from {stack.entry(template - 1)}")
    mine = f"{stack.entry(template)}."
    copies: list[fx.Node] = []

    def read(arg: fx.Node) -> fx.Node:
        if arg in own:
            return copies[own[arg]]
        if _symbolic(arg):
            return env[arg]
        if arg in prev:
            return before[prev[arg]]
        if arg.op == "get_attr" and str(arg.target).startswith(mine):
            if (index, arg) not in placed:
                placed[(index, arg)] = _stamp_attr(new, gm, model, stack, index, template, arg)
            return placed[(index, arg)]
        return env[arg]

    moved: dict[Any, dict[str, Any]] = {}  # the ops of one module share their stack
    for node in source:
        copy = _copy(new, node, read, rename=True)
        modules = node.meta.get("nn_module_stack") or {}
        key = tuple(modules)
        if key not in moved:
            moved[key] = {
                _moved(name, stack, template, index): (_moved(path, stack, template, index), cls)
                for name, (path, cls) in modules.items()}
        copy.meta["nn_module_stack"] = dict(moved[key])
        copies.append(copy)
    return copies


def _stamp_attr(new: fx.Graph, gm: fx.GraphModule, model: torch.nn.Module, stack: Stack,
                index: int, template: int, attr: fx.Node) -> fx.Node:
    """Entry ``index``'s own tensor where ``template`` reads ``attr``: the model's, or for a
    constant export lifted out of the code (``lifted_tensor_3``), the template's under the
    next number."""
    suffix = str(attr.target)[len(stack.entry(template)) + 1:]
    like = path_attr(gm, str(attr.target))
    lifted = _LIFTED.match(suffix)
    if lifted:
        number = 1 + max(int(m.group(3)) for m in map(_LIFTED.match, _targets(gm)) if m)
        target = f"{stack.entry(index)}.{lifted.group(1)}{lifted.group(2)}{number}"
        tensor = like
    else:
        target = f"{stack.entry(index)}.{suffix}"
        tensor = path_attr(model, target)
        if not isinstance(tensor, torch.nn.Parameter) and tensor.device != like.device:
            tensor = tensor.to(like.device)  # buffers of a meta model trace on meta
    attach(gm, target, tensor, str(attr.target))
    node = new.get_attr(target)
    node.meta = dict(attr.meta)
    return node


def _targets(gm: fx.GraphModule) -> Iterator[str]:
    for name, _ in gm.named_buffers():
        yield name
    for name, value in gm.named_modules():
        for key, attr in vars(value).items():
            if isinstance(attr, torch.Tensor):
                yield f"{name}.{key}" if name else key


def _op(node: fx.Node) -> tuple[str, str]:
    return node.op, repr(node.target)


def _copy(new: fx.Graph, node: fx.Node, read: Any, rename: bool) -> fx.Node:
    copy = new.create_node(node.op, node.target, fx.map_arg(node.args, read),
                           fx.map_arg(node.kwargs, read),
                           _base(node.name) if rename else node.name, node.type)
    copy.meta = dict(node.meta)
    return copy


def _base(name: str) -> str:
    """``linear_12`` -> ``linear``: the graph numbers it in order, as export did."""
    match = _SUFFIX.match(name)
    return match.group(1) if match else name


def _moved(path: str, stack: Stack, template: int, index: int) -> str:
    old, new = stack.entry(template), stack.entry(index)
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?=$|\.)", new, str(path).replace(
        f"L__self__{old}", f"L__self__{new}"))


def attach(gm: fx.GraphModule, target: str, tensor: torch.Tensor, like: str) -> None:
    """``tensor`` as the program's ``target``, held the way ``like`` is (parameter, buffer
    or plain attribute)."""
    def owner_of(path: str, create: bool) -> tuple[torch.nn.Module, str]:
        *parents, name = path.split(".")
        owner: torch.nn.Module = gm
        for part in parents:
            child = owner._modules.get(part)
            if child is None:
                if not create:
                    return owner, ""
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner, name

    source, source_name = owner_of(like, create=False)
    owner, name = owner_of(target, create=True)
    if isinstance(tensor, torch.nn.Parameter):
        owner.register_parameter(name, tensor)
    elif source_name in source._buffers:
        owner.register_buffer(name, tensor,
                              persistent=source_name not in source._non_persistent_buffers_set)
    else:
        setattr(owner, name, tensor)
