"""Redistributions between layouts, and the collective each one costs in each direction.

    from -> to    forward          backward          why
    R  -> R*      -                all-reduce        Megatron's f: partial gradients summed
    R* -> R       -                scale by 1/tp     identical gradients, counted once
    R  -> S       slice            all-gather        the full gradient is rebuilt
    R* -> S       slice            zero-pad          the gradient stays partial
    P  -> R       all-reduce       -                 Megatron's g
    P  -> R*      all-reduce       all-reduce
    P  -> S       reduce-scatter   all-gather        sequence parallelism
    S  -> R       all-gather       slice
    S  -> R*      all-gather       reduce-scatter    sequence parallelism
    P(lse) -> R   all-gather       -                 tp numbers per row, combined locally;
    P(lse) -> R*  all-gather       all-reduce        the gradient is local: g * exp(x_r - y)
    R* -> S(0)@experts  take rows  zero-pad          rows routed to the rank's experts
    S(0)@experts -> R   zero-pad + all-reduce   -    (autotp.runtime.routed_rows)

Without sequence parallelism autotp keeps to Megatron's pattern: activations change layout
through f and g (and free slices) only; all-gathers happen where the user receives a value
(the graph outputs) and where a layer-invariant value meets the stream (``batched``: every
layer's joined in one all-gather before the first layer, autotp.planner.invariant). A gather
anywhere else is a last resort, priced above any other choice and reported in the plan.
Every other pair (S(a) -> S(b), anything -> P) is not offered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from autotp.layout import ROUTED, Layout, Partial, Period, Replicate, Shard, is_mixed


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"  # expert parallelism's dispatch and combine (not planned)

    def ring_factor(self, tp: int) -> float:
        """Bytes each rank sends, as a fraction of the full tensor (ring algorithms; an
        all-to-all sends all but its own share)."""
        if self is Collective.ALL_REDUCE:
            return 2.0 * (tp - 1) / tp
        return (tp - 1) / tp

    def ring_steps(self, tp: int) -> int:
        """Sequential steps of the ring: each waits for its neighbour's chunk (an all-reduce
        is a reduce-scatter then an all-gather; an all-to-all, one exchange per peer)."""
        return 2 * (tp - 1) if self is Collective.ALL_REDUCE else tp - 1


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Transition:
    src: Layout
    dst: Layout
    forward: Optional[Collective]
    backward: Optional[Collective]
    # outside Megatron's pattern: used only where no plan without it exists (an op that
    # only runs replicated reads a sharded value), and reported in the plan
    last_resort: bool = False


@lru_cache(maxsize=4096)
def transition(
    src: Layout,
    dst: Layout,
    *,
    requires_grad: bool,
    to_output: bool = False,
    sequence_parallel: bool = False,
    batched: bool = False,
) -> Optional[Transition]:
    """The redistribution from ``src`` to ``dst``, or None when autotp does not offer it."""
    if src == dst:
        return Transition(src, dst, None, None)
    if any(isinstance(x, Shard) and is_mixed(x.blocks) for x in (src, dst)):
        return None  # segments held whole are read only where they are made (a split)
    if any(isinstance(x, Shard) and isinstance(x.blocks, Period) and x.blocks.symbolic
           for x in (src, dst)):
        return None  # merged sequences (context parallelism): read where they are made
    grad = requires_grad

    def make(fwd: Optional[Collective], bwd: Optional[Collective],
             last_resort: bool = False) -> Transition:
        return Transition(src, dst, fwd, bwd if grad else None, last_resort)

    gather_ok = to_output or sequence_parallel or batched
    if _routed(src) or _routed(dst):
        # rows routed to experts (autotp.runtime.routed_rows): taken from replicated rows, whose
        # gradient stays partial; given back zero-padded as a partial sum, all-reduced
        if isinstance(src, Replicate) and _routed(dst) and (src.grad_partial or not grad):
            return make(None, None)
        if _routed(src) and isinstance(dst, Replicate):
            return make(Collective.ALL_REDUCE,
                        Collective.ALL_REDUCE if dst.grad_partial else None)
        return None
    if isinstance(src, Replicate):
        if isinstance(dst, Replicate):
            if not grad:
                return make(None, None)
            return make(None, Collective.ALL_REDUCE if dst.grad_partial else None)
        if isinstance(dst, Shard):
            return make(None, None if src.grad_partial else Collective.ALL_GATHER)
        return None
    if isinstance(src, Partial) and src.reduce == "logsumexp":
        if isinstance(dst, Replicate):
            return make(Collective.ALL_GATHER,
                        Collective.ALL_REDUCE if dst.grad_partial else None)
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return make(Collective.ALL_REDUCE, Collective.ALL_REDUCE if dst.grad_partial else None)
        if isinstance(dst, Shard) and sequence_parallel:
            return make(Collective.REDUCE_SCATTER, Collective.ALL_GATHER)
        return None
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return make(Collective.ALL_GATHER,
                        Collective.REDUCE_SCATTER if dst.grad_partial else None,
                        last_resort=not gather_ok)
        return None
    raise TypeError(f"not a layout: {src!r}")


def _routed(layout: Layout) -> bool:
    return isinstance(layout, Shard) and layout.blocks == ROUTED
