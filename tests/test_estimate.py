"""The time and memory model against what autograd really keeps and what a hand count says.

Activation bytes are measured on each rank of the sharded program with
``autotp.verification.saved_tensors.count_saved`` (each storage once, parameters excluded), with
and without sequence parallelism and full recomputation (each layer wrapped in a reentrant
checkpoint, which keeps only the layer's inputs), and compared with ``profile.py``'s count
read off the plan: within 10 %. On CPU a dropout keeps a mask of the input's dtype
(``mask_bytes=4``); CUDA's keeps one byte per element, the estimator's default.
"""

from __future__ import annotations

import inspect

import math
import os
import subprocess
import sys
import json

from dataclasses import replace
from typing import Any, Iterable

import pytest
import torch
from torch import nn

import autotp
from autotp.errors import ConfigError
from autotp.verification.saved_tensors import count_saved
from autotp.capture.trace import capture
from autotp.planner.job.configure import Planner, Request, estimate, parse_mesh, search
from autotp.planner.job.hardware import PRESETS, Hardware, hardware, load, save
from autotp.planner.job.memory import layer_activations, end_activations, precision, stage_memory
from autotp.planner.job.profile import build_profile
from autotp.planner.solve import PlanOptions, plan_graph
from examples import nanogpt as nano


B, T, LAYERS = 2, 24, 2


