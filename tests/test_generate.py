"""generate() and cached forward calls on the sharded model, against the unsharded model.

Token sequences must be equal (greedy, seeded sampling, beam search) on a left-padded batch of
prompts of different lengths; logits of a cached forward agree within 1e-5; the cache holds
this rank's k/v heads only; a decode step runs Megatron's two all-reduces per layer, one for
the vocabulary-parallel embedding and one all-gather of the last position's logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import autotp
from autotp.verification.verify import max_difference
from tests import gen_cases as gc
from autotp.errors import ConfigError
from autotp.integrations.generate import cache_argument, decoder_of
from autotp.runtime.launch import run_processes

LAYERS = 2


def _check(name: str, result: dict, tp: int, rank: int, config) -> None:
    assert result["sampled"], f"{name}: seeded sampling differs from the unsharded model"
    assert result["greedy"], f"{name}: greedy decoding differs from the unsharded model"
    assert result["prefill_diff"] < 1e-5 and result["logits_diff"] < 1e-5, result
    assert result["cache_bytes"] == gc.kv_bound(config, tp, rank, 3, result["cache_length"])
    events = result["step_events"]
    for layer in range(LAYERS):
        assert events.count(("all_reduce", layer)) == 2, (name, events)
    outside = [kind for kind, layer in events if layer is None]
    assert sorted(outside) == ["all_gather", "all_reduce"], (name, events)
    assert len(events) == 2 * LAYERS + 2, (name, events)


@pytest.mark.parametrize(("tp", "names"), [(2, ["gpt2", "llama", "qwen2"]), (4, ["llama"])])
def test_generate_in_processes(tp: int, names: list[str]) -> None:
    """gloo processes: GPT-2 (tied, learned positions), LLaMA with 2 k/v heads (at tp=4 the
    k/v projections are whole, and each rank's cache keeps the one k/v head its query heads
    read), Qwen2 (q/k/v biases). At tp=2 the group is
    given as a 1-D DeviceMesh."""
    results = run_processes(gc.generate_case, tp, names, tp == 2, timeout=300)
    for name in names:
        config = gc.BUILDERS[name]().config
        for rank, result in enumerate(results):
            _check(name, result[name], tp, rank, config)
            assert result[name]["tokens"] == results[0][name]["tokens"], (name, rank)


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "bigcode", "bloom"])
def test_greedy_at_tp4(name: str) -> None:
    """Simulated ranks (threads share torch's random stream, so sampling is checked in the
    processes above): greedy decoding and a cached step at tp=4. GPTBigCode: multi-query
    attention fused with q (c_attn S(0)x8:1*:1*), its one k/v head cached whole on every
    rank. Bloom: heads sharded inside the merged batch x heads dim (S(0)%8), in the prompt's
    program and in the decode step's."""
    reference = gc.model(name)
    sim = autotp.simulate(gc.model(name), 4)
    ids, mask = gc.prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=gc.NEW_TOKENS, pad_token_id=0)
    want = reference.generate(ids, do_sample=False, **kwargs)
    for got in sim.run(lambda m: m.generate(ids, do_sample=False, **kwargs)):
        assert torch.equal(got, want)
    if name == "bloom":
        programs = sim.run(lambda m: list(decoder_of(m).programs.values()))[0]
        assert len(programs) == 2  # the prompt's and the decode step's
        for program in programs:
            assert not program.plan.fallbacks
            assert any("S(0)%8" in c.strategy for c in program.plan.choices.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_on_cuda_with_graphs() -> None:
    """NCCL on one or two GPUs: the decode step replayed as a CUDA graph (the default on a
    GPU) and op by op (``cuda_graphs=False``) give the unsharded model's tokens."""
    world = min(2, torch.cuda.device_count())
    for result in run_processes(gc.cuda_case, world, ["llama", "gpt2"], backend="nccl",
                                timeout=300):
        for name, got in result.items():
            assert got["graph_used"] and not got["eager_graph_used"], (name, got)
            assert got["graph"] and got["eager"] and got["sampled"], (name, got)


@pytest.fixture(scope="module")
def llama_sim():
    reference = gc.model("llama")
    return reference, autotp.simulate(gc.model("llama"), 2)


def test_beam_search_and_generate_outputs(llama_sim) -> None:
    reference, sim = llama_sim
    ids, mask = gc.prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    want = reference.generate(ids, **kwargs)
    for got in sim.run(lambda m: m.generate(ids, **kwargs)):
        assert torch.equal(got.sequences, want.sequences)
        assert len(got.scores) == len(want.scores)
        assert max(map(max_difference, want.scores, got.scores)) < 1e-4
        cache = got.past_key_values
        # allocated once, for the prompt and every new token, 3 beams per prompt
        assert cache.allocations == 1 and cache.capacity == ids.shape[1] + 4
        assert cache.nbytes == gc.kv_bound(reference.config, 2, 0, 9, cache.capacity)


def test_decoding_is_captured_once(llama_sim) -> None:
    """Other prompt lengths and batch sizes reuse the prefill and decode programs."""
    reference, sim = llama_sim
    for batch, length in ((1, 4), (2, 9)):
        ids = torch.randint(1, gc.VOCAB, (batch, length))
        want = reference.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        def run(m, ids=ids):
            return m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)

        for got in sim.run(run):
            assert torch.equal(got, want)
    from autotp.runtime.causal import CausalWhereMasked

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for rank in sim.ranks:
        assert sorted(rank._decoder.programs) == [(False, 1), (True, 1)]
        # the k/v heads are read from the cache as they are, not repeated to the query heads
        # (as scaled_dot_product_attention, or where its mask may be the causal one, as the
        # module that checks it: runtime/causal.py)
        module = rank._decoder.programs[(False, 1)].module
        calls = [n for n in module.graph.nodes if n.target == sdpa or (
            n.op == "call_module" and
            isinstance(module.get_submodule(n.target), CausalWhereMasked))]
        assert len(calls) == LAYERS and all(n.kwargs.get("enable_gqa") for n in calls)


