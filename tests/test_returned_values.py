"""A value the model returns beside its output, taken from along a sharded dim (one head's
attention probabilities): the rank holding that head selects it, the others give zeros, and
only the returned slice is summed; the attention stays sharded by heads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent, perturb
from autotp.planner.bound import megatron_verdict


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(b, t, 3, self.heads, -1) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        probs = (q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5).softmax(-1)
        x = x + self.o((probs @ v).transpose(1, 2).reshape(b, t, h))
        return x + self.down(torch.relu(self.up(self.n2(x)))), probs[:, 0]


class Model(nn.Module):
    def __init__(self, h: int = 64, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(h, heads) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first_heads = []
        for layer in self.layers:
            x, probs = layer(x)
            first_heads.append(probs)
        return x, torch.stack(first_heads)


@pytest.mark.parametrize("tp", [2, 4])
def test_one_heads_returned_probabilities_keep_the_attention_sharded(tp: int) -> None:
    with torch.device("meta"):
        wide = Model(1024, 16)
    plan = autotp.plan(wide, tp, example_args=(torch.randn(2, 16, 1024, device="meta"),))
    assert plan.params["layers.0.qkv.weight"].layout.startswith("S(0)")
    assert plan.params["layers.0.o.weight"].layout == "S(1)"
    assert megatron_verdict(plan).met, plan.summary()
    torch.manual_seed(0)
    model = perturb(Model()).eval()
    x = torch.randn(2, 8, 64)
    small = autotp.plan(model, tp, example_args=(x,))
    owners = [c for c in small.choices.values() if "owner's slice" in c.strategy]
    assert len(owners) == 2, small.summary()  # each layer's head 0, selected by its owner
    for pick in (lambda out: out[0], lambda out: out[1]):
        assert_equivalent(model, tp, args=(x,), pick=pick, atol=1e-5, grad_rtol=1e-4)
