"""The prefill and decode programs of ``generate()``: the model called with a static cache
whose key/value tensors are inputs (``Step``), captured once with symbolic batch, prompt and
cache lengths, planned by the same rules with the cache as state (stored in the layout of
the k/v heads that write it, or narrowed to the heads this rank's query heads read:
``narrow_cache_heads``), and rewritten per rank reading the training program's weights
(``build_program``). The decoder that runs them: ``autotp.integrations.generate``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim

from autotp.errors import ConfigError, TraceError, versions

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
except ImportError:  # pragma: no cover - generation is for transformers models
    raise ConfigError("autotp's generate() needs the transformers package") from None

from autotp.runtime.fusion import full_slice, fuse_repeated_kv_attention
from autotp.capture.trace import Captured, capture
from autotp.layout import Replicate, Shard, parse_layout, shard_tensor
from autotp.ops import arg_seq, node_arg
from autotp.planner.plan import Plan
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.runtime.collectives import DeferredGradReduce, Redistribute, gather
from autotp.mesh import plan_sharing
from autotp.runtime.rewrite import erase_input_guards, rewrite
from autotp.weights.materialize import Weights, model_tensor

aten = torch.ops.aten
CACHE = "key_values"  # the step programs' input holding the key/value tensors, layer by layer
_TRACING = threading.Lock()
# transformers renamed the KV cache argument (and output field) from ``past_key_values`` to
# ``cache`` in 5.24, behind a deprecation shim; autotp reads the name off the model's forward
CACHE_NAMES = ("cache", "past_key_values")


def cache_argument(fn: Any) -> str:
    """The name under which ``fn`` (a model's forward, or ``generate``) takes the KV cache."""
    params = inspect.signature(fn).parameters
    for name in CACHE_NAMES:
        if name in params:
            return name
    raise ConfigError(
        f"{getattr(fn, '__qualname__', fn)} takes no KV cache argument (neither of "
        f"{', '.join(CACHE_NAMES)}); {versions()}")


# ---- what is captured ----------------------------------------------------------------------


class Slots(CacheLayerMixin):
    """A cache layer whose key/value tensors are program inputs, written at ``positions``."""

    is_compileable = True  # the mask is always materialized: no data-dependent skip
    is_sliding = False
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> Any:
        return self.positions[0]

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:  # abstract in transformers < 5.20
        return self.keys.shape[2]


class Step(nn.Module):
    """The model run on new tokens with a cache of explicit slots: what prefill and decode
    capture. ``cache`` holds keys and values of every layer, ``[B, heads, S, head_dim]``."""

    def __init__(self, model: nn.Module, logits_to_keep: int):
        super().__init__()
        self.model = model
        self.logits_to_keep = logits_to_keep

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache_position: torch.Tensor,
                key_values: list[torch.Tensor]) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = self.logits_to_keep
        kwargs[cache_argument(self.model.forward)] = Cache(layers=[
            Slots(key_values[i], key_values[i + 1], cache_position)
            for i in range(0, len(key_values), 2)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, **kwargs)
        return out.logits


# ---- the programs --------------------------------------------------------------------------


class SharedWeights(Weights):
    """The step programs' parameters are the training program's: the same storage where the
    layouts agree (they do for every model tried), else resliced from the gathered tensor."""

    def __init__(self, sharded: Any, step: Step):
        super().__init__(step, None)
        self.sharded = sharded
        self.local = {}
        for target, local in sharded.local_parameters().items():
            for name in sharded.plan.params[target].names:
                self.local[name] = (target, local)

    def parameter(self, target: str, names: Any, layout: Any, rank: int, tp: int,
                  like: torch.Tensor) -> torch.Tensor:
        for name in names:
            found = self.local.get(name.removeprefix("model."))
            if found is None:
                continue
            own, local = found
            have = self.sharded.plan.param_layout(own)
            if have == layout or (isinstance(have, Replicate) and isinstance(layout, Replicate)):
                return local.detach()
            full = local.detach()
            if isinstance(have, Shard):
                full = gather(self.sharded.comm, full.contiguous(), have)
            return shard_tensor(full, layout, rank, tp).clone() if isinstance(layout, Shard) \
                else full
        raise ConfigError(f"the decoding program reads {target!r}, which the sharded model "
                          "does not hold")

    def buffer(self, target: str, like: torch.Tensor) -> torch.Tensor:
        own = model_tensor(self.sharded.program, target.removeprefix("model."))
        return own if own is not None else super().buffer(target, like)


class Program:
    """One captured, planned and rewritten step (prefill or decode) of this rank.
    ``cache``: per cache tensor, its layout and the k/v heads ``(first, count)`` this rank
    stores when the layout is whole but its attention reads fewer (None: as laid out)."""

    def __init__(self, plan: Plan, module: fx.GraphModule,
                 cache: list[tuple[Any, Optional[tuple[int, int]]]]):
        self.plan = plan
        self.module = module  # the rewritten graph, as rules and passes see it
        self.cache = cache
        self.run = direct_calls(module)  # the same program, compiled to run lean

    def __call__(self, **inputs: Any) -> torch.Tensor:
        return self.run(**inputs)


def weights_dtype(sharded: Any) -> torch.dtype:
    return next((p.dtype for p in sharded.program.parameters() if p.is_floating_point()),
                torch.float32)


def replica(sharded: Any) -> nn.Module:
    """The model's structure on the meta device, in the dtype of the sharded weights: what
    the step programs are captured from (the sharded model keeps no full copy)."""
    info = sharded.source
    with torch.device("meta"):
        model = info.model_class(copy.deepcopy(info.config))
    return model.to(weights_dtype(sharded)).eval()


@contextlib.contextmanager
def _batched_experts(model: nn.Module) -> Iterator[None]:
    """transformers' grouped-GEMM experts take only bfloat16 on the meta device: the probe
    runs their batched form, which writes the same cache."""
    configs: dict[int, Any] = {
        id(c): c for c in [getattr(m, "config", None) for m in model.modules()]
        if getattr(c, "_experts_implementation", None) == "grouped_mm"}
    for config in configs.values():
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for config in configs.values():
            config._experts_implementation = "grouped_mm"


def cache_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """The per-layer key and value shapes ``[1, heads, 1, head_dim]`` the model writes, read
    from one run on the meta device (no formula per family: MLA and GQA alike)."""
    device = next(model.parameters()).device
    config: Any = model.config
    cache = DynamicCache(config=config)
    # transformers checks the ids for padding (reading their values, which meta tensors do
    # not have) when the config names a pad token: the probe runs without one
    pad, config.pad_token_id = getattr(config, "pad_token_id", None), None
    try:
        with torch.no_grad(), _batched_experts(model):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  use_cache=True, **{cache_argument(model.forward): cache})
    finally:
        config.pad_token_id = pad
    shapes = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            raise ConfigError(f"{type(model).__name__} keeps a cache autotp cannot shard "
                              f"(layer {type(layer).__name__} holds no keys/values)")
        shapes += [tuple(keys.shape), tuple(values.shape)]
    return shapes


