"""Sibling all-reduces joined (planner/coalesce.py, autotp.runtime.batching.join_siblings).

The planner half on aten graphs with hand-written plans: which all-reduces may run as one.
The runtime half on two simulated ranks: the joined call against the separate ones, forward
and backward. Whole models whose plans join (OLMo-2's q and k norm statistics, DeepSeek-V3's
attention and routing weights) are checked against the unsharded model in
tests/test_families.py.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autotp.layout import Partial, Replicate, parse_layout
from autotp.planner.coalesce import join_siblings, movable
from autotp.planner.plan import CollectiveRecord, Edge, Plan
from autotp.runtime.batching import JoinedAllReduce
from autotp.runtime.collectives import Redistribute
from autotp.runtime.comm import ThreadComm, ThreadHub

aten = torch.ops.aten


def _statistics(chained: bool = False, dropout: bool = False) -> Callable[..., Any]:
    """q and k from x, each divided by its mean square: two partial statistics on a sharded
    width (the plans below say so), the second read from the first's result when
    ``chained``, or from a dropout of k."""

    def f(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
        q = x @ wq
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))
        k = (q if chained else x) @ wk
        if dropout:
            k = torch.nn.functional.dropout(k, 0.1, training=True)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True))
        return q * k

    return f


def _graph(f: Callable[..., Any]) -> fx.Graph:
    return make_fx(f)(torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)).graph


def _plan(graph: fx.Graph, phases: tuple[str, str] = ("forward", "forward"),
          layers: tuple[int, int] = (0, 0)) -> Plan:
    """Each mean's sum made whole for the rsqrt that reads it (forward), or each rsqrt's
    gradient summed (backward: Megatron's f on the rsqrt's output)."""
    plan = Plan.over("tp", 2, model="f", layers=1)
    means = [n for n in graph.nodes if n.target == aten.mean.dim]
    for node, phase, layer in zip(means, phases, layers):
        if phase == "backward":
            node = next(iter(node.users))  # add eps / rsqrt: read by the product as R*
        value, consumer = node, next(iter(node.users))
        src, dst = ("P", "R") if phase == "forward" else ("R", "R*")
        plan.edges.append(Edge(value=value.name, consumer=consumer.name, src=src, dst=dst,
                               forward="all_reduce" if phase == "forward" else None,
                               backward="all_reduce" if phase == "backward" else None,
                               layer=layer))
        plan.collectives.append(CollectiveRecord(
            kind="all_reduce", phase=phase, layer=layer, bytes_expr="16", node=value.name,
            source=None, src=src, dst=dst))
    return plan


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_independent_all_reduces_of_a_layer_are_joined(phase: str) -> None:
    graph = _graph(_statistics())
    plan = _plan(graph, (phase, phase))
    join_siblings(plan, graph)
    assert [e.joined for e in plan.edges] == [0, 0]
    assert len(plan.collectives) == 1, plan.collectives
    record = plan.collectives[0]
    assert (record.kind, record.phase, record.bytes_expr) == ("all_reduce", phase, "32")
    assert record.node == "joined: " + ", ".join(e.value for e in plan.edges)


@pytest.mark.parametrize("case, plan_kwargs", [
    ("chained", {}),  # k is computed from the normalized q: its statistic waits for q's sum
    ("dropout", {}),  # k's dropout would move ahead of q's norm: random draws keep their place
    ("independent", {"phases": ("forward", "backward")}),
    ("independent", {"layers": (0, 1)}),
])
def test_all_reduces_that_must_stay_apart(case: str, plan_kwargs: dict) -> None:
    graph = _graph(_statistics(chained=case == "chained", dropout=case == "dropout"))
    plan = _plan(graph, **plan_kwargs)
    before = list(plan.collectives)
    join_siblings(plan, graph)
    assert [e.joined for e in plan.edges] == [None, None]
    assert plan.collectives == before


def test_movable_ops() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    add = graph.call_function(aten.add.Tensor, (x, x))
    drop = graph.call_function(aten.native_dropout.default, (x, 0.1, True))
    inplace = graph.call_function(aten.add_.Tensor, (x, x))
    assert movable(add) and not movable(drop) and not movable(inplace) and not movable(x)
    # a rank program (no owning module): its redistributions move, the guard check does not
    assert movable(graph.call_module("autotp_x_to_R", (x,)))
    assert not movable(graph.call_module("_guards_fn", (x,)))
    # dropout in eval mode is the identity: no draw to keep in place
    assert movable(graph.call_function(aten.dropout.default, (x, 0.1, False)))
    assert not movable(graph.call_function(aten.dropout.default, (x, 0.1, True)))


def _on_two_ranks(work: Callable[[ThreadComm], Any]) -> list[Any]:
    hub, out = ThreadHub(2), [None, None]

    def run(rank: int) -> None:
        out[rank] = work(ThreadComm(hub, rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_joined_all_reduce_computes_what_the_separate_ones_do(phase: str) -> None:
    """Two values (different shapes) through one JoinedAllReduce and through two
    Redistributes, on two ranks: the same outputs and gradients, one all-reduce logged
    instead of two. The second output gets no gradient (zeros are summed for it)."""
    src, dst = (Partial(), Replicate()) if phase == "forward" else \
        (Replicate(), parse_layout("R*"))

    def work(comm: ThreadComm) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(comm.rank)
        xs = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
        members = [Redistribute(comm, src, dst, layer=0, bwd_layer=0, label=str(i))
                   for i in range(2)]
        results = {}
        for name, call in (("joined", lambda a, b: JoinedAllReduce(comm, members, phase, 0)(a, b)),
                           ("apart", lambda a, b: (members[0](a), members[1](b)))):
            a, b = (x.clone().requires_grad_() for x in xs)
            comm.log.clear()
            ya, yb = call(a, b)
            (ya * torch.arange(12.0).view(3, 4)).sum().backward()
            results[name] = (ya.detach(), yb.detach(), a.grad, b.grad,
                             [(e.kind, e.phase, e.nbytes) for e in comm.log.events])
        return results

    for got in _on_two_ranks(work):
        joined, apart = got["joined"], got["apart"]
        for x, y in zip(joined[:3], apart[:3]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert joined[3] is None or torch.equal(joined[3], torch.zeros(5)), joined[3]
        assert joined[4] == [("all_reduce", phase, 4 * (12 + 5))], joined[4]
        assert [e[1] for e in apart[4]] == [phase] * (2 if phase == "forward" else 1)


def test_deepseek_routing_weights_join_the_experts_input_gradient() -> None:
    """DeepSeek-V3's MoE layer where the plan sums the routing weights' gradient (a cost
    model dominated by bytes, as at its published width the router's 256 x 7168 weight
    gradient is): that sum and the experts' input gradient run as one all-reduce, and the
    attention's q and compressed k/v gradients as another, 2 each way; exact against the
    unsharded model."""
    import warnings

    import autotp
    from autotp.verification.verify import assert_equivalent, layer_counts
    from autotp.planner.cost import CostModel
    from tests.family_cases import ATOL, build, next_token_loss

    model, kwargs = build("DeepSeek-V3 (MLA, MoE)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, 2, example_kwargs=kwargs,
                              cost_model=CostModel(bandwidth=1e6, batch=1, seq=1))
        assert_equivalent(model, sim, kwargs=kwargs,
                          loss_fn=next_token_loss(kwargs["input_ids"]), atol=ATOL,
                          grad_rtol=ATOL)
    joined = [e.label for e in sim.ranks[0].comm.log.events
              if e.layer == 1 and e.label.startswith("joined: ")]
    assert len(joined) == 2 and any(label.count("R->R*") == 2 for label in joined), joined
    assert layer_counts(sim.ranks[0].comm.log)[1] == {"forward": 2, "backward": 2}


def test_joins_are_checked_against_the_joins_before_them() -> None:
    """Two joins that are each possible alone but tie each other's readers in a cycle: a1
    and a2 (forward sums), b1 and b2 (backward sums), where b1 is computed from a1's reader
    and a2 from b2's. The second join looked for is refused (it would wait for itself), and
    the first is placed in a copy of the program, so the rank program can take it."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a1, b2 = x @ w, (x * 2) @ w
        b1 = (a1 + 1) @ w
        a2 = (b2 + 1) @ w
        return (a2 + 1) * (b1 + 1)

    graph = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4)).graph
    a1, b2, b1, a2 = [n for n in graph.nodes if n.target == aten.mm.default]
    plan = Plan.over("tp", 2, model="f", layers=1)
    for value, phase in ((a1, "forward"), (a2, "forward"), (b1, "backward"), (b2, "backward")):
        src, dst = ("P", "R") if phase == "forward" else ("R", "R*")
        plan.edges.append(Edge(value=value.name, consumer=next(iter(value.users)).name,
                               src=src, dst=dst,
                               forward="all_reduce" if phase == "forward" else None,
                               backward="all_reduce" if phase == "backward" else None,
                               layer=0))
        plan.collectives.append(CollectiveRecord(
            kind="all_reduce", phase=phase, layer=0, bytes_expr="64", node=value.name,
            source=None, src=src, dst=dst))
    join_siblings(plan, graph)
    joined = {e.value: e.joined for e in plan.edges}
    assert joined == {b1.name: 0, b2.name: 0, a1.name: None, a2.name: None}, joined
    assert len(plan.collectives) == 3
