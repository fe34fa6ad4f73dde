"""Branches the trace must decide: torch.export follows one path through ``forward`` for every
batch and sequence size at once (``autotp.capture.trace``).

* A comparison of symbolic sizes that their traced ranges decide is a Python bool while the
  model is retraced (``decided_size_comparisons``). Sizes are traced from 2 up (export's 0/1
  rule), so ``T > 1`` is True for all of them, and ``F.scaled_dot_product_attention(q, k, v,
  is_causal=T > 1)``, whose ``is_causal`` takes only a bool, traces, with T still symbolic.
  A comparison the ranges leave open stays symbolic: a Python ``if`` on it adds a guard (as
  export does), an op that takes a bool refuses it.
* A branch on the values in a tensor cannot be traced: ``ways_forward`` says what the user
  can do instead: only ways that trace, each one run exact by tests/test_branches.py.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.fx.experimental.symbolic_shapes import (GuardOnDataDependentSymNode,
                                                   statically_known_true)

_COMPARISONS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    found: Optional[BaseException] = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        yield found
        found = found.__cause__ or found.__context__


def size_comparison_as_bool(exc: BaseException) -> bool:
    """``exc`` is an op refusing a symbolic comparison where it takes a bool
    (``is_causal=T > 1``: "argument 'is_causal' must be bool, not SymBool")."""
    return any(isinstance(e, TypeError) and "SymBool" in str(e) for e in _causes(exc))


def _data_dependent(exc: BaseException) -> bool:
    return any(isinstance(e, GuardOnDataDependentSymNode) for e in _causes(exc))


@contextlib.contextmanager
def decided_size_comparisons() -> Iterator[None]:
    """While tracing, ``SymInt`` comparisons that the symbols' ranges decide return a Python
    bool instead of a ``SymBool``. Exact: the answer is the same for every size the program
    accepts, so no guard is added and no size is specialized. The methods are torch's own
    (set on the class by ``torch.fx.experimental.sym_node``), restored on exit; export is
    not thread-safe anyway (``autotp.integrations.generate`` holds a lock around it)."""
    originals = {name: torch.SymInt.__dict__[name] for name in _COMPARISONS}

    def decided(compare: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def comparison(self: Any, other: Any) -> Any:
            out = compare(self, other)
            if isinstance(out, torch.SymBool):
                if statically_known_true(out):
                    return True
                if statically_known_true(torch.sym_not(out)):
                    return False
            return out
        return comparison

    for name, compare in originals.items():
        setattr(torch.SymInt, name, decided(compare))
    try:
        yield
    finally:
        for name, compare in originals.items():
            setattr(torch.SymInt, name, compare)


def ways_forward(exc: BaseException) -> str:
    """What to change, for a trace that ``exc`` stopped (indented lines, to follow the
    user's source line in a ``TraceError``)."""
    if _data_dependent(exc):
        return (
            "\n  this line branches on the values in a tensor (an if on a tensor, bool(), or "
            ".item() / .tolist() steering Python): autotp traces one program for every "
            "input, and the branch would differ between inputs. Ways forward:"
            "\n    - compute both sides and pick with torch.where(condition, a, b)"
            "\n    - if the condition holds for every input the model will see: take the "
            "number with .item() and assert it, torch._check(n > 0), before the branch; "
            "the trace then takes that side, and an input that breaks it fails the check"
            "\n    - decide before forward: pass the flag as a Python bool argument (in "
            "example_kwargs); the program is traced for that value, and a call with "
            "another value is refused"
            "\n    - an if on a one-element tensor (if mask.any():) in a model with weights "
            "(not on the meta device) is traced as the example inputs take it, with a "
            "run-time check that later inputs take it too"
        )
    if size_comparison_as_bool(exc):
        return (
            "\n  this line passes a comparison of the symbolic batch or sequence size where "
            "torch takes a bool: autotp traces every size from 2 up at once, decides such "
            "a comparison where all of them agree (T > 1), and here they do not. Ways "
            "forward:"
            "\n    - if the comparison holds for every size the model will see: "
            "torch._check(T > 8) (your comparison) before this line; sizes are then traced "
            "within it, and a call outside it is refused"
            "\n    - decide before forward: pass the flag as a Python bool argument (in "
            "example_kwargs); the program is traced for that value, and a call with "
            "another value is refused"
        )
    custom = re.search(r"no fake impl registered for <CustomOpDef\((\w+::\w+)\)>|"
                       r"[Nn]o fake impl.*?for (\w+::\w+)|(\w+::\w+).*?(?:Meta|fake) kernel",
                       str(exc))
    if custom:
        op = next(g for g in custom.groups() if g)
        return (
            f"\n  {op} is a custom op with no fake kernel: autotp traces with torch.export, "
            "which runs every op on shapes only. Ways forward:"
            f"\n    - register one: @torch.library.register_fake(\"{op}\") on a function "
            "that returns an empty tensor of the output's shape (torch.empty_like, "
            "x.new_empty)"
            f"\n    - then say how it shards: autotp.register_rule(\"{op}\", "
            "[\"S(0), S(0) -> S(0)\", ...]) (docs/custom-ops.md); without a rule it runs "
            "replicated and the plan names it"
        )
    return (
        "\n  autotp traces the model once, for every batch and sequence size "
        "(torch.export, non-strict): check that the example inputs fit the model"
    )


@dataclass(frozen=True)
class Taken:
    """A branch on a tensor's value, as the example inputs took it."""

    filename: str
    lineno: int
    value: bool

    @property
    def where(self) -> str:
        return f"{self.filename}:{self.lineno}"


def _caller() -> tuple[str, int]:
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno


_BOOL = torch._C.TensorBase.__bool__


def branches_taken(run: Callable[[], Any]) -> dict[tuple[str, int], list[bool]]:
    """Call ``run`` (the model on the example inputs, eagerly) and record, per source line,
    the truth value of every one-element tensor a Python branch read (``if mask.any():``)."""
    taken: dict[tuple[str, int], list[bool]] = {}

    def recording(self: torch.Tensor) -> bool:
        value = _BOOL(self)
        taken.setdefault(_caller(), []).append(value)
        return value

    torch.Tensor.__bool__ = recording  # type: ignore[method-assign, assignment]
    try:
        with torch.no_grad():
            run()
    finally:
        del torch.Tensor.__bool__
    return taken


@contextlib.contextmanager
def example_branches(taken: dict[tuple[str, int], list[bool]],
                     followed: list[Taken]) -> Iterator[None]:
    """While tracing, a branch on a tensor's value takes the side the example inputs took
    (``branches_taken``) and leaves in the program a run-time check that the input at hand
    takes it too (``aten._assert_async``: a call whose input takes the other side fails
    there, naming the line, instead of running the traced side). Exact for every input it
    runs on. ``followed`` receives each branch so traced."""
    seen: dict[tuple[str, int], int] = {}

    def replaying(self: torch.Tensor) -> bool:
        try:
            return _BOOL(self)
        except GuardOnDataDependentSymNode:
            site = _caller()
            index = seen.get(site, 0)
            values = taken.get(site, [])
            if index >= len(values):
                raise
            seen[site] = index + 1
            value = values[index]
            condition = self.reshape(()).bool()
            where = f"{site[0]}:{site[1]}"
            torch._assert_async(condition if value else condition.logical_not(),
                                f"autotp traced the branch at {where} for bool(...) = {value} "
                                "(as the example inputs took it); this input takes the other "
                                "side: trace with an example that takes it")
            followed.append(Taken(site[0], site[1], value))
            return value

    torch.Tensor.__bool__ = replaying  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del torch.Tensor.__bool__


def data_dependent(exc: BaseException) -> bool:
    return _data_dependent(exc)
