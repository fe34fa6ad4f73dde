"""A model's attention mask as the program that makes it (``planner.masks.MaskRegion``: its
elementwise ops of position vectors), run by context parallelism's ring on each block of
queries and keys it meets, so that no rank holds its [s/cp, s] rows of the mask.

Invariant: ``BlockMask.block`` of any rows and run of keys is exactly those rows and columns
of the mask the model would have built whole; ``BlockMask.grid`` says what the mask keeps of
each pair of chunks (``HIDDEN``, ``PARTIAL``, ``WHOLE``), read once for all the attentions
that read the same, unchanged factor tensors. In a compiled program (``BlockMask.traced_grid``)
the grid is read while dynamo traces where the factors are a function of sizes alone
(``MaskProgram.sizes_only``: the graph is specialised to them); any other mask is PARTIAL on
every pair, its blocks applied as they are (the same values, no pair skipped).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.fx as fx
from torch import nn

from autotp.errors import ConfigError
from autotp.planner.masks import MaskRegion, unsqueezed_dim

if TYPE_CHECKING:
    from autotp.runtime.ring import SequenceLayout

aten = torch.ops.aten


def _broadcast_to_rank(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``expand`` in a mask's program: the same elements, size-1 dims left to broadcast."""
    return x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape)) if x.dim() < ndim else x


class MaskProgram(nn.Module):
    """An attention mask's elementwise ops (``planner.masks.MaskRegion``) as a program of
    their factors: ``bind`` it to the factors' values, and each block of the mask is the
    program run on those rows and columns of them."""

    def __init__(self, region: MaskRegion, root: Optional[nn.Module] = None):
        """``root``: the module holding the program's submodules (its redistributions)."""
        super().__init__()
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {f: graph.placeholder(f"factor_{i}")
                                       for i, f in enumerate(region.factors)}
        for node in region.nodes:
            source = cast(fx.Node, node.args[0]) if node.args else node
            if node.target == aten.expand.default:
                env[node] = graph.call_function(_broadcast_to_rank,
                                                (env[source], node.meta["val"].dim()))
            elif node.target in (aten.slice.Tensor, aten.alias.default):  # whole: the same
                env[node] = env[source]
            elif node.target == aten.unsqueeze.default:
                env[node] = graph.call_function(aten.unsqueeze.default,
                                                (env[source], unsqueezed_dim(node)))
            else:
                env[node] = graph.node_copy(node, lambda a: env[a])
        graph.output(env[region.nodes[-1]])
        self.program = fx.GraphModule(nn.Module(), graph)
        self.memo: Optional[tuple[list[Any], Any, list[list[int]]]] = None
        # the factors read no input, only sizes: the grid is one per size
        self.sizes_only = all(_of_sizes_alone(f, root) for f in region.factors
                              if isinstance(f, fx.Node))

    @torch.compiler.assume_constant_result
    def grid_at_trace(self, chunks: int, cp: int, balanced: bool, queries: int, length: int,
                      tile_bytes: int, *factors: Any) -> list[list[int]]:
        """``BlockMask.grid`` computed while dynamo traces, on the factors' real values: a
        constant of the graph (valid where ``sizes_only``)."""
        from autotp.runtime.ring import SequenceLayout

        bound = BlockMask(self, tuple(factors), queries, length)
        return bound.grid(chunks, SequenceLayout(cp, balanced), tile_bytes)

    def bind(self, factors: tuple, queries: int, length: int) -> "BlockMask":
        return BlockMask(self, tuple(factors), queries, length)


