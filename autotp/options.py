"""The options of ``autotp.prepare``, ``plan``, ``simulate`` and ``parallelize`` as one typed
value (``Options``), declared once: each entry point takes them as keywords (its signature
and ``help()`` list them, generated from ``Options`` by ``takes_options``) or whole, as
``options=autotp.Options(...)``; either way the entry point reads one frozen ``Options``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from autotp.errors import ConfigError
from autotp.planner.cost import CostModel
from autotp.planner.problem import OutputGather, PlanOptions
from autotp.rules.registry import Registry

# option -> what it does: the one text the entry points' help() and ``Options`` show
DOCS = {
    "example_args": "positional inputs of the example call that is traced (default: derived "
                    "from the model's config)",
    "example_kwargs": "keyword inputs of the example call",
    "strict": "False replicates ops without a rule (recorded in the plan) instead of "
              "raising NoRuleError",
    "cost_model": "the alpha-beta cost model the planner prices collectives with",
    "registry": "the rules (default ``Registry.default()``)",
    "sequence_parallel": "between the blocks, activations sharded along the sequence, or "
                         "along the batch where tp divides the example's (norms, dropout and "
                         "residual adds on token shards; all-gather before and reduce-scatter "
                         "after the sharded matmuls instead of all-reduces); every sequence "
                         "length must divide by tp (a call whose batch tp does not divide "
                         "runs a program planned for it). What autograd saves of a "
                         "gathered input is kept as this rank's shard and gathered again in "
                         "backward, as Megatron-LM does",
    "keep_gathered": "with sequence parallelism, keep the gathered inputs for backward "
                     "instead (more activation memory, one all-gather fewer each)",
    "gather_outputs": "where outputs the plan holds sharded (logits sharded over the "
                      "vocabulary) are gathered. \"read\": in the program, unless the call "
                      "computes a loss (``labels=``): then they leave it sharded and are "
                      "gathered when first read (``out.logits``; collective: read them on "
                      "every rank or on none), so a loop that reads only ``out.loss`` gathers "
                      "nothing (``module.plan.gathered_when_read``). \"always\" (or True): "
                      "in the program, in every call. \"never\" (or False): each rank "
                      "receives its shard (``module.plan.outputs``: their layouts)",
    "grad_sync": "\"bucket\" sums the partial gradients of replicated parameters in one "
                 "all-reduce after backward, into ``.grad``; \"per_use\" inside autograd "
                 "(for ``torch.autograd.grad``, DDP or FSDP around the module)",
    "compile": "True (or a dict of ``torch.compile`` options) compiles each rank's program, "
               "its collectives included (on a process group; a simulation's stay eager)",
    "async_tp": "True overlaps each all-gather before a column-parallel product and each "
                "reduce-scatter after a row-parallel one with the product (torch's "
                "micro-pipeline pass in inductor, over symmetric memory): needs compile=, "
                "sequence_parallel=True and ranks on CUDA GPUs with NCCL",
    "check_plan": "prove before building that every parameter's gradient arrives whole in "
                  "its own layout (``GradientFlowError`` otherwise) and, in processes, that "
                  "every rank holds the same plan; False skips both",
    "checkpoint": "a safetensors file or directory from which each rank reads only its "
                  "slices (a model built on the meta device)",
    "init": "True runs the model's own initializers one module at a time, keeping only the "
            "local slices (a model built on the meta device)",
    "device": "where the local shards live (default for a meta model: ``cuda:LOCAL_RANK`` "
              "where CUDA is available, else the CPU; for a real model, where its weights "
              "are)",
}


@dataclass(frozen=True)
class Options:
    example_args: Optional[tuple[Any, ...]] = None
    example_kwargs: Optional[dict[str, Any]] = None
    strict: bool = True
    cost_model: Optional[CostModel] = None
    registry: Optional[Registry] = None
    sequence_parallel: bool = False
    keep_gathered: bool = False
    gather_outputs: Union[str, bool] = "read"
    grad_sync: str = "bucket"
    compile: Any = False
    async_tp: bool = False
    check_plan: bool = True
    checkpoint: Any = None
    init: bool = False
    device: Any = None

    def plan_options(self, ep: int = 1) -> PlanOptions:
        """What the planner reads of these (``ep``: the expert-parallel degree)."""
        return PlanOptions(strict=self.strict, sequence_parallel=bool(self.sequence_parallel),
                           gather_outputs=_output_gather(self.gather_outputs),
                           expert_parallel=ep)

    def build_options(self) -> dict[str, Any]:
        """What ``build_rank`` reads of these."""
        return {"grad_sync": self.grad_sync, "compile": self.compile,
                "async_tp": self.async_tp,
                "keep_gathered": self.keep_gathered, "registry": self.registry}


def _output_gather(value: Union[str, bool]) -> OutputGather:
    if isinstance(value, bool):  # the earlier spelling: gathered in the program, or never
        return OutputGather.ALWAYS if value else OutputGather.NEVER
    try:
        return OutputGather(value)
    except ValueError:
        raise ConfigError(f"gather_outputs takes one of {[g.value for g in OutputGather]} "
                          f"(or True, False), got {value!r}") from None


def _described(name: str, indent: str) -> str:
    """One option's line of a docstring, wrapped."""
    return textwrap.fill(f"``{name}``: {DOCS[name]}.", 92, initial_indent=indent,
                         subsequent_indent=indent + "    ", break_on_hyphens=False)


