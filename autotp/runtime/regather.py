"""Sequence parallelism at Megatron's activation memory: gathered inputs saved as shards.

With sequence parallelism a column-parallel product reads its input all-gathered along the
sequence, and autograd would keep that full-sequence input for the product's backward (the
weight gradient is x^T dy). Megatron-LM keeps the sequence shard instead and all-gathers it
again in backward (Korthikanti et al. 2022: s*b*h/t * (34 + 5as/h) bytes per layer).
``ShardKeeper`` does the same for whatever op saves such a tensor.

Invariant: while a rank program's forward runs in ``ShardKeeper.saving()``, a tensor that
autograd saves for backward and that is the output of one of the program's sequence
all-gathers, or a view of its storage, is stored as this rank's shard plus the view's size,
stride and offset; backward all-gathers the shard again when it unpacks it (once for all the
saves of one gathered tensor unpacked in turn) and rebuilds the view. Every other saved
tensor is stored as it is.

Saved-tensor hooks nest, and autograd calls only the innermost pair. The keeper's pair
therefore hands what it stores to the pair that was active outside it (a user's
``save_on_cpu``, a memory probe, a checkpoint around the whole model), which sees the shard,
not the gathered tensor. Inside an activation-checkpointed layer the checkpoint's pair is
the innermost one: it stores nothing and recomputes the layer, gathers included.

In a rank program the keeper's pair is set only around the ops that read a gathered tensor
or a view of it (``scope_saves``: the products reading the gathered input), not around the
whole forward: every other saved tensor goes to autograd's own storage (or the outer pair)
untouched, with no alias made per saved tensor. The pair is set there only while no other
pair was set inside the forward (a checkpointed layer's: it stays innermost, as it would be
around the whole forward). A keeper used without ``scope_saves``, or the keeper of a
compiled program (whose readers are traced into its graphs: ``saving(whole=True)``), sets its
pair around the whole forward. A product reading a whole gathered tensor needs no pair at all:
``ShardKeeper.product`` runs it as an autograd Function that saves the shard and gathers it
again in backward (Megatron's column-parallel product), no alias per save, no view rebuilt.

Re-gathers are collectives, so every rank must run them in the same order: they run when
backward unpacks the saved tensors, in autograd's order, which the ranks share since they
run the same program, and whether a saved tensor is kept as a shard depends only on the
program (storage identity), never on timing.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
# False inside transforms that forbid saved-tensor hooks (torch.func)
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]


class Gatherer(Protocol):
    """What gathered a tensor, and can gather it again in backward (a ``Redistribute``)."""

    def regather(self, shard: torch.Tensor) -> torch.Tensor:
        ...


class _Regather:
    """The re-gather of one forward all-gather's output, shared by the saves of it.

    The first unpack gathers; the others of the same backward reuse that tensor, and the
    last lets it go (q, k and v projections save one gathered input three times)."""

    __slots__ = ("gatherer", "saves", "unpacked", "full")

    def __init__(self, gatherer: Gatherer):
        self.gatherer = gatherer
        self.saves = 0
        self.unpacked = 0
        self.full: Optional[torch.Tensor] = None

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        full = self.full
        if full is None:
            with torch.no_grad():
                full = self.gatherer.regather(shard)
        self.unpacked += 1
        if self.unpacked >= self.saves:  # the last one (a retained graph starts over)
            self.full, self.unpacked = None, 0
        else:
            self.full = full
        return full


class _Gathered:
    """A forward all-gather's output, while it lives: its shard, and how to re-gather it."""

    __slots__ = ("shard", "version", "dtype", "regather")

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, gatherer: Gatherer):
        self.shard = shard  # its history holds no save of this: no cycle, no alias needed
        self.version = shard._version
        self.dtype = full.dtype
        self.regather = _Regather(gatherer)


class _Saved:
    """What the keeper stores for one saved tensor: the tensor (or what the outer hooks made
    of it), and its version when the keeper holds it itself (hooks turn autograd's own
    check of in-place changes off)."""

    __slots__ = ("stored", "version")

    def __init__(self, stored: Any, version: Optional[int]):
        self.stored = stored
        self.version = version


class _SavedShard(_Saved):
    """A view of a gathered tensor, stored as the shard: the view's geometry rebuilds it."""

    __slots__ = ("regather", "size", "stride", "offset")

    def __init__(self, stored: Any, version: Optional[int], regather: _Regather,
                 view: torch.Tensor):
        super().__init__(stored, version)
        self.regather = regather
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def rebuild(self, shard: torch.Tensor) -> torch.Tensor:
        full = self.regather(shard)
        if full.size() == self.size and full.stride() == self.stride and not self.offset:
            return full
        return full.as_strided(self.size, self.stride, self.offset)


def _check_version(value: torch.Tensor, expected: Optional[int], what: str) -> None:
    if expected is not None and value._version != expected:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {what} {list(value.shape)} is at version {value._version}; "
            f"expected version {expected} instead")


