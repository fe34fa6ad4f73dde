"""Outputs gathered when read: what a call that computes a loss returns.

Where the call computes a loss (``Plan.gathered_when_read``: a field of the mapping it returns
is a floating 0-dim tensor), the fields the plan holds sharded (the logits, over the
vocabulary) leave the rank program as this rank's shard, and the mapping returned (a
transformers ``ModelOutput``, a dict) gathers each the first time it is read:

    out.logits, out["logits"], out.get("logits")     that field
    out[1], out[0:2] (a ModelOutput's positions)     the fields at those positions
    out.to_tuple(), values(), items(), copy(),       every field
    dict(out), {**out}, pytree flattening

The gather is the program's own redistribution (``Redistribute``: all-gather forward, this
rank's slice of the gradient backward), so a loss computed from the gathered tensor
back-propagates as through the program's. Once read, the field holds the whole tensor. Reading
a field is a collective, as every step of the rank program is: every rank of the group reads
it, or none does. ``repr`` shows a field not read yet without reading it.

Megatron-LM and torchtitan never gather the logits a vocabulary-parallel loss reads: a training
loop that reads only ``out.loss`` pays nothing for them here either.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch.utils import _pytree as pytree

from autotp.layout import Replicate, parse_layout
from autotp.runtime.collectives import Redistribute
from autotp.runtime.comm import CollectiveError, Communicator

_PENDING = "_autotp_pending"  # field -> its gather, on each instance
_NOTHING: dict[str, Callable[[], torch.Tensor]] = {}


def _pending(obj: Any) -> dict[str, Callable[[], torch.Tensor]]:
    return object.__getattribute__(obj, "__dict__").get(_PENDING, _NOTHING)


class GatheredWhenRead:
    """The base of an output mapping whose pending fields are gathered when first read
    (``gathered_when_read``); the class of one is made per mapping type (``_lazy_class``)."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        # a field that is also an attribute (a ModelOutput's; a dict's keys are none)
        if name in _pending(self) and name in object.__getattribute__(self, "__dict__"):
            self._read((name,))
        return super().__getattribute__(name)

    def __getitem__(self, key: Any) -> Any:
        held: dict = self  # type: ignore[assignment]
        if isinstance(key, str):
            self._read((key,))
            if dict.__contains__(held, key):  # the mapping's own lookup may read every field
                return dict.__getitem__(held, key)
        elif hasattr(self, "to_tuple"):  # a ModelOutput's positions
            names = list(held.keys())[key]
            self._read([names] if isinstance(names, str) else names)
            return tuple(dict.__getitem__(held, name) for name in held.keys())[key]
        return super().__getitem__(key)  # type: ignore[misc]

    def get(self, key: Any, default: Any = None) -> Any:
        self._read((key,))
        return super().get(key, default)  # type: ignore[misc]

    def values(self) -> Any:
        self._read(list(_pending(self)))
        return super().values()  # type: ignore[misc]

    def items(self) -> Any:
        self._read(list(_pending(self)))
        return super().items()  # type: ignore[misc]

    def copy(self) -> Any:
        self._read(list(_pending(self)))
        return super().copy()  # type: ignore[misc]

    def __iter__(self) -> Iterator[Any]:
        # overridden so that dict(out) and {**out} read through keys() and __getitem__ (a
        # dict whose __iter__ is dict's own is copied by CPython without either)
        return super().__iter__()  # type: ignore[misc]

    def __repr__(self) -> str:
        pending, held = _pending(self), dict(super().items())  # type: ignore[misc]
        fields = ", ".join(f"{k}=<{k}: sharded, gathered when read>" if k in pending else
                           f"{k}={v!r}" for k, v in held.items())
        return f"{type(self).__name__}({fields})"

    def _read(self, names: Iterable[Any]) -> None:
        pending = _pending(self)
        for name in names:
            gather = pending.get(name) if isinstance(name, str) else None
            if gather is None:
                continue
            full = gather()
            super().__setitem__(name, full)  # type: ignore[misc]
            if name in object.__getattribute__(self, "__dict__"):  # a field that is an attribute
                object.__setattr__(self, name, full)
            del pending[name]


_CLASSES: dict[type, type] = {}


def _lazy_class(base: type) -> type:
    """``base`` (a dict type) whose pending fields are gathered when read: made once per
    type, known to pytree as ``base`` is (flattening reads ``values()``: every field)."""
    found = _CLASSES.get(base)
    if found is None:
        found = type(base.__name__, (GatheredWhenRead, base), {
            "__module__": f"{__name__}.{base.__module__}",
            "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        known = pytree.SUPPORTED_NODES.get(base)
        if found not in pytree.SUPPORTED_NODES and known is not None:
            pytree.register_pytree_node(
                found, known.flatten_fn, known.unflatten_fn,
                serialized_type_name=f"{found.__module__}.{found.__qualname__}",
                flatten_with_keys_fn=known.flatten_with_keys_fn)
        _CLASSES[base] = found
    return found


def gathered_when_read(out: Any, fields: Mapping[str, str], comm: Communicator) -> Any:
    """``out``, the mapping a rank program returned, with ``fields`` (field -> the layout its
    shard is in) gathered when first read."""
    if not isinstance(out, dict):
        return out
    pending = {name: _gather(name, out[name], parse_layout(text), comm)
               for name, text in fields.items() if isinstance(dict.get(out, name), torch.Tensor)}
    cls = _lazy_class(type(out))
    try:
        out.__class__ = cls  # a ModelOutput: the same object, its fields kept
        lazy = out
    except TypeError:  # a builtin dict or OrderedDict
        lazy = cls(out)
    object.__setattr__(lazy, _PENDING, pending)
    return lazy


def _gather(name: str, shard: torch.Tensor, layout: Any, comm: Communicator
            ) -> Callable[[], torch.Tensor]:
    module = Redistribute(comm, layout, Replicate(), layer=None, bwd_layer=None,
                          label=f"{name} {layout}->R, read")

    def gather() -> torch.Tensor:
        # with the gradient the program's output would have had, wherever it is read
        with torch.enable_grad() if shard.requires_grad else contextlib.nullcontext():
            try:
                return module(shard)
            except RuntimeError as exc:
                raise CollectiveError(
                    f"out.{name} is gathered when read: read it on every rank, or pass "
                    f"gather_outputs=\"always\" to gather it in the forward "
                    f"(rank {comm.rank}: {exc})") from exc
    return gather
