"""Every registered layout rule, checked numerically on small real tensors.

``SAMPLES`` maps each op of ``Registry.default()`` to sample calls whose shapes let the rules
actually shard: sizes divisible by tp=2 and tp=4, fused dims divisible by 3 * tp, attention
shaped [B, H, T, D]. ``check_op`` shards the inputs per strategy, runs every rank's lowered op,
reassembles and compares with the unsharded op. The reshape algebra and the registry's
gradient semantics are tested directly below.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import pytest
import sympy
import torch
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from autotp.layout import R, R_STAR, Partial, Period, Replicate, Shard, parse_layout
from autotp.rules import misc
from autotp.rules.registry import OpCall, Registry, Strategy, TensorMeta, output_layouts
from autotp.rules.views import map_shard_through_view, view_groups
from autotp.verification.testing import check_op

aten = torch.ops.aten
Sample = tuple[tuple[Any, ...], dict[str, Any]]
TPS = (2, 4)
MAX_INT = 9223372036854775807

# ---- sample tensors ----------------------------------------------------------------------

_GEN = torch.Generator().manual_seed(1234)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN).to(dtype)


def positive(*shape: int) -> torch.Tensor:
    """Values in [0.5, 1.5): safe for log, sqrt, rsqrt, reciprocal, pow."""
    return torch.rand(shape, generator=_GEN) + 0.5


def randint(high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_GEN).to(dtype)


def bools(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_GEN) > 0.5


def s(*args: Any, **kwargs: Any) -> Sample:
    return args, kwargs


X = randn(8, 12)  # the default pointwise operand: 8 -> S(0) (x2), 12 -> S(1) (x3)
X3 = randn(4, 8, 12)
XI = randint(5, 8, 12)
XB = bools(8, 12)
QKV = [randn(2, 4, 8, 8) for _ in range(3)]  # [B, H, T, D]
CAUSAL = torch.ones(8, 8, dtype=torch.bool).tril()
IDS = torch.tensor([[0, 5, 9, 15, 3, 12, 7, 8], [5, 1, 14, 10, 4, 11, 2, 6]])
WITH_INF = X.clone().index_fill_(1, torch.tensor([3]), float("inf"))
WITH_NAN = X.clone().index_fill_(0, torch.tensor([2]), float("nan"))
WITH_ZEROS = X.clone().index_fill_(1, torch.tensor([0, 5]), 0.0)


def unary(ops: list[Any], *extra: Any, x: torch.Tensor = X, **kwargs: Any) -> dict[Any, list]:
    return {op: [s(x, *extra, **kwargs)] for op in ops}


SAMPLES: dict[Any, list[Sample]] = {
    # ---- matrix products (fused output dims of 24 = 3 * tp * 2) ----
    aten.mm.default: [s(randn(8, 12), randn(12, 24))],
    aten.bmm.default: [s(randn(4, 8, 12), randn(4, 12, 8))],
    aten.linear.default: [
        s(randn(8, 12), randn(24, 12)),
        s(randn(2, 8, 12), randn(24, 12)),
        s(randn(2, 8, 12), randn(24, 12), randn(24)),
    ],
    aten.matmul.default: [
        s(randn(2, 4, 8, 12), randn(12, 16)),
        s(randn(2, 4, 8, 12), randn(1, 4, 12, 8)),
        s(randn(4, 8, 12), randn(2, 1, 12, 8)),
        s(QKV[0], QKV[1].transpose(-1, -2)),
    ],
    # ---- attention: broadcast bool mask, per-head float mask, causal, GQA, MQA ----
    aten.scaled_dot_product_attention.default: [
        s(*QKV),
        s(*QKV, CAUSAL.expand(2, 1, 8, 8).clone()),
        s(*QKV, randn(2, 1, 8, 8)),
        s(*QKV, randn(2, 4, 8, 8)),
        s(*QKV, randn(8, 8)),
        s(*QKV, is_causal=True, scale=0.5),
        s(randn(2, 8, 8, 8), randn(2, 4, 8, 8), randn(2, 4, 8, 8), enable_gqa=True),
        # multi-query: one k/v head broadcast to every query head (Falcon)
        s(randn(2, 8, 8, 8), randn(2, 1, 8, 8), randn(2, 1, 8, 8), randn(2, 1, 8, 8)),
    ],
    # ---- normalizations, softmax, scans ----
    aten._native_batch_norm_legit_no_training.default: [
        s(randn(4, 12, 8), randn(12), randn(12), randn(12), positive(12), 0.1, 1e-5),
        s(randn(2, 6, 4, 8), None, None, randn(6), positive(6), 0.1, 1e-5),
    ],
    aten.native_group_norm.default: [
        s(randn(2, 8, 6), randn(8), randn(8), 2, 8, 6, 4, 1e-5),
        s(randn(2, 16, 3, 4), None, None, 2, 16, 12, 8, 1e-5),
    ],
    aten._native_batch_norm_legit_functional.default: [
        s(randn(4, 12, 8), randn(12), randn(12), randn(12), positive(12), True, 0.1, 1e-5),
    ],
    aten.layer_norm.default: [
        s(randn(4, 6, 16), [16], randn(16), randn(16), 1e-5),
        s(randn(4, 8, 12), [8, 12], randn(8, 12), randn(8, 12), 1e-5),
        s(randn(4, 6, 16), [16], None, None),
    ],
    aten.rms_norm.default: [s(randn(4, 6, 16), [16], randn(16), 1e-6), s(randn(4, 8, 16), [16])],
    aten.softmax.int: [s(randn(2, 4, 8, 8), -1), s(X, 0, torch.float64)],
    aten._softmax.default: [s(randn(2, 4, 8, 8), -1, False)],
    aten.log_softmax.int: [s(randn(2, 4, 8, 8), -1)],
    aten._log_softmax.default: [s(randn(2, 4, 8, 8), 1, False)],
    aten.cumsum.default: [s(X, 1), s(XI, 0, dtype=torch.int64)],
    # ---- reductions ----
    aten.sum.dim_IntList: [
        s(X3, [1]), s(X3, [1], True), s(X3, [0, 2]), s(X3, [-1], True), s(X3, []), s(X3, None),
        s(randint(9, 4, 8), [1]), s(X3, [2], dtype=torch.float64),
    ],
    aten.mean.dim: [s(X3, [1]), s(X3, [0, 2], True), s(X3, [-1])],
    aten.sum.default: [s(X3), s(randint(9, 4, 8))],
    aten.mean.default: [s(X3)],
    aten.logsumexp.default: [s(X3, [2]), s(X3, [1], True), s(X3, [0, 2])],
    aten.amax.default: [s(X3, [1]), s(X3, [0, 2], True)],
    aten.amin.default: [s(X3, [-1], True)],
    aten.var.dim: [s(X3, [2], False, True), s(X3, [1])],
    aten.std.dim: [s(X3, [2], True, True), s(X3, [0, 1])],
    aten.var.correction: [s(X3, [1], correction=1), s(X3, [2], correction=0, keepdim=True)],
    aten.std.correction: [s(X3, [-1], keepdim=True)],
    aten.any.dim: [s(bools(4, 8, 12), 1)],
    aten.all.dim: [s(bools(4, 8, 12), 0, True)],
    aten.argmax.default: [s(X3, 1), s(X3, -1, True)],
    aten.argmin.default: [s(X3, 2)],
    aten.min.default: [s(X)],
    aten.any.default: [s(XB)],
    aten.all.default: [s(XB)],
    aten._assert_async.msg: [s(torch.tensor(True), "checked")],
    aten._assert_async.default: [s(torch.tensor(True))],
    aten.max.default: [s(X)],
    # ---- embedding: vocab 16, padding_idx 5 lies inside one rank's rows ----
    aten.embedding.default: [s(randn(16, 8), IDS), s(randn(16, 8), IDS, 5)],
    # ---- views ----
    aten.view.default: [
        s(randn(2, 3, 16), [2, 3, 4, 4]),  # split the hidden dim into heads
        s(randn(2, 3, 4, 4), [2, 3, 16]),  # merge heads
        s(randn(2, 3, 16), [6, 16]),  # flatten
        s(randn(2, 3, 16), [2, 3, -1, 4]),
        s(randn(2, 3, 16), [-1, 16]),
        s(randn(4, 1, 24), [4, 24]),
        s(randn(4, 24), [4, 24]),
    ],
    aten.reshape.default: [s(randn(2, 3, 16), [2, 3, 4, 4]), s(randn(2, 3, 4, 4), [6, -1]),
                           # timm's fused qkv: 3 blocks become a dim, heads keep the shard
                           s(randn(2, 3, 96), [2, 3, 3, 8, 4])],
    aten._unsafe_view.default: [s(randn(2, 3, 16), [2, 3, 4, 4])],
    aten.view_copy.default: [s(randn(2, 3, 4, 4), [2, 3, 16])],
    aten.expand.default: [s(randn(2, 1, 16), [2, 4, -1]), s(randn(4, 16), [3, 4, 16])],
    aten.expand_as.default: [s(randn(2, 4, 1), randn(2, 4, 12)), s(randn(8, 12), X3),
                             s(randn(1, 8, 12), randn(6, 8, 12))],
    aten.slice.Tensor: [
        s(X3, 1, 0, MAX_INT),
        s(X3, 2, 2, 10),
        s(X3, -1, 0, 6, 2),
        s(X3, 0, 0, 4),
        s(X3, 1),
    ],
    aten.select.int: [s(X3, 1, 3), s(X3, -1, 0)],
    aten.split.Tensor: [s(randn(4, 24), 8, 1), s(randn(8, 12), 4), s(randn(4, 24), 10, -1)],
    aten.split_with_sizes.default: [s(randn(4, 24), [8, 8, 8], 1), s(randn(4, 24), [16, 8], -1)],
    aten.chunk.default: [s(randn(4, 24), 3, 1), s(randn(8, 12), 2)],
    aten.roll.default: [s(randn(4, 8, 6), [1, -2], [1, 2]), s(randn(8, 4), [3], [0])],
    aten.cat.default: [
        s([randn(4, 8), randn(4, 8), randn(4, 8)], 1),
        s([randn(4, 8), randn(4, 8)]),
        s([randn(4, 8), randn(4, 4)], -1),
    ],
    aten.transpose.int: [s(X3, 0, 2), s(X3, -1, -2)],
    aten.t.default: [s(X), s(randn(8))],
    aten.movedim.int: [s(X3, 2, 0), s(X3, 0, -1), s(randn(2, 4, 6, 8), 1, 2)],
    aten.unfold.default: [s(randn(4, 8, 12), 2, 3, 3), s(randn(4, 8, 12), 1, 4, 2)],
    aten.permute.default: [s(X3, [2, 0, 1]), s(X3, [0, -1, 1])],
    aten.unsqueeze.default: [s(X, 1), s(X, -1), s(X, 0)],
    # complex numbers: a float tensor with a trailing (real, imaginary) pair (rotary embeddings)
    aten.view_as_complex.default: [s(randn(4, 8, 12, 2))],
    aten.view_as_real.default: [s(torch.complex(randn(4, 8, 12), randn(4, 8, 12)))],
    aten.polar.default: [s(positive(8, 12), X)],
    aten.squeeze.dim: [s(randn(8, 1, 12), 1), s(randn(8, 1, 12), -2), s(X, 0), s(randn(4, 8), 0)],
    aten.squeeze.dims: [s(randn(8, 1, 12, 1), [1, 3]), s(randn(4, 1, 8), [0, 1])],
    aten.squeeze.default: [s(randn(8, 1, 12, 1)), s(randn(4, 1, 8, 1))],
    # ---- linear pointwise ----
    **unary([aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
             aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default]),
    aten.add.Tensor: [s(X, randn(12)), s(X3, randn(4, 1, 12), alpha=2), s(X, 1.0), s(XI, XI),
                      s(X, 0)],
    aten.sub.Tensor: [s(X, randn(8, 1)), s(X3, X3, alpha=0.5)],
    aten.mul.Tensor: [s(X, randn(12)), s(randn(2, 4, 8, 8), randn(2, 1, 8, 8)), s(XI, 3)],
    aten.mul.Scalar: [s(X, 2.5)],
    aten.div.Tensor: [s(X, positive(8, 12)), s(X, 4.0)],
    aten.div.Scalar: [s(X, 4.0)],
    aten.add.Scalar: [s(X, 1.0, alpha=2)],
    aten.sub.Scalar: [s(X, 1.0)],
    # ---- dtype casts ----
    aten.to.dtype: [s(X, torch.float64), s(XI, torch.float32), s(X, torch.int64)],
    aten._to_copy.default: [
        s(X, dtype=torch.float64), s(XB, dtype=torch.float32), s(WITH_ZEROS, dtype=torch.bool),
        s(X, dtype=torch.bfloat16),
    ],
    aten.to.dtype_layout: [
        s(X, dtype=torch.float64, layout=torch.strided, device=torch.device("cpu")),
        s(X, dtype=torch.int32, layout=torch.strided, device=torch.device("cpu")),
    ],
    aten.to.device: [s(X, torch.device("cpu"), torch.float64)],
    aten.to.other: [s(X, randn(8, 12, dtype=torch.float64))],
    # ``other`` gives its dtype only: any layout of it, whatever its shape (torchtitan's
    # ``xq_out.type_as(xv)`` with v of fewer heads)
    aten.type_as.default: [s(X, randn(12, dtype=torch.float64)), s(X, randn(3)),
                           s(X3, randn(4, 2, 6, dtype=torch.float64))],
    # ---- nonlinear pointwise ----
    **unary([aten.relu.default, aten.silu.default, aten.sigmoid.default,
             aten.tanh.default, aten.exp.default, aten.abs.default, aten.sin.default,
             aten.cos.default, aten.erf.default, aten.square.default, aten.relu_.default,
             aten.mish.default, aten.elu.default, aten.sign.default, aten.floor.default,
             aten.ceil.default, aten.round.default, aten.softplus.default,
             aten.hardtanh.default, aten.leaky_relu.default, aten.zeros_like.default,
             aten.ones_like.default, aten.expm1.default, aten.log_sigmoid.default]),
    **unary([aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default],
            x=positive(8, 12)),
    aten.pow.Tensor_Scalar: [s(positive(8, 12), 2.5)],
    aten.pow.Tensor_Tensor: [s(positive(8, 12), positive(12))],
    aten.pow.Scalar: [s(2.0, X)],
    aten.gelu.default: [s(X), s(X, approximate="tanh")],
    aten.clamp.default: [s(X, -0.5, 0.5), s(X, None, 0.1)],
    aten.clamp_min.default: [s(X, 0.0)],
    aten.clamp_max.default: [s(X, 0.0)],
    aten.maximum.default: [s(X, randn(12))],
    aten.minimum.default: [s(X, randn(8, 1))],
    aten.full_like.default: [s(X, 3.0)],
    aten.empty_like.default: [s(XI)],  # filled deterministically, see _deterministic_fill
    aten.dropout.default: [s(X, 0.5, False)],
    aten.isinf.default: [s(WITH_INF)],
    aten.isnan.default: [s(WITH_NAN)],
    aten.fmod.Scalar: [s(X, 0.3)],
    aten.remainder.Scalar: [s(XI, 3)],
    aten.floor_divide.default: [s(XI, randint(4, 12) + 1)],
    # ---- comparisons and logic on int/bool tensors, with broadcast masks ----
    **{op: [s(XI, randint(5, 12)), s(X, randn(8, 1))]
       for op in (aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor,
                  aten.gt.Tensor, aten.ge.Tensor)},
    **{op: [s(XI, 2), s(X, 0.0)]
       for op in (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar,
                  aten.gt.Scalar, aten.ge.Scalar)},
    **unary([aten.logical_not.default, aten.bitwise_not.default], x=XB),
    **{op: [s(XB, bools(12)), s(bools(2, 4, 8, 8), CAUSAL)]
       for op in (aten.logical_and.default, aten.logical_or.default, aten.__and__.Tensor,
                  aten.__or__.Tensor)},
    aten.bitwise_and.Tensor: [s(XI, randint(7, 8, 1))],
    aten.bitwise_or.Tensor: [s(XI, XI.flip(0)), s(XB, XB)],
    aten.lerp.Tensor: [s(X, randn(8, 12), randn(8, 12)), s(X3, randn(12), randn(8, 12))],
    aten.lerp.Scalar: [s(X, randn(8, 12), 0.3)],
    aten.glu.default: [s(randn(4, 8, 24)), s(randn(4, 8, 12), 1)],
    aten.where.self: [
        s(CAUSAL.expand(2, 1, 8, 8).clone(), randn(2, 4, 8, 8), torch.tensor(-100.0)),
        s(XB, X, randn(12)),
    ],
    aten.masked_fill.Scalar: [
        s(randn(2, 4, 8, 8), ~CAUSAL.expand(2, 1, 8, 8).clone(), -100.0),
        s(randn(2, 4, 8, 8), ~CAUSAL, 0.0),
    ],
    aten.masked_fill.Tensor: [s(randn(2, 4, 8, 8), bools(2, 4, 8, 8), torch.tensor(-5.0))],
    # ---- factories and replicated-by-design ops ----
    aten.arange.default: [s(8), s(8, dtype=torch.float32)],
    aten.arange.start: [s(2, 10)],
    aten.arange.start_step: [s(0, 16, 2)],
    aten.full.default: [s([4, 8], 1.5)],
    aten.zeros.default: [s([4, 8])],
    aten.ones.default: [s([4, 8], dtype=torch.int64)],
    aten.empty.memory_format: [s([4, 8], dtype=torch.int64)],
    aten.scalar_tensor.default: [s(3.0, dtype=torch.float32)],
    aten.new_ones.default: [s(X, [4, 8])],
    aten.new_zeros.default: [s(XI, [2, 3])],
    aten.new_full.default: [s(X, [4, 8], 2.0)],
    aten.new_empty.default: [s(XI, [4, 8])],
    aten.index.Tensor: [s(X, [randint(8, 5)]), s(X, [None, randint(12, 2, 3)])],
    aten.gather.default: [s(X, 1, randint(12, 8, 3)), s(X, 1, randint(12, 8, 4)),
                          s(X, 0, randint(8, 4, 12))],
    aten.numpy_T.default: [s(randn(8, 12))],
    aten.flatten.using_ints: [s(randn(8, 4, 12), 1, 2), s(randn(8, 12, 4), 0, 1)],
    aten.max.other: [s(randn(8, 12), randn(8, 12))],
    aten.min.other: [s(randn(8, 12), randn(12))],
    aten.where.ScalarOther: [s(bools(8, 12), randn(8, 12), 0.5)],
    aten.where.ScalarSelf: [s(bools(8, 12), 0.5, randn(8, 12))],
    aten.stack.default: [s([randn(8, 12), randn(8, 12)], 1), s([randn(8, 12), randn(8, 12)])],
    aten.einsum.default: [s("bij,bjk->bik", [randn(4, 8, 12), randn(4, 12, 8)]),
                          s("ij,jk", [randn(8, 12), randn(12, 8)]),
                          s("bhtd,bhsd->bhts", [randn(2, 4, 8, 4), randn(2, 4, 8, 4)])],
    aten.baddbmm.default: [s(randn(4, 8, 8), randn(4, 8, 12), randn(4, 12, 8))],
    aten.repeat_interleave.self_int: [s(randn(8, 12), 2, 1), s(randn(2, 4, 6, 8), 3, 1),
                                      s(randn(2, 4, 6), 2, -1, output_size=12)],
    aten.pad.default: [s(randn(8, 12, 4), [0, 2]), s(randn(8, 12, 4), [1, 1, 0, 4]),
                       s(randint(12, 8, 4), [0, 1], "constant", -100.0)],
    aten.constant_pad_nd.default: [s(randn(8, 12, 4), [0, 2]), s(randn(8, 12), [0, 4], 1.5)],
    aten.nll_loss_forward.default: [s(torch.log_softmax(randn(8, 12), -1), randint(12, 8),
                                      None, 1, -100)],
    aten.nll_loss_nd.default: [s(torch.log_softmax(randn(8, 12), -1), randint(12, 8))],
    aten.nll_loss.default: [s(torch.log_softmax(randn(8, 12), -1), randint(12, 8))],
    aten.cross_entropy_loss.default: [s(randn(8, 12), randint(12, 8))],
    aten.mse_loss.default: [s(randn(8, 12), randn(8, 12))],
    aten.index_select.default: [s(X, 0, randint(8, 5))],
    # a KV cache [B, H, S, D] written at three new positions
    **{op: [s(randn(2, 4, 8, 6), 2, torch.tensor([1, 5, 6]), randn(2, 4, 3, 6))]
       for op in (aten.index_copy.default, aten.index_copy_.default)},
    aten.diff.default: [s(X, 1, -1), s(X, 1, 0, randn(1, 12), randn(2, 12))],
    # a per-head decay mask [B, H, chunks, C, C]: heads and chunks may stay sharded
    aten.triu.default: [s(randn(8, 8), 1), s(randn(2, 4, 8, 6, 6), 1)],
    aten.tril.default: [s(randn(8, 8)), s(randn(2, 4, 8, 6, 6), -1), s(randn(4, 8, 8))],
    aten.repeat.default: [s(X, [2, 1])],
    aten.sort.default: [s(X, -1), s(X, 0, True)],
    aten.max.dim: [s(X3, 1), s(X3, -1, True)],
    aten.min.dim: [s(X3, 0)],
    aten.linalg_vector_norm.default: [s(X3, 2, [2], True), s(X3, 2, [1]), s(X3, 1, [0, 2])],
    # peft's DoRA: torch.linalg.norm(W, dim=1) per output row; a matrix norm over two dims
    aten.linalg_norm.default: [s(X, None, [1]), s(X3, 2, [2], True), s(X3, 1, [0, 2])],
    aten.unbind.int: [s(randn(3, 4, 8), 0), s(randn(2, 8, 12), 1)],
    # Flux's q.unflatten(-1, (heads, -1)), and a split of the leading dim
    aten.unflatten.int: [s(randn(2, 3, 16), -1, [4, -1]), s(randn(2, 3, 24), 2, [-1, 4]),
                         s(randn(8, 12), 0, [2, 4])],
    aten.where.Scalar: [s(XB, 1.0, 0.0)],
    aten.rsub.Scalar: [s(X, 1.0), s(X, 2.0, 0.5)],
    aten.argsort.default: [s(X, -1), s(X, 0, True)],
    aten.argsort.stable: [s(X, stable=True, dim=0)],
    aten.topk.default: [s(X, 3)],
    aten.bucketize.Tensor: [s(X, torch.tensor([-1.0, 0.0, 1.0]))],
    aten.searchsorted.Tensor: [s(torch.tensor([-1.0, 0.0, 1.0]), X)],
    aten.outer.default: [s(randn(8), randn(12))],
    aten.copy.default: [s(X, randn(8, 12)), s(randn(4, 8, 12), randn(8, 12))],
    # ---- convolutions (a ViT's patch embedding): output channels column, input row ----
    aten.conv1d.default: [s(randn(2, 4, 10), randn(8, 4, 3)),
                          s(randn(2, 4, 10), randn(8, 4, 3), randn(8), [2], [1])],
    aten.conv2d.default: [s(randn(2, 4, 8, 8), randn(8, 4, 2, 2), None, [2, 2]),
                          s(randn(2, 4, 6, 6), randn(8, 4, 3, 3), randn(8))],
    aten.conv3d.default: [s(randn(1, 4, 4, 4, 4), randn(8, 4, 2, 2, 2))],
    # ---- mixture of experts: routing, token gather/scatter, grouped products ----
    aten.histc.default: [s(randint(4, 16).float(), 4, 0, 3)],
    aten.scatter.value: [s(torch.zeros(8, 12), 1, randint(12, 8, 3), 1.0)],
    aten.scatter.src: [s(torch.zeros(8, 12), 1, randint(12, 8, 3), randn(8, 3))],
    **{op: [s(randn(8, 12), [torch.tensor([6, 1, 3, 0])], randn(4, 12)),
            s(randn(8, 12), [randint(8, 6)], randn(6, 12), True),
            s(randn(4, 8, 12), [None, torch.tensor([2, 5])], randn(4, 2, 12)),
            s(randint(9, 8, 4), [torch.tensor([3, 1])], randint(9, 2, 4))]
       for op in (aten.index_put.default, aten.index_put_.default)},
    aten.slice_scatter.default: [s(randn(4, 8, 12), randn(4, 8, 4), 2, 4, 8),
                                 s(randn(8, 12), randn(2, 12), 0, 0, 2)],
    # 12 rows in three experts' groups of 3, 5 and 4 rows (torch's kernel takes bfloat16;
    # the values are small integers, exact in bfloat16 whatever the order of the sums)
    # (and strides of 16 bytes: 8 bfloat16 columns at least on every rank)
    aten._grouped_mm.default: [s(randint(5, 12, 32, dtype=torch.bfloat16) - 2,
                                 randint(5, 3, 32, 64, dtype=torch.bfloat16) - 2,
                                 torch.tensor([3, 8, 12], dtype=torch.int32))],
    "transformers::grouped_mm_fallback": [s(randn(12, 8), randn(3, 8, 12),
                                            torch.tensor([3, 8, 12], dtype=torch.int32))],
    aten.lift_fresh.default: [s(X)],
    # ---- size queries and metadata asserts (no tensor result) ----
    aten.sym_size.int: [s(X3, 1), s(X3, -1)],
    aten._assert_tensor_metadata.default: [s(X, dtype=torch.float32)],
}

# autocast regions are spliced into the program at capture (trace.inline_autocast): no rule
_HIGHER_ORDER = "higher-order op (no-grad region): takes a subgraph, not an aten call"
NOT_SAMPLED: dict[Any, str] = {
    wrap_with_set_grad_enabled: _HIGHER_ORDER,
    aten.item.default: "data-dependent Python scalar: check_op's FakeTensorMode cannot run it",
    aten.bincount.default: "data-dependent output shape: FakeTensorMode cannot run it "
                           "(replicated-only by design)",
    aten.repeat_interleave.self_Tensor: "data-dependent output shape: FakeTensorMode cannot "
                                        "run it (replicated-only by design)",
}

# bfloat16-only kernels: a partial sum splits values into random parts, which bfloat16
# rounds (relative precision 2^-8); shards of the small-integer samples stay exact.
ATOL = {aten._grouped_mm.default: 0.5}

# Ops that only ever get the replicated strategies, by design.
REPLICATED_BY_DESIGN = frozenset(misc.REPLICATED_ONLY)
# Ops whose output is uninitialized memory: compared under torch's deterministic fill.
UNINITIALIZED = frozenset({aten.empty_like.default, aten.empty.memory_format,
                           aten.new_empty.default})

# ---- helpers -------------------------------------------------------------------------------


def _cases() -> Iterator[Any]:
    for op, samples in SAMPLES.items():
        for index in range(len(samples)):
            for tp in TPS:
                yield pytest.param(op, index, tp, id=f"{op}-{index}-tp{tp}")


def _clone(value: Any) -> Any:
    """Fresh copies of the sample's tensors: in-place ops must not leak between cases."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def _deterministic_fill(enabled: bool) -> Iterator[None]:
    """Under deterministic algorithms torch fills uninitialized memory (ints with their max)."""
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _is_sharded(strategy: Strategy) -> bool:
    layouts = [*strategy.inputs, *output_layouts(strategy.output)]
    return any(isinstance(layout, (Shard, Partial)) for layout in layouts)


