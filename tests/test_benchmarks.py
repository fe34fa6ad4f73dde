"""The benchmark's reference implementations are exact, and its collective counter counts.

One gloo run at tp = 2 on tiny models: the hand-written Megatron and both DTensor variants
match the unsharded model (loss and every gradient <= 1e-4), and the counter of
``benchmarks/step_probe.py`` sees the collectives Megatron's and DTensor's plans predict, in
forward and in backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotp.runtime.launch import run_processes
from benchmarks import bench_models as bm
from benchmarks.step_probe import StepProbe

ATOL = 1e-4
MODELS = ("gpt2", "llama")
IMPLS = ("megatron", "dtensor", "dtensor-prepare")


def reference_case(rank: int, world_size: int) -> dict[str, Any]:
    """Per model and implementation: loss and max gradient diff against the unsharded model,
    and the collectives of one training step counted by the probe."""
    from benchmarks.tp_bench import build_impl, check_step, train_step

    from autotp.verification.verify import max_difference

    torch.set_num_threads(1)
    # foreach: the optimizer's multi-tensor kernels, torch's default on CUDA
    spec = {"device": "cpu", "optim": "sgd", "lr": 0.1, "foreach": True}
    out: dict[str, Any] = {}
    for model in MODELS:
        cfg = bm.make_config(model, "tiny")
        ref = bm.build_model(cfg, seed=0)
        idx, targets = bm.make_batch(cfg, 2, seed=1)
        ref_loss = ref(idx, targets)
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        ref.zero_grad(set_to_none=True)
        for name in IMPLS:
            impl = build_impl(name, ref, rank, world_size, (idx, targets), spec)
            loss, grads = check_step(impl, idx, targets, ref_grads)
            probe = StepProbe()
            with probe:
                train_step(impl, idx, targets, probe)
            out[f"{model}/{name}"] = {
                "loss_diff": abs(loss - ref_loss.item()),
                "grad_diff": max_difference(ref_grads, grads),
                "n_grads": len(grads),
                "counts": probe.counts(),
                "bytes": probe.bytes(),
                "n_layer": cfg.n_layer,
            }
        out[f"{model}/n_params"] = len(ref_grads)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_processes(reference_case, 2, timeout=240)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model", MODELS)
def test_reference_matches_unsharded(results: list[dict[str, Any]], model: str,
                                     impl: str) -> None:
    for rank, r in enumerate(results):
        row = r[f"{model}/{impl}"]
        assert row["loss_diff"] <= ATOL, (rank, row)
        assert row["grad_diff"] <= ATOL, (rank, row)
        assert row["n_grads"] >= r[f"{model}/n_params"]


@pytest.mark.parametrize("model", MODELS)
def test_counter_sees_megatron_collectives(results: list[dict[str, Any]], model: str) -> None:
    """Megatron: forward, the embedding's g, two g per layer, the loss's three all-reduces;
    backward, two f per layer and the lm_head's f (autograd Functions' backward)."""
    for r in results:
        row = r[f"{model}/megatron"]
        layers = row["n_layer"]
        assert row["counts"]["forward"] == {"all_reduce": 1 + 2 * layers + 3}, row
        assert row["counts"]["backward"] == {"all_reduce": 2 * layers + 1}, row
        assert "optimizer" not in row["counts"]


@pytest.mark.parametrize("model", MODELS)
def test_counter_sees_dtensor_collectives(results: list[dict[str, Any]], model: str) -> None:
    """DTensor's functional collectives are counted too: the per-linear plan all-reduces the
    input gradient of every column-parallel linear, PrepareModuleInput once per module."""
    column_per_layer = 4 if model == "gpt2" else 5  # q, k, v + up (+ gate)
    for r in results:
        plain, prepared = r[f"{model}/dtensor"], r[f"{model}/dtensor-prepare"]
        meg = r[f"{model}/megatron"]
        layers = plain["n_layer"]
        assert plain["counts"]["backward"] == {"all_reduce": column_per_layer * layers + 1}
        assert prepared["counts"] == meg["counts"]
        assert prepared["bytes"] == meg["bytes"]


def test_probe_memory_counts_new_storages_only() -> None:
    kept = torch.zeros(1000)  # allocated before: not counted
    probe = StepProbe()
    with probe:
        a = torch.ones(256)  # 1024 B
        b = a * 2  # 1024 B
        view = b.view(16, 16)  # no new storage
        kept.add_(1)  # in place: nothing new
        del a  # 1024 B freed
        c = kept + 1  # 4000 B while b is alive
    assert probe.peak_bytes == 1024 + 4000
    assert probe.live_bytes == 1024 + 4000
    del b, view, c
    assert probe.live_bytes == 0


def autotp_probe_case(rank: int, world_size: int, sequence_parallel: bool) -> dict[str, Any]:
    """One autotp training step under the run-time probe: the c10d collectives that actually
    ran, next to what autotp's own log recorded."""
    from collections import Counter

    import autotp

    torch.set_num_threads(1)
    cfg = bm.make_config("llama", "tiny")
    model = bm.build_model(cfg, seed=0)
    idx, targets = bm.make_batch(cfg, 2, seed=1)
    sharded = autotp.parallelize(model, tp=world_size, example_args=(idx, targets),
                                 sequence_parallel=sequence_parallel)
    sharded(idx, targets).backward()  # the first call also checks the plan across ranks
    sharded.zero_grad(set_to_none=True)
    sharded.comm.log.clear()
    probe = StepProbe()
    with probe:
        loss = sharded(idx, targets)
        probe.phase = "backward"
        loss.backward()
    logged: dict[str, Counter] = {}
    for event in sharded.comm.log.events:
        logged.setdefault(event.phase, Counter())[event.kind] += 1
    return {"probe": probe.counts(),
            "log": {phase: dict(sorted(c.items())) for phase, c in sorted(logged.items())},
            "n_layer": cfg.n_layer}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_counter_sees_what_autotp_logs(sequence_parallel: bool) -> None:
    """The collectives autotp reports are the ones that run: with sequence parallelism each
    layer's 2 all-gathers and 2 reduce-scatters per direction are real reduce-scatters on
    gloo, not all-reduces labelled as such."""
    for r in run_processes(autotp_probe_case, 2, sequence_parallel, timeout=240):
        assert r["probe"] == r["log"], r
        forward = r["probe"]["forward"]
        if sequence_parallel:
            assert forward.get("reduce_scatter", 0) >= 2 * r["n_layer"], r
            assert forward.get("all_gather", 0) >= 2 * r["n_layer"], r
        else:
            assert forward.get("all_reduce", 0) >= 2 * r["n_layer"], r
