"""Attention whose mask tensor is the causal one runs by the kernel's own causal path.

transformers builds its causal mask as a tensor when it is traced (``torch.export`` cannot
take the shortcut its eager run takes, ``is_causal=True`` where nothing is padded), so a
rank program would attend under an [s, s] mask: every pair computed, none of the causal
half skipped. Where the mask keeps at most the causal half by construction
(``autotp.planner.masks.ordered``), ``CausalWhereMasked`` calls ``scaled_dot_product_attention``
with ``is_causal=True`` and no mask wherever the mask is exactly causal; any other mask
(padding, packed sequences, a window) is applied as it is.

Invariant: a step of a rank program synchronizes the host for its masks at most once per
mask and forward, and not at all where the mask is a function of sizes alone:

* a mask whose recipe reads no input's values, only sizes (no padding or position input:
  transformers' causal mask of a call without ``attention_mask``) is the same for every
  input of those sizes. Its ops leave the program: ``CausalWhereMasked`` builds it from the
  sizes the first time it meets them and keeps the answer (causal, or the mask to apply),
  so later steps run no mask op and no check. In a compiled program the decision is made
  while dynamo traces, on the host, from the sizes the graph is specialised to
  (``assume_constant_result``): the graph holds the causal kernel, or the mask's ops and
  the masked one, and no break (``compile=`` specialises the graphs to their sizes; with
  ``dynamic`` sizes the call breaks the graph and runs as eagerly);
* a mask that reads an input (a padding mask) is compared with the causal one once per
  forward, by the first attention that reads it; the others reuse the answer. A compiled
  program applies such a mask as it is (no comparison: its answer would be a host read
  inside the graph).

Keys and values whose heads ``repeat_kv`` repeated for grouped queries go to the kernel as
they are (``enable_gqa=True``) where the plan holds them as it holds the queries: no copy of
every key and value per layer, as in the eager model.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autotp.ops import node_arg
from autotp.planner.context import grouped_source
from autotp.planner.masks import mask_region, ordered
from autotp.planner.plan import Plan

aten = torch.ops.aten

# the meta key on a rank program's node that calls a module with scaled_dot_product_attention's
# arguments, as passes over the program read them (``fusion.fuse_repeated_kv_attention``)
SDPA_CALL = "autotp_sdpa_call"
# the masks of other sizes a size-only mask keeps (a run that changes its batch or sequence
# length now and then keeps a few)
KNOWN_SIZES = 8


class CausalWhereMasked(nn.Module):
    """``aten.scaled_dot_product_attention`` with a mask that may be the causal one. One
    module serves every attention reading the same mask. With a ``recipe`` (the mask's ops
    as a program of the sizes it reads) the mask is passed as ``sizes`` and built only for
    sizes not met before; without, the first call of a forward compares the mask with the
    causal one and the others reuse the answer while the mask tensor is the same object,
    unchanged. ``causal_calls`` and ``masked_calls`` count which path each call took,
    ``checks`` the comparisons made."""

    recipe: Optional[fx.GraphModule]

    def __init__(self, recipe: Optional[fx.GraphModule] = None) -> None:
        super().__init__()
        object.__setattr__(self, "recipe", recipe)  # no submodule: it holds no state
        self._seen: Optional[tuple[Any, int, tuple[int, ...], bool]] = None
        # sizes -> None where the mask is causal, else the mask itself
        self._known: OrderedDict[tuple, Optional[torch.Tensor]] = OrderedDict()
        self.causal_calls = 0
        self.masked_calls = 0
        self.checks = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                is_causal: bool = False, *, scale: Optional[float] = None,
                enable_gqa: bool = False, sizes: Sequence[int] = ()) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa, sizes=sizes)
        return self._call(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa, sizes=sizes)

    def _traced(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, *,
                scale: Optional[float], enable_gqa: bool, sizes: Sequence[int]
                ) -> torch.Tensor:
        """The call as a compiled graph holds it (the counters count eager calls only)."""
        if self.recipe is not None and attn_mask is None and not is_causal:
            known = tuple(int(s) for s in sizes)  # the sizes the graph is specialised to
            if self._causal_of_sizes(known, q.shape[-2], k.shape[-2], q.device):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                      is_causal=True, scale=scale,
                                                      enable_gqa=enable_gqa)
            attn_mask = self.recipe(*known)
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    @torch.compiler.assume_constant_result
    def _causal_of_sizes(self, sizes: tuple[int, ...], queries: int, keys: int,
                         device: torch.device) -> bool:
        """Whether the recipe's mask at ``sizes`` is the causal one: run on the host while
        dynamo traces (its answer a constant of the graph, which is specialised to these
        sizes)."""
        return self._mask_of_sizes(sizes, queries, keys, device) is None

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, *,
              scale: Optional[float], enable_gqa: bool, sizes: Sequence[int]) -> torch.Tensor:
        causal = False
        if self.recipe is not None and attn_mask is None and not is_causal:
            attn_mask = self._mask_of_sizes(tuple(int(s) for s in sizes), q.shape[-2],
                                            k.shape[-2], q.device)
            causal = attn_mask is None
        elif attn_mask is not None and not is_causal:
            causal = self.is_causal(attn_mask, q.shape[-2], k.shape[-2])
        if causal:
            self.causal_calls += 1
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  scale=scale, enable_gqa=enable_gqa)
        self.masked_calls += 1
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    def _mask_of_sizes(self, sizes: tuple[int, ...], queries: int, keys: int,
                       device: torch.device) -> Optional[torch.Tensor]:
        """The mask the recipe builds from ``sizes`` for ``queries`` against ``keys``; None
        where it is the causal one."""
        key = (sizes, queries, keys, device)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        assert self.recipe is not None
        # a normal tensor even under inference mode: a later training step saves it
        with torch.inference_mode(False), torch.no_grad():
            mask = self.recipe(*sizes)
        found = None if self.is_causal(mask, queries, keys) else mask
        self._known[key] = found
        while len(self._known) > KNOWN_SIZES:
            self._known.popitem(last=False)
        return found

    def is_causal(self, mask: torch.Tensor, queries: int, keys: int) -> bool:
        """Whether ``mask`` (boolean, broadcast to [b, h, queries, keys]) keeps exactly each
        query's keys at or before its own position, for every batch row and head."""
        if mask.dtype != torch.bool or queries != keys or mask.shape[-2:] != (queries, keys):
            return False
        seen = self._seen
        if seen is not None and seen[0]() is mask and seen[1] == mask._version and \
                seen[2] == tuple(mask.shape):
            return seen[3]
        causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
        self.checks += 1
        answer = bool(torch.equal(mask, causal.expand(mask.shape)))
        self._seen = (weakref.ref(mask), mask._version, tuple(mask.shape), answer)
        return answer


