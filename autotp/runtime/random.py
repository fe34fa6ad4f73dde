"""Randomness under tensor parallelism (Megatron's RNG tracker idea).

Two random streams per rank:

* ``replicated``: seeded identically on every rank and advanced by the same sequence of
  draws, so dropout on a replicated value draws the same mask everywhere and the value stays
  replicated (its gradient stays identical across ranks);
* ``sharded``: seeded differently on every rank, so each shard of a sharded value draws its
  own part of one independent mask, as the unsharded model would over the whole tensor.

Dropout in the traced program is rewritten to use the stream its layout asks for; the global
torch generator is left alone (in a simulation all ranks share it, across threads).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import torch
from torch import nn


class Stream(enum.Enum):
    REPLICATED = "replicated"
    SHARDED = "sharded"


class RngTracker:
    def __init__(self, seed: int, rank: int):
        self.seed = int(seed)
        self.rank = rank
        self._generators: dict[tuple[Stream, str], torch.Generator] = {}
        self._draws: dict[Stream, int] = {}

    def generator(self, stream: Stream, device: torch.device) -> torch.Generator:
        key = (stream, str(device))
        if key not in self._generators:
            generator = torch.Generator(device=device)
            offset = 0 if stream is Stream.REPLICATED else 2_654_435_761 * (self.rank + 1)
            generator.manual_seed((self.seed + offset) % (2**63))
            self._generators[key] = generator
        return self._generators[key]

    def next_seed(self, stream: Stream) -> int:
        """A seed for one kernel that draws from the global generator (attention dropout):
        the stream's n-th, counted on the host, so that no value comes back from the device
        (the same on every rank for the replicated stream, this rank's own for the sharded)."""
        draw = self._draws.get(stream, 0)
        self._draws[stream] = draw + 1
        offset = 0 if stream is Stream.REPLICATED else 2_654_435_761 * (self.rank + 1)
        # splitmix64 of (stream seed, draw): neighbouring draws give unrelated seeds
        z = (self.seed + offset + 0x9E3779B97F4A7C15 * (draw + 1)) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return (z ^ (z >> 31)) % 2**62


class _Tracked(nn.Module):
    """A random op of the traced program, drawing from one stream of the tracker."""

    def __init__(self, tracker: RngTracker, stream: Stream):
        super().__init__()
        self.tracker = tracker
        self.stream = stream

    def extra_repr(self) -> str:
        return f"stream={self.stream.value}"


class TrackedDropout(_Tracked):
    """``aten.dropout(x, p, train)`` drawing its mask from the stream."""

    def forward(self, x: torch.Tensor, p: float, train: Any) -> torch.Tensor:
        if not train or p == 0.0:  # traced where compiled: no draw, no break
            return x
        if p == 1.0:
            return x * 0.0
        return self._draw(x, p)

    # a torch.Generator is no graph's: a compiled program breaks where a mask is drawn
    @torch.compiler.disable
    def _draw(self, x: torch.Tensor, p: float) -> torch.Tensor:
        generator = self.tracker.generator(self.stream, x.device)
        keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
        return x * keep * (1.0 / (1.0 - p))


class TrackedAttention(_Tracked):
    """``scaled_dot_product_attention`` with ``dropout_p > 0``: the kernel draws from the
    global generator, so the call runs on a forked global state seeded by the tracker's
    stream (``RngTracker.next_seed``: no host synchronization; a lock keeps simulated ranks,
    which share the global state, apart)."""

    _lock = threading.Lock()

    @torch.compiler.disable  # the global generator forked and seeded: no graph's
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        q = args[0]
        seed = self.tracker.next_seed(self.stream)
        devices = [q.device] if q.device.type == "cuda" else []
        with self._lock, torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)
