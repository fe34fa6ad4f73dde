"""Other libraries' own model code, sharded in simulation, against the unsharded model.

Each model is small (hidden 64, 2 layers) and every weight is moved off its initial value by
noise of 0.02 (``perturb``), so zero-initialised biases and LoRA's B are not zero. The same
weights and inputs go through the unsharded model and through every rank at tp 2 and 4
(``assert_equivalent``, fp32): the output and the loss within 1e-5, every parameter's gradient
within 1e-5 of its largest entry (at least 1% of the model's largest gradient: one that is
zero in exact arithmetic, an attention key's bias, is rounding noise only), and one SGD step
taken on both: the next output and loss within 1e-5, every parameter within 1e-5.

Skipped without the library (they are in the ``test`` extra). Left out: timm (its torchvision
has no CPU wheel for torch 2.13 here; the CUDA one fails to load and breaks ``import
transformers``) and torchtitan (its model code imports triton, which CPU torch lacks).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import autotp
from autotp.verification.verify import assert_equivalent, perturb
from tests.models import dit, dit_inputs, x_transformers_decoder

TOL = 1e-5


def check_exact(model: nn.Module, kwargs: dict[str, Any], tp: int,
                loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> autotp.Simulation:
    """``model`` at ``tp`` against the unsharded model (``assert_equivalent``): its main
    output, the loss (``loss_fn``, by default the mean square of that output), every
    gradient and one SGD step."""
    sim = autotp.simulate(model, tp, example_kwargs=kwargs)
    assert_equivalent(model, sim, kwargs=kwargs, loss_fn=loss_fn, atol=TOL, grad_rtol=TOL)
    return sim


# x-transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_x_transformers_decoder_with_rotary(tp: int) -> None:
    model = x_transformers_decoder()
    tokens = torch.randint(0, 128, (2, 16))
    sim = check_exact(model, {"x": tokens}, tp)
    at_megatrons_bound(sim.plan)


def at_megatrons_bound(plan: autotp.Plan) -> None:
    """x-transformers' layers are [norm, block, residual] entries, one per attention or
    feedforward block: Megatron's one all-reduce each way per block, nothing replicated
    (the rotary embedding runs in an autocast region, planned op by op)."""
    assert plan.fallbacks == []
    per_layer = {k: dict(v) for k, v in plan.per_layer().items() if k is not None}
    assert per_layer and all(counts == {("forward", "all_reduce"): 1,
                                        ("backward", "all_reduce"): 1}
                             for counts in per_layer.values()), per_layer


@pytest.mark.parametrize("tp", [2, 4])
def test_x_transformers_encoder_takes_context_through_kwargs(tp: int) -> None:
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = perturb(xt.TransformerWrapper(
        num_tokens=128, max_seq_len=32,
        attn_layers=xt.Encoder(dim=64, depth=2, heads=4, cross_attend=True)))
    kwargs = {"x": torch.randint(0, 128, (2, 16)), "context": torch.randn(2, 8, 64)}
    sim = check_exact(model, kwargs, tp)
    at_megatrons_bound(sim.plan)


# peft ----------------------------------------------------------------------------------------


def lora_llama(targets: tuple[str, ...] = ("q_proj", "v_proj")) -> nn.Module:
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, target_modules=list(targets))
    return perturb(peft.get_peft_model(LlamaForCausalLM(config), lora))


def lm_inputs() -> dict[str, Any]:
    tokens = torch.randint(0, 128, (2, 16))
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}


@pytest.mark.parametrize("tp", [2, 4])
def test_peft_lora_llama_called_with_inputs(tp: int) -> None:
    model = lora_llama()
    # PeftModel.forward has no use_cache argument (it passes **kwargs on to the LLaMA): autotp
    # turns the cache off for the trace as it does for a transformers model
    kwargs = lm_inputs()
    sim = check_exact(model, kwargs, tp, lambda out: out.loss)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained)
    layouts = sim.plan.params
    assert layouts["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
                   ].layout == "S(0)"
    # the adapters cost no collective of their own: lora_A (4 x 64) stays whole, and the
    # frozen k/v projections, whole because tp = 4 exceeds the 2 k/v heads, are Megatron's
    # choice, not fallbacks
    assert all(p.layout == "R" for name, p in layouts.items() if ".lora_A." in name)
    assert sim.plan.fallbacks == []
    for layer, counts in sim.plan.per_layer().items():
        if layer is not None:
            assert sum(n for (phase, _), n in counts.items() if phase == "forward") == 2, counts


@pytest.mark.parametrize("tp", [2, 4])
def test_peft_lora_on_every_linear_costs_no_collective(tp: int) -> None:
    """Adapters on all seven linears outnumber the model's own matrices: they are still
    narrow (the typical width is that of the matrix holding the median parameter), so they
    stay where they cost nothing, at Megatron's 2 + 2 per layer."""
    model = lora_llama(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"))
    sim = check_exact(model, lm_inputs(), tp, lambda out: out.loss)
    for layer, counts in sim.plan.per_layer().items():
        if layer is not None:  # at tp 4 a k/v slice's gradient may be gathered, not summed
            assert {kind: n for (phase, kind), n in counts.items() if phase == "forward"} == \
                {"all_reduce": 2}, counts
            assert sum(n for (phase, _), n in counts.items() if phase == "backward") <= 2, \
                counts


def test_peft_lora_llama_traces_without_its_cache() -> None:
    plan = autotp.plan(lora_llama(), 2, example_kwargs=lm_inputs())
    assert plan.outputs and not plan.states  # no cache among the inputs or the outputs


# diffusers -----------------------------------------------------------------------------------


def tiny_dit() -> nn.Module:
    pytest.importorskip("diffusers")
    return dit()


@pytest.mark.parametrize("tp", [2, 4])
def test_diffusers_dit(tp: int) -> None:
    model = tiny_dit().eval()  # eval: no random class-label dropout
    check_exact(model, dit_inputs(), tp)


def test_diffusers_dit_training_label_dropout_is_refused_clearly() -> None:
    # In training DiT drops class labels at random (torch.rand): strict mode names the op
    # and diffusers' line rather than computing it replicated unasked
    model = tiny_dit().train()
    with pytest.raises(autotp.errors.NoRuleError) as refused:
        autotp.plan(model, 2, example_kwargs=dit_inputs())
    assert "aten.rand.default" in str(refused.value)
    assert "embeddings.py" in str(refused.value) and "token_drop" in str(refused.value)


@pytest.mark.parametrize("tp", [2, 4])
def test_diffusers_sd3_joint_blocks_at_megatrons_count(tp: int) -> None:
    """SD3's joint attention (image and text streams, one attention) with adaLN modulation
    from the pooled timestep embedding. Block 0 (both streams' attention outputs and MLPs)
    at 2 all-reduces forward: each pair of the streams' outputs is one all-reduce
    (planner/coalesce.py), against Megatron's 4 for two streams; the last block
    (context_pre_only: the text stream only feeds k/v) at 2, and its modulation, unlike
    block 0's program, is joined with the others in the one gather before the blocks."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = perturb(diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8)).eval()
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8),
              "encoder_hidden_states": torch.randn(2, 6, 32),
              "pooled_projections": torch.randn(2, 32), "timestep": torch.tensor([3.0, 7.0]),
              "return_dict": False}
    sim = check_exact(model, inputs, tp)
    per = {k: dict(v) for k, v in sim.plan.per_layer().items() if k is not None}
    assert per[0].get(("forward", "all_reduce")) == 2 and len(per[0]) == 2, per
    joined = [c for c in sim.plan.collectives if c.layer == 0 and c.phase == "forward"]
    assert all(len(c.members) == 2 for c in joined), joined
    assert per[1].get(("forward", "all_reduce")) == 2 and len(per[1]) == 2, per
    assert all(n <= 4 for counts in per.values() for (phase, _), n in counts.items()
               if phase == "backward"), per


def test_diffusers_flux_double_and_single_stream_blocks_at_megatrons_count() -> None:
    """Flux: double-stream blocks (joint attention, as SD3's) at 2 all-reduces forward (each
    pair of the streams' outputs joined, planner/coalesce.py) and at most 4 backward;
    single-stream blocks run attention and MLP in parallel and concatenate them (h and 4h)
    before one output projection, which is row-parallel over the concatenation's blocks in
    proportion 1:4: one all-reduce each way. Exact at tp 2."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = perturb(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))).eval()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                     indexing="ij"), -1).reshape(-1, 3)
    inputs = {"hidden_states": torch.randn(2, 16, 16), "encoder_hidden_states":
              torch.randn(2, 6, 32), "pooled_projections": torch.randn(2, 32),
              "timestep": torch.tensor([0.3, 0.7]), "img_ids": ids,
              "txt_ids": torch.zeros(6, 3), "return_dict": False}
    sim = check_exact(model, inputs, 2)
    per_block: dict[tuple[str, str], int] = {}
    for c in sim.plan.collectives:
        block = re.match(r"^(\w+\.\d+)", c.module or "")
        if c.layer is not None and block:
            key = (block.group(1), c.phase)
            per_block[key] = per_block.get(key, 0) + 1
    for block in ("transformer_blocks.0", "transformer_blocks.1"):
        assert per_block[(block, "forward")] == 2 and per_block[(block, "backward")] <= 4
    for block in ("single_transformer_blocks.0", "single_transformer_blocks.1"):
        assert per_block[(block, "forward")] == 1 and per_block[(block, "backward")] == 1
    layouts = sim.plan.params
    assert layouts["single_transformer_blocks.0.proj_out.weight"].layout.startswith("S(1)x1:4")


@pytest.mark.parametrize("tp", [2, 4])
def test_diffusers_pixart_with_a_dict_of_none(tp: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = perturb(diffusers.PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=64,
        caption_channels=32, norm_num_groups=32))
    kwargs = {"hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([3, 7]),
              "encoder_hidden_states": torch.randn(2, 6, 32),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
              "return_dict": False}
    check_exact(model, kwargs, tp)
