"""A plan exported as transformers' ``tp_plan`` and torch's ``parallelize_module`` styles
(``autotp.integrations.export``): compared with the known-good Megatron plan written by hand and
with transformers' own plan of LLaMA; what the styles cannot say (GPT-2's Conv1D, nanoGPT's
fused q|k|v, a vocabulary-parallel loss, sequence parallelism) listed, never exported half
right; and the exported styles run in two gloo processes (torch's parallelize_module, and
transformers' own apply_tensor_parallelism) against the unsharded model and
``autotp.parallelize`` (outputs and every gradient within 1e-5 relative)."""

from __future__ import annotations

import contextlib
import functools
import io
import json

import pytest
import torch

import autotp
from autotp.errors import ConfigError
from autotp.integrations.export import TpPlanExport, to_tp_plan
from autotp.integrations.styles import Kind, Placement
from autotp.planner.plan import Plan
from autotp.runtime.launch import run_processes
from tests.dist_cases import each_case, torch_styles_case
from tests.models import (BUILDERS, dit, dit_inputs, example, llama_config, qwen3_moe,
                    quiet_transformers)

RTOL = 1e-5  # outputs and gradients, relative to the unsharded model's largest entry

# Megatron-LM's plan of a LLaMA, by hand: q, k, v, gate and up column-parallel; o and down
# row-parallel; the embedding vocabulary-parallel; the head column-parallel, gathered
MEGATRON_LLAMA = {
    "lm_head": "colwise_gather_output",
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


@functools.lru_cache(maxsize=None)
def planned(name: str, **options: object) -> Plan:
    args, kwargs = example(name)
    if options.pop("labels", False):
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    return autotp.plan(BUILDERS[name](), 2, example_args=args, example_kwargs=kwargs,
                       **options)  # type: ignore[arg-type]


def test_llama_exports_the_megatron_plan() -> None:
    plan = planned("llama")
    export = plan.to_tp_plan()
    assert export.as_transformers() == MEGATRON_LLAMA
    assert export.not_expressible == {}
    # transformers' own plan of LLaMA (its config's, under "model.", and the head's) is in it
    tf = quiet_transformers()
    own = {f"model.{k}": v for k, v in tf.LlamaConfig.base_model_tp_plan.items()}
    own.update(tf.LlamaForCausalLM._tp_plan)
    assert own.items() <= export.as_transformers().items()
    # every layer listed by its own path; the same from a plan read back from JSON
    assert export.modules["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert len(export.modules) == 2 + 7 * llama_config().num_hidden_layers
    assert to_tp_plan(Plan.from_json(plan.to_json())) == export


def test_llama_as_torch_styles() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = planned("llama").to_tp_plan(style="torch").as_torch()
    q, o = styles["model.layers.0.self_attn.q_proj"], styles["model.layers.0.self_attn.o_proj"]
    head, table = styles["lm_head"], styles["model.embed_tokens"]
    assert isinstance(q, ColwiseParallel) and isinstance(head, ColwiseParallel)
    assert isinstance(o, RowwiseParallel) and isinstance(table, RowwiseParallel)
    assert q.input_layouts == (Replicate(),) and q.output_layouts == (Shard(-1),)
    assert o.input_layouts == (Shard(-1),) and o.output_layouts == (Replicate(),)
    assert head.output_layouts == (Replicate(),)  # the logits gathered, as the plan does
    assert table.input_layouts == (Replicate(),)  # token ids whole on every rank


def test_gpt2_conv1d_and_tied_weights_are_not_expressible() -> None:
    """GPT-2's Conv1D stores [in, out]: no style shards it. Its tied embedding and head are
    not exported either; the position table is, and alone it is exact."""
    from transformers.pytorch_utils import Conv1D

    export = planned("gpt2").to_tp_plan()
    conv1d = [f"{path}.weight" for path, m in BUILDERS["gpt2"]().named_modules()
              if isinstance(m, Conv1D)]
    assert len(conv1d) == 8
    for name in conv1d:
        assert "stored [in, out]" in export.not_expressible[name], name
    assert "tied to lm_head.weight" in export.not_expressible["transformer.wte.weight"]
    assert export.as_transformers() == {"transformer.wpe": "embedding_rowwise"}


def test_nanogpt_fused_qkv_takes_its_attention_out() -> None:
    """nanoGPT's c_attn is q|k|v fused (S(0)x3): not expressible, so neither is the c_proj
    that reads its heads (a rowwise style would read whole heads as slices); the MLP is."""
    export = planned("nanogpt").to_tp_plan(style="torch")
    assert "fused segments (S(0)x3)" in export.not_expressible["transformer.h.0.attn.c_attn.weight"]
    assert "shards together with transformer.h.1.attn.c_attn.weight" in \
        export.not_expressible["transformer.h.1.attn.c_proj.weight"]
    assert sorted(export.modules) == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                                      "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj",
                                      "transformer.wpe"]


def test_phi3_fused_gate_up_is_packed_colwise_for_transformers_only() -> None:
    """Phi-3's gate_up_proj is gate|up fused (S(0)x2): transformers' packed_colwise slices
    each half; torch has no such style. Its qkv_proj (S(0)x3) is not expressible, nor the
    o_proj that reads its heads."""
    tf = quiet_transformers()
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=0, bos_token_id=0))
    _, kwargs = example("llama")
    plan = autotp.plan(model, 2, example_kwargs=kwargs)
    export = plan.to_tp_plan()
    assert export.as_transformers() == {
        "lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.down_proj": "rowwise"}
    assert "fused segments (S(0)x3)" in export.not_expressible[
        "model.layers.0.self_attn.qkv_proj.weight"]
    assert "shards together with model.layers.1.self_attn.qkv_proj.weight" in \
        export.not_expressible["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(ConfigError, match=r"gate\|up"):
        export.as_torch()
    torch_export = plan.to_tp_plan(style="torch")
    assert "torch has no style" in torch_export.not_expressible[
        "model.layers.0.mlp.gate_up_proj.weight"]
    assert "model.layers.0.mlp.down_proj" not in torch_export.modules


def test_a_vocabulary_parallel_loss_keeps_the_head_out() -> None:
    export = planned("llama", labels=True).to_tp_plan()
    assert "lm_head.weight" in export.not_expressible
    assert any("makes a partial sum that no style sums" in why
               for why in export.not_expressible.values())
    assert export.as_transformers() == {k: v for k, v in MEGATRON_LLAMA.items() if k != "lm_head"}


def test_sequence_parallelism_is_not_expressible() -> None:
    export = planned("llama", sequence_parallel=True).to_tp_plan()
    assert export.modules == {} and list(export.not_expressible) == ["(sequence parallelism)"]


def test_replicated_with_partial_gradient_is_transformers_only() -> None:
    """Qwen3's q_norm/k_norm run on sharded heads: transformers sums their gradients
    (replicated_with_grad_allreduce), torch has no style for it; experts are not exported."""
    _, kwargs = example("llama")
    plan = autotp.plan(qwen3_moe(), 2, example_kwargs=kwargs)
    export = plan.to_tp_plan()
    said = export.as_transformers()
    assert said["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert said["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert "model.layers.*.mlp.gate" not in said  # its partial gradient comes from the experts
    assert "stacked expert weights" in export.not_expressible[
        "model.layers.0.mlp.experts.gate_up_proj"]
    with pytest.raises(ConfigError, match="style='torch'"):
        export.as_torch()
    torch_export = plan.to_tp_plan(style="torch")
    assert "never all-reduce" in torch_export.not_expressible[
        "model.layers.0.self_attn.q_norm.weight"]
    assert "model.layers.0.self_attn.q_proj" not in torch_export.modules


def test_a_pattern_must_hold_for_every_layer() -> None:
    """transformers' keys write each layer index as *: layers sharded differently have no
    transformers plan (the export for that style lists them as not expressible), nor do a
    module and another its pattern reaches (a Sequential's entries: ``net.*``)."""
    colwise = Placement(Kind.COLWISE)
    uneven = TpPlanExport("torch", {}, {}, {"m.layers.0.q": colwise},
                          ("m.layers.0.q", "m.layers.1.q"))
    with pytest.raises(ConfigError, match=r"m\.layers\.\*\.q"):
        uneven.as_transformers()
    even = TpPlanExport("torch", {}, {}, {"m.layers.0.q": colwise, "m.layers.1.q": colwise},
                        ("m.layers.0.q", "m.layers.1.q"))
    assert even.as_transformers() == {"m.layers.*.q": "colwise"}


def test_dit_list_entries_and_gradients_summed_by_colwise_inputs() -> None:
    """diffusers' DiT: attn1.to_out.0 and ff.net.2 are entries of a list and a Sequential,
    and transformers' keys write each index as *: ``ff.net.*`` also reaches net.0 (the
    activation holding the up projection), ``to_out.*`` the dropout beside the Linear; no
    transformers key says them, so they are left out with their regions (torch's keys are
    paths: listed there). The patch embedding's gradient is partial in the plan only because
    its sum is left to after backward: in eager the colwise q/k/v sum their inputs'
    gradients, so it is not listed (replicated_with_grad_allreduce would double it)."""
    plan = autotp.plan(dit().eval(), 2, example_kwargs=dit_inputs())
    export = plan.to_tp_plan()
    said = export.as_transformers()
    assert not any(".to_out." in k or ".ff.net." in k for k in said), said
    assert "one style to every layer" in export.not_expressible[
        "transformer_blocks.0.ff.net.2.weight"]
    assert "transformers' key transformer_blocks.*.attn1.to_out.* reaches every entry" in \
        export.not_expressible["transformer_blocks.1.attn1.to_out.0.weight"]
    torch_export = plan.to_tp_plan(style="torch")
    assert torch_export.modules["transformer_blocks.0.ff.net.2"].startswith("RowwiseParallel")
    assert torch_export.modules["transformer_blocks.1.attn1.to_out.0"].startswith(
        "RowwiseParallel")
    assert torch_export.modules["transformer_blocks.1.attn1.to_q"].startswith(
        "ColwiseParallel")
    assert plan.params["pos_embed.proj.weight"].grad_sync
    for e in (export, torch_export):
        assert "pos_embed.proj" not in e.modules and "pos_embed.proj.weight" not in \
            e.not_expressible


def test_an_unknown_style_says_which_exist() -> None:
    with pytest.raises(ConfigError, match="transformers, torch"):
        planned("llama").to_tp_plan(style="megatron")


def test_exported_styles_match_unsharded_and_autotp_in_gloo_processes() -> None:
    """LLaMA (everything exported) and nanoGPT (its attention left replicated) on 2 gloo
    processes: torch's parallelize_module with the exported styles, and for LLaMA
    transformers' apply_tensor_parallelism with the exported tp_plan, against the unsharded
    model and against autotp.parallelize, forward and backward."""
    names = ["llama", "nanogpt"]
    per_rank = run_processes(each_case, 2, torch_styles_case, [(n,) for n in names],
                             timeout=300)
    for rank, results in enumerate(per_rank):
        for name, r in zip(names, results):
            runs = ["torch", "transformers"] if name == "llama" else ["torch"]
            for run in runs:
                for against in ("unsharded", "autotp"):
                    got = r[f"{run} vs {against}"]
                    assert got["output_rel"] <= RTOL, (name, rank, run, against, got)
                    assert got["grad_rel"] <= RTOL, (name, rank, run, against, got)
            assert r["sharded"] == {"llama": 16, "nanogpt": 9}[name], (name, r["sharded"])


def cli(*args: str) -> str:
    """``autotp ARGS -q`` through the command line's entry point: its stdout."""
    from autotp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.random.fork_rng():
        assert main([*args, "-q"]) == 0
    return out.getvalue()


SMALL_LLAMA = ["hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
               "--set", "intermediate_size=160", "--set", "num_attention_heads=8",
               "--set", "num_key_value_heads=2", "--set", "vocab_size=128"]


def test_cli_prints_the_tp_plan_and_writes_it(tmp_path) -> None:
    text = cli("plan", *SMALL_LLAMA, "--tp", "2", "--format", "tp-plan")
    data = json.loads(text)
    assert data["schema"] == "autotp.tp_plan/1" and data["style"] == "transformers"
    assert data["tp_plan"] == MEGATRON_LLAMA and data["not_expressible"] == {}
    target = tmp_path / "tp_plan.json"
    assert cli("plan", *SMALL_LLAMA, "--tp", "2", "--format", "tp-plan", "-o",
               str(target)) == ""
    assert target.read_text() == text
