"""Experts whole per rank (expert parallelism inside the tensor-parallel group).

The stacked expert weights of transformers' grouped mixture-of-experts blocks are sharded
along the experts: each rank multiplies the rows routed to the experts it owns
(``S(0)@experts``, bounds known at run time), and the rows come back to token order as a
partial sum that the layer's all-reduce completes. Checked against the unsharded model on
the same weights and inputs, forward and every gradient (the router's included; within one
tensor-parallel group one SGD step too), for routings that reach every expert, only some
ranks' experts, or one expert; and at a published shape planned on meta.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

import autotp
from autotp.errors import PlanError
from autotp.api import full_state_dict
from autotp.verification.verify import (StepResult, assert_equivalent, compare, layer_counts,
                                    max_difference, perturb, reference_step)
from autotp.layout import ROUTED, R, R_STAR, Shard, parse_layout
from autotp.planner.transitions import Collective, transition
from autotp.presentation.report import to_dict, to_table
from autotp.planner.cost import CostModel
from autotp.runtime import routed_rows
from autotp.runtime.launch import run_processes
from tests.models import qwen3_moe

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # logits, loss: max abs; gradients relative to each parameter's largest
ROWS = Shard(0, ROUTED)


def _gpt_oss() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return perturb(transformers.GptOssForCausalLM(config).eval())


def _route_to_first_experts(model: torch.nn.Module) -> None:
    """Zero routers: every token scores every expert alike and top-k takes the first k, so
    every row goes to experts 0..k-1 (at tp 4 with 4 experts, ranks k..3 get none)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()


def _check(model: torch.nn.Module, tp: int) -> tuple[autotp.Simulation, dict]:
    """``model`` at ``tp`` against the unsharded model: logits, their mean square as the loss,
    every gradient, one SGD step (``assert_equivalent``)."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, tp, example_kwargs={"input_ids": ids})
    assert_equivalent(model, sim, kwargs={"input_ids": ids}, atol=ATOL, grad_rtol=ATOL)
    return sim, layer_counts(sim.ranks[0].comm.log)


@pytest.mark.parametrize(("tp", "routing_kind", "top_k"), [
    (2, "learned", 2), (4, "learned", 2), (4, "first experts", 2), (2, "one expert", 1)])
def test_experts_whole_exact(tp: int, routing_kind: str, top_k: int) -> None:
    """Qwen3-MoE (4 experts): each rank holds 4/tp whole experts; exact whatever the
    routing leaves a rank (all rows, none); per layer Megatron's 2 all-reduces forward, and
    backward at most one more: the routing weights' gradient (B x T x top_k floats), summed
    where the router's weight gradient would otherwise be."""
    model = qwen3_moe(top_k)
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


def _data_parallel_step(model: torch.nn.Module, tp: int, ep: int, batch: int = 2
                        ) -> tuple[autotp.Simulation, StepResult, list]:
    """The unsharded model on ep sequences' worth of batches, the data-parallel mean loss;
    and tp * ep simulated ranks, each ep rank on its own ``batch`` sequences, dense
    gradients averaged over the ep ranks (as data parallelism does) and the experts'
    finished by ``finish_expert_gradients``."""
    ids = torch.randint(0, 128, (ep * batch, 8), generator=torch.Generator().manual_seed(3))
    reference = reference_step(model, lambda m: m(input_ids=ids),
                               lambda out: out.logits.float().pow(2).mean(),
                               lambda out: out.logits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, tp, ep=ep, example_kwargs={"input_ids": ids[:batch]})

    def step(module: autotp.ShardedModule) -> tuple[StepResult, list]:
        e = module.ep_comm.rank
        module.zero_grad(set_to_none=True)
        logits = module(input_ids=ids[e * batch:(e + 1) * batch]).logits
        loss = logits.float().pow(2).mean()
        loss.backward()
        experts = module.expert_parameters()
        for target, param in module.local_parameters().items():
            if target not in experts and param.grad is not None:
                param.grad = module.ep_comm.all_reduce(param.grad) / ep
        module.finish_expert_gradients()
        full = StepResult(logits.detach(), float(loss.detach()),
                          full_state_dict(module, grads=True))
        return full, list(module.ep_comm.log.events)

    results = sim.run(step)
    for rank, (got, _) in enumerate(results):
        e = rank // tp
        rows = reference.output[e * batch:(e + 1) * batch]
        assert max_difference(rows, got.output) <= ATOL, rank
        diff = compare(StepResult(got.output, reference.loss, reference.grads),
                       StepResult(got.output, reference.loss, got.grads))
        assert diff.grad_rel <= ATOL, (rank, diff)
    return sim, reference, [events for _, events in results]


