"""A rank program cut between its layers into pipeline stages (``cut``), each stage a
GraphModule of its own: where the boundaries go (``stage_bounds``: given, or balancing the
weight elements the stages' matrix products read), which values each stage receives and
passes on, and sizes re-read from a tensor the stage holds rather than sent
(``autotp.integrations.pipeline`` makes torch's ``PipelineStage``s of them)."""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx as fx
from torch import nn

from autotp.errors import ConfigError
from autotp.ops import arg_node, path_attr
from autotp.planner.job.memory import balanced_stages
from autotp.runtime.layers import program_nodes
from autotp.runtime.rewrite import SPLIT


# ---- cutting the program -------------------------------------------------------------------


def layer_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(str(n.target)), fx.GraphModule)]


def _layer(gm: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    """The GraphModule that ``call``, one of the ``layer_calls``, runs."""
    layer = gm.get_submodule(str(call.target))
    assert isinstance(layer, fx.GraphModule), f"{call.target} is not a layer"
    return layer


def stage_bounds(gm: fx.GraphModule, layers: list[fx.Node], count: int,
            split_points: Optional[Sequence[int]]) -> list[int]:
    """The index of each stage's first layer (the first is 0)."""
    if split_points is not None:
        points = [int(p) for p in split_points]
        if len(points) != count - 1 or points != sorted(set(points)) or \
                points[0] <= 0 or points[-1] >= len(layers):
            raise ConfigError(
                f"split_points must be {count - 1} increasing layer indices in 1..."
                f"{len(layers) - 1} (the first layer of every stage but the first), got "
                f"{list(split_points)}")
        return [0, *points]
    work = [_matmul_weights(_layer(gm, n)) for n in layers]
    head = _matmul_weights(gm, root_only=True)  # embedding and head: split between the ends
    work[0] += head / 2
    work[-1] += head / 2
    return _balanced(work, count)


def _matmul_weights(gm: fx.GraphModule, root_only: bool = False) -> float:
    """Elements of the parameters that the module's matrix products and lookups read."""
    total = 0
    for node in (gm.graph.nodes if root_only else program_nodes(gm)):
        if node.op != "get_attr":
            continue
        value = path_attr(gm, str(node.target))
        if isinstance(value, nn.Parameter) and value.dim() >= 2:
            total += value.numel()
    return float(total)


def _balanced(work: list[float], count: int) -> list[int]:
    """Contiguous split of ``work`` into ``count`` non-empty parts minimizing the largest: the
    index of each part's first element (``autotp.planner.job.memory.balanced_stages``, the split the
    estimate prices)."""
    stages = balanced_stages(list(range(len(work))), count, dict(enumerate(work)))
    return [stage[0] for stage in stages]


def cut(gm: fx.GraphModule, layers: list[fx.Node], bounds: list[int],
        example: dict[str, Any]) -> list[fx.GraphModule]:
    """``gm``'s root graph as ``len(bounds)`` stage programs: stage ``k`` calls layers
    ``bounds[k]`` up to the next bound. Stage 0 takes the tensor inputs, each stage returns
    what later stages read, the last the program's first output tensor."""
    count = len(bounds)
    _layer_values(gm, layers)
    layer_stage = {}
    for k, start in enumerate(bounds):
        end = bounds[k + 1] if k + 1 < count else len(layers)
        for node in layers[start:end]:
            layer_stage[node] = k
    order = [n for n in gm.graph.nodes
             if not (n.op == "call_module" and n.target == "_guards_fn")]
    result = _first_tensor(gm)
    stage: dict[fx.Node, int] = {}  # where a tensor is computed (absent: copied where used)
    for node in order:
        if node.op == "placeholder":
            if isinstance(node.meta.get("val"), torch.Tensor):
                stage[node] = 0
        elif node in layer_stage:
            stage[node] = layer_stage[node]
        elif node.op in ("call_function", "call_module") and _is_tensor(node):
            anchored = [stage[x] for x in node.all_input_nodes if x in stage]
            if anchored:
                stage[node] = max(anchored)
    if stage.get(result) != count - 1:
        raise ConfigError("the model's first output is not computed after the last layer: "
                          "it cannot be the last pipeline stage's output")
    # the tensors each stage reads from earlier stages, and what each boundary carries
    needs: list[list[fx.Node]] = [[] for _ in range(count)]
    for node in order:
        if node in stage and node.op != "placeholder":
            for x in _anchors(node, stage):
                if stage[x] < stage[node] and x not in needs[stage[node]]:
                    needs[stage[node]].append(x)
    carried: list[list[fx.Node]] = [[] for _ in range(count)]  # boundary k: into stage k + 1
    for k in range(1, count):
        for x in needs[k]:
            for boundary in range(stage[x], k):
                if x not in carried[boundary]:
                    carried[boundary].append(x)
    parts = []
    for k in range(count):
        inputs = [n for n in order if n.op == "placeholder" and n in stage] if k == 0 \
            else carried[k - 1]
        outputs = carried[k] if k + 1 < count else [result]
        mine = [n for n in order if stage.get(n) == k and n.op != "placeholder"]
        part = _stage_module(gm, k, inputs, mine, outputs, stage, example)
        part.meta["autotp_layers"] = [str(n.target) for n in mine if n in layer_stage]
        parts.append(part)
    return parts


def _layer_values(gm: fx.GraphModule, layers: list[fx.Node]) -> None:
    """The example values (shapes with their size symbols) of what the layer calls return,
    from the layers' own graphs."""
    for call in layers:
        inner = _layer(gm, call)
        result = next(n for n in inner.graph.nodes if n.op == "output").args[0]
        if isinstance(result, fx.Node):
            call.meta.setdefault("val", result.meta.get("val"))
            call.meta.setdefault(SPLIT, result.meta.get(SPLIT))
            continue
        for user in call.users:
            if user.target is operator.getitem and isinstance(result[user.args[1]], fx.Node):
                user.meta.setdefault("val", result[user.args[1]].meta.get("val"))
                user.meta.setdefault(SPLIT, result[user.args[1]].meta.get(SPLIT))


def _anchors(node: fx.Node, stage: dict[fx.Node, int]) -> list[fx.Node]:
    """The computed tensors ``node`` depends on through values copied where used."""
    out, todo, seen = [], list(node.all_input_nodes), set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in stage:
            out.append(x)
        elif x.op not in ("get_attr", "placeholder") and not _is_size(x):
            todo.extend(x.all_input_nodes)  # sizes are re-read where used, not carried
    return out


def _stage_module(gm: fx.GraphModule, k: int, inputs: list[fx.Node], mine: list[fx.Node],
                  outputs: list[fx.Node], stage: dict[fx.Node, int],
                  example: dict[str, Any]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta = dict(x.meta)
    attrs: dict[str, Any] = {}

    def value(x: fx.Node) -> Any:
        if x in env:
            return env[x]
        if x.op == "placeholder":  # a non-tensor input: the example's value
            env[x] = example.get(str(x.target))
        elif isinstance(x.meta.get("val"), torch.SymInt) and \
                any(stage.get(a, k) < k for a in x.all_input_nodes):
            # a size an earlier stage's layer returned (B * T of the tokens a mixture of
            # experts routes): computed again from the sizes this stage holds
            env[x] = _rebuild_size(graph, x, env)
        elif x in stage:
            raise AssertionError(f"stage {k} reads {x.name} of stage {stage[x]}, not carried")
        elif _is_size(x) and x.target is torch.ops.aten.sym_size.int and \
                stage.get(arg_node(x, 0), k) != k and x.args[0] not in env:
            env[x] = _reread_size(graph, x, env)
        else:  # parameters, constants and what is computed from them alone: copied here
            _keep(gm, x, attrs)
            env[x] = graph.node_copy(x, value)
        return env[x]

    for node in mine:
        _keep(gm, node, attrs)
        env[node] = graph.node_copy(node, value)
    outs = tuple(value(x) for x in outputs)
    graph.output(outs[0] if len(outs) == 1 else outs)
    module = fx.GraphModule(attrs, graph, class_name=f"Stage{k}")
    module.graph.eliminate_dead_code()
    module.delete_all_unused_submodules()
    module.recompile()
    return module


def _reread_size(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """A size of a tensor this stage does not hold, read from one it holds with a dim of the
    same size (the batch and sequence sizes travel in the activations' shapes), times the
    ways this rank's value is split along that dim (a sequence under context or sequence
    parallelism)."""
    want = node.meta["val"]
    expr = want.node.expr if isinstance(want, torch.SymInt) else want
    found = []
    for source, copy in list(env.items()):
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(copy, fx.Node):
            continue
        for d, size in enumerate(val.shape):
            if (size.node.expr if isinstance(size, torch.SymInt) else size) == expr:
                found.append((copy, d, (source.meta.get(SPLIT) or {}).get(d, 1)))
    if found:  # one held whole along the dim where there is one
        copy, d, split = min(found, key=lambda f: f[2])
        read = graph.call_function(torch.ops.aten.sym_size.int, (copy, d))
        read.meta = dict(node.meta)
        if split == 1:
            return read
        whole = graph.call_function(operator.mul, (read, split))
        whole.meta = dict(node.meta)
        return whole
    raise ConfigError(f"a stage needs the size {expr} ({node.name}) and holds no tensor of "
                      "that size: pass split_points that keep its reader with its source")


def _rebuild_size(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """A size expression (``s0 * s1``) over the size symbols, from the dims of tensors this
    stage holds that have those sizes."""
    expr = node.meta["val"].node.expr
    reads: dict[Any, Any] = {}
    for symbol in expr.free_symbols:
        for source, copy in list(env.items()):
            val = source.meta.get("val") if isinstance(source, fx.Node) else None
            if not isinstance(val, torch.Tensor) or not isinstance(copy, fx.Node):
                continue
            dim = next((d for d, size in enumerate(val.shape) if isinstance(size, torch.SymInt)
                        and size.node.expr == symbol), None)
            if dim is not None:
                reads[symbol] = graph.call_function(torch.ops.aten.sym_size.int, (copy, dim))
                split = (source.meta.get(SPLIT) or {}).get(dim, 1)
                if split != 1:
                    reads[symbol] = graph.call_function(operator.mul, (reads[symbol], split))
                break
        else:
            raise ConfigError(f"a stage needs the size {expr} ({node.name}) and holds no "
                              f"tensor of size {symbol}: pass split_points that keep its "
                              "reader with its source")

    def build(e: Any) -> Any:
        if e.is_Symbol:
            return reads[e]
        if e.is_Integer:
            return int(e)
        if isinstance(e, (sympy.Mul, sympy.Add)):
            op = operator.mul if isinstance(e, sympy.Mul) else operator.add
            out = build(e.args[0])
            for arg in e.args[1:]:
                out = graph.call_function(op, (out, build(arg)))
            return out
        raise ConfigError(f"a stage needs the size {expr} ({node.name}), which autotp cannot "
                          "compute again from its own tensors: pass split_points that keep "
                          "its reader with its source")

    out = build(expr)
    if isinstance(out, fx.Node):
        out.meta = dict(node.meta)
    return out


def _keep(gm: fx.GraphModule, node: fx.Node, attrs: dict[str, Any]) -> None:
    if node.op in ("get_attr", "call_module"):
        attrs[str(node.target)] = path_attr(gm, str(node.target))


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return node.op == "call_module" and not _is_size(node)


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, int, bool))


def _first_tensor(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [x for x in torch.utils._pytree.tree_leaves(out.args[0]) if isinstance(x, fx.Node)]
    tensors = [x for x in leaves if isinstance(x.meta.get("val"), torch.Tensor)
               or x.op == "call_module"]
    if not tensors:
        raise ConfigError("the model returns no tensor for the last stage to give the loss")
    return tensors[0]
