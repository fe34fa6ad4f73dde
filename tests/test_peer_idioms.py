"""Idioms of other codebases' model code that broke autotp, against the unsharded model.

Each model is small and written here in the style of the codebase it follows; each is run in
simulation and compared on the same weights and inputs: every output and every parameter's
gradient, within 1e-5 relative to the largest entry (fp32).

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


def check_exact(model: nn.Module, args: tuple, tp: int, kwargs: Any = None,
                **options: Any) -> autotp.Simulation:
    """The sharded model's output and gradients equal the unsharded model's."""
    kwargs = kwargs or {}
    reference = copy.deepcopy(model)
    want = reference(*args, **kwargs)
    want.square().sum().backward()
    sim = autotp.simulate(model, tp, example_args=args or None, example_kwargs=kwargs or None,
                          **options)

    def step(rank: nn.Module) -> tuple[torch.Tensor, dict]:
        out = rank(*args, **kwargs)
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
    want = model(x, context=context)
    for out in sim.run(lambda rank: rank(x, context=context)):
        assert (out - want).abs().max().item() <= RTOL * want.abs().max().item()


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
