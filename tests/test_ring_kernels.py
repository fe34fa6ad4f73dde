"""Ring attention on the device's fused kernels (autotp.runtime.ring_kernels): each call of
the ring by the CPU flash kernel in the inputs' dtype, merged by log-sum-exp, backward by
the kernel's backward. Against the unsharded scaled_dot_product_attention: float32 within
1e-5 of each tensor's largest entry (as tests/test_context.py), bfloat16 within 2.5 x
SDPA's own bfloat16 error from the float64 attention (each gradient sums up to cp kernel
calls' bfloat16 results); the ring reads no tensor value on the host."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.verification.verify import max_difference
from tests.context_cases import on_ranks
from autotp.runtime.comm import ThreadComm
from autotp.runtime.ring import SequenceLayout, ring_attention
from autotp.runtime.ring_kernels import Kernel, choose

aten = torch.ops.aten
HOST_READS = (aten.equal.default, aten._local_scalar_dense.default, aten.is_nonzero.default)


class _Ops(TorchDispatchMode):
    """Counts every aten op run under it (in the thread that enters it)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


# name: (query heads, key/value heads, causal, window, padding, v head dim)
CASES: dict[str, tuple[int, int, bool, Any, Any, int]] = {
    "causal-gqa": (8, 2, True, None, None, 16),
    "window": (4, 4, True, 9, None, 16),
    "padding": (8, 2, True, None, "right", 16),
    # the second sequence's first 11 tokens are pads: those queries see no key at all
    "left-padding": (4, 2, True, None, "left", 16),
    "bidirectional": (4, 2, False, None, None, 16),
    # v's head dim is not q's: no fused kernel takes it, the products do
    "value-dim": (4, 2, True, None, None, 24),
}


def _inputs(name: str, length: int) -> tuple[torch.Tensor, ...]:
    heads, kv_heads, _, _, padding, dv = CASES[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 16, generator=gen)
    k = torch.randn(2, kv_heads, length, 16, generator=gen)
    v = torch.randn(2, kv_heads, length, dv, generator=gen)
    grad = torch.randn(2, heads, length, dv, generator=gen)
    keys = torch.ones(2, length, dtype=torch.bool)
    if padding == "right":
        keys[1, length - 11:] = False
    elif padding == "left":
        keys[1, :11] = False
    return q, k, v, grad, keys


def _unsharded(name: str, length: int, dtype: torch.dtype,
               device: str = "cpu") -> list[torch.Tensor]:
    """scaled_dot_product_attention on the whole sequence in ``dtype``: out, dq, dk, dv."""
    heads, kv_heads, causal, window, padding, _ = CASES[name]
    q, k, v, grad, keys = _inputs(name, length)
    xs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    pos = torch.arange(length)
    allowed = pos[None, :] <= pos[:, None] if causal else torch.ones(length, length,
                                                                     dtype=torch.bool)
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    mask = (allowed[None, None] & keys[:, None, None, :]).to(device)
    empty = ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(*xs, attn_mask=mask | empty,
                                         enable_gqa=heads != kv_heads)
    out = out.masked_fill(empty, 0.0)
    out.backward(grad.to(device, dtype))
    return [out.detach(), *(x.grad for x in xs)]


def _ring(name: str, length: int, dtype: torch.dtype, cp: int,
          counted: list[dict[Any, int]], device: str = "cpu") -> list[torch.Tensor]:
    """The ring at ``cp`` on the balanced layout (contiguous where not causal), in ``dtype``;
    out, dq, dk, dv in the global order; each rank's aten ops into ``counted``."""
    _, _, causal, window, padding, _ = CASES[name]
    q, k, v, grad, keys = _inputs(name, length)
    layout = SequenceLayout(cp, balanced=causal)

    def rank(comm: ThreadComm) -> list[torch.Tensor]:
        xs = [layout.shard(t, 2, comm.rank).to(device, dtype).requires_grad_()
              for t in (q, k, v)]
        mode = _Ops()
        with mode:
            out = ring_attention(*xs, comm, layout, causal=causal, window=window,
                                 key_mask=keys.to(device) if padding else None)
            out.backward(layout.shard(grad, 2, comm.rank).to(device, dtype))
        counted.append(mode.counts)
        return [out.detach(), *(x.grad for x in xs)]

    parts = on_ranks(cp, rank)
    return [layout.unshard([p[i] for p in parts], 2) for i in range(4)]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_float32_ring_on_the_kernels_matches_unsharded_attention(name: str, cp: int) -> None:
    """Output and gradients within 1e-5 of each tensor's largest entry; every call of the
    ring by the CPU flash kernel (by the products where v's head dim is not q's), no query
    chunk's pair expanded to [rows, every key], no key/value head repeated where the kernel
    reads them grouped, and no tensor value read on the host."""
    length = 12 * cp  # 2 cp chunks of 6 tokens (cp chunks of 12 where not causal)
    counted: list[dict[Any, int]] = []
    ring = _ring(name, length, torch.float32, cp, counted)
    want = _unsharded(name, length, torch.float64)
    for what, a, b in zip(["out", "q", "k", "v"], want, ring, strict=True):
        assert max_difference(a, b.double(), relative=True) <= 1e-5, (name, what)
    fused = CASES[name][5] == 16
    for ops in counted:
        forward = ops.get(aten._scaled_dot_product_flash_attention_for_cpu.default, 0)
        backward = ops.get(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 0)
        assert forward == backward and (forward > 0) == fused, (name, forward, backward)
        assert not any(ops.get(op, 0) for op in HOST_READS), (name, ops)
        if fused:
            assert not ops.get(aten.repeat_interleave.self_int, 0), name
            assert not ops.get(aten.bmm.default, 0) and not ops.get(aten.mm.default, 0), name


