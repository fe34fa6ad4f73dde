"""Idioms of other codebases' model code that broke autotp, against the unsharded model.

Each model is small and written here in the style of the codebase it follows; each is run in
simulation and compared on the same weights and inputs (``assert_equivalent``, fp32): the
output and the loss (the output's mean square) within 1e-5, every parameter's gradient within
1e-5 of its largest entry, and the same after one SGD step on both.

- a module list whose entries hold no parameters (x-transformers keeps ``[norm, block,
  residual]`` per layer; its Residual holds nothing)
- a submodule of one layer called again from outside it (diffusers' DiT runs
  ``transformer_blocks[0].norm1.emb`` again for its final conditioning)
- a tensor passed through ``**kwargs`` (x-transformers' ``TransformerWrapper(x,
  context=...)``, peft's ``PeftModel(**inputs)``), and a dict input that holds no tensor
  (diffusers' PixArt ``added_cond_kwargs={"resolution": None}``)
- timm's attention: ``qkv(x).reshape(B, N, 3, heads, hs).permute(2, 0, 3, 1, 4).unbind(0)``
  (the fused projection column-parallel in 3 blocks, the heads sharded, Megatron's plan)
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent

ATOL, RTOL = 1e-5, 1e-5  # outputs and loss: max abs; gradients: of each one's largest entry


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


def check_exact(model: nn.Module, args: tuple, tp: int, kwargs: Any = None,
                **options: Any) -> autotp.Simulation:
    """The sharded model's output, loss, gradients and one SGD step equal the unsharded
    model's (``assert_equivalent``)."""
    kwargs = kwargs or {}
    sim = autotp.simulate(model, tp, example_args=args or None, example_kwargs=kwargs or None,
                          **options)
    assert_equivalent(model, sim, args=args, kwargs=kwargs, atol=ATOL, grad_rtol=RTOL)
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


class ContextThroughKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ctx = nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = x + self.ctx(kwargs["context"]).mean(1, keepdim=True)
        return self.fc2(F.gelu(self.fc1(h)))


class DictOfNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, added_cond_kwargs: Any = None) -> torch.Tensor:
        assert added_cond_kwargs["resolution"] is None
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_through_kwargs_is_an_input(tp: int) -> None:
    torch.manual_seed(0)
    model = ContextThroughKwargs()
    sim = check_exact(model, (), tp, {"x": torch.randn(2, 16, 64),
                                      "context": torch.randn(2, 8, 64)})
    assert not sim.plan.fallbacks
    # other batch and context lengths than the traced ones, the context by keyword
    x, context = torch.randn(3, 5, 64), torch.randn(3, 7, 64)
    assert_equivalent(model, sim, args=(x,), kwargs={"context": context}, atol=ATOL,
                      grad_rtol=RTOL)


def test_a_dict_input_without_tensors_is_accepted() -> None:
    torch.manual_seed(0)
    check_exact(DictOfNone(), (), 2, {"x": torch.randn(2, 16, 64),
                                      "added_cond_kwargs": {"resolution": None}})


class TimmAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = 8
        self.qkv, self.proj = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, N, hs)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("tp", [2, 4])
def test_timm_attention_shards_the_fused_qkv_by_heads(tp: int) -> None:
    torch.manual_seed(0)
    sim = check_exact(TimmAttention(), (torch.randn(2, 16, 64),), tp)
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"qkv.weight": "S(0)x3", "proj.weight": "S(1)"}, layouts
    assert not sim.plan.fallbacks
    forward = [c for c in sim.plan.collectives if c.phase == "forward"]
    assert [c.kind for c in forward] == ["all_reduce"], sim.plan.summary()


