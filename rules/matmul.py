"""Matrix products, each written as an einsum equation; one enumerator derives the strategies.

For ``"mk,kn->mn"`` (and bmm, linear, matmul) every index letter gives one way to shard:

* a letter of the output that one operand holds (``n``: column parallel; ``m``: rows of the
  activation) is sharded there and in the output; the other operand is read replicated,
* a letter held by both operands and the output (a batch dim, e.g. attention heads in
  q @ k^T) is sharded everywhere,
* a contracted letter (``k``: row parallel) is sharded in both operands and gives ``P``:
  A @ B = sum_r A[:, k_r] @ B[k_r, :].

A product is linear in each operand, so (P, R) -> P and (R, P) -> P as well.
The equation, not the name, decides which dim is the column: ``addmm``'s Conv1D weight is
stored [in, out] and its column is dim 1; ``linear``'s weight is [out, in] and it is dim 0.
"""

from __future__ import annotations

import string
from typing import Iterator, Optional

import torch

from autotp.layout import (
    P,
    R,
    ROUTED,
    Blocks,
    Layout,
    Period,
    Shard,
)
from autotp.rules.registry import OpCall, RuleSet, Strategy, TensorMeta

aten = torch.ops.aten
rules = RuleSet()


def einsum_strategies(equation: str, call: OpCall) -> Iterator[Strategy]:
    lhs, out_spec = equation.split("->")
    in_specs = lhs.split(",")
    metas = call.inputs[: len(in_specs)]
    sizes: dict[str, object] = {}
    for spec, meta in zip(in_specs, metas):
        for letter, size in zip(spec, meta.shape):
            sizes.setdefault(letter, size)
    # operands past the equation (a bias, MoE group offsets) are read replicated; callers
    # keep only the strategies where that is exact
    extra = len(call.inputs) - len(in_specs)
    for letter in dict.fromkeys(lhs.replace(",", "")):
        holders = [i for i, spec in enumerate(in_specs) if letter in spec]
        # with context parallelism the sequence's letter may be sharded (the activation's
        # tokens, the weight read whole); elsewhere only static sizes are
        probe = TensorMeta((sizes[letter],), metas[holders[0]].dtype,
                           metas[holders[0]].split if call.context else frozenset())
        if letter in out_spec:
            # a batch letter shared by the operands keeps plain shards, or heads sharded
            # inside a merged batch (Bloom's [B*H, T, D] bmm)
            block_options = call.blocks if len(holders) == 1 else \
                (1,) + tuple(b for b in call.blocks if isinstance(b, Period))
            for blocks in block_options:
                if not probe.shardable(0, call.tp, blocks):
                    continue
                inputs: list[Layout] = [
                    Shard(spec.index(letter), blocks) if letter in spec else R
                    for spec in in_specs
                ]
                name = "batch" if len(holders) > 1 else "column"
                yield Strategy(tuple(inputs) + (R,) * extra,
                               Shard(out_spec.index(letter), blocks), name=name)
        elif len(holders) == 2:
            # a contracted letter sharded alike in both operands: plainly, or in unequal
            # blocks (a concatenation of h and 4h pieces meeting one row-parallel weight)
            unequal: list[Blocks] = [b for b in call.blocks if isinstance(b, tuple)]
            for blocks in [1, *unequal]:
                if probe.shardable(0, call.tp, blocks):
                    inputs = [Shard(spec.index(letter), blocks) for spec in in_specs]
                    yield Strategy(tuple(inputs) + (R,) * extra, P, name="row")
    if extra == 0 and all(m.floating for m in metas):
        for i in range(len(in_specs)):
            inputs = [P if j == i else R for j in range(len(in_specs))]
            yield Strategy(tuple(inputs), P, name="linear")


def _without_ellipsis(equation: str, call: OpCall) -> Optional[str]:
    """``... i j, ... j d -> ... i d`` with the ellipsis spelled as letters of its own, where
    every operand's ellipsis stands for the same dims (same count, same sizes); None where
    they broadcast against each other."""
    lhs, _, out = equation.partition("->")
    specs = lhs.split(",")
    if not out or len(specs) != len(call.inputs):
        return None
    spans = []
    for spec, meta in zip(specs, call.inputs):
        explicit = len(spec.replace("...", ""))
        spans.append(tuple(meta.shape[:meta.ndim - explicit]) if "..." in spec else None)
    shapes = {span for span in spans if span is not None}
    if len(shapes) != 1:
        return None
    count = len(next(iter(shapes)))
    free = [c for c in string.ascii_letters if c not in equation][:count]
    if len(free) < count:
        return None
    dots = "".join(free)
    return ",".join(spec.replace("...", dots) for spec in specs) + "->" + \
        out.replace("...", dots)