@pytest.mark.parametrize("name", ["causal-gqa", "window", "padding", "left-padding"])
def test_bfloat16_ring_is_as_close_as_unsharded_sdpa(name: str) -> None:
    """bfloat16 at cp 2, S 128: the ring's output and gradients against the float64
    attention, within 2.5 x the distance of SDPA's own in bfloat16 (plus one bfloat16 step
    of the largest entry, for a tensor SDPA happens to get almost exact); queries no key is
    left for get zeros and no gradient, exactly."""
    exact = _unsharded(name, 128, torch.float64)
    sdpa = _unsharded(name, 128, torch.bfloat16)
    ring = _ring(name, 128, torch.bfloat16, 2, [])
    assert all(t.dtype == torch.bfloat16 for t in ring)
    for what, want, a, b in zip(["out", "q", "k", "v"], exact, ring, sdpa, strict=True):
        ring_err, sdpa_err = (max_difference(want, x.double(), relative=True) for x in (a, b))
        assert ring_err <= 2.5 * sdpa_err + 2 ** -8, (name, what, ring_err, sdpa_err)
    if name == "left-padding":
        assert not ring[0][1, :, :11].any() and not ring[1][1, :, :11].any()


def test_kernel_choice_by_device_dtype_and_head_dims() -> None:
    """On the CPU: the flash kernel for every float dtype, with or without a mask, grouped
    key/value heads as they are; the products where v's head dim is not q's."""
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for masked in (False, True):
            assert choose(q.to(dtype), kv.to(dtype), kv.to(dtype), masked) is Kernel.CPU_FLASH
    assert choose(q, kv, torch.randn(1, 2, 8, 24), False) is Kernel.MATMUL
    assert choose(q, kv, kv.double(), False) is Kernel.MATMUL  # mixed dtypes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal-gqa", "window", "padding", "left-padding"])
def test_cuda_ring_on_flash_and_memory_efficient_kernels(name: str,
                                                         dtype: torch.dtype) -> None:
    """On a CUDA device at cp 2 (simulated ranks on one device), S 128: bfloat16 calls
    without a mask by the flash kernel, masked ones (and float32 ones) by the
    memory-efficient kernel, each backward by its own; against the float64 attention within
    2.5 x SDPA's own distance in that dtype (plus one bfloat16 step, or 1e-4 in float32)."""
    exact = [t.cuda() for t in _unsharded(name, 128, torch.float64)]
    sdpa = _unsharded(name, 128, dtype, "cuda")
    counted: list[dict[Any, int]] = []
    ring = _ring(name, 128, dtype, 2, counted, "cuda")
    slack = 2 ** -8 if dtype == torch.bfloat16 else 1e-4
    for what, want, a, b in zip(["out", "q", "k", "v"], exact, ring, sdpa, strict=True):
        ring_err, sdpa_err = (max_difference(want, x.double(), relative=True) for x in (a, b))
        assert ring_err <= 2.5 * sdpa_err + slack, (name, what, ring_err, sdpa_err)
    flash = (aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_flash_attention_backward.default)
    efficient = (aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_efficient_attention_backward.default)
    for ops in counted:
        assert ops.get(flash[0], 0) == ops.get(flash[1], 0), ops
        assert ops.get(efficient[0], 0) == ops.get(efficient[1], 0), ops
        assert (ops.get(flash[0], 0) > 0) == (dtype == torch.bfloat16), (name, ops)
        assert (ops.get(efficient[0], 0) > 0) == (dtype == torch.float32 or name != "causal-gqa")


def test_a_models_mask_program_is_read_once_per_step() -> None:
    """transformers' LLaMA at cp 2, padded (its causal and padding mask a program of position
    vectors, ``BlockMask``): what the mask keeps of each pair of chunks is made once per rank
    and step for both layers (the layers read the same factor tensors, known by identity, not
    compared), no tensor value is read on the host in the step, and the model is exact
    against the unsharded one (verify's tolerances)."""
    import autotp
    import autotp.runtime.block_mask as block_mask
    from autotp.verification.verify import assert_equivalent
    from tests import context_cases as cc
    from tests import models

    inputs = cc.model_inputs("llama", True)
    model = models.llama().eval()
    sim = autotp.simulate(model, 1, cp=2, example_kwargs=inputs)
    grids: dict[int, int] = {}
    real = block_mask.BlockMask.grid

    def counting(self: Any, *args: Any) -> Any:
        ident = threading.get_ident()
        grids[ident] = grids.get(ident, 0) + (self.program.memo is None or
                                              not block_mask._same(self.program.memo[0],
                                                                   [*self.factors, self.keys]))
        return real(self, *args)

    def step(module: torch.nn.Module) -> dict[Any, int]:
        with _Ops() as mode:
            module(**inputs).loss.backward()
        return mode.counts

    block_mask.BlockMask.grid = counting  # type: ignore[method-assign]
    try:
        counts = sim.run(step)
    finally:
        block_mask.BlockMask.grid = real  # type: ignore[method-assign]
    assert sorted(grids.values()) == [1, 1], grids
    assert all(not ops.get(op, 0) for ops in counts for op in HOST_READS), counts
    assert_equivalent(model, sim, kwargs=inputs, loss_fn=lambda out: out.loss,
                      pick=lambda out: out.logits)