class L2QKNorm(nn.Module):
    """x-transformers' ``attn_qk_norm``: ``F.normalize`` of q and k over each head's dims."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, 8, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, scale=10.0)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize("tp", [2, 4])
def test_per_head_l2_norm_keeps_the_heads_sharded(tp: int) -> None:
    torch.manual_seed(0)
    sim = check_exact(L2QKNorm(), (torch.randn(2, 16, 64),), tp)
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)",
                       "o.weight": "S(1)"}, layouts


class AutocastRotary(nn.Module):
    """x-transformers' rotary embedding runs under ``@disable_autocast``; a projection run
    under ``autocast(bfloat16)`` checks that the region's casts are kept in the rank program."""

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, 8, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            q = q * freqs.cos() + torch.cat((-q[..., 4:], q[..., :4]), -1) * freqs.sin()
            k = k * freqs.cos() + torch.cat((-k[..., 4:], k[..., :4]), -1) * freqs.sin()
            k = k @ torch.eye(8)  # a product: bfloat16 inside an enabled region
        y = F.scaled_dot_product_attention(q, k.float(), v)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "bfloat16"])
def test_an_autocast_region_is_planned_op_by_op(tp: int, enabled: bool) -> None:
    torch.manual_seed(0)
    sim = check_exact(AutocastRotary(enabled), (torch.randn(2, 16, 64),), tp)
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)",
                       "o.weight": "S(1)"}, layouts
    assert not sim.plan.fallbacks
    targets = {n.target for n in sim.ranks[0].program.graph.nodes}
    assert torch.amp._enter_autocast in targets or any(
        isinstance(m, torch.fx.GraphModule) and torch.amp._enter_autocast in
        {n.target for n in m.graph.nodes} for m in sim.ranks[0].program.modules())


class LoopMaskAttention(nn.Module):
    """litgpt builds Gemma-2's sliding-window mask in a Python loop over positions
    (``fill_`` and ``select_scatter`` on a tensor made from no input), and ``torch.eye`` is a
    factory with no layout rule: both are constants, computed replicated. (No biases: a key
    bias's gradient is zero in exact arithmetic, left as rounding noise.)"""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        mask = torch.zeros(16, 16, dtype=torch.bool)
        for i in range(16):  # a window of 4 positions, the loop unrolled by the trace
            row = torch.zeros(16, dtype=torch.bool)
            row[max(0, i - 3):i + 1].fill_(True)
            mask = torch.select_scatter(mask, row, 0, i)
        mask = mask & (torch.eye(16) < 2)
        q, k, v = (lin(x).view(b, n, 8, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:n, :n])
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize("tp", [2, 4])
def test_constants_are_computed_replicated_not_fallbacks(tp: int) -> None:
    torch.manual_seed(0)
    sim = check_exact(LoopMaskAttention(), (torch.randn(2, 16, 64),), tp)  # strict by default
    assert not sim.plan.fallbacks
    assert any("eye" in text for text in sim.plan.constants), sim.plan.constants
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)",
                       "o.weight": "S(1)"}, layouts
    per = sim.plan.per_layer()
    # o's all-reduce forward; nothing backward (the input takes no gradient)
    assert dict(per[None]) == {("forward", "all_reduce"): 1}, per


class RandomFactory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.special.ndtri(torch.rand(64).clamp(0.01, 0.99))


def test_a_random_factory_is_no_constant() -> None:
    """A draw from no input differs per call: it is not a constant (refused, with its line)."""
    model = RandomFactory()
    with pytest.raises(autotp.AutotpError, match="test_peer_idioms.py"):
        autotp.plan(model, 2, example_args=(torch.randn(2, 4, 64),))