def _model(dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    model = nano.GPT(nano.GPTConfig(n_layer=LAYERS, n_head=8, n_embd=64, vocab_size=128,
                                    block_size=32, dropout=dropout, flash=False))
    return model.train()


def _saved_bytes(module: nn.Module, ids: torch.Tensor,
                 exclude: Iterable[torch.Tensor] = ()) -> int:
    with count_saved(exclude=[*module.parameters(), *exclude]) as saved:
        out = module(ids)
    del out
    return saved.nbytes


def _checkpointed(module: nn.Module) -> nn.Module:
    """Each transformer block under a reentrant checkpoint: only its inputs are kept."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    blocks = module.get_submodule("transformer.h")
    for i in range(len(blocks)):
        blocks[i] = checkpoint_wrapper(blocks[i], checkpoint_impl=CheckpointImpl.REENTRANT)
    return module


def _estimated(tp: int, sp: bool, policy: str) -> float:
    model = _model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (ids,), {})
    plan = plan_graph(captured, tp, options=PlanOptions(sequence_parallel=sp))
    prof = build_profile(captured, plan, B, T, dtype_bytes=4, mask_bytes=4)
    per_layer = layer_activations(prof, policy)
    return sum(per_layer.values()) + end_activations(prof, "first") + \
        end_activations(prof, "last")


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_activation_bytes_match_what_autograd_saves(tp: int, sp: bool) -> None:
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(2))
    example = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)
    model = _model()
    params = list(model.parameters())
    for policy in ("none", "full"):
        if tp == 1:
            module = _model()
            if policy == "full":
                _checkpointed(module)
            measured = [_saved_bytes(module, ids)]
        else:
            sim = autotp.simulate(model, tp, example_args=example, sequence_parallel=sp)
            if policy == "full":
                sim.run(_checkpointed)
            measured = sim.run(lambda m: _saved_bytes(m, ids, params))
        got = max(measured)
        want = _estimated(tp, sp, policy)
        assert want == pytest.approx(got, rel=0.10), (tp, sp, policy, want, got)


def test_float32_inside_a_bfloat16_model_counts_four_bytes() -> None:
    """A LLaMA trained in bfloat16 computes its norms and its loss in float32 (RMSNorm's
    upcast, ``logits.float()``): traced on meta in bfloat16 (``capture_for_training``), the
    profile counts those at 4 bytes and matches what autograd keeps; traced in float32 it
    undercounts them."""
    import copy

    transformers = pytest.importorskip("transformers")
    from autotp.planner.job.configure import Planner, capture_for_training, training_example

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=4,
                                      num_hidden_layers=2, vocab_size=512)
    batch, seq = 2, 32
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(3))
    with count_saved(exclude=model.parameters()) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    measured = saved.nbytes
    assert loss.requires_grad

    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)

    def profiled_in(dtype: str) -> Any:
        profiled, planned = capture_for_training(copy.deepcopy(meta), None,
                                                 training_example(meta), dtype)
        return Planner(profiled, "llama", seq, planned=planned).profile(1, False, batch, 2)

    def estimated(dtype: str) -> float:
        prof = profiled_in(dtype)
        return sum(layer_activations(prof, "none").values()) + \
            end_activations(prof, "first") + end_activations(prof, "last")

    assert estimated("bfloat16") == pytest.approx(measured, rel=0.10)
    # backward's largest pair: the logits' float32 gradient and the bfloat16 one of the cast
    assert profiled_in("bfloat16").backward_working["last"] == batch * seq * 512 * (4 + 2)
    assert estimated("float32") < 0.9 * measured  # every float32 value at 2 bytes
    assert next(meta.parameters()).dtype == torch.float32  # the caller's model is untouched


def test_selective_recomputation_drops_the_attention_core() -> None:
    model = _model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (ids,), {})
    prof = build_profile(captured, plan_graph(captured, 2), B, T, dtype_bytes=2)
    none, selective = layer_activations(prof, "none"), layer_activations(prof, "selective")
    # per layer the attention core keeps softmax output (2 bytes), dropout mask (1) and
    # dropout output (2) of b x heads x s x s: Korthikanti's 5as^2b, sharded by heads; and
    # the causal mask (s x s booleans) that masked_fill keeps
    heads_local = 8 // 2
    core = 5 * B * heads_local * T * T + T * T
    for layer in prof.layers:
        assert none[layer] - selective[layer] == pytest.approx(core, rel=0.02)


def test_model_states_are_the_local_shards_times_bytes_per_element() -> None:
    model = _model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    sim = autotp.simulate(model, 2, example_args=(ids,))
    local = max(sim.run(lambda m: sum(p.numel() for p in m.parameters())))
    captured = capture(model, (ids,), {})
    prof = build_profile(captured, plan_graph(captured, 2), B, T)
    prec = precision("bf16-mixed", "adam")
    mem = stage_memory(prof, 0, [prof.layers], micro_batches=1, policy="none", prec=prec,
                       dp=1)
    assert (prec.weight, prec.grad, prec.optimizer) == (2, 2, 12)
    assert mem.parameters == 2 * local
    assert mem.gradients == 2 * local
    assert mem.optimizer == 12 * local
    sharded = stage_memory(prof, 0, [prof.layers], micro_batches=1, policy="none", prec=prec,
                           dp=4)
    assert sharded.optimizer == 12 * local / 4 and sharded.parameters == 2 * local / 4


def _tiny_hw(memory: float) -> Hardware:
    return Hardware(name="tiny", flops={"float32": 1e12}, memory=memory,
                    memory_bandwidth=1e11, intra_node_bandwidth=1e10,
                    inter_node_bandwidth=1e9, gpus_per_node=2, memory_reserved=0.0)


def test_collective_and_product_times_known_by_hand() -> None:
    """A ring all-reduce of p ranks waits its launch and 2 (p - 1) hop latencies, then moves
    2 (p - 1) / p of the tensor at the achieved bus bandwidth (an all-gather: p - 1 hops and
    (p - 1) / p); a product takes its FLOPs at the GEMM rate or its operands and result at
    the memory rate, whichever is longer; the profile counts those bytes on local shapes."""
    from autotp.planner.job.timing import collective_time

    hw = Hardware(name="hand", flops={"float16": 100e12}, memory=1e9, memory_bandwidth=1e12,
                  intra_node_bandwidth=100e9, inter_node_bandwidth=10e9,
                  intra_node_latency=10e-6, intra_node_step_latency=5e-6,
                  collective_efficiency=0.5, gemm_efficiency=0.5, gemm_knee=0.0,
                  memory_efficiency=0.5, kernel_overhead=0.0, host_overhead=0.0)
    # 10 us + 14 x 5 us, then 1.75 x 100 MB at 50 GB/s = 3.5 ms
    assert collective_time(hw, "all_reduce", 100e6, 8, True) == pytest.approx(80e-6 + 3.5e-3)
    # 10 us + 7 x 5 us, then 0.875 x 100 MB at 50 GB/s = 1.75 ms
    assert collective_time(hw, "all_gather", 100e6, 8, True) == pytest.approx(45e-6 + 1.75e-3)
    assert collective_time(hw, "all_reduce", 100e6, 1, True) == 0.0
    # 1 GFLOP at 50 TFLOP/s: 20 us; 100 MB of operands at 500 GB/s: 200 us
    assert hw.gemm_time(1e9, "float16") == pytest.approx(20e-6)
    assert hw.gemm_time(1e9, "float16", 1e6) == pytest.approx(20e-6)
    assert hw.gemm_time(1e9, "float16", 100e6) == pytest.approx(200e-6)

    model = _model(dropout=0.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (ids,), {})
    h, tokens = 64, B * T
    for tp in (1, 2):
        prof = build_profile(captured, plan_graph(captured, tp), B, T, dtype_bytes=2)
        products = [op for op in prof.ops if op.kind == "gemm" and op.layer == 0]
        qkv, out = products[0], products[-1]
        # column-parallel qkv: x whole, W and the result split by tp
        assert qkv.nbytes == 2 * (tokens * h + 3 * h * h / tp + tokens * 3 * h / tp)
        # row-parallel MLP output: x and W split, the partial result whole on every rank
        assert out.nbytes == 2 * (tokens * 4 * h / tp + h * 4 * h / tp + tokens * h)


def test_search_finds_the_answer_known_by_hand() -> None:
    """2 GPUs, a model whose 16 bytes per parameter fit only when tensor parallelism halves
    them: dp=2 (no sharding of states) is refused for memory, tp=2 wins. With room for
    everything, dp=2 wins: the same compute per GPU and no tensor-parallel traffic."""
    model = _model(dropout=0.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    total = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    captured = capture(model, (ids,), {})
    planner = Planner(captured, "nanogpt", T)
    # room for the sharded states (and activations) but not for the replicated ones
    memory = 16 * (total - matrices / 2) + 3e5
    assert memory < 16 * total
    req = Request(gpus=2, global_batch=2, seq=T, micro_batch=1, checkpointing="none",
                  sequence_parallel=False, dtype="float32", dp_shard="none")
    configs = search(planner, _tiny_hw(memory), req)
    best = next(c for c in configs if c.fits)
    assert (best.tp, best.pp, best.dp) == (2, 1, 1)
    assert best.parallelize_kwargs() == {"tp": 2, "sequence_parallel": False}
    # docs/estimate.md's hand-off: init_device_mesh("cuda", **best.device_mesh_kwargs()) binds
    from torch.distributed.device_mesh import init_device_mesh

    bound = inspect.signature(init_device_mesh).bind("cuda", **best.device_mesh_kwargs())
    assert bound.arguments["mesh_shape"] == (1, 1, 2)
    assert bound.arguments["mesh_dim_names"] == ("pp", "dp", "tp")
    refused = {(c.tp, c.pp, c.dp): c.why for c in configs if not c.fits}
    assert "usable" in refused[(1, 1, 2)]
    roomy = search(planner, _tiny_hw(1e12), req)
    assert (roomy[0].tp, roomy[0].pp, roomy[0].dp) == (1, 1, 2)
    assert roomy[0].time.tp_comm == 0 and next(c for c in roomy if c.tp == 2).time.tp_comm > 0


def test_pipeline_stages_hold_their_micro_batches_in_flight() -> None:
    """1F1B: stage 0 keeps pp micro-batches of activations, the last stage one."""
    model = _model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (ids,), {})
    prof = build_profile(captured, plan_graph(captured, 1), B, T)
    prec = precision("bf16-mixed")
    stages = [[0], [1]]
    per_layer = layer_activations(prof, "none")
    first = stage_memory(prof, 0, stages, micro_batches=8, policy="none", prec=prec, dp=1)
    last = stage_memory(prof, 1, stages, micro_batches=8, policy="none", prec=prec, dp=1)
    assert first.activations == pytest.approx(2 * (per_layer[0] + end_activations(prof, "first")))
    assert last.activations == pytest.approx(per_layer[1] + end_activations(prof, "last"))


def test_bad_input_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match="h100"):
        hardware("tpu-v9")
    with pytest.raises(ConfigError, match="pp=P,dp=D,tp=T"):
        parse_mesh("pp=2,xx=3")
    model = _model(dropout=0.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ConfigError, match="16 GPUs, not the 8"):
        estimate(model, gpus=8, global_batch=8, seq=16, hardware="h100",
                 example_args=(ids,), mesh=(2, 4, 2))
    est = estimate(model, gpus=8, global_batch=6, seq=16, hardware="h100",
                   example_args=(ids,), micro_batch=1, checkpointing="none",
                   sequence_parallel=False)
    whys = {(c.tp, c.pp, c.dp): c.why for c in est.configs}
    assert "not divisible by dp=4" in whys[(2, 1, 4)]
    wide = estimate(model, gpus=16, global_batch=16, seq=16, hardware="h100",
                    example_args=(ids,), mesh=(1, 1, 16), micro_batch=1,
                    checkpointing="none", sequence_parallel=False)
    assert not wide.configs[0].fits
    assert "tp=16 does not divide the 8 attention heads" in wide.configs[0].why


def test_hardware_files_round_trip(tmp_path) -> None:
    path = str(tmp_path / "hw.json")
    save(PRESETS["a100-80gb"], path)
    assert load(path) == PRESETS["a100-80gb"]
    with open(path, "w") as handle:
        json.dump({"name": "x", "flops": {"bfloat16": 1e15}}, handle)
    with pytest.raises(ConfigError, match="missing field"):
        load(path)


def test_cli_estimate_writes_the_schema(tmp_path) -> None:
    factories = os.path.join(os.path.dirname(__file__), "cli_factories.py")
    out = tmp_path / "est.json"
    run = subprocess.run(
        [sys.executable, "-m", "autotp", "estimate", f"{factories}:nanogpt", "--gpus", "4",
         "--global-batch", "8", "--seq", "16", "--hardware", "a100-80gb", "--format", "json",
         "-o", str(out), "-q", "--checkpointing", "none", "--micro-batch", "1"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == "autotp.estimate/1"
    first = data["configs"][0]
    assert first["fits"] and set(first["memory"]) >= {"parameters", "gradients", "optimizer",
                                                      "activations", "total"}
    parts = ("compute_s", "tp_comm_s", "ep_comm_s", "cp_comm_s", "pp_bubble_s", "dp_comm_s",
             "optimizer_s")
    assert set(first["time"]) == {"step_s", *parts}
    assert first["time"]["optimizer_s"] > 0
    assert math.isclose(sum(first["time"][k] for k in parts),
                        first["time"]["step_s"], rel_tol=1e-6)
    steps = [c["time"]["step_s"] for c in data["configs"] if c["fits"]]
    assert steps == sorted(steps)


def test_calibrate_writes_a_hardware_file_of_this_device(tmp_path) -> None:
    from autotp.planner.job.hardware import calibrate

    measured, m = calibrate(PRESETS["h100"], dtype="float32", device="cpu", sizes=(64, 128),
                            repeats=2)
    assert len(m.gemms) == 2 and all(seconds > 0 for _, _, seconds in m.gemms)
    assert 0 < measured.gemm_efficiency <= 1 and measured.memory_efficiency > 0
    # an eager op's host time is measured anywhere; a kernel's device time only on a GPU
    assert 0 < measured.host_overhead < 1e-3
    assert measured.kernel_overhead == PRESETS["h100"].kernel_overhead
    path = str(tmp_path / "cpu.json")
    save(measured, path)
    assert hardware(path) == measured


@pytest.mark.parametrize("tokens,experts,top_k,ranks", [(64, 16, 2, 4), (256, 128, 8, 8),
                                                        (32, 8, 2, 2)])
def test_routing_imbalance_matches_sampled_routings(tokens: int, experts: int, top_k: int,
                                                    ranks: int) -> None:
    """The busiest rank's routed rows over the mean, under uniform top-k routing: the normal
    approximation against 4000 sampled routings (each token's k distinct experts drawn at
    random), within 1% of the sampled mean ratio."""
    from autotp.planner.job.expert_load import routing_imbalance

    g = torch.Generator().manual_seed(0)
    picks = torch.rand(4000, tokens, experts, generator=g).argsort(-1)[..., :top_k]
    owner = picks // (experts // ranks)  # experts held in contiguous blocks per rank
    loads = torch.nn.functional.one_hot(owner, ranks).sum((1, 2)).float()  # [trials, ranks]
    sampled = (loads.max(-1).values / (tokens * top_k / ranks)).mean().item()
    predicted = routing_imbalance(tokens, experts, top_k, ranks)
    assert predicted > 1.0
    assert predicted == pytest.approx(sampled, rel=0.01), (predicted, sampled)


def test_expert_products_are_timed_at_the_busiest_rank(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A Qwen3-MoE on meta, experts whole at tp 2: the estimate reports the experts per rank
    and the expected imbalance, and every op on routed rows (the expert products, their
    activation) costs the balanced share times it; no other op changes."""
    tf = pytest.importorskip("transformers")
    from autotp.planner.job import profile as profile_module
    from autotp.planner.job.expert_load import routing_imbalance

    config = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=8, num_experts=8,
                               num_experts_per_tok=2, vocab_size=128)
    with torch.device("meta"):
        model = tf.Qwen3MoeForCausalLM(config)
    ids = torch.zeros(2, T, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), {})
    planner = Planner(captured, "qwen3_moe", T)
    req = Request(gpus=2, global_batch=2, seq=T, micro_batch=1, checkpointing="none",
                  sequence_parallel=False, dtype="float32", mesh=(1, 1, 2))
    (found,) = search(planner, _tiny_hw(1e12), req)
    want = routing_imbalance(T, 8, 2, 2)
    assert want > 1.05
    assert found.experts == (8, 2, pytest.approx(want))
    assert found.to_dict()["experts"] == {"experts": 8, "top_k": 2, "per_rank": 4,
                                          "imbalance": round(want, 4)}
    plan = planner.plan(2, False)
    busiest = build_profile(captured, plan, 1, T, 4)
    monkeypatch.setattr(profile_module, "routing_imbalance", lambda *args: 1.0)
    balanced = build_profile(captured, plan, 1, T, 4)
    assert busiest.expert_imbalance == pytest.approx(want) and balanced.expert_imbalance == 1
    pairs = list(zip(busiest.ops, balanced.ops))
    scaled = [(a, b) for a, b in pairs if (a.flops, a.nbytes) != (b.flops, b.nbytes)]
    products = [(a, b) for a, b in scaled if a.kind == "gemm"]
    assert len(products) >= 2 * 2, [a.name for a, _ in scaled]  # gate|up and down, per layer
    for a, b in products:
        assert a.flops == pytest.approx(want * b.flops)
    assert all(a.nbytes >= b.nbytes for a, b in scaled)
    assert len(scaled) < len(pairs) / 2  # attention, norms, the router: unchanged


