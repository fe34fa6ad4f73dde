"""``autotp.parallelize(model, mesh=device_mesh)`` on real gloo processes, run on every rank
of the world: the torchtitan way of naming the axes, against the unsharded model."""

from __future__ import annotations

from typing import Any

import torch


def dp_cp_tp_mesh(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """A (dp, cp, tp) = (2, 2, world / 4) DeviceMesh given whole to ``parallelize``: the tp
    and cp groups are its dims; FSDP2 per layer and at the root over dp x cp (flattened);
    each dp rank takes half the batch (the second sequence of each half left-padded); AdamW
    steps after ``autotp.clip_grad_norm_`` against the unsharded model trained on the whole
    batch. Then the meshes ``parallelize`` refuses, each error's text."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autotp
    from tests import models
    from tests.dist_cases import train_against_reference

    torch.set_num_threads(1)
    dp, cp, tp = 2, 2, world_size // 4
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    model = models.llama().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, models.VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1::2, :3] = 0
    half = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    mine = {"input_ids": ids[half], "attention_mask": mask[half], "labels": ids[half]}
    sharded = autotp.parallelize(model, mesh=mesh, example_kwargs=mine)
    both = mesh["dp", "cp"]._flatten("dp_cp")
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=both)
    fully_shard(sharded, mesh=both)
    whole = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    result = train_against_reference(sharded, reference, mine, whole, steps,
                                     mesh["dp"].get_group(), dp)
    context = sharded.plan.context or sharded.plan
    result.update(
        rings=sum(c.strategy.endswith("[ring]") for c in context.choices.values()),
        ranks=(sharded.comm.rank, sharded.cp_comm.rank),
        degrees=(sharded.plan.tp, sharded.plan.cp))
    errors = {}
    bad = {
        "unknown dim": lambda: init_device_mesh("cpu", (2, world_size // 2),
                                                mesh_dim_names=("fsdp", "tp")),
        "tp degree": lambda: mesh,
        "mesh and group": lambda: mesh,
        "cp with ep": lambda: init_device_mesh("cpu", (2, world_size // 2),
                                               mesh_dim_names=("cp", "ep")),
        "pp": lambda: init_device_mesh("cpu", (2, world_size // 2),
                                       mesh_dim_names=("pp", "tp")),
    }
    extra = {"tp degree": {"tp": 4}, "mesh and group": {"group": mesh["tp"]}}
    for name, make in bad.items():
        try:
            autotp.parallelize(models.llama(), mesh=make(), example_kwargs=mine,
                               **extra.get(name, {}))
            errors[name] = "no error"
        except autotp.ConfigError as exc:
            errors[name] = str(exc)
    result["errors"] = errors
    return result
