"""Peephole fusions of the rewritten programs: same values and gradients, fewer kernels."""

from __future__ import annotations

import shutil

import pytest
import torch

import autotp
from autotp.runtime.fusion import logsumexp_and_gather
from autotp.runtime.layers import program_nodes
from tests.models import BUILDERS, example

aten = torch.ops.aten


def test_logsumexp_and_gather_matches_the_separate_ops_in_value_and_gradient() -> None:
    x = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 10, (6, 1))
    for keepdim in (False, True):
        lse, picked = logsumexp_and_gather(x, 1, index, keepdim)
        assert torch.equal(lse, torch.logsumexp(x, 1, keepdim=keepdim))
        assert torch.equal(picked, x.gather(1, index))
        assert torch.autograd.gradcheck(
            lambda t, k=keepdim: logsumexp_and_gather(t, 1, index, k), (x,))
    # one output unused: its gradient is None in backward
    lse, _ = logsumexp_and_gather(x, 1, index, False)
    (g,) = torch.autograd.grad(lse.sum(), x)
    assert torch.allclose(g, torch.softmax(x, 1))


def _count(program: torch.fx.GraphModule, target: object, nargs: int | None = None) -> int:
    return sum(1 for n in program_nodes(program) if n.target == target
               and (nargs is None or len(n.args) == nargs))


def test_biases_go_back_into_their_products_where_no_collective_separates_them() -> None:
    model = BUILDERS["nanogpt"]()
    args, kwargs = example("nanogpt")
    sim = autotp.simulate(model, 2, example_args=args, example_kwargs=kwargs)
    program = sim.ranks[0].program
    # column-parallel q|k|v and fc: bias fused; row-parallel projections: bias after the
    # all-reduce, so still a separate add (2 layers)
    assert _count(program, aten.linear.default, 3) == 4
    assert _count(program, aten.linear.default, 2) == 4 + 1  # + the tied LM head


def test_the_loss_is_one_fused_logsumexp_and_lookup() -> None:
    model = BUILDERS["llama"]()
    ids = torch.randint(0, 128, (2, 16))
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": ids, "labels": ids})
    program = sim.ranks[0].program
    assert _count(program, logsumexp_and_gather) == 1
    assert _count(program, aten.logsumexp.default) == 0
    assert _count(program, aten.gather.default) == 0


def _check_compiled(compile: object, sequence_parallel: bool = False) -> None:
    """Every rank of the compiled program matches the unsharded model, the collectives ran
    on every rank, and something was compiled. With sequence parallelism the compiled
    products save their gathered inputs as shards too: backward gathers each again."""
    from torch._dynamo.utils import counters

    from autotp.verification.verify import assert_equivalent

    model = BUILDERS["llama"]()
    ids = torch.randint(0, 128, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids}
    sim = autotp.simulate(model, 2, example_kwargs=kwargs, compile=compile,
                          sequence_parallel=sequence_parallel)
    counters.clear()
    assert_equivalent(model, sim, kwargs=kwargs, loss_fn=lambda o: o.loss, atol=1e-4)
    counts = [len(r.comm.log.events) for r in sim.ranks]
    assert counts[0] > 0 and len(set(counts)) == 1  # the collectives ran, on every rank
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    regathers = [sum(1 for e in r.comm.log.events if e.label.endswith("re-gathered"))
                 for r in sim.ranks]
    assert regathers == [5 if sequence_parallel else 0] * 2  # 2 per layer, and the head's


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_compiled_program_matches_the_unsharded_model(sequence_parallel: bool) -> None:
    """compile= runs each rank's program through torch.compile (the aot_eager backend here:
    no C++ toolchain needed); the collectives stay eager between the compiled segments."""
    _check_compiled({"backend": "aot_eager"}, sequence_parallel)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_compiled_program_matches_the_unsharded_model() -> None:
    """compile=True (inductor, the backend docs/performance.md's figures use)."""
    _check_compiled(True)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral_window"])
def test_a_traced_causal_mask_runs_by_the_kernels_causal_path(name: str) -> None:
    """transformers' causal mask, a tensor once traced, is checked at run time
    (``runtime/causal.py``): unpadded it is the causal one and every attention runs with
    ``is_causal=True`` and no mask (one check per forward for all layers); a padded batch or
    a sliding window keeps its mask. Exact against the unsharded model at tp 2 either way."""
    from autotp.verification.verify import assert_equivalent
    from autotp.runtime.causal import CausalWhereMasked

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :3] = 0
    model = BUILDERS[name]().eval()
    for padded in (False, True):
        inputs = {"input_ids": ids, "labels": ids}
        if padded:
            inputs["attention_mask"] = padding
        sim = autotp.simulate(model, 2, example_kwargs=inputs)
        assert_equivalent(model, sim, kwargs=inputs, loss_fn=lambda out: out.loss,
                          pick=lambda out: out.logits)
        checkers = [m for m in sim.ranks[0].program.modules()
                    if isinstance(m, CausalWhereMasked)]
        assert len(checkers) == 1, checkers  # one mask, read by both layers
        causal = not padded and name != "mistral_window"  # a window of 5 in 16 tokens
        calls = (checkers[0].causal_calls, checkers[0].masked_calls)
        assert (calls[0] > 0, calls[1] > 0) == (causal, not causal), calls