def test_automatic_dims_when_export_refuses_named_ones(monkeypatch) -> None:
    """Some torch releases (2.11) cannot prove guards such as min(32*S, 128*S) == 32*S and
    refuse the step's named dims: the capture is retried with automatic dims, whose sizes
    must come out symbolic; the programs then decode any length as before."""
    import autotp.integrations.steps as steps
    from autotp.errors import TraceError

    real, refused = steps.capture, []

    def capture(step, example_kwargs, dynamic_shapes, layers_once=True):
        named = dynamic_shapes["attention_mask"][1] is not torch.export.Dim.AUTO
        if named:
            refused.append(True)
            try:
                raise RuntimeError("Constraints violated (S)! Not all values of S ...")
            except RuntimeError as exc:
                raise TraceError("torch.export could not trace Step") from exc
        return real(step, example_kwargs=example_kwargs, dynamic_shapes=dynamic_shapes,
                    layers_once=layers_once)

    monkeypatch.setattr(steps, "capture", capture)
    reference = gc.model("gpt2")
    sim = autotp.simulate(gc.model("gpt2"), 2)
    generator = torch.Generator().manual_seed(3)
    for batch, length in ((3, 7), (1, 4)):
        ids = torch.randint(1, gc.VOCAB, (batch, length), generator=generator)
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        want = reference.generate(ids, **kwargs)
        for got in sim.run(lambda m, ids=ids, kwargs=kwargs: m.generate(ids, **kwargs)):
            assert torch.equal(got, want)
    assert len(refused) == 2  # prefill and decode, each captured once


def test_generate_errors(llama_sim) -> None:
    _, sim = llama_sim
    ids, mask = gc.prompts()
    rank = sim.ranks[0]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        rank.generate(ids, attention_mask=mask, max_new_tokens=60)
    from transformers import DynamicCache

    with pytest.raises(ConfigError, match="must be the cache this sharded model returned"):
        rank(ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True)


def test_generate_needs_a_generative_model() -> None:
    import transformers as tf

    config = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=64)
    sim = autotp.simulate(tf.BertModel(config).eval(), 2)
    with pytest.raises(ConfigError, match="can generate"):
        sim.ranks[0].generate(torch.ones(1, 4, dtype=torch.long))


def test_cached_forward(llama_sim) -> None:
    """forward(use_cache=True) and past_key_values as transformers' own: all positions'
    logits, a cache that grows as calls add tokens (one, then three at once)."""
    reference, sim = llama_sim
    ids, mask = gc.prompts()
    more = torch.randint(1, gc.VOCAB, (3, 4))
    ones = torch.ones(3, 4, dtype=torch.long)
    steps = [(ids, mask), (more[:, :1], torch.cat([mask, ones[:, :1]], 1)),
             (more[:, 1:], torch.cat([mask, ones], 1))]

    # the cache goes by the name this transformers gives it: past_key_values, cache since 5.24
    name = cache_argument(type(reference).forward)

    def run(model):
        past, out = None, []
        with torch.no_grad():
            for step_ids, step_mask in steps:
                result = model(step_ids, attention_mask=step_mask, use_cache=True,
                               **{name: past})
                past = getattr(result, name)
                out.append(result.logits)
        return out, past

    want, _ = run(reference)
    for got, cache in sim.run(run):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and max_difference(b, a) < 1e-5
        # room for the 7-token prompt, doubled for the next token, enough for the last three
        assert (cache.allocations, cache.capacity, cache.seen) == (2, 14, 11)


