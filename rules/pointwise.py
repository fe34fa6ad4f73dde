"""Pointwise ops: elementwise maps keep any shard that broadcasting lines up.

* Every elementwise op commutes with slicing: f(x)[shard] = f(x[shard]). An input that is
  broadcast along the sharded dim (size 1 or missing) is read replicated.
* Linear ops also pass ``P`` through: neg(A1 + A2) = neg(A1) + neg(A2);
  (A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2); (A1 + A2) * c = A1 * c + A2 * c.
* Adding a replicated tensor or a scalar to a ``P`` value would add it ``tp`` times, and
  P * P is not a sum of local products: those strategies are never offered.
"""

from __future__ import annotations

from typing import Iterator

import torch

from autotp.layout import P, R, Layout, Shard
from autotp.rules.registry import (OpCall, RuleSet, Strategy, TensorMeta, normalize_dim,
                                   shardable_dims)

aten = torch.ops.aten
rules = RuleSet()

# Unary ops that are linear in their tensor input (casts and copies included).
LINEAR_UNARY = [
    aten.neg.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.positive.default,
]

# Elementwise ops that are not linear: S and R only.
NONLINEAR = [
    aten.relu.default,
    aten.gelu.default,
    aten.silu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.exp.default,
    aten.expm1.default,
    aten.rsub.Scalar,  # c - x: a constant minus a partial sum would count c tp times
    aten.log_sigmoid.default,
    aten.log.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.polar.default,
    aten.erf.default,
    aten.reciprocal.default,
    aten.square.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.maximum.default,
    aten.minimum.default,
    aten.max.other,
    aten.min.other,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    aten.relu_.default,
    aten.leaky_relu.default,
    aten.hardtanh.default,
    aten.softplus.default,
    aten.mish.default,
    aten.elu.default,
    aten.logical_not.default,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.bitwise_not.default,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.isinf.default,
    aten.isnan.default,
    aten.sign.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.fmod.Scalar,
    aten.remainder.Scalar,
    aten.floor_divide.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.dropout.default,
]

# add/sub: linear in all tensor operands jointly.
ADDITIVE = [aten.add.Tensor, aten.sub.Tensor]
# mul: linear in each tensor operand separately; div: linear in the numerator only.
MULTIPLICATIVE = [aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
                  aten.add.Scalar, aten.sub.Scalar]

# Every deterministic map above: each output element reads its operands' elements at its own
# (broadcast) index alone, so evaluating it on a block of the operands gives that block of
# the result (context parallelism evaluates attention masks so, key block by key block).
ELEMENTWISE = frozenset(LINEAR_UNARY + NONLINEAR + ADDITIVE + MULTIPLICATIVE) - {
    aten.dropout.default, aten.empty_like.default}


def broadcast_shards(call: OpCall) -> Iterator[Strategy]:
    """Shard each output dim; inputs hold the aligned dim, or are broadcast along it."""
    out = call.out
    for dim in range(out.ndim):
        for blocks in call.blocks:
            if not out.shardable(dim, call.tp, blocks):
                continue
            inputs: list[Layout] = []
            for meta in call.inputs:
                layout = _aligned_input_layout(meta, out, dim, blocks)
                if layout is None:
                    break
                inputs.append(layout)
            else:
                yield Strategy(tuple(inputs), Shard(dim, blocks), name="elementwise")


def _aligned_input_layout(meta: TensorMeta, out: TensorMeta, dim: int, blocks: int):
    aligned = dim - (out.ndim - meta.ndim)
    if aligned < 0:
        return R
    size = meta.shape[aligned]
    if size == 1 and out.shape[dim] != 1:
        return R
    if size == out.shape[dim]:
        return Shard(aligned, blocks)
    return None


@rules.register(*NONLINEAR)
def elementwise_rule(call: OpCall) -> Iterator[Strategy]:
    if not isinstance(call.output, TensorMeta):
        return
    yield from broadcast_shards(call)


@rules.register(*LINEAR_UNARY)
def linear_unary_rule(call: OpCall) -> Iterator[Strategy]:
    yield from broadcast_shards(call)
    # A cast is linear only into a floating type at least as wide: int(a1) + int(a2) is not
    # int(a1 + a2), and rounding each partial sum to bf16 is not rounding their sum.
    if len(call.inputs) == 1 and isinstance(call.output, TensorMeta):
        src, dst = call.inputs[0].dtype, call.output.dtype
        if src.is_floating_point and dst.is_floating_point and dst.itemsize >= src.itemsize:
            yield Strategy((P,), P, name="linear")


