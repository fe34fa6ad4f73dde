"""Factories for the CLI tests (``path/to/file.py:factory``)."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayerMLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def mlp(width: int = 32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return TwoLayerMLP(width), (torch.randn(2, 8, width),)


def not_a_model() -> str:
    return "a string"


def nanogpt() -> nn.Module:
    from examples import nanogpt as nano

    torch.manual_seed(0)
    model = nano.GPT(nano.GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128,
                                    block_size=64))
    return model, (torch.randint(0, 128, (2, 16)),)


class NoisyMLP(nn.Module):
    """Dropout in every mode (``training=True``; verify runs in eval mode) on a sharded
    activation: the ranks draw other masks than the unsharded model; verify must see the
    mismatch and point at the dropout."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return x + self.down(nn.functional.dropout(h, 0.5, training=True))


def noisy_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return NoisyMLP(), (torch.randn(2, 8, 32),)


class BranchyMLP(nn.Module):
    """A branch on a tensor's value: torch.export cannot trace it symbolically; autotp follows
    the example's side (and says so) or refuses with its own message, never torch's dump."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if h.sum() > 0:
            h = h * 2
        return x + self.down(h)


def branchy_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return BranchyMLP(), (torch.randn(2, 8, 32),)


class Block(nn.Module):
    """A pre-norm transformer block, nanoGPT's: fused q|k|v, causal attention, an MLP of
    width ``d_ff``. Shapes: x (B, T, C), heads (B, nh, T, hs)."""

    def __init__(self, d_model: int = 32, n_head: int = 4, d_ff: int = 128) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(nn.functional.gelu(self.up(self.ln_2(x))))


class Blocks(nn.Module):
    """Two blocks in an nn.ModuleList."""

    def __init__(self, d_ff: int = 128) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d_ff=d_ff) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def blocks(d_ff: int = 128) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Megatron's plan at tp 2 and 4; at d_ff=98 and tp 4 the MLPs stay whole (non-strict)."""
    torch.manual_seed(0)
    return Blocks(d_ff), (torch.randn(2, 8, 32),)
