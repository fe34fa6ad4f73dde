"""Why a matrix stays whole: the op that stops each way of sharding it.

A matrix ``W`` in a product ``y = x W`` can be sharded two ways (Megatron's):

* column: ``W`` split along its output features, so ``y`` is sharded (``S(d)``); every op
  that reads ``y``, and every op after it that reads a sharded result, must have a strategy
  taking that layout, until a row product turns it into a partial sum (or the model returns
  it);
* row: ``W`` split along its input features, so ``x`` must arrive sharded along them; the op
  that computes ``x`` must have a strategy giving that layout from sharded inputs, and so on
  back to a column product (a sharded parameter).

Walking the problem's strategies (``autotp.planner.problem``: each op's rule, with its gradient
semantics) in each direction finds the first op, in the program's order from the product,
that has no strategy for the layout the shard needs: the *blocking op*. Its source line is
the line of the user's model to look at, or the rule autotp lacks. Where neither direction
stops, an exact sharding exists and the plan kept the matrix whole for its cost.

A replicated value can always be sliced locally (``R* -> S`` costs nothing), so "the shard
needs" means: the shard comes from a sharded parameter, not from computing the whole value
on every rank and slicing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import networkx as nx

from autotp.capture.trace import origin_of
from autotp.layout import Layout, Partial, Shard
from autotp.planner.problem import PNode
from autotp.rules.registry import Strategy

# how many (value, layout) states one walk may visit: a walk follows one layer's dataflow
_STATES = 4000


@dataclass(frozen=True)
class Blocker:
    """The op that stops one way of sharding a matrix."""

    direction: str  # "column" (the product's output sharded) | "row" (its input sharded)
    layout: str  # the layout the op cannot take (column) or give (row), e.g. "S(2)"
    node: str  # the graph node (for debugging views)
    op: str
    source: str  # the user's module and source line

    def __str__(self) -> str:
        verb = "takes" if self.direction == "column" else "gives"
        return (f"as {self.direction}, stops at {_short_op(self.op)} ({self.source}): no "
                f"strategy {verb} {self.layout}")

    def as_dict(self) -> dict[str, str]:
        return {"direction": self.direction, "layout": self.layout, "node": self.node,
                "op": self.op, "source": self.source}


def _short_op(op: str) -> str:
    return op.removeprefix("aten.")


class Walker:
    """The problem's dataflow, walked along the layouts its strategies allow."""

    def __init__(self, pnodes: Iterable[PNode]):
        self.by_name = {pn.node.name: pn for pn in pnodes}
        self.flow = nx.DiGraph()
        for pn in self.by_name.values():
            self.flow.add_node(pn.node.name)
            self.flow.add_edges_from((name, pn.node.name) for name in pn.inputs
                                     if name in self.by_name)
        self.order = {name: i for i, name in enumerate(self.by_name)}

    def node(self, name: str) -> Any:
        return self.by_name[name].node

    def blockers(self, weight: str, products: Iterable[str]) -> list[Blocker]:
        """The first blocking op of each direction (at most one each) over the products that
        read ``weight`` (a parameter's graph node)."""
        found: dict[str, Blocker] = {}
        for product in products:
            pn = self.by_name.get(product)
            if pn is None or pn.kind != "op":
                continue
            at = [i for i, name in enumerate(pn.inputs) if name == weight]
            sharded = [s for s in pn.strategies
                       if at and all(isinstance(s.inputs[i], Shard) for i in at)]
            if not sharded:
                found.setdefault("column", self._blocker("column", "a shard of the weight",
                                                         pn))
                continue
            columns = {o for s in sharded for o in _outputs(s.output) if isinstance(o, Shard)}
            if columns and "column" not in found:
                # each layout the column offers (plain, or in blocks a later split needs)
                # walked on its own: none stops, or the one that gets furthest names its op
                walks = [self._forward(product, {layout}) for layout in sorted(columns, key=str)]
                stopped = [b for b in walks if b is not None]
                if len(stopped) == len(walks):
                    found["column"] = max(stopped, key=lambda b: self.order[b.node])
            rows = [s for s in sharded if any(isinstance(o, Partial)
                                              for o in _outputs(s.output))]
            if rows and "row" not in found:
                blocker = self._backward_any(pn, at, rows)
                if blocker is not None:
                    found["row"] = blocker
        return [found[d] for d in ("column", "row") if d in found]

    # ---- column: forward from the product's sharded output ------------------------------

    def _forward(self, product: str, layouts: set[Layout]) -> Optional[Blocker]:
        """The first reader, in program order, with no strategy taking the sharded value."""
        seen: set[tuple[str, Any]] = set()
        frontier = [(self.order[product], product, layout) for layout in layouts]
        while frontier and len(seen) < _STATES:
            frontier.sort(key=lambda item: item[0])
            _, value, layout = frontier.pop(0)
            if (value, layout) in seen:
                continue
            seen.add((value, layout))
            for reader in sorted(self.flow.successors(value), key=self.order.__getitem__):
                pn = self.by_name[reader]
                if pn.kind == "getitem":
                    if isinstance(layout, tuple):
                        element = layout[pn.node.args[1]]
                        if isinstance(element, Shard):
                            frontier.append((self.order[reader], reader, element))
                    continue
                if pn.kind != "op":
                    continue  # returned to the user (gathered for the user only)
                at = [i for i, name in enumerate(pn.inputs) if name == value]
                taking = [s for s in pn.strategies
                          if all(_element(s.inputs[i], layout) for i in at)]
                if not taking:
                    return self._blocker("column", str(_first_shard(layout)), pn)
                for s in taking:
                    if _holds_shard(s.output):
                        frontier.append((self.order[reader], reader, s.output))
        return None

    # ---- row: backward from the product's sharded input ---------------------------------

    def _backward_any(self, pn: PNode, at: list[int], rows: list[Strategy]
                      ) -> Optional[Blocker]:
        """None when some row strategy's sharded activations all come from sharded
        parameters; else the blocker the first strategy meets."""
        first: Optional[Blocker] = None
        for s in rows:
            blocker = self._inputs_blocker(pn, s, skip=at, memo={})
            if blocker is None:
                return None
            first = first or blocker
        # an input computed from the model's inputs alone (no product before it) has no
        # shard to arrive in: not a way of sharding this matrix, and no op to blame
        return None if first is _WHOLE else first

    def _inputs_blocker(self, pn: PNode, s: Strategy, skip: list[int],
                        memo: dict) -> Optional[Blocker]:
        needs = [(name, layout) for i, (name, layout) in enumerate(zip(pn.inputs, s.inputs))
                 if i not in skip and isinstance(layout, Shard)]
        if not needs:
            return _WHOLE  # computed whole and sliced: not a shard the plan can start
        for name, layout in needs:
            blocker = self._produce(name, layout, memo)
            if blocker is not None:
                return blocker
        return None

    def _produce(self, name: str, layout: Any, memo: dict) -> Optional[Blocker]:
        """None when ``name`` can be computed in ``layout`` from sharded parameters."""
        key = (name, layout)
        if key in memo:
            return memo[key]
        memo[key] = _WHOLE  # a cycle through itself does not produce it
        pn = self.by_name.get(name)
        result: Optional[Blocker]
        if pn is None or pn.kind in ("input", "skip", "output"):
            result = _WHOLE  # the model's inputs arrive whole
        elif pn.kind == "leaf":
            result = None  # a parameter or buffer stored sharded
        elif pn.kind == "getitem":
            parent = self.by_name[pn.inputs[0]]
            index = pn.node.args[1]
            result = self._produce_element(parent, index, layout, memo)
        else:
            result = self._produce_element(pn, None, layout, memo)
        memo[key] = result
        return result

    def _produce_element(self, pn: PNode, index: Any, layout: Any, memo: dict
                         ) -> Optional[Blocker]:
        giving = [s for s in pn.strategies
                  if _element(_pick(s.output, index), layout)]
        if not giving:
            return self._blocker("row", str(layout), pn)
        first: Optional[Blocker] = None
        for s in giving:
            blocker = self._inputs_blocker(pn, s, skip=[], memo=memo)
            if blocker is None:
                return None
            if first is None or (first is _WHOLE and blocker is not _WHOLE):
                first = blocker
        return self._blocker("row", str(layout), pn) if first is _WHOLE else first

    def _blocker(self, direction: str, layout: str, pn: PNode) -> Blocker:
        node = pn.node
        op = str(node.target) if node.op == "call_function" else node.op
        return Blocker(direction, layout, node.name, op, origin_of(node))


# a walk that ends at a value computed whole (no sharded parameter feeds it): not an op's
# missing strategy, so the op that needed the shard is the blocker
_WHOLE = Blocker("row", "", "", "", "")


def _outputs(output: Any) -> list[Any]:
    if output is None:
        return []
    return [o for o in output if o is not None] if isinstance(output, tuple) else [output]


def _pick(output: Any, index: Any) -> Any:
    if index is None:
        return output
    return output[index] if isinstance(output, tuple) and index < len(output) else None


def _element(layout: Any, wanted: Any) -> bool:
    return layout is not None and layout == wanted


def _holds_shard(output: Any) -> bool:
    return any(isinstance(o, Shard) for o in _outputs(output))


def _first_shard(layout: Any) -> Any:
    if isinstance(layout, tuple):
        return next((o for o in layout if isinstance(o, Shard)), layout)
    return layout