def _moe_on_meta(experts: int = 8) -> tuple[Any, Planner]:
    tf = pytest.importorskip("transformers")
    config = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=8, num_experts=experts,
                               num_experts_per_tok=2, vocab_size=128)
    with torch.device("meta"):
        model = tf.Qwen3MoeForCausalLM(config)
    captured = capture(model, (torch.zeros(2, T, dtype=torch.long, device="meta"),), {})
    return captured, Planner(captured, "qwen3_moe", T)


def test_expert_parallelism_is_searched_and_priced() -> None:
    """A Qwen3-MoE (8 experts) on 4 GPUs of 2 per node: at tp 1 x dp 4 the search tries ep 1
    and 2 (the largest whose all-to-alls stay in a node), at tp 2 x dp 2 ep 1 only; ep 4 when
    asked. Each ep holds experts / (tp x ep) per rank, outside the data-parallel sharding,
    and adds 4 all-to-alls per MoE layer over the ep group (rows to their experts and back,
    each way) carrying the rows of the tp rank's share: B x T x top-k x h elements over tp."""
    from autotp.planner.job.timing import collective_time

    captured, planner = _moe_on_meta()
    hw = _tiny_hw(1e12)
    req = Request(gpus=4, global_batch=4, seq=T, micro_batch=1, checkpointing="none",
                  sequence_parallel=False, dtype="float32", precision="fp32", dp_shard="none")
    found = {(c.tp, c.dp, c.ep): c for c in search(planner, hw, req) if c.pp == 1}
    assert {ep for tp, dp, ep in found if (tp, dp) == (1, 4)} == {1, 2}
    assert {ep for tp, dp, ep in found if (tp, dp) == (2, 2)} == {1}
    (found[(1, 4, 4)],) = search(planner, hw, replace(req, mesh=(1, 4, 1), ep=4))
    profiles = {ep: planner.profile(1, False, 1, 4, ep) for ep in (1, 2, 4)}
    stacked = sum(p.numel for p in profiles[1].params if ".experts." in p.name)
    assert stacked == 2 * 8 * 3 * 64 * 32  # gate|up and down of 8 experts, 2 layers
    per_elem = 4 + 4 + 8  # fp32 weight, gradient, two moments
    for ep in (2, 4):
        experts = [p for p in profiles[ep].params if p.expert]
        assert sum(p.numel for p in experts) == stacked // ep
        assert {p.name for p in experts} == {p.name for p in profiles[1].params
                                             if ".experts." in p.name}
        c, dense = found[(1, 4, ep)], found[(1, 4, 1)]
        saved = sum(getattr(dense.memory, k) - getattr(c.memory, k)
                    for k in ("parameters", "gradients", "optimizer"))
        assert saved == pytest.approx(stacked * (1 - 1 / ep) * per_elem)
        assert c.to_dict()["experts"]["per_rank"] == 8 // ep
        moved = [x for x in profiles[ep].comms if x.group == "ep"]
        assert sorted((x.layer, x.phase) for x in moved) == sorted(
            (layer, phase) for layer in (0, 1) for phase in ("forward", "backward") * 2)
        assert {x.kind for x in moved} == {"all_to_all"}
        assert {x.nbytes for x in moved} == {T * 2 * 64 * 4}
        within = ep <= hw.gpus_per_node
        want = sum(collective_time(hw, "all_to_all", x.nbytes, ep, within) for x in moved)
        assert c.time.ep_comm == pytest.approx(want)
        assert c.time.ep_comm > 0 and dense.time.ep_comm == 0
    assert found[(1, 4, 4)].flags == "--mesh pp=1,dp=4,tp=1 --ep 4"
    assert found[(1, 4, 1)].flags == "--mesh pp=1,dp=4,tp=1"


