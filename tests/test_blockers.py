"""Every matrix the plan keeps whole although tp could shard it names the op that stops each
way of sharding it (planner/blockers.py), with the user's line: in the plan, the fallback
warnings, the table and the JSON of ``autotp plan``."""

from __future__ import annotations

import inspect
import json
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.presentation.report import to_json, to_table
from autotp.planner.cost import CostModel

H, HEADS = 64, 8


class _SoftmaxQuery(nn.Module):
    """Attention whose query is a softmax over all its features (every head's): no shard of
    the features passes it, so q stays whole."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = F.softmax(self.q(x), dim=-1)  # SOFTMAX
        q, k, v = (y.view(b, t, HEADS, H // HEADS).transpose(1, 2) for y in (q, self.k(x),
                                                                          self.v(x)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).flatten(2))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SoftmaxQuery() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(F.layer_norm(x, (H,)))
        return x


def _line(marker: str) -> int:
    lines, start = inspect.getsourcelines(_SoftmaxQuery)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def test_a_replicated_matrix_names_the_op_that_stops_its_shard() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autotp.plan(_Model(), 2, example_args=(torch.randn(2, 16, H),))
    where = f"test_blockers.py:{_line('# SOFTMAX')}"
    for layer in (0, 1):
        q = plan.blocked[f"layers.{layer}.q.weight"]
        assert [(b["direction"], b["op"], b["layout"]) for b in q] == \
            [("column", "aten.softmax.int", "S(2)")], q
        assert q[0]["source"].endswith(where) and f"layers.{layer}" in q[0]["source"]
    # k, v and o shard as Megatron's: q's whole heads are sliced, free, to meet k's
    assert set(plan.blocked) == {"layers.0.q.weight", "layers.1.q.weight"}
    assert plan.params["layers.0.o.weight"].layout == "S(1)"
    messages = [str(w.message) for w in caught if "layers.0.q.weight" in str(w.message)]
    assert messages and "stops at softmax.int" in messages[0] and where in messages[0]

    table = to_table(plan, CostModel())
    assert "why replicated: 2 matrices" in table
    assert f"softmax.int (layers.N  {where.split('/')[-1]}): as column, no strategy " \
        "takes S(2): layers.{0-1}.q.weight" in table
    data = json.loads(to_json(plan, CostModel()))
    assert data["why_replicated"]["layers.1.q.weight"][0]["module"] == "layers.1"
    assert data["why_replicated"]["layers.1.q.weight"][0]["source"].endswith(where)


def softmax_query() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model above for ``autotp plan tests/test_blockers.py:softmax_query``."""
    torch.manual_seed(0)
    return _Model(), (torch.randn(2, 16, H),)


def test_plan_and_explain_name_the_blocking_op() -> None:
    from tests.test_cli import autotp as run

    factory = f"{__file__}:softmax_query"
    where = f"test_blockers.py:{_line('# SOFTMAX')}"
    table = run("plan", factory, "--tp", "2").stdout
    assert f"softmax.int (layers.N  {where}): as column, no strategy takes S(2): " \
        "layers.{0-1}.q.weight" in table, table
    out = run("explain", factory, "--tp", "2", "layers.0.q.weight").stdout
    assert "what stops each way: softmax.int (layers.N  " + where in out, out
