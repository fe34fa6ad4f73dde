"""The view algebra (rules/view_algebra.py) on what other codebases write: heads folded into
the batch and carried through transposes, flattens and reshapes (fairseq's and torchscale's
[T, B*heads, d]), and a symbolic dim split by sizes the algebra cannot prove (einops'
``b (n g) d -> b n g d``), checked on the dim maps, on values, and on whole plans."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.testing import check_op
from autotp.verification.verify import assert_equivalent, layer_counts
from autotp.layout import Period, Shard, shard_tensor
from autotp.planner.bound import megatron_verdict
from autotp.rules.registry import TensorMeta
from autotp.rules.view_algebra import (
    map_shard_through_view,
    view_groups,
    view_groups_around,
    view_segmentations,
)

aten = torch.ops.aten
S0 = sympy.Symbol("s0", integer=True, positive=True)  # the batch
S1 = sympy.Symbol("s1", integer=True, positive=True)  # the sequence
SPLIT = sympy.floor(S1 / 8)  # einops' n of (n g) with g = 8: T // 8
GROUP = sympy.floor(S1 / SPLIT)  # and g as einops computes it back: T // (T // 8)
_GEN = torch.Generator().manual_seed(7)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN)


# ---- groups: lined up from both ends around what the algebra cannot prove -----------------

AROUND = [
    # einops' 'b (n g) d -> b n g d' with a dynamic T: the batch and the features line up
    ((S0, S1, 128), (S0, SPLIT, GROUP, 128),
     [((0,), (0,)), ((2,), (3,))], ((1,), (1, 2))),
    ((S0, S1, 4, 16), (S0, SPLIT, 8, 64),
     [((0,), (0,)), ((2, 3), (3,))], ((1,), (1, 2))),
    # ... and back: the groups after the middle keep their own grouping
    ((S0, SPLIT, GROUP, 128), (S0, 8 * SPLIT, 128),
     [((0,), (0,)), ((3,), (2,))], ((1, 2), (1,))),
    # a whole reshape that lines up has no middle
    ((S0, S1, 64), (S0, S1, 4, 16), [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))], None),
]


@pytest.mark.parametrize(("src", "dst", "groups", "middle"), AROUND)
def test_view_groups_line_up_from_both_ends(src: tuple, dst: tuple, groups: list,
                                            middle: Optional[tuple]) -> None:
    assert view_groups_around(src, dst) == (groups, middle)
    if middle is not None:
        with pytest.raises(ValueError):
            view_groups(src, dst)


SHARDS = [
    # the middle keeps nothing; the dims around it keep their shards
    ((S0, S1, 128), (S0, SPLIT, GROUP, 128), Shard(2), 2, Shard(3)),
    ((S0, S1, 4, 16), (S0, SPLIT, 8, 64), Shard(2), 4, Shard(3)),
    ((S0, SPLIT, GROUP, 128), (S0, 8 * SPLIT, 128), Shard(3), 2, Shard(2)),
    # heads folded into the batch, carried into a flattened last dim: segments of heads x d
    ((S1, S0 * 4, 16), (S1, S0 * 64), Shard(1, Period(4)), 2, Shard(1, Period(64))),
    ((S0 * 4, 8, 16), (S0 * 32, 16), Shard(0, Period(4)), 4, Shard(0, Period(32))),
    # ... not where a symbolic size falls inside a segment (a head times the sequence)
    ((S0 * 4, S1, 16), (S0 * 4 * S1, 16), Shard(0, Period(4)), 2, None),
    # a static batch: the segments are blocks of the static dim (S(1)%4 of [T, 8, d] is
    # S(1)x2), both ways
    ((S1, 2, 64), (S1, 8, 16), Shard(2), 2, Shard(1, 2)),
    ((S1, 8, 16), (S1, 2, 64), Shard(1, 2), 2, Shard(2)),
    ((S1, 8, 16), (S1, 128), Shard(1, 2), 4, Shard(1, 2)),
    ((2, 4, S1, 16), (8, S1, 16), Shard(1), 2, Shard(0, 2)),
]


@pytest.mark.parametrize(("src", "dst", "shard", "tp", "expected"), SHARDS)
def test_map_shard_through_view(src: tuple, dst: tuple, shard: Shard, tp: int,
                                expected: Optional[Shard]) -> None:
    mapped = map_shard_through_view(shard, TensorMeta(src, torch.float32),
                                    TensorMeta(dst, torch.float32), tp)
    assert mapped == expected


@pytest.mark.parametrize(("src", "dst", "shard", "tp", "expected"),
                         [case for case in SHARDS if case[4] is not None])
def test_a_mapped_shard_holds_on_values(src: tuple, dst: tuple, shard: Shard, tp: int,
                                        expected: Shard) -> None:
    """A rank's piece viewed at its local size is its piece of the viewed tensor, at
    sequences that are whole groups of 8 and batches of 2 and 3."""
    for s0, s1 in ((2, 16), (3, 24)):
        values = {S0: s0, S1: s1}
        src_shape, dst_shape = ([int(sympy.sympify(d).subs(values)) for d in shape]
                                for shape in (src, dst))
        full = torch.arange(float(torch.Size(src_shape).numel())).reshape(src_shape)
        local = list(dst_shape)
        local[expected.dim] //= tp
        for rank in range(tp):
            piece = shard_tensor(full, shard, rank, tp).reshape(local)
            assert torch.equal(piece, shard_tensor(full.reshape(dst_shape), expected, rank, tp))


def test_view_segmentations_name_the_periods_a_plan_needs() -> None:
    """fairseq's [T, B, h] -> [T, B*heads, d] folds the heads into the batch: segments of the
    heads, on either side of the reshape; a flatten after it, segments of heads x d."""
    assert view_segmentations((S1, S0, 64), (S1, S0 * 8, 8)) == {Period(8)}
    assert view_segmentations((S1, S0 * 8, 8), (S1, S0, 64)) == {Period(8)}
    assert view_segmentations((S1, S0 * 8, 8), (S1, S0 * 64), {1, Period(8)}) == {
        Period(8), Period(64)}
    assert view_segmentations((2, 3, 4, 4), (2, 3, 16)) == set()  # blocks: no period


# ---- strategies on values, with the sizes symbolic as the planner sees them ---------------

B, T, HEADS, D = 5, 3, 4, 4  # B * HEADS = 20, T * B * HEADS = 60, HEADS * D = 16
SIZES = {B * HEADS: S0 * HEADS, B: S0, T: S1, T * B * HEADS: S1 * S0 * HEADS,
         B * HEADS * D: S0 * HEADS * D}
PERIOD = Period(HEADS)

# op, args, sizes seen as symbols, blocks, strategies (input -> output) that must be offered
PERIOD_VIEWS: list[tuple[Any, tuple, dict, tuple, list]] = [
    # attention over [B*H, T, d] (heads fastest), back to [T, B*H, d] and merged into [T, B, h]
    (aten.transpose.int, (randn(20, 3, 4), 0, 1), SIZES, (1, PERIOD),
     [(Shard(0, PERIOD), Shard(1, PERIOD))]),
    (aten.permute.default, (randn(3, 20, 4), [1, 0, 2]), SIZES, (1, PERIOD),
     [(Shard(1, PERIOD), Shard(0, PERIOD))]),
    (aten.reshape.default, (randn(3, 20, 4), [3, 5, 16]), SIZES, (1, PERIOD),
     [(Shard(1, PERIOD), Shard(2))]),
    (aten.view.default, (randn(3, 5, 16), [3, 20, 4]), SIZES, (1, PERIOD),
     [(Shard(2), Shard(1, PERIOD))]),
    (aten.view.default, (randn(3, 20, 4), [60, 4]), SIZES, (1, PERIOD),
     [(Shard(1, PERIOD), Shard(0, PERIOD))]),
    (aten.reshape.default, (randn(20, 3, 4), [5, 4, 3, 4]), SIZES, (1, PERIOD),
     [(Shard(0, PERIOD), Shard(1))]),
    (aten.reshape.default, (randn(5, 4, 3, 4), [20, 3, 4]), SIZES, (1, PERIOD),
     [(Shard(1), Shard(0, PERIOD))]),
    (aten.unflatten.int, (randn(20, 3, 4), 0, [5, 4]), SIZES, (1, PERIOD),
     [(Shard(0, PERIOD), Shard(1))]),
    # flatten: the heads' segments with d after them; gateloop's interleave leaves them alone
    (aten.flatten.using_ints, (randn(3, 20, 4), 1, 2), SIZES, (1, PERIOD),
     [(Shard(1, PERIOD), Shard(1, Period(HEADS * D)))]),
    (aten.flatten.using_ints, (randn(20, 3, 2, 4), 1, 2), SIZES, (1, PERIOD),
     [(Shard(0, PERIOD), Shard(0, PERIOD))]),
    # a static batch: the same layouts as blocks of the static dim
    (aten.view.default, (randn(3, 2, 16), [3, 8, 4]), {}, (1, 2), [(Shard(2), Shard(1, 2))]),
    (aten.view.default, (randn(3, 8, 4), [3, 32]), {}, (1, 2), [(Shard(1, 2), Shard(1, 2))]),
    # einops' 'b (n g) d -> b n g d' with a dynamic T, and back
    (aten.reshape.default, (randn(5, 24, 12), [5, 3, 8, 12]),
     {24: S1, 3: SPLIT, 8: GROUP, 5: S0}, (1,), [(Shard(2), Shard(3))]),
    (aten.reshape.default, (randn(5, 3, 8, 12), [5, 24, 12]),
     {24: 8 * SPLIT, 3: SPLIT, 8: GROUP, 5: S0}, (1,), [(Shard(3), Shard(2))]),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("op", "args", "sizes", "blocks", "offered"), PERIOD_VIEWS,
                         ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_period_views_are_exact(op: Any, args: tuple, sizes: dict, blocks: tuple,
                                offered: list, tp: int) -> None:
    checks = check_op(op, args, tp=tp, blocks=blocks, sizes=sizes)
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g} {c.error}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    strategies = {(c.strategy.inputs[0], c.strategy.output) for c in checks}
    for pair in offered:
        assert pair in strategies, sorted(map(str, (c.strategy for c in checks)))


def test_pad_by_nothing_keeps_the_shard() -> None:
    """FLASH's pad_at_dim(x, (1, -1), dim=-3) names the two dims after it with zeros."""
    checks = check_op(aten.pad.default, (randn(2, 6, 4, 8), [0, 0, 0, 0, 1, -1]), tp=2,
                      blocks=(1,))
    assert all(c.ok for c in checks)
    kept = {c.strategy.inputs[0] for c in checks if c.strategy.name == "keep shard"}
    assert kept == {Shard(0), Shard(2), Shard(3)}, kept