@pytest.mark.parametrize(("tp", "ep", "routing_kind", "top_k"), [
    (1, 2, "learned", 2), (2, 2, "learned", 2), (1, 4, "first experts", 2),
    (2, 2, "one expert", 1)])
def test_expert_parallel_over_data_parallel_ranks(tp: int, ep: int, routing_kind: str,
                                                  top_k: int) -> None:
    """Experts split over ep data-parallel ranks as well as tp: each rank holds 4/(tp * ep)
    whole experts, the rows routed to them arrive by all-to-all (counts first) and go back
    the same way. Exact against the unsharded model on the whole batch, every rank's
    logits and every gradient (the router's included), whatever the routing leaves a rank:
    uneven counts, no rows at all (zero routers: every row goes to experts 0 and 1), one
    expert. Per MoE layer: forward the counts, the dispatch(es) and the combine; backward
    the reverse moves; within the tp group, Megatron's 2 all-reduces forward."""
    model = qwen3_moe(top_k)
    if routing_kind != "learned":
        _route_to_first_experts(model)
    sim, _, events = _data_parallel_step(model, tp, ep)
    share = 4 // (tp * ep)
    assert sim.plan.ep == ep and f"whole, {share} of 4 per rank" in sim.plan.summary()
    text = to_table(sim.plan, CostModel())
    assert f"tp={tp}, ep={ep}," in text and f"split over tp x ep = {tp * ep} ranks" in text
    assert to_dict(sim.plan, CostModel())["experts"]["ep"] == ep
    with pytest.raises(autotp.ConfigError, match="generation with expert parallelism"):
        sim.ranks[0].generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=1)
    assert sorted(sim.plan.expert_params) == sorted(sim.plan.experts)
    assert all(how == "whole" for _, how in sim.plan.experts.values()), sim.plan.experts
    for target in sim.plan.expert_params:
        assert sim.plan.params[target].local_shape[0] == share
        for module in sim.ranks:
            assert module.expert_parameters()[target].shape[0] == share
    for rank_events in events:
        for layer in (0, 1):
            kinds = Counter((e.phase, e.label) for e in rank_events if e.layer == layer)
            assert kinds[("forward", "experts' row counts")] == 1, kinds
            assert kinds[("forward", "experts' rows combined")] == 1, kinds
            assert kinds[("backward", "experts' rows dispatched")] == 1, kinds
            assert 1 <= kinds[("forward", "experts' rows dispatched")] <= 2, kinds
            assert all(e.kind == "all_to_all" for e in rank_events)
    if tp > 1:
        counts = layer_counts(sim.ranks[0].comm.log)
        assert all(counts[layer]["forward"] == 2 for layer in (0, 1)), counts


def test_expert_parallel_with_per_expert_tables() -> None:
    """gpt-oss at tp 2 x ep 2: its per-expert biases are split with their experts and read
    at the dispatched rows' expert ids on the rank that owns them."""
    sim, _, _ = _data_parallel_step(_gpt_oss(), 2, 2)
    biases = [t for t in sim.plan.expert_params if t.endswith("_bias")]
    assert len(biases) == 4, sim.plan.expert_params
    assert all(sim.plan.params[t].local_shape[0] == 1 for t in biases)


