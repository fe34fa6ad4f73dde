"""The rule registry: ATen overload -> the strategies that compute it exactly under sharding.

A rule is a pure function of one op call (op, arguments with global shapes, tp). It lists
*base* strategies in terms of the forward algebra only: which input layouts give which output
layout. The registry then applies the gradient semantics in one place:

* a strategy whose inputs and outputs are all replicated is offered twice: all ``R`` (every
  rank computes the same value and the same gradient) and all ``R*`` (the same value, partial
  gradients),
* in any other strategy a replicated input is read as ``R*``: its gradient on each rank only
  covers that rank's part of the output, so the ranks' gradients must be summed.

Every op is also computable fully replicated, so the all-replicated strategies are always
present. Rules never read module or parameter names: only ops, shapes and arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import sympy
import torch

from autotp.ops import argument
from autotp.layout import (
    R,
    R_STAR,
    ROUTED,
    Blocks,
    Layout,
    Partial,
    Period,
    Replicate,
    Shard,
    divides,
    is_mixed,
    parse_layout,
)

Size = Union[int, sympy.Expr]


@dataclass(frozen=True)
class TensorMeta:
    """Global shape (ints, or sympy expressions for symbolic batch/sequence) and dtype."""

    shape: tuple[Size, ...]
    dtype: torch.dtype
    # symbolic sizes that may be sharded (the sequence, under sequence parallelism); the
    # caller guarantees at run time that tp divides them
    split: frozenset = frozenset()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def static(self, dim: int) -> Optional[int]:
        size = self.shape[dim]
        if isinstance(size, int):
            return size
        if isinstance(size, sympy.Integer):
            return int(size)
        return None

    def shardable(self, dim: int, tp: int, blocks: Blocks = 1) -> bool:
        if self.shape[dim] in self.split:
            return blocks == 1
        if isinstance(blocks, Period) and not isinstance(blocks.length, int):
            # batch x sequence rows, each sequence one segment split along: the sequence's
            # symbol a factor of the merged size
            size = sympy.sympify(self.shape[dim])
            symbol = next((s for s in size.free_symbols if str(s) == blocks.length), None)
            return symbol is not None and self.static(dim) is None and \
                _whole_ratio(size, symbol)
        if isinstance(blocks, Period) and isinstance(blocks.length, int):
            # a symbolic count of static segments
            return self.static(dim) is None and blocks.length % tp == 0 and \
                multiple_of(self.shape[dim], blocks.length)
        size = self.static(dim)
        return size is not None and size > 1 and divides(size, tp, blocks)

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


Output = Union[Layout, tuple[Optional[Layout], ...], None]


@dataclass(frozen=True)
class Strategy:
    """One way to compute an op: a layout per tensor input (flatten order) and the output's."""

    inputs: tuple[Layout, ...]
    output: Output
    name: str = ""
    # Exact, but outside Megatron's pattern: priced like a matrix of this many bytes held
    # whole on every rank (autotp.planner.cost), so a plan takes it only to shard more than that.
    premium: float = 0.0

    def __str__(self) -> str:
        ins = ", ".join(str(layout) for layout in self.inputs)
        suffix = f"  [{self.name}]" if self.name else ""
        return f"({ins}) -> {format_output(self.output)}{suffix}"


def format_output(output: Output) -> str:
    if output is None:
        return "-"
    if isinstance(output, tuple):
        return "(" + ", ".join("-" if o is None else str(o) for o in output) + ")"
    return str(output)


def parse_output(text: str) -> Output:
    """Inverse of ``format_output``: ``"-"``, ``"S(1)"``, ``"(S(2), -, R)"``."""
    if text == "-":
        return None
    if text.startswith("("):
        parts = [p.strip() for p in _split_top(text[1:-1])]
        return tuple(None if p == "-" else parse_layout(p) for p in parts)
    return parse_layout(text)


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def output_layouts(output: Output) -> list[Layout]:
    if output is None:
        return []
    if isinstance(output, tuple):
        return [o for o in output if o is not None]
    return [output]


@dataclass(frozen=True)
class OpCall:
    """One call of an op, as the rules see it: no graph, no names, only algebra."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[TensorMeta, ...]
    output: Union[TensorMeta, tuple[Optional[TensorMeta], ...], None]
    tp: int
    blocks: tuple[Blocks, ...] = (1,)
    # the row count of tensors sorted by expert (a grouped product's rows) when this call
    # reads or writes such rows: their strategies are also offered on routed rows
    routed: Optional[Size] = None
    experts: Optional[int] = None  # how many experts those rows are sorted by
    # expert parallelism across ep data-parallel ranks (autotp.runtime.routed_rows): the routed
    # rows are dispatched to the ranks that own their experts, so experts are split tp * ep
    # ways and a routed row cannot read replicated data by its position (see _routed_variants)
    ep: int = 1
    # context parallelism (autotp.runtime.ring): the group shards the sequence of every
    # activation, and attention may take its queries, keys and values sharded along it
    context: bool = False

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument the op's schema calls ``name`` (see ``autotp.ops.argument``)."""
        return argument(self.op, self.args, self.kwargs, name, default)

    @property
    def out(self) -> TensorMeta:
        assert isinstance(self.output, TensorMeta), f"{self.op} has no single tensor output"
        return self.output