def build_program(sharded: Any, shapes: list[tuple[int, ...]], prompt: bool,
                  logits_to_keep: int) -> Program:
    """Capture, plan and rewrite one step of ``sharded``'s model for this rank; ``shapes``:
    the model's per-layer key and value shapes (``cache_shapes``)."""
    captured, plan, step, cache_inputs = _planned_step(sharded, shapes, prompt, logits_to_keep)
    module, _ = rewrite(captured, plan, sharded.rank, sharded.comm,
                        weights=SharedWeights(sharded, step), device=sharded._device())
    drop_identities(module)
    erase_input_guards(module.graph)  # the decoder builds the inputs; no check per step
    layouts = [parse_layout(plan.states[name]) for name in cache_inputs]
    heads = narrow_cache_heads(module, cache_inputs, layouts, sharded.rank, plan.degree)
    fuse_repeated_kv_attention(module.graph)  # no backward here: GQA kernel, no copies
    module.graph.eliminate_dead_code()  # what export left unused; in-place writes are kept
    module.graph.lint()
    module.delete_all_unused_submodules()
    module.recompile()
    module.eval()
    return Program(plan, module, list(zip(layouts, heads)))


# ranks simulated in one process share one training plan, and so one capture of each step
_PLANNED: dict[tuple[int, bool, int], tuple[Any, ...]] = {}


