"""Real multi-process runs: tp = 2 and 4 gloo processes on CPU, each calling
``autotp.parallelize`` on the same model, compared with the unsharded model in-process.

Tolerances as in test_equivalence: outputs and loss <= 1e-4 abs; gradients <= 1e-4 abs and
<= 1e-4 relative to the parameter's largest gradient entry.
"""

from __future__ import annotations

import pytest
import torch

from autotp.runtime.launch import run_processes
from tests.dist_cases import each_case, equivalence_case, reduce_scatter_case

ATOL = 1e-4


MODELS = ["gpt2", "llama", "bert", "nanogpt"]


@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_processes_match_unsharded(tp: int) -> None:
    """Every model, one after the other in the same tp processes."""
    per_rank = run_processes(each_case, tp, equivalence_case, [(n,) for n in MODELS],
                             timeout=300)
    for rank, results in enumerate(per_rank):
        for name, r in zip(MODELS, results):
            assert r["output_diff"] <= ATOL, (name, rank, r)
            assert r["loss_diff"] <= ATOL, (name, rank, r)
            assert r["grad_diff"] <= ATOL and r["grad_rel"] <= ATOL, (name, rank, r)
            for layer in (0, 1):
                assert r["counts"][layer] == {"forward": 2, "backward": 2}, \
                    (name, rank, r["counts"])
            assert r["local_params"] < r["full_params"], (name, rank, r)


def test_gloo_loss_computed_by_the_model() -> None:
    """HF computes the loss from labels= inside forward: the traced loss matches too."""
    names = ["gpt2", "llama"]
    for results in run_processes(each_case, 2, equivalence_case,
                                 [(n, True) for n in names], timeout=240):
        for name, r in zip(names, results):
            assert r["loss_diff"] <= ATOL and r["output_diff"] <= ATOL, (name, r)
            assert r["grad_diff"] <= ATOL and r["grad_rel"] <= ATOL, (name, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gloo_processes_with_cuda_tensors(name: str) -> None:
    """gloo takes CUDA tensors: two ranks sharing one GPU (NCCL refuses that)."""
    for r in run_processes(equivalence_case, 2, name, False, "cuda", timeout=240):
        assert r["output_diff"] <= ATOL and r["loss_diff"] <= ATOL, r
        assert r["grad_diff"] <= ATOL and r["grad_rel"] <= ATOL, r
        for layer in (0, 1):
            assert r["counts"][layer] == {"forward": 2, "backward": 2}, r["counts"]


@pytest.mark.parametrize("native", [True, False])
def test_gloo_reduce_scatter_leaves_its_input_alone(native: bool) -> None:
    """gloo reduce-scatters natively; without it (older gloo) it is an all-reduce and a slice,
    and the all-reduce works in place: on a contiguous dim-0 input it must work on a copy
    (another reader may hold the value)."""
    for r in run_processes(reduce_scatter_case, 2, native, timeout=120):
        assert r == {"result_ok": True, "input_kept": True, "gather_ok": True}, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_single_collectives() -> None:
    """NCCL's reduce_scatter/all_gather *_single path (one rank per GPU: as many ranks as
    GPUs, at most 2)."""
    world = min(2, torch.cuda.device_count())
    for r in run_processes(reduce_scatter_case, world, True, "cuda", backend="nccl",
                           timeout=120):
        assert r == {"result_ok": True, "input_kept": True, "gather_ok": True}, r