def test_gloo_expert_parallel_with_fsdp2_and_in_pipeline_stages() -> None:
    """Four gloo processes (one launch, three runs), experts split over the dp ranks:

    - FSDP2 per layer and at the root over "dp" with the experts ignored, on a (dp 2, tp 2)
      and a (dp 4, tp 1) DeviceMesh (ep 2 and 4, one of 4 experts per rank): the first
      step's gradients (dense: FSDP2's mean over dp; experts: summed by the dispatch's
      backward, scaled by ``finish_expert_gradients``) within 1e-5 of the unsharded model's
      on the whole batch, and over 2 AdamW steps after ``autotp.clip_grad_norm_`` to half
      the model's norm (the norm within 1e-5 relative) the dp-mean loss within 1e-5 and
      every parameter within 1e-4;
    - pipeline stages, pp 2 x dp 2 (ep 2), FSDP2 over dp and Schedule1F1B: every gradient,
      relative to its largest, within 1e-5 on the first step and 3e-3 on the second (AdamW
      magnifies rounding where a gradient is near zero, as in tests/test_pipeline.py; a
      gradient not scaled is off by 1/2), the losses within 1e-5. A layer of a mixture of
      experts returns sizes (B x T) that the next stage computes again from its own
      tensors."""
    from tests.dist_cases import expert_parallel_cases

    for rank, runs in enumerate(run_processes(expert_parallel_cases, 4, timeout=600)):
        for dp in (2, 4):
            r = runs[f"fsdp dp {dp}"]
            assert r["grad_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (rank, dp, r)
            assert r["norm_diff"] < 1e-5, (rank, dp, r)  # clipped as in test_composition
            assert r["param_diff"] < 1e-4 and r["names"], (rank, dp, r)
            assert r["experts_held"] == [1] and r["expert_moves"] > 0, (rank, dp, r)
        got = runs["pipeline"]
        assert got["experts_held"] and set(got["experts_held"].values()) == {2}, (rank, got)
        for loss, want in zip(got["losses"], got["reference"], strict=True):
            assert abs(loss - want) < 1e-5, (rank, got)
        first, second = got["grad_diffs"]
        assert first["untied"] < 1e-5 and second["untied"] < 3e-3, (rank, got["grad_diffs"])
        first, second = got["norm_diffs"]  # autotp.clip_grad_norm_ over pp, dp and ep
        assert max(first.values()) < 1e-5 and max(second.values()) < 3e-3, (rank, got)


def test_expert_parallel_with_grouped_routing_and_a_shared_expert() -> None:
    """DeepSeek-V3's block (family_coverage.py's model: MLA, grouped top-k routing, a shared expert
    beside the routed ones) at tp 2 x ep 2: exact as above; the shared expert stays a dense
    MLP, tensor parallel and not dispatched."""
    from tests.family_cases import build

    model, _ = build("DeepSeek-V3 (MLA, MoE)")
    sim, _, _ = _data_parallel_step(model, 2, 2)
    assert sim.plan.expert_params and all(how == "whole"
                                          for _, how in sim.plan.experts.values())
    assert not any("shared" in target for target in sim.plan.expert_params)


def test_an_ep_that_does_not_divide_the_experts_is_refused() -> None:
    """ep=3 for 4 experts: an error naming the ep that do divide them, before any rank
    runs."""
    with pytest.raises(PlanError, match=r"ep in \[1, 2, 4\] divide them"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autotp.simulate(qwen3_moe(), 1, ep=3,
                            example_kwargs={"input_ids": torch.zeros(2, 8, dtype=torch.long)})


PUBLISHED_MOE = {
    # name: (config class, model class, fields, experts, experts per rank at tp 8)
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768), 128, 16),
    # layer 0 dense (as the first three of the published 61), layer 1 a MoE layer
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        moe_intermediate_size=2048, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=1), 256, 32),
}


@pytest.mark.parametrize("name", list(PUBLISHED_MOE))
def test_published_moe_shape_on_meta(name: str) -> None:
    """The published shape (2 layers) planned at tp 8 on meta: whole experts per rank in
    every stacked weight, and every layer within Megatron's 2 all-reduces each way (DeepSeek:
    the attention's two gradient sums and the routing weights' joined with others,
    planner/coalesce.py)."""
    config_cls, model_cls, fields, experts, per_rank = PUBLISHED_MOE[name]
    config = getattr(transformers, config_cls)(num_hidden_layers=2, **fields)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autotp.plan(model, 8, example_kwargs={"input_ids": ids})
    assert plan.experts and all(v == [experts, "whole"] for v in plan.experts.values())
    for target in plan.experts:
        assert plan.params[target].local_shape[0] == per_rank
    assert not plan.fallbacks, plan.fallbacks  # the routers: replicated by design, not noted
    for layer in (0, 1):
        assert plan.count("forward", layer) == 2, plan.summary()
        assert plan.count("backward", layer) <= 2, plan.summary()


class _LoopOverHitExperts(torch.nn.Module):
    """A mixture of experts as older transformers wrote it: a Python loop over the experts
    some token picked (``nonzero``), each run on its tokens (``torch.where``)."""

    def __init__(self, experts: int = 4, width: int = 16):
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width)
                                           for _ in range(experts))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.flatten(0, 1)
        weights, chosen = torch.topk(self.router(rows).softmax(-1), 2)
        out = torch.zeros_like(rows)
        mask = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            choice, token = torch.where(mask[hit[0]])
            picked = self.experts[hit[0]](rows[token]) * weights[token, choice, None]
            out.index_add_(0, token, picked)
        return self.head(out.view_as(x))