def _planned_step(sharded: Any, shapes: list[tuple[int, ...]], prompt: bool,
                  logits_to_keep: int) -> tuple[Any, ...]:
    key = (id(sharded.plan), prompt, logits_to_keep)
    with _TRACING:  # torch.export is not thread-safe (simulated ranks are threads)
        found = _PLANNED.get(key)
        if found is not None and found[0]() is sharded.plan:
            return found[1:]
        model = replica(sharded)
        dtype = weights_dtype(sharded)
        batch, tokens, slots = 2, (3 if prompt else 1), 8
        meta = torch.device("meta")
        example = {
            "input_ids": torch.zeros(batch, tokens, dtype=torch.long, device=meta),
            "attention_mask": torch.ones(batch, slots, dtype=torch.long, device=meta),
            "position_ids": torch.zeros(batch, tokens, dtype=torch.long, device=meta),
            "cache_position": torch.zeros(tokens, dtype=torch.long, device=meta),
            CACHE: [torch.zeros(batch, s[1], slots, s[3], dtype=dtype, device=meta)
                    for s in shapes],
        }
        step = Step(model, logits_to_keep)
        try:
            # each layer reads its own cache entry, an input: every layer is traced
            captured = capture(step, example_kwargs=example,
                               dynamic_shapes=_step_dims(len(shapes), prompt, named=True),
                               layers_once=False)
        except TraceError as exc:
            if "Constraints violated" not in str(exc.__cause__):
                raise
            # Older torch (2.11) cannot prove some guards that hold for every size, such as
            # min(32*S, 128*S) == 32*S, and refuses named dims; automatic dims keep them as
            # checks, and the sizes must still come out symbolic.
            automatic = _step_dims(len(shapes), prompt, named=False)
            captured = capture(step, example_kwargs=example, dynamic_shapes=automatic,
                               layers_once=False)
            _check_symbolic(captured, automatic)
        cache_inputs = _cache_placeholders(captured, len(shapes))
        _name_cache_dim(captured, cache_inputs[0])
        # the training plan's replicated matrices were reported when it was made
        reported = frozenset(f"model.{name}" for param in sharded.plan.params.values()
                         if param.layout.startswith("R") for name in param.names)
        options = PlanOptions(strict=sharded.strict, state_inputs=tuple(cache_inputs),
                              reported=reported)
        plan = plan_graph(captured, sharded.plan.degree, options=options,
                          model_name=f"{sharded.plan.model} ({'prefill' if prompt else 'decode'})",
                          share=plan_sharing(sharded.comm))
        for stale in [k for k, v in _PLANNED.items() if v[0]() is None]:
            del _PLANNED[stale]
        _PLANNED[key] = (weakref.ref(sharded.plan), captured, plan, step, cache_inputs)
        return captured, plan, step, cache_inputs


def _step_dims(count: int, prompt: bool, named: bool) -> dict[str, Any]:
    """torch.export's dynamic shapes of a step's inputs: batch B, cache length S and, for
    prefill, prompt length T symbolic (``named``: as named dims, else automatic ones)."""
    if named:
        b, s, t = Dim("B", min=1), Dim("S", min=2), Dim("T", min=2) if prompt else Dim.STATIC
    else:
        b, s, t = Dim.AUTO, Dim.AUTO, Dim.AUTO if prompt else Dim.STATIC
    return {
        "input_ids": {0: b, 1: t}, "attention_mask": {0: b, 1: s},
        "position_ids": {0: b, 1: t}, "cache_position": {0: t},
        CACHE: [{0: b, 2: s} for _ in range(count)],
    }


def _check_symbolic(captured: Captured, dims: dict[str, Any]) -> None:
    wanted = {name: spec for name, spec in dims.items() if name != CACHE}
    wanted.update({f"{CACHE}_{i}": spec for i, spec in enumerate(dims[CACHE])})
    for node in captured.gm.graph.nodes:
        spec = wanted.get(str(node.target)) if node.op == "placeholder" else None
        for d, dim in (spec or {}).items():
            size = node.meta["val"].shape[d]
            if dim is not Dim.STATIC and not isinstance(size, torch.SymInt):
                raise TraceError(
                    f"torch {torch.__version__} fixed dim {d} of the decoding step's "
                    f"{node.target} to {size}: autotp needs it symbolic to decode any "
                    "length without a new capture (torch >= 2.13 captures it)")


