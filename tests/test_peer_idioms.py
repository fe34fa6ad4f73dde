"""Idioms of other codebases' model code that broke autotp, against the unsharded model.

Each model is small and written here in the style of the codebase it follows; each is run in
simulation and compared on the same weights and inputs: every output and every parameter's
gradient, within 1e-5 relative to the largest entry (fp32).

- a module list whose entries hold no parameters (x-transformers keeps ``[norm, block,
  residual]`` per layer; its Residual holds nothing)
- a submodule of one layer called again from outside it (diffusers' DiT runs
  ``transformer_blocks[0].norm1.emb`` again for its final conditioning)
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp

RTOL = 1e-5


class ParameterFreeEntries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64),
                                     nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class AdaNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.linear = nn.Linear(8, 64), nn.Linear(64, 128)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(self.emb(c))).chunk(2, -1)
        return x * (1 + scale[:, None]) + shift[:, None]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.fc1, self.fc2 = AdaNorm(), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm1(x, c))))


class ReusedSubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.out = nn.ModuleList([Block(), Block()]), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c)
        return self.out(x) + self.blocks[0].norm1.emb(c)[:, None]


def check_exact(model: nn.Module, args: tuple, tp: int, **options: Any) -> autotp.Simulation:
    """The sharded model's output and gradients equal the unsharded model's."""
    reference = copy.deepcopy(model)
    want = reference(*args)
    want.square().sum().backward()
    sim = autotp.simulate(model, tp, example_args=args, **options)

    def step(rank: nn.Module) -> tuple[torch.Tensor, dict]:
        out = rank(*args)
        out.square().sum().backward()
        return out.detach(), autotp.full_state_dict(rank, grads=True)

    for out, grads in sim.run(step):
        scale = want.abs().max().item()
        assert (out - want).abs().max().item() <= RTOL * scale
        for name, param in reference.named_parameters():
            diff = (grads[name] - param.grad).abs().max().item()
            assert diff <= RTOL * param.grad.abs().max().item(), f"{name}: off by {diff:.1e}"
    return sim


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    "parameter-free entries": (ParameterFreeEntries, lambda: (torch.randn(2, 16, 64),)),
    "reused submodule": (ReusedSubmodule, lambda: (torch.randn(2, 16, 64), torch.randn(2, 8))),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_splitting_keeps_what_it_cannot_split_in_the_root(name: str, tp: int) -> None:
    build, inputs = CASES[name]
    torch.manual_seed(0)
    sim = check_exact(build(), inputs(), tp)
    rank = sim.ranks[0]
    if name == "reused submodule":  # the layers are split, the root still reaches emb
        assert isinstance(rank.program.blocks[0], torch.fx.GraphModule)
        assert rank.program.get_parameter("blocks.0.norm1.emb.weight") is not None
    else:  # the entries with parameters are layers; the others run in the root
        for path in ("layers.0", "layers.2"):
            assert isinstance(rank.program.get_submodule(path), torch.fx.GraphModule)
