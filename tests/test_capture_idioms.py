"""Forward idioms that torch.export cannot trace as they are, which capture makes plain
(``autotp.capture.traceable``, ``capture.shared_buffers``, the trace of fixed sizes), each
against the unsharded model (``assert_equivalent``: outputs and loss within 1e-5, gradients
within 1e-4 of each parameter's largest entry, and again after one SGD step):

- reentrant activation checkpointing (``checkpoint(fn, x)``, ``use_reentrant=True`` or left
  out): traced as ``fn(x)``, its matrices sharded; with no input that requires grad, the
  body's parameters get no gradient, as in the model
- a rotary table shared by every layer, whose first call caches its frequencies into a slice
  of a registered buffer under ``@torch.autocast(enabled=False)`` and whose later calls read
  that slice (functionalized with the buffer one program input)
- ``functools.lru_cache`` on a mask builder that takes the sequence length: traced at the
  example's sizes, a call of another length traced again; no cache keeps a traced value
- ``self.mlp.to(x.device)`` inside forward: the move to where the module is is skipped; a
  move that would convert is not
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import autotp
from autotp.errors import TraceError
from autotp.verification.verify import assert_equivalent

D, HEADS = 32, 4


def _x(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randn(batch, length, D, generator=torch.Generator().manual_seed(3))


def _weight_layouts(sim: autotp.Simulation) -> dict[str, str]:
    return {name: p.layout for name, p in sim.plan.params.items() if name.endswith("weight")}


class Attention(nn.Module):
    """Causal attention, 4 heads; ``rotary`` (shared) rotates q and k; ``mask`` builds the
    (T, T) mask from the length."""

    def __init__(self, rotary: Optional[nn.Module] = None, mask: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.rotary, self.mask = rotary, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, HEADS, C // HEADS).transpose(1, 2)  # (B, nh, T, hs)
                   for p in (self.q, self.k, self.v))
        if self.rotary is not None:
            q, k = self.rotary.rotate(q), self.rotary.rotate(k)
        if self.mask:
            scores = q @ k.transpose(-1, -2) / math.sqrt(C // HEADS)
            gammas = decay_gammas(HEADS, x.device)[:, None, None]
            scores = scores * gammas + causal_bias(T, x.device)
            z = scores.softmax(-1) @ v
        else:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(z.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


# ---- reentrant checkpointing (gateloop-transformer's gate loop) -----------------------------

class Checkpointed(nn.Module):
    """``use_reentrant``: passed to ``checkpoint`` (None: left out, the old default);
    ``first``: the checkpointed MLP reads the input itself (nothing in it requires grad)."""

    def __init__(self, use_reentrant: Optional[bool], first: bool = False) -> None:
        super().__init__()
        self.use_reentrant, self.first = use_reentrant, first
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first:
            x = x + self.attn(x)
        kwargs = {} if self.use_reentrant is None else {"use_reentrant": self.use_reentrant}
        x = x + checkpoint(self.mlp, x, **kwargs)
        return x + self.attn(x) if self.first else x


@pytest.mark.parametrize("use_reentrant", [True, None])
def test_a_reentrant_checkpointed_block_is_sharded_and_exact(
        use_reentrant: Optional[bool]) -> None:
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: "use_reentrant should be passed"
        sim = autotp.simulate(model, 2, example_args=(_x(),))
        assert _weight_layouts(sim) == {
            "attn.q.weight": "S(0)", "attn.k.weight": "S(0)", "attn.v.weight": "S(0)",
            "attn.o.weight": "S(1)", "mlp.fc1.weight": "S(0)", "mlp.fc2.weight": "S(1)"}
        assert_equivalent(model, sim, args=(_x(),))


def test_a_reentrant_checkpoint_of_an_input_without_grad_gives_its_body_no_gradient() -> None:
    """The reentrant form's known trap, kept: its output requires no grad where no input
    does, so the MLP's parameters get none, in the model and in the program alike."""
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant=True, first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: "none of the inputs requires grad"
        out = model(_x())
        out.square().mean().backward()
        assert model.mlp.fc1.weight.grad is None
        model.zero_grad(set_to_none=True)
        assert_equivalent(model, 2, args=(_x(),))


# ---- a shared rotary table cached into a buffer (rotary-embedding-torch, FLASH) --------------

