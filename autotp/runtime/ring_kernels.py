"""One call of ring attention -- some of a rank's queries against some of the keys passing
by -- by the device's fused attention kernel, which returns the call's log-sum-exp beside
its output; the calls merged by those (the online softmax); backward by the kernel's own
backward given the merged output and log-sum-exp, which is each call's exact share of dq,
dk and dv:

    out = sum_i exp(lse_i - lse) out_i,   lse = log sum_i exp(lse_i)
    dq, dk_i, dv_i = kernel_backward(dout, q, k_i, v_i, out, lse)   summed over i

Invariant: a call's kernel is a function of its device, dtypes, head dims and whether it
carries a mask (``choose``), never of tensor values, so forward and backward pick the same
one; a kernel that cannot take the call is never asked, the next one is, down to
``Kernel.MATMUL`` (the scores by products in float32, any device, dtype and head dims),
which gives the same result. The kernels read and write the inputs' dtype; only the merge
runs in float32 (or the inputs' dtype where wider).

A mask reaches a kernel additive ([b|1, h|1, rows, keys], -inf where hidden); a row it
hides whole (``Call.empty``) has log-sum-exp -inf whatever the kernel says (the CPU kernel
gives 0 there), so it weighs nothing in the merge. After the merge a query no key is left
for has out 0 and log-sum-exp +inf, which makes every kernel's backward give it and its
keys no gradient.

Kernels by device: CPU ``_scaled_dot_product_flash_attention_for_cpu`` (grouped key/value
heads as they are, masks, every float dtype); CUDA flash (half precision, no mask), memory
efficient (masks; float32 too), in that order; they are given key/value heads expanded to
the query heads, once per ring step. cuDNN's kernel is not among them: flash takes every
call it would (half precision, no mask), and its log-sum-exp's layout has not been checked
on a GPU here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

aten = torch.ops.aten


class Kernel(enum.Enum):
    CPU_FLASH = "cpu flash"
    CUDA_FLASH = "cuda flash"
    CUDA_EFFICIENT = "cuda memory-efficient"
    MATMUL = "matmul"  # scores by products, in float32: any device, dtype and head dims


_ORDER = {"cpu": (Kernel.CPU_FLASH,),
          "cuda": (Kernel.CUDA_FLASH, Kernel.CUDA_EFFICIENT)}
_HALF = (torch.float16, torch.bfloat16)
_CUDA = (Kernel.CUDA_FLASH, Kernel.CUDA_EFFICIENT)


def _cuda_switch(kernel: Kernel) -> bool:
    """Whether torch's own switches (``torch.backends.cuda.sdp_kernel`` and friends) let
    SDPA use ``kernel`` here: the ring follows them."""
    backends = torch.backends.cuda
    if kernel is Kernel.CUDA_FLASH:
        return backends.flash_sdp_enabled() and backends.is_flash_attention_available()
    return backends.mem_efficient_sdp_enabled()


def _takes(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           masked: bool) -> bool:
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d or not (q.dtype == k.dtype == v.dtype):
        return False
    if kernel is Kernel.CPU_FLASH:
        return q.dtype.is_floating_point
    if not _cuda_switch(kernel):
        return False
    if kernel is Kernel.CUDA_FLASH:  # FlashAttention-2: Ampere and later
        return not masked and q.dtype in _HALF and d % 8 == 0 and d <= 256 and \
            torch.cuda.get_device_capability(q.device) >= (8, 0)
    return q.dtype in (*_HALF, torch.float32) and d % (8 if q.dtype in _HALF else 4) == 0


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool) -> Kernel:
    """The first of the device's kernels that takes a call on these inputs, with or without
    a mask; ``Kernel.MATMUL`` where none does."""
    for kernel in _ORDER.get(q.device.type, ()):
        if _takes(kernel, q, k, v, masked):
            return kernel
    return Kernel.MATMUL


def takes_groups(kernel: Kernel) -> bool:
    """Whether the kernel reads fewer key/value heads than query heads as they are."""
    return kernel is Kernel.CPU_FLASH


@dataclass(frozen=True)
class Call:
    """What one kernel call is asked besides q, k and v: ``causal``: top-left (query i sees
    keys 0..i; the call is square and the keys' positions are the queries'); ``bias``: an
    additive mask [b|1, h|1, rows, keys]; ``empty``: [b|1, h|1, rows], the rows the bias
    hides whole."""
    causal: bool = False
    bias: Optional[torch.Tensor] = None
    empty: Optional[torch.Tensor] = None


def bias_of(allowed: Optional[torch.Tensor], extra: Optional[torch.Tensor],
            dtype: torch.dtype) -> Call:
    """One additive mask from a positions mask (``allowed``, [rows, keys], True: kept) and a
    model's mask (boolean, True: kept, or additive) for the same rows and keys."""
    if extra is None:
        assert allowed is not None
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        bias = bias.masked_fill(~allowed, float("-inf"))
    elif extra.dtype == torch.bool:
        keep = extra if allowed is None else extra & allowed
        bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        bias = bias.masked_fill(~keep, float("-inf"))
    else:
        bias = extra.to(dtype)
        if allowed is not None:
            bias = bias.masked_fill(~allowed, float("-inf"))
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return Call(bias=bias, empty=(bias == float("-inf")).all(-1))


