"""The parallel axes of a job as data, built once at the API edge.

A ``Mesh`` holds one ``Axis`` per name of ``AXES`` (degree 1 where the job has none): its
degree, its process group and communicator (None when planned or simulated) and, for the
sequence axis, how the sequence is cut over its ranks. ``resolve_mesh`` is the one place
that turns what a caller gave (a torch ``DeviceMesh`` with named dims, or the degrees and
groups ``tp=``, ``cp=``, ``ep=``, ``group=``, ``cp_group=``, ``ep_group=``) into a mesh, and
refuses, with one ``ConfigError`` each, a dim name autotp does not know, a degree that is
not the size of its mesh dim, group or world, and axes that do not compose.

autotp plans over "tp" and "cp" and splits experts over "ep"; "dp" is left to the caller's
FSDP2 or DDP and "pp" to ``autotp.pipeline_stages``. The rank program runs its plan over one
axis (``Mesh.plan_axis``) and at most one other beside it (``Mesh.outer_axis``): the API
and the command line ask the mesh which, rather than whether cp is on and tp is 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from autotp.errors import ConfigError
from autotp.ops import positive_int
from autotp.runtime.comm import Communicator, ProcessGroupComm, ThreadComm, ThreadHub
from autotp.runtime.ring import SequenceLayout, held_sequence

AXES = ("dp", "pp", "cp", "tp", "ep")
# what autotp does on each axis
ROLES = {"dp": "data parallelism, left to your FSDP2 or DDP",
         "pp": "pipeline stages (autotp.pipeline_stages)",
         "cp": "context parallelism: the sequence split",
         "tp": "tensor parallelism: the plan's layouts",
         "ep": "expert parallelism: the experts split"}


@dataclass(frozen=True)
class Axis:
    """One mesh axis: ``degree`` ranks; ``group`` their process group (a 1-D DeviceMesh
    where the caller gave one) and ``comm`` autotp's communicator over it, both None when
    planned or simulated."""

    name: str
    degree: int = 1
    group: Any = None
    comm: Optional[Communicator] = None

    @property
    def layout(self) -> Optional[SequenceLayout]:
        """On the sequence axis ("cp"): rank r holds chunks r and 2 cp - 1 - r of 2 cp, the
        same causal work on every rank. None on the others."""
        return held_sequence(self.degree) if self.name == "cp" else None

    def process_group(self) -> Any:
        """The torch process group (the group of a 1-D DeviceMesh)."""
        from torch.distributed.device_mesh import DeviceMesh

        return self.group.get_group() if isinstance(self.group, DeviceMesh) else self.group


@dataclass(frozen=True)
class Spelling:
    """How an error names a degree and an option: as Python keywords (``cp=2``,
    ``sequence_parallel``) or as the command line's flags (``--cp 2``)."""

    flags: bool = False

    def degree(self, name: str, value: Any) -> str:
        return f"--{name} {value}" if self.flags else f"{name}={value}"

    def option(self, name: str) -> str:
        return "--" + name.replace("_", "-") if self.flags else name


PYTHON, FLAGS = Spelling(False), Spelling(True)


