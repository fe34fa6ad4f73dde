"""A hand-written Megatron-LM style tensor-parallel version of the benchmark models.

Follows the Megatron-LM paper (Shoeybi et al., 2019, section 3): two conjugate operators

    f: identity forward, all-reduce backward   (enters a column-parallel region)
    g: all-reduce forward, identity backward   (leaves a row-parallel region)

so that a transformer layer costs two all-reduces forward (after attention and after the MLP)
and two backward (f before attention and before the MLP).

- Attention: q/k/v are column-parallel (this rank's heads, one ``f`` for the three), the output
  projection is row-parallel; the bias of a row-parallel linear is added after the all-reduce.
- MLP: up/gate column-parallel, down row-parallel.
- Embedding: vocabulary-parallel (rows of the table), masked lookup, then ``g``.
- lm_head: column-parallel over the vocabulary (``f`` on its input), logits stay sharded;
  the loss is the vocabulary-parallel cross-entropy (all-reduces of the max, the target logit
  and the sum of exponentials; its backward is local).
- A tied lm_head uses the same local vocabulary shard as the embedding: both gradient
  contributions land in one parameter, no extra collective.

``from_reference(model, rank, tp, group)`` builds this rank's module from the unsharded model's
weights; ``full_grads`` gathers the gradients back under the reference model's names.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_models import GPT, Llama, attend

Group = Optional[dist.ProcessGroup]


# ---- f and g -------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce on a contiguous tensor (a copy only if it is not contiguous)."""
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


# ---- parallel layers -----------------------------------------------------------------------


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"tp={tp} does not divide dim {dim} of a {tuple(t.shape)} tensor")
    return t.detach().chunk(tp, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i (+ b_i): the output features split across ranks. ``f`` is applied by the
    caller once for all the column-parallel linears that read the same input."""

    def __init__(self, ref: nn.Linear, rank: int, tp: int):
        super().__init__()
        self.weight = nn.Parameter(_shard(ref.weight, 0, rank, tp))
        self.bias = None if ref.bias is None else nn.Parameter(_shard(ref.bias, 0, rank, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(sum_i X_i A_i) + b: the input features split; the bias is added after the
    all-reduce, once."""

    def __init__(self, ref: nn.Linear, rank: int, tp: int, group: Group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_shard(ref.weight, 1, rank, tp))
        self.bias = None if ref.bias is None else nn.Parameter(ref.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the table on this rank: look up the ids in range, zero the
    others, and sum the ranks' partial embeddings with ``g``."""

    def __init__(self, ref: nn.Embedding, rank: int, tp: int, group: Group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_shard(ref.weight, 0, rank, tp))
        self.vocab_start = rank * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits sharded over the vocabulary (N, V/tp), without gathering
    them: three all-reduces of N values (max, target logit, sum of exponentials). Backward is
    local: softmax - one_hot, on this rank's columns."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                group: Group) -> torch.Tensor:
        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(target_logit.masked_fill(outside, 0.0), group)
        exp = shifted.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss.mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        n = softmax.shape[0]
        grad_logits = softmax.clone()
        rows = torch.arange(n, device=softmax.device)
        grad_logits[rows, local_target] -= (~outside).to(softmax.dtype)
        grad_logits.mul_(grad / n)
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 group: Group) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)


# ---- blocks --------------------------------------------------------------------------------


class ParallelAttention(nn.Module):
    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        if ref.n_kv_head % tp:
            raise ValueError(f"tp={tp} does not divide the {ref.n_kv_head} k/v heads")
        self.group = group
        self.n_head = ref.n_head // tp  # this rank's heads
        self.n_kv_head = ref.n_kv_head // tp
        self.head_dim = ref.head_dim
        self.q_proj = ColumnParallelLinear(ref.q_proj, rank, tp)
        self.k_proj = ColumnParallelLinear(ref.k_proj, rank, tp)
        self.v_proj = ColumnParallelLinear(ref.v_proj, rank, tp)
        self.o_proj = RowParallelLinear(ref.o_proj, rank, tp, group)

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)
        return self.o_proj(attend(self, x, cos, sin))  # this rank's heads


