"""Functions run inside real worker processes by ``autotp.launch.run_processes``."""

from __future__ import annotations

from typing import Any

import torch


def equivalence_case(rank: int, world_size: int, name: str, labels: bool = False,
                     device: str = "cpu") -> dict[str, Any]:
    """parallelize ``name`` over the gloo group; compare with the unsharded model.

    With ``labels`` the model computes its own loss (HF ``labels=``) from gathered logits.
    ``device="cuda"``: model and inputs on the GPU (every rank on the same one).
    """
    import autotp
    from autotp.verify import compare, layer_counts, reference_step, sharded_step
    from models import BUILDERS, batch, example, loss_of, main_output

    torch.set_num_threads(1)
    model = BUILDERS[name]().to(device)
    args, kwargs = example(name)
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    if labels:
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    sharded = autotp.parallelize(model, tp=world_size, example_args=args,
                                 example_kwargs=kwargs)
    ids = batch().to(device)

    def call(m: torch.nn.Module) -> Any:
        return m(ids, labels=ids) if labels else m(ids)

    def loss(out: Any) -> torch.Tensor:
        return out.loss if labels else loss_of(out, ids)

    reference = reference_step(model, call, loss, main_output)
    got = sharded_step(sharded, call, loss, main_output)
    cmp = compare(reference, got)
    local = sum(p.numel() for p in sharded.parameters())
    return {
        "output_diff": cmp.output_diff,
        "loss_diff": cmp.loss_diff,
        "grad_diff": cmp.grad_diff,
        "grad_rel": cmp.grad_rel,
        "worst_param": cmp.worst_param,
        "counts": {(-1 if k is None else k): v for k, v in layer_counts(sharded.comm.log).items()},
        "local_params": local,
        "full_params": sum(p.numel() for p in model.parameters()),
    }


def vocab_sequence_case(rank: int, world_size: int, name: str, sequence_parallel: bool
                        ) -> dict[str, Any]:
    """HF ``labels=`` loss on vocabulary-sharded logits (returned sharded), optionally with
    sequence parallelism; compared with the unsharded model."""
    import torch.distributed as dist

    import autotp
    from autotp.verify import compare, reference_step, sharded_step
    from models import BUILDERS, VOCAB, batch

    torch.set_num_threads(1)
    model = BUILDERS[name]()
    example = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    sharded = autotp.parallelize(model, tp=world_size,
                                 example_kwargs={"input_ids": example, "labels": example},
                                 sequence_parallel=sequence_parallel, gather_outputs=False)
    ids = batch(t=12)

    def call(m: torch.nn.Module) -> Any:
        return m(input_ids=ids, labels=ids)

    reference = reference_step(model, call, lambda out: out.loss, lambda out: out.logits)
    got = sharded_step(sharded, call, lambda out: out.loss, lambda out: out.logits)
    pieces = [torch.empty_like(got.output) for _ in range(world_size)]
    dist.all_gather(pieces, got.output.contiguous())
    got.output = torch.cat(pieces, dim=-1)  # the logits are sharded over the vocabulary
    cmp = compare(reference, got)
    kinds: dict[str, dict[str, dict[str, int]]] = {}
    for e in sharded.comm.log.events:
        phase = kinds.setdefault(str(e.layer), {}).setdefault(e.phase, {})
        phase[e.kind] = phase.get(e.kind, 0) + 1
    return {
        "logits_diff": cmp.output_diff, "loss_diff": cmp.loss_diff, "grad_diff": cmp.grad_diff,
        "grad_rel": cmp.grad_rel, "kinds": kinds,
        "largest_collective": max(e.nbytes for e in sharded.comm.log.events),
        "logits_bytes": ids.numel() * VOCAB * 4,
    }


def reduce_scatter_case(rank: int, world_size: int, native: bool = True,
                        device: str = "cpu") -> dict[str, Any]:
    """ProcessGroupComm.reduce_scatter (native, or the all-reduce-and-slice path of gloo
    builds without one) and all_gather along dims 0 and 1: the results, and the input left
    untouched. On CUDA with NCCL this is the *_single path."""
    from autotp.comm import ProcessGroupComm

    if device == "cuda":  # NCCL: one GPU per rank
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    comm = ProcessGroupComm()
    comm.native_reduce_scatter = native
    base = torch.arange(8.0 * world_size, device=device).reshape(4 * world_size, 2)
    x = base * (rank + 1)
    before = x.clone()
    out = comm.reduce_scatter(x, 0)
    total = sum(r + 1 for r in range(world_size)) * base
    expected = total.chunk(world_size, 0)[rank]
    piece = torch.full((2, 3), float(rank), device=device)
    gathered = comm.all_gather(piece, 1)
    return {"result_ok": bool(torch.equal(out, expected)),
            "input_kept": bool(torch.equal(x, before)),
            "gather_ok": bool(torch.equal(gathered, torch.cat(
                [torch.full((2, 3), float(r), device=device) for r in range(world_size)],
                dim=1)))}