Options.__doc__ = "How autotp traces, plans and builds (every field optional):\n\n" + \
    "\n".join(_described(name, "") for name in DOCS)

FIELDS = {f.name: f for f in dataclasses.fields(Options)}
# the options that only building a rank reads: planning takes none of them
BUILD_ONLY = ("keep_gathered", "grad_sync", "compile", "async_tp", "check_plan", "checkpoint",
              "init", "device")
PLANNING = tuple(name for name in FIELDS if name not in BUILD_ONLY)
SIMULATING = tuple(name for name in FIELDS if name not in ("checkpoint", "init", "device"))
PARALLELIZING = tuple(name for name in FIELDS if name != "registry")

Fn = TypeVar("Fn", bound=Callable[..., Any])


def takes_options(names: tuple[str, ...]) -> Callable[[Fn], Fn]:
    """An entry point that takes the ``Options`` fields ``names`` as keywords (collected in
    its ``**keywords``): its signature shows them as keyword-only parameters, with their
    types and defaults, and its docstring ends with their descriptions."""
    def decorate(fn: Fn) -> Fn:
        signature = inspect.signature(fn)
        params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                     default=FIELDS[name].default,
                                     annotation=FIELDS[name].type) for name in names]
        fn.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        listed = "\n".join(_described(name, "    ") for name in names)
        fn.__doc__ = (fn.__doc__ or "").rstrip() + \
            "\n\n    Options (each a keyword, or all as ``options=autotp.Options(...)``):\n" + \
            listed + "\n"
        return fn
    return decorate


def gather_options(names: tuple[str, ...], where: str, given: Optional[Options],
                   keywords: dict[str, Any]) -> Options:
    """The ``Options`` of one call of the entry point ``where`` (``"plan"``), which takes
    the fields ``names``: ``given`` (default ``Options()``) with ``keywords`` over it; a
    keyword it does not take is refused by name."""
    for name in keywords:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]}?" if close else \
                f"; it takes {', '.join(names)}"
            if name in FIELDS:
                hint = f": {name} is an option of building a rank, which {where}() does not do"
            raise ConfigError(f"autotp.{where}() got an unexpected keyword {name!r}{hint}")
    if given is not None and not isinstance(given, Options):
        raise ConfigError(f"options= takes an autotp.Options, got {type(given).__name__}")
    base = given if given is not None else Options()
    return dataclasses.replace(base, **keywords) if keywords else base