@dataclass(frozen=True)
class Mesh:
    """Every axis of ``AXES``, in that order. ``distributed``: the axes are process groups
    (a group None is the whole world), else degrees only (planned or simulated)."""

    axes: tuple[Axis, ...]
    distributed: bool = False

    def __getitem__(self, name: str) -> Axis:
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise KeyError(name)

    def __iter__(self) -> Iterator[Axis]:
        return iter(self.axes)

    @classmethod
    def of(cls, axes: dict[str, Axis], distributed: bool = False) -> "Mesh":
        """The mesh of ``axes`` (name -> axis), every other axis of degree 1."""
        return cls(tuple(axes.get(name, Axis(name)) for name in AXES), distributed)

    def degree(self, name: str) -> int:
        return self[name].degree

    @property
    def tp(self) -> int:
        return self["tp"].degree

    @property
    def cp(self) -> int:
        return self["cp"].degree

    @property
    def ep(self) -> int:
        return self["ep"].degree

    @property
    def plan_axis(self) -> Axis:
        """The axis the plan's own degree runs over: "tp", or "cp" where tp is 1 (the plan
        of the cp group is then the whole plan, ``autotp.planner.context``)."""
        return self["cp"] if self.tp == 1 and self.cp > 1 else self["tp"]

    @property
    def outer_axis(self) -> Optional[Axis]:
        """The axis beside the plan's whose ranks each run a copy of it: "cp" inside tp,
        or "ep"; None where there is none."""
        for axis in (self["cp"], self["ep"]):
            if axis.degree > 1 and axis is not self.plan_axis:
                return axis
        return None

    @property
    def sample_axes(self) -> tuple[Axis, ...]:
        """The axes whose ranks compute the same samples together (tp and cp; not the
        data-parallel ep): they share one dropout stream."""
        outer = self.outer_axis
        return (self.plan_axis,) + ((outer,) if outer is not None and outer.name == "cp"
                                    else ())

    @property
    def mean_group(self) -> Any:
        """The "dp" group autotp averages the gradients over after a backward that no DDP or
        FSDP2 reduces (``ShardedModule.average_over``); None without a dp axis of several
        ranks, and with cp or ep, where the caller reduces over dp (FSDP2 over dp x cp;
        ``finish_expert_gradients``)."""
        dp = self["dp"]
        if dp.degree == 1 or self.cp > 1 or self.ep > 1:
            return None
        return dp.process_group()

    def connected(self, timeout: Optional[float]) -> "Mesh":
        """This mesh with a communicator over the group of each axis autotp runs collectives
        on (the plan's, and tp, cp or ep of more than one rank)."""
        if not self.distributed:
            return self
        return self._with_comms({
            axis.name: ProcessGroupComm(axis.process_group(), timeout=timeout)
            for axis in self.axes
            if axis.name in ("tp", "cp", "ep") and (axis.degree > 1 or axis is self.plan_axis)})

    def simulated(self, timeout: float) -> list["Mesh"]:
        """One mesh per rank simulated in this process, its axes' communicators in-memory:
        rank ``c * n + r`` is rank r of the plan's axis (n ranks) in copy c of the axis
        beside it."""
        inner, outer = self.plan_axis, self.outer_axis
        copies = 1 if outer is None else outer.degree
        outer_hubs = [ThreadHub(copies, timeout) for _ in range(inner.degree)]
        meshes = []
        for c in range(copies):
            for comm in ThreadHub(inner.degree, timeout).comms():
                comms: dict[str, Communicator] = {inner.name: comm}
                if outer is not None:
                    comms[outer.name] = ThreadComm(outer_hubs[comm.rank], c)
                meshes.append(self._with_comms(comms))
        return meshes

    def _with_comms(self, comms: dict[str, Communicator]) -> "Mesh":
        """This mesh with ``comms`` (axis name -> communicator)."""
        axes = []
        for axis in self.axes:
            comm = comms.get(axis.name)
            if comm is not None:
                axis = replace(axis, comm=comm)
            axes.append(axis)
        return Mesh(tuple(axes), self.distributed)

    def rank_comms(self) -> "RankComms":
        """``build_rank``'s communicators: the plan's and the one beside it."""
        comm, outer = self.plan_axis.comm, self.outer_axis
        if comm is None:
            raise ConfigError("this mesh has no communicators: connect it (Mesh.connected) "
                              "or simulate it (Mesh.simulated) first")
        return RankComms(comm, cp_comm=outer.comm if outer and outer.name == "cp" else None,
                         ep_comm=outer.comm if outer and outer.name == "ep" else None)


@dataclass(frozen=True)
class RankComms:
    """What one rank's program communicates over: its plan's group (``comm``) and the group
    beside it, of context (``cp_comm``) or expert (``ep_comm``) parallelism."""

    comm: Communicator
    cp_comm: Optional[Communicator] = None
    ep_comm: Optional[Communicator] = None


Share = Callable[[str, Callable[[], str]], str]  # ``plan_graph``'s share=


