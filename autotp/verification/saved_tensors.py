"""What autograd keeps for backward, measured: the count ``autotp estimate``'s activation
memory (``autotp.planner.job.profile``, ``autotp.planner.job.memory``) stands for.

Invariant: inside ``count_saved()`` every tensor autograd saves goes through one hook pair,
and its storage is counted once, however many tensors or views of it are saved (a saved view
keeps its whole base alive), with the bytes of the whole storage. The storages of the
``exclude`` tensors are never counted: a product saves its weight, but a module's parameters
are model states, not activations. Storages are held by weak reference until the count is
dropped, so no address freed during the forward is taken for a later storage's.

    with count_saved(exclude=model.parameters()) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    saved.nbytes  # the activation bytes of one training forward, on this rank

Saved-tensor hooks nest, and autograd calls only the innermost pair: set this one around the
whole call. autotp's own pair (``autotp.runtime.regather``) hands on what it really keeps (a
gathered input's sequence shard). A non-reentrant checkpoint's pair keeps nothing and
recomputes its layer, which keeps its inputs: add those with ``saved.add``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedTensors:
    """The storages counted so far, each once, with its bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        self._bytes: dict[StorageWeakRef, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (a second time changes nothing; an excluded one is
        never counted)."""
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in self._excluded:
            self._bytes[key] = storage.nbytes()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is counted."""
        return StorageWeakRef(tensor.untyped_storage()) in self._bytes

    @property
    def storages(self) -> frozenset[StorageWeakRef]:
        return frozenset(self._bytes)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def __len__(self) -> int:
        return len(self._bytes)


@contextlib.contextmanager
def count_saved(*, exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensors]:
    """Count every storage autograd saves for backward inside the block, but those of
    ``exclude`` (see the module docstring)."""
    saved = SavedTensors(exclude)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor)
        # an alias, not the tensor: a saved output kept as itself would hold its own grad_fn
        return tensor.detach()

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield saved
