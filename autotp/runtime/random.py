"""Randomness under tensor parallelism (Megatron's RNG tracker idea).

Two random streams per rank:

* ``replicated``: seeded identically on every rank and advanced by the same sequence of
  draws, so dropout on a replicated value draws the same mask everywhere and the value stays
  replicated (its gradient stays identical across ranks);
* ``sharded``: seeded differently on every rank, so each shard of a sharded value draws its
  own part of one independent mask, as the unsharded model would over the whole tensor.

Dropout in the traced program is rewritten to use the stream its layout asks for; the global
torch generator is left alone (in a simulation all ranks share it, across threads).

Under torch.compile each draw is a custom op (``autotp::tracked_keep``,
``autotp::tracked_attention``): a graph holds no ``torch.Generator`` and cannot fork the
global one, so the op, opaque to dynamo, finds its tracker by handle and draws at run time
exactly what the eager module draws; the compiled rank program stays one graph.
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch._library.effects import EffectType


class Stream(enum.Enum):
    REPLICATED = "replicated"
    SHARDED = "sharded"


# The trackers by handle: a custom op takes ints and strings, not the tracker itself.
_TRACKERS: "weakref.WeakValueDictionary[int, RngTracker]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class RngTracker:
    def __init__(self, seed: int, rank: int):
        self.seed = int(seed)
        self.rank = rank
        self._generators: dict[tuple[Stream, str], torch.Generator] = {}
        self._draws: dict[Stream, int] = {}
        self._register()

    def _register(self) -> None:
        self.handle = next(_HANDLES)  # what a compiled program's draws name it by
        _TRACKERS[self.handle] = self

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy is a tracker of its own
        self.__dict__.update(state)
        self._register()

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
        if not train or p == 0.0:  # no draw
            return x
        if p == 1.0:
            return x * 0.0
        if torch.compiler.is_compiling():  # the mask an op of the graph, drawn at run time
            keep = torch.ops.autotp.tracked_keep(x.detach(), p, self.tracker.handle,
                                                 self.stream.value)
        else:
            keep = _keep(self.tracker, self.stream, x, p)
        return x * keep * (1.0 / (1.0 - p))


class TrackedAttention(_Tracked):
    """``scaled_dot_product_attention`` with ``dropout_p > 0``: the kernel draws from the
    global generator, so the call runs on a forked global state seeded by the tracker's
    stream (``RngTracker.next_seed``: no host synchronization; a lock keeps simulated ranks,
    which share the global state, apart)."""

    _lock = threading.Lock()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.compiler.is_compiling():
            call = _attention_args(*args, **kwargs)
            mask = call[3]
            # an op of the graph; its backward computes the attention again on the same seed
            # (it gives a mask no gradient: a mask that needs one is left to the eager call)
            if mask is None or not mask.requires_grad:
                out, _seed = torch.ops.autotp.tracked_attention(*call, self.tracker.handle,
                                                                self.stream.value)
                return out
        return self._eager(*args, **kwargs)

    @torch.compiler.disable  # the global generator forked and seeded: no graph's
    def _eager(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _seeded_attention(self.tracker.next_seed(self.stream), *args, **kwargs)


def _keep(tracker: RngTracker, stream: Stream, like: torch.Tensor, p: float) -> torch.Tensor:
    """A dropout's keep mask (1 kept, 0 dropped) laid out as ``like``, from the stream."""
    generator = tracker.generator(stream, like.device)
    return torch.empty_like(like).bernoulli_(1.0 - p, generator=generator)


def _seeded_attention(seed: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` on the global generator forked and seeded."""
    q = args[0]
    devices = [q.device] if q.device.type == "cuda" else []
    with TrackedAttention._lock, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)


def _attention_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                    is_causal: bool = False, *, scale: Optional[float] = None,
                    enable_gqa: bool = False) -> tuple[Any, ...]:
    """An attention call's arguments in the order of ``autotp::tracked_attention``."""
    return (query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale,
            bool(enable_gqa))


# ---- the draws as custom ops, for torch.compile ------------------------------------------------


@torch.library.custom_op("autotp::tracked_keep", mutates_args=())
def tracked_keep(like: torch.Tensor, p: float, tracker: int, stream: str) -> torch.Tensor:
    """``TrackedDropout``'s keep mask for ``like``, drawn from tracker ``tracker``'s stream."""
    return _keep(_TRACKERS[tracker], Stream(stream), like, p)


@tracked_keep.register_fake
def _(like: torch.Tensor, p: float, tracker: int, stream: str) -> torch.Tensor:
    return torch.empty_like(like)


@torch.library.custom_op("autotp::tracked_attention", mutates_args=())
def tracked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                      scale: Optional[float], enable_gqa: bool, tracker: int,
                      stream: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``TrackedAttention``: the attention on the stream's next seed, and that seed (an
    int64 on the host, for the backward)."""
    seed = _TRACKERS[tracker].next_seed(Stream(stream))
    out = _seeded_attention(seed, query, key, value, attn_mask, dropout_p, is_causal,
                            scale=scale, enable_gqa=enable_gqa)
    return out.contiguous(), torch.tensor(seed, dtype=torch.int64)


@tracked_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
      attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
      scale: Optional[float], enable_gqa: bool, tracker: int,
      stream: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # (B, hq, T, dv)
    return out, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("autotp::tracked_attention_backward", mutates_args=())
def tracked_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                               dropout_p: float, is_causal: bool, scale: Optional[float],
                               enable_gqa: bool, seed: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's gradients: computed again on the same seed (the same kernel draws
    the same mask) and differentiated as eager autograd would."""
    # a custom op's kernel runs below autograd: its keys back on (removing AutogradCPU from
    # the excluded set removes autograd for every device), as outside the op
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradCPU)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), \
            torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        out = _seeded_attention(int(seed), *inputs, attn_mask, dropout_p, is_causal,
                                scale=scale, enable_gqa=enable_gqa)
        grads = torch.autograd.grad(out, inputs, grad)
    dq, dk, dv = (g.contiguous() for g in grads)
    return dq, dk, dv


@tracked_attention_backward.register_fake
def _(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
      attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
      scale: Optional[float], enable_gqa: bool, seed: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device)
                  for t in (query, key, value))
    return dq, dk, dv


def _attention_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, value, attn_mask, *options, _tracker, _stream = inputs
    ctx.save_for_backward(query, key, value, attn_mask, output[1])
    ctx.options = tuple(options)


def _attention_backward(ctx: Any, grad: torch.Tensor, _grad_seed: Any) -> tuple[Any, ...]:
    query, key, value, attn_mask, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.autotp.tracked_attention_backward(
        grad, query, key, value, attn_mask, *ctx.options, seed)
    return (dq, dk, dv) + (None,) * 7


tracked_attention.register_autograd(_attention_backward, setup_context=_attention_context)
# each draw advances its stream: compiled graphs keep them in the program's order (two draws
# that no value orders, a parallel block's, are neither swapped nor dropped)
for _op in (tracked_keep, tracked_attention):
    _op.register_effect(EffectType.ORDERED)
