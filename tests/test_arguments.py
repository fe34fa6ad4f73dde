"""Rules read an op's arguments by the names its schema gives them, so every form of a call
(by position, by keyword, with its defaults written out or left out) plans the same.

Before rules read by name, a reader that took argument 1 of ``linalg_vector_norm`` as the
reduced dims got ``ord`` (2.0) and crashed the planner on any ``F.normalize`` after a
projection kept whole."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.capture.trace import make_call
from autotp.verification.testing import build_call
from autotp.verification.verify import assert_equivalent
from autotp.ops import argument
from autotp.rules.registry import Registry

from tests.test_rules import SAMPLES, _clone, _resolve

aten = torch.ops.aten


def _bound(op: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value given or None when left out), in schema order."""
    spec = op._schema.arguments
    given: dict[str, Any] = dict(kwargs)
    for arg, value in zip(spec, args):
        given[arg.name] = value
    return [(arg, given.get(arg.name, _MISSING)) for arg in spec]


_MISSING = object()


def _forms(op: Any, args: tuple, kwargs: dict) -> Iterator[tuple[str, tuple, dict]]:
    """The call as given; every positional argument written out (defaults included); the
    first argument by position and every other one by keyword; and by keyword with the
    arguments equal to their defaults left out."""
    bound = _bound(op, args, kwargs)
    yield "given", args, kwargs
    positional, keyword = [], {}
    for arg, value in bound:
        if value is _MISSING:
            if not arg.has_default_value():
                continue
            value = arg.default_value
        if arg.kwarg_only:
            keyword[arg.name] = value
        else:
            positional.append(value)
    yield "positional", tuple(positional), keyword
    first, *rest = [(a, v) for a, v in bound if v is not _MISSING]
    yield "keyword", (first[1],), {a.name: v for a, v in rest}
    yield "no defaults", (first[1],), {
        a.name: v for a, v in rest
        if not (a.has_default_value() and _same(v, a.default_value))}


def _same(value: Any, default: Any) -> bool:
    try:
        return type(value) is type(default) and bool(value == default)
    except (RuntimeError, TypeError):
        return False


def _strategies(registry: Registry, op: Any, args: tuple, kwargs: dict, tp: int) -> set:
    node = build_call(op, _clone(args), _clone(kwargs))
    call = make_call(node, tp, (1, 2, 3))
    return {(s.inputs, s.output) for s in registry.strategies(call)}


def _samples() -> Iterator[Any]:
    for op, samples in SAMPLES.items():
        if isinstance(op, str):
            continue  # another library's custom op: test_rules checks it when installed
        for index in range(len(samples)):
            yield pytest.param(op, index, id=f"{op}-{index}")


@pytest.mark.parametrize(("op", "index"), list(_samples()))
def test_every_argument_form_plans_the_same(op: Any, index: int) -> None:
    registry = Registry.default()
    args, kwargs = SAMPLES[op][index]
    op = _resolve(op)
    expected = _strategies(registry, op, args, kwargs, 2)
    for form, form_args, form_kwargs in list(_forms(op, args, kwargs))[1:]:
        got = _strategies(registry, op, form_args, form_kwargs, 2)
        assert got == expected, (
            f"{op} sample {index} passed {form}: {len(got)} strategies, "
            f"{len(expected)} as given; differ: {sorted(map(str, got ^ expected))[:4]}")


def test_arguments_are_read_by_their_schema_names() -> None:
    norm = aten.linalg_vector_norm.default
    x = torch.zeros(2, 3)
    assert argument(norm, (x, 2.0, [-1]), {}, "dim") == [-1]
    assert argument(norm, (x,), {"dim": [1], "ord": 1}, "dim") == [1]
    assert argument(norm, (x,), {}, "ord") == 2  # the schema's default
    assert argument(norm, (x,), {}, "dim") is None
    # a None default stands for the caller's meaning of "left out"
    assert argument(aten.pad.default, (x, [1, 1]), {}, "value", 0) == 0
    # keyword-only arguments are never read by position
    assert argument(aten.var.correction, (x, [1]), {"keepdim": True}, "keepdim") is True
    with pytest.raises(KeyError, match="no argument 'dims'"):
        argument(norm, (x,), {}, "dims")


class _CosineAttention(nn.Module):
    """q and k normalized per head (cosine-similarity attention), then a unit-norm head kept
    whole: ``F.normalize`` after a projection the plan keeps replicated."""

    def __init__(self, h: int = 64, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=4.0)
        return x + self.o(o.transpose(1, 2).flatten(2))


class _CosineModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CosineAttention() for _ in range(2))
        self.head = nn.Linear(64, 16, bias=False)  # narrow: kept whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.normalize(self.head(x), dim=-1)


@pytest.mark.parametrize("tp", [2, 4])
def test_normalize_after_a_whole_projection_plans_and_is_exact(tp: int) -> None:
    torch.manual_seed(0)
    model = _CosineModel()
    x = torch.randn(2, 16, 64)
    weights = torch.randn(2, 16, 16)  # a loss whose gradient is not 0 (|normalize| is 1)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (out * weights).sum()

    sim = autotp.simulate(model, tp, example_args=(x,))
    assert sim.plan.params["layers.0.o.weight"].layout != "R"
    # after the step the loss, a sum of 512 terms, is -90, where float32's spacing is 7.6e-6:
    # the ranks' sums land 2 spacings from the unsharded one (1.5e-5 at tp 4), outputs 3e-7
    assert_equivalent(model, sim, args=(x,), loss_fn=loss, atol=1e-4)
