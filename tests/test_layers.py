"""The rank program split into its layers (``autotp.runtime.layers``): exact, and split."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent


class Hook(nn.Module):
    """An identity module called on intermediate values (TransformerLens' HookPoint)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Attention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.hook_q, self.hook_k, self.hook_v, self.hook_z = (Hook() for _ in range(4))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.hook_q(self.q(x)).view(B, T, self.heads, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.hook_k(self.k(context)).view(B, T, self.heads, -1).transpose(1, 2)
        v = self.hook_v(self.v(context)).view(B, T, self.heads, -1).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(self.hook_z(z.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    """Two residual streams: x (queries, MLP) and y (keys and values, scaled by a learned
    vector); the MLP's output also goes to y. ``parallel``: attention and MLP both read the
    block's x and their sum is added once; else the MLP reads x after the attention."""

    def __init__(self, parallel: bool, dim: int = 64) -> None:
        super().__init__()
        self.parallel = parallel
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.attn = Attention(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        (self.hook_resid_pre, self.hook_stream_pre, self.hook_attn_out, self.hook_mlp_out,
         self.hook_resid_mid, self.hook_branches, self.hook_resid_post,
         self.hook_stream_post) = (Hook() for _ in range(8))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_mlp_out(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.hook_resid_pre(x), self.hook_stream_pre(y)
        a = self.hook_attn_out(self.attn(self.ln1(x), self.ln1(y * self.scale)))
        if self.parallel:
            m = self.mlp(x)
            x = self.hook_resid_post(x + self.hook_branches(a + m))
        else:
            x = self.hook_resid_mid(x + a)
            m = self.mlp(x)
            x = self.hook_resid_post(x + m)
        return x, self.hook_stream_post(y + m)


class TwoStreams(nn.Module):
    def __init__(self, parallel: bool, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(parallel) for _ in range(layers))
        self.hook_x, self.hook_y = Hook(), Hook()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, y = block(x, y)
            x, y = self.hook_x(x), self.hook_y(y)
        return x + y


@pytest.mark.parametrize("parallel", [True, False])
def test_a_collective_joining_two_blocks_values_runs_in_the_later_block(parallel: bool) -> None:
    """A parallel block's backward all-reduces are joined: the one of the previous block's
    output x with the one of this block's ln1(y * scale) runs as one, placed in this block.
    It went to the previous block, the value it acts on first: that block was then called
    where the join is, before this block had computed ln1(y * scale) (KeyError)."""
    torch.manual_seed(0)
    model = TwoStreams(parallel)
    x, y = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    sim = autotp.simulate(model, 2, example_args=(x, y))
    program = sim.ranks[0].program
    assert all(isinstance(block, fx.GraphModule) for block in program.blocks)  # split

    assert_equivalent(model, sim, args=(x, y), grad_rtol=1e-5)
