"""A buffer that several modules hold (one rotary table given to every layer, written as a
cache by the first and read by the next) is one tensor under several names, and torch.export
lifts it as one program input per name. Functionalizing such a program
(``ExportedProgram.run_decompositions``) fails where one of those inputs is written
(``AOTDedupeWrapper``: "expected compiled_fn to be GraphModule"); it would be wrong too, with
the inputs apart: the second name's reads would not see the first's writes.

    merge_shared_buffers   before functionalizing: one input per buffer tensor, every
                           reader of a name reading it (the program reads one tensor, as
                           the model does)
    name_shared_buffers    after: the names merged away held again by the program, as the
                           same tensor, so its buffers are the model's under every path
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec,
                                          OutputSpec, TensorArgument)

from autotp.capture.repeat import attach


def merge_shared_buffers(ep: ExportedProgram) -> ExportedProgram:
    """``ep`` with one buffer input per tensor: each later name's placeholder replaced by the
    first name's and dropped, with its input spec and its entry in the state dict or the
    constants; a write into it (an output spec) retargeted to the first name. ``ep`` itself
    is left as it was."""
    signature = ep.graph_signature
    first: dict[int, InputSpec] = {}
    merged: dict[str, InputSpec] = {}  # a later name's placeholder -> the first name's spec
    for spec in signature.input_specs:
        if spec.kind is not InputKind.BUFFER or not isinstance(spec.arg, TensorArgument):
            continue
        tensor = ep.state_dict.get(spec.target) if spec.persistent else \
            ep.constants.get(spec.target)
        if tensor is None:
            continue
        kept = first.setdefault(id(tensor), spec)
        if kept is not spec:
            merged[spec.arg.name] = kept
    if not merged:
        return ep
    graph = copy.deepcopy(ep.graph)
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    for name, kept in merged.items():
        node = placeholders[name]
        node.replace_all_uses_with(placeholders[kept.arg.name])
        graph.erase_node(node)
    graph.lint()
    gm = fx.GraphModule(ep.graph_module, graph)
    dropped = {spec.arg.name: spec.target for spec in signature.input_specs
               if spec.arg.name in merged}
    target_of = {target: merged[name].target for name, target in dropped.items()}
    outputs = [OutputSpec(spec.kind, spec.arg, target_of.get(spec.target, spec.target))
               if spec.target in target_of else spec for spec in signature.output_specs]
    new_signature = ExportGraphSignature(
        input_specs=[s for s in signature.input_specs if s.arg.name not in merged],
        output_specs=outputs)
    gone = set(dropped.values())
    merged_ep = ep._update(gm, new_signature,
                           state_dict={k: v for k, v in ep.state_dict.items() if k not in gone},
                           constants={k: v for k, v in ep.constants.items() if k not in gone})
    # postcondition: no tensor is two buffer inputs
    held = [id(merged_ep.state_dict.get(s.target) if s.persistent
               else merged_ep.constants.get(s.target))
            for s in merged_ep.graph_signature.input_specs if s.kind is InputKind.BUFFER]
    assert len(held) == len(set(held)), "a buffer tensor is still two inputs"
    return merged_ep


def name_shared_buffers(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Every name ``model`` has for a buffer ``gm`` holds under another: held by ``gm`` too,
    the same tensor (a buffer of the model that ``gm`` holds under no name stays away)."""
    names: dict[int, list[str]] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buf), []).append(name)
    held = dict(gm.named_buffers(remove_duplicate=False))
    for group in names.values():
        kept = next((name for name in group if name in held), None)
        if kept is None:
            continue
        for name in group:
            if name not in held:
                attach(gm, name, held[kept], kept)
