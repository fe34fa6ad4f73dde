"""A parallel block that adds the residual between its branches' outputs
(``x = attn(h) + x; x = mlp(h) + x``, litgpt's form) sums the two
partial outputs first (``capture.sums``): one forward all-reduce of B x T x h per block, as
Megatron's parallel block, exact against the unsharded model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent

H, HEADS = 64, 8


class _ParallelBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = F.layer_norm(x, (H,))
        q, k, v = (y.view(b, t, HEADS, H // HEADS).transpose(1, 2)
                   for y in self.qkv(h).split(H, -1))
        attention = self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                              .transpose(1, 2).reshape(b, t, H))
        x = attention + x  # the residual between the branches
        return self.out(F.gelu(self.fc(h))) + x


class _Model(nn.Module):
    def __init__(self, block: type = _ParallelBlock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_parallel_block_with_the_residual_between_its_branches_reduces_once() -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 16, H)
    sim = autotp.simulate(model, 2, example_args=(x,))
    for layer in (0, 1):
        forward = [c for c in sim.plan.collectives if c.layer == layer and c.phase == "forward"]
        assert len(forward) == 1 and forward[0].kind == "all_reduce", forward
        assert "joined" not in forward[0].node  # one sum, not two values in one call
        assert forward[0].bytes_expr == str(sim.plan.collectives[0].bytes_expr)
    assert_equivalent(model, sim, args=(x,))


class _Branches(nn.Module):
    """vit-pytorch's ``Parallel``: ``sum([fn(x) for fn in fns])`` (a sum that starts from
    ``0``), each branch's output inside ``nn.Dropout`` (eval mode: the identity), and, in
    TransformerLens' way, an output weight used through a view of it:
    ``F.linear(z, W_O.permute(2, 0, 1).reshape(h, -1).contiguous(), b_O)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(H, 4 * H) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(4 * H, H) for _ in range(2))
        self.w_o = nn.Parameter(torch.randn(HEADS, 4 * H // HEADS, H) / 16)
        self.b_o = nn.Parameter(torch.randn(H) / 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (H,))
        branches = [self.drop(out(F.gelu(fc(h)))) for fc, out in zip(self.fc, self.out)]
        w = self.w_o.permute(2, 0, 1).reshape(H, -1).contiguous()
        branches.append(F.linear(F.gelu(self.fc[0](h)), w, self.b_o))
        return sum(branches) + x


def test_branches_summed_from_zero_through_eval_dropout_reduce_once() -> None:
    """``0 + a``, eval-mode dropout and a weight's views hide nothing: the three partial
    products are added first, one forward all-reduce per block."""
    torch.manual_seed(0)
    model, x = _Model(_Branches).eval(), torch.randn(2, 16, H)
    sim = autotp.simulate(model, 2, example_args=(x,))
    for layer in (0, 1):
        forward = [c for c in sim.plan.collectives if c.layer == layer and c.phase == "forward"]
        assert len(forward) == 1 and "joined" not in forward[0].node, sim.plan.summary()
    assert_equivalent(model, sim, args=(x,))
