"""The cost model: an alpha-beta model of collectives, a flop rate, and parameter memory.

    cost(plan) = sum_params  w(p) * bytes_per_rank(p)                      memory
               + sum_collectives  (alpha + steps(kind) * delta
                                  + ring(kind) * bytes / beta)           communication
               + sum_ops  flops(op) / (F * (tp if the op is split else 1))  compute
               + sum_grouped  knee * (experts a rank multiplies) / F      (MoE products)
               + epsilon * #(ops with a partial-sum output)                tie-break
               + sum_premium  w * premium(s) * (1 - 1/tp)                  see below
               + a * sum_activations bytes_per_rank(v)     with sequence parallelism only

``w`` is large for matrices (ndim >= 2): a matrix is replicated only when no exact plan
shards it within Megatron's communication pattern. Vectors (norm weights, biases) get a tiny
weight that only breaks ties. A strategy outside Megatron's pattern but exact (a norm's
statistic over a sharded dim, all-reduced) carries a premium in bytes of matrix: the plan
takes it only where it shards more than that. Byte counts are sympy expressions in the
batch and sequence sizes; they are evaluated at a reference (batch, seq) for the comparison.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import sympy

from autotp.planner.transitions import Collective


@dataclass(frozen=True)
class CostModel:
    bandwidth: float = 100e9  # bytes/s, per rank
    latency: float = 10e-6  # s, per collective: its launch
    # s per sequential step of the ring (2(tp - 1) for an all-reduce, tp - 1 otherwise), as
    # autotp.planner.job.hardware's ring_latency: at tp 8 an all-reduce waits 14 hops, so a small
    # collective of its own costs more than adding its bytes to one that runs anyway
    step_latency: float = 3.4e-6
    flops: float = 100e12  # flop/s
    batch: int = 8
    seq: int = 1024
    # cost per byte of a matrix parameter held per rank: 1 KiB outweighs any communication,
    # while a 70B model's total (~1e8) keeps microsecond differences above float resolution
    matrix_weight: float = 1e-3
    vector_weight: float = 1e-15  # cost per byte of a vector parameter held per rank
    # Ties between plans of equal communication (a residual stream kept as a partial sum and
    # reduced before each norm, or reduced right after each row-parallel product, as Megatron
    # does) are broken toward reducing partial sums early: a tiny charge per op with P output.
    partial_output: float = 1e-7
    # Sequence parallelism: cost per byte per rank of an activation that autograd keeps
    # (the output of an op that requires grad). Large enough that sharding the norms,
    # residuals and dropouts between blocks beats the extra latency of reduce-scatter +
    # all-gather over one all-reduce; far below any parameter byte.
    activation_weight: float = 1e-9
    # a redistribution outside Megatron's pattern: dearer than replicating any model
    last_resort: float = 1e10
    # FLOPs at which a GEMM runs at half its peak rate (autotp.planner.job.hardware's gemm_knee): a
    # grouped product pays it once per expert a rank multiplies, so e/tp whole experts beat
    # e slices of every expert (skinny GEMMs run far from peak)
    gemm_knee: float = 2e9
    # bytes/s a copy reads and writes on the device: an all-gather or reduce-scatter along a
    # dim after one of several indices copies its buffer to interleave the ranks' pieces
    memory_bandwidth: float = 2e12

    def collective_time(self, kind: Collective, nbytes: float, tp: int) -> float:
        return self.collective_latency(kind, tp) + self.transfer_time(kind, nbytes, tp)

    def collective_latency(self, kind: Collective, tp: int) -> float:
        """s a collective waits whatever it carries; one joined with others (the gradient
        bucket, a layer-invariant gather) shares theirs."""
        return self.latency + kind.ring_steps(tp) * self.step_latency

    def transfer_time(self, kind: Collective, nbytes: float, tp: int) -> float:
        return kind.ring_factor(tp) * nbytes / self.bandwidth

    def copy_time(self, nbytes: float) -> float:
        """s to copy ``nbytes`` on the device (read and written)."""
        return 2 * nbytes / self.memory_bandwidth

    def compute_time(self, flops: float, gemms: int = 0) -> float:
        return (flops + gemms * self.gemm_knee) / self.flops

    def premium_cost(self, nbytes: float, tp: int) -> float:
        """A strategy outside Megatron's pattern: what sharding a matrix of ``nbytes`` saves."""
        return self.memory_cost(nbytes * (1 - 1 / tp), 2)

    def memory_cost(self, nbytes: float, ndim: int) -> float:
        return nbytes * (self.matrix_weight if ndim >= 2 else self.vector_weight)

    def evaluate(self, expr: Any, dim_names: dict[sympy.Symbol, str]) -> float:
        """A size expression at the reference batch and sequence (other symbols: seq)."""
        if isinstance(expr, (int, float)):
            return float(expr)
        values = tuple(sorted(
            (str(sym), self.batch if name.startswith("B") else self.seq)
            for sym, name in dim_names.items()
        ))
        return _evaluate(str(expr), values, self.seq)


def attention_strategy(heads: int, kv_heads: int, cp: int) -> tuple[str, str]:
    """("ulysses" or "ring", why): the one that sends fewer bytes per rank and layer (context
    parallelism's attention, ``autotp.runtime.ring``; the plan picks it where attention
    takes no mask tensor, ``autotp.planner.assemble``).

    Per rank and per layer, in units of one rank's query block: Ulysses sends (cp - 1)/cp of
    q, k, v and the output, 2 (1 + kv_heads/heads) (cp - 1)/cp; the ring sends k and v
    cp - 1 times, 2 (kv_heads/heads) (cp - 1). Both twice as much again in backward."""
    ratio = kv_heads / heads
    ring = 2 * ratio * (cp - 1)
    if heads % cp or kv_heads % cp:
        return "ring", (f"{heads} query and {kv_heads} key/value heads do not divide by "
                        f"cp={cp} (Ulysses splits both)")
    ulysses = 2 * (1 + ratio) * (cp - 1) / cp
    if ring <= ulysses:  # a tie: the ring, whose shifts overlap the attention's work
        return "ring", (f"the ring sends {ring:.2f} and Ulysses {ulysses:.2f} query blocks "
                        "per rank and layer")
    return "ulysses", (f"Ulysses sends {ulysses:.2f} and the ring {ring:.2f} query blocks "
                       "per rank and layer")


# sympy's one-letter names (its singleton registry S, Euler's E, the imaginary I, ...) that a
# dim may be called (the decoding program's cache slots are S)
_SYMPY_LETTERS = frozenset("SNEIOQ")


def parse_size_expr(text: Any) -> Any:
    """A size expression written as text ("32768*B*T") back to sympy, every name in it a
    symbol unless it is one of sympy's functions (floor, Mod)."""
    if not isinstance(text, str):
        return sympy.sympify(text)
    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
    return sympy.sympify(text, locals={n: sympy.Symbol(n) for n in names
                                       if n in _SYMPY_LETTERS or not hasattr(sympy, n)})


@lru_cache(maxsize=65536)
def _evaluate(expr_text: str, values: tuple[tuple[str, int], ...], default: int) -> float:
    expr = parse_size_expr(expr_text)
    subs = dict(values)
    return float(expr.subs({s: subs.get(str(s), default) for s in expr.free_symbols}))


def readable(expr: Any, dim_names: dict[sympy.Symbol, str]) -> str:
    """A size expression with the export's symbols renamed to B, T."""
    if isinstance(expr, (int, float)):
        return str(int(expr))
    renamed = parse_size_expr(expr).subs({sym: sympy.Symbol(name)
                                          for sym, name in dim_names.items()})
    return str(renamed)
