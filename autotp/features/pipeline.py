"""Pipeline stages: the rank program cut between its layers, one pipelining stage per part.

``autotp.pipeline_stages`` builds this rank's tensor-parallel program over the mesh's "tp"
dim (``parallelize``), cuts the root graph between the calls of its layers (``split_layers``
gives them) and returns this rank's parts as ``torch.distributed.pipelining``
``PipelineStage``s over the "pp" dim. Any of torch's schedules runs them; autotp writes no
schedule of its own.

    mesh = init_device_mesh("cuda", (pp, tp), mesh_dim_names=("pp", "tp"))
    stages = autotp.pipeline_stages(model, mesh, stages_per_rank=2, example_kwargs=...)
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(input_ids, target=labels)       # first stage: inputs; last: the loss

What a stage computes is where the program computes it: glue between layers runs where its
inputs are ready, so the embedding and everything derived from the inputs alone (position
embeddings, masks) run in the first stage, and the final norm and head in the last. Every
tensor a later stage reads travels with the activations, passed on by the stages between.
Sizes (SymInts) never travel: a stage re-reads them from a tensor it holds that has the same
size. Parameters go to the stages that read them; one read by several stages (tied
embeddings) has a copy in each, and the copies' gradients are summed after the last
backward of a step (``perform_reduce_grad``, ``_TiedGrads``).

Stage boundaries: ``split_points`` (the index of the first layer of each stage but the
first), or chosen so that the heaviest stage does the least work, counted as the weight
elements its matrix products read (the first and last stages carry the embedding and head).
Stages sit on the pp ranks in a loop (``s % pp``) or folded back as a V (``placement="v"``).

A model with real weights: the stages are checked once on construction; chained on the
example, they give the program's own first output. A model without weights (built under
``autotp.empty_weights()``, with ``checkpoint=`` or ``init=True``): the program is built with
meta parameters and each rank materializes only its own stages' slices (with
``checkpoint=`` it reads only those; ``init=True`` runs the initializers of the whole
modules it touches); the stages' shapes are then measured by running the example through
the stages where they live.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autotp.errors import ConfigError
from autotp.runtime.layers import program_nodes
from autotp.weights.materialize import DeferredWeights, deferred_weights, has_meta_parameters


def pipeline_stages(model: nn.Module, mesh: Any, *, stages_per_rank: int = 1,
                    split_points: Optional[Sequence[int]] = None, placement: str = "loop",
                    example_args: Optional[tuple[Any, ...]] = None,
                    example_kwargs: Optional[dict[str, Any]] = None,
                    **parallelize_options: Any) -> list[Any]:
    """This rank's pipeline stages of ``model``, tensor-parallel over ``mesh["tp"]``.

    ``mesh``: a DeviceMesh with dims "pp" and "tp" (and "dp", which the stages leave to the
    caller's FSDP2). ``stages_per_rank``: virtual stages per rank, for the interleaved and
    looped schedules. ``placement``: ``"loop"``, stage ``s`` on pp rank ``s % pp`` (GPipe,
    1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), or ``"v"``, two stages per
    rank folded back (rank ``r`` holds ``r`` and ``2 pp - 1 - r``: ZBVZeroBubble,
    DualPipeV). ``split_points``: the first layer
    of every stage but the first (``[4, 8, 12]`` for four stages of 16 layers); default:
    balanced by the cost model. The example (``example_args``/``example_kwargs``, default:
    from the model's config) is one microbatch: its shapes are the shapes the stages send.
    The first stage takes the model's tensor inputs positionally, in the order of
    ``forward``'s signature; the last returns the model's first output (logits).
    ``parallelize_options`` go to ``autotp.parallelize`` (default ``grad_sync="per_use"``:
    partial gradients are summed inside autograd, which pipelining's backward runs).
    """
    from torch.distributed.pipelining import PipelineStage

    from autotp.api import parallelize

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names or "tp" not in names:
        raise ConfigError(f"pipeline_stages needs a DeviceMesh with dims 'pp' and 'tp', got "
                          f"{names or type(mesh).__name__}: init_device_mesh(device, (pp, tp), "
                          "mesh_dim_names=('pp', 'tp'))")
    if stages_per_rank < 1:
        raise ConfigError(f"stages_per_rank must be at least 1, got {stages_per_rank}")
    if placement not in ("loop", "v") or (placement == "v" and stages_per_rank != 2):
        raise ConfigError(f"placement must be 'loop' or 'v' (with stages_per_rank=2), got "
                          f"{placement!r} with stages_per_rank={stages_per_rank}")
    pp_mesh, tp_mesh = mesh["pp"], mesh["tp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    count = pp * stages_per_rank
    parallelize_options.setdefault("grad_sync", "per_use")
    parallelize_options.setdefault("check_plan", True)
    # a model without weights (empty_weights, checkpoint= or init=): the program is built
    # with meta parameters and each rank then reads only its own stages' slices
    deferring = has_meta_parameters(model)
    with deferred_weights() if deferring else contextlib.nullcontext([]) as deferred:
        sharded = parallelize(model, group=tp_mesh, example_args=example_args,
                              example_kwargs=example_kwargs, **parallelize_options)
        if not sharded._plan_checked:
            sharded.check_plan()
        program = sharded.program
        layers = _layer_calls(program)
        if len(layers) < count:
            raise ConfigError(
                f"{count} pipeline stages (pp={pp} x stages_per_rank={stages_per_rank}) need "
                f"at least {count} layers; the model has {len(layers)} "
                f"{'(its blocks are not an nn.ModuleList)' if not layers else ''}".rstrip())
        bounds = _bounds(program, layers, count, split_points)
        parts = cut(program, layers, bounds, sharded._example)
        rank_of = [_rank_of(s, pp, placement) for s in range(count)]
        mine = [s for s in range(count) if rank_of[s] == pp_rank]
        if deferred:
            _load(parts, mine, deferred[0])
            metas = _measure_across(sharded, parts, rank_of, pp_mesh)
        else:
            metas = _check_and_measure(sharded, parts)
    ties = _TiedGrads(parts, mine, mesh, rank_of)
    device = sharded._device()
    stages = []
    for index in mine:
        inputs, outputs = metas[index]
        stage = PipelineStage(parts[index], index, count, device, input_args=inputs,
                              output_args=outputs, group=pp_mesh.get_group())
        stage.__class__ = _stage_class(type(stage))
        stage._autotp_ties = ties
        stage._autotp_plan = sharded.plan
        # the groups its gradients are spread over (autotp.clip_grad_norm_)
        stage._autotp_comm, stage._autotp_ep_comm = sharded.comm, sharded.ep_comm
        stage._autotp_pp_group = pp_mesh.get_group()
        stages.append(stage)
    return stages


def stage_layers(stage: Any) -> list[nn.Module]:
    """The layer modules a stage calls, in order, at the original blocks' paths inside
    ``stage.submod`` (for ``fully_shard`` or activation checkpointing per layer): each
    layer's rank program, or what wraps it once it has been wrapped."""
    module = stage.submod if hasattr(stage, "submod") else stage
    return [module.get_submodule(name) for name in module.meta["autotp_layers"]]


# ---- cutting the program -------------------------------------------------------------------


def _layer_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(str(n.target)), fx.GraphModule)]


def _bounds(gm: fx.GraphModule, layers: list[fx.Node], count: int,
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
    work = [_matmul_weights(gm.get_submodule(str(n.target))) for n in layers]
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
        value = _fetch(gm, str(node.target))
        if isinstance(value, nn.Parameter) and value.dim() >= 2:
            total += value.numel()
    return float(total)


def _balanced(work: list[float], count: int) -> list[int]:
    """Contiguous split of ``work`` into ``count`` non-empty parts minimizing the largest."""
    n = len(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut_at = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for end in range(k, n - (count - k) + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost < best[k][end]:
                    best[k][end], cut_at[k][end] = cost, start
    bounds, end = [], n
    for k in range(count, 0, -1):
        end = cut_at[k][end]
        bounds.append(end)
    return bounds[::-1]


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
        inner = gm.get_submodule(str(call.target))
        result = next(n for n in inner.graph.nodes if n.op == "output").args[0]
        if isinstance(result, fx.Node):
            call.meta.setdefault("val", result.meta.get("val"))
            continue
        for user in call.users:
            if user.target is operator.getitem and isinstance(result[user.args[1]], fx.Node):
                user.meta.setdefault("val", result[user.args[1]].meta.get("val"))


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
                stage.get(x.args[0], k) != k and x.args[0] not in env:
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
    same size (the batch and sequence sizes travel in the activations' shapes)."""
    want = node.meta["val"]
    expr = want.node.expr if isinstance(want, torch.SymInt) else want
    for source, copy in list(env.items()):
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(copy, fx.Node):
            continue
        for d, size in enumerate(val.shape):
            if (size.node.expr if isinstance(size, torch.SymInt) else size) == expr:
                read = graph.call_function(torch.ops.aten.sym_size.int, (copy, d))
                read.meta = dict(node.meta)
                return read
    raise ConfigError(f"a stage needs the size {expr} ({node.name}) and holds no tensor of "
                      "that size: pass split_points that keep its reader with its source")


def _rebuild_size(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """A size expression (``s0 * s1``) over the size symbols, from the dims of tensors this
    stage holds that have those sizes."""
    import sympy

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
        attrs[str(node.target)] = _fetch(gm, str(node.target))


def _fetch(gm: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


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


# ---- metadata, check and ties --------------------------------------------------------------


def _check_and_measure(sharded: Any, parts: list[fx.GraphModule]
                       ) -> dict[int, tuple[Any, Any]]:
    """Chain every stage on the example (all ranks of the tp group do, so its collectives
    match), compare with the program's own output, and keep each stage's inputs and outputs
    as meta tensors for PipelineStage (shapes, dtypes, whether they carry gradients)."""
    example = sharded._example
    names = [n for n in parts[0].graph.nodes if n.op == "placeholder"]
    args = tuple(example[str(n.target)] for n in names)
    with _streams_kept(sharded.program.modules(), sharded._device()) as rewind:
        with torch.no_grad():
            want = _first(sharded.program(**example))
        rewind()  # dropout draws the same masks in the chain
        metas = _chain(parts, args)
    got = metas.pop()
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4,
                                                     atol=1e-5):
        raise AssertionError("the pipeline stages chained do not compute the program's output "
                             f"(largest difference {(got.float() - want.float()).abs().max()})")
    return dict(enumerate(metas))


def _load(parts: list[fx.GraphModule], mine: list[int], weights: DeferredWeights) -> None:
    """Read the slices of the parameters this rank's stages hold (the rest stay on meta)."""
    loaded: dict[str, nn.Parameter] = {}
    for index in mine:
        for name, param in list(parts[index].named_parameters()):
            if not param.is_meta:
                continue
            if name not in loaded:
                loaded[name] = nn.Parameter(weights.load(name),
                                            requires_grad=param.requires_grad)
            owner, _, attr = name.rpartition(".")
            setattr(parts[index].get_submodule(owner) if owner else parts[index], attr,
                    loaded[name])


def _measure_across(sharded: Any, parts: list[fx.GraphModule], rank_of: list[int],
                    pp_mesh: Any) -> dict[int, tuple[Any, Any]]:
    """Each of this rank's stages' (inputs, outputs) as meta tensors, measured by running the
    example through the stages where they live: a stage's outputs go to the next stage's pp
    rank (no rank holds the weights of the others, so the whole program cannot run here)."""
    device = sharded._device()
    # a model without weights was captured on meta inputs: zeros of their shapes serve here
    example = {k: (torch.zeros(v.shape, dtype=v.dtype, device=device) if v.is_meta
                   else v.to(device)) if isinstance(v, torch.Tensor) else v
               for k, v in sharded._example.items()}
    names = [n for n in parts[0].graph.nodes if n.op == "placeholder"]
    current: Any = tuple(example[str(n.target)] for n in names)
    me, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    metas: dict[int, tuple[Any, Any]] = {}
    with _streams_kept((m for part in parts for m in part.modules()), device), \
            torch.enable_grad():
        for index, part in enumerate(parts):
            if rank_of[index] != me:
                continue
            if index > 0 and rank_of[index - 1] != me:
                current = _recv_tensors(group, rank_of[index - 1], device)
            out = part(*current)
            out = out if isinstance(out, tuple) else (out,)
            metas[index] = (tuple(_meta(x) for x in current), tuple(_meta(x) for x in out))
            current = tuple(x.detach().requires_grad_(x.requires_grad) for x in out)
            if index + 1 < len(parts) and rank_of[index + 1] != me:
                _send_tensors(current, group, rank_of[index + 1], device)
    return metas


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16]


def _send_tensors(values: tuple[torch.Tensor, ...], group: Any, dst: int,
                  device: torch.device) -> None:
    """Tensors to pp rank ``dst``: a header of plain integers (count; per tensor dtype,
    requires_grad, rank, sizes), then each tensor. Nothing is pickled."""
    header = [len(values)]
    for x in values:
        header += [_DTYPES.index(x.dtype), int(x.requires_grad), x.dim(), *x.shape]
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.send(size, group=group, group_dst=dst)
    dist.send(torch.tensor(header, dtype=torch.int64, device=device), group=group,
              group_dst=dst)
    for x in values:
        dist.send(x.detach().contiguous().to(device), group=group, group_dst=dst)


def _recv_tensors(group: Any, src: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, group=group, group_src=src)
    header_t = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(header_t, group=group, group_src=src)
    header = header_t.tolist()
    count, at, out = header[0], 1, []
    for _ in range(count):
        code, grad, ndim = header[at:at + 3]
        shape = header[at + 3:at + 3 + ndim]
        at += 3 + ndim
        x = torch.empty(shape, dtype=_DTYPES[code], device=device)
        dist.recv(x, group=group, group_src=src)
        out.append(x.requires_grad_(bool(grad)))
    return tuple(out)


def _chain(parts: list[fx.GraphModule], args: tuple[Any, ...]) -> list[Any]:
    """Each stage's (inputs, outputs) as meta tensors, and last the final output."""
    metas: list[Any] = []
    current: Any = args
    with torch.enable_grad():
        for part in parts:
            inputs = tuple(_meta(x) for x in current)
            out = part(*current)
            out = out if isinstance(out, tuple) else (out,)
            metas.append((inputs, tuple(_meta(x) for x in out)))
            current = tuple(x.detach().requires_grad_(x.requires_grad) for x in out)
    metas.append(current[0].detach())
    return metas


@contextlib.contextmanager
def _streams_kept(modules: Any, device: torch.device) -> Iterator[Callable[[], None]]:
    """Random streams as they were on entry, again on exit (training starts from them): the
    global ones (forked) and the dropout trackers of ``modules``. Yields a function that
    rewinds the trackers inside the block."""
    trackers = {id(m.tracker): m.tracker for m in modules if hasattr(m, "tracker")}
    saved = [(t, {k: g.get_state() for k, g in t._generators.items()})
             for t in trackers.values()]

    def rewind() -> None:
        for tracker, states in saved:
            for key in list(tracker._generators):
                if key not in states:
                    del tracker._generators[key]
            for key, state in states.items():
                tracker._generators[key].set_state(state)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield rewind
        finally:
            rewind()


def _first(out: Any) -> torch.Tensor:
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return leaves[0]


def _meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta").requires_grad_(
        bool(x.requires_grad) and x.is_floating_point())


def _rank_of(stage: int, pp: int, placement: str) -> int:
    """The pp rank that holds ``stage``: looped, or folded back as a V."""
    if placement == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


class _TiedGrads:
    """Parameters that several stages read (a tied embedding and head). Every stage holds its
    own copy (two stages of one rank too, so FSDP2 may shard each stage). After the last
    ``perform_reduce_grad`` of a step on this rank, the copies' gradients are summed over
    this rank's stages and then over the pp ranks that hold the parameter (at this rank's
    position in the other mesh dims), and every copy gets the sum: the copies start equal
    and stay equal under any optimizer. The sum covers the whole ``.grad``: clear gradients
    between steps (``zero_grad``); accumulated over several steps, earlier sums would be
    added again."""

    def __init__(self, parts: list[fx.GraphModule], mine: list[int], mesh: Any,
                 rank_of: list[int]) -> None:
        holders: dict[str, list[int]] = {}
        for index, part in enumerate(parts):
            for name, param in part.named_parameters():
                if param.requires_grad:
                    holders.setdefault(name, []).append(index)
        dims = list(mesh.mesh_dim_names)
        pp = mesh["pp"].size()
        grid = mesh.mesh.movedim(dims.index("pp"), 0).reshape(pp, -1)
        me = dist.get_rank()
        self.count, self.seen = len(mine), 0
        self.ties: list[tuple[str, list[nn.Module], Any]] = []
        # tied name -> the first stage holding a copy: the one whose copy counts once in
        # the model's gradient norm (the copies hold the same sum)
        self.first_holder: dict[str, int] = {}
        for name, stages in sorted(holders.items()):
            if len(stages) < 2:
                continue
            self.first_holder[name] = min(stages)
            ranks = sorted({rank_of[s] for s in stages})
            group = None
            if len(ranks) > 1:
                for column in range(grid.shape[1]):  # every rank creates every group, in order
                    members = [int(grid[r, column]) for r in ranks]
                    created = dist.new_group(members)
                    group = created if me in members else group
            local = [parts[s] for s in stages if s in mine]
            for part in local[1:]:  # a copy of its own for each further stage of this rank
                owner, _, attr = name.rpartition(".")
                param = _fetch(part, name)
                setattr(part.get_submodule(owner) if owner else part, attr,
                        nn.Parameter(param.detach().clone()))
            if local:
                self.ties.append((name, local, group))

    def reduced(self) -> None:
        """One stage of this rank has its gradients for the step; after the last, sum."""
        self.seen += 1
        if self.seen < self.count:
            return
        self.seen = 0
        for name, parts, group in self.ties:
            grads = []
            for part in parts:
                param = _fetch(part, name)  # by name: FSDP2 replaces parameters
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                # under FSDP2 each dp rank sums its shard (the same shard on every pp rank)
                grads.append(_local(param.grad))
            total, copies = grads[0], grads[1:]
            for grad in copies:
                total.add_(grad)
            if group is None:
                _copy_sum(total, copies)
                continue
            work = dist.all_reduce(total, group=group, async_op=True)
            if total.device.type == "cuda" and dist.get_backend(group) != "gloo":
                work.wait()  # the stream waits, not the host
                _copy_sum(total, copies)
            else:
                _PENDING.append((work, total, copies))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _copy_sum(total: torch.Tensor, copies: list[torch.Tensor]) -> None:
    for grad in copies:
        grad.copy_(total)


_CLASSES: dict[type, type] = {}
_PENDING: list[Any] = []  # tied-gradient sums still running (gloo)
_HOOKED: list[Any] = []


def wait_tied_grads() -> None:
    """Wait for the sums of tied parameters' gradients over the pipeline ranks that the last
    ``schedule.step`` started. Every optimizer's ``step`` does this first; call it before
    reading such gradients yourself (``clip_grad_norm_``) with gloo. With NCCL the sums are
    ordered on the GPU stream and this returns at once."""
    while _PENDING:
        work, total, copies = _PENDING.pop()
        work.wait()
        _copy_sum(total, copies)


def _stage_class(base: type) -> type:
    """``base`` with the sum of tied parameters' gradients after a step's last backward
    (``_TiedGrads``).

    The sum is started without waiting: the last stage reaches its last backward while the
    first still waits for gradients the last has yet to send, and a blocking collective
    there would never return. NCCL orders it on the stream; with gloo it completes in the
    background and ``wait_tied_grads`` (run before every optimizer step) waits for it."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(
            lambda *_: wait_tied_grads()))
    if base not in _CLASSES:
        def perform_reduce_grad(self: Any, grad_scale_factor: int) -> None:
            base.perform_reduce_grad(self, grad_scale_factor)
            self._autotp_ties.reduced()

        def backward_weight_one_chunk(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self, "_autotp_fsdp_checked", False):
                _refuse_nested_fsdp(self.submod)
                self._autotp_fsdp_checked = True
            return base.backward_weight_one_chunk(self, *args, **kwargs)

        _CLASSES[base] = type(f"Autotp{base.__name__}", (base,),
                              {"perform_reduce_grad": perform_reduce_grad,
                               "backward_weight_one_chunk": backward_weight_one_chunk})
    return _CLASSES[base]


def _refuse_nested_fsdp(module: nn.Module) -> None:
    """Schedules that split the backward (input, then weight: the zero-bubble ones) leave
    wrong weight gradients in layers that FSDP2 shards on their own inside a stage (torch
    2.13, measured: plain modules too); FSDP2 on the whole stage module is right. Raised on
    the first weight backward of each rank; a peer already waiting on that rank then stops
    at the process group's timeout."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules() if m is not module):
        raise ConfigError(
            "a zero-bubble schedule (split input/weight backward) with fully_shard on the "
            "layers inside a pipeline stage computes wrong weight gradients in "
            f"torch {torch.__version__}: fully_shard only each stage's submod, or use a "
            "schedule without the split backward (1F1B, Interleaved1F1B, GPipe)")


__all__ = ["cut", "pipeline_stages", "stage_layers", "wait_tied_grads"]