class Rotary(nn.Module):
    """Frequencies computed in fp32 with autocast off, cached into a slice of a registered
    buffer on the first call and read back from it while the length fits."""

    def __init__(self, dim: int, max_len: int = 64) -> None:
        super().__init__()
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("cached_freqs", torch.zeros(max_len, dim), persistent=False)
        self.cached_len = 0

    @torch.autocast("cuda", enabled=False)
    def freqs(self, length: int, device: torch.device) -> torch.Tensor:
        if length <= self.cached_len:
            return self.cached_freqs[:length].detach()
        t = torch.arange(length, device=device, dtype=torch.float32)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq).repeat_interleave(2, -1)  # (T, hs)
        self.cached_freqs[:length] = freqs.detach()
        self.cached_len = length
        return freqs

    @torch.autocast("cuda", enabled=False)
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.freqs(x.shape[-2], x.device)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack((-x2, x1), -1).flatten(-2)
        return x * freqs.cos() + rotated * freqs.sin()


class SharedRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rotary = Rotary(D // HEADS)
        self.attns = nn.ModuleList(Attention(rotary) for _ in range(2))
        self.mlps = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, mlp in zip(self.attns, self.mlps):
            x = x + attn(x)
            x = x + mlp(x)
        return x


def test_a_shared_rotary_table_cached_into_a_buffer_is_exact() -> None:
    torch.manual_seed(0)
    model = SharedRotary()
    sim = autotp.simulate(model, 2, example_args=(_x(),))
    layouts = _weight_layouts(sim)
    assert {layouts[f"attns.{i}.{p}.weight"] for i in range(2) for p in "qkv"} == {"S(0)"}
    assert {layouts[f"attns.{i}.o.weight"] for i in range(2)} == {"S(1)"}
    assert_equivalent(model, sim, args=(_x(),))
    # the captured program holds the table under both layers' paths, one tensor
    traced = sim.captured.gm
    assert traced.get_buffer("attns.0.rotary.cached_freqs") is \
        traced.get_buffer("attns.1.rotary.cached_freqs")
    # the model kept its own cache (empty: it never ran eagerly before the trace)
    assert model.attns[0].rotary.cached_len == 0


# ---- a cache keyed on the length (yet-another-retnet's decay mask) ---------------------------

@functools.lru_cache(maxsize=1)
def decay_gammas(heads: int, device: torch.device) -> torch.Tensor:
    return 1 - torch.linspace(math.log(1 / 32), math.log(1 / 512), heads, device=device).exp()


@functools.lru_cache(maxsize=1)
def causal_bias(length: int, device: torch.device) -> torch.Tensor:
    return torch.full((length, length), float("-inf"), device=device).triu(1)


class CachedMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(mask=True), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_a_mask_cached_on_the_length_traces_at_fixed_sizes_and_retraces_another() -> None:
    torch.manual_seed(0)
    model = CachedMask()
    with pytest.warns(UserWarning, match="traced at the example's sizes only"):
        sim = autotp.simulate(model, 2, example_args=(_x(),))
    assert _weight_layouts(sim) == {
        "attn.q.weight": "S(0)", "attn.k.weight": "S(0)", "attn.v.weight": "S(0)",
        "attn.o.weight": "S(1)", "mlp.fc1.weight": "S(0)", "mlp.fc2.weight": "S(1)"}
    # no cache holds what the traces made: the model runs, and runs as before
    assert not any(isinstance(t, torch._subclasses.FakeTensor)
                   for t in (decay_gammas(HEADS, torch.device("cpu")),
                             causal_bias(16, torch.device("cpu"))))
    assert_equivalent(model, sim, args=(_x(),))
    assert_equivalent(model, sim, args=(_x(length=8),))  # another length: traced again
    assert len(sim.ranks[0]._traced) == 2


# ---- Module.to inside forward (st-moe-pytorch's experts) -------------------------------------

class MovesItsMLP(nn.Module):
    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        self.mlp.to(x.device)
        self.mlp.cpu()
        if self.dtype is not None:
            self.mlp.to(self.dtype)
        return x + self.mlp(x.to(self.mlp.fc1.weight.dtype)).to(x.dtype)


def test_a_module_moved_where_it_is_inside_forward_is_exact() -> None:
    torch.manual_seed(0)
    model = MovesItsMLP()
    sim = autotp.simulate(model, 2, example_args=(_x(),))
    assert _weight_layouts(sim)["mlp.fc1.weight"] == "S(0)"
    assert_equivalent(model, sim, args=(_x(),))


def test_a_module_converted_inside_forward_is_still_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"self\.mlp\.to\(self\.dtype\)"):
        autotp.plan(MovesItsMLP(torch.float64), 2, example_args=(_x(),))
