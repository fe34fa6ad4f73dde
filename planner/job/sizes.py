"""The sizes of a captured program's values at one micro-batch and sequence length, on one
rank: shapes with the batch and sequence symbols given numbers, local shapes under a layout,
bytes per element in training, and a product's output size from its local operands."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from autotp.capture.trace import Captured, size_expr
from autotp.layout import Layout, Replicate, Shard, local_shape, parse_layout
from autotp.planner.cost import parse_size_expr

aten = torch.ops.aten


class Sizes:
    """Shapes of the captured graph at a batch and sequence length."""

    def __init__(self, captured: Captured, batch: int, seq: int):
        self.subs = tuple(sorted((str(sym), batch if name.startswith("B") else seq)
                                 for sym, name in captured.dim_names.items()))
        self.seq_syms = frozenset(str(sym) for sym, name in captured.dim_names.items()
                                  if name.startswith("T"))

        self.shapes: dict[int, tuple[int, ...]] = {}  # by the value's id (it outlives us)

    def shape(self, val: torch.Tensor) -> tuple[int, ...]:
        key = id(val)
        out = self.shapes.get(key)
        if out is None:
            out = self.shapes[key] = tuple(_value(size_expr(s), self.subs) for s in val.shape)
        return out

    def quadratic(self, val: Any) -> bool:
        """Two or more dims (or one dim's square) grow with the sequence."""
        if not isinstance(val, torch.Tensor):
            return False
        return _quadratic(tuple(str(size_expr(s)) for s in val.shape), self.seq_syms)


@lru_cache(maxsize=1 << 14)
def _quadratic(shape: tuple[str, ...], seq_syms: frozenset) -> bool:
    degree = 0
    for text in shape:
        expr = parse_size_expr(text)
        if isinstance(expr, int) or expr.is_number:
            continue
        degree += sum(sympy.degree(expr, sym) for sym in expr.free_symbols
                      if str(sym) in seq_syms)
    return degree >= 2


@lru_cache(maxsize=1 << 16)
def _value_text(text: str, subs: tuple[tuple[str, int], ...]) -> int:
    expr = parse_size_expr(text)
    values = dict(subs)
    return int(expr.subs({s: values.get(str(s), 1) for s in expr.free_symbols}))


def _value(expr: Any, subs: tuple[tuple[str, int], ...]) -> int:
    return expr if isinstance(expr, int) else _value_text(str(expr), subs)


def local_numel(shape: tuple[int, ...], layout: Layout, tp: int) -> float:
    if isinstance(layout, Shard):
        try:
            return float(math.prod(local_shape(shape, layout, tp)))
        except ValueError:
            return math.prod(shape) / tp
    return float(math.prod(shape))


def element_bytes(val: torch.Tensor, dtype_bytes: int,
                   model_dtype: Optional[torch.dtype] = None) -> int:
    """Bytes per element in training: the model's own float dtype at ``dtype_bytes``, any
    other dtype (a float32 upcast in a bfloat16 model, a mask, an index) at its own."""
    if val.dtype.is_floating_point:
        return dtype_bytes if model_dtype in (None, val.dtype) else val.element_size()
    if val.dtype.is_complex:
        real = val.dtype.to_real()
        return 2 * (dtype_bytes if model_dtype in (None, real) else real.itemsize)
    return val.element_size()


def model_dtype(gm: fx.GraphModule) -> Optional[torch.dtype]:
    """The float dtype holding most of the parameters' elements."""
    counts: dict[torch.dtype, int] = {}
    for p in gm.parameters():
        if p.dtype.is_floating_point:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def layout_of(text: Optional[str]) -> Layout:
    if not text or text.startswith("(") or text == "-":
        return Replicate()
    return parse_layout(text)


def local_shape_at(shape: tuple[int, ...], layout: Layout, tp: int) -> tuple[int, ...]:
    if isinstance(layout, Shard):
        try:
            return local_shape(shape, layout, tp)
        except ValueError:
            out = list(shape)
            out[layout.dim] = max(1, out[layout.dim] // tp)
            return tuple(out)
    return shape


def out_numel(node: fx.Node, local: list[tuple[int, ...]]) -> float:
    """Rows x columns of a product from its local operands (batch dims broadcast)."""
    if node.target in (aten.linear.default,):
        x, w = local[0], local[1]
        return math.prod(x[:-1]) * w[0]
    if node.target in (aten.addmm.default,):
        return local[1][0] * local[2][1]
    if node.target in (aten.baddbmm.default, aten.addbmm.default):
        b1, b2 = local[1], local[2]
        return math.prod(b1[:-1]) * b2[-1]
    a, b = local[0], local[1]
    if len(b) == 1:
        return math.prod(a[:-1])
    batch = [max(x, y) for x, y in zip(reversed(a[:-2]), reversed(b[:-2]))]
    longer = a[:-2] if len(a) > len(b) else b[:-2]
    batch += list(reversed(longer[:abs(len(a) - len(b))]))
    rows = a[-2] if len(a) >= 2 else 1
    return math.prod(batch) * rows * b[-1]