def test_expert_parallelism_bad_input_is_refused_with_the_numbers() -> None:
    captured, planner = _moe_on_meta()
    req = Request(gpus=4, global_batch=4, seq=T, micro_batch=1, checkpointing="none",
                  sequence_parallel=False, dtype="float32", mesh=(1, 4, 1), ep=3)
    (refused,) = search(planner, _tiny_hw(1e12), req)
    assert not refused.fits and refused.why == \
        "ep=3 does not divide dp=4: expert parallelism splits the dp ranks"
    req = Request(gpus=4, global_batch=4, seq=T, micro_batch=1, checkpointing="none",
                  sequence_parallel=False, dtype="float32", mesh=(1, 2, 2), ep=8)
    assert "does not divide dp=2" in search(planner, _tiny_hw(1e12), req)[0].why
    dense = Planner(capture(nano.GPT(nano.GPTConfig(block_size=T, vocab_size=128, n_layer=2,
                                                    n_head=4, n_embd=32)),
                            (torch.zeros(2, T, dtype=torch.long),), {}), "nanogpt", T)
    with pytest.raises(ConfigError, match="no grouped experts"):
        search(dense, _tiny_hw(1e12), Request(gpus=2, global_batch=2, seq=T, ep=2,
                                              dtype="float32"))


