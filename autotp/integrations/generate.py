"""Decoding: ``generate()`` on the sharded model, with a KV cache that holds this rank's heads.

A transformers causal LM decodes with two more programs next to the training one: *prefill*
(a prompt of T tokens) and *decode* (one token). Each is the original model called with a
static cache whose key/value tensors are inputs of the program, written in place at the new
positions (``index_copy_``). They are captured once with symbolic batch, prompt and cache
lengths, planned by the same rules, and rewritten per rank like the training program. The
cache is *state* to the planner: stored in whatever layout the plan gives it, which is the
layout of the k/v heads that write it: sharded by heads, or, when tp exceeds the k/v heads
and their projections are whole, narrowed to the k/v heads this rank's query heads read
(``narrow_cache_heads``). The programs read the weights the training program already holds:
no second copy, and no backward (layout changes that only mark gradients are dropped).

transformers' own generation loop drives them. ``ShardedModule.generate`` runs
``GenerationMixin.generate`` on a stand-in of the model's class whose forward runs these
programs, so logits processors, stopping criteria, streamers, beam search and
``return_dict_in_generate`` are transformers' code, not autotp's.

    sharded = autotp.parallelize(model, tp=4)
    out = sharded.generate(input_ids, attention_mask=mask, max_new_tokens=64)
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any, Optional, cast

import torch
from torch import nn

from autotp.errors import ConfigError

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # pragma: no cover - generation is for transformers models
    raise ConfigError("autotp's generate() needs the transformers package") from None

from autotp.integrations.steps import (CACHE, CACHE_NAMES, Program, replica, build_program,
                                   cache_argument, cache_shapes, weights_dtype)
from autotp.layout import Shard, local_shape


# ---- the cache -----------------------------------------------------------------------------


class LocalLayer(CacheLayerMixin):
    """One layer of a rank's cache, as transformers sees it; the tensors are the cache's."""

    is_compileable = False  # generate() keeps passing the 2D mask; the programs make the 4D
    is_sliding = False

    def __init__(self, cache: "KVCache"):
        super().__init__()
        self.cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("the cache autotp made is written by its own programs only")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_max_length(self) -> int:
        return self.cache.capacity

    def get_max_cache_shape(self) -> int:  # abstract in transformers < 5.20
        return self.cache.capacity


class KVCache(Cache):
    """This rank's cache: keys and values ``[B, local k/v heads, capacity, head_dim]`` per
    layer, allocated at the first step (when the batch is known). ``capacity`` None: room
    for the first call's tokens, doubled whenever a later call needs more."""

    def __init__(self, decoder: "Decoder", capacity: Optional[int], graphs: bool = True):
        super().__init__(layers=[LocalLayer(self) for _ in range(len(decoder.shapes) // 2)])
        self.decoder = decoder
        self.capacity = capacity or 0
        self.fixed = capacity is not None
        self.graphs = graphs  # decode steps may replay a CUDA graph (Decoder._graphs)
        self.graph: Optional[GraphedStep] = None
        self.seen = 0
        self.tensors: list[torch.Tensor] = []
        self.allocations = 0  # how many times the tensors were (re)allocated

    def reserve(self, batch: int, length: int, program: Program) -> None:
        if self.tensors and self.tensors[0].shape[0] != batch:
            raise ConfigError(f"the cache holds a batch of {self.tensors[0].shape[0]}, this "
                              f"call has {batch}")
        if length > self.capacity:
            if self.fixed and self.tensors:
                raise ConfigError(f"the cache has room for {self.capacity} tokens, this call "
                                  f"needs {length}")
            self.capacity = max(length, 2 * self.capacity)
        if self.tensors and self.tensors[0].shape[2] == self.capacity:
            return
        new = self.decoder.allocate(batch, self.capacity, program)
        self.allocations += 1
        for old, fresh in zip(self.tensors, new):
            fresh[:, :, : old.shape[2]].copy_(old)
        self.tensors = new
        for i, layer in enumerate(cast("list[LocalLayer]", self.layers)):
            layer.keys, layer.values = new[2 * i], new[2 * i + 1]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for tensor in self.tensors:
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class GraphedStep:
    """The decode program recorded as a CUDA graph for one cache (its tensors, batch and
    capacity). A step copies its inputs into the graph's own buffers and replays the graph:
    the host issues one launch instead of one per op, and the writes land in the cache.

    Recorded at the cache's first decode step with that step's real inputs: the warm-up runs
    (on a side stream, as CUDA graphs need) are that step itself, writing the same keys and
    values into the same slots, so the cache is left as an eager step leaves it."""

    def __init__(self, graph: Any, buffers: dict[str, torch.Tensor], out: torch.Tensor):
        self.graph = graph
        self.buffers = buffers
        self.out = out

    @staticmethod
    def capture(program: Program,
                inputs: dict[str, Any]) -> tuple[Optional["GraphedStep"], torch.Tensor]:
        buffers = {name: value.clone() for name, value in inputs.items() if name != CACHE}
        static = dict(buffers, **{CACHE: inputs[CACHE]})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and library warm-up outside the recording
                logits = program(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = program(**static)
        except RuntimeError as exc:  # an op of this model that a graph cannot hold
            warnings.warn(f"autotp: the decode step runs without a CUDA graph ({exc}); "
                          "pass generate(..., cuda_graphs=False) to skip the attempt",
                          stacklevel=2)
            return None, logits
        return GraphedStep(graph, buffers, out), logits

    def __call__(self, inputs: dict[str, Any]) -> torch.Tensor:
        for name, buffer in self.buffers.items():
            buffer.copy_(inputs[name])
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites the graph's output


# ---- the decoder ---------------------------------------------------------------------------


class Decoder:
    """This rank's prefill and decode programs, its caches, and the transformers stand-in
    that ``generate`` runs on."""

    def __init__(self, sharded: Any):
        info = sharded.source
        if info is None or info.config is None or not _can_generate(info.model_class):
            name = info.model_class.__name__ if info is not None else type(sharded).__name__
            raise ConfigError(
                f"generate() needs a transformers model that can generate (a causal LM such "
                f"as LlamaForCausalLM); {name} cannot")
        self.sharded = sharded
        self.info = info
        self.programs: dict[tuple[bool, int], Program] = {}
        self.shapes = cache_shapes(replica(sharded))
        self.device = sharded._device()
        self.dtype = weights_dtype(sharded)
        self.host = _host(self)
        self.cache_name = cache_argument(info.model_class.forward)
        # the output's field for the cache, renamed like the argument
        self.output_field = next(key for key in CACHE_NAMES
                                 if key in CausalLMOutputWithPast.__dataclass_fields__)

    def program(self, prompt: bool, logits_to_keep: int) -> Program:
        key = (prompt, logits_to_keep if prompt else 1)
        if key not in self.programs:
            built = build_program(self.sharded, self.shapes, prompt, key[1])
            for other in self.programs.values():  # one cache serves every program
                if other.cache != built.cache:
                    raise AssertionError(f"the decoding programs store the cache differently: "
                                         f"{other.cache} and {built.cache}")
            self.programs[key] = built
        return self.programs[key]

    def allocate(self, batch: int, capacity: int, program: Program) -> list[torch.Tensor]:
        tp = self.sharded.plan.degree
        out = []
        for shape, (layout, heads) in zip(self.shapes, program.cache):
            full = (batch, heads[1] if heads else shape[1], capacity, shape[3])
            local = local_shape(full, layout, tp) if isinstance(layout, Shard) else full
            out.append(torch.zeros(local, dtype=self.dtype, device=self.device))
        return out

    def max_positions(self) -> Optional[int]:
        config = self.info.config
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
        return None

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None, logits_to_keep: int = 0,
                **kwargs: Any) -> Any:
        name = self.cache_name
        given = [kwargs.pop(key) for key in CACHE_NAMES if kwargs.get(key) is not None]
        unknown = sorted(k for k, v in kwargs.items()
                         if v is not None and k not in _IGNORED)
        if len(given) > 1:
            raise ConfigError(f"pass the KV cache once, as {name}= (got both "
                              f"{' and '.join(CACHE_NAMES)})")
        if unknown or input_ids is None:
            raise ConfigError(
                f"the decoding programs take input_ids, attention_mask, position_ids and "
                f"{name}; got {unknown or 'no input_ids'}")
        cache = given[0] if given else None
        if cache is None:
            cache = KVCache(self, None)
        elif getattr(cache, "decoder", None) is not self:
            raise ConfigError(
                f"{name}= must be the cache this sharded model returned (a "
                f"{type(cache).__name__} holds every head of every rank); start with "
                f"{name}=None")
        batch, tokens = input_ids.shape
        past = cache.seen
        limit = self.max_positions()
        if limit is not None and past + tokens > limit:
            raise ConfigError(f"{past + tokens} positions exceed the model's "
                              f"{limit} (max_position_embeddings)")
        self._check_plan()
        prompt = tokens > 1
        program = self.program(prompt, int(logits_to_keep or 0) if prompt else 1)
        # On the CPU the programs see the filled slots only (a view: the writes land in the
        # cache), so attention reads past + new tokens, not the whole capacity; at least 2
        # slots, the smallest cache length the programs were captured for (the spare one
        # masked). On a GPU a cache of fixed capacity is read whole, the free slots masked:
        # every step has the same shapes, so kernels' plans (cuDNN attention) are reused and
        # the decode step can be replayed as a CUDA graph.
        length = max(past + tokens, 2)
        cache.reserve(batch, length, program)
        if self.device.type == "cuda" and cache.fixed:
            length = cache.capacity
        device = self.device
        if attention_mask is not None and (attention_mask.dim() != 2 or
                                           attention_mask.shape[1] != past + tokens):
            raise ConfigError(
                f"attention_mask must be [batch, past + new tokens] = [{batch}, "
                f"{past + tokens}], got {list(attention_mask.shape)}")
        mask = attention_mask.to(device) if attention_mask is not None else \
            torch.ones(batch, past + tokens, dtype=torch.long, device=device)
        if length > past + tokens:
            mask = torch.cat([mask, mask.new_zeros(batch, length - past - tokens)], dim=1)
        positions = torch.arange(past, past + tokens, device=device)
        if position_ids is None:
            position_ids = positions.unsqueeze(0).expand(batch, tokens)
        inputs = dict(input_ids=input_ids.to(device), attention_mask=mask,
                      position_ids=position_ids.to(device).contiguous(),
                      cache_position=positions,
                      key_values=[t[:, :, :length] for t in cache.tensors])
        if not prompt and self._graphs(cache) and length == cache.capacity:
            if cache.graph is None:
                cache.graph, logits = GraphedStep.capture(program, inputs)
                cache.graphs = cache.graph is not None
            else:
                logits = cache.graph(inputs)
        else:
            logits = program(**inputs)
        cache.seen = past + tokens
        kept: dict[str, Any] = {self.output_field: cache if use_cache is not False else None}
        return CausalLMOutputWithPast(logits=logits, **kept)

    def _graphs(self, cache: "KVCache") -> bool:
        """Whether this cache's decode steps replay a CUDA graph: on a GPU, for a cache of
        fixed capacity (generate's), unless turned off, and where the collectives can be
        captured (NCCL, or none at tp = 1)."""
        if not cache.graphs or self.device.type != "cuda" or not cache.fixed:
            return False
        comm = self.sharded.comm
        return self.sharded.plan.degree == 1 or getattr(comm, "backend", "gloo") != "gloo"

    def generate(self, inputs: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        graphs = kwargs.pop("cuda_graphs", True)
        if any(kwargs.get(key) is not None for key in CACHE_NAMES):
            raise ConfigError("generate() on a sharded model makes its own cache: leave "
                              f"{self.cache_name} out")
        for key in ("assistant_model", "prompt_lookup_num_tokens", "cache_implementation"):
            if kwargs.get(key) is not None:
                raise ConfigError(f"generate({key}=...) is not supported on a sharded model")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is None:
            raise ConfigError("generate() on a sharded model needs input_ids")
        total = self._total_length(ids.shape[-1], kwargs)
        limit = self.max_positions()
        if limit is not None and total is not None and total > limit:
            raise ConfigError(
                f"a prompt of {ids.shape[-1]} tokens plus the new tokens needs {total} "
                f"positions, more than the model's {limit} (max_position_embeddings): "
                "lower max_new_tokens or shorten the prompt")
        kwargs[self.cache_name] = KVCache(self, total, graphs=bool(graphs))
        self._check_plan()
        return self.host.generate(inputs, **kwargs)

    def _check_plan(self) -> None:
        if not self.sharded._plan_checked:
            self.sharded.check_plan()

    def _total_length(self, prompt: int, kwargs: dict[str, Any]) -> Optional[int]:
        """The tokens the cache must hold; None where neither the call nor the generation
        config says (transformers' own default applies, which versions differ on: the cache
        then grows as it fills, and is not replayed as a CUDA graph)."""
        config = kwargs.get("generation_config") or self.host.generation_config
        new = kwargs.get("max_new_tokens")
        if new is None:
            new = getattr(config, "max_new_tokens", None)
        if new is not None:
            return prompt + int(new)
        length = kwargs.get("max_length") or getattr(config, "max_length", None)
        return max(int(length), prompt + 1) if length else None


_IGNORED = {"return_dict", "output_attentions", "output_hidden_states", "cache_position",
            "token_type_ids"}


def _can_generate(model_class: type) -> bool:
    can = getattr(model_class, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - a class that cannot answer cannot generate
        return False


def _host(decoder: Decoder) -> Any:
    """An instance of the model's own class (so transformers sees the same model: the same
    ``prepare_inputs_for_generation``, defaults and checks) that holds no weights and whose
    forward runs the decoding programs."""
    cls = decoder.info.model_class
    signature = inspect.signature(cls.forward)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop(next(iter(signature.parameters)))
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
        return decoder.forward(**named)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    host_cls: type[nn.Module] = type(f"Sharded{cls.__name__}", (cls,),
                                     {"forward": forward, "__module__": __name__})
    host = host_cls.__new__(host_cls)
    nn.Module.__init__(host)
    host.config = decoder.info.config
    host.generation_config = copy.deepcopy(decoder.info.generation_config)
    # one real tensor, so that transformers' ``device`` and ``dtype`` answer as for the model
    host.register_parameter("_autotp_device", nn.Parameter(
        torch.zeros((), dtype=decoder.dtype, device=decoder.device), requires_grad=False))
    return host


def decoder_of(sharded: Any) -> Decoder:
    found = getattr(sharded, "_decoder", None)
    if found is None and sharded.plan.ep > 1:
        raise ConfigError(
            f"generation with expert parallelism (ep={sharded.plan.ep}) is not offered: its "
            "decoding programs hold experts per tp rank only; build the model for generation "
            "without ep (autotp.parallelize or from_pretrained with tp alone)")
    if found is None:
        found = Decoder(sharded)
        object.__setattr__(sharded, "_decoder", found)
    return found


__all__ = ["Decoder", "decoder_of"]
