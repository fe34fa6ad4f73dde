"""User-facing errors. Every error autotp raises on bad input derives from ``AutotpError``."""

from __future__ import annotations

import importlib.metadata as metadata
from typing import Optional

import torch
import torch.fx as fx


class AutotpError(Exception):
    """Base class of the errors autotp raises for bad input or unsupported models."""


class ConfigError(AutotpError, ValueError):
    """An argument of autotp's API is wrong (tp, group, example inputs)."""


class TraceError(AutotpError, RuntimeError):
    """The model could not be captured into a graph."""


class NoRuleError(AutotpError, NotImplementedError):
    """The graph holds an op that autotp has no layout rule for."""


class RuleError(AutotpError, ValueError):
    """A layout rule registered for an op gives other numbers than the op."""


class PlanError(AutotpError, ValueError):
    """No tensor-parallel plan satisfies the constraints (divisibility, strictness)."""


class GradientFlowError(PlanError):
    """The plan would give a parameter a wrong gradient: partial where nothing sums it, a
    fraction or a multiple of the true one, or scrambled (``autotp.planner.gradflow``)."""


def where(node: Optional[fx.Node]) -> str:
    """The node and, when known, the user's source line that produced it."""
    if node is None:
        return ""
    text = f"\n  node: {node.format_node()}"
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [line for line in trace.strip().splitlines() if line.strip()]
        # The last "File ..." line of the trace is the user's line closest to the op.
        file_lines = [i for i, line in enumerate(lines) if line.strip().startswith("File ")]
        if file_lines:
            i = file_lines[-1]
            text += "\n  source: " + lines[i].strip()
            if i + 1 < len(lines):
                text += "\n          " + lines[i + 1].strip()
    return text


def versions() -> str:
    """The transformers and torch found, beside the ranges autotp is tested with (read from
    the installed package's own requirements, so the message and pyproject.toml agree)."""
    try:
        import transformers  # optional: transformers

        found = f"transformers {transformers.__version__} and torch {torch.__version__}"
    except ImportError:
        found = f"torch {torch.__version__} (no transformers)"
    try:
        tested = sorted({req.split(";")[0].replace(" ", "")
                         for req in metadata.requires("autotp") or []
                         if req.startswith(("torch", "transformers"))})
    except metadata.PackageNotFoundError:
        tested = []
    ranges = ", ".join(tested) if tested else "the ranges in autotp's pyproject.toml"
    return f"found {found}; autotp is tested with {ranges}"
