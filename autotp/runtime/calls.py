"""Every call the model takes: one rank program per input structure.

torch.export specializes a program to the structure of its example: which inputs are
present, their ranks, dtypes and sizes beyond batch and sequence, the values of non-tensor
inputs. A call of another structure (a training program called without ``labels`` for an
evaluation, with an ``attention_mask`` the example lacked, with ``num_items_in_batch``) is
traced and planned on first use, as ``torch.compile`` recompiles on a failed guard, and kept:

- ``structure``: a call's structure, the key of its program. An input whose value is its
  signature's default ``None`` counts as absent, and so does ``use_cache=False`` (autotp
  traces without the cache; a call with one decodes).
- ``Retracer``: what tracing another structure takes: the model's structure with its
  parameters on the meta device (``skeleton``; its buffers kept), the plan's options, and,
  for ranks simulated as threads, one capture and plan per structure shared by all of them.
- The new program is planned with every parameter forced to the layout the first program
  holds it in, and built on the first program's parameters: the same ``nn.Parameter``
  objects, so an optimizer over ``parameters()`` trains every program, and gradients from
  any of them land in one ``.grad``.
"""

from __future__ import annotations

import copy
import inspect
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autotp.capture.trace import Captured, batch_symbols, capture, sequence_symbols, size_expr
from autotp.errors import ConfigError, PlanError, TraceError
from autotp.layout import Layout
from autotp.ops import path_attr
from autotp.planner.context import plan_tp_cp
from autotp.planner.cost import CostModel
from autotp.planner.gradflow import check_gradient_flow
from autotp.planner.plan import Plan
from autotp.planner.problem import PlanOptions
from autotp.rules.registry import Registry
from autotp.weights.materialize import Weights

Structure = tuple[Any, ...]


def _leaf(value: Any, sizes: bool = False) -> Any:
    if isinstance(value, torch.Tensor):
        # batch and sequence (dims 0 and 1) are symbolic in a program unless it was traced
        # at its example's sizes (``Captured.fixed_sizes``); the rest is fixed
        return ("tensor", str(value.dtype), value.dim(),
                tuple(value.shape if sizes else value.shape[2:]))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", type(value).__name__, value)
    return ("object", type(value).__qualname__)


def structure(named: dict[str, Any], sizes: bool = False) -> Structure:
    """The key of the program that runs ``named`` (a call bound to the signature, or the
    traced example): per input, its pytree structure and each leaf's kind (``sizes``: with
    every size of a tensor, for a model whose programs are of fixed sizes)."""
    out = []
    for name in sorted(named):
        leaves, spec = pytree.tree_flatten(named[name])
        out.append((name, str(spec), tuple(_leaf(v, sizes) for v in leaves)))
    return tuple(out)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} with {value.dim()} dims"
    return f"{type(value).__name__} {value!r}"[:60]


def difference(named: dict[str, Any], example: dict[str, Any]) -> str:
    """How a call's inputs differ from a traced example's, in words."""
    parts = []
    for name in sorted(set(named) | set(example)):
        if name not in example:
            parts.append(f"{name} (the example had none)")
        elif name not in named:
            parts.append(f"no {name} (the example had one)")
        elif structure({name: named[name]}) != structure({name: example[name]}):
            parts.append(f"{name} is {_kind(named[name])} (the example: "
                         f"{_kind(example[name])})")
    return ", ".join(parts)


def significant(named: dict[str, Any], signature: Optional[inspect.Signature]
                ) -> dict[str, Any]:
    """``named`` without the inputs that change nothing: ``None`` where the signature's
    default is ``None`` (or the input is one of ``**kwargs``), and ``use_cache=False``."""
    params = signature.parameters if signature is not None else {}
    out = {}
    for name, value in named.items():
        if name == "use_cache" and value is False:
            continue
        param = params.get(name)
        if value is None and (param is None or param.default is None):
            continue
        out[name] = value
    return out