def _cache_placeholders(captured: Captured, count: int) -> list[str]:
    names = [str(n.target) for n in captured.gm.graph.nodes
             if n.op == "placeholder" and str(n.target).startswith(CACHE + "_")]
    if len(names) != count:
        raise AssertionError(f"expected {count} cache inputs in the step program, got {names}")
    return names


def _name_cache_dim(captured: Captured, name: str) -> None:
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder" and node.target == name:
            size = node.meta["val"].shape[2]
            if isinstance(size, torch.SymInt):
                captured.dim_names[size.node.expr] = "S"


def drop_identities(gm: fx.GraphModule) -> None:
    """What does nothing in a forward without backward is not run, one op call less per node
    and step: layout changes between replicated forms (R -> R*, a parameter's deferred
    gradient), casts to the dtype a value already has and slices of a whole dim (capture
    already drops torch.export's metadata asserts)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, DeferredGradReduce) or (
                    isinstance(module, Redistribute) and isinstance(module.src, Replicate) and
                    isinstance(module.dst, Replicate)):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
        elif (node.target == aten.to.dtype and len(node.args) == 2 and not node.kwargs
              and _dtype(node.args[0]) == node.args[1]) or full_slice(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` compiled with less Python around each op, for steps run without autograd: a
    decode step calls some 800 ops per token, and the wrapper of ``torch.ops.aten.*`` (a
    Python frame and an attribute chain per call) and the module path of every weight
    (``getattr(self.model.layers, "0").self_attn.q_proj.weight``: seven lookups) cost as much
    as a small model's ops. Each ATen op becomes a global bound to its C entry point and each
    weight an attribute of the program itself; ``gm`` keeps its graph for inspection."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    graph._codegen = gm.graph._codegen  # the pytree of inputs and outputs, unchanged
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = _direct(node.target)
        elif node.op == "get_attr":
            flat = "w_" + str(node.target).replace(".", "_")
            value = model_tensor(gm, str(node.target))
            # not a tensor: the body of a higher-order op (a no-grad region's graph module)
            attrs[flat] = value if value is not None else gm.get_submodule(str(node.target))
            node.target = flat
        elif node.op == "call_module":
            attrs[str(node.target)] = gm.get_submodule(str(node.target))
    lean = fx.GraphModule(attrs, graph, class_name="DirectCalls")
    for name, value in attrs.items():  # a plain attribute: no Module.__getattr__ per read
        if isinstance(value, torch.Tensor):
            lean._parameters.pop(name, None)
            lean._buffers.pop(name, None)
            lean.__dict__[name] = value
    return lean


_DIRECT: dict[Any, Any] = {}


def _direct(op: torch._ops.OpOverload) -> Any:
    """``op``'s C entry point, named so that fx binds it as a global of the generated code
    rather than spelling ``torch.ops.<ns>.<op>.<overload>`` (a partial: one C call)."""
    found = _DIRECT.get(op)
    if found is None:
        found = functools.partial(op._op)
        found.__module__ = "autotp.direct"  # type: ignore[attr-defined]
        found.__name__ = op.__name__.replace(".", "_")  # type: ignore[attr-defined]
        _DIRECT[op] = found
    return found


def _dtype(node: Any) -> Optional[torch.dtype]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


# ---- the k/v heads a rank reads -------------------------------------------------------------


def narrow_cache_heads(gm: fx.GraphModule, cache_inputs: list[str], layouts: list[Any],
                       rank: int, tp: int) -> list[Optional[tuple[int, int]]]:
    """When tp exceeds the k/v heads, the k/v projections and so the cache are whole on every
    rank, yet a rank's attention reads only the k/v heads of its query heads: the cache is
    read through ``repeat_kv`` (unsqueeze, expand, reshape) and then this rank's slice of
    the repeated heads. Such a cache stores and writes only those k/v heads. Returns, per
    cache input, ``(first, count)`` of the heads kept, or None where it is left as it was.
    Runs after ``drop_identities`` (no whole-dim slices left on the way)."""
    placeholders = {str(n.target): n for n in gm.graph.nodes if n.op == "placeholder"}
    heads = [_narrow_heads(gm, placeholders[name], rank, tp)
             if isinstance(layout, Replicate) else None
             for name, layout in zip(cache_inputs, layouts)]
    return heads


def _narrow_heads(gm: fx.GraphModule, cache: fx.Node, rank: int,
                  tp: int) -> Optional[tuple[int, int]]:
    writes = [u for u in cache.users if u.target == aten.index_copy_.default]
    if len(writes) != 1 or any(u not in writes and not _reads_size(u) for u in cache.users):
        return None
    write = writes[0]
    kv = cache.meta["val"].shape[1]
    if write.args[0] is not cache or write.args[1] != 2 or not isinstance(kv, int):
        return None
    chains = []
    for user in write.users:
        if _reads_size(user):
            continue
        chain = _repeated_then_sliced(gm, user, kv)
        if chain is None:
            return None
        chains.append(chain)
    if not chains:
        return None
    blocks = []
    for expand, _, _ in chains:
        repeats = arg_seq(expand, 1)[2]
        total = kv * repeats
        if total % tp:
            return None
        start = rank * (total // tp)
        blocks.append((start, start + total // tp, repeats))
    first = min(start // repeats for start, _, repeats in blocks)
    last = max((end - 1) // repeats for _, end, repeats in blocks)
    count = last - first + 1
    if count >= kv:
        return None
    graph = gm.graph
    with graph.inserting_before(write):
        kept = graph.call_function(aten.slice.Tensor, (write.args[3], 1, first, first + count))
    write.args = (*write.args[:3], kept, *write.args[4:])
    for (expand, reshape, redistribute), (start, end, repeats) in zip(chains, blocks):
        sizes, flat = list(arg_seq(expand, 1)), list(arg_seq(reshape, 1))
        read = reshape
        if count == 1:  # every query head of this rank reads the one k/v head kept
            sizes[1:3], flat[1] = [1, end - start], end - start
        else:
            sizes[1], flat[1] = count, count * repeats
            offset = start - first * repeats
            if offset or end - start != count * repeats:
                with graph.inserting_after(reshape):
                    read = graph.call_function(aten.slice.Tensor,
                                               (reshape, 1, offset, offset + end - start))
        expand.args = (expand.args[0], sizes, *expand.args[2:])
        reshape.args = (reshape.args[0], flat, *reshape.args[2:])
        redistribute.replace_all_uses_with(read)
        graph.erase_node(redistribute)
    return first, count


def _reads_size(node: fx.Node) -> bool:
    """A shape read that is not of the heads (dim 1), or torch.export's input guards."""
    if node.op == "call_module" and node.target == "_guards_fn":
        return True
    return node.target == aten.sym_size.int and node_arg(node, "dim") != 1


def _repeated_then_sliced(gm: fx.GraphModule, node: fx.Node,
                          kv: int) -> Optional[tuple[fx.Node, ...]]:
    """``(expand, reshape, redistribute)`` where ``node`` starts ``repeat_kv`` (unsqueeze at
    2, expand to [B, kv, n, S, D], reshape to [B, kv * n, S, D]) whose result is then
    sliced to this rank's heads."""
    if node.target != aten.unsqueeze.default or node.args[1] != 2 or len(node.users) != 1:
        return None
    expand = next(iter(node.users))
    if expand.target != aten.expand.default or len(sizes := arg_seq(expand, 1)) != 5 or \
            sizes[1] != kv or not isinstance(sizes[2], int) or len(expand.users) != 1:
        return None
    reshape = next(iter(expand.users))
    if reshape.target != aten.reshape.default or len(arg_seq(reshape, 1)) != 4 or \
            len(reshape.users) != 1:
        return None
    redistribute = next(iter(reshape.users))
    if redistribute.op != "call_module":
        return None
    module = gm.get_submodule(str(redistribute.target))
    if not isinstance(module, Redistribute) or not isinstance(module.src, Replicate) or \
            module.dst != Shard(1):
        return None
    return expand, reshape, redistribute