def plan_sharing(comm: Optional[Communicator]) -> Optional[Share]:
    """How ranks that plan the same program share it: over a process group of several
    ranks, its rank 0 plans and the others receive the plan (``made_once``); None (each
    plans alone) for one rank, or ranks simulated in one process."""
    if isinstance(comm, ProcessGroupComm) and comm.world_size > 1:
        return comm.made_once
    return None


# ---- from what the caller gave --------------------------------------------------------------


def resolve_mesh(*, mesh: Any = None, tp: Optional[int] = None, cp: Optional[int] = None,
                 ep: Optional[int] = None, group: Any = None, cp_group: Any = None,
                 ep_group: Any = None, sequence_parallel: bool = False,
                 distributed: bool = False, spelling: Spelling = PYTHON) -> Mesh:
    """The mesh of a job, checked: from ``mesh`` (a DeviceMesh whose dim names are among
    ``AXES``; ``tp``/``cp``/``ep`` then only confirm its sizes) or from the degrees and
    groups. ``distributed``: the axes get process groups (default: the world, split into tp
    groups of consecutive ranks and cp or ep groups across them; collective), else only
    degrees (planned or simulated)."""
    if mesh is not None:
        if group is not None or cp_group is not None or ep_group is not None:
            raise ConfigError("pass mesh= or the groups (group=, cp_group=, ep_group=), not "
                              "both: with mesh= every group is one of its dims")
        resolved = _from_device_mesh(mesh, tp, cp, ep, spelling)
    elif distributed:
        resolved = _from_groups(tp, cp, ep, group, cp_group, ep_group, spelling)
    else:
        if group is not None or cp_group is not None or ep_group is not None:
            raise ConfigError("groups are for autotp.parallelize (a process group); planning "
                              "and simulation take the degrees tp=, cp=, ep=")
        resolved = Mesh.of({name: Axis(name, positive_int(spelling.option(name), degree))
                            for name, degree in (("tp", tp), ("cp", cp), ("ep", ep))
                            if degree is not None})
    check_axes(resolved, sequence_parallel=sequence_parallel, spelling=spelling)
    return resolved


def check_axes(mesh: Mesh, *, sequence_parallel: bool = False,
               spelling: Spelling = PYTHON) -> None:
    """Axes that do not compose, each refused with what to change."""
    s = spelling
    if mesh.cp > 1 and mesh.ep > 1:
        raise ConfigError(
            f"{s.degree('cp', mesh.cp)} with {s.degree('ep', mesh.ep)}: expert parallelism "
            "across context-parallel ranks is not there yet; pass no ep with cp (or "
            f"{s.degree('cp', 1)})")
    if mesh.cp > 1 and mesh.tp == 1 and sequence_parallel:
        raise ConfigError(
            f"{s.degree('cp', mesh.cp)} with {s.option('sequence_parallel')} at "
            f"{s.degree('tp', 1)}: context parallelism shards the sequence itself; pass "
            f"{s.option('sequence_parallel')} only with tp > 1 (inside cp), or no cp")
    if mesh.degree("pp") > 1:
        raise ConfigError(
            f"the mesh has a pp axis of {mesh.degree('pp')} ranks, and parallelize builds "
            "the whole model on every rank: build the stages with "
            "autotp.pipeline_stages(model, mesh), or pass a mesh without pp")