def skeleton(model: nn.Module) -> Optional[nn.Module]:
    """The model's modules and buffers with every parameter on the meta device (tied ones
    still tied): what another input structure is traced from, holding no weights. None
    where the model cannot be copied."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model that cannot be copied traces one structure
        return None


@dataclass
class Traced:
    """One input structure's rank program and what running it needs."""

    program: fx.GraphModule
    plan: Plan
    run: Any  # the program, or its torch.compile
    bucket: Any  # the program's GradBucket
    keeper: Any  # its ShardKeeper (sequence parallelism), or None
    example: dict[str, Any]  # the traced inputs, by name
    seq_dims: dict[str, list[int]] = field(default_factory=dict)
    # input -> its batch dims, where the plan splits the batch (``Plan.batch_tokens``)
    batch_dims: dict[str, list[int]] = field(default_factory=dict)
    checked: bool = False  # every rank holds its plan (``ShardedModule.check_plan``)


def sequence_dims(captured: Captured) -> dict[str, list[int]]:
    """Input -> its sequence dims, whose sizes tp (or 2 x cp) must divide."""
    return _dims_of(captured, sequence_symbols(captured.dim_names))


def batch_dims(captured: Captured) -> dict[str, list[int]]:
    """Input -> its batch dims, whose sizes tp must divide where the plan splits the batch."""
    return _dims_of(captured, batch_symbols(captured.dim_names))


def _dims_of(captured: Captured, symbols: frozenset) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for node in captured.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            dims = [d for d, size in enumerate(val.shape) if size_expr(size) in symbols]
            if dims:
                out[str(node.target)] = dims
    return out


@dataclass
class Retracer:
    """What tracing and planning another input structure of one model takes. Shared by the
    ranks simulated in one process (``lock`` and ``planned``); one per process otherwise."""

    model: Optional[nn.Module]  # the skeleton (None: the model could not be copied)
    tp: int
    cp: int
    options: PlanOptions
    registry: Optional[Registry] = None
    cost_model: Optional[CostModel] = None
    check_flow: bool = True
    model_name: str = "model"
    example: dict[str, Any] = field(default_factory=dict)  # the first program's, significant
    lock: threading.Lock = field(default_factory=threading.Lock)
    planned: dict[Structure, tuple[Captured, Plan]] = field(default_factory=dict)

    @property
    def skeleton(self) -> nn.Module:
        if self.model is None:
            raise ConfigError("the model's structure could not be copied: every call must "
                              "have the inputs of the example it was traced with")
        return self.model

    def plan(self, key: Structure, named: dict[str, Any], first: Plan, dtype: torch.dtype,
             share: Any) -> tuple[Captured, Plan]:
        """The capture and plan of the structure ``key`` (inputs ``named``), every parameter
        held as ``first`` holds it."""
        with self.lock:  # torch.export is not thread-safe (simulated ranks are threads)
            found = self.planned.get(key)
            if found is not None:
                return found
            model = self.skeleton
            for param in model.parameters():  # traced in the dtype the weights are in now
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            example = pytree.tree_map(
                lambda v: v.detach() if isinstance(v, torch.Tensor) else v, named)
            try:
                captured = capture(model, example_kwargs=example)
            except TraceError as exc:
                raise TraceError(f"this call's inputs differ from the traced example's "
                                 f"({difference(named, self.example)}) and do not trace: "
                                 f"{exc}") from exc
            options = replace(self.options, force=forced_layouts(captured, first),
                              reported=frozenset(n for p in first.params.values()
                                                 for n in p.names))
            plan = plan_tp_cp(captured, self.tp, self.cp, options, registry=self.registry,
                              cost_model=self.cost_model, model_name=self.model_name,
                              share=share)
            same_layouts(plan, first)
            if self.check_flow:
                check_gradient_flow(plan, captured.gm)
            self.planned[key] = (captured, plan)
            return captured, plan


