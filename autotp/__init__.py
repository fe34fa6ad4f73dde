"""autotp: automatic tensor parallelism for unmodified PyTorch transformers.

    sharded = autotp.parallelize(model, tp=8)        # on every rank of a process group
    sharded = autotp.parallelize(model, mesh=mesh)   # a ("dp", "cp", "tp") DeviceMesh
    plan = autotp.plan(model, tp=8)                  # no process group needed
    sim = autotp.simulate(model, tp=4)               # all ranks in one process
    sharded = autotp.from_pretrained("model-dir", tp=8)   # each rank reads only its slices
    best = autotp.estimate(model, gpus=64, global_batch=512, seq=4096, hardware="a100-80gb").best
"""

from importlib.metadata import PackageNotFoundError, version as _version
from typing import TYPE_CHECKING, Any

from autotp import progress

try:
    __version__ = _version("autotp")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it, imported on first use: ``import autotp`` and
# ``autotp --help`` load neither the planner nor torch.export, nor transformers
_LAZY = {
    "ShardedModule": "autotp.api", "Simulation": "autotp.api",
    "expert_parameters": "autotp.api", "finish_expert_gradients": "autotp.api",
    "full_state_dict": "autotp.api", "parallelize": "autotp.api", "plan": "autotp.api",
    "simulate": "autotp.api", "Options": "autotp.options", "Mesh": "autotp.mesh",
    "load_checkpoint": "autotp.integrations.checkpoint",
    "save_checkpoint": "autotp.integrations.checkpoint",
    "from_pretrained": "autotp.integrations.pretrained",
    "save_pretrained": "autotp.integrations.pretrained",
    "AutotpError": "autotp.errors", "ConfigError": "autotp.errors",
    "GradientFlowError": "autotp.errors", "NoRuleError": "autotp.errors",
    "PlanError": "autotp.errors", "RuleError": "autotp.errors", "TraceError": "autotp.errors",
    "register_rule": "autotp.integrations.custom_ops",
    "unregister_rule": "autotp.integrations.custom_ops",
    "P": "autotp.layout", "R": "autotp.layout", "R_STAR": "autotp.layout",
    "Partial": "autotp.layout", "Replicate": "autotp.layout", "Shard": "autotp.layout",
    "empty_weights": "autotp.weights.materialize",
    "clip_grad_norm_": "autotp.integrations.clipping",
    "pipeline_stages": "autotp.integrations.pipeline",
    "Estimate": "autotp.planner.job.configure", "estimate": "autotp.planner.job.configure",
    "Plan": "autotp.planner.plan",
}

if TYPE_CHECKING:
    from autotp.api import (
        ShardedModule,
        Simulation,
        expert_parameters,
        finish_expert_gradients,
        full_state_dict,
        parallelize,
        plan,
        simulate,
    )
    from autotp.errors import (AutotpError, ConfigError, GradientFlowError, NoRuleError,
                               PlanError, RuleError, TraceError)
    from autotp.integrations.custom_ops import register_rule, unregister_rule
    from autotp.integrations.checkpoint import load_checkpoint, save_checkpoint
    from autotp.integrations.clipping import clip_grad_norm_
    from autotp.integrations.pipeline import pipeline_stages
    from autotp.integrations.pretrained import from_pretrained, save_pretrained
    from autotp.layout import P, R, R_STAR, Partial, Replicate, Shard
    from autotp.mesh import Mesh
    from autotp.options import Options
    from autotp.planner.job.configure import Estimate, estimate
    from autotp.planner.plan import Plan
    from autotp.weights.materialize import empty_weights


def __getattr__(name: str) -> Any:
    """The public API's names and the subpackages (``autotp.api.default_device``), each
    imported on first use."""
    from importlib import import_module
    from importlib.util import find_spec

    module = _LAZY.get(name)
    if module is not None:
        return getattr(import_module(module), name)
    if not name.startswith("__") and find_spec(f"autotp.{name}") is not None:
        return import_module(f"autotp.{name}")
    raise AttributeError(f"module 'autotp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "clip_grad_norm_",
    "AutotpError",
    "ConfigError",
    "Estimate",
    "GradientFlowError",
    "NoRuleError",
    "P",
    "Partial",
    "Plan",
    "pipeline_stages",
    "progress",
    "PlanError",
    "R",
    "R_STAR",
    "Replicate",
    "RuleError",
    "Shard",
    "ShardedModule",
    "Simulation",
    "TraceError",
    "empty_weights",
    "estimate",
    "expert_parameters",
    "finish_expert_gradients",
    "from_pretrained",
    "full_state_dict",
    "load_checkpoint",
    "Mesh",
    "Options",
    "parallelize",
    "plan",
    "register_rule",
    "save_checkpoint",
    "save_pretrained",
    "simulate",
    "unregister_rule",
]
