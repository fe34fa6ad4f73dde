"""Rules derived from op semantics (``autotp.rules.derived``), checked numerically.

Every ATen op torch tags pointwise that no hand-written rule names gets the elementwise
strategies from the tag alone. Each is checked here as the hand-written ones are in
test_rules.py: samples built from the op's schema (a [8, 12] operand, a second operand
broadcast along dim 0, scalars from the schema's defaults), every strategy sharded, run per
rank, reassembled and compared with the unsharded op. Ops with a decomposition and no rule are
planned through it: a model full of such ops plans at Megatron's bound and runs exact.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.testing import check_op
from autotp.verification.verify import assert_equivalent, perturb
from autotp.rules.derived import is_pointwise
from autotp.rules.registry import Registry

aten = torch.ops.aten
TPS = (2, 4)


def derived_pointwise_ops() -> list[Any]:
    registry = Registry.default()
    found = []
    for name in sorted(dir(aten)):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if is_pointwise(op) and not registry.written(op):
                found.append(op)
    return found


def _operand(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator
             ) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(1, 7, shape, generator=generator, dtype=dtype)
    # inside every domain (acos, atanh, logit, erfinv, log): (0.1, 0.9)
    return torch.rand(shape, generator=generator, dtype=dtype) * 0.8 + 0.1


def _scalar(argument: Any, floating: bool) -> Any:
    if argument.has_default_value() and argument.default_value is not None:
        return argument.default_value
    kind = str(argument.type)
    if "int" in kind:
        return 2
    return 0.5 if floating else 2


def samples(op: Any) -> Iterator[tuple[tuple, dict]]:
    """Argument lists from the schema: every tensor of one dtype, the second one broadcast."""
    schema = op._schema
    for dtype in (torch.float32, torch.int64, torch.bool):
        generator = torch.Generator().manual_seed(0)
        args, kwargs, tensors = [], {}, 0
        for argument in schema.arguments:
            if argument.name == "out":
                continue
            if isinstance(argument.type, torch.TensorType):
                shape = (8, 12) if tensors == 0 else (12,)
                value: Any = _operand(dtype, shape, generator)
                tensors += 1
            elif argument.kwarg_only:
                if argument.has_default_value():
                    continue
                value = _scalar(argument, dtype.is_floating_point)
            else:
                value = _scalar(argument, dtype.is_floating_point)
            if argument.kwarg_only:
                kwargs[argument.name] = value
            else:
                args.append(value)
        yield tuple(args), kwargs


def first_sample(op: Any) -> Optional[tuple[tuple, dict]]:
    """The first sample the unsharded op computes finitely, or None."""
    for args, kwargs in samples(op):
        try:
            out = op(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a dtype the op does not take: the next one
            continue
        if isinstance(out, torch.Tensor) and (not out.is_floating_point()
                                              or bool(out.isfinite().all())):
            return args, kwargs
    return None


OPS = derived_pointwise_ops()


def test_the_pointwise_tag_covers_ops_without_a_written_rule() -> None:
    """More than a hundred ops get a rule from the tag alone; nearly all can be sampled."""
    assert len(OPS) > 100
    unsampled = [str(op) for op in OPS if first_sample(op) is None]
    assert len(unsampled) <= len(OPS) // 10, unsampled


@pytest.mark.parametrize("tp", TPS)
def test_every_derived_pointwise_strategy_is_exact(tp: int) -> None:
    failing, checked = [], 0
    for op in OPS:
        sample = first_sample(op)
        if sample is None:
            continue
        args, kwargs = sample
        checks = check_op(op, args, kwargs, tp=tp, blocks=(1,))
        sharded = [c for c in checks if "pointwise" in c.strategy.name]
        if not sharded:
            failing.append(f"{op}: no sharded strategy")
        failing += [f"{op} {c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
        checked += 1
    assert checked > 100
    assert not failing, "\n".join(failing)


def test_random_and_mutating_ops_get_no_derived_rule() -> None:
    assert not is_pointwise(aten.bernoulli.p)  # draws random numbers
    assert not is_pointwise(aten.add_.Tensor)  # in place: capture makes it functional first
    assert not is_pointwise(aten.add.out)
    assert is_pointwise(aten.hypot.default)


class _Block(nn.Module):
    """Attention and an MLP whose activations are ops no hand-written rule names: some
    tagged pointwise (nan_to_num, hypot, logaddexp, selu), some only decomposable
    (hardswish, reshape_as)."""

    def __init__(self, h: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for y in self.qkv(self.n1(x)).chunk(3, -1))
        q = torch.nan_to_num(q) * torch.hypot(k, torch.sigmoid(k))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape_as(x))
        u = self.up(self.n2(x))
        u = F.hardswish(u) + torch.logaddexp(u, 0.5 * u) + F.selu(u)
        return x + self.down(u)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("tp", TPS)
def test_ops_without_a_written_rule_plan_at_the_bound_and_run_exact(tp: int) -> None:
    torch.manual_seed(0)
    model = perturb(_Model()).eval()
    ids = torch.randint(0, 64, (2, 8))
    plan = autotp.plan(model, tp=tp, example_args=(ids,))  # strict: no op without a rule
    assert plan.fallbacks == []
    for name in ("qkv", "up"):
        assert plan.params[f"layers.0.{name}.weight"].layout.startswith("S(0)"), name
    for name in ("o", "down"):
        assert plan.params[f"layers.0.{name}.weight"].layout == "S(1)", name
    counts = plan.per_layer()
    for layer in (0, 1):
        assert sum(1 for r in plan.collectives if r.layer == layer
                   and r.phase == "forward") == 2, (counts, plan.summary())
    assert_equivalent(model, tp, args=(ids,), atol=1e-5, grad_rtol=1e-4)
