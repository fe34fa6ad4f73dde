"""planner/saved.py against autograd: which inputs an op keeps for backward.

Each case runs the ATen op eagerly under ``torch.autograd.graph.saved_tensors_hooks`` and
records the storages autograd packs; the rule must say "saved" exactly for the inputs whose
storage was packed (sequence parallelism charges activation memory by it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

from autotp.planner.saved import saved_values, saves_input

aten = torch.ops.aten

CASES: list[tuple[str, Any, tuple[bool, ...], Any]] = [
    # (id, op, which inputs require grad, extra args after the tensors)
    ("add", aten.add.Tensor, (True, True), ()),
    ("sub", aten.sub.Tensor, (True, False), ()),
    ("mul both", aten.mul.Tensor, (True, True), ()),
    ("mul by constant", aten.mul.Tensor, (True, False), ()),
    ("div by constant", aten.div.Tensor, (True, False), ()),
    ("div by variable", aten.div.Tensor, (False, True), ()),
    ("linear", aten.linear.default, (True, True), ()),
    ("neg", aten.neg.default, (True,), ()),
    ("silu", aten.silu.default, (True,), ()),
    ("transpose", aten.transpose.int, (True,), (0, 1)),
    ("cast", aten.to.dtype, (True,), (torch.float64,)),
    ("sum", aten.sum.dim_IntList, (True,), ([1],)),
    ("softmax", aten._softmax.default, (True,), (1, False)),
    ("exp", aten.exp.default, (True,), ()),
]


def _packed(op: Any, tensors: list[torch.Tensor], extra: tuple) -> set[int]:
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        op(*tensors, *extra)
    return storages


@pytest.mark.parametrize("name,op,grads,extra", CASES, ids=[c[0] for c in CASES])
def test_saved_inputs_match_autograd(name: str, op: Any, grads: tuple[bool, ...],
                                     extra: tuple) -> None:
    shape = (4, 4)
    tensors = [torch.randn(shape, requires_grad=g) for g in grads]
    packed = _packed(op, tensors, extra)
    graph = fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(tensors))]
    node = graph.call_function(op, (*inputs, *extra))
    requires = {n.name: g for n, g in zip(inputs, grads)}
    requires[node.name] = any(grads)

    def requires_grad(n: fx.Node) -> bool:
        return requires[n.name]

    for value, tensor in zip(inputs, tensors):
        expected = tensor.untyped_storage().data_ptr() in packed
        assert saves_input(node, value, requires_grad) == expected, (name, value.name)
    output_kept = len(packed - {t.untyped_storage().data_ptr() for t in tensors}) > 0
    assert (node.name in saved_values(graph, requires_grad)) == output_kept, name