def mask_dtype(kernel: Kernel, q: torch.Tensor) -> torch.dtype:
    """The dtype a kernel's additive mask takes: the inputs' for CUDA's kernel, float32 or
    wider elsewhere (a model's finite "hidden" value stays finite)."""
    if kernel is Kernel.CUDA_EFFICIENT:
        return q.dtype
    return torch.promote_types(q.dtype, torch.float32)


def wide(dtype: torch.dtype) -> torch.dtype:
    """What the merge and the accumulators run in: float32, or the inputs' dtype if wider."""
    return torch.promote_types(dtype, torch.float32)


# ---- forward ----------------------------------------------------------------------------------


def forward(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(out [b, h, rows, d], lse [b, h, rows] in float32 or wider, what the kernel's
    backward needs besides) for one call."""
    sq = q.shape[2]
    aux: Any = None
    if kernel in _CUDA:  # rows of a shard are strided views; the CUDA kernels want them dense
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel is Kernel.CPU_FLASH:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, call.causal, attn_mask=call.bias, scale=scale)
    elif kernel is Kernel.CUDA_FLASH:
        out, lse, *aux = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, call.causal, False, scale=scale)
    elif kernel is Kernel.CUDA_EFFICIENT:
        bias = _aligned(call.bias, q, k)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, call.causal, scale=scale)
        aux = (seed, offset, tuple(lse.shape))  # the bias is built again for backward
    else:
        out, lse = _matmul_forward(q, k, v, call, scale)
    lse = lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :sq].to(wide(q.dtype))
    if call.empty is not None:
        lse = lse.masked_fill(call.empty, float("-inf"))
        out = out.masked_fill(call.empty[..., None], 0.0)
    return out, lse, aux


def _aligned(bias: Optional[torch.Tensor], q: torch.Tensor,
             k: torch.Tensor) -> Optional[torch.Tensor]:
    """The memory-efficient kernel's bias: [b, h, rows, keys] in the inputs' dtype, its rows
    16-element aligned in memory (the kernel's requirement, as SDPA pads it)."""
    if bias is None:
        return None
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    padded = -(-sk // 16) * 16
    room = torch.zeros(b, h, sq, padded, dtype=q.dtype, device=q.device)
    room[..., :sk] = bias.to(q.dtype)
    return room[..., :sk]


def _scores(q: torch.Tensor, k: torch.Tensor, call: Call, scale: float) -> torch.Tensor:
    """q [b, h, sq, d] against k [b, h, sk, d] in float32 or wider, -inf where masked."""
    dtype = wide(q.dtype)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if call.causal:
        sq, sk = s.shape[-2:]
        rows = torch.arange(sq, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(sk, device=s.device)[None, :] > rows, float("-inf"))
    if call.bias is not None:
        s = s + call.bias.to(dtype)
    return s


def _matmul_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, call, scale)
    lse = torch.logsumexp(s, dim=-1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    out = torch.matmul(torch.exp(s - safe[..., None]), v.to(s.dtype))
    return out, lse


# ---- the merge --------------------------------------------------------------------------------


class _Covered:
    """Which runs of rows (dim 2) parts have been written to: a part over rows nothing was
    written to yet is copied in, with no zeros to add it to."""

    def __init__(self, like: torch.Tensor):
        self.rows = like.shape[2]
        self.covered: list[tuple[int, int]] = []

    def fresh(self, rows: slice) -> bool:
        start, stop = rows.start, rows.stop
        new = not any(start < b and a < stop for a, b in self.covered)
        self.covered.append((start, stop))
        return new

    def gaps(self) -> list[slice]:
        """The runs of rows no part has covered."""
        out, at = [], 0
        for a, b in sorted(self.covered):
            if a > at:
                out.append(slice(at, a))
            at = max(at, b)
        return out + ([slice(at, self.rows)] if at < self.rows else [])


class Merged(_Covered):
    """The running output and log-sum-exp of a rank's queries, in float32 or wider."""

    def __init__(self, q: torch.Tensor, dv: int):
        super().__init__(q)
        b, h, sq, _ = q.shape
        self.out = q.new_empty((b, h, sq, dv), dtype=wide(q.dtype))
        self.lse = q.new_empty((b, h, sq), dtype=wide(q.dtype))

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        acc, old = self.out[:, :, rows], self.lse[:, :, rows]
        if self.fresh(rows):
            acc.copy_(out)
            old.copy_(lse)
            return
        new = torch.logaddexp(old, lse)
        safe = new.masked_fill(new == float("-inf"), 0.0)  # no key yet: both weigh 0
        acc.mul_(torch.exp(old - safe).unsqueeze(-1))
        acc.addcmul_(out, torch.exp(lse - safe).unsqueeze(-1))
        old.copy_(new)

    def result(self, dtype: torch.dtype, maybe_empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in ``dtype``, lse): a query no key is left for (``maybe_empty``: a model's
        mask may leave none; positions alone always leave a query its own key) gets out 0
        and lse +inf."""
        for rows in self.gaps():  # rows every pair of chunks hid
            self.out[:, :, rows] = 0.0
            self.lse[:, :, rows] = float("-inf")
        if not maybe_empty:
            return self.out.to(dtype), self.lse
        empty = self.lse == float("-inf")
        out = self.out.masked_fill(empty[..., None], 0.0).to(dtype)
        return out, self.lse.masked_fill(empty, float("inf"))


class Summed(_Covered):
    """A float32 (or wider) sum of parts of a tensor like ``like``, each over some rows."""

    def __init__(self, like: torch.Tensor):
        super().__init__(like)
        self.total = torch.empty(like.shape, dtype=wide(like.dtype), device=like.device)

    def add(self, rows: slice, part: torch.Tensor) -> None:
        if self.fresh(rows):
            self.total[:, :, rows] = part
        else:
            self.total[:, :, rows] += part

    def result(self) -> torch.Tensor:
        for rows in self.gaps():  # rows no call read: no gradient
            self.total[:, :, rows] = 0.0
        return self.total


# ---- backward ---------------------------------------------------------------------------------


def backward(kernel: Kernel, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, call: Call, scale: float,
             aux: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's share of (dq, dk, dv), given the merged ``out`` and ``lse`` of its rows."""
    if kernel in _CUDA:
        grad, q, k, v, out = (t.contiguous() for t in (grad, q, k, v, out))
    if kernel is Kernel.CPU_FLASH:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse.contiguous(), 0.0, call.causal, attn_mask=call.bias,
            scale=scale)
    elif kernel is Kernel.CUDA_FLASH:
        cum_q, cum_k, max_q, max_k, seed, offset, _ = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0,
            call.causal, seed, offset, scale=scale)
    elif kernel is Kernel.CUDA_EFFICIENT:
        seed, offset, shape = aux
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, _aligned(call.bias, q, k), out, _as_kernel_lse(lse, shape), seed,
            offset, 0.0, [True, True, True, False], call.causal, scale=scale)
    else:
        dq, dk, dv = _matmul_backward(grad, q, k, v, out, lse, call, scale)
    return dq, dk, dv


def _as_kernel_lse(lse: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The merged [b, h, rows] log-sum-exp in the layout the kernel's forward gave its own
    (the memory-efficient kernel pads the rows to a multiple of 32)."""
    if shape[-1] > lse.shape[-1]:
        return torch.nn.functional.pad(lse, (0, shape[-1] - lse.shape[-1])).contiguous()
    return lse.contiguous()


def _matmul_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, call: Call, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = _scores(q, k, call, scale)
    do = grad.to(s.dtype)
    p = torch.exp(s - lse[..., None].to(s.dtype))  # 0 where masked (and for empty rows)
    delta = (do * out.to(s.dtype)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.to(s.dtype).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.to(s.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype)) * scale
    return dq, dk, dv