def _from_device_mesh(device_mesh: Any, tp: Optional[int], cp: Optional[int],
                      ep: Optional[int], spelling: Spelling) -> Mesh:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise ConfigError(f"mesh= takes a torch DeviceMesh (init_device_mesh(..., "
                          f"mesh_dim_names=(...))), got {type(device_mesh).__name__}")
    names = tuple(device_mesh.mesh_dim_names or ())
    if not names:
        raise ConfigError("mesh= needs a DeviceMesh with named dims: init_device_mesh(device, "
                          f"shape, mesh_dim_names=...), names among {', '.join(AXES)}")
    unknown = [n for n in names if n not in AXES]
    if unknown:
        known = "; ".join(f"{n}: {ROLES[n]}" for n in AXES)
        raise ConfigError(
            f"the DeviceMesh has dim(s) {', '.join(map(repr, unknown))}, which autotp does "
            f"not know ({known}): name the dims among these, or pass the tensor-parallel "
            "axis alone as group=mesh['tp']")
    axes = {n: Axis(n, device_mesh.size(names.index(n)), device_mesh[n]) for n in names}
    if "tp" not in axes:  # the plan runs over one rank: a group of this rank alone
        axes["tp"] = Axis("tp", 1)
    for name, given in (("tp", tp), ("cp", cp), ("ep", ep)):
        have = axes[name].degree if name in axes else 1
        if given is not None and positive_int(spelling.option(name), given) != have:
            raise ConfigError(
                f"{spelling.degree(name, given)} but the mesh's {name!r} dim has {have} "
                f"rank(s): pass {spelling.degree(name, have)} or leave it out (the mesh "
                "gives it)")
    if "tp" not in names and ("cp" not in axes or axes["cp"].degree == 1):
        axes["tp"] = Axis("tp", 1, _own_group())
    return Mesh.of(axes, distributed=True)


def _own_group() -> Any:
    """A group of this rank alone (collective: every rank creates every one, in order)."""
    mine = None
    for rank in range(dist.get_world_size()):
        made = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = made
    return mine


def _from_groups(tp: Optional[int], cp: Optional[int], ep: Optional[int], group: Any,
                 cp_group: Any, ep_group: Any, spelling: Spelling) -> Mesh:
    """``parallelize``'s mesh from the degrees and groups it was given (the world by
    default); each degree checked against its group."""
    from autotp.runtime.grads import data_parallel_group

    cp = 1 if cp is None else positive_int("cp", cp)
    if cp_group is not None and cp == 1:
        raise ConfigError("cp_group= without cp=: pass cp, the size of the group")
    dp = data_parallel_group(group)
    dp_axis = Axis("dp", dist.get_world_size(dp), dp) if dp is not None else Axis("dp")
    if cp > 1:
        if ep not in (None, 1) or ep_group is not None:
            raise ConfigError("cp with ep: expert parallelism across context-parallel ranks "
                              "is not there yet; pass no ep with cp")
        tp = 1 if tp is None and group is None else tp
        group, cp_group = _context_groups(tp, cp, group, cp_group)
        _check_size("cp", cp, cp_group, "cp_group", "mesh['cp']")
        size = 1 if group is None else dist.get_world_size(_process_group(group))
        tp = size if tp is None else positive_int("tp", tp)
        if tp != size:
            raise ConfigError(f"tp={tp} with cp={cp}, but the tensor-parallel group has "
                              f"{size} ranks: pass group= a group of {tp} ranks (e.g. "
                              f"mesh['tp']), or tp={size}")
        return Mesh.of({"dp": dp_axis, "tp": Axis("tp", tp, group), "cp": Axis("cp", cp, cp_group)},
                       distributed=True)
    tp_group, ep_group = _expert_groups(tp, ep, group, _process_group(ep_group))
    world = dist.get_world_size(_process_group(tp_group))
    tp = world if tp is None else positive_int("tp", tp)
    if tp != world:
        raise ConfigError(
            f"tp={tp} but the process group has {world} ranks: pass group= a tensor-parallel "
            f"group of {tp} ranks (e.g. from a DeviceMesh), or tp={world}")
    axes = {"dp": dp_axis, "tp": Axis("tp", tp, tp_group)}
    if ep_group is not None:
        axes["ep"] = Axis("ep", dist.get_world_size(ep_group), ep_group)
    return Mesh.of(axes, distributed=True)