# ---- whole plans ------------------------------------------------------------------------------


class FoldedHeads(nn.Module):
    """fairseq's attention: [T, B, h] viewed as [T, B*heads, d] and transposed to batch-first
    for bmm, the heads fastest in the merged dim; then ``transpose(0, 1)`` and
    ``.contiguous().view(T, B, h)`` (or ``.reshape``) back into the features."""

    def __init__(self, dim: int = 32, heads: int = 4, reshape: bool = False,
                 unpack: bool = False) -> None:
        super().__init__()
        self.heads, self.reshape, self.unpack = heads, reshape, unpack
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, B, h)
        t, b, h = x.shape
        q = self.q(x).contiguous().view(t, b * self.heads, -1).transpose(0, 1)
        k = self.k(x).contiguous().view(-1, b * self.heads, h // self.heads).transpose(0, 1)
        v = self.v(x).contiguous().view(-1, b * self.heads, h // self.heads).transpose(0, 1)
        probs = torch.bmm(q, k.transpose(1, 2)).softmax(-1)  # (B*heads, T, T)
        attn = torch.bmm(probs, v)  # (B*heads, T, d)
        if self.unpack:  # einops' pack / unpack of one tensor: a cat of it, then all of it
            attn = torch.cat([attn])[: b * self.heads]
        attn = attn.transpose(0, 1)  # (T, B*heads, d)
        attn = attn.reshape(t, b, h) if self.reshape else attn.contiguous().view(t, b, h)
        x = x + self.o(attn)
        return x + self.down(torch.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList([FoldedHeads(**options) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("reshape, unpack", [(False, False), (True, False), (False, True)],
                         ids=["view", "reshape", "unpacked"])
def test_heads_folded_into_the_batch_plan_at_the_bound(reshape: bool, unpack: bool) -> None:
    """q, k, v column-parallel and o row-parallel through the folded heads (S(1)%4 and
    S(0)%4 between them): Megatron's two all-reduces per layer, exact at another T and B.
    A concatenation of one tensor and a slice to the end of a symbolic dim are the tensor
    itself, and keep its shard."""
    torch.manual_seed(0)
    model = Blocks(reshape=reshape, unpack=unpack)
    sim = autotp.simulate(model, 2, example_args=(torch.randn(6, 2, 32),))
    for name in ("q", "k", "v", "o"):
        layout = sim.plan.params[f"layers.0.{name}.weight"].layout
        assert layout == ("S(1)" if name == "o" else "S(0)"), (name, layout)
    assert any("S(0)%4" in c.strategy for c in sim.plan.choices.values())
    x = torch.randn(5, 3, 32)
    assert_equivalent(model, sim, args=(x,), loss_fn=lambda out: out.square().mean(),
                      atol=1e-4, grad_rtol=1e-4)
    counts = layer_counts(sim.ranks[0].comm.log)  # the input needs no gradient: 3 backward
    assert sorted((c["forward"], c["backward"]) for c in counts.values()) == [(2, 1), (2, 2)]
    assert {c.kind for c in sim.plan.collectives} <= {"all_reduce"}


class GroupedScan(nn.Module):
    """einops' 'b (n g) d -> b n g d' (g = 8) around a scan within each group, on features a
    column-parallel projection shards and a row-parallel one reads back."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        b, t, _ = x.shape
        y = torch.relu(self.up(x))
        n = t // 8
        y = y.reshape(b, n, t // n, -1).cumsum(2).reshape(b, t, -1)
        return x + self.down(y)


def test_a_split_the_algebra_cannot_prove_keeps_the_shard_around_it() -> None:
    """The features stay sharded through [B, T, 4h] -> [B, T // 8, 8, 4h] -> [B, T, 4h]:
    the row-parallel projection's one all-reduce, exact at another batch and sequence."""
    torch.manual_seed(0)
    model = GroupedScan()
    sim = autotp.simulate(model, 2, example_args=(torch.randn(2, 16, 32),))
    assert sim.plan.params["up.weight"].layout == "S(0)"
    x = torch.randn(3, 24, 32)
    assert_equivalent(model, sim, args=(x,), loss_fn=lambda out: out.square().mean(),
                      atol=1e-4, grad_rtol=1e-4)
    kinds = [(c.phase, c.kind) for c in sim.plan.collectives]  # x needs no gradient
    assert kinds == [("forward", "all_reduce")], kinds


class FusedParallel(nn.Module):
    """PaLM's parallel block: one projection for q | k | v | ff (one k/v head), the ff part
    halved again by SwiGLU, the attention and MLP outputs summed."""

    def __init__(self, dim: int = 64, heads: int = 4, d: int = 16) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.sizes = [heads * d, d, d, 8 * dim]
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, sum(self.sizes), bias=False)
        self.attn_out = nn.Linear(heads * d, dim, bias=False)
        self.ff_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, ff = self.proj(self.norm(x)).split(self.sizes, dim=-1)
        q = q.reshape(b, t, self.heads, self.d).transpose(1, 2)
        k, v = (y.unsqueeze(1).expand(b, self.heads, t, self.d) for y in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a, gate = ff.chunk(2, dim=-1)
        mlp = self.ff_out(a * F.silu(gate))
        return x + self.attn_out(attn.transpose(1, 2).reshape(b, t, -1)) + mlp


class FusedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FusedParallel() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_fused_projection_split_unequally_and_split_again_stays_sharded() -> None:
    """q | k | v | ff with the ff part halved: the fused matrix sharded in the segments of
    both splits (q and both ff halves sliced, the single k/v head whole on every rank), both
    outputs row-parallel, one all-reduce per layer each way; exact."""
    torch.manual_seed(0)
    model = FusedStack()
    x = torch.randn(2, 8, 64)
    sim = autotp.simulate(model, 2, example_args=(x,))
    params = sim.plan.params
    assert params["layers.0.proj.weight"].layout == "S(0)x4:1*:1*:16:16"
    assert params["layers.0.attn_out.weight"].layout == "S(1)"
    assert params["layers.0.ff_out.weight"].layout == "S(1)"
    assert megatron_verdict(sim.plan).met
    assert_equivalent(model, sim, args=(torch.randn(3, 5, 64),),
                      loss_fn=lambda out: out.square().mean(), atol=1e-4, grad_rtol=1e-4)
    counts = layer_counts(sim.ranks[0].comm.log)  # (None: the whole k/v rows' gradient sum)
    assert sorted((c["forward"], c["backward"]) for layer, c in counts.items()
                  if layer is not None) == [(1, 0), (1, 1)]


class GroupedSequence(nn.Module):
    """FLASH's grouped attention: the sequence cut into groups of g (``'b (n g) d -> b n g
    d'``), attention inside each group by einsums over a broadcast ellipsis, on values a
    column-parallel projection shards."""

    def __init__(self, dim: int = 32, g: int = 4) -> None:
        super().__init__()
        self.g = g
        self.qk, self.v = nn.Linear(dim, 16), nn.Linear(dim, 4 * dim)
        self.o = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qk = self.qk(x).reshape(b, t // self.g, self.g, 16)
        v = self.v(x).reshape(b, t // self.g, self.g, -1)
        sim = torch.einsum("... i d, ... j d -> ... i j", qk, qk) / self.g
        out = torch.einsum("... i j, ... j d -> ... i d", sim.softmax(-1), v)
        return x + self.o(out.reshape(b, t, -1))


def test_a_sequence_cut_into_groups_keeps_the_features_sharded_through_ellipsis_einsums(
        ) -> None:
    """The group's size proved by the trace (the sequence a multiple of g) and the einsums'
    ellipsis spelled out: v column-parallel, o row-parallel, one all-reduce each way."""
    torch.manual_seed(0)
    model = nn.Sequential(GroupedSequence(), GroupedSequence())
    sim = autotp.simulate(model, 2, example_args=(torch.randn(2, 8, 32),))
    assert sim.plan.params["0.v.weight"].layout == "S(0)"
    assert sim.plan.params["0.o.weight"].layout == "S(1)"
    assert sim.plan.fallbacks == [], sim.plan.fallbacks
    assert_equivalent(model, sim, args=(torch.randn(3, 12, 32),),
                      loss_fn=lambda out: out.square().mean(), atol=1e-4, grad_rtol=1e-4)
