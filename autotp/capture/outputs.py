"""The model's own output containers, made known to torch's pytree so that export can flatten
them and the sharded module returns them whole.

torch.export flattens a forward's result with ``torch.utils._pytree``: tensors, tuples, lists,
dicts, namedtuples, and types registered with it (transformers registers its ``ModelOutput``).
A model that returns its own container (``return Output(logits=..., hidden=...)``) is refused
("not a known type"). While the model is traced, ``registered_outputs`` reads what its forward
returns and registers each unknown container inside it, nested ones included:

    a dataclass            its init fields (``pytree.register_dataclass``); unflattened by
                           calling the class with them, as the model built it
    a plain object         its ``__dict__`` in order, where it holds a tensor: made again by
                           ``object.__new__`` and the same attributes (``__init__`` is not run)

Namedtuples need nothing: pytree knows every one. A type pytree already knows is never
registered again, and a registration stays for the process: the sharded module's program
rebuilds the output from the same type. What is neither (an object with ``__slots__``, a
subclass of a builtin container) stays unknown, and export's own error says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Iterable, Iterator

import torch
from torch.utils import _pytree as pytree


@contextlib.contextmanager
def registered_outputs(model: torch.nn.Module) -> Iterator[None]:
    """While ``model`` is traced, register the containers its forward returns (a forward hook
    on the model: it runs before export flattens the result)."""
    def hook(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        register_containers(out)  # returns None: a hook's result would replace the output

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def register_containers(value: Any) -> list[type]:
    """Register every container in ``value`` that pytree does not know and can be made known
    (see the module docstring); returns the types registered now. A newly registered
    container's fields are searched in turn, until every leaf is known or left as it is."""
    added: list[type] = []
    while True:
        fresh = list(dict.fromkeys(type(leaf) for leaf in pytree.tree_leaves(value)
                                   if _registrable(leaf)))
        if not fresh:
            return added
        for cls in fresh:
            _register(cls)
        added += fresh


def _known(cls: type) -> bool:
    return cls in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(cls)


def _registrable(leaf: Any) -> bool:
    cls = type(leaf)
    if _known(cls) or issubclass(cls, (torch.Tensor, torch.nn.Module, type, enum.Enum)):
        return False
    if dataclasses.is_dataclass(cls):
        return True
    # a plain object only where it holds a tensor: an object of settings is no output
    return _plain_object(cls) and any(isinstance(x, torch.Tensor)
                                      for x in pytree.tree_leaves(list(vars(leaf).values())))


def _plain_object(cls: type) -> bool:
    """A class of the model's own code whose instances keep their fields in ``__dict__``:
    not a builtin (``int``, ``str``, a function), not a subclass of a builtin container, with
    no ``__slots__`` of its own (fields outside ``__dict__`` would be lost)."""
    if cls.__module__.split(".")[0] in ("builtins", "torch", "sympy", "numpy"):
        return False
    if issubclass(cls, (dict, list, tuple, set, frozenset, str, bytes, int, float, complex)):
        return False
    return all("__slots__" not in vars(base) for base in cls.__mro__[:-1]) and \
        "__dict__" in dir(cls)


def _register(cls: type[Any]) -> None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if dataclasses.is_dataclass(cls):
        pytree.register_dataclass(cls, serialized_type_name=name)
        return

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
        fields = vars(obj)
        return list(fields.values()), tuple(fields)

    def unflatten(values: Iterable[Any], names: tuple[str, ...]) -> Any:
        obj = object.__new__(cls)
        obj.__dict__.update(zip(names, values))
        return obj

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        values, names = flatten(obj)
        return [(pytree.GetAttrKey(k), v) for k, v in zip(names, values)], names

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=name,
                                flatten_with_keys_fn=flatten_with_keys)


def loss_fields(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Output node name -> the field it is of the mapping a call that computes a loss returns
    (a transformers ``ModelOutput``, a dict): the tensors that may leave the program in the
    layout they are computed in and be gathered when read (``autotp.runtime.outputs``). A
    call computes a loss where a field of its mapping is a floating 0-dim tensor. Empty
    where the output is no mapping or holds no loss; a node that is also returned elsewhere
    (inside a nested field) is left out."""
    spec = getattr(gm.graph._codegen, "pytree_info", None)
    spec = spec.out_spec if spec is not None else None
    if spec is None or not isinstance(spec.type, type) or not issubclass(spec.type, dict):
        return {}
    (leaves,) = next(n for n in gm.graph.nodes if n.op == "output").args
    fields: dict[str, str] = {}
    nested: set[str] = set()
    start, loss = 0, False
    for key, child in zip(spec.context, spec.children()):
        if child.is_leaf():
            leaf = leaves[start]
            val = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
                loss = True
            elif isinstance(val, torch.Tensor) and isinstance(key, str):
                fields.setdefault(leaf.name, key)
        else:
            nested.update(n.name for n in leaves[start:start + child.num_leaves]
                          if isinstance(n, torch.fx.Node))
        start += child.num_leaves
    return {name: key for name, key in fields.items() if name not in nested} if loss else {}