def _call(op: Any, inputs: list[TensorMeta], output: TensorMeta, tp: int) -> OpCall:
    return OpCall(op, tuple(inputs), {}, tuple(inputs), output, tp, (1, 2, 3))


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


# ---- coverage ------------------------------------------------------------------------------


def test_every_registered_op_has_a_sample() -> None:
    registered = set(Registry.default().ops)
    missing = [str(op) for op in registered if op not in SAMPLES and op not in NOT_SAMPLED]
    assert not missing, f"registered ops without a sample: {sorted(missing)}"
    stale = [str(op) for op in {*SAMPLES, *NOT_SAMPLED} if op not in registered]
    assert not stale, f"sampled ops that no rule registers: {sorted(stale)}"
    assert not set(SAMPLES) & set(NOT_SAMPLED)


# ---- every strategy of every op is exact ---------------------------------------------------


def _resolve(op: Any) -> Any:
    """A rule registered by name belongs to another library's custom op: import it."""
    if not isinstance(op, str):
        return op
    library, name = op.split("::")
    if library == "transformers":
        pytest.importorskip("transformers.integrations.moe")
    return getattr(getattr(torch.ops, library), name).default


@pytest.mark.parametrize(("op", "index", "tp"), list(_cases()))
def test_strategies_are_exact(op: Any, index: int, tp: int) -> None:
    args, kwargs = _clone(SAMPLES[op][index])
    op = _resolve(op)
    with _deterministic_fill(op in UNINITIALIZED):
        checks = check_op(op, args, kwargs, tp=tp, atol=ATOL.get(op, 1e-5))
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, f"{op} sample {index} at tp={tp}:\n  " + "\n  ".join(failing)
    replicated = [c for c in checks if not _is_sharded(c.strategy)]
    assert len(replicated) >= 2, "the all-R and all-R* strategies must always be checked"
    sharded = [str(c.strategy) for c in checks if _is_sharded(c.strategy)]
    if op in REPLICATED_BY_DESIGN:
        assert not sharded, f"{op} is replicated-only by design but offers {sharded}"
    else:
        assert sharded, f"{op} sample {index} at tp={tp} exercised no Shard/Partial strategy"


