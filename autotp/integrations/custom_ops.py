"""Teaching autotp a layout rule for a user's own op (``autotp.register_rule``).

A custom op (``torch.library.custom_op``, a C++ kernel, another library's op) is opaque to
autotp: no hand-written rule names it and torch declares nothing about how it computes.
Without a rule it runs replicated and the plan names it. Its author knows how it shards, and
says so in autotp's layout notation, one pattern per way:

    autotp.register_rule("mylib::expert_mm", [
        "S(0), S(0) -> S(0)",   # experts split: each rank computes its own experts
        "R, S(2) -> S(2)",      # column-parallel: each rank its output features
        "S(2), S(1) -> P",      # row-parallel: partial sums, all-reduced by autotp
    ], example=(x, w))

A pattern lists one layout per tensor argument (in the op's argument order) and the output's.
It is offered where it fits the call: every sharded dim exists and divides by tp, a partial
sum only for a floating output. ``example`` (the op's arguments, real tensors) has every
pattern checked numerically before the rule is registered, at tp 2 and 4: each rank's piece
computed by the op itself, reassembled, compared with the op on the whole tensors. A pattern
that gives other numbers is refused, named. ``pointwise=True`` declares an elementwise op
(the broadcast strategies of torch's pointwise ops); ``rule=`` takes a function of the call
(``autotp.rules.OpCall`` -> ``Strategy`` list) for patterns that depend on shapes or
arguments.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch

from autotp.errors import ConfigError, RuleError
from autotp.layout import Layout, Partial, Shard, parse_layout
from autotp.rules.derived import pointwise_rule
from autotp.rules.registry import USER_RULES, OpCall, Registry, Rule, Strategy, TensorMeta, \
    normalize_dim

Pattern = Union[str, tuple[Sequence[Union[str, Layout]], Union[str, Layout]]]


def register_rule(op: Any, strategies: Optional[Sequence[Pattern]] = None, *,
                  rule: Optional[Rule] = None, pointwise: bool = False,
                  example: Any = None, tps: Sequence[int] = (2, 4),
                  atol: float = 1e-5, rtol: float = 1e-5) -> str:
    """Give ``op`` a layout rule; returns the op's qualified name (see the module doc).

    ``op``: the op (``torch.ops.mylib.expert_mm``, an overload of it) or its qualified name
    (``"mylib::expert_mm"``). Exactly one of ``strategies`` (patterns such as
    ``"R, S(2) -> S(2)"``), ``rule`` or ``pointwise=True``. ``example``: the op's arguments
    (a tuple, or ``(args, kwargs)``) on which every strategy is checked before the rule is
    kept."""
    key, overload = _op_key(op)
    if sum(x is not None and x is not False for x in (strategies, rule, pointwise)) != 1:
        raise ConfigError("register_rule takes one of strategies=[...], rule= or "
                          "pointwise=True")
    if Registry.default().written(overload if overload is not None else key):
        raise ConfigError(f"autotp already has a rule for {key}: a registered one would "
                          "replace an exact, tested rule")
    if pointwise:
        rule = pointwise_rule
    elif strategies is not None:
        rule = patterns_rule([_parse(key, p) for p in strategies])
    assert rule is not None
    USER_RULES[key] = rule
    if example is not None:
        try:
            _check(key, overload, example, tps, atol, rtol)
        except BaseException:
            USER_RULES.pop(key, None)
            raise
    return key


def unregister_rule(op: Any) -> None:
    """Forget the rule ``register_rule`` gave ``op`` (it runs replicated again)."""
    USER_RULES.pop(_op_key(op)[0], None)


def patterns_rule(patterns: list[tuple[tuple[Layout, ...], Layout]]) -> Rule:
    """The rule offering each pattern where it fits the call."""

    def rule(call: OpCall) -> Iterable[Strategy]:
        for inputs, output in patterns:
            if len(inputs) != len(call.inputs) or not isinstance(call.output, TensorMeta):
                continue
            ins = [_fit(layout, meta, call.tp) for layout, meta in zip(inputs, call.inputs)]
            out = _fit(output, call.output, call.tp)
            if any(x is None for x in ins) or out is None:
                continue
            if isinstance(out, Partial) and not call.output.floating:
                continue
            yield Strategy(tuple(ins), out, name="registered")  # type: ignore[arg-type]
    return rule


def _fit(layout: Layout, meta: TensorMeta, tp: int) -> Optional[Layout]:
    if not isinstance(layout, Shard):
        return layout
    if not -meta.ndim <= layout.dim < meta.ndim:
        return None
    dim = normalize_dim(layout.dim, meta.ndim)
    if not meta.shardable(dim, tp, layout.blocks):
        return None
    return Shard(dim, layout.blocks)


def _parse(key: str, pattern: Pattern) -> tuple[tuple[Layout, ...], Layout]:
    try:
        if isinstance(pattern, str):
            ins, arrow, out = pattern.partition("->")
            if not arrow:
                raise ValueError("no '->'")
            inputs = tuple(parse_layout(p) for p in ins.split(",") if p.strip())
            return inputs, parse_layout(out)
        inputs_given, out_given = pattern
        return (tuple(x if not isinstance(x, str) else parse_layout(x) for x in inputs_given),
                out_given if not isinstance(out_given, str) else parse_layout(out_given))
    except ValueError as exc:
        raise ConfigError(
            f"register_rule({key!r}): {pattern!r} is not a pattern ({exc}); write one layout "
            "per tensor argument and the output's, as \"R, S(2) -> S(2)\" (layouts: R, P, "
            "S(dim), S(dim)xk for k fused blocks)") from None


def _op_key(op: Any) -> tuple[str, Optional[Any]]:
    """(qualified name, the overload if known)."""
    if isinstance(op, str):
        if "::" not in op:
            raise ConfigError(f"register_rule: name the op as 'library::name', not {op!r}")
        name = op.split(".")[0]
        library, short = name.split("::")
        packet = getattr(getattr(torch.ops, library, None), short, None)
        overload = getattr(packet, "default", None) if packet is not None else None
        return name, overload
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name, getattr(op, "default", None)
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name, op
    schema_op = getattr(op, "_opoverload", None)  # a torch.library.custom_op object
    if schema_op is not None:
        return schema_op._schema.name, schema_op
    raise ConfigError(f"register_rule: {op!r} is not an op; pass torch.ops.library.name or "
                      "'library::name'")


def _check(key: str, overload: Any, example: Any, tps: Sequence[int], atol: float,
           rtol: float) -> None:
    from autotp.verification.testing import check_op

    if overload is None:
        raise ConfigError(f"register_rule({key!r}, example=...): the op is not loaded; "
                          "import the library that defines it first")
    args, kwargs = example if _is_args_kwargs(example) else (tuple(example), {})
    for tp in tps:
        for check in check_op(overload, args, kwargs, tp=tp, atol=atol, rtol=rtol):
            if not check.ok:
                how = f"fails on a rank's pieces ({check.error})" if check.error else \
                    f"differs from the op on the whole tensors by {check.max_diff:.3g}"
                raise RuleError(
                    f"the rule registered for {key} is not exact: strategy {check.strategy} "
                    f"at tp={tp} {how} on the example; fix or drop that pattern")


def _is_args_kwargs(example: Any) -> bool:
    return isinstance(example, tuple) and len(example) == 2 and \
        isinstance(example[0], (tuple, list)) and isinstance(example[1], dict)

