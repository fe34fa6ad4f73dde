"""Checks around the plan: divisibility by tp, and parts the plan leaves replicated.

With ``strict=True`` a dimension tp must divide but does not is an error naming the valid tp
values; otherwise it becomes a recorded fallback. Matrices computed replicated although tp
divides them are always recorded: the plan never leaves anything replicated silently.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

import networkx as nx

import torch
import torch.fx as fx

from autotp.capture.trace import origin_of
from autotp.ops import MATMULS, ROW_NORMS, STATISTICS, node_arg
from autotp.errors import PlanError, where
from autotp.planner.blockers import Blocker, Walker
from autotp.planner.gradflow import dataflow
from autotp.planner.plan import Plan
from autotp.planner.problem import PNode

aten = torch.ops.aten


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(gm: fx.GraphModule, tp: int, strict: bool) -> list[str]:
    """tp must divide the attention heads (the query heads; k/v heads may be replicated).
    Returns the fallbacks taken with ``strict=False``."""
    fallbacks: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.scaled_dot_product_attention.default:
            q = node.args[0].meta["val"]
            if q.dim() != 4 or not isinstance(q.shape[1], int):
                continue
            heads = int(q.shape[1])
            if heads % tp == 0:
                continue
            valid = ", ".join(map(str, _divisors(heads)))
            if strict:
                raise PlanError(
                    f"tp={tp} does not divide the {heads} attention heads; use tp in "
                    f"{{{valid}}} (or strict=False to replicate the attention){where(node)}"
                )
            fallbacks.append(f"attention {node.name}: {heads} heads not divisible by tp={tp}, "
                             f"computed replicated ({origin_of(node)})")
    return fallbacks




def narrow(shape: tuple[int, ...], tp: int) -> bool:
    """A matrix with one side at most the other / (4 tp): a router over a few experts, a
    scalar gate, a rank-r adapter. Replicated by design, as in Megatron: sharding it would
    cost more communication than the compute and memory it saves."""
    return len(shape) == 2 and min(shape) * 4 * tp <= max(shape)


def narrow_matrices(shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The matrices of ``shapes`` (name -> 2-D shape) whose smaller side is at most an
    eighth of the model's typical width (the smaller side of the matrix holding the median
    parameter: rank-r adapters on every linear outnumber a model's matrices, not its
    parameters) and of their own larger side, or whose both sides are: at most width^2/64
    elements, next to nothing to shard. Rank-r adapters, routers and mixing tables over a
    few streams (hyper-connections' [streams, streams + 1]) are; k/v projections with 8
    k/v heads of 32 are not, nor the projections of a model's first, narrower stage (a
    vision transformer whose width doubles by stage)."""
    weighted = sorted((min(shape), math.prod(shape)) for shape in shapes.values())
    total, held, typical = sum(n for _, n in weighted), 0, 0
    for side, numel in weighted:
        held += numel
        if 2 * held >= total:
            typical = side
            break
    return {name for name, shape in shapes.items()
            if min(shape) * 8 <= typical and (min(shape) * 8 <= max(shape)
                                              or max(shape) * 8 <= typical)}


