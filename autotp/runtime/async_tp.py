"""Asynchronous tensor parallelism: torch's micro-pipeline pass over a compiled rank program.

With sequence parallelism a column-parallel product reads an all-gathered input and a
row-parallel product's partial sums are reduce-scattered. Inductor's micro-pipeline pass
(``torch._inductor.config._micro_pipeline_tp``) finds those all-gather -> matmul and
matmul -> reduce-scatter pairs in the compiled graph and replaces each with a fused op of
``torch.ops.symm_mem`` that splits the product into tp pieces and overlaps each piece's
compute with the transfer of the next, over symmetric memory (peer-to-peer buffers between
the GPUs of one node). The rank program compiles whole (``autotp.runtime.comm``: traceable
collectives), so the pass sees every pair.

What it needs, each checked by ``compile_options`` with an error that says what to change:
``compile=`` (it is a pass of inductor, the default backend), sequence parallelism (without
it a tensor-parallel program has all-reduces, which the pass does not touch), ranks in
processes on CUDA GPUs with an NCCL group, and symmetric memory for that group (torch's
CUDA build; ``enable_symm_mem_for_group`` is called here).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from autotp.errors import ConfigError
from autotp.runtime.comm import Communicator, ProcessGroupComm

PASS = "_micro_pipeline_tp"  # the inductor option that turns the pass on


def refuse_where_it_cannot_run(compile: Any, comm: Optional[Communicator],
                               sequence_parallel: bool,
                               device: Optional[torch.device] = None) -> None:
    """A ConfigError saying what to change where async_tp=True cannot run: checked by
    ``parallelize`` and ``simulate`` before tracing (``comm`` None: simulated ranks;
    ``device`` None: not known yet), and again on the rank's placed parameters."""
    if not compile:
        raise ConfigError("async_tp=True is a pass of inductor over the compiled rank "
                          "program: pass compile=True (or a dict of torch.compile options) "
                          "too")
    options = compile if isinstance(compile, dict) else {}
    backend = options.get("backend", "inductor")
    if backend != "inductor":
        raise ConfigError(f"async_tp=True runs in inductor, but compile= asks for the backend "
                          f"{backend!r}: leave out 'backend' or use 'inductor'")
    if not sequence_parallel:
        raise ConfigError("async_tp=True overlaps the all-gathers before column-parallel "
                          "products and the reduce-scatters after row-parallel ones, which "
                          "only sequence parallelism has: pass sequence_parallel=True too")
    if not isinstance(comm, ProcessGroupComm):
        raise ConfigError("async_tp=True needs ranks in processes (torchrun) on CUDA GPUs "
                          "with an NCCL group; a simulation's ranks are threads")
    if comm.backend == "gloo" or (device is not None and device.type != "cuda"):
        where = f"on {device} " if device is not None else ""
        raise ConfigError(f"async_tp=True needs CUDA GPUs and an NCCL group (symmetric "
                          f"memory between the GPUs); this rank runs {where}with "
                          f"{comm.backend}: leave async_tp off here")


def compile_options(compile: Any, comm: Communicator, sequence_parallel: bool,
                    device: torch.device) -> dict[str, Any]:
    """``compile``'s torch.compile options with the micro-pipeline pass on, after checking
    that it can run here (``device``: where the rank's parameters live), and symmetric
    memory enabled for ``comm``'s group."""
    refuse_where_it_cannot_run(compile, comm, sequence_parallel, device)
    options = dict(compile) if isinstance(compile, dict) else {}
    assert isinstance(comm, ProcessGroupComm)  # refuse_where_it_cannot_run checked it
    _enable_symmetric_memory(comm.group_name)
    # torch.compile takes a mode or inductor options, not both: a mode becomes its options
    mode = options.pop("mode", None)
    inductor = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    inductor.update(options.get("options") or {})
    inductor[PASS] = True
    return {**options, "options": inductor}


def _enable_symmetric_memory(group_name: Any) -> None:
    try:
        from torch.distributed import _symmetric_memory
    except ImportError as exc:
        raise ConfigError(f"async_tp=True needs torch's symmetric memory "
                          f"(torch.distributed._symmetric_memory), which this torch "
                          f"({torch.__version__}) lacks: {exc}") from None
    try:
        with warnings.catch_warnings():
            # torch marks the call deprecated, yet its pass still asks whether the group
            # has symmetric memory
            warnings.simplefilter("ignore", FutureWarning)
            _symmetric_memory.enable_symm_mem_for_group(group_name)
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise ConfigError(f"async_tp=True: symmetric memory could not be enabled for the "
                          f"tensor-parallel group ({type(exc).__name__}: {exc}); it needs "
                          f"GPUs of one node with peer access and torch's CUDA build") from None
