"""A user's own op: replicated and named without a rule, sharded with one
(``autotp.register_rule``), a wrong rule refused by its numbers, a missing fake kernel
explained."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent


@torch.library.custom_op("autotp_test::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A grouped expert product: x [E, n, h] @ w [E, h, f] -> [E, n, f]."""
    return torch.bmm(x, w)


@expert_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


def _expert_mm_backward(ctx, grad):  # noqa: ANN001 - torch.library's autograd signature
    x, w = ctx.saved_tensors
    return expert_mm(grad, w.transpose(1, 2)), expert_mm(x.transpose(1, 2), grad)


def _save(ctx, inputs, output):  # noqa: ANN001
    ctx.save_for_backward(*inputs)


expert_mm.register_autograd(_expert_mm_backward, setup_context=_save)


@torch.library.custom_op("autotp_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Experts(nn.Module):
    """Every token through every expert's MLP (dense experts), the products a custom op."""

    def __init__(self, experts: int = 4, h: int = 16, f: int = 32):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, h, f) / h ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, f, h) / f ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x.unsqueeze(0).expand(self.up.shape[0], -1, -1)  # [E, n, h]
        y = expert_mm(torch.relu(expert_mm(routed, self.up)), self.down)
        return y.sum(0)


@pytest.fixture
def rule() -> Iterator[None]:
    autotp.register_rule(expert_mm, ["S(0), S(0) -> S(0)", "R, S(2) -> S(2)",
                                     "S(2), S(1) -> P"],
                         example=(torch.randn(4, 3, 8), torch.randn(4, 8, 6)))
    yield
    autotp.unregister_rule(expert_mm)


def test_a_custom_op_without_a_rule_runs_replicated_and_is_named() -> None:
    torch.manual_seed(0)
    model, x = Experts(), torch.randn(6, 16)
    plan = autotp.plan(model, 2, example_args=(x,))  # strict, yet no NoRuleError
    named = [f for f in plan.fallbacks if "autotp_test.expert_mm" in f]
    assert len(named) == 2 and all("autotp.register_rule" in f for f in named), plan.fallbacks
    assert plan.params["up"].layout == "R" and plan.params["down"].layout == "R"
    assert_equivalent(model, 2, args=(x,))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_registered_rule_shards_the_custom_op_exactly(rule: None, tp: int) -> None:
    torch.manual_seed(0)
    model, x = Experts(), torch.randn(6, 16)
    plan = autotp.plan(model, tp, example_args=(x,))
    assert plan.fallbacks == []
    assert plan.params["up"].layout.startswith("S(") and \
        plan.params["down"].layout.startswith("S("), plan.summary()
    assert_equivalent(model, tp, args=(x,), atol=1e-5, grad_rtol=1e-4)


def test_a_rule_that_contradicts_the_op_is_refused_naming_the_strategy() -> None:
    with pytest.raises(autotp.RuleError, match=r"autotp_test::expert_mm.*strategy "
                                               r"\(S\(1\), S\(1\)\) -> S\(1\)"):
        autotp.register_rule("autotp_test::expert_mm", ["S(1), S(1) -> S(1)"],
                             example=(torch.randn(4, 4, 8), torch.randn(4, 8, 6)))
    # refused rules are not kept: the op runs replicated again
    plan = autotp.plan(Experts(), 2, example_args=(torch.randn(6, 16),))
    assert plan.params["up"].layout == "R"


def test_bad_registrations_say_what_to_write() -> None:
    with pytest.raises(autotp.ConfigError, match=r"not a pattern.*R, S\(2\) -> S\(2\)"):
        autotp.register_rule(expert_mm, ["S(0) S(0)"])
    with pytest.raises(autotp.ConfigError, match="already has a rule for aten::mm"):
        autotp.register_rule(torch.ops.aten.mm.default, ["R, S(1) -> S(1)"])
    with pytest.raises(autotp.ConfigError, match="one of strategies"):
        autotp.register_rule(expert_mm)


@torch.library.custom_op("autotp_test::squash", mutates_args=())
def squash(x: torch.Tensor) -> torch.Tensor:
    """An elementwise activation of the user's own."""
    return x * torch.tanh(x)


@squash.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


squash.register_autograd(
    lambda ctx, grad: grad * (torch.tanh(ctx.x) + ctx.x * (1 - torch.tanh(ctx.x) ** 2)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))


class SquashMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(squash(self.up(x)))


def test_a_pointwise_declaration_keeps_the_mlp_sharded() -> None:
    torch.manual_seed(0)
    model, x = SquashMLP(), torch.randn(2, 3, 8)
    before = autotp.plan(model, 2, example_args=(x,))
    assert any("autotp_test.squash" in f for f in before.fallbacks)
    autotp.register_rule(squash, pointwise=True, example=(torch.randn(8, 12),))
    try:
        plan = autotp.plan(model, 2, example_args=(x,))
        assert plan.fallbacks == []
        assert plan.params["up.weight"].layout == "S(0)" and \
            plan.params["down.weight"].layout == "S(1)", plan.summary()
        assert_equivalent(model, 2, args=(x,))
    finally:
        autotp.unregister_rule(squash)


def test_a_custom_op_without_a_fake_kernel_is_explained() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return no_fake(self.proj(x))

    with pytest.raises(autotp.TraceError, match=r"autotp_test::no_fake is a custom op with no "
                                                r"fake kernel(.|\n)*register_fake(.|\n)*"
                                                r"autotp.register_rule"):
        autotp.plan(Model(), 2, example_args=(torch.randn(2, 3, 8),))