def replicated_products(plan: Plan, gm: fx.GraphModule, reported: frozenset[str] = frozenset(),
                        wide_heads: bool = False
                        ) -> Iterator[tuple[fx.Node, list[fx.Node], list[int]]]:
    """The matrices multiplied replicated on every rank although tp divides one of their
    sizes, not by design: (parameter node, its products, the sizes tp does not divide).
    ``wide_heads``: also the wide ones kept whole by design (k/v heads fewer than tp), which
    the plan reports but no other plan can shard."""
    if plan.tp == 1:
        return  # nothing is sharded at tp = 1
    trained = {name: p.requires_grad for name, p in gm.named_parameters(remove_duplicate=False)}
    flow = dataflow(plan)
    # the matrices the planner prices as vectors (narrow by the model's own widths): whole
    # by the same measure that made the plan keep them whole
    narrow_by_width = narrow_matrices({node.target: tuple(node.meta["val"].shape)
                                       for node in gm.graph.nodes if node.op == "get_attr"
                                       and node.target in trained
                                       and isinstance(node.meta.get("val"), torch.Tensor)
                                       and node.meta["val"].ndim == 2})
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in plan.params:
            continue
        param = plan.params[node.target]
        if len(param.global_shape) < 2 or param.layout != "R":
            continue
        if any(name in reported for name in param.names):
            continue
        if not any(size % plan.tp == 0 for size in param.global_shape):
            continue  # reported by check_divisibility
        products = [u for u in node.users if u.op == "call_function" and u.target in MATMULS]
        odd = [size for size in param.global_shape if size % plan.tp]
        # Replicated with partial gradients and every size divisible: the k/v projections
        # when tp exceeds the k/v heads, replicated by design (their gradients are summed).
        # Recorded all the same where the matrix is wide (one side more than half the other:
        # above h x h/2), where keeping it whole costs real memory and compute; narrower
        # ones (k/v heads, MLA's low-rank down-projections) are Megatron's own choice.
        by_design = param.grad_sync or _normalized_whole(products) or (
            not trained[node.target] and _meets_a_shard(plan, products, flow))
        if not products or (by_design and not odd and not (
                wide_heads and 2 * min(param.global_shape) > max(param.global_shape))):
            continue
        if narrow(param.global_shape, plan.tp) or node.target in narrow_by_width or \
                _routes(plan, products, flow):
            # A narrow matrix (a router over a few experts, a scalar gate), or a router
            # whose scores pick the experts (a top-k over its output): replicated by
            # design, as in Megatron; sharding it would cost more communication than the
            # compute it saves, and the choice of experts must be the same on every rank.
            continue
        yield node, products, odd


def _normalized_whole(products: list[fx.Node]) -> bool:
    """Whether a product's output (or a slice of it) is normalized over its features before
    it meets any other value: MLA's low-rank down-projections (q_a_proj into q_a_layernorm,
    kv_a_proj_with_mqa's latent into kv_a_layernorm). Sharding one would split the norm's
    statistic across ranks; Megatron-Core keeps them whole, and their gradients arrive whole
    (the up-projections' input gradients are summed). Not one: an MLP's down-projection (it
    meets the residual stream, an add of another value, before the next norm), nor a
    projection normalized per head (the norm's dim is a head's, not most of the output)."""
    if not products:
        return False
    graph = products[0].graph
    # value -> reader, where the reader reads no other computed tensor (casts, squares, a
    # scalar eps, views and splits): the path from a product to its own norm
    alone = nx.DiGraph((x, n) for n in graph.nodes if n.op == "call_function"
                       for x in n.all_input_nodes
                       if len([y for y in n.all_input_nodes if y.op != "get_attr"]) == 1)
    for product in products:
        out = product.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.ndim == 0:
            continue
        reach = (nx.descendants(alone, product) if product in alone else set()) | {product}
        for value in reach:
            for user in value.users:
                size = _normalized_size(user)
                if isinstance(size, int) and 2 * size > int(out.shape[-1]):
                    return True
    return False


def _normalized_size(node: fx.Node) -> Any:
    """The size of the last dim a norm or a statistic over it reduces, or None."""
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) \
        else None
    if not isinstance(val, torch.Tensor) or val.ndim == 0:
        return None
    if node.target in ROW_NORMS:
        return val.shape[-1]
    if node.target not in STATISTICS:
        return None
    dims: Any = node_arg(node, "dim")
    if dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return val.shape[-1] if [d % val.ndim for d in dims] == [val.ndim - 1] else None


def _routes(plan: Plan, products: list[fx.Node], flow: Any) -> bool:
    """Whether a product's output chooses experts: a top-k over it within its layer, reached
    without another product on the way (a router's scores; not a q projection whose
    attention output flows on through o_proj into the router)."""
    others = {str(t) for t in MATMULS}
    for product in products:
        if product.name not in flow:
            continue
        layer = plan.node_layers.get(product.name)
        local = flow.subgraph(n for n in flow if plan.node_layers.get(n) == layer and
                              (n == product.name or plan.ops.get(n) not in others))
        if any(plan.ops.get(n) == str(torch.ops.aten.topk.default)
               for n in nx.descendants(local, product.name)):
            return True
    return False