Rule = Callable[[OpCall], Iterable[Strategy]]

# Rules for a user's own ops (``autotp.register_rule``), by op overload or qualified name.
USER_RULES: dict[Any, Rule] = {}


@dataclass
class RuleSet:
    """The rules of one op family, collected by decorator, merged into a ``Registry``."""

    rules: dict[Any, Rule] = field(default_factory=dict)

    def register(self, *ops: Any) -> Callable[[Rule], Rule]:
        def decorate(rule: Rule) -> Rule:
            for op in ops:
                if op in self.rules:
                    raise KeyError(f"two rules for {op}")
                self.rules[op] = rule
            return rule

        return decorate


class Registry:
    """Maps op overloads to rules (their lowerings: ``autotp.runtime.lowerings``); build a
    fresh one per test if needed."""

    def __init__(self, rule_sets: Sequence[RuleSet]):
        self._rules: dict[Any, Rule] = {}
        for rule_set in rule_sets:
            for op, rule in rule_set.rules.items():
                if op in self._rules:
                    raise KeyError(f"two rules for {op}")
                self._rules[op] = rule

    @classmethod
    def default(cls) -> "Registry":
        # cycle: each rules module imports this one
        from autotp.rules import embedding, matmul, misc, norms, pointwise, views

        return cls(
            [
                matmul.rules,
                pointwise.rules,
                views.rules,
                norms.rules,
                embedding.rules,
                misc.rules,
            ]
        )

    def _key(self, op: Any) -> Any:
        """``op``, or its qualified name for rules registered by name (custom ops of other
        libraries, such as ``"transformers::grouped_mm_fallback"``, which exist only once
        that library is imported)."""
        if op in self._rules:
            return op
        schema = getattr(op, "_schema", None)
        return schema.name if schema is not None else op

    def rule(self, op: Any) -> Optional[Rule]:
        """The op's rule: hand-written, registered by the user (``autotp.register_rule``),
        or derived from what torch declares about the op (``autotp.rules.derived``)."""
        key = self._key(op)
        found = self._rules.get(key) or USER_RULES.get(op) or USER_RULES.get(key)
        if found is not None:
            return found
        from autotp.rules.derived import derived_rule  # cycle: it imports this module

        return derived_rule(op)

    def __contains__(self, op: Any) -> bool:
        return self.rule(op) is not None

    def written(self, op: Any) -> bool:
        """Whether a hand-written rule names ``op`` (not derived, not the user's)."""
        return self._key(op) in self._rules

    @property
    def ops(self) -> list[Any]:
        """The ops with hand-written rules."""
        return sorted(self._rules, key=str)

    def base_strategies(self, call: OpCall) -> list[Strategy]:
        rule = self.rule(call.op)
        assert rule is not None, f"no rule for {call.op}"
        return list(rule(call))

    def strategies(self, call: OpCall) -> list[Strategy]:
        """All strategies of ``call``, with gradient semantics applied, deduplicated."""
        out: list[Strategy] = []
        seen: set[tuple[Any, ...]] = set()
        n = len(call.inputs)
        replicated = _replicate_output(call.output, R)
        base = [Strategy((R,) * n, replicated, name="replicated")]
        base += self.base_strategies(call)
        base += self._routed_variants(call)
        for strategy in base:
            if len(strategy.inputs) != n:
                raise AssertionError(
                    f"rule for {call.op} gave {len(strategy.inputs)} input layouts for "
                    f"{n} tensor inputs"
                )
            if _sums_whole_segments(strategy):
                continue
            for variant in _with_gradient_semantics(strategy, call):
                key = (variant.inputs, variant.output)
                if key not in seen:
                    seen.add(key)
                    out.append(variant)
        return out


    def _routed_variants(self, call: OpCall) -> list[Strategy]:
        """Strategies on rows routed to experts (``S(0)@experts``), derived from the rule's
        own: where the rule computes rows independently (every sharded tensor, read or
        written, is sharded along dim 0 of the routed row count), any contiguous split of
        the rows is as exact as an equal one, so it holds for the run-time split the
        experts' row counts give. The rule sees the row count as a size it may split (as
        sequence parallelism's sequence). Only where the output holds routed rows (not a
        size read off them), and not for ops that draw random numbers (their streams are
        placed by rank). Lowerings see ``S(0)@experts`` and keep its rows' count as is."""
        rows = call.routed
        tags = getattr(call.op, "tags", ())
        if rows is None or torch.Tag.nondeterministic_seeded in tags:
            return []

        def widen(meta: Any) -> Any:
            if isinstance(meta, TensorMeta) and meta.ndim and meta.shape[0] == rows:
                return replace(meta, split=meta.split | {rows})
            return meta

        output = tuple(widen(o) for o in call.output) if isinstance(call.output, tuple) \
            else widen(call.output)
        wide = replace(call, inputs=tuple(widen(m) for m in call.inputs), output=output)
        metas = list(wide.inputs) + _as_list(output)
        routed = Shard(0, ROUTED)

        def swap(x: Any) -> Any:
            return routed if x == Shard(0) else x

        out: list[Strategy] = []
        for strategy in self.base_strategies(wide):
            layouts = list(strategy.inputs) + _as_list(strategy.output)
            shards = [(x, m) for x, m in zip(layouts, metas) if isinstance(x, Shard)]
            if not any(isinstance(o, Shard) for o in _as_list(strategy.output)) or \
                    any(isinstance(x, Partial) for x in layouts) or \
                    any(x != Shard(0) or m is None or m.shape[0] != rows for x, m in shards):
                continue
            if call.ep > 1 and _reads_by_position(strategy.inputs, wide.inputs):
                continue
            output_layout = tuple(swap(o) for o in strategy.output) \
                if isinstance(strategy.output, tuple) else swap(strategy.output)
            out.append(Strategy(tuple(swap(x) for x in strategy.inputs), output_layout,
                                name=f"{strategy.name or 'rows'} (routed)"))
        return out


