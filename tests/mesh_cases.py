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
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from tests import models
    from tests.context_cases import on_dp_cp_tp

    seen: dict[str, Any] = {}

    def build(model: torch.nn.Module, mesh: Any, mine: dict) -> Any:
        seen.update(mesh=mesh, mine=mine)
        return autotp.parallelize(model, mesh=mesh, example_kwargs=mine)

    sharded, result = on_dp_cp_tp(world_size, steps, build)
    mesh, mine = seen["mesh"], seen["mine"]
    context = sharded.plan.on("cp")
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


def dp_tp_sequence_parallel(rank: int, world_size: int) -> dict[str, Any]:
    """A (dp, tp) = (2, 2) DeviceMesh with sequence parallelism, nothing wrapped around the
    sharded model: the norms' weights have partial gradients, summed over tp by the bucket
    after backward and averaged over dp by autotp (``average_over``). Two backwards of two
    micro-batches each without zeroing (accumulation) against the unsharded model's two
    backwards on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from tests import models

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    ids = torch.randint(0, models.VOCAB, (4, 16), generator=torch.Generator().manual_seed(5))
    mine = ids.chunk(2)[mesh["dp"].get_local_rank()]
    reference = models.llama()
    sharded = autotp.parallelize(models.llama(), mesh=mesh, sequence_parallel=True,
                                 example_kwargs={"input_ids": mine, "labels": mine})
    for _ in range(2):
        sharded(input_ids=mine, labels=mine).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    diffs = {name: (grads[name] - p.grad).abs().max().item()
             for name, p in reference.named_parameters()}
    return {"diffs": diffs, "deferred": sorted(sharded._bucket.params)}
