"""Loading, saving and resuming without the whole model on any rank (gloo processes).

Tolerances: logits, loss and gradients of a model loaded at tp = 2, 4 against transformers'
own unsharded load of the same directory <= 1e-5 abs (fp32); loaded weights, saved files and
init=True weights bitwise equal; losses after resuming at another tp <= 1e-5 from
uninterrupted unsharded training; trained weights and AdamW moments (in checkpoints and
exports) <= 1e-3 of each tensor's largest |value| from it: AdamW divides by sqrt(v), which
magnifies fp32 reduction-order differences where a gradient is near zero (measured <= 5e-5),
while a misplaced slice or a lost optimizer state is off by O(1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import ckpt_cases as cc
from autotp.verification.verify import max_difference
from autotp.runtime.launch import run_processes

ATOL = 1e-5
STATE_RTOL = 1e-3  # trained weights and AdamW state, relative to each tensor's max |value|


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
    """Each rank asks the files for exactly its parameters' bytes: slices, never a sharded
    tensor whole (Phi-3's q|k|v with 4 k/v heads: a 2:1:1 slice of each part; GPTBigCode's
    multi-query q|k|v: a slice of q and the whole k/v head; Qwen3-MoE's experts at tp = 2,
    stored one tensor per expert and part, stacked: only the experts the rank owns)."""
    names = ["gpt2", "llama", "phi3", "phi3_gqa", "bigcode"] + (["qwen3_moe"] if tp == 2 else [])
    for per_rank in run_processes(cc.load_cases, tp, [saved[n] for n in names], timeout=360):
        for name, r in zip(names, per_rank):
            assert r["weights"] == 0.0, (name, r)
            assert r["logits"] <= ATOL and r["loss"] <= ATOL and r["grad"] <= ATOL, (name, r)
            assert r["local_params"] < r["full_params"], (name, r)
            assert r["bytes_read"] == r["param_bytes"], (name, r)
        gqa = per_rank[names.index("phi3_gqa")]
        assert gqa["qkv_layout"] == "S(0)x2:1:1", gqa
        assert gqa["qkv_read"] * tp == gqa["qkv_bytes"], gqa
        mqa = per_rank[names.index("bigcode")]
        assert mqa["mqa_layout"] == "S(0)x8:1*:1*", mqa


def test_from_pretrained_passes_options_through(saved: dict[str, str]) -> None:
    """sequence_parallel=True reaches the plan; the loaded model still matches."""
    for r in run_processes(cc.load_case, 2, saved["gpt2"], "float32", True, timeout=240):
        assert r["weights"] == 0.0 and r["sequence_parallel"], r
        assert r["logits"] <= ATOL and r["loss"] <= ATOL and r["grad"] <= ATOL, r


@pytest.mark.parametrize("name", ["gpt2", "qwen3_moe"])
def test_save_pretrained_loads_bitwise_in_transformers(saved: dict[str, str],
                                                       tmp_path: Path, name: str) -> None:
    """Written in the layout of the checkpoint it was loaded from (Qwen3-MoE's experts one
    tensor per expert and part, as transformers wrote them), which transformers loads."""
    run_processes(cc.save_case, 2, saved[name], str(tmp_path), timeout=240)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    tf = cc._tf()
    original = tf.AutoModelForCausalLM.from_pretrained(saved[name]).state_dict()
    again = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    assert original.keys() == again.keys()
    for key, value in original.items():
        assert torch.equal(value, again[key]), key


def expert_save_case(rank: int, world_size: int, source: str, target: str, ep: int
                     ) -> dict[str, Any]:
    """from_pretrained at tp = world_size / ep with the experts split over ep ranks too, then
    save_pretrained as loaded, stacked, and per expert under transformers' own keys (a module
    with no record of its checkpoint's); the experts each rank holds."""
    import autotp

    torch.set_num_threads(1)
    sharded = autotp.from_pretrained(source, tp=world_size // ep, ep=ep)
    held = {t: tuple(p.shape) for t, p in sharded.expert_parameters().items()}
    autotp.save_pretrained(sharded, f"{target}/loaded", max_shard_size="30KB")
    autotp.save_pretrained(sharded, f"{target}/model", layout="model")
    sharded.checkpoint_experts = {}
    autotp.save_pretrained(sharded, f"{target}/derived", layout="checkpoint")
    return held


def _stored(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in Path(directory).glob("*.safetensors") for k, v in load_file(f).items()}


def test_save_pretrained_writes_experts_as_the_checkpoint_stored_them(saved: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """Qwen3-MoE loaded with its 4 experts split over 2 expert-parallel ranks (tp 1, ep 2:
    2 whole experts each) from transformers' files, one tensor per expert and part, and
    saved (gathered over the ep ranks, one writer): by default the source's keys, each tensor
    bitwise equal (gate and up split out of gate|up, each expert out of the stack); with
    layout="model" the stacked tensors the model holds; with layout="checkpoint" and no
    record of the source's keys, transformers' own per-expert keys again. transformers
    loads each to the source's weights."""
    source = saved["qwen3_moe"]
    held = run_processes(expert_save_case, 2, source, str(tmp_path), 2, timeout=240)
    for rank_held in held:
        assert rank_held and all(shape[0] == 2 for shape in rank_held.values()), rank_held
    original = _stored(source)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert expert in original and "model.layers.1.mlp.experts.gate_up_proj" not in original
    tf = cc._tf()
    weights = tf.AutoModelForCausalLM.from_pretrained(source).state_dict()
    for kind in ("loaded", "model", "derived"):
        stored = _stored(tmp_path / kind)
        if kind == "model":
            assert stored.keys() == weights.keys()
        else:
            assert stored.keys() == original.keys(), (kind, stored.keys() ^ original.keys())
            for key, value in original.items():
                assert torch.equal(stored[key], value), (kind, key)
        again = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / kind)).state_dict()
        assert again.keys() == weights.keys()
        for key, value in weights.items():
            assert torch.equal(value, again[key]), (kind, key)


