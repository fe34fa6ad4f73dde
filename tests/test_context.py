"""Context-parallel attention (autotp.runtime.ring) against the unsharded
scaled_dot_product_attention: output and the gradients of q, k and v, fp32, at most 1e-5 of
each tensor's largest entry, on simulated ranks (threads) and on gloo processes."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests import context_cases as cc
import autotp
from autotp.errors import ConfigError
from autotp.verification.verify import max_difference
from autotp.runtime.comm import ThreadComm
from autotp.runtime.ring import SequenceLayout, attention_strategy, ring_attention, \
    ulysses_attention
from autotp.runtime.launch import run_processes

RTOL = 1e-5


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("name", list(cc.CASES))
def test_matches_unsharded_attention(name: str, strategy: str, cp: int) -> None:
    case = cc.CASES[name]
    if strategy == "ulysses" and (case.heads % cp or case.kv_heads % cp):
        pytest.skip("Ulysses splits the heads: refused (test_bad_input_is_a_clear_error)")
    if strategy == "ulysses" and case.explicit:
        pytest.skip("a mask tensor's rows are the ring's queries")
    for rank, diffs in enumerate(cc.on_ranks(cp, lambda comm: cc.run(comm, case, strategy))):
        assert max(diffs.values()) <= RTOL, (rank, diffs)


def test_layout_balances_causal_work_and_round_trips() -> None:
    layout = SequenceLayout(4, balanced=True)
    assert layout.positions(1, 16).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    # every rank has the same number of (query, key) pairs under the causal mask
    pairs = [int((layout.positions(r, 16)[:, None] >= torch.arange(16)).sum()) for r in range(4)]
    assert len(set(pairs)) == 1, pairs
    x = torch.arange(2 * 16).view(2, 16)  # (the cases' length, 24, serves cp 2, 3 and 4)
    assert torch.equal(layout.unshard([layout.shard(x, 1, r) for r in range(4)], 1), x)


def test_ring_skips_the_blocks_the_causal_mask_hides() -> None:
    """At cp 4, balanced: each rank computes 2 x 2 chunk pairs per step of the ring when
    nothing is hidden; under the causal mask half of the 64 pairs are skipped, alike on every
    rank (the ring shifts 3 times forward either way); backward calls the kernels forward
    called, each once."""
    import autotp.runtime.ring as context

    pairs: list[int] = []
    kernels = {"forward": 0, "backward": 0}
    real, forward, backward = context._step_calls, context.kernel_forward, \
        context.kernel_backward

    def planned(*args: Any) -> Any:
        calls = real(*args)
        pairs.append(sum(c.pairs for c in calls))
        return calls

    def counting(phase: str, kernel: Any) -> Any:
        def call(*args: Any) -> Any:
            kernels[phase] += 1
            return kernel(*args)
        return call

    case = cc.CASES["causal"]
    context._step_calls = planned  # type: ignore[assignment]
    context.kernel_forward = counting("forward", forward)  # type: ignore[assignment]
    context.kernel_backward = counting("backward", backward)  # type: ignore[assignment]
    try:
        logs = cc.on_ranks(4, lambda comm: (cc.run(comm, case, "ring"), comm.log)[1])
    finally:
        context._step_calls = real  # type: ignore[assignment]
        context.kernel_forward, context.kernel_backward = forward, backward  # type: ignore
    # 4 ranks: 64 pairs - 28 hidden
    assert sum(pairs) == 4 * 4 * 4 - 28, sum(pairs)
    assert kernels["forward"] == kernels["backward"] > 0, kernels
    assert all(log.count("forward", kind="shift", any_layer=True) == 3 for log in logs)
    # backward: the blocks 3 times, their gradient accumulators 4 (the last one home)
    assert all(log.count("backward", kind="shift", any_layer=True) == 7 for log in logs)


@pytest.mark.parametrize("name", ["causal", "window", "padding", "explicit-bool",
                                  "explicit-additive"])
@pytest.mark.parametrize("kernel", ["fused", "matmul"])
def test_tiles_of_query_rows_match_whole_chunks(name: str, kernel: str,
                                                monkeypatch: Any) -> None:
    """A long sequence's pair of chunks goes in tiles of query rows (``TILE_BYTES`` of
    float32 scores, or mask, each) where a call holds them: every pair on the products'
    path (``Kernel.MATMUL``), the pairs with a mask on the fused kernels. With tiles of one
    query row at cp 2, the output and gradients are the unsharded attention's, as with
    whole chunks."""
    import autotp.runtime.ring as context
    from autotp.runtime.ring_kernels import Kernel

    case = cc.CASES[name]
    rows = 2 * case.heads * (case.length // 4) * 4  # b x heads x key chunk x float32
    monkeypatch.setattr(context, "TILE_BYTES", rows)
    if kernel == "matmul":
        monkeypatch.setattr(context, "choose", lambda *args: Kernel.MATMUL)
    counted: list[int] = []
    real = context._step_calls

    def counting(*args: Any) -> Any:
        calls = real(*args)
        counted.extend(c.rows.stop - c.rows.start for c in calls
                       if kernel == "matmul" or c.cell is context._Cell.MASKED)
        return calls

    monkeypatch.setattr(context, "_step_calls", counting)
    for rank, diffs in enumerate(cc.on_ranks(2, lambda comm: cc.run(comm, case, "ring"))):
        assert max(diffs.values()) <= RTOL, (rank, diffs)
    if kernel == "matmul" or name != "causal":  # causal alone needs no mask on the kernels
        assert counted and set(counted) == {1}, set(counted)
    else:
        assert not counted, counted


def test_bfloat16_under_autocast_is_as_close_as_unsharded_attention() -> None:
    """bfloat16 q, k, v under autocast at cp 2: the ring's output and gradients are close to
    the float64 attention as scaled_dot_product_attention's own in bfloat16: the output
    within 1.5 x its error (the blocks merge in float32), each gradient within 2.5 x (a
    query's dq, a key's dk and dv sum up to cp kernel calls' bfloat16 results, each as
    close as SDPA's own, at cp 2)."""
    case = cc.Case(length=64)
    q, k, v, grad, _ = cc.inputs(case)
    layout = SequenceLayout(2, balanced=True)

    def attend(dtype: torch.dtype, sharded: bool) -> list[torch.Tensor]:
        if not sharded:
            xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True)
            out.backward(grad.to(dtype))
            return [out.detach().double(), *(x.grad.double() for x in xs)]

        def rank(comm: ThreadComm) -> list[torch.Tensor]:
            xs = [layout.shard(t, 2, comm.rank).to(dtype).requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = ring_attention(*xs, comm, layout, causal=True)
            out.backward(layout.shard(grad, 2, comm.rank).to(dtype))
            return [out.detach().double(), *(x.grad.double() for x in xs)]

        parts = cc.on_ranks(2, rank)
        return [layout.unshard([p[i] for p in parts], 2) for i in range(4)]

    exact = attend(torch.float64, sharded=False)
    ring = attend(torch.bfloat16, sharded=True)
    sdpa = attend(torch.bfloat16, sharded=False)
    for name, want, a, b in zip(["out", "q", "k", "v"], exact, ring, sdpa):
        ring_err, sdpa_err = (max_difference(want, x, relative=True) for x in (a, b))
        bound = 1.5 if name == "out" else 2.5
        assert ring_err <= bound * sdpa_err, (name, ring_err, sdpa_err)


def test_strategy_by_bytes_sent() -> None:
    assert attention_strategy(32, 32, 4)[0] == "ulysses"  # MHA: all-to-all sends less
    assert attention_strategy(32, 8, 4)[0] == "ring"  # GQA: the ring's k, v are small
    strategy, why = attention_strategy(12, 4, 8)
    assert strategy == "ring" and "do not divide by cp=8" in why


def test_bad_input_is_a_clear_error() -> None:
    layout = SequenceLayout(2, balanced=True)
    with pytest.raises(ConfigError, match="sequence length 6 does not divide by 4"):
        layout.positions(0, 6)

    def ulysses(comm: ThreadComm) -> None:
        q = torch.randn(1, 6, 4, 8)
        k = torch.randn(1, 3, 4, 8)
        ulysses_attention(q, k, k, comm, layout)

    with pytest.raises(ConfigError, match="3 key/value heads do not divide by it; use ring"):
        cc.on_ranks(2, ulysses)

    def wrong_group(comm: ThreadComm) -> None:
        q = torch.randn(1, 2, 4, 8)
        ring_attention(q, q, q, comm, SequenceLayout(4, balanced=False))

    with pytest.raises(ConfigError, match="cp=4 but the context-parallel group has 2 ranks"):
        cc.on_ranks(2, wrong_group)

    for causal, window in [(False, 3), (True, 0)]:
        def windowed(comm: ThreadComm, causal: bool = causal, window: int = window) -> None:
            q = torch.randn(1, 2, 4, 8)
            ring_attention(q, q, q, comm, layout, causal=causal, window=window)

        with pytest.raises(ConfigError, match=f"window={window}: a sliding window needs"):
            cc.on_ranks(2, windowed)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gloo_processes_match_unsharded_attention(cp: int) -> None:
    """Every case, ring and Ulysses, through torch.distributed's gloo (point-to-point shifts,
    all_to_all_single) in one launch."""
    for rank, results in enumerate(run_processes(cc.process_cases, cp, timeout=240)):
        shifts = results.pop("shifts")
        assert len(results) >= len(cc.CASES) + 1, results.keys()
        for name, diffs in results.items():
            assert max(diffs.values()) <= RTOL, (rank, name, diffs)
        assert shifts["forward"] > 0


# ---- whole models: autotp.simulate / parallelize with cp ------------------------------------


@pytest.mark.parametrize("name,tp,cp,padded,kind", [
    ("llama", 1, 2, True, "ring"),  # GQA, rotary from the positions, a padding mask
    ("llama", 1, 4, False, "ring"),  # 2 key/value heads: Ulysses cannot split them over 4
    ("gpt2", 1, 2, True, "ring"),  # learned absolute positions
    ("mistral_window", 1, 2, False, "ring"),  # a sliding-window mask
    # plain PyTorch: SDPA with is_causal (no mask tensor), the loss outside; 8 heads of
    # 8 over 4 ranks: Ulysses sends 1.50 query blocks, the ring 6.00
    ("nanogpt", 1, 4, False, "ulysses"),
    # inside tp 2 (tp rank t of cp rank c: thread c * 2 + t)
    ("llama", 2, 2, True, "ring"),
    ("gpt2", 2, 2, True, "ring"),  # Conv1D's [in, out] weights, sharded by the tp plan
    ("mistral_window", 2, 2, False, "ring"),
    # 4 of 8 heads per tp rank over 4 cp ranks: Ulysses 3.00 query blocks, the ring 6.00
    ("nanogpt", 2, 4, False, "ulysses"),
    # 4 heads per tp rank over 2 cp ranks: a tie, which the ring takes (its shifts overlap)
    ("nanogpt", 2, 2, False, "ring"),
])
def test_models_match_the_unsharded_model(name: str, tp: int, cp: int, padded: bool,
                                          kind: str) -> None:
    """Outputs, the model's own loss (labels shifted by one, across the shards' boundaries),
    every gradient and one SGD step against the unsharded model (fp32; verify's tolerances:
    1e-5 absolute on outputs and loss, 1e-4 of each gradient's largest entry); every
    attention by the ring, or by Ulysses where it takes no mask tensor and sends fewer
    bytes (the plan says which and why); every parameter whole on every rank at tp 1, as
    the tp plan holds it (Megatron's bound per layer) inside tp."""
    from tests import models

    from autotp.verification.verify import assert_equivalent

    model = models.BUILDERS[name]().eval()
    inputs = cc.model_inputs(name, padded)
    sim = autotp.simulate(model, tp, cp=cp, example_kwargs=inputs)
    assert len(sim.ranks) == tp * cp and sim.plan.cp == cp and sim.tp == tp
    context = sim.plan.on("cp")
    assert list(sim.plan.axes) == (["tp", "cp"] if tp > 1 else ["cp"])
    assert context.lead.name == "cp" and context.degree == cp and sim.plan.tp == tp
    degree = f"cp={cp} (context parallel" if tp == 1 else \
        f"tp={tp} x cp={cp} (context parallel inside tp)"
    assert degree in sim.plan.summary()
    sdpa = [c for c in context.choices.values() if "scaled_dot_product" in c.op]
    assert sdpa and all(c.strategy.endswith(f"[{kind}]") for c in sdpa), sdpa
    whys = [why for node, why in context.attention.items() if node in context.choices]
    assert len(whys) == len(sdpa) and all(why.startswith(f"{kind}: ") for why in whys), whys
    assert whys[0] in sim.plan.summary()
    assert all(p.layout == "R" for p in context.params.values())
    if tp > 1:  # the tp plan as without cp: 2 all-reduces forward and 2 backward per layer
        per_layer = {k: dict(v) for k, v in sim.plan.per_layer().items() if k is not None}
        assert per_layer and all(counts == {("forward", "all_reduce"): 2,
                                            ("backward", "all_reduce"): 2}
                                 for counts in per_layer.values()), per_layer
        assert any(p.layout.startswith("S") for p in sim.plan.params.values())
    assert_equivalent(model, sim, kwargs=inputs, loss_fn=lambda out: cc.model_loss(name, out),
                      pick=lambda out: cc.model_output(name, out))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallelism_inside_cp_matches_the_unsharded_model(name: str) -> None:
    """tp 2 x cp 2 with sequence parallelism: tp splits each rank's cp shard of the sequence
    again between the blocks (the sequence in 8 pieces, cp's balanced chunks outside, tp's
    contiguous pieces inside); the tp plan at Megatron's bound with sequence parallelism,
    2 all-gathers and 2 reduce-scatters each way per layer. GPT-2's projections read
    merged batch x sequence rows, which cp gathers whole: its split of their outputs comes
    before tp's reduce-scatter of them. Exact against the unsharded model (padded); a
    length 4 does not divide is refused with the numbers."""
    from tests import models

    from autotp.verification.verify import assert_equivalent

    model = models.BUILDERS[name]().eval()
    inputs = cc.model_inputs(name, True)
    sim = autotp.simulate(model, 2, cp=2, example_kwargs=inputs, sequence_parallel=True)
    per_layer = {k: dict(v) for k, v in sim.plan.per_layer().items() if k is not None}
    assert per_layer and all(counts == {("forward", "all_gather"): 2,
                                        ("forward", "reduce_scatter"): 2,
                                        ("backward", "all_gather"): 2,
                                        ("backward", "reduce_scatter"): 2}
                             for counts in per_layer.values()), per_layer
    assert_equivalent(model, sim, kwargs=inputs, loss_fn=lambda out: cc.model_loss(name, out),
                      pick=lambda out: cc.model_output(name, out))
    short = {k: v[:, :10] for k, v in inputs.items()}
    with pytest.raises(ConfigError, match="divisible by 4: by 2 x cp = 4 \\(cp=2, .* and by "
                                          "cp x tp = 4 \\(tp=2 splits each.*has 10"):
        sim.run(lambda m: m(**short))


def test_merged_batch_and_sequence_rows_stay_sharded() -> None:
    """``logits.view(-1, vocab)`` of the model's own loss and GPT-2's Conv1D rows
    (``x.view(-1, C)``) merge the batch with the split sequence: each batch index one
    sequence, split across the cp ranks (``S(0)%<T>``), read row by row and reduced to
    partial sums, never gathered. LLaMA's loss chain from the merged logits holds them so
    (the shifted labels sliced to match, not the logits gathered), GPT-2 runs its layers
    with no collective over cp; the activation memory with the loss, measured, is within
    15 % of 1/cp of the unsharded model's at cp 2 and 4."""
    import warnings

    from tests import models

    from autotp.verification.saved_tensors import count_saved

    ids = torch.randint(0, models.VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    model = models.llama().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no value gathered as a last resort
        plan = autotp.plan(model, 1, cp=2, example_kwargs=inputs, gather_outputs=False)
    loss_chain = [n for n, c in plan.choices.items() if c.op in (
        "aten.logsumexp.default", "aten.gather.default")]
    assert loss_chain and all(plan.values[n].startswith("S(0)%s") for n in loss_chain), \
        {n: plan.values[n] for n in loss_chain}
    assert not any(e.forward == "all_gather" for e in plan.edges), \
        [e for e in plan.edges if e.forward]
    gpt2 = autotp.plan(models.gpt2().eval(), 1, cp=2, example_kwargs=inputs)
    assert all(layer is None for layer in gpt2.per_layer()), gpt2.per_layer()
    assert any(v.startswith("S(0)%s") for n, v in gpt2.values.items()
               if gpt2.ops.get(n) == "aten.mm.default")

    def saved(m: torch.nn.Module) -> int:
        with count_saved(exclude=[*m.parameters(), *model.parameters()]) as counted:
            out = m(**inputs)
        out.loss.backward()
        return counted.nbytes

    whole = saved(model)
    for cp in (2, 4):
        sim = autotp.simulate(model, 1, cp=cp, example_kwargs=inputs, gather_outputs=False)
        per_rank = max(sim.run(saved))
        assert per_rank * cp / whole < 1.15, (cp, per_rank, whole)


@pytest.mark.parametrize("name,padded,tile_bytes", [
    ("llama", True, None), ("mistral_window", False, None),
    ("llama", True, 2048),  # tiles of 10 query rows for the mask, of 2 for the scores
])
def test_model_masks_are_built_block_by_block(name: str, padded: bool, tile_bytes: Any,
                                              monkeypatch: Any) -> None:
    """transformers' causal, padding and sliding-window masks are elementwise ops of
    position vectors: at cp 2 the ring runs those ops on each pair of chunks it meets
    (``planner/masks.py``), so no rank makes a tensor of its 24 query rows by all 48 keys
    (forward or backward), and the model stays exact, in tiles of query rows too."""
    from tests import models

    import autotp.runtime.ring as context

    if tile_bytes is not None:
        monkeypatch.setattr(context, "TILE_BYTES", tile_bytes)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from autotp.verification.verify import assert_equivalent

    ids = torch.randint(0, models.VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(2, 48, dtype=torch.long)
        mask[1, :9] = 0
        inputs["attention_mask"] = mask
    model = models.BUILDERS[name]().eval()
    sim = autotp.simulate(model, 1, cp=2, example_kwargs=inputs)

    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[tuple[int, ...]] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            self.seen |= {tuple(t.shape) for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor)}
            return out

    def shapes(module: torch.nn.Module) -> set[tuple[int, ...]]:
        with Shapes() as mode:
            module(**inputs).loss.backward()
        return mode.seen

    for seen in sim.run(shapes):
        rows = [s for s in seen if len(s) >= 2 and s[-2:] in ((24, 48), (48, 48))]
        assert not rows, rows
    assert_equivalent(model, sim, kwargs=inputs, loss_fn=lambda out: out.loss,
                      pick=lambda out: out.logits)


def test_eager_einsum_attention_gathers_keys_and_values() -> None:
    """x-transformers' decoder (rotary, attention as einsums and a softmax, no SDPA) at
    cp 2: the scores' product keeps this rank's queries and reads every key, so each
    attention block all-gathers k and v forward and reduce-scatters their gradients
    (context parallelism by gathered keys and values), and the model stays exact."""
    from tests import models

    from autotp.verification.verify import assert_equivalent

    model = models.x_transformers_decoder()
    tokens = torch.randint(0, 128, (2, 16))
    sim = autotp.simulate(model, 1, cp=2, example_kwargs={"x": tokens})
    per_layer = {k: dict(v) for k, v in sim.plan.per_layer().items() if k is not None}
    assert per_layer and all(counts == {("forward", "all_gather"): 2,
                                        ("backward", "reduce_scatter"): 2}
                             for counts in per_layer.values()), per_layer
    assert_equivalent(model, sim, kwargs={"x": tokens})


def test_any_head_count_runs_by_the_ring() -> None:
    """cp need not divide the heads (nanoGPT's 8 at cp 3): the ring takes any count, where
    a tp plan of 3 refuses them."""
    from tests import models

    from autotp.errors import PlanError

    inputs = cc.model_inputs("nanogpt", False)
    plan = autotp.plan(models.nanogpt(), 1, cp=3, example_kwargs=inputs)
    assert plan.attention and all(why.startswith("ring: ") and "cp=3" in why
                                  for why in plan.attention.values()), plan.attention
    with pytest.raises(PlanError, match="tp=3 does not divide the 8 attention heads"):
        autotp.plan(models.nanogpt(), 3, example_kwargs=inputs)


def test_context_parallel_bad_input_is_a_clear_error() -> None:
    from tests import models

    inputs = cc.model_inputs("llama", False)
    with pytest.raises(ConfigError, match="sequence_parallel only with tp > 1"):
        autotp.plan(models.llama(), 1, cp=2, example_kwargs=inputs, sequence_parallel=True)
    with pytest.raises(ConfigError, match="pass no ep with cp"):
        autotp.plan(models.llama(), 2, cp=2, example_kwargs=inputs, ep=2)
    sim = autotp.simulate(models.llama(), 1, cp=2, example_kwargs=inputs)
    with pytest.raises(ConfigError, match="context parallelism needs the sequence length "
                                          "divisible by 2 x cp = 4 \\(cp=2, .*'input_ids' has 15"):
        sim.run(lambda m: m(input_ids=inputs["input_ids"][:, :15]))
    with pytest.raises(ConfigError, match="generate\\(\\) on a context-parallel model"):
        sim.ranks[0].generate(inputs["input_ids"], max_new_tokens=2)


@pytest.mark.parametrize("cp,names", [(2, ["gpt2", "nanogpt", "llama", "mistral_window"]),
                                      (4, ["llama", "nanogpt"])])
def test_gloo_processes_parallelize_with_cp(cp: int, names: list[str], tmp_path: Any) -> None:
    """``autotp.parallelize(model, tp=1, cp=...)`` on gloo processes, padded inputs (a
    sliding-window Mistral among them at cp 2): each
    rank's output, loss and every gradient against the unsharded model; a cp the group does
    not have and a sequence cp does not divide are refused. Every attention by the ring but
    nanoGPT's at cp 4 (no mask tensor, 8 of 8 heads over 4 ranks), by Ulysses. At cp 2, in
    the same processes, ``autotp.from_pretrained(path, 1, cp=2)`` of a saved LLaMA against
    transformers' loading of it."""
    saved = None
    if cp == 2:
        from tests import models

        models.llama().save_pretrained(tmp_path)
        saved = str(tmp_path)
    for rank, results in enumerate(run_processes(cc.process_models, cp, names, True, saved,
                                                 timeout=300)):
        if saved is not None:
            got = results["pretrained"]
            assert got.ok(atol=1e-5, grad_rtol=1e-4), (rank, "from_pretrained", got)
        for name in names:
            got = results[name]
            assert got.ok(atol=1e-5, grad_rtol=1e-4), (rank, name, got)
            ulysses = 2 if (name, cp) == ("nanogpt", 4) else 0
            assert results[f"{name}-ulysses"] == ulysses, (rank, name)
            assert results[f"{name}-rings"] == 2 - ulysses, (rank, name)
        wrong_group, odd_length = results["errors"]
        assert f"cp={cp + 1} but the context-parallel group has {cp} ranks" in wrong_group
        assert f"divisible by 2 x cp = {2 * cp}" in odd_length and "has 15" in odd_length


def test_command_line_plans_with_cp() -> None:
    """``autotp plan --tp 1 --cp 2``: the plan's table names the degree and the ring; with
    --tp 2 the tp plan's table, the ring and the collectives over cp (the gradients' sum);
    --cp with --sequence-parallel at --tp 1 is refused, as the library refuses it."""
    import contextlib
    import io

    from autotp.cli import main

    model = ["hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64",
             "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
             "--set", "num_key_value_heads=2", "--set", "vocab_size=256", "-q"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["plan", *model, "--tp", "1", "--cp", "2"]) == 0, err.getvalue()
        text = out.getvalue()
        out.truncate(0)
        assert main(["plan", *model, "--tp", "2", "--cp", "2"]) == 0, err.getvalue()
        inside = out.getvalue()
        assert main(["plan", *model, "--tp", "1", "--cp", "2", "--sequence-parallel"]) != 0
    assert "cp=2 (context parallel, tp=1)" in text and "2 call(s) by ring attention" in text
    assert "tp=2 x cp=2 (context parallel inside tp)" in inside
    assert "2 call(s) by ring attention" in inside and "Megatron bound (2, 2): met" in inside
    assert "over cp=2" in inside and "grad sync: lm_head.weight" in inside
    assert "--cp 2 with --sequence-parallel at --tp 1" in err.getvalue()



def test_four_gloo_processes_fsdp2_over_dp_and_cp_and_tp_inside_cp(tmp_path: Any) -> None:
    """4 gloo processes. dp 2 x cp 2, FSDP2 per layer and at the root over all four ranks
    (GQA LLaMA with rotary, padded): the first step's gradients within 1e-5 of the unsharded
    model's on the whole batch; over 2 AdamW steps after clipping to half the model's norm
    (``autotp.clip_grad_norm_`` within 1e-5 relative), the dp-mean loss within 1e-5 and the
    parameters within 1e-4. Then tp 2 x cp 2 (``parallelize(model, tp=2, cp=2)``): LLaMA
    (padded), GPT-2 (padded, learned positions, sequence parallelism inside cp), nanoGPT,
    Mistral with a sliding window and x-transformers' decoder (attention as einsums: k and
    v gathered over cp), each rank's output, loss and
    every gradient against the unsharded model; tp rank r % 2 of cp rank r // 2;
    ``from_pretrained(path, 2, cp=2)`` of a saved LLaMA against transformers' loading; tp 2
    x cp 3 on 4 ranks refused. Then pp 2 x cp 2: ``pipeline_stages(..., cp=2)`` of LLaMA
    (4 layers, the ring in each), Schedule1F1B over 4 microbatches, two AdamW steps: the
    losses within 1e-5 of the unsharded model's on the whole batch, each gradient within
    1e-5 of its largest entry on the first step and 3e-3 on the second (AdamW's first update
    moves a near-zero gradient's weight by about lr, as in tests/test_pipeline.py), half
    the weights per pp rank, and ``clip_grad_norm_`` over the stages within 1e-4."""
    from tests import models

    models.llama().save_pretrained(tmp_path)
    for rank, both in enumerate(run_processes(cc.four_ranks, 4, str(tmp_path), timeout=400)):
        r = both["fsdp"]
        got = both["tp_cp"]["pretrained"]
        assert got.ok(atol=1e-5, grad_rtol=1e-4), (rank, "from_pretrained", got)
        for name in ("llama", "gpt2", "nanogpt", "mistral_window", "x_transformers"):
            got = both["tp_cp"][name]
            assert got.ok(atol=1e-5, grad_rtol=1e-4), (rank, name, got)
            assert both["tp_cp"][f"{name}-ranks"] == (rank % 2, rank // 2), (rank, name)
        assert "tp=2 x cp=3 = 6 ranks, but the world has 4" in both["tp_cp"]["error"]
        _pipeline_trained_as_the_model(rank, both["pp_cp"], share=0.51)
        assert r["rings"] == 2, (rank, r)
        _trained_as_the_model(rank, r)


def _trained_as_the_model(rank: int, r: dict[str, Any]) -> None:
    """``fsdp_over_dp_and_cp``'s result: first-step gradients and the clipping norm within
    1e-5, the dp-mean loss within 1e-5 and the parameters within 1e-4."""
    assert r["grad_diff"] < 1e-5 and r["norm_diff"] < 1e-5, (rank, r)
    assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-4 and r["names"], (rank, r)


def _pipeline_trained_as_the_model(rank: int, pp: dict[str, Any], share: float) -> None:
    """``pipeline_context_case``'s result: the ring in each of the 4 layers, under ``share``
    of the weights on this rank; each step's loss within 1e-5, its gradients within 1e-5 of
    their largest entry on the first step and 3e-3 after, the clipping norms within 1e-4."""
    assert pp["rings"] == 4 and pp["stage_params"] < share * pp["full_params"], pp
    for step, (loss, want) in enumerate(zip(pp["losses"], pp["reference"], strict=True)):
        assert abs(loss - want) < 1e-5, (rank, step, pp)
        assert pp["grad_diffs"][step]["untied"] < (1e-5 if step == 0 else 3e-3), (rank, pp)
        assert max(pp["norm_diffs"][step].values()) < 1e-4, (rank, pp)


def test_eight_gloo_processes_dp_cp_tp_with_fsdp2_and_pp_cp_tp() -> None:
    """8 gloo processes. A (dp, cp, tp) mesh of 2 x 2 x 2: ``parallelize(tp=2, cp=2)`` over
    "tp" and "cp", FSDP2 per layer and at the root over dp x cp flattened (padded LLaMA):
    the first step's gradients within 1e-5 of the unsharded model's on the whole batch;
    over 2 AdamW steps after ``clip_grad_norm_`` (within 1e-5 relative), the dp-mean loss
    within 1e-5 and the parameters within 1e-4. Then pp 2 x cp 2 x tp 2:
    ``pipeline_stages(..., cp=2)`` of LLaMA, Schedule1F1B, two AdamW steps, as in the
    4-process case; a quarter of the weights per rank."""
    for rank, both in enumerate(run_processes(cc.eight_ranks, 8, timeout=500)):
        _trained_as_the_model(rank, both["fsdp"])
        _pipeline_trained_as_the_model(rank, both["pp_cp"], share=0.26)


@pytest.mark.parametrize("name,cp,pairs", [("nanogpt", 2, 5), ("llama", 4, 9)])
def test_the_plan_holds_the_sequence_balanced(name: str, cp: int, pairs: int) -> None:
    """Every rank holds chunks r and 2 cp - 1 - r of 2 cp and computes the same number of
    (query, key) chunk pairs per attention forward, the causal ones: nanoGPT at cp 2 (SDPA's
    is_causal, by the ring at cp 2), 5 of the 16 pairs each; transformers' LLaMA at cp 4,
    whose causal mask arrives as a tensor (the pairs it hides found in one read of it per
    call), 9 of the 64 each. Contiguous shards would give the last rank 2 cp - 1 times the
    first one's work. Outputs and gradients are the unsharded model's (the whole-model tests
    above run on the same layout)."""

    import autotp.runtime.ring as context
    from tests import models

    inputs = cc.model_inputs(name, False)
    sim = autotp.simulate(models.BUILDERS[name]().eval(), 1, cp=cp, example_kwargs=inputs)
    assert all(m.sequence.balanced and m.sequence.chunks_of(m.comm.rank) ==
               (m.comm.rank, 2 * cp - 1 - m.comm.rank) for m in sim.ranks)
    assert all(c.strategy.endswith("[ring]") for c in sim.plan.choices.values()
               if "scaled_dot_product" in c.op)
    counted: dict[int, int] = {}
    real = context._step_calls

    def counting(*args: Any) -> Any:
        calls = real(*args)
        ident = threading.get_ident()
        counted[ident] = counted.get(ident, 0) + sum(c.pairs for c in calls)
        return calls

    context._step_calls = counting  # type: ignore[assignment]
    try:
        sim.run(lambda m: m(**inputs))
    finally:
        context._step_calls = real  # type: ignore[assignment]
    layers = 2
    assert sorted(counted.values()) == [pairs * layers] * cp, counted