class LoraMlp(nn.Module):
    """peft's ``lora.Linear``: ``base(x) + lora_B(lora_A(x)) * scaling`` (rank 4) on the
    column-parallel half of an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 256)
        self.lora_A, self.lora_B = nn.Linear(64, 4, bias=False), nn.Linear(4, 256, bias=False)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.base(x) + self.lora_B(self.lora_A(x)) * 2.0))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_low_rank_adapter_costs_no_collective(tp: int) -> None:
    """lora_A (4 x 64) is narrow: replicated beside the column-parallel base, lora_B
    column-parallel with it, so the block keeps its one all-reduce forward (sharding lora_A
    along its rank of 4 saved 1 KiB and cost an all-reduce per adapter)."""
    torch.manual_seed(0)
    model = LoraMlp()
    with torch.no_grad():
        model.lora_B.weight.normal_(0, 0.02)  # peft starts it at zero: a zero gradient path
    x = torch.randn(2, 16, 64, requires_grad=True)
    sim = check_exact(model, (x,), tp)
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"base.weight": "S(0)", "lora_A.weight": "R", "lora_B.weight": "S(0)",
                       "down.weight": "S(1)"}, layouts
    assert dict(sim.plan.per_layer()[None]) == {("forward", "all_reduce"): 1,
                                                ("backward", "all_reduce"): 1}


class AdaLNZeroBlock(nn.Module):  # DiT: shift, scale and gate from the conditioning vector c
    def __init__(self, h: int = 64) -> None:
        super().__init__()
        self.mod, self.fc1, self.fc2 = nn.Linear(h, 3 * h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(c)).chunk(3, -1)
        y = F.layer_norm(x, x.shape[-1:]) * (1 + scale[:, None]) + shift[:, None]
        return x + gate[:, None] * self.fc2(F.gelu(self.fc1(y)))


class AdaLNZero(nn.Module):
    def __init__(self, layers: int = 4, embed_input: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64) if embed_input else None  # c takes a gradient
        self.t_embed = nn.Sequential(nn.Linear(8, 64), nn.SiLU(), nn.Linear(64, 64))
        self.blocks = nn.ModuleList([AdaLNZeroBlock() for _ in range(layers)])

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c = self.t_embed(t)
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x, c)
        return x


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("embed_input", [True, False])
def test_adaln_modulation_is_gathered_once_for_all_blocks(tp: int, embed_input: bool) -> None:
    """The modulation linears are sharded and every block's shift/scale/gate is made whole
    in one collective ahead of the first block (gathered column-parallel outputs, or summed
    row-parallel ones): each block keeps Megatron's one all-reduce each way, and the result
    is exact (outputs, every gradient, the timestep embedding's included)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 16 if embed_input else 64)
    sim = check_exact(AdaLNZero(embed_input=embed_input), (x, torch.randn(2, 8)), tp)
    plan = sim.plan
    assert all(plan.params[f"blocks.{i}.mod.weight"].layout.startswith("S(") for i in range(4))
    per = plan.per_layer()
    for layer in range(1, 4):
        assert per[layer] == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}, \
            plan.summary()
    joined = [c for c in plan.collectives if c.phase == "forward" and c.node.startswith("batched")]
    assert len(joined) == 1 and joined[0].layer is None, plan.summary()
    assert joined[0].node.count(",") + 1 >= 4  # the modulation of four blocks
    # the blocks stay submodules of the program; the joined collective runs in the root
    rank = sim.ranks[0]
    assert isinstance(rank.program.blocks[1], torch.fx.GraphModule)
    # what ran in check_exact's one step: the joined collective once, each block's one
    # all-reduce forward, and no gather
    events = sim.ranks[0].comm.log.events
    assert [e.label.split(":")[0] for e in events if e.phase == "forward" and e.layer is None] \
        == ["batched"], events
    assert not [e for e in events if e.kind == "all_gather" and e.layer is not None], events
    for layer in range(4):
        assert [e.kind for e in events if e.phase == "forward" and e.layer == layer] == \
            ["all_reduce"], events


class TimestepBlock(AdaLNZeroBlock):  # diffusers' DiT: each block embeds the timestep again
    def __init__(self, h: int = 64) -> None:
        super().__init__(h)
        self.t_mlp = nn.Sequential(nn.Linear(8, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return super().forward(x, self.t_mlp(t))


class TimestepPerBlock(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TimestepBlock() for _ in range(layers)])

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, t)
        return x


