"""Pipeline stages (autotp.pipeline_stages) on (pp, tp), (dp, pp, tp) and (tp, pp) meshes,
against the unsharded model.

4 gloo processes, pp2 x tp2, 4 microbatches, AdamW: Schedule1F1B with one stage per rank on
transformers' LLaMA; ScheduleInterleaved1F1B with two stages per rank and
ScheduleZBVZeroBubble (split backward) with two placed as a V on GPT-2, whose embedding and
head are one tied parameter read by the first and last stages: on two pp ranks, or on one
with the V. The loss of each of three steps equals the unsharded model's on the whole batch
within 1e-5 (the later steps check the optimizer step), and every local gradient of every
step equals the matching slice of the unsharded gradient (within ``FIRST_STEP``, then
``LATER_STEPS``): the tied gradients are summed at every step, not once.
"""

from __future__ import annotations

import pytest

from tests import dist_cases
from autotp.errors import ConfigError
from autotp.runtime.launch import run_processes
from autotp.integrations.cut import _balanced

# gradients relative to each unsharded gradient's largest |value|. After an AdamW step the
# weights differ from the unsharded model's by rounding that AdamW magnifies where a gradient
# is near zero (its update is about ±lr whatever the gradient's size): measured <= 1e-6 on the
# first step, <= 5e-4 on the next two
FIRST_STEP = 1e-5
LATER_STEPS = 3e-3


def test_pipeline_matches_the_unsharded_model() -> None:
    results = run_processes(dist_cases.pipeline_case, 4, ["llama", "gpt2"], timeout=600)
    for rank, result in enumerate(results):
        assert set(result) == {"llama-1f1b", "gpt2-interleaved", "gpt2-zbv"}, result
        for case, got in result.items():
            assert len(got["losses"]) == len(got["reference"]) == 3, (case, got)
            for loss, want in zip(got["losses"], got["reference"]):
                assert abs(loss - want) < 1e-5, (case, rank, got)
            _check_grads(got["grad_diffs"], tied=case == "gpt2-interleaved" or
                         (case == "gpt2-zbv" and rank < 2))
            _check_norms(got["norm_diffs"])
            # a quarter of the weights per rank (half the layers, half of each), plus the
            # replicated norms and the embedding or head of the end stages
            assert got["stage_params"] < 0.3 * got["full_params"], (case, rank, got)


def test_v_placement_is_torchs() -> None:
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    from autotp.integrations.pipeline import _rank_of

    for pp in range(1, 5):
        want = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert {s: _rank_of(s, pp, "v") for s in range(2 * pp)} == want
        want = generate_stage_to_rank_mapping(pp, 3 * pp, style="loop")
        assert {s: _rank_of(s, pp, "loop") for s in range(3 * pp)} == want


def test_bad_placement_is_a_clear_error() -> None:
    import torch

    import autotp

    class Mesh:
        mesh_dim_names = ("pp", "tp")

    with pytest.raises(ConfigError, match="placement must be 'loop' or 'v'"):
        autotp.pipeline_stages(torch.nn.Linear(2, 2), Mesh(), stages_per_rank=3,
                               placement="v")


def test_zero_bubble_with_fsdp_inside_a_stage_is_refused() -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from autotp.integrations.pipeline import _refuse_nested_fsdp

    layer = torch.nn.Linear(2, 2)
    stage = torch.nn.Sequential(layer)
    _refuse_nested_fsdp(stage)  # nothing sharded inside: fine
    # fully_shard swaps the layer's class for one deriving from FSDPModule, as here
    layer.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    with pytest.raises(ConfigError, match="fully_shard only each stage's submod"):
        _refuse_nested_fsdp(stage)


