"""What the search may drop without losing the cheapest plan (``planner/frontier.py``'s
``_drop_dominated``), and what the cost model prices as next to nothing to shard
(``planner/checks.py``'s ``narrow_matrices``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.layout import R, R_STAR, Shard
from autotp.planner.checks import narrow_matrices
from autotp.planner.frontier import _drop_dominated


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTP_CACHE", "0")


def _state(cost: float, **entries: tuple) -> tuple[frozenset, tuple[float, dict]]:
    return frozenset(entries.items()), (cost, dict(entries))


def test_a_value_held_as_r_star_covers_it_held_as_r() -> None:
    """R* -> R and R* -> S are free both ways, R -> R* pays an all-reduce backward: at no
    more cost, R* drops R; a slice made already (read as it is, an anchor) is not free."""
    s = Shard(2)
    states = dict([
        _state(1.0, x=(R_STAR, frozenset()), y=(s, frozenset())),
        _state(1.0, x=(R, frozenset()), y=(s, frozenset())),
        _state(1.0, x=(R, frozenset({R_STAR})), y=(s, frozenset())),
        _state(1.0, x=(R_STAR, frozenset({R})), y=(s, frozenset())),  # R made for nothing
        _state(0.5, x=(R, frozenset({s})), y=(s, frozenset())),  # cheaper: stays
        _state(1.0, x=(R, frozenset({s})), y=(s, frozenset())),  # its slice: stays
    ])
    kept = {tuple(sorted((n, str(e[0]), tuple(map(str, e[1]))) for n, e in v[1].items()))
            for v in _drop_dominated(states).values()}
    assert kept == {
        (("x", "R*", ()), ("y", "S(2)", ())),
        (("x", "R", ("S(2)",)), ("y", "S(2)", ())),
    }
    # dearer R* does not drop a cheaper R: what it paid may never be repaid
    states = dict([_state(2.0, x=(R_STAR, frozenset())), _state(1.0, x=(R, frozenset()))])
    assert len(_drop_dominated(states)) == 2


class SharedQK(nn.Module):
    """FLASH's gated attention unit in small: v and the gate column parallel, one narrow q/k
    projection shared by a quadratic and a linear attention, offset and scaled four ways and
    rotated (cos and sin computed in forward), the output row parallel. Megatron sums the
    gradient of the q/k chain once, where the unit's input enters (f): the chain runs R*."""

    def __init__(self, dim: int = 64, qk: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.to_hidden = nn.Linear(dim, 2 * hidden)
        self.to_qk = nn.Linear(dim, qk)
        self.gamma = nn.Parameter(torch.randn(4, qk))
        self.beta = nn.Parameter(torch.randn(4, qk))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, qk, 2) / qk),
                             persistent=False)
        self.to_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, dim)
        normed = self.norm(x)
        v, gate = F.silu(self.to_hidden(normed)).chunk(2, dim=-1)  # (B, T, hidden) each
        qk = F.silu(self.to_qk(normed))  # (B, T, qk)
        q1, q2, k1, k2 = (qk.unsqueeze(-2) * self.gamma + self.beta).unbind(-2)
        freqs = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq[None]
        cos, sin = freqs.cos(), freqs.sin()  # (T, qk / 2)

        def rotate(u: torch.Tensor) -> torch.Tensor:
            u1, u2 = u.chunk(2, dim=-1)
            return torch.cat((u1 * cos - u2 * sin, u1 * sin + u2 * cos), dim=-1)

        q1, q2, k1, k2 = map(rotate, (q1, q2, k1, k2))
        quad = F.relu(q1 @ k1.transpose(-1, -2)) ** 2  # (B, T, T)
        out = quad @ v + q2 @ (k2.transpose(-1, -2) @ v)
        return x + self.to_out(out * gate)


class Units(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SharedQK()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_chain_summed_once_at_its_start_survives_the_beam() -> None:
    """Each op of the q/k chain may drop back from R* to R at equal cost: as many states as
    places to drop. They crowded the chain out of a 64-state beam, and the plan summed the
    partial gradients of the rotated q/k where the attention reads them (a backward
    all-reduce in the layer, as a 1024-state beam did not). R* covering R drops them."""
    torch.manual_seed(0)
    plan = autotp.plan(Units(), 2, example_args=(torch.randn(2, 8, 64),))
    assert plan.params["layers.0.to_qk.weight"].layout == "R"
    assert plan.per_layer()[0] == {("forward", "all_reduce"): 1}  # the unit's input: no grad


def test_a_table_small_along_both_sides_is_narrow() -> None:
    """Hyper-connections' stream mixing [streams, streams + 1] beside h = 64 matrices: next
    to nothing to shard (sharding it split the residual streams, an all-reduce per branch
    input). A rank-r adapter is narrow; a first stage's [4w, w] projection is not."""
    shapes = {f"w{i}": (256, 64) for i in range(4)} | {f"o{i}": (64, 256) for i in range(4)}
    shapes |= {"alpha": (4, 5), "lora": (4, 64), "stage": (128, 32)}
    narrow = narrow_matrices(shapes)
    assert {"alpha", "lora"} <= narrow
    assert not narrow & {"stage", *shapes.keys() - {"alpha", "lora"}}


def test_a_wider_search_without_a_last_resort_is_kept() -> None:
    """PixArt at tp 2: the 64-state search gathers the stream once for a norm (a last
    resort), the wider one needs no gather at a cost 1e10 lower. The first plan's bytes per
    layer were no reference for it (its gather moved a backward all-reduce out of a layer),
    and the wider plan was refused on them."""
    pytest.importorskip("diffusers")
    from benchmarks.peers import make_cases

    case = make_cases()["pixart"]
    plan = autotp.plan(case.build(), 2, example_kwargs=case.inputs(), strict=False)
    assert plan.last_resorts == 0
    assert not [f for f in plan.fallbacks if "gathered" in f]