def _reads_by_position(layouts: tuple, metas: tuple) -> bool:
    """Whether routed integers (token positions, ``perm // k``) index a replicated tensor
    (``x[token_of_row]``). With expert parallelism the routed rows are dispatched to the
    ranks that own their experts, where such a position names a row of another rank's
    tokens: the rows must be gathered before they are dispatched."""
    index = any(isinstance(x, Shard) and m is not None and not m.floating
                for x, m in zip(layouts, metas))
    return index and any(isinstance(x, Replicate) and m is not None and m.ndim
                         for x, m in zip(layouts, metas))


def _as_list(output: Any) -> list[Any]:
    return list(output) if isinstance(output, tuple) else [output]


def _sums_whole_segments(strategy: Strategy) -> bool:
    """A partial sum over a dim with segments every rank holds whole would count those
    segments tp times: no rule's partial output holds for such an input."""
    return any(isinstance(x, Shard) and is_mixed(x.blocks) for x in strategy.inputs) and \
        any(isinstance(o, Partial) for o in output_layouts(strategy.output))


def _replicate_output(output: Any, layout: Layout) -> Output:
    if output is None:
        return None
    if isinstance(output, tuple):
        return tuple(None if o is None else layout for o in output)
    return layout


def _with_gradient_semantics(strategy: Strategy, call: OpCall) -> Iterator[Strategy]:
    outs = output_layouts(strategy.output)
    all_replicated = all(isinstance(x, Replicate) for x in (*strategy.inputs, *outs))
    if all_replicated:
        yield Strategy((R,) * len(strategy.inputs), _replicate_output(strategy.output, R),
                       name=strategy.name or "replicated")
        yield Strategy((R_STAR,) * len(strategy.inputs),
                       _replicate_output(strategy.output, R_STAR),
                       name=strategy.name or "replicated")
        return
    if any(isinstance(o, Replicate) and not o.grad_partial for o in outs):
        # An exact replicated output from non-replicated inputs would need a collective
        # inside the op; rules never offer that.
        raise AssertionError(f"rule for {call.op} returned R output from sharded inputs")
    inputs = tuple(R_STAR if isinstance(x, Replicate) else x for x in strategy.inputs)
    yield Strategy(inputs, strategy.output, strategy.name, strategy.premium)


# ---- helpers shared by the rule modules -------------------------------------------------


def _whole_ratio(size: Size, symbol: Any) -> bool:
    """Whether ``size`` is ``symbol`` times a polynomial with positive integer coefficients
    (B*T of T)."""
    numerator, denominator = sympy.fraction(sympy.cancel(sympy.sympify(size) / symbol))
    return denominator == 1 and bool(numerator.is_positive) and \
        multiple_of(numerator, 1)


def multiple_of(size: Size, n: int) -> bool:
    """Whether a size (an int, or a polynomial in the batch/sequence symbols) is ``n`` times
    one with integer coefficients."""
    expr = sympy.expand(sympy.sympify(size))
    try:
        coefficients = sympy.Poly(expr, *sorted(expr.free_symbols, key=str)).coeffs() \
            if expr.free_symbols else [expr]
    except sympy.PolynomialError:  # floor division, modulo: not provably a multiple
        return False
    return all(c.is_integer and int(c) % n == 0 for c in coefficients)


def shardable_dims(meta: TensorMeta, call: OpCall) -> Iterator[tuple[int, Blocks]]:
    """(dim, blocks) pairs along which ``meta`` can be sharded at this tp."""
    for dim in range(meta.ndim):
        for blocks in call.blocks:
            if meta.shardable(dim, call.tp, blocks):
                yield dim, blocks


def all_layouts(meta: TensorMeta, call: OpCall) -> list[Layout]:
    layouts: list[Layout] = [R, Partial()]
    layouts += [Shard(d, b) for d, b in shardable_dims(meta, call)]
    return layouts


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim
