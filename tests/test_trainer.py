"""transformers' Trainer on an autotp model, in gloo processes, against Trainer on the
unsharded model (tests/trainer_cases.py); and the wrappers refused over tensor-parallel
peers.

Trainer runs with its defaults but for the CPU, seed, batch size, learning rate, four steps,
logging every step, no saving and no reporting: gradient clipping (max_grad_norm 1.0, above
the gradients' norm here, so it clips) and the loss scaled by the tokens counted over the
data-parallel ranks included. Tolerances: each logged loss, gradient norm and the
evaluation loss within 1e-5 relative; each final weight tensor within 1e-4 relative in norm
(AdamW's normalised steps turn float32 rounding of near-zero gradients into steps of the
learning rate's size on single entries, so entry-wise comparisons would measure that)."""

from __future__ import annotations

import os

import torch

from autotp.runtime.launch import free_port, run_processes
from tests import trainer_cases as cases

RTOL_NUMBERS = 1e-5
RTOL_WEIGHTS = 1e-4


def _run(fn, world: int, *args):  # type: ignore[no-untyped-def]
    os.environ["MASTER_PORT"] = str(free_port())
    return run_processes(fn, world, *args, timeout=300)


def _same_training(got: dict, want: dict, clipped: bool = True) -> None:
    numbers = torch.tensor(got["numbers"])
    expected = torch.tensor(want["numbers"])
    assert len(numbers) == 2 * cases.STEPS + 1
    assert ((numbers - expected).abs() <= RTOL_NUMBERS * expected.abs()).all(), \
        (got["numbers"], want["numbers"])
    if clipped:
        assert expected[cases.STEPS:2 * cases.STEPS].min() > 1.0  # the steps were clipped
    for name, values in want["weights"].items():
        w, ref = torch.tensor(got["weights"][name]), torch.tensor(values)
        assert (w - ref).norm() <= RTOL_WEIGHTS * ref.norm(), name


def test_trainer_at_tp_2_trains_as_the_unsharded_model() -> None:
    reference = _run(cases.reference_case, 1)[0]
    for result in _run(cases.sharded_case, 2, 2):
        _same_training(result, reference)
        assert result["names"] == result["model_names"]


def test_trainer_at_dp_2_x_tp_2_trains_as_ddp_over_2_ranks() -> None:
    reference = _run(cases.reference_case, 2)[0]
    for result in _run(cases.sharded_case, 4, 2):
        _same_training(result, reference)


def test_trainer_accumulating_gradients_at_dp_2_x_tp_2() -> None:
    """Two batches a step: the data-parallel mean after each backward is linear, so the
    accumulated gradients are DDP's."""
    reference = _run(cases.reference_case, 2, 2)[0]
    for result in _run(cases.sharded_case, 4, 2, 2):
        _same_training(result, reference, clipped=False)


def test_trainer_on_a_model_of_no_library() -> None:
    """A plain nn.Module returning a dict with the loss: Trainer reads the parallel sizes
    from the config the module gives it."""
    reference = _run(cases.plain_case, 1, 0)[0]
    for result in _run(cases.plain_case, 2, 2):
        _same_training(result, reference)


def test_ddp_over_tensor_parallel_peers_is_refused() -> None:
    for message in _run(cases.ddp_over_peers_case, 2):
        assert message.startswith("DistributedDataParallel over ranks [0, 1]"), message
        assert "tensor-parallel peers" in message and "mesh['dp']" in message


def test_fsdp_over_tensor_parallel_peers_is_refused() -> None:
    for message in _run(cases.fsdp_over_peers_case, 2):
        assert message.startswith("FSDP (fully_shard) over ranks [0, 1]"), message


def test_ddp_over_the_data_parallel_ranks_trains_as_the_unsharded_model() -> None:
    for difference in _run(cases.ddp_over_dp_case, 4):
        assert difference <= 1e-5


def test_the_documented_trainer_example_runs() -> None:
    """examples/train_trainer.py as docs/training.md launches it (torchrun, 2 processes)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(root / "examples" / "train_trainer.py"),
         "--tp", "2", "--steps", "2"],
        capture_output=True, text=True, timeout=300, cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: loss" in done.stdout and "evaluation loss" in done.stdout, done.stdout
