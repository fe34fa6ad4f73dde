"""Checking a rule numerically: shard sample inputs as a strategy says, run each rank's
lowered op, reassemble, and compare with the unsharded op.

This is the one generic property every registered strategy must satisfy. It runs the same
lowerings the rewriter uses, so a wrong size localization fails here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autotp.capture.trace import make_call
from autotp.layout import Layout, Partial, Replicate, Shard, shard_tensor, unshard_tensor
from autotp.runtime.lowerings import LowerContext, lowering_for
from autotp.rules.registry import OpCall, Registry, Strategy, TensorMeta


@dataclass
class StrategyCheck:
    strategy: Strategy
    max_diff: float
    ok: bool
    error: str = ""  # what the op raised on a rank's pieces


def _split_partial(full: torch.Tensor, tp: int, generator: torch.Generator) -> list[torch.Tensor]:
    parts = [torch.randn(full.shape, generator=generator, dtype=full.dtype) for _ in range(tp - 1)]
    last = full - sum(parts) if parts else full
    return [*parts, last]


def _build(op: Any, args: tuple, kwargs: dict) -> tuple[fx.Graph, fx.Node, list[torch.Tensor]]:
    graph = fx.Graph()
    tensors: list[torch.Tensor] = []
    mode = FakeTensorMode()

    def to_node(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(f"t{len(tensors)}")
            node.meta["val"] = mode.from_tensor(value)
            tensors.append(value)
            return node
        return value

    node_args = pytree.tree_map(to_node, args)
    node_kwargs = pytree.tree_map(to_node, kwargs)
    node = graph.call_function(op, tuple(node_args), dict(node_kwargs))
    fake_args = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a,
                                (node_args, node_kwargs))
    with mode:
        node.meta["val"] = op(*fake_args[0], **fake_args[1])
    graph.output(node)
    return graph, node, tensors


def build_call(op: Any, args: tuple, kwargs: dict) -> fx.Node:
    """The node of one call of ``op`` on placeholders for its tensors, with fake values."""
    return _build(op, args, kwargs)[1]


def check_op(
    op: Any,
    args: tuple,
    kwargs: Optional[dict] = None,
    *,
    tp: int = 2,
    blocks: tuple[int, ...] = (1, 2, 3),
    registry: Optional[Registry] = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
    sizes: Optional[dict[int, Any]] = None,
) -> list[StrategyCheck]:
    """Check every strategy the registry offers for ``op(*args, **kwargs)`` at degree ``tp``.
    ``sizes``: global sizes the rules see as these expressions instead, as the planner sees a
    dynamic batch or sequence (``{8: 4 * B}``: a batch of 2 with 4 heads folded in); the
    tensors, and the size arguments the lowerings localize, keep the concrete ones."""
    registry = registry or Registry.default()
    kwargs = kwargs or {}
    graph, node, tensors = _build(op, args, kwargs)
    call = make_call(node, tp, blocks)
    if sizes:
        call = _with_sizes(call, sizes)
    # on copies, and every rank on its own pieces: an in-place op must not change the inputs
    # that the next strategy is checked with
    expected = op(*_clone(args), **_clone(kwargs))
    generator = torch.Generator().manual_seed(seed)
    results = []
    for strategy in registry.strategies(call):
        per_rank_inputs = _shard_inputs(tensors, strategy.inputs, tp, generator)
        try:
            outputs = [
                _run_rank(op, args, kwargs, strategy, rank, tp, registry,
                          per_rank_inputs[rank])
                for rank in range(tp)
            ]
        except RuntimeError as exc:  # the op refuses the pieces (a shape it cannot take)
            results.append(StrategyCheck(strategy, float("inf"), False,
                                         f"{type(exc).__name__}: {exc}".splitlines()[0]))
            continue
        diff = _compare(expected, outputs, strategy.output)
        ok = diff <= atol + rtol * _scale(expected)
        results.append(StrategyCheck(strategy, diff, ok))
    return results


def _with_sizes(call: OpCall, sizes: dict[int, Any]) -> OpCall:
    def meta(value: Any) -> Any:
        if isinstance(value, TensorMeta):
            return replace(value, shape=tuple(sizes.get(s, s) if isinstance(s, int) else s
                                              for s in value.shape))
        return value

    output = call.output
    return replace(call, args=tuple(pytree.tree_map(meta, list(call.args))),
                   kwargs={k: pytree.tree_map(meta, v) for k, v in call.kwargs.items()},
                   inputs=tuple(meta(m) for m in call.inputs),
                   output=tuple(meta(o) for o in output) if isinstance(output, tuple)
                   else meta(output))


def _clone(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _scale(expected: Any) -> float:
    leaves = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    return max((float(t.abs().max()) for t in leaves
                if t.numel() and (t.is_floating_point() or t.is_complex())),
               default=1.0)


def _shard_inputs(tensors: list[torch.Tensor], layouts: tuple[Layout, ...], tp: int,
                  generator: torch.Generator) -> list[list[torch.Tensor]]:
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    for tensor, layout in zip(tensors, layouts):
        if isinstance(layout, Partial):
            pieces = _split_partial(tensor, tp, generator)
        else:
            pieces = [shard_tensor(tensor, layout, r, tp).clone() for r in range(tp)]
        for rank in range(tp):
            per_rank[rank].append(pieces[rank])
    return per_rank


def _run_rank(op: Any, args: tuple, kwargs: dict, strategy: Strategy, rank: int, tp: int,
              registry: Registry, local_inputs: list[torch.Tensor]) -> Any:
    graph, node, _ = _build(op, args, kwargs)
    lowering = lowering_for(op)
    if lowering is not None:
        lowering(LowerContext(graph, rank, tp), node, strategy)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return gm(*local_inputs)


def _compare(expected: Any, outputs: list[Any], layout: Any) -> float:
    if layout is None:
        return 0.0
    if isinstance(layout, tuple):
        return max(
            (_compare(expected[i], [o[i] for o in outputs], sub) for i, sub in enumerate(layout)
             if sub is not None),
            default=0.0,
        )
    if isinstance(layout, Replicate):
        return max(_diff(expected, out) for out in outputs)
    assembled = unshard_tensor(outputs, layout) if isinstance(layout, (Shard, Partial)) else None
    return _diff(expected, assembled)


def _diff(a: torch.Tensor, b: Optional[torch.Tensor]) -> float:
    if b is None or a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


__all__ = ["StrategyCheck", "check_op"]
