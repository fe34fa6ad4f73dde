"""Branches in forward (``autotp.capture.branches``): a comparison of sizes that every traced
size decides (``is_causal=T > 1``) traces as a bool; a branch the trace cannot decide is a
TraceError naming the user's line and ways forward, and each way forward is exact."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent


class Branchy(nn.Module):
    """Attention and MLP over (B, T, 32), 4 heads; ``kind`` picks how forward branches."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, 4, C // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.kind == "size_decided":
            z = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif self.kind == "size_open":
            z = F.scaled_dot_product_attention(q, k, v, is_causal=T > 8)
        elif self.kind == "size_checked":
            torch._check(T > 8)
            z = F.scaled_dot_product_attention(q, k, v, is_causal=T > 8)
        else:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = x + self.o(z.transpose(1, 2).reshape(B, T, C))
        h = self.fc2(F.gelu(self.fc1(y)))
        if self.kind == "tensor":
            if h.sum() > 0:
                return y + h
            return y - h
        if self.kind == "item":
            n = h.abs().max().item()
            if n < 100:
                return y + h
            return y - h
        if self.kind == "where":
            return y + torch.where(h.sum() > 0, h, -h)
        if self.kind == "item_checked":
            n = h.abs().max().item()
            torch._check(n < 100)
            return y + h if n < 100 else y - h
        if self.kind == "flag":
            return y + h if causal else y - h
        if self.kind == "mask":  # ESM's `if not padding_mask.any(): padding_mask = None`
            padding = x[..., 0] == 0
            if padding.any():
                return (y + h) * padding.logical_not()[..., None]
        return y + h


def _refusal(kind: str, seq: int = 16, meta: bool = False) -> str:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Branchy(kind)
    with pytest.raises(autotp.TraceError) as info:
        autotp.plan(model, 2, example_args=(torch.randn(2, seq, 32),))
    return str(info.value)


@pytest.mark.parametrize("kind, line, meta", [
    ("tensor", r"if h\.sum\(\) > 0:", True),  # no values to follow the example's branch by
    ("item", r"if n < 100:", False),  # .item() steering Python: not followed
])
def test_a_branch_on_tensor_values_is_refused_with_ways_forward(kind: str, line: str,
                                                               meta: bool) -> None:
    text = _refusal(kind, meta=meta)
    assert re.search(rf"test_branches\.py:\d+: {line}", text), text
    for way in ("torch.where(condition, a, b)", "torch._check(n > 0)",
                "pass the flag as a Python bool argument (in example_kwargs)"):
        assert way in text, text
    assert "torch.cond" not in text  # non-strict export cannot capture it


def test_a_size_comparison_the_sizes_leave_open_is_refused_with_ways_forward() -> None:
    text = _refusal("size_open")
    assert re.search(
        r"test_branches\.py:\d+: z = F\.scaled_dot_product_attention\(q, k, v, "
        r"is_causal=T > 8\)", text), text
    for way in ("torch._check(T > 8)",
                "pass the flag as a Python bool argument (in example_kwargs)"):
        assert way in text, text


def _exact(model: nn.Module, kwargs: dict[str, Any], sim: Any) -> None:
    """Outputs, loss, every gradient and one SGD step of ``sim``'s ranks against ``model`` on
    ``kwargs``."""
    assert_equivalent(model, sim, kwargs=kwargs, grad_rtol=1e-5)


def test_a_size_comparison_every_size_decides_traces_as_a_bool() -> None:
    """``is_causal=T > 1`` (a SymBool, which sdpa refuses) is True for every traced T >= 2: the
    trace passes True, T stays symbolic, and other lengths run exact too."""
    torch.manual_seed(0)
    model = Branchy("size_decided")
    sim = autotp.simulate(model, 2, example_args=(torch.randn(2, 16, 32),))
    for seq in (16, 5):
        _exact(model, {"x": torch.randn(2, seq, 32)}, sim)


@pytest.mark.parametrize("kind", ["where", "item_checked", "flag", "size_checked"])
def test_the_ways_forward_are_exact(kind: str) -> None:
    """Each way forward the refusals print traces and runs exact; what it does not cover is
    refused at the call, not run wrong. A flag the call gives another value of is another
    input structure: traced on first use, exact too."""
    torch.manual_seed(0)
    model = Branchy(kind)
    x = torch.randn(2, 16, 32)
    example = {"x": x, "causal": False} if kind == "flag" else {"x": x}
    sim = autotp.simulate(model, 2, example_kwargs=example)
    _exact(model, example, sim)
    if kind == "flag":
        _exact(model, {"x": x, "causal": True}, sim)
        return
    if kind == "size_checked":
        outside: dict[str, Any] = {"x": torch.randn(2, 4, 32)}
        outside = {"x": torch.randn(2, 4, 32)}
    elif kind == "item_checked":
        outside = {"x": 1e4 * x}
    else:
        return
    with pytest.raises((AssertionError, RuntimeError),
                       match="Guard failed|Runtime assertion failed"):
        sim.run(lambda m: m(**outside))


def test_a_branch_on_a_tensor_is_traced_as_the_example_takes_it_and_checked() -> None:
    """ESM's padding branch: the example has no padding, so the trace takes that side,
    exact for inputs that take it too; an input that takes the other side is refused where
    the branch is, never run on the traced side."""
    torch.manual_seed(0)
    model = Branchy("mask")
    x = torch.randn(2, 16, 32)
    with pytest.warns(UserWarning, match=r"test_branches\.py:\d+: if padding\.any\(\):.*"
                      r"bool\(\.\.\.\) is False"):
        sim = autotp.simulate(model, 2, example_args=(x,))
    _exact(model, {"x": x}, sim)
    padded = x.clone()
    padded[0, 3, 0] = 0.0
    with pytest.raises(RuntimeError, match=r"autotp traced the branch at .*test_branches\.py"):
        sim.run(lambda module: module(padded))