class _PackHooks:
    """The keeper's pack/unpack pair for one forward, composed with ``outer``: the pair
    active when the forward began (None: autograd's own storage)."""

    def __init__(self, keeper: "ShardKeeper", outer: Optional[Hooks]):
        self.keeper = keeper
        self.outer_pack: Optional[Callable[[torch.Tensor], Any]] = None
        self.outer_unpack: Optional[Callable[[Any], torch.Tensor]] = None
        if outer is not None:
            self.outer_pack, self.outer_unpack = outer

    def pack(self, tensor: torch.Tensor, inputs_only: bool = False) -> _Saved:
        gathered = self.keeper.gathered_of(tensor)
        if gathered is None:
            if self.outer_pack is not None:
                return _Saved(self.outer_pack(tensor), None)
            # detached: a saved output holding its own grad_fn would be a reference cycle.
            # An op that saves only its inputs (``inputs_only``) saves no tensor whose
            # history holds the node saving it: stored as it is, no alias made
            return _Saved(tensor if inputs_only else tensor.detach(), tensor._version)
        gathered.regather.saves += 1
        shard = gathered.shard
        if self.outer_pack is not None:
            return _SavedShard(self.outer_pack(shard), None, gathered.regather, tensor)
        return _SavedShard(shard, gathered.version, gathered.regather, tensor)

    def pack_input(self, tensor: torch.Tensor) -> _Saved:
        """``pack`` for an op that saves only its inputs (``_SAVES_INPUTS_ONLY``)."""
        return self.pack(tensor, inputs_only=True)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        value = saved.stored if self.outer_unpack is None else self.outer_unpack(saved.stored)
        if isinstance(saved, _SavedShard):
            _check_version(value, saved.version, "the sequence shard of a gathered input")
            return saved.rebuild(value)
        _check_version(value, saved.version, "a tensor")
        return value