def test_a_loop_over_the_experts_hit_is_refused_with_its_line() -> None:
    """Routing the capture cannot see (a loop whose trip count is the experts some token
    picked) is refused before any rank runs, naming the loop's source line."""
    with pytest.raises(autotp.TraceError, match=r"test_experts.py:\d+: +for hit in"):
        autotp.plan(_LoopOverHitExperts(), 2, example_args=(torch.randn(2, 8, 16),))


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
        route = routed_rows.route(offs, rank, 2)
        bounds = route.bounds
        assert route.total == 8 and bounds == ((0, 3, 8) if rank == 0 else (3, 8, 8))
        rows = routed_rows.take_rows(full, route)
        assert torch.equal(routed_rows.local_offsets(route),
                           offs[2 * rank: 2 * rank + 2] - bounds[0])
        total += routed_rows.put_rows(rows, route)
        gathered += routed_rows.routed_lookup(rows, index, route)
    assert torch.equal(total, full) and torch.equal(gathered, full[index])
    with pytest.raises(RuntimeError, match="rows sorted by expert"):
        routed_rows.take_rows(torch.randn(9, 5), routed_rows.route(offs, 0, 2))
    table = torch.randn(4, 3)
    ids = torch.tensor([2, 2, 3])
    assert torch.equal(routed_rows.expert_rows(table[2:], ids, routed_rows.route(offs, 1, 2)),
                       table[ids])
    with pytest.raises(RuntimeError, match="another rank's experts"):
        routed_rows.expert_rows(table[:2], ids, routed_rows.route(offs, 0, 2))


def test_expert_dispatch_against_its_definition() -> None:
    """Two ep ranks (threads), 4 experts, each rank's rows sorted by expert with uneven
    counts (an expert no row picks, a rank sending another none): rank d receives, for each
    of its experts {2d, 2d+1} in turn, that expert's rows from rank 0 then rank 1; its
    offsets count them; combining returns every source its own rows, in its own order; and
    the gradient of the round trip is the identity."""
    from autotp.runtime.comm import ThreadHub

    counts = [torch.tensor([2, 0, 3, 1]), torch.tensor([0, 0, 1, 2])]
    sources = [torch.randn(int(c.sum()), 3, requires_grad=True) for c in counts]
    hub = ThreadHub(2, timeout=30)
    results: list = [None, None]

    def rank_main(comm: Any) -> None:
        offs = counts[comm.rank].cumsum(0).to(torch.int32)
        route = routed_rows.ExpertDispatch(comm, 0, 1, layer=None)(offs)
        rows = routed_rows.take_rows(sources[comm.rank], route)
        back = routed_rows.put_rows(rows * 2, route)
        back.sum().backward()
        results[comm.rank] = (rows.detach(), routed_rows.local_offsets(route), back.detach())

    threads = [threading.Thread(target=rank_main, args=(c,)) for c in hub.comms()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pieces = [list(x.split(c.tolist())) for x, c in zip(sources, counts)]
    for d in range(2):
        rows, offsets, back = results[d]
        mine = [pieces[s][e] for e in (2 * d, 2 * d + 1) for s in range(2)]
        assert torch.equal(rows, torch.cat(mine).detach())
        per_expert = [sum(int(counts[s][e]) for s in range(2)) for e in (2 * d, 2 * d + 1)]
        assert offsets.tolist() == torch.tensor(per_expert).cumsum(0).tolist()
        assert torch.equal(back, 2 * sources[d].detach())
        assert torch.equal(sources[d].grad, torch.full_like(sources[d], 2.0))


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
    plan = autotp.planner.plan.Plan.over("tp", 2, model="m", layers=0)
    for node in (first, second):
        plan.choices[node.name] = autotp.planner.plan.Choice(
            op=str(node.target), strategy="(S(0)@experts, S(0), R*) -> S(0)@experts  [experts]",
            inputs=("S(0)@experts", "S(0)", "R*"), output="S(0)@experts", layer=None,
            source=None, candidates=1)
        plan.values[node.name] = "S(0)@experts"
    with pytest.raises(PlanError, match="2 expert groupings"):
        routed_rows._regions(graph, plan)


def test_generate_with_experts_whole() -> None:
    """Greedy decoding on a left-padded batch: the same tokens as the unsharded model, with
    the prefill and decode programs both holding whole experts (each rank's decode step
    reads only its own experts)."""
    from autotp.integrations.generate import decoder_of

    model = qwen3_moe()
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
