"""Worker functions for the robustness tests (run in real gloo processes)."""

from __future__ import annotations

import time
from typing import Any

import torch


def different_models(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 builds a model with another hidden size: refused before rank 0 plans it (the
    ranks compare what they traced). Then a model with an op no rule covers, the same on
    both ranks: only rank 0 plans it, and its NoRuleError is raised on rank 1 too."""
    import autotp
    from tests.models import VOCAB
    from tests.test_errors import UsesAnOpWithoutRule

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    width = 64 if rank == 0 else 128
    config = transformers.GPT2Config(n_layer=1, n_embd=width, n_head=4, vocab_size=VOCAB,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    out = {}
    try:
        autotp.parallelize(model, tp=world_size)
        out["mismatch"] = "no error"
    except autotp.ConfigError as exc:
        out["mismatch"] = str(exc)
    try:
        autotp.parallelize(UsesAnOpWithoutRule(), tp=world_size,
                           example_args=(torch.randn(2, 4, 8),))
        out["no_rule"] = "no error"
    except autotp.NoRuleError as exc:
        out["no_rule"] = str(exc)
    return out


def one_rank_fails(rank: int, world_size: int, timeout: float) -> Any:
    """Rank 1 raises after the first step; rank 0 must fail fast instead of hanging."""
    import autotp
    from tests.models import BUILDERS, batch

    model = BUILDERS["gpt2"]()
    sharded = autotp.parallelize(model, tp=world_size, timeout=timeout)
    ids = batch()
    sharded(ids).logits.sum().backward()
    if rank == 1:
        raise RuntimeError("rank 1 crashes on purpose")
    start = time.perf_counter()
    try:
        sharded(ids).logits.sum().backward()
    except autotp.AutotpError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


def different_seeds(rank: int, world_size: int) -> str:
    """Ranks seeded differently hold different weights and would draw different dropout
    masks for replicated values: refused on the first call."""
    import autotp
    from tests.models import BUILDERS, batch

    model = BUILDERS["gpt2"](seed=rank)
    sharded = autotp.parallelize(model, tp=world_size)
    try:
        sharded(batch())
    except autotp.ConfigError as exc:
        return str(exc)
    return "no error"
