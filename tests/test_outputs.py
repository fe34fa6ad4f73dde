"""A model that returns its own output container (a dataclass, nested ones, a NamedTuple, a
plain object) traces, and the sharded module returns the same type with the same fields.

Each model is an MLP block whose hidden activation is sharded and returned too (gathered for
the user), compared with the unsharded model on the same weights and inputs
(``assert_equivalent``, fp32): every tensor field within 1e-5 (max abs), the loss (the sum of
the fields' mean squares) within 1e-5, every parameter's gradient within 1e-5 of its largest
entry, and the same after one SGD step on both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import autotp
from autotp.capture.outputs import register_containers
from autotp.verification.verify import assert_equivalent

ATOL, RTOL = 1e-5, 1e-5


@dataclass
class BlockOutput:
    logits: torch.Tensor
    hidden: torch.Tensor
    depth: int = 1  # a non-tensor field, returned as it is
    aux: Optional[torch.Tensor] = None  # a field left None


@dataclass(frozen=True)
class Parts:
    gate: torch.Tensor
    name: str = "mlp"


@dataclass
class NestedOutput:
    logits: torch.Tensor
    parts: Parts
    extra: list[Parts]  # dataclasses inside a list


class Pair(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


class PlainOutput:  # no dataclass: fields set by __init__
    def __init__(self, logits: torch.Tensor, scale: float) -> None:
        self.logits = logits
        self.scale = scale


class Block(nn.Module):
    """x + down(gelu(up(x))), returned in the container ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> Any:
        hidden = torch.nn.functional.gelu(self.up(x))  # (B, T, 128), sharded on 128
        logits = x + self.down(hidden)  # (B, T, 32)
        if self.kind == "dataclass":
            return BlockOutput(logits=logits, hidden=hidden)
        if self.kind == "nested":
            return NestedOutput(logits, Parts(hidden.sigmoid()), [Parts(hidden * 2, "twice")])
        if self.kind == "namedtuple":
            return Pair(logits, hidden)
        return PlainOutput(logits, 0.5)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _all_fields(out: Any) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in _tensors(out)])


def _loss(out: Any) -> torch.Tensor:
    return sum(x.square().mean() for x in _tensors(out))  # type: ignore[return-value]


def _same_structure(got: Any, want: Any) -> None:
    """The same type at every level, the same fields, the same non-tensor values."""
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape
        return
    if dataclasses.is_dataclass(want):
        assert [f.name for f in dataclasses.fields(got)] == \
            [f.name for f in dataclasses.fields(want)]
        for f in dataclasses.fields(want):
            _same_structure(getattr(got, f.name), getattr(want, f.name))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same_structure(g, w)
    elif hasattr(want, "__dict__"):
        assert list(vars(got)) == list(vars(want))
        for key in vars(want):
            _same_structure(vars(got)[key], vars(want)[key])
    else:
        assert got == want


CONTAINERS = ["dataclass", "nested", "namedtuple", "plain"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", CONTAINERS)
def test_own_output_container_equals_the_unsharded_model(kind: str, tp: int) -> None:
    torch.manual_seed(0)
    model, x = Block(kind), torch.randn(2, 5, 32)
    sim = autotp.simulate(model, tp, example_args=(x,))
    assert sim.plan.count("forward") >= 1  # the block is sharded: its output is assembled
    assert_equivalent(model, sim, args=(x,), pick=_all_fields, loss_fn=_loss,
                      atol=ATOL, grad_rtol=RTOL)
    want = model(x)
    for got in sim.run(lambda rank: rank(x)):
        _same_structure(got, want)
        for g, w in zip(_tensors(got), _tensors(want)):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_a_container_type_is_registered_once_and_never_a_known_one() -> None:
    @dataclass
    class Fresh:
        value: torch.Tensor

    assert register_containers(Fresh(torch.ones(2))) == [Fresh]
    assert register_containers([Fresh(torch.ones(2))]) == []  # known now
    assert register_containers(Pair(torch.ones(1), torch.ones(1))) == []  # pytree knows these
    transformers = pytest.importorskip("transformers")
    output = transformers.modeling_outputs.CausalLMOutput(logits=torch.ones(1))
    assert register_containers(output) == []  # transformers registers its own


class Settings:  # an object holding no tensor is not an output container
    def __init__(self) -> None:
        self.depth = 2


@pytest.mark.parametrize("value", [Settings(), 3, "text", None, torch.float32])
def test_what_holds_no_tensor_is_left_alone(value: Any) -> None:
    assert register_containers(value) == []
    assert type(value) is type(None) or type(value) not in pytree.SUPPORTED_NODES
