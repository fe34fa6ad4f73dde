"""Small models with random weights for the equivalence tests (importable by worker processes).

Every builder takes ``tp`` only to pick head counts that the degree divides; the weights come
from a fixed seed, so every process builds the same model. The libraries initialise biases to
zero and norm scales to one, under which a bias added on every rank or a norm scale sliced
wrong cannot show: every builder perturbs them (``randomize_vectors``), from the same seed.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

VOCAB = 128


def randomize_vectors(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Biases += N(0, 0.05), other 1-D parameters (norm scales) += N(0, 0.1): deterministic in
    ``seed`` and the parameter order, so every process builds the same model."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1:
                continue  # matrices and embeddings are random already
            std = 0.05 if name.endswith("bias") else 0.1
            param.add_(std * torch.randn(param.shape, generator=generator).to(param.dtype))
    return model


def _quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(seed: int = 0) -> torch.nn.Module:
    tf = _quiet_transformers()
    torch.manual_seed(seed)
    config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=8, vocab_size=VOCAB, n_positions=64,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=0, eos_token_id=0)
    return randomize_vectors(tf.GPT2LMHeadModel(config), seed)


def llama(seed: int = 0) -> torch.nn.Module:
    """GQA: 8 query heads, 2 key/value heads (fewer than tp at tp = 4 and 8)."""
    tf = _quiet_transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160,
                            num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
                            max_position_embeddings=64)
    return randomize_vectors(tf.LlamaForCausalLM(config), seed)


def bert(seed: int = 0) -> torch.nn.Module:
    tf = _quiet_transformers()
    torch.manual_seed(seed)
    config = tf.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                           num_attention_heads=8, vocab_size=VOCAB, max_position_embeddings=64,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return randomize_vectors(tf.BertModel(config), seed)


def nanogpt(seed: int = 0) -> torch.nn.Module:
    import nanogpt as nano

    torch.manual_seed(seed)
    model = nano.GPT(nano.GPTConfig(n_layer=2, n_head=8, n_embd=64, vocab_size=VOCAB,
                                    block_size=64, dropout=0.0))
    return randomize_vectors(model, seed)


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "nanogpt": nanogpt,
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


def main_output(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0]
    if hasattr(out, "logits"):
        return out.logits
    return out.last_hidden_state


def loss_of(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """A scalar that touches every output: next-token cross-entropy for LMs, a regression of
    the hidden states for encoders."""
    x = main_output(out)
    if x.shape[-1] == VOCAB:
        return torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
    pooled = out.pooler_output if hasattr(out, "pooler_output") else 0.0
    return x.pow(2).mean() + (pooled.pow(2).mean() if torch.is_tensor(pooled) else 0.0)
