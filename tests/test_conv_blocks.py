"""A convolution module between attention blocks (Conformer's): pointwise conv, GLU over the
channels, depthwise conv, batch norm in eval, pointwise conv back. With conv biases split off
the products, it shards as an MLP does: the first pointwise conv column-parallel (its GLU
halves as two blocks), the depthwise conv and the batch norm per channel, the last pointwise
conv row-parallel with one all-reduce, its bias added once after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent, perturb
from autotp.planner.bound import megatron_verdict


class ConvModule(nn.Module):
    def __init__(self, h: int = 64, inner: int = 128, kernel: int = 5):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.pointwise_in = nn.Conv1d(h, 2 * inner, 1)
        self.depthwise = nn.Conv1d(inner, inner, kernel, padding=kernel // 2, groups=inner)
        self.batch_norm = nn.BatchNorm1d(inner)
        self.pointwise_out = nn.Conv1d(inner, h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x).transpose(1, 2)  # [B, h, T]
        y = F.glu(self.pointwise_in(y), dim=1)
        y = F.silu(self.batch_norm(self.depthwise(y)))
        return x + self.pointwise_out(y).transpose(1, 2)


class Model(nn.Module):
    def __init__(self, h: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ConvModule(h, 2 * h) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_conformer_conv_module_shards_as_an_mlp_and_runs_exact(tp: int) -> None:
    torch.manual_seed(0)
    model = perturb(Model()).eval()
    for layer in model.layers:  # running statistics off their init
        layer.batch_norm.running_mean.uniform_(-0.5, 0.5)
        layer.batch_norm.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 8, 64)
    plan = autotp.plan(model, tp, example_args=(x,))
    layouts = {name: p.layout for name, p in plan.params.items()}
    assert layouts["layers.0.pointwise_in.weight"] == "S(0)x2"
    assert layouts["layers.0.depthwise.weight"] == "S(0)"
    assert layouts["layers.0.batch_norm.weight"] == "S(0)"
    assert layouts["layers.0.pointwise_out.weight"] == "S(1)"
    assert layouts["layers.0.pointwise_out.bias"] == "R"
    assert plan.fallbacks == [] and megatron_verdict(plan).met, plan.summary()
    with torch.device("meta"):  # at a real width the same
        wide = autotp.plan(Model(1024).eval(), tp, example_args=(torch.randn(2, 8, 1024),))
    assert {name: p.layout for name, p in wide.params.items()} == layouts
    assert_equivalent(model, tp, args=(x,), atol=1e-5, grad_rtol=1e-4)
