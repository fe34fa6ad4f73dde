"""What the tools around a model read of it, on the sharded module.

transformers' Trainer and accelerate treat a model sharded by tensor parallelism by what it
says of itself: ``tp_size`` (> 1: no DDP wrap, every rank of a tensor-parallel group gets
the same batches, ``num_items_in_batch`` counted once per group) and
``config.distributed_config.dp_size`` (the ranks with distinct batches). The sharded module
says so (``ShardedModule.tp_size``; ``describe`` gives it the model's config with a
``distributed_config``, and the attributes Trainer reads to compute the loss:
``main_input_name``, ``accepts_loss_kwargs``, ``loss_type``). The model's config object is
not changed: the module holds a shallow copy. In CPU processes, accelerate's check that
keeps tensor parallelism to accelerators is widened (``admit_cpu_tensor_parallel``).
"""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from autotp.runtime.comm import ProcessGroupComm

# read by transformers' Trainer off the model it trains; copied where the model has them
TRAINER_ATTRIBUTES = ("main_input_name", "accepts_loss_kwargs", "loss_type")


def distributed_config(tp: int, dp: int) -> Any:
    """transformers' ``DistributedConfig`` of a model split tp ways with dp replicas (its
    ``dp_size`` is what Trainer reads); where transformers' has no replicas (before 5.2x's
    ``dp_size``), the sizes alone, as Trainer there reads ``fsdp_size`` off the model."""
    import importlib

    try:
        found: Any = importlib.import_module("transformers.distributed.configuration_utils")
    except ImportError:
        found = None
    made = getattr(found, "DistributedConfig", None)
    if made is not None and "dp_replicate_size" in inspect.signature(made).parameters:
        return made(tp_size=tp, dp_replicate_size=dp)
    return SimpleNamespace(tp_size=tp, dp_replicate_size=dp, fsdp_size=1, dp_size=dp)


def describe(sharded: Any, model: nn.Module, data_parallel: Optional[Any]) -> None:
    """Give ``sharded`` the model's attributes Trainer reads, and its config with the
    parallel sizes (``data_parallel``: the data-parallel group, or None)."""
    for name in TRAINER_ATTRIBUTES:
        if hasattr(model, name):
            object.__setattr__(sharded, name, getattr(model, name))
    tp = sharded.plan.degree
    config = getattr(model, "config", None)
    config = copy.copy(config) if config is not None else None
    if tp > 1:
        dp = dist.get_world_size(data_parallel) if data_parallel is not None else 1
        # a model of other code than transformers has no config (or one of its own): Trainer
        # reads only the parallel sizes of it
        config = config if config is not None else SimpleNamespace()
        sizes = distributed_config(tp, dp)
        try:
            config.distributed_config = sizes
        except (AttributeError, TypeError):  # a frozen config of the model's own
            pass
        if isinstance(sizes, SimpleNamespace):  # transformers < 5.2x's Trainer reads this
            object.__setattr__(sharded, "fsdp_size", dp)
        if isinstance(sharded.comm, ProcessGroupComm) and sharded._device().type == "cpu":
            admit_cpu_tensor_parallel()
    if config is not None:
        object.__setattr__(sharded, "config", config)


def admit_cpu_tensor_parallel() -> None:
    """Let accelerate run a tensor-parallel model in CPU processes (gloo).

    accelerate builds its tensor-parallel mesh and its data loading (the same batches on
    every rank of a tensor-parallel group) for any device type, but its config check admits
    tensor parallelism on accelerators only: transformers' Trainer, given a model with a
    ``tp_size``, would refuse to start in CPU processes. The check is widened for CPU
    processes (``DistributedType.MULTI_CPU``) alone, once per process; nothing else in
    accelerate changes. Without accelerate installed there is nothing to do."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    check = ParallelismConfig._validate_accelerator
    if getattr(check, "autotp_cpu", False):
        return

    def validate(self: Any, accelerator: Any) -> Any:
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            return check(self, accelerator)
        kind = type(accelerator)
        saved = kind.__dict__.get("multi_device")
        kind.multi_device = property(lambda _: True)  # what the check asks of the device
        try:
            return check(self, accelerator)
        finally:
            if saved is None:
                del kind.multi_device
            else:
                kind.multi_device = saved

    validate.autotp_cpu = True  # type: ignore[attr-defined]
    ParallelismConfig._validate_accelerator = validate  # type: ignore[method-assign]
