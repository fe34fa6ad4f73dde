"""Functions run inside real worker processes by ``autotp.launch.run_processes``."""

from __future__ import annotations

from typing import Any

import torch


def equivalence_case(rank: int, world_size: int, name: str, labels: bool = False
                     ) -> dict[str, Any]:
    """parallelize ``name`` over the gloo group; compare with the unsharded model.

    With ``labels`` the model computes its own loss (HF ``labels=``) from gathered logits.
    """
    import autotp
    from autotp.verify import compare, layer_counts, reference_step, sharded_step
    from models import BUILDERS, batch, example, loss_of, main_output

    torch.set_num_threads(1)
    model = BUILDERS[name]()
    args, kwargs = example(name)
    if labels:
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    sharded = autotp.parallelize(model, tp=world_size, example_args=args,
                                 example_kwargs=kwargs)
    ids = batch()

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
