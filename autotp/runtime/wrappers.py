"""Wrappers around a sharded module, refused over the wrong ranks.

DDP and FSDP assume the ranks of their group hold the same model. Tensor-parallel peers hold
different shards under the same names and shapes: DDP's start-up broadcast copies one rank's
shards over the others' and its gradient average mixes them; FSDP gathers a "whole"
parameter from pieces of different shards. Nothing fails: the model trains on wrong
weights. ``WrapperCheck`` looks at every forward for the wrappers around the module (the DDP
running it, the DTensor parameters FSDP2 holds) and refuses one whose group takes in two
tensor-parallel peers, naming the groups. Over the data-parallel ranks they are fine.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from autotp.errors import ConfigError
from autotp.runtime.comm import ProcessGroupComm


def group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group (None: the world)."""
    return list(dist.get_process_group_ranks(group if group is not None
                                             else dist.group.WORLD))


class WrapperCheck:
    """Refuses, at the first forward through them, DDP and FSDP2 over tensor-parallel
    peers of ``sharded`` (whose communicator is a process group; simulated ranks have no
    wrappers)."""

    def __init__(self, sharded: Any):
        self.sharded = sharded
        self.seen: set[int] = set()  # the DDP objects and device meshes already checked
        self.ddp_over_dp = False  # a DDP runs the current forward (over dp: else refused)
        self.fsdp = False  # FSDP2 holds the parameters (over dp: else refused)
        # the modules that hold parameters, walked at every forward (FSDP2 swaps their
        # parameters for DTensors, and their class for a subclass of FSDPModule, in place)
        self.owners = [m for m in sharded.modules() if m._parameters]

    def _peers(self) -> Optional[list[int]]:
        comm = self.sharded.comm
        if not isinstance(comm, ProcessGroupComm) or comm.world_size == 1 or \
                self.sharded.plan.tp == 1:  # cp at tp 1: the group holds them whole
            return None
        return group_ranks(comm.group)

    def check(self) -> None:
        peers = self._peers()
        ddp = DistributedDataParallel._get_active_ddp_module()
        self.ddp_over_dp = ddp is not None
        meshes = _fsdp_meshes(self.owners + [self.sharded])
        self.fsdp = bool(meshes)
        if peers is None:
            return
        if ddp is not None and id(ddp) not in self.seen:
            self._refuse("DistributedDataParallel", group_ranks(ddp.process_group), peers,
                         "process_group=")
            self.seen.add(id(ddp))
        for mesh in meshes:
            if id(mesh) not in self.seen:
                self._refuse("FSDP (fully_shard)", mesh.mesh.flatten().tolist(), peers,
                             "mesh=")
                self.seen.add(id(mesh))

    def reduce_over_dp(self) -> bool:
        """Whether a wrapper reduces this forward's gradients over the data-parallel ranks:
        a DDP runs it, or FSDP2 holds the parameters."""
        return self.ddp_over_dp or self.fsdp

    @staticmethod
    def _refuse(what: str, ranks: list[int], peers: list[int], argument: str) -> None:
        common = sorted(set(ranks) & set(peers))
        if len(common) < 2:
            return
        raise ConfigError(
            f"{what} over ranks {sorted(ranks)} wraps the sharded module, but ranks {common} "
            f"are tensor-parallel peers (its group is ranks {peers}): they hold different "
            f"shards of each parameter, which {what} would overwrite or mix. Wrap it over "
            f"the data-parallel ranks instead ({argument}mesh['dp'] of a ('dp', 'tp') "
            "DeviceMesh, whose 'tp' axis is autotp.parallelize's group=); transformers' "
            "Trainer needs no wrapper: it reads the module's tp_size")


def _fsdp_meshes(modules: list[Any]) -> list[Any]:
    """The device meshes FSDP2 shards the parameters of ``modules`` over: those of the
    DTensors they hold between steps and, inside a forward where they are gathered, of
    their parameter groups."""
    meshes = {}
    for sub in modules:
        for p in sub._parameters.values():
            if isinstance(p, DTensor):
                meshes[id(p.device_mesh)] = p.device_mesh
        if isinstance(sub, FSDPModule):
            group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if mesh is not None:
                meshes[id(mesh)] = mesh
    return list(meshes.values())