# ---- unequal blocks: a fused q|k|v with fewer k/v heads ---------------------------------

# q of 16 columns, k and v of 8 each: proportions 2:1:1, split or sliced into its parts
UNEQUAL = [
    (aten.split_with_sizes.default, (randn(4, 32), [16, 8, 8], 1)),
    (aten.slice.Tensor, (randn(4, 32), 1, 0, 16)),
    (aten.slice.Tensor, (randn(4, 32), 1, 16, 24)),
    (aten.slice.Tensor, (randn(4, 32), 1, 24, MAX_INT)),
    (aten.linear.default, (randn(3, 8), randn(32, 8))),
    # the contracted dim in unequal blocks (a concatenation's proportions): row-parallel
    (aten.linear.default, (randn(3, 32), randn(8, 32))),
    (aten.mm.default, (randn(3, 32), randn(32, 8))),
    (aten.cat.default, ([randn(4, 16), randn(4, 8), randn(4, 8)], 1)),
    (aten.add.Tensor, (randn(4, 32), randn(32))),
]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(("op", "args"), UNEQUAL, ids=lambda v: str(v)[:40])
def test_unequal_blocks_are_exact(op: Any, args: tuple, tp: int) -> None:
    checks = check_op(op, _clone(args), tp=tp, blocks=(1, (2, 1, 1)))
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    blocked = [str(c.strategy) for c in checks if "x2:1:1" in str(c.strategy)]
    assert blocked, [str(c.strategy) for c in checks]
    if op in (aten.split_with_sizes.default, aten.slice.Tensor):  # the parts come out plain
        assert any(str(c.strategy).endswith(("-> (S(1), S(1), S(1))  [split blocks]",
                                             "-> S(1)  [slice block]")) for c in checks)


