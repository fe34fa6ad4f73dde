"""Layout rules, one module per op family, merged by ``Registry.default()``."""

from autotp.rules.registry import (
    OpCall,
    Registry,
    RuleSet,
    Strategy,
    TensorMeta,
    format_output,
    output_layouts,
)

__all__ = [
    "OpCall",
    "Registry",
    "RuleSet",
    "Strategy",
    "TensorMeta",
    "format_output",
    "output_layouts",
]
