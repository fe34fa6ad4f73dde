"""benchmarks/gpu_step.py, the one-GPU check, on its CPU path (``--dry-run``): every part
prints its lines and rows with the estimator's figures beside the measured ones, a spent
budget skips with a line, and the host-sync check names the line that read a value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_prints_every_part_and_writes_its_rows(tmp_path: Path) -> None:
    """Ring beside SDPA with no host read per rank; the three sync cases clean on the CPU;
    the six step rows timed beside the estimate, which needs less memory per GPU at tp 2."""
    out = tmp_path / "gpu_step.jsonl"  # $OUT's, the device runner's folder
    env = {**os.environ, "AUTOTP_GPU_CHECK_DRY": "1", "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "FAILED" not in text and "skipped" not in text, text
    for part in gpu_step.PARTS:
        assert f"{part}: done in" in text, (part, text)
    for case, _ in gpu_step.SYNC_CASES:
        assert f"  {case:<10} ok: no host sync" in text, (case, text)
    for impl, tp, how in gpu_step.STEP_ROWS:
        assert any(row.split()[:3] == [impl, str(tp), how.value]
                   for row in text.splitlines()), \
            (impl, tp, how, text)

    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["part"] for r in rows] == ["ring"] + ["syncs"] * 3 + ["step"] * 6
    ring = rows[0]
    assert ring["syncs"] == "0/0" and ring["sdpa_ms"] > 0 and ring["pred_sdpa_ms"] > 0
    assert all(r["first_sync"] is None for r in rows[1:4])
    steps = rows[4:]
    assert all(r["step_ms"] > 0 and r["pred_ms"] > 0 for r in steps)
    pred = {r["tp"]: r["pred_mib"] for r in steps}
    assert pred[2] < pred[1]
    assert all(r["pred_x_mib"] == pytest.approx(r["pred_mib"] * r["ranks"]) for r in steps)


def test_a_spent_budget_skips_every_part_with_a_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert gpu_step.main(["--dry-run", "--budget-scale", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert sorted(r["part"] for r in rows) == sorted(["ring", "step", "syncs", "syncs",
                                                      "syncs"])
    assert all("skipped" in r for r in rows), rows
    assert text.count("skipped, 0 of the part's 0 s left") == len(rows), text


def test_the_first_host_sync_is_named_by_its_source_line() -> None:
    x = torch.ones(3)
    with pytest.raises(gpu_step.HostSyncError) as caught:
        with gpu_step.RaiseOnHostSync():
            y = x * 2
            if y.sum() > 0:  # reads the sum on the host
                pass
    where = gpu_step.where(caught.value)
    assert "tests/test_gpu_step.py:" in where
    assert "if y.sum() > 0" in where


class _ReadsOnTheHost(torch.nn.Module):
    """The model, after a branch on a value of its input (a host sync on a device)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> object:
        if inputs["input_ids"].min() >= 0:
            return self.model(**inputs)
        raise AssertionError("token ids are never negative")


def test_a_step_that_reads_a_value_fails_at_that_line(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The syncs part's step reports the branch as the first host sync, the warm-up step
    (outside the check) having run through it."""
    build = gpu_step.build_model
    monkeypatch.setattr(gpu_step, "build_model",
                        lambda sizes, device="cpu": _ReadsOnTheHost(build(sizes, device)))
    run = gpu_step.make_run(True, str(tmp_path / "rows.jsonl"))
    row = gpu_step.synced_step(run, "unsharded", {})
    assert row["first_sync"] is not None
    assert "tests/test_gpu_step.py:" in row["first_sync"], row
    assert 'if inputs["input_ids"].min() >= 0' in row["first_sync"], row
