"""Norms between two matrices (NormFormer's FFN norm, sub-LN's norm ahead of the attention
output projection): written out as partial statistics, so both matrices stay sharded and
each norm all-reduces its [B, T, 1] statistics, not the activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent, perturb


class Block(nn.Module):
    def __init__(self, h: int, heads: int, norm: type):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn_norm, self.ffn_norm = norm(h), norm(4 * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for y in self.qkv(self.n1(x)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(self.attn_norm(a.transpose(1, 2).reshape(b, t, h)))
        return x + self.down(self.ffn_norm(F.gelu(self.up(self.n2(x)))))


class Model(nn.Module):
    def __init__(self, h: int = 64, heads: int = 4, norm: type = nn.LayerNorm):
        super().__init__()
        self.embed = nn.Embedding(128, h)
        self.layers = nn.ModuleList(Block(h, heads, norm) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm], ids=["layer", "rms"])
@pytest.mark.parametrize("tp", [2, 4])
def test_norms_between_two_matrices_keep_both_sharded_and_run_exact(norm: type,
                                                                    tp: int) -> None:
    torch.manual_seed(0)
    model = perturb(Model(norm=norm)).eval()
    ids = torch.randint(0, 128, (2, 8))
    plan = autotp.plan(model, tp, example_args=(ids,))
    layouts = {name: p.layout for name, p in plan.params.items()}
    assert layouts["layers.0.qkv.weight"].startswith("S(0)")
    assert layouts["layers.0.up.weight"] == "S(0)"
    assert layouts["layers.0.o.weight"] == layouts["layers.0.down.weight"] == "S(1)"
    assert layouts["layers.0.ffn_norm.weight"] == "S(0)"  # each rank its features' scale
    assert plan.fallbacks == []
    statistics = [c for c in plan.choices.values() if "[partial sum]" in c.strategy]
    per_norm = 2 if norm is nn.LayerNorm else 1  # mean and variance, or the mean square
    assert len(statistics) == per_norm * 2 * 2, plan.summary()  # 2 norms in each of 2 layers
    assert_equivalent(model, tp, args=(ids,), atol=1e-5, grad_rtol=1e-4)


def test_the_residual_streams_norms_keep_their_fused_kernel() -> None:
    """Pre-norms read the residual stream (an add of two streams): not rewritten, so the
    stream stays replicated as Megatron keeps it."""
    with torch.device("meta"):
        model = Model(h=1024, heads=16)
    plan = autotp.plan(model, 4, example_args=(torch.randint(0, 128, (2, 16)),))
    norms = [c for c in plan.choices.values() if c.op == "aten.layer_norm.default"]
    assert len(norms) == 4, [c.op for c in plan.choices.values()]  # n1, n2 of each layer
    assert plan.params["layers.0.n1.weight"].layout == "R"


class HandNorm(nn.Module):
    """A LayerNorm written with torch.var and torch.mean, as codebases do by hand."""

    def __init__(self, h: int, unbiased: bool = False):
        super().__init__()
        self.g = nn.Parameter(torch.ones(h))
        self.unbiased = unbiased

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = torch.var(x, dim=-1, unbiased=self.unbiased, keepdim=True)
        mean = torch.mean(x, dim=-1, keepdim=True)
        return (x - mean) * (var + 1e-5).rsqrt() * self.g


class StdNorm(HandNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5) * self.g


class L2Norm(HandNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.g


@pytest.mark.parametrize("norm", [HandNorm, StdNorm, L2Norm], ids=["var", "std", "l2"])
def test_statistics_written_by_hand_between_two_matrices_are_partial_sums(norm: type) -> None:
    """torch.var / Tensor.std / F.normalize over a projection's features: written out in
    sums, each a partial sum all-reduced as one number per token; both FFN matrices stay
    sharded, forward and backward exact."""
    torch.manual_seed(0)
    model = perturb(Model(norm=norm)).eval()
    ids = torch.randint(0, 128, (2, 8))
    plan = autotp.plan(model, 2, example_args=(ids,))
    layouts = {name: p.layout for name, p in plan.params.items()}
    assert layouts["layers.0.up.weight"] == "S(0)"
    assert layouts["layers.0.o.weight"] == layouts["layers.0.down.weight"] == "S(1)"
    assert not [c for c in plan.choices.values()
                if c.op in ("aten.var.correction", "aten.std.correction",
                            "aten.linalg_vector_norm.default")], plan.summary()
    assert plan.fallbacks == []
    assert_equivalent(model, 2, args=(ids,), atol=1e-5, grad_rtol=1e-4)