def test_balanced_split() -> None:
    assert _balanced([1.0] * 8, 4) == [0, 2, 4, 6]
    # heavy ends (embedding, head) take fewer layers
    assert _balanced([3.0, 1.0, 1.0, 1.0, 1.0, 3.0], 2) == [0, 3]
    assert _balanced([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1]


def test_needs_a_pp_and_tp_mesh() -> None:
    import torch

    import autotp

    with pytest.raises(ConfigError, match="'pp' and 'tp'"):
        autotp.pipeline_stages(torch.nn.Linear(2, 2), object())


def test_pipeline_with_fsdp_on_a_3d_mesh() -> None:
    """8 processes, dp2 x pp2 x tp2 with "pp" the middle mesh dim (GPT-2, tied embedding),
    FSDP2 per layer and per stage, Interleaved1F1B: the losses of three AdamW steps equal
    the unsharded model's on the whole batch within 1e-5, and every gradient of every step
    gathered over dp equals the unsharded slice (the tied embedding's too, summed over the
    pp ranks on FSDP2's shards; summed over "dp" or "tp" instead, where a mesh read as
    pp-first puts them, it is off by O(1))."""
    results = run_processes(dist_cases.pipeline_3d_case, 8, timeout=600)
    for rank, got in enumerate(results):
        assert got["fsdp"], (rank, got)
        assert len(got["losses"]) == len(got["reference"]) == 3, (rank, got)
        for loss, want in zip(got["losses"], got["reference"]):
            assert abs(loss - want) < 1e-5, (rank, got)
        _check_grads(got["grad_diffs"], tied=True)
        _check_norms(got["norm_diffs"])


def test_stages_read_only_their_weights(tmp_path) -> None:
    """A model built without weights (autotp.empty_weights) and checkpoint=: each rank reads
    the slices of its own stages' parameters, each once, and no other; training matches the
    unsharded model (tp2 x pp2 on a ("tp", "pp") mesh, GPT-2 with its tied embedding and
    head, ZBVZeroBubble: both ends on the first pp rank, ranks 0 and 2; 2 AdamW steps,
    losses within 1e-5)."""
    dist_cases.tiny_gpt2().save_pretrained(tmp_path)
    results = run_processes(dist_cases.pipeline_checkpoint_case, 4, str(tmp_path), timeout=600)
    for rank, got in enumerate(results):
        assert not got["meta"], rank
        assert len(got["read"]) == len(set(got["read"])), (rank, got["read"])
        assert set(got["read"]) == set(got["held"]), (rank, got["read"], got["held"])
        # the tied embedding: read once, held by stages 0 and 3 on pp rank 0, by none on 1
        assert (got["held"].count("transformer.wte.weight") == 2) == (rank % 2 == 0), \
            got["held"]
        assert len(got["losses"]) == len(got["reference"]) == 2, (rank, got)
        for loss, want in zip(got["losses"], got["reference"]):
            assert abs(loss - want) < 1e-5, (rank, got)


def _check_grads(diffs: list[dict[str, float]], tied: bool) -> None:
    """Every step's gradients against the unsharded model's, relative to each gradient's
    largest |value|: within ``FIRST_STEP`` on the first step, ``LATER_STEPS`` on the later
    ones. A tied gradient not summed over the pp ranks, summed over another mesh dim, or
    summed on the first step only is off by O(1); ``tied``: this rank holds one."""
    assert len(diffs) == 3 and all(("tied" in d) == tied for d in diffs), (tied, diffs)
    for step, diff in enumerate(diffs):
        assert max(diff.values()) < (FIRST_STEP if step == 0 else LATER_STEPS), (step, diffs)


def _check_norms(diffs: list[dict[str, float]]) -> None:
    """``autotp.clip_grad_norm_`` over the stages against the unsharded model's gradient
    norm (2 and infinity), relative, with the gradients' own tolerances: a norm not summed
    over the pp ranks, or counting a tied parameter's copies twice, is off by O(1)."""
    assert len(diffs) == 3, diffs
    for step, diff in enumerate(diffs):
        assert max(diff.values()) < (FIRST_STEP if step == 0 else LATER_STEPS), (step, diffs)
