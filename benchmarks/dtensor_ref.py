"""The benchmark models under torch's DTensor tensor parallelism (``parallelize_module``).

``parallelize(model, mesh, prepare_inputs=False)`` deep-copies the unsharded model and applies
the plan of torch's tensor-parallel recipe (the torch TP tutorial / torchtitan, without
sequence parallelism):

    q/k/v, up/gate            ColwiseParallel()
    o, down                   RowwiseParallel()
    token embedding           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    lm_head                   ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)

The logits stay sharded over the vocabulary as a DTensor, and the model's own
``F.cross_entropy`` runs vocabulary-parallel under ``loss_parallel()``: forward and backward
must run inside ``loss_context()``.

Attention runs on local heads: like the tutorial, the copy's attention modules get
``n_head // tp`` (and ``n_kv_head // tp``) heads; the model's code is unchanged.

Tied embedding: ``parallelize_module`` replaces each module's parameter by a new DTensor
parameter, which unties a tied lm_head. Both styles shard the table over the vocabulary rows
(``Shard(0)``), so the tie is restored by assigning the embedding's DTensor parameter to the
lm_head after ``parallelize_module``; one parameter then receives both gradients, as in the
unsharded model.

``prepare_inputs=True`` adds ``PrepareModuleInput(Replicate -> Replicate,
use_local_output=False)`` on each attention and MLP module. In the plain plan every column-
parallel linear turns its (plain tensor) input into a DTensor, so each of q, k, v (and
gate, up) all-reduces its own input gradient in backward: 3 + 1 (GPT) or 3 + 2 (LLaMA)
all-reduces per layer. With the module input already a replicated DTensor, the partial
gradients of the projections are summed locally and all-reduced once where the module input
entered DTensor: 2 per layer, Megatron's count.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, ContextManager, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from benchmarks.bench_models import GPT, Llama


def tp_plan(model: nn.Module, prepare_inputs: bool) -> dict[str, Any]:
    if isinstance(model, GPT):
        embed, mlp_column, attn_args = "wte", ("up_proj",), 1
    elif isinstance(model, Llama):
        embed, mlp_column, attn_args = "tok_embeddings", ("gate_proj", "up_proj"), 3
    else:
        raise TypeError(f"no DTensor plan for {type(model).__name__}")
    plan: dict[str, Any] = {
        embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    for i in range(len(model.blocks)):
        layer = f"blocks.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.attn.{name}"] = ColwiseParallel()
        plan[f"{layer}.attn.o_proj"] = RowwiseParallel()
        for name in mlp_column:
            plan[f"{layer}.mlp.{name}"] = ColwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
        if prepare_inputs:
            # the hidden state enters DTensor once per module; cos/sin (LLaMA) stay plain
            rest = (None,) * (attn_args - 1)
            plan[f"{layer}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(), *rest), desired_input_layouts=(Replicate(), *rest),
                use_local_output=False)
            plan[f"{layer}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                use_local_output=False)
    return plan


def parallelize(model: nn.Module, mesh: DeviceMesh, *, prepare_inputs: bool = False) -> nn.Module:
    """A DTensor tensor-parallel copy of ``model`` on the 1-D ``mesh``."""
    tp = mesh.size()
    copied = copy.deepcopy(model)
    tied = isinstance(copied, GPT) and copied.lm_head.weight is copied.wte.weight
    for block in copied.blocks:
        attn = block.attn
        if attn.n_kv_head % tp:
            raise ValueError(f"DTensor's ColwiseParallel needs tp={tp} to divide the "
                             f"{attn.n_kv_head} k/v heads")
        attn.n_head //= tp
        attn.n_kv_head //= tp
    parallelize_module(copied, mesh, tp_plan(copied, prepare_inputs))
    if tied:
        copied.lm_head.weight = copied.wte.weight
    return copied


def loss_context() -> ContextManager[None]:
    """Forward and backward of a parallelized model run inside this (vocabulary-parallel
    cross-entropy over the sharded logits)."""
    return loss_parallel()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Collective for a DTensor: the unsharded value."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every parameter's full gradient under the reference model's names."""
    out = {}
    for name, param in module.named_parameters():
        grad = full(param.grad)
        out[name] = (torch.zeros(param.shape, dtype=param.dtype, device=local(param).device)
                     if grad is None else grad.detach().clone())
    return out


def local_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: local(param) for name, param in module.named_parameters()}


no_context = contextlib.nullcontext
