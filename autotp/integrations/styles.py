"""The vocabulary two ecosystems run tensor-parallel plans in, as data: a module's
``Placement`` (how its parameters and boundary are sharded) and the word each ecosystem has for
it: transformers' ``tp_plan`` strings (``transformers_style``) and the
``torch.distributed.tensor.parallel`` style with its input and output layouts
(``torch_style``). None where one has no word; ``UNSAID`` says why.

    kind               parameters                      boundary
    COLWISE            nn.Linear weight, bias S(0)     input whole; output S(-1) or gathered
    ROWWISE            weight S(1), bias R             input S(-1) (or whole); output summed
    PACKED_COLWISE     weight S(0)x2 (gate|up)         input whole; output S(-1) per half
    EMBEDDING_ROWWISE  nn.Embedding table S(0)         ids whole; lookups summed
    EMBEDDING_COLWISE  table S(1)                      ids whole; output S(-1) or gathered
    GRAD_ALLREDUCE     replicated, gradient partial    unchanged; gradient summed
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional

STYLES = ("transformers", "torch")
LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")  # how transformers' tp_plan keys say "every layer"


class Kind(Enum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    PACKED_COLWISE = "packed_colwise"
    EMBEDDING_ROWWISE = "embedding_rowwise"
    EMBEDDING_COLWISE = "embedding_colwise"
    GRAD_ALLREDUCE = "replicated_with_grad_allreduce"  # replicated, gradient partial


@dataclass(frozen=True)
class Placement:
    """How one module is sharded, in terms both vocabularies share."""

    kind: Kind
    gathered: bool = False  # colwise: the output all-gathered at the module's boundary
    whole_input: bool = False  # rowwise: the input arrives whole; the style slices it


def transformers_style(p: Placement) -> Optional[str]:
    """The string transformers' ``tp_plan`` gives it, or None where it has none."""
    match p.kind:
        case Kind.COLWISE:
            return "colwise_gather_output" if p.gathered else "colwise"
        case Kind.ROWWISE:
            return "rowwise_split_input" if p.whole_input else "rowwise"
        case Kind.PACKED_COLWISE:
            return None if p.gathered else "packed_colwise"
        case Kind.EMBEDDING_ROWWISE:
            return "embedding_rowwise"
        case Kind.EMBEDDING_COLWISE:
            return "embedding_colwise" if p.gathered else None
        case Kind.GRAD_ALLREDUCE:
            return "replicated_with_grad_allreduce"
    raise ValueError(f"unknown placement kind {p.kind}")


def torch_style(p: Placement) -> Optional[tuple[str, str, str]]:
    """(style class, input_layouts, output_layouts) for ``parallelize_module``, or None."""
    out = "Replicate()" if p.gathered else "Shard(-1)"
    match p.kind:
        case Kind.COLWISE | Kind.EMBEDDING_COLWISE:
            return ("ColwiseParallel", "Replicate()", out)
        case Kind.ROWWISE:
            return ("RowwiseParallel", "Replicate()" if p.whole_input else "Shard(-1)",
                    "Replicate()")
        case Kind.EMBEDDING_ROWWISE:  # torch's RowwiseParallel on nn.Embedding splits the vocab
            return ("RowwiseParallel", "Replicate()", "Replicate()")
        case Kind.PACKED_COLWISE | Kind.GRAD_ALLREDUCE:
            return None
    raise ValueError(f"unknown placement kind {p.kind}")


UNSAID = {  # why a style has no word for a placement
    Kind.PACKED_COLWISE: "fused gate|up weight S(0)x2, each half sliced: torch has no style "
                         "that slices segments, transformers' packed_colwise gathers none",
    Kind.GRAD_ALLREDUCE: "replicated, read by sharded values: its gradient is a partial sum "
                         "that torch's styles never all-reduce",
    Kind.EMBEDDING_COLWISE: "table sharded on dim 1, output kept sharded: transformers' "
                            "embedding_colwise gathers it",
}


def style_text(p: Placement, style: str) -> Optional[str]:
    """Its word in ``style`` ("transformers" or "torch": the style's constructor), or None."""
    if style == "transformers":
        return transformers_style(p)
    found = torch_style(p)
    return None if found is None else \
        f"{found[0]}(input_layouts={found[1]}, output_layouts={found[2]})"


def layer_pattern(path: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``."""
    return LAYER_INDEX.sub(".*", path)
