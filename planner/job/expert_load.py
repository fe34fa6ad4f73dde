"""The expected load imbalance of experts held whole per rank.

With experts whole (expert parallelism inside the tp group), rank r computes the rows routed
to the E/tp experts it owns. Every rank waits for the busiest one, so the expert products
take (busiest rank's rows) / (mean rows) times what balanced routing would. Routing is the
model's and the data's; autotp reports what uniform routing gives, a floor under any real
router's imbalance:

    each of N tokens picks k distinct experts of E uniformly; the rows landing on one rank's
    E/tp experts are, per token, hypergeometric: mean k/tp, variance
    k (1/tp) (1 - 1/tp) (E - k) / (E - 1); over N tokens, nearly normal. The ranks' loads
    sum to N k, so any two correlate by -1/(tp - 1): they are mu + sigma sqrt(tp/(tp-1))
    (W_r - mean W) for independent standard normals W, and
    busiest / mean  ~=  1 + sqrt(tp / (tp - 1)) m(tp) sigma / mu,
    mu = N k / tp, sigma^2 = N * variance

m(n), the expected largest of n independent standard normals. tests/test_estimate.py
compares it with sampled routings (within 1%).
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist


@lru_cache(maxsize=64)
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals], by quadrature (0 for n = 1)."""
    if n <= 1:
        return 0.0
    unit = NormalDist()
    step, total = 1e-3, 0.0
    for i in range(-9000, 9001):
        x = i * step
        total += x * n * unit.pdf(x) * unit.cdf(x) ** (n - 1) * step
    return total


def routing_imbalance(tokens: int, experts: int, top_k: int, ranks: int) -> float:
    """Busiest rank's routed rows over the mean, under uniform top-k routing of ``tokens``
    tokens to ``experts`` experts held whole by ``ranks`` ranks (1.0: one rank, or every
    rank gets every token's k rows)."""
    if ranks <= 1 or tokens <= 0 or top_k >= experts:
        return 1.0
    p = 1.0 / ranks
    variance = top_k * p * (1 - p) * (experts - top_k) / (experts - 1)
    mean = top_k * p
    spread = math.sqrt(ranks / (ranks - 1)) * expected_max_of_normals(ranks)
    return 1.0 + spread * math.sqrt(variance / tokens) / mean