class ParallelGPTMLP(nn.Module):
    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        self.group = group
        self.up_proj = ColumnParallelLinear(ref.up_proj, rank, tp)
        self.down_proj = RowParallelLinear(ref.down_proj, rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class ParallelSwiGLU(nn.Module):
    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        self.group = group
        self.gate_proj = ColumnParallelLinear(ref.gate_proj, rank, tp)
        self.up_proj = ColumnParallelLinear(ref.up_proj, rank, tp)
        self.down_proj = RowParallelLinear(ref.down_proj, rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _copy(module: nn.Module) -> nn.Module:
    """A replicated module (norms, position table): the same weights on every rank."""
    return copy.deepcopy(module)


class ParallelGPTBlock(nn.Module):
    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        self.ln_1, self.ln_2 = _copy(ref.ln_1), _copy(ref.ln_2)
        self.attn = ParallelAttention(ref.attn, rank, tp, group)
        self.mlp = ParallelGPTMLP(ref.mlp, rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelLlamaBlock(nn.Module):
    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        self.attn_norm, self.mlp_norm = _copy(ref.attn_norm), _copy(ref.mlp_norm)
        self.attn = ParallelAttention(ref.attn, rank, tp, group)
        self.mlp = ParallelSwiGLU(ref.mlp, rank, tp, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# ---- models --------------------------------------------------------------------------------


class MegatronLM(nn.Module):
    """One rank of a Megatron tensor-parallel GPT or LLaMA built from the reference model."""

    def __init__(self, ref: nn.Module, rank: int, tp: int, group: Group):
        super().__init__()
        self.group = group
        self.tp = tp
        self.is_gpt = isinstance(ref, GPT)
        if self.is_gpt:
            self.embed = VocabParallelEmbedding(ref.wte, rank, tp, group)
            self.wpe = _copy(ref.wpe)
            self.blocks = nn.ModuleList(ParallelGPTBlock(b, rank, tp, group) for b in ref.blocks)
            self.norm = _copy(ref.ln_f)
        elif isinstance(ref, Llama):
            self.embed = VocabParallelEmbedding(ref.tok_embeddings, rank, tp, group)
            self.blocks = nn.ModuleList(ParallelLlamaBlock(b, rank, tp, group)
                                        for b in ref.blocks)
            self.norm = _copy(ref.norm)
            self.register_buffer("rope_cos", ref.rope_cos.clone(), persistent=False)
            self.register_buffer("rope_sin", ref.rope_sin.clone(), persistent=False)
        else:
            raise TypeError(f"no Megatron version of {type(ref).__name__}")
        self.tied = ref.lm_head.weight is (ref.wte.weight if self.is_gpt else None)
        self.lm_head = ColumnParallelLinear(ref.lm_head, rank, tp)
        if self.tied:
            self.lm_head.weight = self.embed.weight  # the same vocabulary rows on this rank
        self.vocab_start = self.embed.vocab_start

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.shape[1]
        x = self.embed(idx)
        if self.is_gpt:
            x = x + self.wpe(torch.arange(T, device=idx.device))
            for block in self.blocks:
                x = block(x)
        else:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
            for block in self.blocks:
                x = block(x, cos, sin)
        h = copy_to_tensor_parallel(self.norm(x), self.group)
        logits = self.lm_head(h)  # (B, T, V/tp)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                            self.vocab_start, self.group)


def from_reference(model: nn.Module, rank: int, tp: int, group: Group = None) -> MegatronLM:
    """This rank's Megatron module, with the unsharded ``model``'s weights (same device)."""
    return MegatronLM(model, rank, tp, group)


def shard_dims(ref: nn.Module, module: MegatronLM) -> dict[str, tuple[str, Optional[int]]]:
    """Reference parameter name -> (name in ``module``, sharded dim or None if replicated)."""
    local = dict(module.named_parameters())  # tied weights once, under the embedding's name
    prefix = "wte" if module.is_gpt else "tok_embeddings"
    out: dict[str, tuple[str, Optional[int]]] = {}
    for name, _ in ref.named_parameters():
        if name.startswith(prefix + "."):
            out[name] = ("embed.weight", 0)
        elif name.startswith("lm_head."):
            out[name] = ("embed.weight" if module.tied else "lm_head.weight", 0)
        elif name.startswith(("ln_f.", "norm.")):
            out[name] = (name.replace("ln_f.", "norm."), None)
        elif name.startswith("blocks."):
            out[name] = (name, _block_param_dim(name))
        else:
            out[name] = (name, None)
        assert out[name][0] in local, f"no local parameter for {name}"
    return out


def _block_param_dim(name: str) -> Optional[int]:
    column = ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj")
    if any(f".{c}." in name for c in column):
        return 0  # output features (weight rows, bias)
    if any(f".{r}.weight" in name for r in ("o_proj", "down_proj")):
        return 1  # input features; row-parallel biases are replicated
    return None


def local_params(ref: nn.Module, module: MegatronLM) -> dict[str, torch.Tensor]:
    """Reference parameter name -> this rank's tensor for it."""
    local = dict(module.named_parameters())
    return {name: local[target] for name, (target, _) in shard_dims(ref, module).items()}


def full_grads(ref: nn.Module, module: MegatronLM) -> dict[str, torch.Tensor]:
    """Collective: every reference parameter's full gradient (sharded ones all-gathered)."""
    local = dict(module.named_parameters())
    out = {}
    for name, (target, dim) in shard_dims(ref, module).items():
        grad = local[target].grad
        grad = torch.zeros_like(local[target]) if grad is None else grad.detach()
        if dim is not None and module.tp > 1:
            pieces = [torch.empty_like(grad) for _ in range(module.tp)]
            dist.all_gather(pieces, grad.contiguous(), group=module.group)
            grad = torch.cat(pieces, dim=dim)
        out[name] = grad.clone()
    return out


__all__ = ["MegatronLM", "from_reference", "full_grads", "local_params", "shard_dims"]
