"""Complex numbers: Meta-LLaMA-style rotary embeddings, against the unsharded model.

``view_as_complex`` -> multiply by a complex ``freqs_cis`` -> ``view_as_real`` on separate
q/k/v projections (torchtitan's llama3 and deepseek_v3 write it this way). A complex tensor
is a float tensor with a trailing (real, imaginary) pair: the heads stay sharded through it,
and it carries gradients. Compared on the same weights and inputs (``assert_equivalent``,
fp32): the output and the loss within 1e-5, every parameter's gradient within 1e-5 of its
largest entry, and the same after one SGD step on both.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent
from autotp.rules import embedding, matmul, misc, norms, pointwise, views
from autotp.rules.registry import Registry, RuleSet

HIDDEN, HEADS, HEAD_DIM, TOKENS = 64, 8, 8, 16
TOL = 1e-5


class ComplexRopeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN, bias=False)
                                              for _ in range(4))
        angles = torch.outer(torch.arange(TOKENS).float(),
                             1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, nh, hs)
        b, t = x.shape[:2]
        pairs = torch.view_as_complex(x.float().reshape(b, t, HEADS, -1, 2))
        turned = pairs * self.freqs_cis[:t].view(1, t, 1, HEAD_DIM // 2)
        return torch.view_as_real(turned).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        q, k = self.rotate(q), self.rotate(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("tp", [2, 4])
def test_complex_rotary_heads_stay_sharded_and_exact(tp: int) -> None:
    torch.manual_seed(0)
    model = ComplexRopeAttention().eval()
    x = torch.randn(2, TOKENS, HIDDEN)
    sim = autotp.simulate(model, tp, example_args=(x,))  # strict: every op has a rule
    layouts = {name: p.layout for name, p in sim.plan.params.items()}
    assert layouts == {"wq.weight": "S(0)", "wk.weight": "S(0)", "wv.weight": "S(0)",
                       "wo.weight": "S(1)"}, layouts
    assert not sim.plan.fallbacks
    # another sequence length than the traced one
    assert_equivalent(model, sim, args=(x[:, :12],), atol=TOL, grad_rtol=TOL)


def without_complex_rules() -> Registry:
    """The rules without those of the complex ops: strict=False computes them replicated."""
    complex_ops = {torch.ops.aten.view_as_complex.default, torch.ops.aten.view_as_real.default,
                   torch.ops.aten.polar.default}
    pruned = []
    for rule_set in (matmul.rules, pointwise.rules, views.rules, norms.rules, embedding.rules,
                     misc.rules):
        kept = RuleSet()
        kept.rules = {op: r for op, r in rule_set.rules.items() if op not in complex_ops}
        pruned.append(kept)
    return Registry(pruned)


def test_a_replicated_complex_region_sums_its_gradients() -> None:
    """Without the complex rules, strict=False computes the rotation replicated: the q and k
    gradients that flow back through it must be whole, not 1/tp of the true ones (complex
    values carry gradients like floats)."""
    torch.manual_seed(0)
    model = ComplexRopeAttention().eval()
    x = torch.randn(2, TOKENS, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, 2, example_args=(x,), strict=False,
                              registry=without_complex_rules())
    assert sim.plan.fallbacks, "the complex ops should have been computed replicated"
    assert_equivalent(model, sim, args=(x,), atol=TOL, grad_rtol=TOL)
