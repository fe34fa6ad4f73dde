"""The families of tests/test_families.py: the small transformers models of
benchmarks/family_coverage.py (its FAMILIES, perturbed weights, example inputs), a loss over the
logits, the per-layer traffic of a collective log, and the function that
``autotp.runtime.launch.run_processes`` runs in each gloo worker (module level: a spawned
interpreter imports it from here)."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F

from benchmarks import family_coverage as cov

ATOL = cov.ATOL  # logits and loss: max abs; gradients: relative (verification.verify.compare)


def build(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """family_coverage.py's model of ``name``: seeded, every weight perturbed, in eval mode; and its
    example inputs. The same in every process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cov.FAMILIES[name].model()
    return model, cov.FAMILIES[name].inputs()


def caller(kwargs: dict[str, torch.Tensor]) -> Any:
    def call(module: torch.nn.Module) -> Any:
        return module(**kwargs)
    return call


def logits(out: Any) -> torch.Tensor:
    return out.logits


def next_token_loss(ids: torch.Tensor) -> Any:
    """Cross-entropy of the logits at each position against the next token."""
    def loss(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    return loss


def megatron_bytes(model: torch.nn.Module, name: str) -> int:
    """Megatron's traffic per layer each way: two all-reduces of B x T x h."""
    batch, tokens = cov.FAMILIES[name].tokens
    dtype = next(model.parameters()).dtype
    return 2 * batch * tokens * cov.hidden_size(model) * dtype.itemsize


def per_layer(log: Any) -> dict[Optional[int], dict[str, int]]:
    """layer -> collectives and bytes per phase, from a communicator's log (None: outside the
    layers: embeddings, head, the bucketed sum of partial gradients)."""
    table: dict[Optional[int], dict[str, int]] = {}
    for e in log.events:
        row = table.setdefault(e.layer, {"forward": 0, "backward": 0,
                                         "forward_bytes": 0, "backward_bytes": 0})
        row[e.phase] += 1
        row[f"{e.phase}_bytes"] += e.nbytes
    return table


def gloo_case(rank: int, world_size: int, name: str, lr: float = 1e-3) -> dict[str, Any]:
    """``autotp.parallelize`` over the gloo group on ``name``, against an unsharded copy made
    before it: logits, loss and every gradient (gathered with full_state_dict) of one
    forward and backward; then one AdamW step on each and a second forward (logits, loss,
    and every parameter, gathered)."""
    import autotp
    from autotp.verification.verify import compare, max_difference, reference_step, sharded_step

    torch.set_num_threads(1)
    model, kwargs = build(name)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autotp.parallelize(model, tp=world_size, example_kwargs=kwargs)
    call, loss = caller(kwargs), next_token_loss(kwargs["input_ids"])
    want = reference_step(reference, call, loss, logits)
    got = sharded_step(sharded, call, loss, logits)
    first = compare(want, got)
    traffic = per_layer(sharded.comm.log)
    names_match = sorted(got.grads) == sorted(n for n, _ in reference.named_parameters())

    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for params in (sharded.parameters(), reference.parameters()):
        optimizer = torch.optim.AdamW(params, lr=lr)
        optimizer.step()
    full = autotp.full_state_dict(sharded)
    ref_params = dict(reference.named_parameters())
    param_diff = max_difference(ref_params, full)
    step_size = max_difference(before, ref_params)
    with torch.no_grad():
        out, ref_out = sharded(**kwargs), reference(**kwargs)
        second_logits = max_difference(logits(ref_out), logits(out))
        second_loss = abs(float(loss(out)) - float(loss(ref_out)))
    return {
        "logits_diff": first.output_diff, "loss_diff": first.loss_diff,
        "grad_diff": first.grad_diff, "grad_rel": first.grad_rel,
        "worst_param": first.worst_param, "names_match": names_match,
        "traffic": traffic, "megatron_bytes": megatron_bytes(reference, name),
        "param_diff": param_diff, "second_logits_diff": second_logits,
        "second_loss_diff": second_loss, "second_loss": float(loss(ref_out)),
        "first_loss": want.loss, "step_size": step_size,
        "local_params": sum(p.numel() for p in sharded.parameters()),
        "full_params": sum(p.numel() for p in reference.parameters()),
    }