def _process_group(group: Any) -> Any:
    """A process group, or the group of a 1-D DeviceMesh (``mesh["tp"]``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ConfigError(
                f"group= takes a 1-D DeviceMesh, the tensor-parallel axis (e.g. mesh['tp']); "
                f"this one has dims {group.mesh_dim_names or group.ndim}: pass the whole "
                "mesh as mesh= instead")
        return group.get_group()
    return group


def _check_size(name: str, degree: int, group: Any, keyword: str, example: str) -> None:
    size = dist.get_world_size(_process_group(group))
    if size != degree:
        raise ConfigError(f"{name}={degree} but the context-parallel group has {size} ranks: "
                          f"pass {keyword}= a group of {degree} ranks (e.g. {example}), or "
                          f"{name}={size}")


def _context_groups(tp: Optional[int], cp: int, group: Any, cp_group: Any
                    ) -> tuple[Any, Any]:
    """The tp group (None with tp 1) and the cp group (default at tp 1: the world). Given
    neither at tp > 1, the world's tp * cp ranks form tp groups of consecutive ranks and cp
    groups of the ranks at the same place in each, tp innermost as in a (dp, cp, tp) mesh
    (collective: every rank creates every group)."""
    if tp == 1:
        if group is not None:
            raise ConfigError("group= with tp=1 and cp: the cp group is cp_group=")
        return None, cp_group
    if group is not None and cp_group is not None:
        return group, cp_group
    if group is not None or cp_group is not None:
        raise ConfigError("tp with cp: pass both group= and cp_group= (e.g. mesh['tp'] and "
                          "mesh['cp'] of a (dp, cp, tp) DeviceMesh), or neither to split the "
                          "world, or the whole mesh as mesh=")
    return _split_world(tp, cp, "cp")


def _expert_groups(tp: Optional[int], ep: Optional[int], group: Any, ep_group: Any
                   ) -> tuple[Any, Any]:
    """The tp group and the ep group (None without expert parallelism). Given ``ep`` and no
    groups, the world's tp * ep ranks form tp groups of consecutive ranks and ep groups of
    the ranks at the same place in each (collective: every rank creates every group)."""
    if ep is not None:
        ep = positive_int("ep", ep)
    if ep_group is not None:
        size = dist.get_world_size(ep_group)
        if ep is not None and ep != size:
            raise ConfigError(f"ep={ep} but ep_group has {size} ranks: pass ep={size}, or an "
                              f"ep_group of {ep} ranks")
        if group is None:  # the default group, the world, would hold the ep ranks' tokens too
            raise ConfigError("with ep_group=, pass group= too: the tensor-parallel ranks "
                              "(e.g. mesh['tp'] beside mesh['dp'])")
        return group, ep_group
    if ep is None or ep == 1:
        return group, None
    if group is not None:
        raise ConfigError(f"ep={ep} with a tp group= needs ep_group=, the ranks the experts "
                          "are split over (e.g. mesh['dp'] of a (dp, tp) DeviceMesh)")
    return _split_world(tp, ep, "ep")


def _split_world(tp: Optional[int], outer: int, name: str) -> tuple[Any, Any]:
    """The world's tp * ``outer`` ranks as tp groups of consecutive ranks and groups of the
    ranks at the same place in each (``name``: "ep" or "cp"), tp by default the rest of the
    world (collective)."""
    world = dist.get_world_size()
    tp = world // outer if tp is None else positive_int("tp", tp)
    if tp * outer != world:
        raise ConfigError(f"tp={tp} x {name}={outer} = {tp * outer} ranks, but the world has "
                          f"{world}: pass tp and {name} whose product is {world}, or group= "
                          f"and {name}_group=")
    return _grid_groups(tp, outer)


def _grid_groups(inner: int, outer: int) -> tuple[Any, Any]:
    """This rank's group of ``inner`` consecutive ranks and its group of the ``outer`` ranks
    at its place in each (collective: every rank creates every group, in the same order)."""
    world, rank = inner * outer, dist.get_rank()
    mine: Any = None
    mine_outer: Any = None
    for first in range(0, world, inner):
        made = dist.new_group(list(range(first, first + inner)))
        if first <= rank < first + inner:
            mine = made
    for offset in range(inner):
        made = dist.new_group(list(range(offset, world, inner)))
        if rank % inner == offset:
            mine_outer = made
    return mine, mine_outer