def test_cache_keeps_the_heads_a_rank_reads() -> None:
    """3 k/v heads for 6 query heads at tp=2: the k/v projections stay whole, rank 0's
    query heads 0-2 read k/v heads 0-1 and rank 1's heads 3-5 read k/v heads 1-2, so each
    rank's cache keeps two of the three k/v heads."""
    import transformers as tf

    def build():
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=48, intermediate_size=96, num_attention_heads=6,
            num_key_value_heads=3, vocab_size=gc.VOCAB, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()

    reference = build()
    sim = autotp.simulate(build(), 2)
    ids, mask = gc.prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=gc.NEW_TOKENS, pad_token_id=0,
                  return_dict_in_generate=True)
    want = reference.generate(ids, do_sample=False, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = sim.run(lambda m: m.generate(ids, do_sample=False, **kwargs))
    # the whole k/v projections were reported when the model was parallelized, not again by
    # the decoding programs
    assert not [w for w in caught if "stays replicated" in str(w.message)]
    for rank, got in enumerate(outputs):
        assert torch.equal(got.sequences, want.sequences)
        cache = got.past_key_values
        assert [t.shape[1] for t in cache.tensors] == [2] * 4
        assert cache.nbytes == gc.kv_bound(reference.config, 2, rank, 3, cache.capacity)


def test_direct_calls_compute_the_program() -> None:
    """The lean compile of a step program: ATen ops bound as globals (no ``torch.ops``
    attribute chain or Python wrapper per call), weights as the program's own attributes
    (no module path per read), in-place writes kept; the same results as the program."""
    import torch.fx as fx

    from autotp.integrations.steps import direct_calls

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 6))

        def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.inner(x))
            cache.index_copy_(0, torch.tensor([1]), y[:1])
            return y.sum(-1) + cache.mean()

    step = Step()
    x = torch.randn(3, 4)
    gm = torch.export.export(step, (x, torch.zeros(2, 6))).module()
    lean = direct_calls(gm)
    assert isinstance(lean, fx.GraphModule) and "torch.ops" not in lean.code
    assert "getattr(" not in lean.code and "self.inner" not in lean.code
    want_cache, got_cache = torch.zeros(2, 6), torch.zeros(2, 6)
    want, got = gm(x, want_cache), lean(x, got_cache)
    assert torch.equal(want, got) and torch.equal(want_cache, got_cache)
    assert got_cache[1].abs().sum() > 0  # the write into the cache happened
    next(gm.parameters()).data.mul_(2)  # the same storage: updates reach the lean program
    assert torch.equal(gm(x, want_cache), lean(x, got_cache))


def test_generate_with_a_pad_token_and_no_length() -> None:
    """GPT-2 whose config names a pad token (transformers then checks the ids for padding,
    which the meta probe of the cache shapes cannot), generating with neither
    max_new_tokens nor max_length (transformers' own default length applies)."""
    import transformers as tf

    def build():
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=8, vocab_size=gc.VOCAB, n_positions=64,
            pad_token_id=0, eos_token_id=None, bos_token_id=None)).eval()

    reference = build()
    sim = autotp.simulate(build(), 2)
    ids = torch.randint(1, gc.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    want = reference.generate(ids, do_sample=False)
    assert want.shape[1] > ids.shape[1]
    for got in sim.run(lambda m: m.generate(ids, do_sample=False)):
        assert torch.equal(got, want)


def test_cached_forward_with_autograd_on(llama_sim) -> None:
    """forward(use_cache=True) outside no_grad: the decoding programs run the same logits
    (a no-grad region of the model, e.g. a rotary embedding, is a submodule they keep)."""
    reference, sim = llama_sim
    ids, mask = gc.prompts()
    want = reference(ids, attention_mask=mask, use_cache=True).logits
    for got in sim.run(lambda m: m(ids, attention_mask=mask, use_cache=True).logits):
        assert max_difference(want, got) < 1e-5
