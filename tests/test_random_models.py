"""Property-based equivalence on random small transformers (hypothesis).

Configurations are drawn from the generic model of tests/generic.py (1 to 3 layers, head counts
and sizes, grouped key/value heads including fewer than tp, GELU / ReLU / SwiGLU MLPs, LayerNorm
/ RMSNorm, pre- and post-norm, biases, tied embeddings, fused or separate q/k/v, learned or
rotary positions, decoder or encoder, SDPA or hand-written attention, a norm over the whole q
and k projections, residuals added in place, a top-k mixture of experts as a loop over expert
MLPs or as stacked expert weights) and from transformers' GPT-2, LLaMA and BERT configs. For
each, at tp in {2, 4} in simulation, either autotp refuses with an AutotpError before running,
or the sharded model gives the unsharded model's logits, loss and every parameter's gradient on
an input of another batch and sequence size (3, 7) than the traced example (2, 8). Any other
exception fails.

The same property holds with sequence parallelism (sequence length 12). CI runs 18 + 12 + 12
examples (derandomized: the same ones every run); benchmarks/random_models.py runs hundreds.
Tolerances (fp32) and the relative gradient measure: tests/generic.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.generic import (
    GenericConfig,
    HFConfig,
    check_equivalence,
    describe,
    generic_configs,
    hf_configs,
)

# What autotp leaves replicated it reports as a UserWarning per model: noise across 50 models.
pytestmark = pytest.mark.filterwarnings("ignore:autotp:UserWarning")

GENERIC_EXAMPLES = 18  # benchmarks/random_models.py --examples N runs more
HF_EXAMPLES = 12
SEQUENCE_PARALLEL_EXAMPLES = 12

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

TPS = st.sampled_from([2, 4])


def _assert_matches(config, tp: int, *, allow_refusal: bool = True,
                    min_sharded: float = 0.0, sequence_parallel: bool = False) -> None:
    outcome = check_equivalence(config, tp, sequence_parallel=sequence_parallel)
    if allow_refusal:  # inside a property: pytest --hypothesis-show-statistics counts them
        event("ran" if outcome.refused is None else
              "refused: " + outcome.refused.splitlines()[0][:80])
    if outcome.refused is not None:
        assert allow_refusal, f"tp={tp} {describe(config)} was refused:\n{outcome.refused}"
        return
    assert outcome.ok, (
        f"tp={tp} {describe(config)}\n"
        f"logits differ by {outcome.output_diff:.3e}, loss by {outcome.loss_diff:.3e}, "
        f"gradients by {outcome.grad_diff:.3e} ({outcome.grad_rel:.3e} relative, worst "
        f"{outcome.worst_param})")
    assert outcome.sharded >= min_sharded, (
        f"tp={tp} {describe(config)}: the plan shards only {outcome.sharded:.0%} of the "
        f"parameters")


@settings(max_examples=GENERIC_EXAMPLES, **SETTINGS)
@given(config=generic_configs(), tp=TPS)
def test_generic_models_match_or_refuse(config: GenericConfig, tp: int) -> None:
    _assert_matches(config, tp)


@settings(max_examples=HF_EXAMPLES, **SETTINGS)
@given(config=hf_configs(), tp=TPS)
def test_transformers_models_match_or_refuse(config: HFConfig, tp: int) -> None:
    _assert_matches(config, tp)


@settings(max_examples=SEQUENCE_PARALLEL_EXAMPLES, **SETTINGS)
@given(config=st.one_of(generic_configs(), hf_configs()), tp=TPS)
def test_sequence_parallel_models_match_or_refuse(config: GenericConfig | HFConfig,
                                                   tp: int) -> None:
    _assert_matches(config, tp, sequence_parallel=True)


# The properties hold vacuously if everything is refused (or replicated): these configurations
# must be accepted, shard most of their parameters and match.
MUST_SHARD = [
    pytest.param(GenericConfig(n_layer=2, d_model=32, n_head=8, n_kv_head=1, d_ff=96,
                               mlp="swiglu", norm="rms", bias=False, tied=False, fused_qkv=True,
                               vocab=100, rope=True, use_sdpa=False), 4,
                 id="generic-mqa-kv1-tp4-fused-swiglu-rms-rope-dff3d"),
    pytest.param(GenericConfig(n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=96,
                               mlp="gelu", norm="layer", prenorm=False, bias=True, tied=True,
                               fused_qkv=False, vocab=64, causal=False), 4,
                 id="generic-gqa-kv2-tp4-postnorm-encoder-bias-tied"),
    pytest.param(GenericConfig(n_layer=1, d_model=64, n_head=8, n_kv_head=8, d_ff=128,
                               mlp="relu", norm="layer", bias=True, tied=True), 2,
                 id="generic-mha-relu-tp2"),
    # a mixture of experts whose expert weights must be sharded, whatever the derandomized
    # examples above draw
    pytest.param(GenericConfig(n_layer=2, d_model=32, n_head=8, n_kv_head=2, d_ff=64,
                               mlp="swiglu", norm="rms", bias=False, tied=False, fused_qkv=True,
                               vocab=100, rope=True, qk_norm=True, inplace_residual=True,
                               moe="stacked", n_expert=4, top_k=2, expert_product="einsum"), 4,
                 id="generic-moe-stacked-einsum-top2-qknorm-inplace-tp4"),
    pytest.param(HFConfig("llama", (("num_hidden_layers", 2), ("hidden_size", 32),
                                    ("num_attention_heads", 8), ("num_key_value_heads", 2),
                                    ("intermediate_size", 96), ("vocab_size", 100),
                                    ("max_position_embeddings", 32),
                                    ("tie_word_embeddings", False), ("attention_bias", True),
                                    ("mlp_bias", True))), 4,
                 id="llama-gqa-kv2-tp4-biases"),
    pytest.param(HFConfig("gpt2", (("n_layer", 2), ("n_embd", 32), ("n_head", 4),
                                   ("vocab_size", 96), ("n_positions", 32),
                                   ("resid_pdrop", 0.0), ("embd_pdrop", 0.0),
                                   ("attn_pdrop", 0.0))), 4,
                 id="gpt2-tied-tp4"),
    pytest.param(HFConfig("bert", (("num_hidden_layers", 2), ("hidden_size", 32),
                                   ("num_attention_heads", 4), ("intermediate_size", 64),
                                   ("vocab_size", 64), ("max_position_embeddings", 32),
                                   ("hidden_dropout_prob", 0.0),
                                   ("attention_probs_dropout_prob", 0.0))), 2,
                 id="bert-tp2"),
]


@pytest.mark.parametrize("config, tp", MUST_SHARD)
def test_drawn_configuration_classes_really_shard(config, tp: int) -> None:
    _assert_matches(config, tp, allow_refusal=False, min_sharded=0.5)