def forced_layouts(captured: Captured, first: Plan) -> tuple[tuple[str, Layout], ...]:
    """Each parameter node of ``captured`` -> the layout ``first`` stores it in."""
    held: dict[str, Layout] = {}
    for target, param in first.params.items():
        for name in param.names:
            held[name] = first.param_layout(target)
    out = []
    for node in captured.gm.graph.nodes:
        if node.op != "get_attr":
            continue
        names = captured.aliases.get(str(node.target))
        layout = next((held[n] for n in names or () if n in held), None)
        if layout is not None:
            out.append((node.name, layout))
    return tuple(out)


def same_layouts(plan: Plan, first: Plan) -> None:
    by_name = {n: (t, p.layout) for t, p in first.params.items() for n in p.names}
    for param in plan.params.values():
        held = next((by_name[n] for n in param.names if n in by_name), None)
        if held is not None and held[1] != param.layout:
            raise PlanError(
                f"{param.names[0]}: this call's program holds it as {param.layout}, the first "
                f"program as {held[1]}; pass this call's inputs as the example to "
                "autotp.parallelize")


class HeldWeights(Weights):
    """A new program's parameters and buffers are the ones ``held`` (name -> tensor, the
    first program's) already holds; what it alone reads comes from the skeleton."""

    def __init__(self, model: nn.Module, held: dict[str, nn.Parameter],
                 buffers: dict[str, torch.Tensor], device: Optional[torch.device]):
        super().__init__(model, device)
        self.held = held
        self.buffers = buffers

    def parameter(self, target: str, names: Any, layout: Layout, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        for name in names:
            if name in self.held:
                return self.held[name].detach()
        raise ConfigError(f"this call reads parameter {target!r}, which the sharded model "
                          "does not hold")

    def buffer(self, target: str, like: torch.Tensor) -> torch.Tensor:
        own = self.buffers.get(target)
        if own is not None and own.shape == like.shape:
            return own
        return super().buffer(target, like)


def adopt(program: fx.GraphModule, plan: Plan, bucket: Any, held: dict[str, nn.Parameter],
          buffers: dict[str, torch.Tensor]) -> None:
    """Make ``program`` hold the first program's parameter objects (and buffers, by path)
    where it made its own: one ``.grad`` per parameter, whichever program ran."""
    swapped: dict[int, nn.Parameter] = {}
    for path, module in program.named_modules():
        prefix = f"{path}." if path else ""
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            target = prefix + leaf
            names = plan.params[target].names if target in plan.params else (target,)
            mine = next((held[n] for n in names if n in held), None)
            if mine is None:
                continue
            if mine.shape != param.shape:
                raise PlanError(f"{target}: {list(param.shape)} in this call's program, "
                                f"{list(mine.shape)} in the first")
            module._parameters[leaf] = mine
            swapped[id(param)] = mine
        for leaf, buf in list(module._buffers.items()):
            own = buffers.get(prefix + leaf)
            if buf is not None and own is not None and own.shape == buf.shape and \
                    own.dtype == buf.dtype:
                module._buffers[leaf] = own
    for key, param in list(bucket.params.items()):
        if id(param) in swapped:
            bucket.params[key] = swapped[id(param)]


def held_tensors(program: fx.GraphModule, plan: Plan, unused: Any
                 ) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """The first program's parameters by every name the model has for them, and its buffers
    by path."""
    params: dict[str, nn.Parameter] = {}
    for target, param in plan.params.items():
        local = path_attr(program, target)
        for name in param.names:
            params[name] = local
    for name in unused:
        params[name] = path_attr(program, name)
    if any(isinstance(p, DTensor) for p in params.values()):
        raise ConfigError(
            "a call with another input structure after fully_shard: FSDP2 holds the "
            "parameters now, and a new program cannot share them; make one call of each "
            "structure (e.g. with and without labels) before fully_shard")
    return params, dict(program.named_buffers())