@pytest.mark.parametrize("tp", [2, 4])
def test_a_timestep_mlp_in_every_block_is_summed_once_for_all_blocks(tp: int) -> None:
    """Each block's timestep MLP (h x h: not to be kept whole) ends row-parallel, a partial
    sum its modulation reads: every block's is all-reduced in one collective ahead of the
    blocks, then every block's modulation made whole in a second. Each block keeps
    Megatron's one all-reduce each way; exact, every gradient included."""
    torch.manual_seed(0)
    sim = check_exact(TimestepPerBlock(), (torch.randn(2, 16, 64), torch.randn(2, 8)), tp)
    plan = sim.plan
    for i in range(4):
        assert plan.params[f"blocks.{i}.t_mlp.2.weight"].layout != "R", plan.summary()
        assert plan.params[f"blocks.{i}.mod.weight"].layout != "R", plan.summary()
    per = plan.per_layer()
    for layer in range(4):
        assert per[layer].get(("forward", "all_reduce")) == 1, plan.summary()
        assert sum(n for (phase, _), n in per[layer].items() if phase == "forward") == 1
        assert sum(n for (phase, _), n in per[layer].items() if phase == "backward") <= 1
    joined = [c for c in plan.collectives if c.phase == "forward" and c.layer is None]
    assert [c.kind for c in joined] == ["all_reduce", "all_gather"], plan.summary()
    assert all(c.node.startswith("batched") and c.node.count(",") >= 3 for c in joined)
    events = sim.ranks[0].comm.log.events
    assert [e.kind for e in events if e.phase == "forward" and e.layer is None] == \
        ["all_reduce", "all_gather"], events


class LowRankAttention(nn.Module):  # DeepSeek's MLA: low-rank q and k/v, each normalized
    def __init__(self, h: int = 256, heads: int = 8, q_rank: int = 96, kv_rank: int = 64,
                 rope: int = 16) -> None:
        super().__init__()
        self.heads, self.d, self.kv_rank, self.rope = heads, h // heads, kv_rank, rope
        self.q_a, self.q_norm = nn.Linear(h, q_rank, bias=False), nn.RMSNorm(q_rank)
        self.q_b = nn.Linear(q_rank, h, bias=False)
        self.kv_a = nn.Linear(h, kv_rank + rope, bias=False)  # the latent and a shared k part
        self.kv_norm, self.kv_b = nn.RMSNorm(kv_rank), nn.Linear(kv_rank, 2 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, t, self.heads, self.d).transpose(1, 2)
        latent, k_shared = self.kv_a(x).split([self.kv_rank, self.rope], -1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, t, self.heads, 2 * self.d)
        k, v = kv.transpose(1, 2).chunk(2, -1)
        k = k + F.pad(k_shared, (0, self.d - self.rope))[:, None]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


class LowRankLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LowRankAttention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_low_rank_down_projections_normalized_whole_are_no_fallback() -> None:
    """MLA's down-projections feed a norm over their whole output: kept whole, as
    Megatron-Core keeps them, their gradients arriving whole from the up-projections'
    summed input gradients. That is the design, not a fallback (it was reported as "no
    exact sharding of its use exists"); the up-projections and o_proj are sharded."""
    torch.manual_seed(0)
    sim = check_exact(LowRankLayers(), (torch.randn(2, 16, 256),), 2)
    plan = sim.plan
    assert plan.fallbacks == [], plan.fallbacks
    for i in range(2):
        assert plan.params[f"layers.{i}.q_a.weight"].layout == "R"
        assert plan.params[f"layers.{i}.kv_a.weight"].layout == "R"
        for name in ("q_b", "kv_b", "o"):
            assert plan.params[f"layers.{i}.{name}.weight"].layout.startswith("S")