# Casts to another tensor's dtype: that tensor gives its dtype only, never its values.
CAST_LIKE = [aten.type_as.default, aten.to.other]


@rules.register(*CAST_LIKE)
def cast_like_rule(call: OpCall) -> Iterator[Strategy]:
    """``x.type_as(other)``: ``other`` gives its dtype only, never its values.

    Where ``other`` broadcasts against ``x`` (mostly the tensor ``x`` was computed from, as
    a norm's ``output.type_as(x)``): the elementwise strategies, ``other``'s layout lined up
    with ``x``'s. Where it does not (torchtitan's ``xq_out.type_as(xv)``, v of fewer heads
    than q): ``x``'s shard passes through and ``other`` may be replicated or sharded along
    any dim, so q's layout is not tied to v's shape. The broadcasting case offers the
    elementwise strategies alone: every layout of ``other`` there adds strategies that are
    no cheaper and crowd a bounded beam.
    """
    x, other = call.inputs[0], call.inputs[1]
    if _broadcasts(other.shape, x.shape):
        yield from broadcast_shards(call)
        return
    others: list[Layout] = [R]
    others += [Shard(d, b) for d, b in shardable_dims(other, call)]
    for d, b in shardable_dims(x, call):
        for other_layout in others:
            yield Strategy((Shard(d, b), other_layout), Shard(d, b), name="cast")


def _broadcasts(shape: tuple, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(to)))


@rules.register(*ADDITIVE)
def additive_rule(call: OpCall) -> Iterator[Strategy]:
    yield from broadcast_shards(call)
    # (A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2); a scalar operand would be added tp times,
    # but for 0 (Python's sum() starts from it: (A1 + A2) + 0 = (A1 + 0) + A2).
    scalars = [a for a in (call.arg("self"), call.arg("other")) if not _is_tensor_arg(a)]
    if len(call.inputs) == 2 and not scalars and call.out.floating:
        yield Strategy((P, P), P, name="linear")
    elif len(call.inputs) == 1 and scalars == [0] and call.out.floating:
        yield Strategy((P,), P, name="linear")


@rules.register(*MULTIPLICATIVE)
def multiplicative_rule(call: OpCall) -> Iterator[Strategy]:
    yield from broadcast_shards(call)
    if not call.out.floating:
        return
    op = call.op
    if op in (aten.add.Scalar, aten.sub.Scalar):
        return  # adding a scalar to a partial sum would add it tp times
    n = len(call.inputs)
    # (A1 + A2) * B = A1 * B + A2 * B, in either operand of mul; only the numerator of div.
    linear_positions = range(n) if op in (aten.mul.Tensor, aten.mul.Scalar) else range(min(n, 1))
    if n >= 1 and not _is_tensor_arg(call.args[0]):
        return  # scalar-first forms have no linear tensor position we track
    for i in linear_positions:
        inputs = tuple(P if j == i else R for j in range(n))
        yield Strategy(inputs, P, name="linear")


@rules.register(aten.lerp.Tensor, aten.lerp.Scalar)
def lerp_rule(call: OpCall) -> Iterator[Strategy]:
    """``lerp(a, b, w) = a + w * (b - a)``, elementwise. Linear in (a, b) jointly for a
    replicated weight: lerp(A1 + A2, B1 + B2, w) = lerp(A1, B1, w) + lerp(A2, B2, w)."""
    yield from broadcast_shards(call)
    if call.out.floating:
        yield Strategy((P, P) + (R,) * (len(call.inputs) - 2), P, name="linear")


@rules.register(aten.glu.default)
def glu_rule(call: OpCall) -> Iterator[Strategy]:
    """``glu(x, d) = a * sigmoid(b)`` for the halves ``a | b`` of dim d: a shard of another
    dim stays; along d, the two halves as blocks (each rank its part of both) give the
    rank's part of the output (``S(d)x2 -> S(d)``, as a gate|up projection's chunk)."""
    src = call.inputs[0]
    dim = normalize_dim(call.arg("dim", -1), src.ndim)
    for d, blocks in shardable_dims(src, call):
        if d != dim:
            yield Strategy((Shard(d, blocks),), Shard(d, blocks), name="elementwise")
        elif blocks == 2 and call.out.shardable(d, call.tp):
            yield Strategy((Shard(d, 2),), Shard(d), name="halves")


def _is_tensor_arg(arg: object) -> bool:
    return isinstance(arg, TensorMeta)
