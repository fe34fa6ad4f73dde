"""Experts whole per rank (expert parallelism inside the tensor-parallel group).

The stacked expert weights of transformers' grouped mixture-of-experts blocks are sharded
along the experts: each rank multiplies the rows routed to the experts it owns
(``S(0)@experts``, bounds known at run time), and the rows come back to token order as a
partial sum that the layer's all-reduce completes. Checked against the unsharded model on
the same weights and inputs, forward and every gradient (the router's included), for
routings that reach every expert, only some ranks' experts, or one expert; and at a
published shape planned on meta.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autotp
from autotp.errors import PlanError
from autotp.features.verify import compare, layer_counts, reference_step, sharded_step
from autotp.layout import ROUTED, R, R_STAR, Shard, parse_layout
from autotp.planner.transitions import Collective, transition
from autotp.runtime import routing

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # logits, loss: max abs; gradients relative to each parameter's largest
ROWS = Shard(0, ROUTED)


def _perturbed(cls: type, config: object) -> torch.nn.Module:
    """``cls(config)`` seeded, in eval mode, every weight perturbed (biases and norms too)."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def _qwen3_moe(top_k: int = 2, experts: int = 4) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=32, max_position_embeddings=64)
    return _perturbed(transformers.Qwen3MoeForCausalLM, config)


def _gpt_oss() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64)
    return _perturbed(transformers.GptOssForCausalLM, config)


def _route_to_first_experts(model: torch.nn.Module) -> None:
    """Zero routers: every token scores every expert alike and top-k takes the first k, so
    every row goes to experts 0..k-1 (at tp 4 with 4 experts, ranks k..3 get none)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()


def _check(model: torch.nn.Module, tp: int) -> tuple[autotp.Simulation, dict]:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))

    def call(module: torch.nn.Module):
        return module(input_ids=ids)

    def loss(out) -> torch.Tensor:
        return out.logits.float().pow(2).mean()

    def pick(out) -> torch.Tensor:
        return out.logits

    reference = reference_step(model, call, loss, pick)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, tp, example_kwargs={"input_ids": ids})
    for result in sim.run(lambda m: sharded_step(m, call, loss, pick)):
        diff = compare(reference, result)
        assert diff.ok(ATOL, ATOL), (diff, sim.plan.summary())
    return sim, layer_counts(sim.ranks[0].comm.log)


@pytest.mark.parametrize(("tp", "routing_kind", "top_k"), [
    (2, "learned", 2), (4, "learned", 2), (4, "first experts", 2), (2, "one expert", 1)])
def test_experts_whole_exact(tp: int, routing_kind: str, top_k: int) -> None:
    """Qwen3-MoE (4 experts): each rank holds 4/tp whole experts; exact whatever the
    routing leaves a rank (all rows, none); per layer Megatron's 2 all-reduces forward, and
    backward at most one more: the routing weights' gradient (B x T x top_k floats), summed
    where the router's weight gradient would otherwise be."""
    model = _qwen3_moe(top_k)
    if routing_kind != "learned":
        _route_to_first_experts(model)
    sim, counts = _check(model, tp)
    assert sim.plan.experts and all(how == "whole" for _, how in sim.plan.experts.values())
    for target, (experts, _) in sim.plan.experts.items():
        param = sim.plan.params[target]
        assert param.layout == "S(0)" and param.local_shape[0] == experts // tp, param
    assert f"whole, {4 // tp} of 4 per rank" in sim.plan.summary()
    for layer in (0, 1):
        assert counts[layer]["forward"] == 2 and counts[layer]["backward"] <= 3, counts


def test_gpt_oss_experts_whole_with_their_biases() -> None:
    """gpt-oss: interleaved gate/up (``[..., ::2]``), clamps, per-expert biases read at the
    rows' expert ids (sharded with their experts: each rank reads its own experts' rows)."""
    sim, counts = _check(_gpt_oss(), 2)
    biases = [t for t in sim.plan.params if t.endswith(("gate_up_proj_bias", "down_proj_bias"))]
    assert biases and all(sim.plan.params[t].layout == "S(0)" for t in biases), biases
    assert all(how == "whole" for _, how in sim.plan.experts.values()), sim.plan.experts
    assert any("[expert rows]" in c.strategy for c in sim.plan.choices.values())
    for layer in (0, 1):
        assert counts[layer]["forward"] == 2 and counts[layer]["backward"] <= 3, counts