def test_unequal_blocks_shard_gather_and_print() -> None:
    from autotp.runtime.collectives import _rank_major, _segment_major, local_slice
    from autotp.layout import shard_tensor, unshard_tensor

    layout = parse_layout("S(1)x2:1:1")
    assert layout == Shard(1, (2, 1, 1)) and str(layout) == "S(1)x2:1:1"
    full = torch.arange(4 * 32.0).reshape(4, 32)
    for tp in TPS:
        pieces = [shard_tensor(full, layout, r, tp) for r in range(tp)]
        # rank r: its slice of q, of k, of v
        assert torch.equal(pieces[1][:, :16 // tp], full[:, 16 // tp:2 * 16 // tp])
        assert torch.equal(unshard_tensor(pieces, layout), full)
        assert all(torch.equal(local_slice(full, layout, r, tp), pieces[r]) for r in range(tp))
        ordered = _rank_major(full, 1, (2, 1, 1), tp)
        assert torch.equal(ordered, torch.cat(pieces, 1))
        assert torch.equal(_segment_major(ordered, 1, (2, 1, 1), tp), full)
    with pytest.raises(ValueError):
        Shard(0, (2, 2))  # equal segments are an int


# ---- blocks held whole: multi-query attention's fused q|k|v ---------------------------------

# q of 16 columns sliced across the ranks, k and v of 8 each held whole by every rank
MIXED = [
    (aten.split_with_sizes.default, (randn(4, 32), [16, 8, 8], 1)),
    (aten.linear.default, (randn(3, 8), randn(32, 8))),
    (aten.add.Tensor, (randn(4, 32), randn(32))),
    (aten.unsqueeze.default, (randn(4, 32), 0)),
    (aten.view.default, (randn(4, 32), [4, 32])),
    (aten.sum.dim_IntList, (randn(4, 32), [1])),
]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(("op", "args"), MIXED, ids=lambda v: str(v)[:40])
def test_blocks_held_whole_are_exact(op: Any, args: tuple, tp: int) -> None:
    checks = check_op(op, _clone(args), tp=tp, blocks=(1, (2, -1, -1)))
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    mixed = [str(c.strategy) for c in checks if "x2:1*:1*" in str(c.strategy)]
    if op == aten.sum.dim_IntList:  # a partial sum would count k and v tp times
        assert not [m for m in mixed if "S(1)x2:1*:1*) -> P" in m], mixed
        return
    assert mixed, [str(c.strategy) for c in checks]
    if op == aten.split_with_sizes.default:  # q comes out sliced, k and v whole
        assert any(m.endswith("-> (S(1), R*, R*)  [split blocks]") for m in mixed), mixed


def test_blocks_held_whole_shard_gather_and_print() -> None:
    from autotp.runtime.collectives import local_slice
    from autotp.layout import (
        global_extent,
        local_shape,
        shard_tensor,
        unshard_tensor,
        whole_numel,
        whole_slices,
    )

    layout = parse_layout("S(1)x2:1*:1*")
    assert layout == Shard(1, (2, -1, -1)) and str(layout) == "S(1)x2:1*:1*"
    full = torch.arange(4 * 32.0).reshape(4, 32)
    for tp in TPS:
        pieces = [shard_tensor(full, layout, r, tp) for r in range(tp)]
        assert local_shape((4, 32), layout, tp) == (4, 16 // tp + 16)
        assert global_extent(16 // tp + 16, layout.blocks, tp) == 32
        # rank 1: its slice of q, then all of k and v
        assert torch.equal(pieces[1], torch.cat([full[:, 16 // tp:2 * 16 // tp],
                                                 full[:, 16:]], 1))
        assert torch.equal(unshard_tensor(pieces, layout), full)
        assert all(torch.equal(local_slice(full, layout, r, tp), pieces[r]) for r in range(tp))
        assert whole_slices(16 // tp + 16, layout.blocks, tp) == [(16 // tp, 8),
                                                                  (16 // tp + 8, 8)]
    assert whole_numel((4, 32), layout) == 4 * 16
    with pytest.raises(ValueError):
        Shard(0, (-1, -1))  # some segment must be sliced


def test_periods_shard_gather_and_print() -> None:
    """S(0)%4: segments of 4 (heads) as many as the size holds (the batch), each sliced."""
    from autotp.runtime.collectives import _segment_major, local_slice
    from autotp.layout import local_shape, shard_tensor, unshard_tensor
    from autotp.rules.registry import multiple_of

    layout = parse_layout("S(0)%4")
    assert layout == Shard(0, Period(4)) and str(layout) == "S(0)%4"
    full = torch.arange(3 * 4 * 5.0).reshape(12, 5)  # batch 3 x 4 heads, 5 features
    for tp in (2, 4):
        pieces = [shard_tensor(full, layout, r, tp) for r in range(tp)]
        heads = full.reshape(3, 4, 5)
        for r in range(tp):  # rank r: its heads of every batch entry
            per = 4 // tp
            assert torch.equal(pieces[r], heads[:, r * per:(r + 1) * per].reshape(-1, 5))
            assert torch.equal(local_slice(full, layout, r, tp), pieces[r])
        assert local_shape((12, 5), layout, tp) == (12 // tp, 5)
        assert torch.equal(unshard_tensor(pieces, layout), full)
        gathered = torch.cat(pieces, 0)  # what an all-gather along dim 0 returns
        assert torch.equal(_segment_major(gathered, 0, layout.blocks, tp), full)
    with pytest.raises(ValueError):
        shard_tensor(torch.zeros(10, 5), layout, 0, 2)  # 10 is no whole number of 4s
    with pytest.raises(ValueError):
        Period(1)
    assert multiple_of(S0 * 8, 8) and multiple_of(S0 * S1 * 16 + 32, 8)
    assert not multiple_of(S0 * 8, 16) and not multiple_of(S0 * 8 + 4, 8)
    assert not multiple_of(S0, 2) and multiple_of(24, 8)


# ---- the reshape algebra -------------------------------------------------------------------

S0, S1 = _sym("s0"), _sym("s1")
VIEW_GROUPS = [
    ((S0, S1, 192), (S0 * S1, 192), [((0, 1), (0,)), ((2,), (1,))]),
    ((S0 * S1, 192), (S0, S1, 192), [((0,), (0, 1)), ((1,), (2,))]),
    ((S0, S1, 64), (S0, S1, 4, 16), [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]),
    ((2, 3, 16), (2, 3, 4, 4), [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]),
    ((2, 3, 4, 4), (2, 3, 16), [((0,), (0,)), ((1,), (1,)), ((2, 3), (2,))]),
    ((2, 3, 16), (6, 16), [((0, 1), (0,)), ((2,), (1,))]),
    ((6, 4), (4, 6), [((0, 1), (0, 1))]),
    ((4, 1, 8), (4, 8), [((0,), (0,)), ((1,), ()), ((2,), (1,))]),
    ((8,), (1, 8), [((), (0,)), ((0,), (1,))]),
    ((1, 1), (1,), [((0,), (0,)), ((1,), ())]),
]

SHARD_THROUGH_VIEW = [
    # splitting the hidden dim into heads keeps the shard iff tp divides the heads
    ((2, 3, 32), (2, 3, 8, 4), Shard(2), 4, Shard(2)),
    ((2, 3, 8), (2, 3, 2, 4), Shard(2), 4, None),
    ((2, 3, 8), (2, 3, 2, 4), Shard(2), 2, Shard(2)),
    ((S0, S1, 64), (S0, S1, 4, 16), Shard(2), 4, Shard(2)),
    ((S0, S1, 64), (S0, S1, 4, 16), Shard(2), 8, None),
    # merging heads: the head dim carries a plain shard through, the head size one per head
    ((2, 3, 4, 4), (2, 3, 16), Shard(2), 4, Shard(2)),
    ((2, 3, 4, 4), (2, 3, 16), Shard(3), 2, Shard(2, 4)),  # each head's slice: 4 blocks
    # flattening: the major dim's shard survives if the merged size is static
    ((4, 3, 16), (12, 16), Shard(0), 4, Shard(0)),
    ((2, 3, 16), (6, 16), Shard(2), 2, Shard(1)),
    ((S0, S1, 192), (S0 * S1, 192), Shard(2), 4, Shard(1)),
    ((S0, S1, 192), (S0 * S1, 192), Shard(1), 2, None),
    # blocked shards pass through one-to-one groups, and k blocks split into (k, heads, hs)
    # put the shard on the heads (timm's fused qkv), into (k, n) on n (torch's attention's
    # unflatten(-1, (3, h))); a split whose leading dim is not the blocks does not keep it
    ((4, 24), (4, 24), Shard(1, 3), 2, Shard(1, 3)),
    ((4, 24), (4, 3, 2, 4), Shard(1, 3), 2, Shard(2)),
    ((4, 48), (4, 3, 4, 4), Shard(1, 3), 4, Shard(2)),
    ((4, 24), (4, 3, 8), Shard(1, 3), 2, Shard(2)),
    ((4, 24), (4, 2, 3, 4), Shard(1, 3), 2, None),
    # heads merged after a symbolic batch: B segments of the heads, each sliced (Bloom)
    ((S0, 8, S1, 16), (S0 * 8, S1, 16), Shard(1), 4, Shard(0, Period(8))),
    ((S0, 8, 16), (S0 * 128,), Shard(1), 2, Shard(0, Period(128))),
    ((S0, 8, S1), (S0 * 8 * S1,), Shard(1), 2, None),  # a symbolic size inside the segment
    ((2, 8, 16), (16, 16), Shard(1), 2, Shard(0, 2)),  # a static batch: blocks, no period
    # ... and split back out of it, or kept where the merged dim stays whole
    ((S0 * 8, S1, S1), (S0, 8, S1, S1), Shard(0, Period(8)), 4, Shard(1)),
    ((S0 * 8, S1), (S0, 2, 4, S1), Shard(0, Period(8)), 2, Shard(1)),
    ((S0 * 8, S1), (S0, 2, 4, S1), Shard(0, Period(8)), 4, None),
    ((S0 * 8, S1, 16), (S0 * 8, S1, 4, 4), Shard(0, Period(8)), 2, Shard(0, Period(8))),
    # a segment spans the static dims grouped after it: [B*8, 2] -> [B, 2, 8] is 16 per B
    ((S0 * 8, 2), (S0, 2, 8), Shard(0, Period(8)), 2, Shard(1)),
    ((S0 * 8, 8), (S0 * 2, 8, 4), Shard(0, Period(4)), 2, Shard(1)),
    ((S0 * 8, S1), (S0, 8 * S1), Shard(0, Period(8)), 2, None),
    # a shard merged into an output dim after outer dims, found by strides: fairseq's
    # [T, B, h] -> [T, B*heads, d] (a segment of the heads per batch index), whole heads only
    ((S1, S0, 64), (S1, S0 * 8, 8), Shard(2), 2, Shard(1, Period(8))),
    ((S1, S0, 64), (S1, S0 * 8, 8), Shard(2), 8, Shard(1, Period(8))),
    ((S1, S0, 64), (S1, S0 * 8, 8), Shard(2), 16, None),
    ((S1, S0, 64), (S1 * S0 * 8, 8), Shard(2), 2, Shard(0, Period(8))),
    # ... and back, the segment with the dims after it in the group (torch's attention
    # [T, B*heads, d] -> [T*B, h]; fairseq's -> [T, B, h])
    ((S1, S0 * 8, 8), (S1 * S0, 64), Shard(1, Period(8)), 2, Shard(1)),
    ((S1, S0 * 8, 8), (S1, S0, 64), Shard(1, Period(8)), 4, Shard(2)),
    ((S1, S0 * 8, 8), (S1 * S0, 2, 32), Shard(1, Period(8)), 2, Shard(1)),
    ((S1, S0 * 8, 8), (S1 * S0 * 16, 4), Shard(1, Period(8)), 2, Shard(0, Period(16))),
    ((S1, S0 * 8, 8), (S1 * S0 * 32, 2), Shard(1, Period(8)), 2, Shard(0, Period(32))),
    ((S1, S0 * 8, 8), (S1 * S0 * 8, 8), Shard(1, Period(8)), 16, None),  # splits a head
    # size-1 dims are skipped on either side
    ((4, 1, 8), (4, 8), Shard(2), 2, Shard(1)),
    ((8,), (1, 8), Shard(0), 4, Shard(1)),
    ((1, 8), (8,), Shard(1), 2, Shard(0)),
]


def _shape_id(shape: tuple) -> str:
    return "[" + ",".join(str(size).replace(" ", "") for size in shape) + "]"


@pytest.mark.parametrize(("src", "dst", "groups"), [
    pytest.param(*case, id=f"{_shape_id(case[0])}->{_shape_id(case[1])}") for case in VIEW_GROUPS
])
def test_view_groups(src: tuple, dst: tuple, groups: list) -> None:
    assert view_groups(src, dst) == groups


def test_view_groups_rejects_a_size_change() -> None:
    with pytest.raises(ValueError):
        view_groups((2, 3), (7,))


@pytest.mark.parametrize(("src", "dst", "shard", "tp", "expected"), [
    pytest.param(*case, id=f"{_shape_id(case[0])}->{_shape_id(case[1])}-{case[2]}-tp{case[3]}")
    for case in SHARD_THROUGH_VIEW
])
def test_map_shard_through_view(src: tuple, dst: tuple, shard: Shard, tp: int,
                                expected: Optional[Shard]) -> None:
    src_meta, dst_meta = TensorMeta(src, torch.float32), TensorMeta(dst, torch.float32)
    assert map_shard_through_view(shard, src_meta, dst_meta, tp) == expected


@pytest.mark.parametrize(("src", "dst", "shard", "tp", "expected"), [
    pytest.param(*case, id=f"{_shape_id(case[0])}->{_shape_id(case[1])}-{case[2]}-tp{case[3]}")
    for case in SHARD_THROUGH_VIEW if case[4] is not None
])
def test_view_of_a_shard_is_the_shard_of_the_view(src: tuple, dst: tuple, shard: Shard,
                                                  tp: int, expected: Shard) -> None:
    """Each mapping holds on values: a rank's piece viewed at its local size is its piece of
    the viewed tensor (symbolic sizes at two values each)."""
    from autotp.layout import shard_tensor

    for s0, s1 in ((3, 5), (2, 1)):
        sizes = {S0: s0, S1: s1}
        concrete = [tuple(int(sympy.sympify(d).subs(sizes)) for d in shape) for shape in (src, dst)]
        full = torch.arange(torch.Size(concrete[0]).numel(), dtype=torch.float32)
        full = full.reshape(concrete[0])
        local_dst = list(concrete[1])
        local_dst[expected.dim] //= tp
        for rank in range(tp):
            piece = shard_tensor(full, shard, rank, tp).reshape(local_dst)
            assert torch.equal(piece, shard_tensor(full.reshape(concrete[1]), expected, rank, tp))


# ---- gradient semantics of the registry ----------------------------------------------------


def test_mm_strategies_read_replicated_inputs_as_partial_gradients() -> None:
    a, b, out = (TensorMeta(shape, torch.float32) for shape in [(8, 12), (12, 24), (8, 24)])
    strategies = Registry.default().strategies(_call(aten.mm.default, [a, b], out, tp=2))
    layouts = {(st.inputs, st.output) for st in strategies}
    assert ((R, R), R) in layouts and ((R_STAR, R_STAR), R_STAR) in layouts
    sharded = [st for st in strategies if isinstance(st.output, (Shard, Partial))]
    assert {st.name for st in sharded} >= {"column", "row", "linear"}
    for strategy in sharded:
        replicated = [x for x in strategy.inputs if isinstance(x, Replicate)]
        assert all(x == R_STAR for x in replicated), f"{strategy} reads an exact R input"
    # column parallel: x read R*, W sharded by columns; row parallel: both sharded, P out
    assert ((R_STAR, Shard(1)), Shard(1)) in layouts
    assert ((Shard(1), Shard(0)), Partial()) in layouts


def test_mean_over_a_sharded_dim_is_a_priced_partial_statistic() -> None:
    """A mean over a sharded dim (a norm's statistic) gives a partial sum, priced as 3/4 of
    an n x n matrix (planner/cost.py); a sum over it is the plain partial sum, unpriced.
    Exactness, with the division by tp, is in test_strategies_are_exact."""
    x, out = TensorMeta((4, 6, 16), torch.float32), TensorMeta((4, 6, 1), torch.float32)
    strategies = Registry.default().strategies(
        OpCall(aten.mean.dim, (x, [-1], True), {}, (x,), out, 2))
    statistics = [st for st in strategies if st.name == "partial statistic"]
    assert [(st.inputs, st.output) for st in statistics] == [((Shard(2),), Partial())]
    assert statistics[0].premium == 0.75 * 16 * 16 * 4
    assert all(st.premium == 0 for st in strategies if st.name != "partial statistic")
    sums = Registry.default().strategies(
        OpCall(aten.sum.dim_IntList, (x, [-1], True), {}, (x,), out, 2))
    partial = [st for st in sums if st.output == Partial()]
    assert partial and all(st.premium == 0 for st in partial)


# ---- repeat: a dim repeated once keeps its shard, one repeated k times is k blocks ----------

REPEATS = [
    # [B, T, kv, 1, hs] -> [B, T, kv, n, hs] (Lumina-Next's GQA): the heads keep their shard
    ((randn(2, 6, 4, 1, 4), [1, 1, 1, 3, 1]), [(Shard(2), Shard(2)), (Shard(4), Shard(4))]),
    # two new leading dims: every shard moves past them
    ((randn(8, 12), [2, 3, 1, 1]), [(Shard(0), Shard(2)), (Shard(1), Shard(3))]),
    ((randn(2, 8, 4), [3, 1, 1, 2]), [(Shard(1), Shard(2)), (Shard(2), Shard(3, 2))]),
    # a sharded dim repeated k times: one block per copy (b blocks -> b * k)
    ((randn(4, 24), [2, 3]), [(Shard(0), Shard(0, 2)), (Shard(1), Shard(1, 3)),
                              (Shard(1, 3), Shard(1, 9))]),
]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(("args", "expected"), REPEATS,
                         ids=lambda v: str(v[1]) if isinstance(v, tuple) else "")
def test_repeat_keeps_shards_and_blocks_repeated_dims(args: tuple, expected: list,
                                                      tp: int) -> None:
    checks = check_op(aten.repeat.default, _clone(args), tp=tp)
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    offered = {(c.strategy.inputs[0], c.strategy.output) for c in checks}
    x = args[0]
    for shard, out in expected:
        if x.shape[shard.dim] % (tp * (shard.blocks if isinstance(shard.blocks, int) else 1)):
            continue  # that dim does not split at this tp
        assert (shard, out) in offered, sorted(map(str, offered))
    repeats = args[1]
    lead = len(repeats) - x.ndim
    for shard, out in offered:  # never a plain shard of a dim repeated more than once
        if isinstance(out, Shard) and out.blocks == 1 and isinstance(shard, Shard):
            assert repeats[out.dim] == 1 and out.dim == shard.dim + lead


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("blocks", [(2, 1, 1), (2, -1, -1)], ids=str)
def test_repeat_of_unequal_blocks_repeats_the_proportions(blocks: tuple, tp: int) -> None:
    """A fused q|k|v (2:1:1, or k/v held whole) repeated twice: 2:1:1:2:1:1, exact."""
    checks = check_op(aten.repeat.default, (randn(4, 32), [1, 2]), tp=tp, blocks=(1, blocks))
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    offered = {(c.strategy.inputs[0], c.strategy.output) for c in checks}
    assert (Shard(1, blocks), Shard(1, blocks * 2)) in offered, sorted(map(str, offered))


def test_repeat_of_a_period_keeps_the_period() -> None:
    """[B*8, 16] in segments of 8 (heads after a symbolic batch) repeated twice along the
    merged dim: twice as many segments of 8; each rank's local repeat is its shard of it."""
    x, out = TensorMeta((S0 * 8, 16), torch.float32), TensorMeta((2 * S0 * 8, 16), torch.float32)
    call = OpCall(aten.repeat.default, (x, [2, 1]), {}, (x,), out, 4, (1, Period(8)))
    strategies = {(st.inputs[0], st.output) for st in Registry.default().strategies(call)}
    assert (Shard(0, Period(8)), Shard(0, Period(8))) in strategies
    from autotp.layout import shard_tensor

    full = randn(3 * 8, 16)
    for rank in range(4):
        local = shard_tensor(full, Shard(0, Period(8)), rank, 4).repeat(2, 1)
        assert torch.equal(local, shard_tensor(full.repeat(2, 1), Shard(0, Period(8)), rank, 4))


class RepeatedKVAttention(torch.nn.Module):
    """Grouped-query attention with k/v heads repeated to the query heads, either as
    diffusers' Lumina-Next does (``k.unsqueeze(3).repeat(1, 1, 1, n, 1).flatten(2, 3)``) or
    as transformers' ``repeat_kv`` (``expand`` of a new dim, then ``reshape``)."""

    def __init__(self, expand: bool, heads: int = 8, kv_heads: int = 4, hs: int = 8) -> None:
        super().__init__()
        self.expand, self.heads, self.kv_heads, self.hs = expand, heads, kv_heads, hs
        self.q = torch.nn.Linear(64, heads * hs)
        self.k = torch.nn.Linear(64, kv_heads * hs)
        self.v = torch.nn.Linear(64, kv_heads * hs)
        self.o = torch.nn.Linear(heads * hs, 64)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, kv, hs) -> (B, T, H, hs)
        n = self.heads // self.kv_heads
        if self.expand:
            B, T = x.shape[:2]
            return x[:, :, :, None].expand(B, T, self.kv_heads, n, self.hs).reshape(
                B, T, self.heads, self.hs)
        return x.unsqueeze(3).repeat(1, 1, 1, n, 1).flatten(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.hs)
        k = self._repeat(self.k(x).view(B, T, self.kv_heads, self.hs))
        v = self._repeat(self.v(x).view(B, T, self.kv_heads, self.hs))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("expand", [False, True], ids=["repeat", "expand"])
def test_repeated_kv_heads_stay_sharded(expand: bool) -> None:
    """Both GQA idioms at tp=2: Megatron's plan (the heads sharded through the repeat, one
    all-reduce after the output projection; the input needs no gradient, so none backward),
    outputs, every gradient and one SGD step equal to the unsharded module's (float64, to
    1e-10: k's bias gets a gradient of 0 in exact arithmetic, softmax ignoring a shift shared
    by every key, and float64 keeps its rounding far below the other gradients)."""
    import autotp
    from autotp.verification.verify import assert_equivalent

    torch.manual_seed(0)
    model = RepeatedKVAttention(expand).double()
    x = torch.randn(2, 6, 64, dtype=torch.float64)
    sim = autotp.simulate(model, 2, example_args=(x,))
    plan = sim.plan
    assert not plan.fallbacks, plan.fallbacks
    repeats = [c for c in plan.choices.values() if "repeat" in c.op or "expand" in c.op]
    assert len(repeats) == 2 and all(c.output.startswith("S(") for c in repeats), repeats
    assert [(c.kind, c.phase) for c in plan.collectives] == [("all_reduce", "forward")], \
        plan.collectives
    assert_equivalent(model, sim, args=(x,), atol=1e-10, grad_rtol=1e-10)


# ---- grouped convolutions: whole groups per rank --------------------------------------------

# [B, C, H, W] inputs: a depthwise conv (groups = channels, 8 of them), a grouped conv of 4
# groups (4 -> 8 channels each), a depthwise conv with two output channels per group
GROUPED_CONVS = [
    (aten.conv2d.default, (randn(2, 8, 6, 6), randn(8, 1, 3, 3), randn(8), [1, 1], [1, 1],
                           [1, 1], 8)),
    (aten.conv2d.default, (randn(2, 16, 6, 6), randn(32, 4, 3, 3), None, [1, 1], [1, 1],
                           [1, 1], 4)),
    (aten.conv1d.default, (randn(2, 8, 10), randn(16, 1, 3), randn(16), [1], [1], [1], 8)),
]


@pytest.mark.parametrize("blocks", [(1, 2), (1, (2, -1, -1))], ids=str)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize(("op", "args"), GROUPED_CONVS, ids=lambda v: str(v)[:40])
def test_grouped_conv_shards_whole_groups(op: Any, args: tuple, tp: int,
                                          blocks: tuple) -> None:
    """y[:, group j] = conv(x[:, group j], W[group j]): S(1), S(0), S(0) -> S(1), each rank
    its g/tp groups; blocked (GLUMBConv's chunk(2, 1) after the depthwise conv) where each
    segment is whole groups, g/tp of each per rank."""
    checks = check_op(op, _clone(args), tp=tp, blocks=blocks)
    failing = [f"{c.strategy}: max_diff={c.max_diff:.3g}" for c in checks if not c.ok]
    assert not failing, "\n".join(failing)
    grouped = {str(c.strategy) for c in checks if c.strategy.name == "groups"}
    bias = ", S(0)" if len(args) > 2 and args[2] is not None else ""
    assert f"(S(1), S(0){bias}) -> S(1)  [groups]" in grouped, grouped
    groups = args[6]
    if blocks[1] == 2 and groups % (2 * tp) == 0:
        assert f"(S(1)x2, S(0)x2{bias.replace('S(0)', 'S(0)x2')}) -> S(1)x2  [groups]" \
            in grouped, grouped


@pytest.mark.parametrize("tp", TPS)
def test_conv_groups_tp_cannot_divide_are_not_sharded(tp: int) -> None:
    """3 groups at tp 2 or 4: no rank can hold whole groups, so channels stay whole (the
    conv's linearity in x, P -> P, still holds)."""
    args = (randn(2, 6, 5, 5), randn(6, 2, 3, 3), randn(6), [1, 1], [1, 1], [1, 1], 3)
    checks = check_op(aten.conv2d.default, _clone(args), tp=tp, blocks=(1, 2, 3))
    assert all(c.ok for c in checks), [str(c.strategy) for c in checks if not c.ok]
    assert not [str(c.strategy) for c in checks if _is_sharded(c.strategy)]


def test_conv_column_and_row_hold_in_blocks() -> None:
    """groups = 1: any partition of the output channels is a column, of the input channels a
    row: a 1x1 conv to gate|up channels gives S(1)x2 for a later chunk(2, 1)."""
    column = check_op(aten.conv2d.default, (randn(2, 4, 3, 3), randn(16, 4, 1, 1), randn(16)),
                      tp=2, blocks=(1, 2))
    assert all(c.ok for c in column)
    assert "(R*, S(0)x2, S(0)x2) -> S(1)x2  [column]" in {str(c.strategy) for c in column}
    row = check_op(aten.conv2d.default, (randn(2, 16, 3, 3), randn(4, 16, 1, 1)), tp=2,
                   blocks=(1, 2))
    assert all(c.ok for c in row)
    assert "(S(1)x2, S(1)x2) -> P  [row]" in {str(c.strategy) for c in row}


class _GLUConvMLP(torch.nn.Module):
    """diffusers' GLUMBConv (Sana's MLP): 1x1 conv to 2n channels, depthwise 3x3 conv, a GLU
    split of the channels, 1x1 conv back. ``groups`` of the middle conv: 2n is depthwise."""

    def __init__(self, channels: int = 16, hidden: int = 16, groups: int = 32) -> None:
        super().__init__()
        self.conv_inverted = torch.nn.Conv2d(channels, 2 * hidden, 1)
        self.conv_depth = torch.nn.Conv2d(2 * hidden, 2 * hidden, 3, padding=1, groups=groups)
        self.conv_point = torch.nn.Conv2d(hidden, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        y = self.conv_depth(torch.nn.functional.silu(self.conv_inverted(x)))  # (B, 2n, H, W)
        y, gate = y.chunk(2, dim=1)
        return self.conv_point(y * torch.nn.functional.silu(gate))


class _GroupedConvMLP(torch.nn.Module):
    """1x1 conv, a 3x3 conv of ``groups`` groups, 1x1 conv back: (B, C, H, W) in and out."""

    def __init__(self, channels: int = 16, hidden: int = 24, groups: int = 4) -> None:
        super().__init__()
        self.up = torch.nn.Conv2d(channels, hidden, 1)
        self.grouped = torch.nn.Conv2d(hidden, hidden, 3, padding=1, groups=groups)
        self.down = torch.nn.Conv2d(hidden, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.grouped(self.up(x))))


def _simulated_against_unsharded(model: torch.nn.Module, tp: int) -> dict[str, str]:
    """The simulated ranks against the unsharded module on inputs of another batch than the
    traced example's (``assert_equivalent``: output, every gradient, one SGD step; fp32,
    1e-5); returns the plan's parameter layouts."""
    import warnings

    import autotp
    from autotp.verification.verify import assert_equivalent

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a replicated kernel is reported, not an error
        sim = autotp.simulate(model, tp, example_args=(torch.randn(2, 16, 4, 4),),
                              strict=False)
    assert_equivalent(model, sim, args=(torch.randn(3, 16, 4, 4),), atol=1e-5, grad_rtol=1e-5)
    return {name: p.layout for name, p in sim.plan.params.items()}


@pytest.mark.parametrize("tp", TPS)
def test_glu_conv_mlp_runs_sharded_and_exact(tp: int) -> None:
    """Sana's MLP as Megatron's: the 1x1 conv column-parallel in gate|up blocks, the
    depthwise conv on each rank's channels of both blocks, chunk(2, 1) into plain shards,
    the last 1x1 conv row-parallel."""
    torch.manual_seed(0)
    layouts = _simulated_against_unsharded(_GLUConvMLP(), tp)
    assert layouts == {"conv_inverted.weight": "S(0)x2", "conv_inverted.bias": "S(0)x2",
                       "conv_depth.weight": "S(0)x2", "conv_depth.bias": "S(0)x2",
                       "conv_point.weight": "S(1)"}, layouts


def test_grouped_conv_mlp_runs_sharded_and_exact() -> None:
    """4 groups at tp 2: two whole groups per rank, between a column- and a row-parallel
    1x1 conv."""
    torch.manual_seed(0)
    layouts = _simulated_against_unsharded(_GroupedConvMLP(), 2)
    assert layouts == {"up.weight": "S(0)", "up.bias": "S(0)", "grouped.weight": "S(0)",
                       "grouped.bias": "S(0)", "down.weight": "S(1)"}, layouts


def test_grouped_conv_tp_cannot_divide_stays_whole_and_exact() -> None:
    """3 groups at tp 2: the grouped conv's kernel stays whole, and the module is exact."""
    torch.manual_seed(0)
    layouts = _simulated_against_unsharded(_GroupedConvMLP(groups=3), 2)
    assert layouts["grouped.weight"] == "R" and layouts["grouped.bias"] == "R", layouts