def test_expert_exchanges_predicted_match_the_simulation() -> None:
    """The all-to-all bytes the profile predicts for each MoE layer and direction, against
    what a simulation at tp 1 x ep 2 received (every rank's log, summed): equal, whatever the
    routing (each row goes to one owner and comes back)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32)
    model = tf.Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, 128, (4, T), generator=torch.Generator().manual_seed(3))
    sim = autotp.simulate(model, 1, ep=2, example_kwargs={"input_ids": ids[:2]})

    def step(module: Any) -> dict:
        e = module.ep_comm.rank
        module.ep_comm.log.clear()
        module(input_ids=ids[2 * e:2 * e + 2]).logits.float().pow(2).mean().backward()
        got: dict = {}
        for ev in module.ep_comm.log.events:
            if ev.kind == "all_to_all" and "counts" not in ev.label:
                got[(ev.layer, ev.phase)] = got.get((ev.layer, ev.phase), 0) + ev.nbytes
        return got

    measured: dict = {}
    for got in sim.run(step):
        for key, nbytes in got.items():
            measured[key] = measured.get(key, 0) + nbytes
    assert sim.captured is not None
    prof = build_profile(sim.captured, sim.plan, 2, T, 4)
    predicted: dict = {}
    for c in prof.comms:
        if c.group == "ep":
            predicted[(c.layer, c.phase)] = predicted.get((c.layer, c.phase), 0) + c.nbytes
    assert measured == {key: 2 * nbytes for key, nbytes in predicted.items()}, (measured,
                                                                                 predicted)


# ---- context parallelism ---------------------------------------------------------------

def _llama_on_meta(layers: int = 2) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=1024,
                                      max_position_embeddings=1 << 20)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_context_profile_splits_the_sequence_and_adds_the_ring() -> None:
    """At cp 4 a rank's program is the cp 1 program on a quarter of the sequence: every
    product, the attention's work (its queries against every key), the activations kept and
    the tp collectives a quarter; each attention adds its ring, one shift carrying the kv
    heads' blocks (b x T/cp x kv heads/tp x head dim x 2 tensors x 2 bytes; transformers'
    repeat of the kv heads for GQA is read through) forward, with their gradients (the
    same bytes) backward, and the gradients' shift home."""
    from autotp.planner.job.configure import training_example

    model = _llama_on_meta()
    captured = capture(model, None, training_example(model))
    plan = plan_graph(captured, 2)
    seq, tp, cp, kv, head = 4096, 2, 4, 2, 32
    one = build_profile(captured, plan, 1, seq, dtype_bytes=2)
    four = build_profile(captured, plan, 1, seq, dtype_bytes=2, cp=cp)
    assert (four.cp, four.seq) == (cp, seq // cp)

    def saved(prof: Any, layer: int) -> float:
        return sum(s.nbytes for s in prof.saved if s.layer == layer)

    def tp_bytes(prof: Any, layer: int) -> float:
        return sum(c.nbytes for c in prof.comms if c.layer == layer and c.group == "tp")

    for layer in one.layers:
        for kind in ("gemm", "attention"):
            mine = [op.flops for op in four.ops if op.layer == layer and op.kind == kind]
            whole = [op.flops for op in one.ops if op.layer == layer and op.kind == kind]
            assert mine and sum(mine) == pytest.approx(sum(whole) / cp, rel=1e-9), kind
        assert saved(four, layer) == pytest.approx(saved(one, layer) / cp)
        assert tp_bytes(one, layer) > 0
        assert tp_bytes(four, layer) == pytest.approx(tp_bytes(one, layer) / cp)
        ring = {(c.kind, c.phase): c.nbytes for c in four.comms
                if c.layer == layer and c.group == "cp"}
        blocks = 1 * (seq // cp) * (kv // tp) * head * 2 * 2
        grads = blocks
        assert ring == {("shift", "forward"): blocks, ("shift", "backward"): blocks + grads,
                        ("shift_home", "backward"): grads}
    assert not [c for c in one.comms if c.group == "cp"]
    with pytest.raises(ConfigError, match="cp=3 does not divide the sequence 4096"):
        build_profile(captured, plan, 1, seq, cp=3)


def test_a_mask_made_from_positions_is_held_as_its_factors() -> None:
    """transformers' LLaMA builds its mask by elementwise ops from vectors of positions; at
    cp the ring builds each block of it from those vectors (``runtime/ring.BlockMask``),
    so the profile keeps the vectors, not the mask's [T/cp, T] rows: what the embeddings'
    side and the first layer keep doubles with the sequence, where the rows would
    quadruple, and stays far below the rows' bytes."""
    from autotp.planner.job.configure import training_example

    model = _llama_on_meta()
    captured = capture(model, None, training_example(model))
    plan = plan_graph(captured, 1)
    cp, first, entering = 4, {}, {}
    for seq in (4096, 8192):
        prof = build_profile(captured, plan, 1, seq, dtype_bytes=2, cp=cp)
        first[seq] = end_activations(prof, "first")
        entering[seq] = prof.layer_inputs[prof.layers[0]]
    assert first[8192] <= 2.01 * first[4096] and entering[8192] <= 2.01 * entering[4096], \
        (first, entering)
    rows = 8192 // cp * 8192  # one byte per (query, key) of this rank's rows
    assert first[8192] < rows / 8 and entering[8192] < rows / 8, (first, entering)


def test_causal_shaped_masks_are_told_from_bidirectional_ones() -> None:
    """``planner/masks.ordered``: transformers' causal masks (LLaMA, GPT-2) and sliding-window
    mask (Mistral), each with a padding mask joined in, keep at most the causal half of the
    pairs (an order comparison of query and key positions, joined by conjunctions), which
    the estimate prices at half (the runtime's causal path, or the ring's skipped chunk
    pairs); BERT's bidirectional padding mask does not."""
    from tests import models

    from autotp.ops import node_arg
    from autotp.planner.masks import mask_region, ordered

    ids = torch.randint(0, models.VOCAB, (2, 16))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :3] = 0
    for name, causal in (("llama", True), ("gpt2", True), ("mistral_window", True),
                         ("bert", False)):
        captured = capture(models.BUILDERS[name]().eval(), None,
                           {"input_ids": ids, "attention_mask": padding})
        masks = [node_arg(n, "attn_mask") for n in captured.gm.graph.nodes
                 if n.target == torch.ops.aten.scaled_dot_product_attention.default]
        regions = [mask_region(m) for m in masks]
        assert regions and all(r is not None for r in regions), name
        assert all(ordered(r) == causal for r in regions if r is not None), name


def test_the_ring_shows_only_where_it_outlasts_the_attention() -> None:
    """Each of the cp - 1 shifts overlaps one step's attention (1/cp of it; backward 2.5x):
    what the shift takes beyond that is added; the gradients' last shift home is not
    hidden; an eager attention's gather over cp is a plain all-gather."""
    from autotp.planner.job.profile import Comm
    from autotp.planner.job.timing import _ring_time, collective_time

    hw = Hardware(name="hand", flops={"float16": 100e12}, memory=1e9, memory_bandwidth=1e12,
                  intra_node_bandwidth=100e9, inter_node_bandwidth=10e9,
                  intra_node_latency=10e-6, intra_node_step_latency=5e-6,
                  inter_node_latency=20e-6, inter_node_step_latency=10e-6,
                  collective_efficiency=0.5, gemm_efficiency=0.5, gemm_knee=0.0,
                  memory_efficiency=0.5, kernel_overhead=0.0, host_overhead=0.0)
    one = hw.ring_latency(1, True) + 100e6 / 50e9  # a 100 MB shift over NVLink at 50 GB/s
    forward = Comm("shift", "forward", 0, 100e6, group="cp")
    # the attention's 4 ms forward hides 1 ms per step: each of 3 shifts shows one - 1 ms
    assert _ring_time(hw, forward, 4, True, [4e-3], 0) == pytest.approx(3 * (one - 1e-3))
    # backward: 2.5 x 4 ms over 4 steps = 2.5 ms per step, more than the shift: hidden
    backward = Comm("shift", "backward", 0, 100e6, group="cp")
    assert _ring_time(hw, backward, 4, True, [4e-3], 0) == 0.0
    home = Comm("shift_home", "backward", 0, 100e6, group="cp")
    assert _ring_time(hw, home, 4, True, [4e-3], 0) == pytest.approx(one)
    # across nodes the same shift takes 10 GB/s x 0.5
    assert _ring_time(hw, forward, 4, False, [0.0], 0) == pytest.approx(
        3 * (hw.ring_latency(1, False) + 100e6 / 5e9))
    gather = Comm("all_gather", "forward", 0, 100e6, group="cp")
    assert _ring_time(hw, gather, 4, True, [], 0) == collective_time(hw, "all_gather", 100e6,
                                                                     4, True)
    assert _ring_time(hw, forward, 1, True, [4e-3], 0) == 0.0


def test_context_parallelism_is_searched_where_the_sequence_outgrows_a_gpu() -> None:
    """A long sequence whose activations fit no GPU whole: the best configuration splits it
    over cp ranks, and the table sets it beside the best without cp (none here, with the
    closest one's shortfall); its mesh binds init_device_mesh with a cp dim and its
    parallelize arguments carry cp. At a sequence that fits whole, the best keeps it whole
    and the table says what the best with cp would cost."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.planner.job.configure import Estimate, training_example
    from autotp.planner.job.estimate_view import to_json, to_table

    model = _llama_on_meta()
    captured = capture(model, None, training_example(model))
    seq = 65536
    planner = Planner(captured, "llama", seq, 8)
    hw = replace(PRESETS["h100"], memory=2 * 2**30, gpus_per_node=4)
    req = Request(gpus=8, global_batch=8, seq=seq, checkpointing="none", dtype="bfloat16")
    configs = search(planner, hw, req)
    best = next(c for c in configs if c.fits)
    assert best.cp > 1 and best.time.cp_comm > 0, best
    assert not [c for c in configs if c.fits and c.cp == 1]
    assert best.parallelize_kwargs()["cp"] == best.cp
    bound = inspect.signature(init_device_mesh).bind("cuda", **best.device_mesh_kwargs())
    assert bound.arguments["mesh_shape"] == (best.pp, best.dp, best.cp, best.tp)
    assert bound.arguments["mesh_dim_names"] == ("pp", "dp", "cp", "tp")
    est = Estimate(model="llama", hardware=hw, gpus=8, global_batch=8, seq=seq,
                   dtype="bfloat16", precision="bf16-mixed/adam", configs=configs)
    table = to_table(est)
    assert f"cp={best.cp}" in table and "without cp: none fits; the closest" in table
    assert json.loads(to_json(est))["configs"][0]["cp"] == best.cp
    # activations per GPU: a quarter of the sequence keeps about a quarter of them
    by_cp = {c.cp: c for c in configs if c.memory is not None and c.tp == 1 and
             c.pp == 1 and c.micro_batch == 1 and c.dp * c.cp == 8}
    assert by_cp[4].memory.activations < by_cp[1].memory.activations / 3

    short = Planner(captured, "llama", 2048, 8)
    roomy = search(short, replace(hw, memory=80 * 2**30),
                   replace(req, seq=2048, global_batch=64))
    assert roomy[0].fits and roomy[0].cp == 1
    assert any(c.fits and c.cp == 2 for c in roomy)
    est = Estimate(model="llama", hardware=hw, gpus=8, global_batch=64, seq=2048,
                   dtype="bfloat16", precision="bf16-mixed/adam", configs=roomy)
    assert "with cp, the best is" in to_table(est) and "cp is not needed" in to_table(est)


def test_context_parallel_bad_input_is_refused_with_the_numbers(tmp_path) -> None:
    from autotp.planner.job.configure import training_example

    model = _llama_on_meta(1)
    planner = Planner(capture(model, None, training_example(model)), "llama", 4096, 8)
    hw = PRESETS["h100"]
    with pytest.raises(ConfigError, match="cp=3 does not divide the sequence 4096"):
        search(planner, hw, Request(gpus=6, global_batch=2, seq=4096, cp=3))
    with pytest.raises(ConfigError, match="cp=2 with ep=2"):
        search(planner, hw, Request(gpus=4, global_batch=2, seq=4096, cp=2, ep=2))
    with pytest.raises(ConfigError, match="= 4 GPUs, not the 8"):
        search(planner, hw, Request(gpus=8, global_batch=2, seq=4096, cp=2, mesh=(1, 2, 1)))
    with pytest.raises(ConfigError, match="cp must be a positive int, got 0"):
        search(planner, hw, Request(gpus=8, global_batch=2, seq=4096, cp=0))
    run = subprocess.run(
        [sys.executable, "-m", "autotp", "estimate", "hf:llama", "--gpus", "8",
         "--global-batch", "8", "--cp", "2", "--mesh", "pp=1,dp=2,cp=4,tp=1", "-q"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--cp 2 and --mesh pp=1,dp=2,cp=4,tp=1 disagree" in \
        run.stderr, run.stderr


def test_attention_without_a_mask_is_priced_by_ulysses_where_the_plan_runs_it() -> None:
    """nanoGPT's SDPA (is_causal, no mask tensor; 8 of 8 heads) at cp 4: the plan runs it by
    Ulysses (``planner/assemble.py``), and the profile prices two all-to-alls per direction
    over cp, each rank sending its q, k, v and output (b x T/cp x h x 2 bytes each), and no
    ring; at cp 2 (a tie of bytes) the ring."""
    torch.manual_seed(0)
    model = nano.GPT(nano.GPTConfig(n_layer=LAYERS, n_head=8, n_embd=64, vocab_size=128,
                                    block_size=32, dropout=0.0, flash=True))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    captured = capture(model, (ids,), {})
    plan = plan_graph(captured, 1)
    seq = 4096
    four = build_profile(captured, plan, 1, seq, dtype_bytes=2, cp=4)
    for layer in four.layers:
        moves = {(c.kind, c.phase): c.nbytes for c in four.comms
                 if c.layer == layer and c.group == "cp"}
        assert moves == {("all_to_all", "forward"): 4 * (seq // 4) * 64 * 2,
                         ("all_to_all", "backward"): 4 * (seq // 4) * 64 * 2}, moves
    two = build_profile(captured, plan, 1, seq, dtype_bytes=2, cp=2)
    assert {c.kind for c in two.comms if c.group == "cp"} == {"shift", "shift_home"}
    sim = autotp.simulate(model, 1, cp=4, example_args=(ids,))
    assert all(c.strategy.endswith("[ulysses]") for c in sim.plan.choices.values()
               if "scaled_dot_product" in c.op)