# ---- the pass ----------------------------------------------------------------------------

def size_recipe(mask: fx.Node) -> Optional[fx.GraphModule]:
    """The ops computing ``mask`` as a program of the sizes they read (``sym_size`` nodes, its
    placeholders in the order ``recipe_sizes`` gives), where they read nothing else: no
    input, parameter, buffer, module call or random op. None otherwise."""
    region = _recipe_nodes(mask)
    if region is None:
        return None
    nodes, sizes = region
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {s: graph.placeholder(f"size_{i}") for i, s in enumerate(sizes)}
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[mask])
    graph.lint()
    return fx.GraphModule(nn.Module(), graph)


def recipe_sizes(mask: fx.Node) -> list[fx.Node]:
    """The size nodes ``size_recipe(mask)`` takes, in order."""
    region = _recipe_nodes(mask)
    return [] if region is None else region[1]


def _recipe_nodes(mask: fx.Node) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    nodes: set[fx.Node] = set()
    sizes: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in nodes or node in sizes:
            continue
        if node.op == "call_function" and node.target == aten.sym_size.int:
            sizes.add(node)
            continue
        tags = getattr(node.target, "tags", ())
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in tags or \
                (isinstance(node.target, torch._ops.OpOverload) and
                 node.target._schema.is_mutable):
            return None
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(nodes, key=order.__getitem__), sorted(sizes, key=order.__getitem__)


def causal_attention_calls(graph: fx.Graph, root: nn.Module,
                           plan: Optional[Plan] = None) -> dict[str, str]:
    """Attention left as ``aten.scaled_dot_product_attention`` (no ring, no dropout): keys
    and values repeated for grouped queries taken unrepeated where ``plan`` holds them as the
    queries (``autotp.planner.context.grouped_source``); a mask that keeps at most the causal half
    by construction (``autotp.planner.masks.ordered``: the causal masks transformers builds as
    tensors when traced) read through ``CausalWhereMasked``, one module per mask for all the
    attentions reading it, the mask's ops moved into it where they read sizes alone. Returns
    original node -> new node."""
    renamed: dict[str, str] = {}
    sdpa = aten.scaled_dot_product_attention.default
    checkers: dict[fx.Node, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != sdpa or \
                node_arg(node, "is_causal", False) or node_arg(node, "dropout_p", 0.0):
            continue
        if plan is not None:
            _take_grouped_kv(graph, node, plan)
        mask = node_arg(node, "attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        if mask not in checkers:
            region = mask_region(mask)
            if region is None or not ordered(region):
                continue
            recipe = size_recipe(mask) if all(
                u.target == sdpa for u in mask.users) else None
            checkers[mask] = f"autotp_causal_{mask.name}"
            root.add_module(checkers[mask], CausalWhereMasked(recipe))
        module = root.get_submodule(checkers[mask])
        args, kwargs = list(node.args), dict(node.kwargs)
        if module.recipe is not None:  # the mask's sizes instead of the mask
            if len(args) > 3:
                args[3] = None
            kwargs.pop("attn_mask", None)
            kwargs["sizes"] = recipe_sizes(mask)
        with graph.inserting_before(node):
            new = graph.call_module(checkers[mask], tuple(args), kwargs)
        new.meta.update(node.meta)
        new.meta[SDPA_CALL] = True
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        renamed[node.name] = new.name
    for mask in checkers:
        if not mask.users:
            _erase_unread(graph, mask)
    return renamed


def _take_grouped_kv(graph: fx.Graph, node: fx.Node, plan: Plan) -> None:
    """sdpa(q, repeat(k), repeat(v)) -> sdpa(q, k, v, enable_gqa=True) where ``plan`` holds k
    and v as it holds q (each rank's query heads keep their own key/value heads)."""
    if node_arg(node, "enable_gqa", False) or len(node.args) < 3:
        return
    repeated = node.args[1:3]
    k, v = (grouped_source(plan, node, a) if isinstance(a, fx.Node) else None
            for a in repeated)
    if k is None or v is None or k.meta["val"].shape[1] != v.meta["val"].shape[1]:
        return
    node.args = (node.args[0], k, v, *node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": True}
    for value in repeated:
        if isinstance(value, fx.Node) and not value.users:
            _erase_unread(graph, value)


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """``node`` and what it was made of, as far as nothing else reads them and they are
    pure (no placeholder, no module call)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if getattr(n, "_erased", False) or n.users or n.op != "call_function" or \
                (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)
