"""Bad input gets an AutotpError that says what to change, never a deep internal trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.runtime.launch import run_processes
from autotp.verification.verify import assert_equivalent
from tests.models import BUILDERS, example


def test_tp_not_dividing_heads_names_valid_values() -> None:
    model = BUILDERS["gpt2"]()  # 8 heads
    with pytest.raises(autotp.PlanError, match=r"tp=3 does not divide the 8 attention heads; "
                                               r"use tp in \{1, 2, 4, 8\}"):
        autotp.plan(model, 3)


@pytest.mark.parametrize("tp", [0, -2, 2.0, "2", True])
def test_tp_must_be_a_positive_int(tp: object) -> None:
    with pytest.raises(autotp.ConfigError, match="tp must be a positive int"):
        autotp.plan(BUILDERS["gpt2"](), tp)  # type: ignore[arg-type]


def test_model_must_be_a_module() -> None:
    with pytest.raises(autotp.ConfigError, match="takes a torch.nn.Module"):
        autotp.plan(lambda x: x, 2)  # type: ignore[arg-type]


def test_parallelize_needs_a_process_group() -> None:
    with pytest.raises(autotp.ConfigError, match="initialized process group"):
        autotp.parallelize(BUILDERS["gpt2"](), tp=2)


def _tp_mismatch(rank: int, world_size: int) -> list[str]:
    """What parallelize says to degrees that do not fit the group: tp alone, ep and tp whose
    product is not the world, an ep group without its tp group."""
    import torch.distributed as dist
    from tests.models import BUILDERS

    out = []
    for kwargs in ({"tp": 4}, {"tp": 2, "ep": 2}, {"ep_group": dist.group.WORLD}):
        try:
            autotp.parallelize(BUILDERS["gpt2"](), **kwargs)
            out.append("no error")
        except autotp.ConfigError as exc:
            out.append(str(exc))
    return out


def test_tp_must_match_the_group() -> None:
    for tp, ep, no_group in run_processes(_tp_mismatch, 2, timeout=120):
        assert "tp=4 but the process group has 2 ranks" in tp, tp
        assert "tp=2 x ep=2 = 4 ranks, but the world has 2" in ep, ep
        assert "with ep_group=, pass group= too" in no_group, no_group


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor value
            return self.proj(x)
        return -self.proj(x)


def test_untraceable_model_names_the_user_line() -> None:
    # on meta: no values to follow the example's branch by (tests/test_branches.py does that)
    with torch.device("meta"):
        model = DataDependent()
    with pytest.raises(autotp.TraceError) as info:
        autotp.plan(model, 2, example_args=(torch.randn(2, 4, 8),))
    text = str(info.value)
    assert "test_errors.py" in text and "if x.sum() > 0" in text
    assert "torch.where" in text


class UsesAnOpWithoutRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.det(self.proj(x).reshape(-1, 2, 4, 2, 2).sum(2))


def test_op_without_rule_is_named_or_replicated_when_not_strict() -> None:
    model = UsesAnOpWithoutRule()
    x = torch.randn(2, 4, 8)
    with pytest.raises(autotp.NoRuleError, match=r"no layout rule for aten\._?linalg_det") as info:
        autotp.plan(model, 2, example_args=(x,))
    assert "test_errors.py" in str(info.value)
    plan = autotp.plan(model, 2, example_args=(x,), strict=False)
    assert any("linalg_det" in f for f in plan.fallbacks)
    sim = autotp.simulate(model, 2, example_args=(x,), strict=False)
    assert_equivalent(model, sim, args=(x,))


def test_untraceable_input_structure_is_refused_with_a_fix() -> None:
    """A call of another structure where the module cannot trace one (no copy of the
    model's structure) names the inputs and the fix."""
    model = BUILDERS["gpt2"]()
    args, kwargs = example("gpt2")
    sim = autotp.simulate(model, 2, example_args=args, example_kwargs=kwargs)
    ids = kwargs["input_ids"]
    sim.ranks[0].retracer = None
    with pytest.raises(autotp.ConfigError, match=r"this call has \['input_ids', 'labels'\]"
                                                 r".*pass this call's inputs as example_kwargs"):
        sim.ranks[0](input_ids=ids, labels=ids)


def test_an_equivalence_check_of_a_model_that_draws_random_numbers_says_to_use_eval() -> None:
    """Training-mode dropout draws other masks on the ranks than on the unsharded model: the
    check refuses with what to do, rather than reporting a difference; in eval mode the
    dropout is the identity and the same model passes."""
    from autotp.verification.verify import assert_equivalent

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"draws random numbers \(dropout.*model\.eval\(\)"):
        assert_equivalent(model, 2, args=(x,))
    assert_equivalent(model.eval(), 2, args=(x,))