def _letters(n: int) -> str:
    return string.ascii_lowercase[:n]


@rules.register(aten.mm.default)
def mm_rule(call: OpCall) -> Iterator[Strategy]:
    yield from einsum_strategies("mk,kn->mn", call)


@rules.register(aten.bmm.default)
def bmm_rule(call: OpCall) -> Iterator[Strategy]:
    yield from einsum_strategies("bmk,bkn->bmn", call)


@rules.register(aten.linear.default)
def linear_rule(call: OpCall) -> Iterator[Strategy]:
    """y = x @ W^T (+ b): "...k,nk->...n". autotp splits the bias off before planning, so a
    biased call only remains when it is planned as one unit; then only column-parallel and
    replicated strategies are offered (a row-parallel bias would be added tp times)."""
    batch = _letters(call.inputs[0].ndim - 1)
    equation = f"{batch}z,yz->{batch}y"
    has_bias = len(call.inputs) == 3
    for strategy in einsum_strategies(equation, call):
        if not has_bias:
            yield strategy
        elif strategy.name == "column" and strategy.inputs[1] == Shard(0, _blocks(strategy)):
            yield Strategy(strategy.inputs[:2] + (Shard(0, _blocks(strategy)),),
                           strategy.output, name="column")


def _blocks(strategy: Strategy) -> Blocks:
    out = strategy.output
    return out.blocks if isinstance(out, Shard) else 1


@rules.register(aten.matmul.default)
def matmul_rule(call: OpCall) -> Iterator[Strategy]:
    a, b = call.inputs
    if a.ndim < 2 or b.ndim < 2:
        return
    batch = _letters(max(a.ndim, b.ndim) - 2)
    a_batch = batch[len(batch) - (a.ndim - 2):]
    b_batch = batch[len(batch) - (b.ndim - 2):]
    # Broadcast batch dims of size 1 are not shared letters: give them their own letter.
    a_spec = "".join(
        ch if a.shape[i] == call.out.shape[len(batch) - len(a_batch) + i] else ch.upper()
        for i, ch in enumerate(a_batch)
    )
    b_spec = "".join(
        ch if b.shape[i] == call.out.shape[len(batch) - len(b_batch) + i] else ch.upper()
        for i, ch in enumerate(b_batch)
    )
    yield from einsum_strategies(f"{a_spec}xy,{b_spec}yz->{batch}xz", call)


@rules.register(aten.einsum.default)
def einsum_rule(call: OpCall) -> Iterator[Strategy]:
    equation = call.arg("equation").replace(" ", "")
    if "..." in equation:
        equation = _without_ellipsis(equation, call)
        if equation is None:
            return  # ellipses that broadcast: computed replicated
    if "->" not in equation:  # implicit output: the letters used once, sorted
        letters = equation.replace(",", "")
        equation += "->" + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(equation.split("->")[0].split(",")) != len(call.inputs):
        return
    yield from einsum_strategies(equation, call)


@rules.register(aten.baddbmm.default)
def baddbmm_rule(call: OpCall) -> Iterator[Strategy]:
    """beta * input + alpha * (b1 @ b2): the batch dim may be sharded in all three."""
    bias, b1, b2 = call.inputs
    if bias.ndim != 3 or bias.shape[0] != b1.shape[0]:
        return
    for blocks in (1,) + tuple(b for b in call.blocks if isinstance(b, Period)):
        if b1.shardable(0, call.tp, blocks):
            batch = Shard(0, blocks)
            yield Strategy((batch, batch, batch), batch, name="batch")


GROUPED_MM: list = [aten._grouped_mm.default, "transformers::grouped_mm_fallback"]