@dataclass(frozen=True)
class BlockMask:
    """A mask program bound to its factors: ``queries`` this rank's rows, ``length`` every
    key; ``keys``: a key padding mask ([b, S], True: a real token) to apply as well."""
    program: MaskProgram
    factors: tuple
    queries: int
    length: int
    keys: Optional[torch.Tensor] = None

    def block(self, rows: slice, columns: slice) -> torch.Tensor:
        """[b|1, h|1, rows|1, columns] of the mask: rows of this rank's queries, columns a
        run of keys' global positions."""
        args = []
        for f in self.factors:
            if isinstance(f, torch.Tensor) and f.dim() >= 1:
                if f.shape[-1] != 1:
                    if f.shape[-1] != self.length:
                        raise ConfigError(f"a mask operand of shape {list(f.shape)} has "
                                          f"neither 1 nor all {self.length} keys last")
                    f = f[..., columns]
                if f.dim() >= 2 and f.shape[-2] != 1:
                    if f.shape[-2] != self.queries:
                        raise ConfigError(f"a mask operand of shape {list(f.shape)} has "
                                          f"neither 1 nor this rank's {self.queries} queries "
                                          "second to last")
                    f = f[..., rows, :]
            args.append(f)
        out = self.program.program(*args)
        out = _broadcast_to_rank(out, 4)
        if self.keys is not None:
            keys = self.keys.to(out.device, torch.bool)[:, None, None, columns]
            out = out & keys if out.dtype == torch.bool else out.masked_fill(~keys,
                                                                            float("-inf"))
        return out

    def traced_grid(self, chunks: int, layout: "SequenceLayout", tile_bytes: int
                    ) -> list[list[int]]:
        """``grid`` as a compiled program has it, with no host read inside its graph: read
        while tracing where the factors are sizes' alone (the graph specialised to its
        sizes; with dynamic sizes the call breaks the graph), else PARTIAL on every pair."""
        if self.program.sizes_only and self.keys is None:
            return self.program.grid_at_trace(chunks, layout.cp, layout.balanced, self.queries,
                                              self.length, tile_bytes, *self.factors)
        return [[PARTIAL] * layout.chunks for _ in range(chunks)]

    def grid(self, chunks: int, layout: "SequenceLayout", tile_bytes: int) -> list[list[int]]:
        """``_live_pairs``'s grid, from the program run on each pair of chunks: once for all
        the attentions reading the same factors (a model's layers share one mask, the same
        tensors, unchanged: known without reading them)."""
        memo = self.program.memo
        key = (chunks, layout, self.queries, self.length)
        operands = [*self.factors, self.keys]
        if memo is not None and memo[1] == key and _same(memo[0], operands):
            return memo[2]
        size, width = self.queries // chunks, self.length // layout.chunks
        batch = max([f.shape[0] for f in self.factors
                     if isinstance(f, torch.Tensor) and f.dim() >= 3] + [1])
        tile = max(1, min(size, tile_bytes // (8 * batch * width)))  # int64 operands at most
        marks = []
        for qi in range(chunks):
            for kc in range(layout.chunks):
                columns = slice(kc * width, (kc + 1) * width)
                tiles = [_mark(self.block(slice(qi * size + start,
                                                qi * size + min(size, start + tile)), columns))
                         for start in range(0, size, tile)]
                # kept somewhere if any tile keeps some; whole if every tile is whole
                marks.append(torch.stack(tiles).clamp(max=1).amax() +
                             (torch.stack(tiles) == WHOLE).all().long())
        flat = torch.stack(marks).tolist()
        grid = [flat[i * layout.chunks:(i + 1) * layout.chunks] for i in range(chunks)]
        self.program.memo = ([_identity(x) for x in operands], key, grid)
        return grid


def _of_sizes_alone(node: fx.Node, root: Optional[nn.Module]) -> bool:
    """Whether ``node``'s value is a function of sizes (and of the rank) alone: pure ops of
    ``sym_size`` nodes, through the program's redistributions (a rank's slice of a value, or
    the ranks' pieces joined, are functions of it and the rank). No input, parameter,
    buffer, random or in-place op."""
    # collectives imports ring, which imports this module
    from autotp.runtime.collectives import Redistribute

    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target == aten.sym_size.int:
            continue
        if n.op == "call_module" and root is not None and \
                isinstance(root.get_submodule(str(n.target)), Redistribute):
            stack.extend(n.all_input_nodes)
            continue
        tags = getattr(n.target, "tags", ())
        if n.op != "call_function" or torch.Tag.nondeterministic_seeded in tags or \
                (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _identity(x: Any) -> Any:
    """A tensor as (a weak reference to it, its version: bumped by every in-place change);
    anything else as itself."""
    return (weakref.ref(x), x._version) if isinstance(x, torch.Tensor) else x


def _same(kept: list[Any], now: list[Any]) -> bool:
    """Whether ``now`` holds the very tensors ``kept`` was made from, unchanged since (and
    equal other operands)."""
    if len(kept) != len(now):
        return False
    for a, b in zip(kept, now):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, tuple) or a[0]() is not b or a[1] != b._version:
                return False
        elif isinstance(a, tuple) or a != b:
            return False
    return True


HIDDEN, PARTIAL, WHOLE = 0, 1, 2  # what a mask keeps of a pair of chunks: none, some, all


def _mark(mask: torch.Tensor) -> torch.Tensor:
    """HIDDEN, PARTIAL or WHOLE for one block of a mask (boolean, or additive: 0 kept as it
    is, -inf hidden)."""
    kept = mask if mask.dtype == torch.bool else mask > float("-inf")
    plain = kept if mask.dtype == torch.bool else mask == 0
    return kept.any().long() + (kept & plain).all().long()
