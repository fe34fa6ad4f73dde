"""planner/saved.py against autograd: which inputs an op keeps for backward.

Each case runs the ATen op eagerly under ``autotp.verification.saved_tensors.count_saved`` and
records the storages autograd packs; the rule must say "saved" exactly for the inputs whose
storage was packed (sequence parallelism charges activation memory by it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

from autotp.verification.saved_tensors import SavedTensors, count_saved
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


def _packed(op: Any, tensors: list[torch.Tensor], extra: tuple) -> SavedTensors:
    with count_saved() as saved:
        op(*tensors, *extra)
    return saved


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
        assert saves_input(node, value, requires_grad) == packed.holds(tensor), (name, value.name)
    output_kept = len(packed) > sum(1 for t in tensors if packed.holds(t))
    assert (node.name in saved_values(graph, requires_grad)) == output_kept, name


def test_count_saved_counts_each_storage_once_and_never_the_excluded() -> None:
    """``count_saved``: a saved view counts its whole storage, once; an excluded tensor's
    storage (here a weight, saved by the product as its transpose) never; two storages are
    never taken for one, even where the first is freed and its memory could be reused."""
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with count_saved(exclude=[weight]) as saved:
        x @ weight.t()  # saves x and the weight's transpose
        y = x[:2].exp()  # saves its output, a storage of its own
        x[:2] * x[2:]  # saves two views of x
    assert saved.holds(x) and saved.holds(y) and not saved.holds(weight)
    assert len(saved) == 2 and saved.nbytes == x.nbytes + y.nbytes
    with count_saved() as saved:
        for _ in range(3):  # each output, and the graph that saved it, freed at once (at
            torch.randn(1024, requires_grad=True).exp()  # this size, malloc reuses the memory)
    assert len(saved) == 3 and saved.nbytes == 3 * 1024 * 4