def _meets_a_shard(plan: Plan, products: list[fx.Node], flow: Any) -> bool:
    """Whether what the products compute is sliced, free, to meet sharded values (a frozen
    k/v projection, replicated because tp exceeds the k/v heads, read by sharded query
    heads): Megatron's choice, as when the projection trains and its gradient is summed."""
    downstream: set[str] = set()
    for product in products:
        if product.name not in flow:
            continue
        # through replicated values of the product's own layer (not the residual stream
        # into the next layer's attention)
        layer = plan.node_layers.get(product.name)
        kept = [n for n in flow if plan.node_layers.get(n) == layer and
                str(plan.values.get(n, "")).startswith("R")]
        if product.name in kept:
            downstream |= nx.descendants(flow.subgraph(kept), product.name) | {product.name}
    return any(edge.value in downstream and edge.forward is None and
               edge.src.startswith("R") and edge.dst.startswith("S") for edge in plan.edges)


def note_replicated_products(plan: Plan, gm: fx.GraphModule, strict: bool,
                             reported: frozenset[str] = frozenset(),
                             problem: Optional[Callable[[], list[PNode]]] = None) -> None:
    """A matrix multiplied replicated on every rank although tp divides one of its sizes:
    tp does not divide the other (an intermediate size of 98 at tp=4), or no exact sharding
    of its use exists (a fused projection split into unequal parts). The first is an error
    with ``strict``; both are recorded in the plan with a warning otherwise: never silent.
    Narrow matrices (one size at most the other / (4 tp)) are replicated by design.

    Each one that tp could shard names the ops that stop sharding it (``planner/blockers``),
    in the fallback's text and in ``plan.blocked``; ``problem`` builds the planning problem
    those are read from (only when there is such a matrix)."""
    walker: Optional[Walker] = None
    for node, products, odd in replicated_products(plan, gm, reported, wide_heads=True):
        param = plan.params[node.target]
        blockers: list[Blocker] = []
        if not odd and problem is not None:
            walker = walker or Walker(problem())
            blockers = walker.blockers(node.name, [p.name for p in products])
            # A shard that reaches a norm over its features has left its block through the
            # residual stream (a q projection's row input, an output projection's column
            # output), where Megatron's pattern ends too: the other direction's op is the
            # one to look at, where there is one.
            blockers = [b for b in blockers if _normalized_size(walker.node(b.node)) is None] \
                or blockers
            plan.blocked[node.target] = [b.as_dict() for b in blockers]
        why = (f"tp={plan.tp} does not divide {', '.join(map(str, odd))} (use tp dividing "
               f"{odd[0]}: {{{', '.join(map(str, _divisors(odd[0])))}}})" if odd else
               "; ".join(map(str, blockers)) if blockers else
               "a reader needs all of it, so it is computed whole on every rank and its "
               "partial gradients are summed after backward" if param.grad_sync else
               "an exact sharding exists; the cost model kept it whole (autotp explain "
               "prices each alternative)")
        text = (f"{node.target} {list(param.global_shape)} stays replicated and its product "
                f"{products[0].name} runs on every rank: {why}")
        if strict and odd:  # a size tp must divide; the other case is a plan's choice
            raise PlanError(text + ", or pass strict=False to replicate it"
                            + where(products[0]))
        plan.fallbacks.append(f"{text} ({origin_of(products[0])})")


def check_divisibility(plan: Plan, tp: int, strict: bool) -> None:
    """A matrix that tp divides along no dimension is replicated on every rank: an error
    naming the parameter and the valid tp values (strict), or a recorded fallback."""
    for target, param in plan.params.items():
        shape = param.global_shape
        if len(shape) < 2 or not param.layout.startswith("R"):
            continue
        if any(size % tp == 0 and size > 1 for size in shape):
            continue  # shardable, replicated by the plan's choice (e.g. k/v heads < tp)
        valid = sorted({d for size in shape for d in _divisors(size)})
        text = (f"tp={tp} divides no dimension of {target} {list(shape)}: it would be "
                f"replicated on every rank; use tp in {{{', '.join(map(str, valid))}}}")
        if strict:
            raise PlanError(text + ", or strict=False to replicate it")
        plan.fallbacks.append(text)