def test_the_beam_ranks_states_by_what_they_still_owe() -> None:
    """A state that saved a collective by leaving a value in a layout its later readers
    cannot take owes at least the cheapest redistribution to one they can. Ranked by cost
    alone, a beam of 8 states keeps only such states through MLA's layers and ends paying
    last-resort gathers; ranked by cost plus what each state still owes (a lower bound), it
    finds the plan of a 64-state beam."""
    from autotp.capture.trace import capture
    from autotp.planner.cost import CostModel
    from autotp.planner.problem import PlanOptions, block_counts, build_problem
    from autotp.planner.solve import solve
    from autotp.rules.registry import Registry

    torch.manual_seed(0)
    captured = capture(LowRankLayers(), (torch.randn(2, 16, 256),))
    cost_model = CostModel()

    def cost(states: int, lookahead: bool) -> float:
        options = PlanOptions(strict=False, max_states=states, lookahead=lookahead,
                              reuse_layers=False)
        problem = build_problem(captured, 2, block_counts(captured.gm), Registry.default(),
                                cost_model, options)
        return solve(problem, 2, cost_model, options)[1]

    wide = cost(64, lookahead=False)
    assert wide < cost_model.last_resort
    assert cost(8, lookahead=True) <= wide * (1 + 1e-6)
    assert cost(8, lookahead=False) >= cost_model.last_resort  # the bound is what keeps it


