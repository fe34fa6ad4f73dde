"""Rules derived from an op's semantics, for the ops no hand-written rule names.

The hand-written rules (the other modules of this package) are the exceptions: ops whose
algebra goes beyond what torch declares about them (linearity, a partial statistic, the
view algebra of a size argument). Every other op gets its strategies from what torch says
it is:

* an op torch tags ``pointwise`` computes each output element from its operands' elements
  at the same (broadcast) index. Evaluating it on a block of the operands gives that block
  of the result, whatever the arity and wherever scalars sit, so every dim of the output
  may be sharded, each input holding the aligned dim or broadcast along it (read
  replicated). Linearity is not declared by the tag, so no partial sum passes through.
* an op with a decomposition is planned through it: capture replaces it by the ops it
  decomposes into (``autotp.capture.passes.decompose_unruled``), which have rules.
* a user's own op gets the rule its author registers (``autotp.register_rule``).

Excluded: ops that draw random numbers (their streams are placed by the hand-written
dropout rule), and mutating or ``out=`` forms, which capture turns into their functional
form first.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from autotp.rules.pointwise import broadcast_shards
from autotp.rules.registry import OpCall, Rule, Strategy, TensorMeta


def is_pointwise(op: Any) -> bool:
    """Whether torch declares ``op`` elementwise, deterministic and functional."""
    tags = getattr(op, "tags", ())
    schema = getattr(op, "_schema", None)
    return torch.Tag.pointwise in tags and \
        torch.Tag.nondeterministic_seeded not in tags and \
        schema is not None and not schema.is_mutable and \
        len(schema.returns) == 1


def pointwise_rule(call: OpCall) -> Iterator[Strategy]:
    """Every output dim sharded, inputs aligned by broadcasting (see the module doc)."""
    if not isinstance(call.output, TensorMeta):
        return
    for strategy in broadcast_shards(call):
        yield Strategy(strategy.inputs, strategy.output, name="pointwise")


def derived_rule(op: Any) -> Optional[Rule]:
    """The rule torch's declarations about ``op`` give, or None."""
    if is_pointwise(op):
        return pointwise_rule
    return None
