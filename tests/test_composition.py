"""The sharded model as torch.distributed's tools see it: its layers under their original
names, each with its own parameters and collectives; FSDP2 over a data-parallel mesh axis
and activation checkpointing applied per layer, trained against the unsharded model."""

from __future__ import annotations

from autotp.verification.verify import max_difference
from autotp.runtime.launch import run_processes
from tests.dist_cases import fsdp_case


def test_fsdp2_per_layer_on_a_2d_mesh() -> None:
    """4 gloo processes, dp2 x tp2, FSDP2 per layer and at the root, with and without each
    layer wrapped in activation checkpointing first; one k/v head (whole k/v projections:
    their partial gradients are summed at each use when FSDP2 holds the parameters). The
    first step's gradients (FSDP2's mean over dp) within 1e-5 of the unsharded model's on
    the whole batch; over 3 AdamW steps (lr 1e-3) after clipping to half the model's
    gradient norm (``autotp.clip_grad_norm_``: the norm within 1e-5 relative of the
    unsharded model's), the dp-mean loss within 1e-5 and the parameters within 1e-4 (Adam's
    normalized update magnifies round-off where a gradient is ~0)."""
    for rank, per_variant in enumerate(run_processes(fsdp_case, 4, timeout=300)):
        for checkpointing, r in per_variant.items():
            where = (rank, checkpointing, r)
            assert r["grad_diff"] < 1e-5, where
            assert r["norm_diff"] < 1e-5, where
            assert r["loss_diff"] < 1e-5, where
            assert r["param_diff"] < 1e-4, where
            assert r["names"], where
            wrapper = "FSDPCheckpointWrapper" if checkpointing else "FSDPLayer"
            assert all(n.startswith(wrapper) for n in r["fsdp_layers"]), where


def _llama(kv_heads: int = 2):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=96, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def test_layers_keep_their_names_parameters_and_collectives() -> None:
    from torch import nn

    import autotp
    from autotp.runtime.collectives import Redistribute

    sim = autotp.simulate(_llama(), 2)
    for m in sim.ranks:
        layers = m.model.layers
        assert isinstance(layers, nn.ModuleList) and len(layers) == 2
        assert m.get_submodule("model.layers.1") is layers[1]
        names = {n for n, _ in m.named_parameters()}
        assert names == set(m.plan.params)  # the model's names, as before the split
        for i, layer in enumerate(layers):
            prefix = f"model.layers.{i}."
            own = {n for n, _ in layer.named_parameters()}
            assert own == {t[len(prefix):] for t in m.plan.params if t.startswith(prefix)}
            moved = [mod for mod in layer.modules() if isinstance(mod, Redistribute)]
            assert moved and all(mod.layer == i for mod in moved), moved
        outside = [mod for mod in m.program.children() if isinstance(mod, Redistribute)]
        assert all(mod.layer is None for mod in outside), outside


def test_activation_checkpointing_per_layer() -> None:
    """checkpoint_wrapper around each layer: loss and every gradient as without it (the
    layer's collectives run again in the recomputation), within 1e-6."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import autotp

    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    sim = autotp.simulate(_llama(kv_heads=1).train(), 2,
                          example_kwargs={"input_ids": ids, "labels": ids})

    def step(m):
        m.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in m.named_parameters()}

    plain = sim.run(step)

    def wrap(m):
        for i, layer in enumerate(m.model.layers):
            m.model.layers[i] = checkpoint_wrapper(layer)

    sim.run(wrap)
    wrapped = sim.run(step)
    for (loss, grads), (loss_ac, grads_ac) in zip(plain, wrapped):
        assert abs(loss - loss_ac) < 1e-6
        renamed = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads_ac.items()}
        assert renamed.keys() == grads.keys()
        assert max_difference(grads, renamed) < 1e-6