def test_published_moe_shape_on_meta() -> None:
    """Qwen3-30B-A3B's shape (2 layers, 128 experts of 768, top 8) planned at tp 8 on meta:
    16 whole experts per rank, every stacked weight, and 2 all-reduces forward per layer."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, 8, example_kwargs={"input_ids": ids})
    assert len(plan.experts) == 4 and all(v == [128, "whole"] for v in plan.experts.values())
    for target in plan.experts:
        assert plan.params[target].local_shape[0] == 16
    assert not plan.fallbacks, plan.fallbacks  # the routers: replicated by design, not noted
    for layer in (0, 1):
        assert plan.count("forward", layer) == 2, plan.summary()


# ---- the pieces ------------------------------------------------------------------------------


def test_routed_layout_text_and_transitions() -> None:
    assert str(ROWS) == "S(0)@experts" and parse_layout("S(0)@experts") == ROWS
    with pytest.raises(ValueError):
        Shard(1, ROUTED)
    take = transition(R_STAR, ROWS, requires_grad=True)
    assert take is not None and (take.forward, take.backward) == (None, None)
    assert transition(R, ROWS, requires_grad=True) is None  # its gradient would be partial
    give = transition(ROWS, R, requires_grad=True)
    assert give is not None and give.forward is Collective.ALL_REDUCE
    assert transition(ROWS, Shard(0), requires_grad=True) is None


def test_routing_pieces_against_their_definitions() -> None:
    """Rank r of 2 owns experts {2r, 2r+1}: its rows are the offsets' range; the pieces put
    them back, and read them in token order, as the full tensor would."""
    counts = torch.tensor([3, 0, 4, 1])
    offs = counts.cumsum(0).to(torch.int32)
    full = torch.randn(8, 5)
    index = torch.randperm(8)
    total = torch.zeros(8, 5)
    gathered = torch.zeros(8, 5)
    for rank in range(2):
        bounds = routing.routed_bounds(offs, rank, 2)
        assert bounds == ((0, 3, 8) if rank == 0 else (3, 8, 8))
        rows = routing.take_rows(full, bounds)
        assert torch.equal(routing.local_offsets(offs, bounds, rank, 2),
                           offs[2 * rank: 2 * rank + 2] - bounds[0])
        total += routing.put_rows(rows, bounds)
        gathered += routing.routed_lookup(rows, index, bounds)
    assert torch.equal(total, full) and torch.equal(gathered, full[index])
    with pytest.raises(RuntimeError, match="rows sorted by expert"):
        routing.take_rows(torch.randn(9, 5), routing.routed_bounds(offs, 0, 2))
    table = torch.randn(4, 3)
    ids = torch.tensor([2, 2, 3])
    assert torch.equal(routing.expert_rows(table[2:], ids, 1), table[ids])
    with pytest.raises(RuntimeError, match="another rank's experts"):
        routing.expert_rows(table[:2], ids, 0)


def test_rows_split_by_two_groupings_are_refused() -> None:
    """A region of routed rows read by grouped products of two different row countings
    cannot be split by either: a PlanError, not a wrong answer."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a, b = graph.placeholder("offs_a"), graph.placeholder("offs_b")
    w = graph.placeholder("w")
    first = graph.call_function(torch.ops.aten._grouped_mm.default, (x, w, a))
    second = graph.call_function(torch.ops.aten._grouped_mm.default, (first, w, b))
    graph.output(second)
    for node, val in ((x, torch.zeros(6, 4)), (a, torch.zeros(2, dtype=torch.int32)),
                      (b, torch.zeros(2, dtype=torch.int32)), (w, torch.zeros(2, 4, 4)),
                      (first, torch.zeros(6, 4)), (second, torch.zeros(6, 4))):
        node.meta["val"] = val
    plan = autotp.planner.plan.Plan(model="m", tp=2, layers=0)
    for node in (first, second):
        plan.choices[node.name] = autotp.planner.plan.Choice(
            op=str(node.target), strategy="(S(0)@experts, S(0), R*) -> S(0)@experts  [experts]",
            inputs=("S(0)@experts", "S(0)", "R*"), output="S(0)@experts", layer=None,
            source=None, candidates=1)
        plan.values[node.name] = "S(0)@experts"
    with pytest.raises(PlanError, match="2 expert groupings"):
        routing._regions(graph, plan)


def test_generate_with_experts_whole() -> None:
    """Greedy decoding on a left-padded batch: the same tokens as the unsharded model, with
    the prefill and decode programs both holding whole experts (each rank's decode step
    reads only its own experts)."""
    from autotp.features.generate import decoder_of

    model = _qwen3_moe()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, 2)
        for got in sim.run(lambda m: m.generate(ids, **kwargs)):
            assert torch.equal(got, want)
    programs = sim.run(lambda m: list(decoder_of(m).programs.values()))[0]
    assert len(programs) == 2
    for program in programs:
        assert all(how == "whole" for _, how in program.plan.experts.values())
        assert not program.plan.fallbacks, program.plan.fallbacks