class AcrossHeadsNorm(nn.Module):
    """LTX-Video's and Lumina-Next's q/k norm: one ``nn.RMSNorm`` / ``nn.LayerNorm`` over all
    heads of the projection (``rms_norm_across_heads``), before the view into heads."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(64, 64) for _ in range(3))
        # k's biases (its projection's, its norm's) shift every score of a row nearly alike:
        # their gradients are of rounding size, no check of anything
        self.k = nn.Linear(64, 64, bias=False)
        self.norm_q = norm(64)
        self.norm_k = norm(64, **({"bias": False} if norm is nn.LayerNorm else {}))
        for param in (*self.norm_q.parameters(), *self.norm_k.parameters()):
            nn.init.normal_(param, 1.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k = self.norm_q(self.q(x)), self.norm_k(self.k(x))
        q, k, v = (t.view(b, n, 8, 8).transpose(1, 2) for t in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("norm", [nn.RMSNorm, nn.LayerNorm])
def test_a_norm_across_heads_all_reduces_its_statistics(tp: int, norm: type) -> None:
    """The fused norm needs q's features whole; written as means, each statistic is a
    partial mean over the local heads, all-reduced as one number per token (RMSNorm: the
    mean square; LayerNorm: the mean, then the variance). q and k stay column-parallel:
    no gather, and the forward's one all-reduce of a row is o's."""
    torch.manual_seed(0)
    sim = check_exact(AcrossHeadsNorm(norm), (torch.randn(2, 16, 64),), tp)
    plan = sim.plan
    layouts = {name: p.layout for name, p in plan.params.items()}
    assert layouts["q.weight"] == layouts["k.weight"] == layouts["norm_q.weight"] == "S(0)"
    assert layouts["o.weight"] == "S(1)", plan.summary()
    assert not plan.fallbacks, plan.fallbacks
    forward = [c for c in plan.collectives if c.phase == "forward"]
    assert {c.kind for c in forward} == {"all_reduce"}, plan.summary()
    # o's sum is B x T x 64 floats, a statistic B x T
    rows = [c for c in forward if sympy.sympify(c.bytes_expr).subs({"B": 1, "T": 1}) == 256]
    statistics = len(forward) - len(rows)
    assert len(rows) == 1 and statistics == (2 if norm is nn.RMSNorm else 4), plan.summary()


class MaskOfItsOwnBatch(nn.Module):
    """diffusers' cross-attention mask: ``prepare_attention_mask`` repeats it per head, then
    ``view(batch, heads, -1, T)`` by the batch of the hidden states, a different input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(64, 64) for _ in range(3))
        self.k = nn.Linear(64, 64, bias=False)  # a bias adds q.b to a whole row: no gradient

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        bias = (1 - mask[:, None, :]) * -10000.0  # [B, 1, Tc]
        bias = bias.repeat_interleave(8, dim=0).view(b, 8, -1, context.shape[1])
        q = self.q(x).view(b, n, 8, 8).transpose(1, 2)
        k, v = (lin(context).view(b, -1, 8, 8).transpose(1, 2) for lin in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o(y.transpose(1, 2).reshape(b, n, 64))


def test_inputs_of_one_batch_share_its_symbol() -> None:
    """Traced with a batch per input, the mask's heads would be ``(8 * B') // B``: no rule
    shards that, and the attention ran replicated. Inputs of the batch's size share one
    batch symbol, so the mask's heads are 8 and shard with q's."""
    torch.manual_seed(0)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    sim = check_exact(MaskOfItsOwnBatch(), (torch.randn(2, 16, 64), torch.randn(2, 6, 64),
                                            mask), 2)
    assert not sim.plan.fallbacks, sim.plan.fallbacks
    assert [c.kind for c in sim.plan.collectives if c.phase == "forward"] == ["all_reduce"]


class SequenceFirstAttention(nn.Module):
    """fairseq's (and ESM's) attention: [T, B, h] with the heads merged into the batch
    after the sequence (``view(T, B * heads, d)``), a padding mask applied through
    ``view(B, heads, T, S)``, and back through ``view(T, B, h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        t, b, h = x.shape
        q, k, v = (lin(x).contiguous().view(t, b * 8, 8).transpose(0, 1)
                   for lin in (self.q, self.k, self.v))
        scores = torch.bmm(q * 8 ** -0.5, k.transpose(1, 2)).view(b, 8, t, t)
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        y = torch.bmm(scores.view(b * 8, t, t).softmax(-1), v)
        x = x + self.o(y.transpose(0, 1).contiguous().view(t, b, h))
        return x + self.fc2(F.gelu(self.fc1(x)))


def _layer_collectives(plan: autotp.Plan, phase: str) -> dict:
    counts: dict = {}
    for c in plan.collectives:
        if c.phase == phase and c.layer is not None:
            counts[c.layer] = counts.get(c.layer, 0) + 1
    return counts


@pytest.mark.parametrize("tp", [2, 4])
def test_heads_merged_into_the_batch_after_the_sequence_stay_sharded(tp: int) -> None:
    """[T, B, h] -> [T, B*heads, d] puts each rank's heads in one segment of every batch
    index (``S(1)%8``): q, k, v column-parallel, o row-parallel, one all-reduce forward."""
    torch.manual_seed(0)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, -3:] = True
    sim = check_exact(SequenceFirstAttention(), (torch.randn(12, 2, 64), padding), tp)
    layouts = {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}
    assert layouts == {"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)",
                       "o.weight": "S(1)", "fc1.weight": "S(0)", "fc2.weight": "S(1)"}, layouts
    assert not sim.plan.fallbacks, sim.plan.fallbacks
    forward = [c.kind for c in sim.plan.collectives if c.phase == "forward"]
    assert forward == ["all_reduce", "all_reduce"], sim.plan.summary()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kdim", [None, 32])
def test_torch_transformer_layers_are_megatron_parallel(tp: int, kdim: Any) -> None:
    """torch's own ``nn.TransformerEncoder`` (one packed in_proj_weight, unflattened into
    (3, h) and taken apart by index) and ``nn.MultiheadAttention`` with a k/v width of its
    own (three projection weights): every matrix sharded, Megatron's two all-reduces per
    layer forward, with a padding mask."""
    torch.manual_seed(0)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, -3:] = True
    if kdim is None:
        layer = nn.TransformerEncoderLayer(64, 8, 256, dropout=0.0, batch_first=True)
        model: nn.Module = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        args: tuple = (torch.randn(2, 12, 64),)
        kwargs = {"src_key_padding_mask": padding}
    else:
        model = CrossAttention(kdim)
        args, kwargs = (torch.randn(2, 12, 64), torch.randn(2, 12, kdim), padding), {}
    sim = check_exact(model, args, tp, kwargs)
    replicated = [name for name, p in sim.plan.params.items()
                  if p.layout == "R" and len(p.global_shape) == 2]
    assert replicated == [] and not sim.plan.fallbacks, sim.plan.summary()
    if kdim is None:
        assert _layer_collectives(sim.plan, "forward") == {0: 2, 1: 2}, sim.plan.summary()


class CrossAttention(nn.Module):
    def __init__(self, kdim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 8, kdim=kdim, vdim=kdim, batch_first=True)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                padding: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, context, context, key_padding_mask=padding)[0]
