"""Attention whose mask tensor is the causal one runs by the kernel's own causal path.

transformers builds its causal mask as a tensor when it is traced (``torch.export`` cannot
take the shortcut its eager run takes, ``is_causal=True`` where nothing is padded), so a
rank program would attend under an [s, s] mask: every pair computed, none of the causal
half skipped. Where the mask keeps at most the causal half by construction
(``planner.masks.ordered``), ``CausalWhereMasked`` looks at the mask each forward (once for
all the layers reading it) and, where it is exactly causal, calls
``scaled_dot_product_attention`` with ``is_causal=True`` and no mask; any other mask (padding,
packed sequences, a window) is applied as it is.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


# the meta key on a rank program's node that calls a module with scaled_dot_product_attention's
# arguments, as passes over the program read them (``fusion.fuse_repeated_kv_attention``)
SDPA_CALL = "autotp_sdpa_call"


class CausalWhereMasked(nn.Module):
    """``aten.scaled_dot_product_attention`` with a mask that may be the causal one. One
    module serves every attention reading the same mask: the first call of a forward
    compares the mask with the causal one, the others reuse the answer while the mask
    tensor is the same object, unchanged. ``causal_calls`` and ``masked_calls`` count which
    path each call took."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: Optional[tuple[Any, int, tuple[int, ...], bool]] = None
        self.causal_calls = 0
        self.masked_calls = 0

    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                is_causal: bool = False, *, scale: Optional[float] = None,
                enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None and not is_causal and self.is_causal(attn_mask, q, k):
            self.causal_calls += 1
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  scale=scale, enable_gqa=enable_gqa)
        self.masked_calls += 1
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    def is_causal(self, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether ``mask`` (boolean, broadcast to [b, h, sq, sk]) keeps exactly each query's
        keys at or before its own position, for every batch row and head."""
        queries, keys = q.shape[-2], k.shape[-2]
        if mask.dtype != torch.bool or queries != keys or mask.shape[-2:] != (queries, keys):
            return False
        seen = self._seen
        if seen is not None and seen[0]() is mask and seen[1] == mask._version and \
                seen[2] == tuple(mask.shape):
            return seen[3]
        causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
        answer = bool(torch.equal(mask, causal.expand(mask.shape)))
        self._seen = (weakref.ref(mask), mask._version, tuple(mask.shape), answer)
        return answer
