"""autotp: automatic tensor parallelism for unmodified PyTorch transformers.

    sharded = autotp.parallelize(model, tp=8)        # on every rank of a process group
    plan = autotp.plan(model, tp=8)                  # no process group needed
    sim = autotp.simulate(model, tp=4)               # all ranks in one process
    sharded = autotp.from_pretrained("model-dir", tp=8)   # each rank reads only its slices
    best = autotp.estimate(model, gpus=64, global_batch=512, seq=4096, hardware="a100-80gb").best
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("autotp")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

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
from autotp.features.checkpoint import load_checkpoint, save_checkpoint
from autotp.features.pretrained import from_pretrained, save_pretrained
from autotp.errors import (AutotpError, ConfigError, GradientFlowError, NoRuleError, PlanError,
                           TraceError)
from autotp.layout import P, R, R_STAR, Partial, Replicate, Shard
from autotp.weights.materialize import empty_weights
from autotp.features.clipping import clip_grad_norm_
from autotp.features.pipeline import pipeline_stages
from autotp.planner.job.configure import Estimate, estimate
from autotp.planner.plan import Plan

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
    "PlanError",
    "R",
    "R_STAR",
    "Replicate",
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
    "parallelize",
    "plan",
    "save_checkpoint",
    "save_pretrained",
    "simulate",
]
