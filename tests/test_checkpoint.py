"""Loading, saving and resuming without the whole model on any rank (gloo processes).

Tolerances: logits, loss and gradients of a model loaded at tp = 2, 4 against transformers'
own unsharded load of the same directory <= 1e-5 abs (fp32); loaded weights, saved files and
init=True weights bitwise equal; losses after resuming at another tp <= 1e-5 from
uninterrupted unsharded training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_cases as cc
from autotp.launch import run_processes

ATOL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """gpt2, llama and phi3 saved by transformers in several files each."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in cc.BUILDERS:
        cc.save_hf(name, str(root / name))
        assert len(list((root / name).glob("*.safetensors"))) > 3
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_from_pretrained_matches_transformers(saved: dict[str, str], tp: int) -> None:
    names = ["gpt2", "llama", "phi3"]
    for per_rank in run_processes(cc.load_cases, tp, [saved[n] for n in names], timeout=360):
        for name, r in zip(names, per_rank):
            assert r["weights"] == 0.0, (name, r)
            assert r["logits"] <= ATOL and r["loss"] <= ATOL and r["grad"] <= ATOL, (name, r)
            assert r["local_params"] < r["full_params"], (name, r)


def test_from_pretrained_passes_options_through(saved: dict[str, str]) -> None:
    """sequence_parallel=True reaches the plan; the loaded model still matches."""
    for r in run_processes(cc.load_case, 2, saved["gpt2"], "float32", True, timeout=240):
        assert r["weights"] == 0.0 and r["sequence_parallel"], r
        assert r["logits"] <= ATOL and r["loss"] <= ATOL and r["grad"] <= ATOL, r


def test_save_pretrained_loads_bitwise_in_transformers(saved: dict[str, str],
                                                       tmp_path: Path) -> None:
    run_processes(cc.save_case, 2, saved["gpt2"], str(tmp_path), timeout=240)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    tf = cc._tf()
    original = tf.AutoModelForCausalLM.from_pretrained(saved["gpt2"]).state_dict()
    again = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert original.keys() == again.keys()
    for key, value in original.items():
        assert torch.equal(value, again[key]), key


def test_resume_at_another_tp_follows_uninterrupted_training(saved: dict[str, str],
                                                             tmp_path: Path) -> None:
    """save_checkpoint at tp=4 after 2 AdamW steps, load at tp=2, 2 steps, save, load at
    tp=1, 2 steps: the losses are those of 6 uninterrupted unsharded steps."""
    source = saved["llama"]  # k/v replicated at tp=4, sharded at tp=2
    reference = cc.reference_losses(source, 6)
    a, b, c = (str(tmp_path / x) for x in "abc")
    got = run_processes(cc.resume_case, 4, source, None, a, 0, 2, timeout=240)[0]
    got += run_processes(cc.resume_case, 2, source, a, b, 2, 2, timeout=240)[0]
    got += run_processes(cc.resume_case, 1, source, b, c, 4, 2, timeout=240)[0]
    assert len(list(Path(a).glob("shard-*.safetensors"))) == 4  # every rank wrote its shards
    assert max(abs(x - y) for x, y in zip(got, reference)) <= ATOL, (got, reference)


@pytest.mark.parametrize("kind", ["tiny", "gpt2"])
def test_init_equals_the_unsharded_initialization(kind: str) -> None:
    for r in run_processes(cc.init_case, 2, kind, timeout=240):
        assert r["params"] == 0.0 and r["output"] <= ATOL, r


def test_bad_inputs_are_clear_errors(saved: dict[str, str], tmp_path: Path) -> None:
    messages = run_processes(cc.error_case, 1, saved["llama"], str(tmp_path), timeout=240)[0]
    expected = {
        "no such path": "is not a directory",
        "pickled weights": "never loads pickled weights",
        "bin file": "is not a .safetensors file",
        "meta without weights": "pass checkpoint=PATH",
        "missing key": "no tensor for 'model.layers.1.mlp.down_proj.weight'",
        "unexpected key": "'model.layers.1.mlp.extra.weight'",
        "wrong shape": "'model.layers.0.mlp.up_proj.weight'",
        "truncated file": "truncated",
        "not a checkpoint": "not an autotp checkpoint",
        "another model's checkpoint": "another model",
    }
    for label, text in expected.items():
        assert messages[label].startswith("AutotpError") and text in messages[label], \
            (label, messages[label])


def test_loading_reads_slices_not_the_whole_model(tmp_path: Path) -> None:
    """A rank reads exactly the bytes of its parameters (column slices of row-parallel
    weights included), and its peak resident memory stays below its share plus a fixed
    slack, and below the whole model (which the naive load holds)."""
    cc.save_big(str(tmp_path))
    full = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    for r in run_processes(cc.memory_case, 2, str(tmp_path), timeout=240):
        assert r["bytes_read"] == r["param_bytes"], (r, full)
        assert r["growth"] <= 1.15 * r["local_bytes"] + cc.MEMORY_SLACK, (r, full)
        assert r["growth"] < full, (r, full)  # the naive load holds at least the whole model
