"""Small models with random weights for the equivalence tests (importable by worker processes).

Every builder takes ``tp`` only to pick head counts that the degree divides; the weights come
from a fixed seed, so every process builds the same model. The libraries initialise biases to
zero and norm scales to one, under which a bias added on every rank or a norm scale sliced
wrong cannot show: every builder perturbs them (``VECTOR_NOISE``), from the same seed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autotp.verification.verify import main_output, perturb

VOCAB = 128


# biases += N(0, 0.05), other 1-D parameters (norm scales) += N(0, 0.1); matrices and
# embeddings are random already. With ``seed=10_000 + seed``: deterministic in the seed and the
# parameter order, so every process builds the same model.
VECTOR_NOISE: dict[str, float] = {"std": 0.0, "bias_std": 0.05, "norm_std": 0.1}


def quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2_config(**overrides: Any) -> Any:
    """The test GPT-2's config (tied embedding and head, Conv1D weights, fused q|k|v), with
    ``overrides``."""
    return quiet_transformers().GPT2Config(**{
        "n_layer": 2, "n_embd": 64, "n_head": 8, "vocab_size": VOCAB, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
        "eos_token_id": 0, **overrides})


def llama_config(**overrides: Any) -> Any:
    """The test LLaMA's config (GQA: 8 query heads, 2 key/value heads), with ``overrides``."""
    return quiet_transformers().LlamaConfig(**{
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 160,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 64, **overrides})


def gpt2(seed: int = 0) -> torch.nn.Module:
    tf = quiet_transformers()
    torch.manual_seed(seed)
    return perturb(tf.GPT2LMHeadModel(gpt2_config()), seed=10_000 + seed, **VECTOR_NOISE)


def llama(seed: int = 0) -> torch.nn.Module:
    """GQA: 8 query heads, 2 key/value heads (fewer than tp at tp = 4 and 8)."""
    tf = quiet_transformers()
    torch.manual_seed(seed)
    return perturb(tf.LlamaForCausalLM(llama_config()), seed=10_000 + seed, **VECTOR_NOISE)


def bert(seed: int = 0) -> torch.nn.Module:
    tf = quiet_transformers()
    torch.manual_seed(seed)
    config = tf.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                           num_attention_heads=8, vocab_size=VOCAB, max_position_embeddings=64,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return perturb(tf.BertModel(config), seed=10_000 + seed, **VECTOR_NOISE)


def nanogpt(seed: int = 0) -> torch.nn.Module:
    from examples import nanogpt as nano

    torch.manual_seed(seed)
    model = nano.GPT(nano.GPTConfig(n_layer=2, n_head=8, n_embd=64, vocab_size=VOCAB,
                                    block_size=64, dropout=0.0))
    return perturb(model, seed=10_000 + seed, **VECTOR_NOISE)


def mistral_window(seed: int = 0) -> torch.nn.Module:
    """A sliding window of 5 tokens (transformers builds the windowed causal mask), GQA."""
    tf = quiet_transformers()
    torch.manual_seed(seed)
    config = tf.MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=64, sliding_window=5)
    return perturb(tf.MistralForCausalLM(config), seed=10_000 + seed, **VECTOR_NOISE)


def x_transformers_decoder(seed: int = 0) -> torch.nn.Module:
    """x-transformers' decoder (rotary, attention as einsums and a softmax), perturbed: a
    model from another codebase (skips where x-transformers is not installed)."""
    import pytest

    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(seed)
    return perturb(xt.TransformerWrapper(
        num_tokens=128, max_seq_len=32,
        attn_layers=xt.Decoder(dim=64, depth=2, heads=4, rotary_pos_emb=True)))


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "nanogpt": nanogpt,
    "mistral_window": mistral_window,
    "x_transformers": x_transformers_decoder,
}


def example(name: str) -> tuple[tuple, dict]:
    """The example the model is traced with (positional args, keyword args)."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    if name == "nanogpt":
        return (ids,), {}
    return (), {"input_ids": ids}


def batch(seed: int = 2, b: int = 3, t: int = 11) -> torch.Tensor:
    """Inputs of another batch size and sequence length than the example."""
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def loss_of(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """A scalar that touches every output: next-token cross-entropy for LMs, a regression of
    the hidden states for encoders."""
    x = main_output(out)
    if x.shape[-1] == VOCAB:
        return torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
    pooled = out.pooler_output if hasattr(out, "pooler_output") else 0.0
    return x.pow(2).mean() + (pooled.pow(2).mean() if torch.is_tensor(pooled) else 0.0)


# ---- a mixture of experts: tests/test_experts.py, test_render.py, test_clipping.py --------


def qwen3_moe(top_k: int = 2, experts: int = 4) -> torch.nn.Module:
    """transformers' Qwen3-MoE, small: 2 layers of 4 heads of 16, each with one block of
    ``experts`` experts (gate_up_proj and down_proj stacked), ``top_k`` per token; every
    weight perturbed (0.02), in eval mode."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    return perturb(transformers.Qwen3MoeForCausalLM(config).eval())


# ---- diffusers' DiT: tests/test_peers.py and benchmarks/peers.py ---------------------------


def dit(seed: int = 0) -> torch.nn.Module:
    """diffusers' DiT, small: 2 blocks of 4 heads of 16, 8 x 8 latents of 4 channels in 2 x 2
    patches, 10 classes, every weight perturbed (0.02). As built it is in train mode, where it
    drops class labels at random."""
    import diffusers

    torch.manual_seed(seed)
    return perturb(diffusers.DiTTransformer2DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
        norm_num_groups=32))


def dit_inputs() -> dict[str, Any]:
    """A batch of 2 for ``dit()``: latents, timesteps, class labels."""
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    return {"hidden_states": latents, "timestep": torch.tensor([3, 7]),
            "class_labels": torch.tensor([1, 4]), "return_dict": False}
