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
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(here), "examples"))
    import nanogpt as nano

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