RESUMES = {  # tp of each stage, AdamW steps per stage
    "llama": ((4, 2, 1), 2),  # k/v replicated at tp=4, sharded at tp=2
    # q|k|v S(0)x2:1:1 at tp=2: stored whole, read whole at tp=1 (the tp=4 slices of a
    # checkpoint are read by test_from_pretrained_matches_transformers)
    "phi3_gqa": ((2, 1, 1), 1),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_at_another_tp_follows_uninterrupted_training(saved: dict[str, str],
                                                             tmp_path: Path,
                                                             name: str) -> None:
    """save_checkpoint (with AdamW's state) after the first stage's steps, load at the
    second stage's tp, train, save, load at tp=1, train, save: the losses are those of
    uninterrupted unsharded training, and so are the weights and AdamW state in the
    checkpoints (whatever each holds whole). The first stage's save_pretrained loads in
    transformers with its trained weights."""
    tps, steps = RESUMES[name]
    source = saved[name]
    reference = cc.Reference(source)
    a, b, c, export = (str(tmp_path / x) for x in ("a", "b", "c", "export"))
    first = run_processes(cc.resume_case, tps[0], source, None, a, 0, steps, export,
                          timeout=240)
    assert first[0]["export_names"] and first[0]["export"] == 0.0, first[0]
    got = first[0]["losses"]
    losses = reference.train(steps)
    after_first = reference.state()
    exported = cc._tf().AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert exported.keys() == {k[len("model."):] for k in after_first if
                               k.startswith("model.")}
    diffs = {"export": _max_diff(exported, after_first, "model.")}
    whole = cc.stored_whole(a)
    if name == "phi3_gqa":  # q|k|v saved whole, with its AdamW moments, and compared
        assert _qkv_layout(a) == "S(0)x2:1:1", _qkv_layout(a)
        assert {f"model.{cc.QKV}", f"optim.{cc.QKV}.exp_avg",
                f"optim.{cc.QKV}.exp_avg_sq"} <= whole.keys()
    diffs["first checkpoint"] = _max_diff(whole, after_first)
    assert diffs["export"] <= STATE_RTOL and diffs["first checkpoint"] <= STATE_RTOL, diffs
    got += run_processes(cc.resume_case, tps[1], source, a, b, steps, steps,
                         timeout=240)[0]["losses"]
    if name == "phi3_gqa" and tps[1] > 1:  # loaded whole and sliced 2:1:1
        assert _qkv_layout(b) == "S(0)x2:1:1", _qkv_layout(b)
    got += run_processes(cc.resume_case, tps[2], source, b, c, 2 * steps, steps,
                         timeout=240)[0]["losses"]
    losses += reference.train(2 * steps)
    assert len(list(Path(a).glob("shard-*.safetensors"))) == tps[0]  # every rank wrote
    assert max(abs(x - y) for x, y in zip(got, losses)) <= ATOL, (got, losses)
    final, whole = reference.state(), cc.stored_whole(c)
    assert tps[2] == 1 and whole.keys() == final.keys()  # tp=1: every tensor whole
    diffs["losses"] = max(abs(x - y) for x, y in zip(got, losses))
    diffs["last checkpoint"] = _max_diff(whole, final)
    assert diffs["last checkpoint"] <= STATE_RTOL, diffs


def test_resume_moves_experts_between_ep_and_tp(saved: dict[str, str],
                                                tmp_path: Path) -> None:
    """Qwen3-MoE trained 2 AdamW steps at tp 1 x ep 2 (2 of the 4 experts per rank, each
    rank on half of every batch, data-parallel) and saved, then resumed at tp 2 x ep 1 for a
    step and saved, resumed at tp 1 x ep 2 for a step: the losses and the final weights are
    those of the same 4 steps at tp 1 x ep 2 without a break (an expert loaded into another
    rank's share, or its AdamW moments, is off by O(1)). (The unsharded model trained on the
    whole batches is not the reference here: one embedding element's gradient cancels to
    ~1e-8 in the second step, and AdamW turns its rounding into a 1e-3 step.)"""
    from safetensors.torch import load_file

    source = saved["qwen3_moe"]
    a, b, straight, resumed = (str(tmp_path / x) for x in ("a", "b", "straight", "resumed"))
    losses = run_processes(cc.expert_resume_case, 2, source, [(1, 2, None, 2, a)], straight,
                           2, timeout=240)[0]
    got = run_processes(cc.expert_resume_case, 2, source, [(2, 1, a, 1, b), (1, 2, b, 1, None)],
                        resumed, timeout=240)[0]
    assert max(abs(x - y) for x, y in zip(got, losses[2:])) <= ATOL, (got, losses)
    weights = _max_diff(load_file(resumed), load_file(straight))
    assert weights <= STATE_RTOL, weights


def test_resume_upward_fills_each_ranks_slices(saved: dict[str, str],
                                               tmp_path: Path) -> None:
    """Phi-3 with as many k/v heads as query heads (q|k|v and gate|up fused in equal
    segments: S(0)x3 and S(0)x2 at tp > 1) trained 2 steps at tp=1 with AdamW settings
    that are not the defaults (two param groups: matrices, and vectors at another lr
    without weight decay) and an lr halved every step, saved, resumed at tp=2 for one
    step, saved, resumed at tp=4 for one step. After each load, before any step, every
    parameter, AdamW moment and step count a rank holds equals its slice of the unsharded
    model trained the same steps (a slice read from the wrong segment, a moment left at
    zero, a rank given another's piece: O(1) off), and each param group holds its saved lr,
    betas and weight decay, not those of the fresh AdamW (lr 1e-2, betas (0.9, 0.999),
    weight decay 0.01) built to load them. The losses are the unsharded model's."""
    from safetensors.torch import save_file

    source = saved["phi3"]
    reference = cc.Reference(source, cc.SETTINGS, cc.param_groups)
    lr_schedule = cc.schedule(reference.optimizer)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    got = run_processes(cc.upward_case, 1, source, None, a, 0, 2, None,
                        timeout=240)[0]["losses"]
    losses = reference.train(2, lr_schedule)
    settings = [{"lr": pytest.approx(cc.LR * cc.DECAY ** 2), "betas": (0.8, 0.95),
                 "weight_decay": 0.1},
                {"lr": pytest.approx(cc.VECTORS["lr"] * cc.DECAY ** 2), "betas": (0.8, 0.95),
                 "weight_decay": 0.0}]
    assert [{k: g[k] for k in settings[0]} for g in reference.optimizer.param_groups] == \
        settings
    for tp, load, save in ((2, a, b), (4, b, None)):
        expected = str(tmp_path / f"expected-{tp}.safetensors")
        save_file(reference.state(), expected)
        results = run_processes(cc.upward_case, tp, source, load, save, reference.done, 1,
                                expected, timeout=240)
        for rank, r in enumerate(results):
            assert r["layouts"][cc.QKV] == "S(0)x3" and r["layouts"][cc.GATE_UP] == "S(0)x2", \
                r["layouts"]
            assert r["groups"] == settings, (tp, rank, r["groups"])
            worst = max(r["slices"], key=r["slices"].get)
            assert r["slices"][worst] <= STATE_RTOL, (tp, rank, worst, r["slices"][worst])
            assert {f"optim.{cc.QKV}.exp_avg", f"optim.{cc.QKV}.exp_avg_sq",
                    f"optim.{cc.QKV}.step"} <= r["slices"].keys()
        got += results[0]["losses"]
        losses += reference.train(1)
    assert max(abs(x - y) for x, y in zip(got, losses)) <= ATOL, (got, losses)


def test_blocks_held_whole_move_between_tp(saved: dict[str, str], tmp_path: Path) -> None:
    """GPTBigCode's multi-query c_attn (S(0)x8:1*:1*: q sliced, the k/v head whole on every
    rank) saved at tp=4, loaded at tp=2 and saved, loaded at tp=1 and saved: the weights of
    the source, exactly. (Trained weights are not compared, as for the models above: the k
    bias's gradient is zero up to rounding, softmax being shift invariant, and AdamW scales
    that rounding up to the learning rate in either implementation.)"""
    source = saved["bigcode"]
    a, b, c = (str(tmp_path / x) for x in ("a", "b", "c"))
    run_processes(cc.resume_case, 4, source, None, a, 0, 0, timeout=240)
    assert json.loads((Path(a) / "autotp.json").read_text())["params"][cc.MQA]["layout"] == \
        "S(0)x8:1*:1*"
    run_processes(cc.resume_case, 2, source, a, b, 0, 0, timeout=240)
    run_processes(cc.resume_case, 1, source, b, c, 0, 0, timeout=240)
    original = cc.Reference(source).state()
    whole = cc.stored_whole(c)
    assert {k for k in whole if k.startswith("model.")} == set(original)
    for key, value in original.items():
        assert torch.equal(whole[key], value), key


def _qkv_layout(checkpoint: str) -> str:
    return json.loads((Path(checkpoint) / "autotp.json").read_text())["params"][cc.QKV]["layout"]


def _max_diff(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
              prefix: str = "") -> float:
    """Largest difference relative to the reference tensor's own scale (max |value|), over
    every tensor: weights and AdamW moments (exp_avg_sq ~ grad^2) alike."""
    return max_difference({key: reference[prefix + key] for key in tensors}, tensors,
                          relative=True)


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


def test_generate_follows_the_checkpoints_generation_config(tmp_path: Path) -> None:
    """A checkpoint's generation_config.json (3 new tokens, a pad token, no eos) is what
    generate() uses after from_pretrained, with no length given in the call."""
    import transformers as tf

    directory = str(tmp_path / "gpt2")
    cc.save_hf("gpt2", directory)
    config = tf.GenerationConfig(max_new_tokens=3, pad_token_id=0, eos_token_id=None,
                                 bos_token_id=None)
    config.save_pretrained(directory)
    for result in run_processes(cc.generation_config_case, 2, directory, timeout=240):
        assert result["sharded"] == result["reference"]
        assert len(result["sharded"][0]) == 5 + 3