@rules.register(*GROUPED_MM)
def grouped_mm_rule(call: OpCall) -> Iterator[Strategy]:
    """Mixture-of-experts products: rows of ``x`` [S, k] sorted by expert, ``offs`` [E] their
    cumulative counts, each group multiplied by its expert's ``W[e]`` [k, n]: "sk,ekn->sn"
    per group. Column (n) and row (k) parallel are exact within every expert, as in a dense
    MLP (Megatron's tensor parallelism inside the experts); the rows (tokens) are not, since
    ``offs`` counts global rows. Experts whole (expert parallelism inside the group): the
    stacked weights sharded along the experts, each rank multiplying the rows routed to the
    experts it owns (``S(0)@experts``); the lowering makes ``offs`` local to those rows."""
    if len(call.inputs) != 3 or call.inputs[0].ndim != 2 or call.inputs[1].ndim != 3:
        return  # batched (3-D x 3-D) or biased forms: computed replicated
    for strategy in einsum_strategies("sk,ekn->sn", call):
        if not (isinstance(strategy.inputs[0], Shard) and strategy.inputs[0].dim == 0):
            yield strategy
    experts = call.inputs[1].static(0)
    if call.routed is not None and call.inputs[0].shape[0] == call.routed and \
            experts is not None and experts % (call.tp * call.ep) == 0:
        # experts whole, e/tp per rank (e/(tp*ep) with expert parallelism): each rank
        # multiplies the rows routed to its own experts (S(0)@experts: contiguous, since the
        # rows are sorted by expert)
        rows = Shard(0, ROUTED)
        yield Strategy((rows, Shard(0), R), rows, name="experts")
    if call.inputs[0].floating and call.inputs[1].floating:
        yield Strategy((P, R, R), P, name="linear")
        yield Strategy((R, P, R), P, name="linear")


CONV: list = [aten.conv1d.default, aten.conv2d.default, aten.conv3d.default]


@rules.register(*CONV)
def conv_rule(call: OpCall) -> Iterator[Strategy]:
    """A convolution is a product over input channels (and the kernel window) per output
    channel: output channels are its column (weight dim 0, output dim 1), input channels its
    row (input dim 1 with weight dim 1 -> P). Any partition of the channels is as exact as
    an equal one, so the column and the row hold in blocks too (a 1x1 conv's output split
    by a later ``chunk(2, 1)``: S(1)x2).

    With ``groups = g``, channels c_in = g * i and c_out = g * o, the weight [c_out, i, ...]:
    group j reads input channels [j*i, (j+1)*i) and writes output channels [j*o, (j+1)*o),
    y[:, group j] = conv(x[:, group j], W[group j]). A shard of dim 1 that holds whole groups,
    each rank the same groups of x, W and b, is exact: S(1), S(0), S(0) -> S(1), each rank
    convolving its g/tp groups (blocks: each segment of whole groups, g/tp per rank of each).
    Beside it, only the conv's linearity in x: (P, R) -> P."""
    x, weight = call.inputs[:2]
    has_bias = len(call.inputs) == 3
    groups = call.arg("groups", 1)
    if x.ndim != weight.ndim or not isinstance(groups, int):
        return
    if groups != 1:
        yield from _group_strategies(call, groups)
        return
    for blocks in call.blocks:
        if weight.shardable(0, call.tp, blocks):
            bias = (Shard(0, blocks),) if has_bias else ()
            yield Strategy((R, Shard(0, blocks)) + bias, Shard(1, blocks), name="column")
        if not has_bias and x.shardable(1, call.tp, blocks) and \
                weight.shardable(1, call.tp, blocks):
            yield Strategy((Shard(1, blocks), Shard(1, blocks)), P, name="row")
    if not has_bias and x.floating:
        yield Strategy((P, R), P, name="linear")


def _group_strategies(call: OpCall, groups: int) -> Iterator[Strategy]:
    """Channels sharded as the g groups are: tp divides the groups of every segment."""
    x = call.inputs[0]
    has_bias = len(call.inputs) == 3
    whole_groups = TensorMeta((groups,), x.dtype)
    for blocks in call.blocks:
        if whole_groups.shardable(0, call.tp, blocks):
            bias = (Shard(0, blocks),) if has_bias else ()
            yield Strategy((Shard(1, blocks), Shard(0, blocks)) + bias, Shard(1, blocks),
                           name="groups")
    if not has_bias and x.floating:
        yield Strategy((P, R), P, name="linear")