class ShardKeeper:
    """One rank program's record of its live sequence all-gathers, and the saved-tensor
    hooks that store them as shards (see the module docstring)."""

    def __init__(self, scoped: bool = False) -> None:
        self._live: dict[StorageWeakRef, _Gathered] = {}
        self._depth = 0
        # the pair is set around the readers of gathered tensors only (``scope_saves``)
        self.scoped = scoped
        self._hooks: Optional[_PackHooks] = None
        self._outer: Optional[Hooks] = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "ShardKeeper":
        return ShardKeeper(self.scoped)  # a copied program records its own gathers

    @contextlib.contextmanager
    def saving(self, whole: bool = False) -> Iterator[None]:
        """Run a forward with the keeper's hooks innermost (the outermost call installs them,
        or, scoped, readies them for the readers; nothing happens where autograd records
        nothing or hooks are disabled). ``whole``: around the whole forward even where
        scoped (a compiled program, whose readers are traced into its graphs)."""
        if self._depth or not torch.is_grad_enabled() or \
                torch.is_inference_mode_enabled() or not _hooks_enabled():
            yield
            return
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        hooks = _PackHooks(self, outer)
        self._depth += 1
        try:
            if self.scoped and not whole:
                self._hooks, self._outer = hooks, outer
                yield
            else:
                with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                    yield
        finally:
            self._depth -= 1
            self._live.clear()
            self._hooks = self._outer = None

    def reading(self, inputs_only: bool = False) -> ContextManager[Any]:
        """The keeper's hooks around one op that reads a gathered tensor, inside ``saving``
        and while the pair on top is the one the forward began with. ``inputs_only``: the
        op saves only its inputs, never its output (``_SAVES_INPUTS_ONLY``)."""
        hooks = self._hooks
        if hooks is None or not _same_hooks(
                torch._C._autograd._top_saved_tensors_default_hooks(True), self._outer):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(
            hooks.pack_input if inputs_only else hooks.pack, hooks.unpack)

    def product(self, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``linear(x, weight, bias)`` as a ``_KeptProduct`` where ``x`` is a whole gathered
        tensor of this keeper's and the forward's pair is on top (as ``reading`` asks); None
        where not, for the op to run under ``reading``."""
        if self._hooks is None or not _same_hooks(
                torch._C._autograd._top_saved_tensors_default_hooks(True), self._outer) or \
                torch.is_autocast_enabled(x.device.type) or x.dtype != weight.dtype or \
                x.dim() < 2 or x.storage_offset() or not x.is_contiguous():
            return None
        gathered = self.gathered_of(x)
        if gathered is None or x.untyped_storage().nbytes() != x.numel() * x.element_size():
            return None
        out: torch.Tensor = _KeptProduct.apply(
            x, weight, bias, gathered.shard, gathered.regather if weight.requires_grad else None)
        return out

    def record(self, full: torch.Tensor, shard: torch.Tensor, gatherer: Gatherer) -> None:
        """``full`` is ``shard`` all-gathered by ``gatherer``: saves of it keep ``shard``."""
        # (``full`` need not require grad: a product saves it for its weight's gradient)
        if not self._depth or not torch.is_grad_enabled() or full.numel() == 0 or \
                full.storage_offset() or not full.is_contiguous():
            return
        storage = full.untyped_storage()
        if storage.nbytes() != full.numel() * full.element_size():
            return  # a view of something larger: the re-gather could not rebuild its storage
        for key in [k for k in self._live if k.expired()]:
            del self._live[key]
        self._live[StorageWeakRef(storage)] = _Gathered(shard, full, gatherer)

    def gathered_of(self, tensor: torch.Tensor) -> Optional[_Gathered]:
        """The live gather whose output ``tensor`` views, if its shard is unchanged."""
        if not self._live or tensor.layout is not torch.strided:
            return None
        try:
            key = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return None
        found = self._live.get(key)
        if found is None or found.dtype != tensor.dtype or \
                found.shard._version != found.version:
            return None
        return found


class _KeptProduct(torch.autograd.Function):
    """y = x W^T + b of a gathered x, saving x's shard: backward gathers x again for W's
    gradient (Megatron's column-parallel product under sequence parallelism). The saves go
    through autograd's own storage (or the outer pair, which sees the shard): no hook of the
    keeper's, so no alias per save and no view to rebuild."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                shard: torch.Tensor, regather: Optional[_Regather]) -> torch.Tensor:
        ctx.regather, ctx.has_bias = regather, bias is not None
        if regather is not None:  # W's gradient reads x: one more save of the gathered x
            regather.saves += 1
            ctx.save_for_backward(weight, shard)
        else:
            ctx.save_for_backward(weight)
        return torch.ops.aten.linear.default(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        saved = ctx.saved_tensors  # once: a checkpoint's pair unpacks each save once
        weight = saved[0]
        rows = g.reshape(-1, g.shape[-1])
        gx = rows.mm(weight).view(*g.shape[:-1], weight.shape[-1]) \
            if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.regather is not None:
            x = ctx.regather(saved[1])
            gw = rows.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = rows.sum(0)
        return gx, gw, gb, None, None


def _same_hooks(a: Optional[Hooks], b: Optional[Hooks]) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] is b[1]


# ---- the readers of gathered tensors -------------------------------------------------------

_aten = torch.ops.aten
# products whose backward saves their inputs (or views of them: x, W^T) and never their own
# output: nothing they save has a history that holds the node saving it
_SAVES_INPUTS_ONLY = frozenset({
    _aten.linear.default, _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten.matmul.default})


class KeptReads(nn.Module):
    """One op of a rank program that reads a gathered tensor (or a view of it), run with the
    keeper's saved-tensor hooks (``ShardKeeper.reading``)."""

    def __init__(self, keeper: ShardKeeper, op: Callable[..., Any]):
        super().__init__()
        self.keeper = keeper
        self.op = op
        self.inputs_only = op in _SAVES_INPUTS_ONLY

    def extra_repr(self) -> str:
        return f"{self.op}, saves of a gathered input kept as the shard"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # compiled: the hooks are around the whole forward
            return self.op(*args, **kwargs)
        if self.op is _aten.linear.default and not kwargs:
            out = self.keeper.product(*args)
            if out is not None:
                return out
        with self.keeper.reading(self.inputs_only):
            return self.op(*args, **kwargs)


_SIZE_READS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                         torch.ops.aten.sym_numel.default})


def _aliases(node: fx.Node) -> bool:
    """``node``'s value may be a view of its first argument (a view op, per its schema), or
    an item of such a list (``split``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _aliases(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def scope_saves(graph: fx.Graph, root: nn.Module, keeper: ShardKeeper,
                gathers: list[fx.Node]) -> int:
    """Run every op that reads one of ``gathers`` (the sequence all-gathers recording to
    ``keeper``), directly or through views, as a ``KeptReads`` of ``keeper``, and make the
    keeper scoped; returns how many. Where a reader is no op (a module call, the output),
    nothing changes: the keeper keeps its pair around the whole forward. Postcondition:
    every reader of a gathered tensor's storage that can save it runs with the keeper's
    hooks."""
    readers: list[fx.Node] = []
    stack = list(gathers)
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _aliases(user):
                stack.append(user)
            elif user.target in _SIZE_READS:
                continue  # a size, no save
            elif user.op == "call_function":
                readers.append(user)
            else:
                return 0
    for node in readers:
        name = f"autotp_kept_{node.name}"
        op = node.target
        assert callable(op), node.format_node()  # a call_function's target
        root.add_module(name, KeptReads(keeper, op))
        node.op, node.target = "call_module", name
    keeper.scoped = bool(readers)
    return len(readers)


__all__ = ["Gatherer", "KeptReads", "ShardKeeper", "scope_saves"]
