"""A generic small transformer in plain single-device PyTorch, hypothesis strategies that draw
random configurations of it and of transformers' own models, and the equivalence property
checked on them (``check_equivalence``), for tests/test_random_models.py and
benchmarks/random_models.py.

The model is written the way people write one by hand (nanoGPT-like): token embeddings, learned
positions or rotary embeddings, a stack of blocks (attention with separate or fused q/k/v
projections and grouped key/value heads, then an MLP), a final norm and a language-model head
that may share its weight with the embedding. ``causal=False`` makes it an encoder (no mask).
Options: a mixture of experts in place of the MLP (``moe``: a replicated router, softmax,
top-k, experts as a list of MLPs or as 3-D weights), a norm over the whole q and k projections
(``qk_norm``, OLMo2) and residual additions written in place (``inplace_residual``).

Shape legend used in the comments:
    B  = batch size           T  = sequence length       C  = d_model
    nh = n_head               nkv = n_kv_head            hs = head_dim (C // nh)
    F  = d_ff                 V  = vocab
    N  = B * T (tokens)       E  = n_expert               k  = top_k
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenericConfig:
    n_layer: int = 2  # 1 to 3
    d_model: int = 32
    n_head: int = 4
    n_kv_head: int = 4  # divides n_head; < n_head is grouped-query attention
    d_ff: int = 128
    mlp: str = "gelu"  # "gelu" | "swiglu" | "relu"
    norm: str = "layer"  # "layer" | "rms"
    prenorm: bool = True  # x + f(norm(x)); else norm(x + f(x)) (post-norm, BERT-style)
    bias: bool = True  # biases of the Linears and of LayerNorm
    tied: bool = True  # lm_head.weight is the token embedding's weight
    fused_qkv: bool = False  # one Linear for q, k and v, split with unequal sizes under GQA
    vocab: int = 64
    causal: bool = True  # decoder; False: bidirectional encoder
    use_sdpa: bool = True  # F.scaled_dot_product_attention; else softmax(q k^T / sqrt(hs)) v
    rope: bool = False  # rotary embeddings on q and k; else learned absolute positions
    kv_repeat: str = "expand"  # GQA: "expand" (expand + reshape) | "interleave" (repeat_interleave)
    block_size: int = 32  # longest sequence
    qk_norm: bool = False  # norm over the whole q and k projections (OLMo2), before the heads
    inplace_residual: bool = False  # h = f(norm(x)); h += x (the residual added in place)
    # mixture of experts in place of the MLP: "loop" (a list of expert MLPs, each run on every
    # token) | "stacked" (expert weights as [E, F, C] and [E, C, F] parameters) | "none"
    moe: str = "none"
    n_expert: int = 4  # E, 2 to 4
    top_k: int = 2  # k, 1 or 2: experts per token
    # how the top-k weights become the dense [N, E] combination: "scatter" (zeros scattered
    # with the weights at the chosen experts) | "mask" (sum of the weights where topk_idx == e)
    expert_gates: str = "scatter"
    # "stacked" experts: "einsum" | "bmm" (every expert on every token, combined by the gates)
    # | "index" | "index_select" (each token's k experts' weights gathered, w[topk_idx])
    expert_product: str = "einsum"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def __post_init__(self) -> None:
        assert 1 <= self.n_layer
        assert self.d_model % self.n_head == 0, "d_model must be n_head * head_dim"
        assert self.n_head % self.n_kv_head == 0, "n_kv_head must divide n_head"
        assert self.mlp in ("gelu", "swiglu", "relu"), self.mlp
        assert self.norm in ("layer", "rms"), self.norm
        assert self.kv_repeat in ("expand", "interleave"), self.kv_repeat
        assert not self.rope or self.head_dim % 2 == 0, "rotary embeddings need an even head_dim"
        assert self.moe in ("none", "loop", "stacked"), self.moe
        assert self.moe == "none" or self.mlp in ("gelu", "swiglu"), "experts: gelu or swiglu"
        assert 1 <= self.top_k <= self.n_expert, "top_k must be at most n_expert"
        assert self.expert_gates in ("scatter", "mask"), self.expert_gates
        assert self.expert_product in ("einsum", "bmm", "index", "index_select"), \
            self.expert_product


class LayerNorm(nn.Module):
    """LayerNorm whose bias can be switched off."""

    def __init__(self, ndim: int, bias: bool, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, written out."""

    def __init__(self, ndim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (B, T, 1)
        return x * rms * self.weight  # (B, T, C)


def make_norm(config: GenericConfig, ndim: int | None = None) -> nn.Module:
    """The config's norm over ``ndim`` features (d_model by default)."""
    ndim = config.d_model if ndim is None else ndim
    if config.norm == "rms":
        return RMSNorm(ndim)
    return LayerNorm(ndim, bias=config.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, n, T, hs/2)
    return torch.cat((-x2, x1), dim=-1)  # (B, n, T, hs)


class Attention(nn.Module):
    def __init__(self, config: GenericConfig):
        super().__init__()
        self.config = config
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.d_model = config.d_model
        q_size = config.n_head * config.head_dim
        kv_size = config.n_kv_head * config.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        if config.fused_qkv:
            # one matmul for query, key and value of every head: (nh + 2 nkv) * hs outputs
            self.qkv = nn.Linear(config.d_model, q_size + 2 * kv_size, bias=config.bias)
        else:
            self.q_proj = nn.Linear(config.d_model, q_size, bias=config.bias)
            self.k_proj = nn.Linear(config.d_model, kv_size, bias=config.bias)
            self.v_proj = nn.Linear(config.d_model, kv_size, bias=config.bias)
        self.o_proj = nn.Linear(q_size, config.d_model, bias=config.bias)
        if config.qk_norm:
            # one norm over all heads' features (OLMo2), not one per head (Qwen3): the
            # statistics cross the head dim that column parallelism shards
            self.q_norm = make_norm(config, q_size)
            self.k_norm = make_norm(config, kv_size)
        if config.causal and not config.use_sdpa:
            # lower-triangular mask: position t may attend to positions <= t
            mask = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size),
                                 persistent=False)

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, nkv, T, hs) -> (B, nh, T, hs): each key/value head serves n_head / n_kv_head
        consecutive query heads."""
        if self.n_kv_head == self.n_head:
            return x
        B, _, T, hs = x.size()
        n_rep = self.n_head // self.n_kv_head
        if self.config.kv_repeat == "interleave":
            return x.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hs)
        x = x[:, :, None, :, :].expand(B, self.n_kv_head, n_rep, T, hs)  # (B, nkv, rep, T, hs)
        return x.reshape(B, self.n_head, T, hs)  # (B, nh, T, hs)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.size()  # (B, T, C)
        if self.config.fused_qkv:
            q, k, v = self.qkv(x).split(self.sizes, dim=2)  # (B, T, nh*hs), 2 x (B, T, nkv*hs)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # (B, T, nh*hs), (B, T, nkv*hs)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if cos is not None and sin is not None:
            q = q * cos + rotate_half(q) * sin  # (B, nh, T, hs)
            k = k * cos + rotate_half(k) * sin  # (B, nkv, T, hs)
        k = self.repeat_kv(k)  # (B, nh, T, hs)
        v = self.repeat_kv(v)  # (B, nh, T, hs)

        if self.config.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.config.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
            if self.config.causal:
                att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)  # (B, nh, T, T)
            y = att @ v  # (B, nh, T, T) @ (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)  # heads joined
        return self.o_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GenericConfig):
        super().__init__()
        self.kind = config.mlp
        if config.mlp == "swiglu":
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, F)
        elif self.kind == "relu":
            h = F.relu(self.up_proj(x))  # (B, T, F)
        else:
            h = F.gelu(self.up_proj(x))  # (B, T, F)
        return self.down_proj(h)  # (B, T, C)


def route(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights, renormalized in place to sum to 1."""
    topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)  # 2 x (N, k)
    topk_w /= topk_w.sum(dim=-1, keepdim=True)  # topk's output is fresh: safe to write
    return topk_w, topk_idx


def dense_gates(config: GenericConfig, probs: torch.Tensor, topk_w: torch.Tensor,
                topk_idx: torch.Tensor) -> torch.Tensor:
    """(N, E): token n's weight for expert e, zero where e is not among its top k.

    Selecting each expert's tokens (nonzero, boolean masks) has a data-dependent size, which
    torch.export cannot trace with symbolic B and T: every expert runs on every token and
    the gates zero out the unchosen ones."""
    if config.expert_gates == "scatter":
        return torch.zeros_like(probs).scatter(1, topk_idx, topk_w)  # (N, E)
    columns = [(topk_w * (topk_idx == e)).sum(dim=-1, keepdim=True)  # (N, 1)
               for e in range(config.n_expert)]
    return torch.cat(columns, dim=-1)  # (N, E)


class MoE(nn.Module):
    """Mixture of experts (Mixtral-like): a replicated router picks k of E expert MLPs per
    token, whose outputs are summed with the renormalized router probabilities."""

    def __init__(self, config: GenericConfig):
        super().__init__()
        self.config = config
        E, C, Fe = config.n_expert, config.d_model, config.d_ff
        self.router = nn.Linear(C, E, bias=False)
        if config.moe == "loop":
            self.experts = nn.ModuleList([MLP(config) for _ in range(E)])
        else:
            if config.mlp == "swiglu":
                self.w_gate = nn.Parameter(torch.empty(E, Fe, C))  # (E, F, C) like Linear's
            self.w_up = nn.Parameter(torch.empty(E, Fe, C))  # (E, F, C)
            self.w_down = nn.Parameter(torch.empty(E, C, Fe))  # (E, C, F)

    def act(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return F.gelu(up) if gate is None else F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        x = x.view(-1, C)  # (N, C)
        probs = F.softmax(self.router(x), dim=-1)  # (N, E)
        topk_w, topk_idx = route(probs, self.config.top_k)  # 2 x (N, k)
        product = self.config.expert_product
        swiglu = self.config.mlp == "swiglu"
        if self.config.moe == "loop":
            gates = dense_gates(self.config, probs, topk_w, topk_idx)  # (N, E)
            y = sum(gates[:, e:e + 1] * expert(x)  # (N, 1) * (N, C)
                    for e, expert in enumerate(self.experts))
        elif product in ("einsum", "bmm"):
            gates = dense_gates(self.config, probs, topk_w, topk_idx)  # (N, E)
            if product == "einsum":
                up = torch.einsum("nc,efc->enf", x, self.w_up)  # (E, N, F)
                gate = torch.einsum("nc,efc->enf", x, self.w_gate) if swiglu else None
                h = torch.einsum("enf,ecf->enc", self.act(up, gate), self.w_down)  # (E, N, C)
                y = torch.einsum("enc,ne->nc", h, gates)  # (N, C)
            else:
                xe = x.unsqueeze(0).expand(self.config.n_expert, -1, -1)  # (E, N, C)
                up = torch.bmm(xe, self.w_up.transpose(1, 2))  # (E, N, F)
                gate = torch.bmm(xe, self.w_gate.transpose(1, 2)) if swiglu else None
                h = torch.bmm(self.act(up, gate), self.w_down.transpose(1, 2))  # (E, N, C)
                y = (h * gates.t().unsqueeze(-1)).sum(dim=0)  # (N, C)
        else:  # only the chosen experts: their weights gathered per token
            def pick(w: torch.Tensor) -> torch.Tensor:  # (E, a, b) -> (N, k, a, b)
                if product == "index":
                    return w[topk_idx]
                flat = torch.index_select(w, 0, topk_idx.reshape(-1))  # (N*k, a, b)
                return flat.view(*topk_idx.shape, *w.shape[1:])

            up = torch.einsum("nc,nkfc->nkf", x, pick(self.w_up))  # (N, k, F)
            gate = torch.einsum("nc,nkfc->nkf", x, pick(self.w_gate)) if swiglu else None
            h = torch.einsum("nkf,nkcf->nkc", self.act(up, gate), pick(self.w_down))  # (N, k, C)
            y = (h * topk_w.unsqueeze(-1)).sum(dim=1)  # (N, C)
        return y.view(B, T, C)


class Block(nn.Module):
    def __init__(self, config: GenericConfig):
        super().__init__()
        self.prenorm = config.prenorm
        self.inplace = config.inplace_residual
        self.norm_1 = make_norm(config)
        self.attn = Attention(config)
        self.norm_2 = make_norm(config)
        self.mlp = MoE(config) if config.moe != "none" else MLP(config)

    def residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + h. In place, it is written into the sublayer's output h: ``x += f(norm(x))``
        would overwrite the x that norm and f saved for backward, which autograd refuses."""
        if self.inplace:
            h += x
            return h
        return x + h

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        if self.prenorm:
            x = self.residual(x, self.attn(self.norm_1(x), cos, sin))  # (B, T, C)
            x = self.residual(x, self.mlp(self.norm_2(x)))  # (B, T, C)
        else:
            x = self.norm_1(self.residual(x, self.attn(x, cos, sin)))  # (B, T, C)
            x = self.norm_2(self.residual(x, self.mlp(x)))  # (B, T, C)
        return x


class GenericTransformer(nn.Module):
    def __init__(self, config: GenericConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.d_model)
        if config.rope:
            hs = config.head_dim
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
            self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hs/2,)
        else:
            self.wpe = nn.Embedding(config.block_size, config.d_model)
        # post-norm models normalize the embeddings (BERT); pre-norm ones the last block's output
        self.norm_in = None if config.prenorm else make_norm(config)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = make_norm(config) if config.prenorm else None
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()  # (B, T)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx)  # (B, T, C)
        cos = sin = None
        if self.config.rope:
            freqs = pos[:, None].float() * self.inv_freq[None, :]  # (T, hs/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
            cos, sin = emb.cos(), emb.sin()  # (T, hs), broadcast over (B, n, T, hs)
        else:
            x = x + self.wpe(pos)  # (B, T, C)
        if self.norm_in is not None:
            x = self.norm_in(x)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.lm_head(x)  # (B, T, V)


def build(config: GenericConfig, seed: int = 0) -> tuple[GenericTransformer, torch.Tensor]:
    """The model with random weights from ``seed`` and an example input of shape (2, 8).

    Every parameter is random, biases and norm weights included (zeros and ones would hide a
    bias added on every rank or a norm weight sliced the wrong way)."""
    torch.manual_seed(seed)
    model = GenericTransformer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith(("wte", "wpe")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.dim() >= 2:  # matrices and stacked experts' (E, out, in): fan-in last
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif name.endswith("weight"):  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    idx = torch.randint(0, config.vocab, (2, 8), generator=torch.Generator().manual_seed(seed + 1))
    return model, idx


# ---- transformers' models ---------------------------------------------------------------------


@dataclass(frozen=True)
class HFConfig:
    """A transformers model: its family and the config fields (all JSON-like, so a failing
    example prints as something one can paste)."""

    family: str  # "gpt2" | "llama" | "bert"
    fields: tuple[tuple[str, Any], ...]
    attn: str = "sdpa"  # "sdpa" | "eager"

    @property
    def vocab(self) -> int:
        return dict(self.fields)["vocab_size"]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.fields)
        return f"HFConfig({self.family!r}, {self.attn!r}, {inner})"


def build_hf(config: HFConfig, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    import transformers as tf

    tf.logging.set_verbosity_error()
    kwargs = dict(config.fields)
    torch.manual_seed(seed)
    if config.family == "gpt2":
        hf_config = tf.GPT2Config(**kwargs)
        cls = tf.GPT2LMHeadModel
    elif config.family == "llama":
        hf_config = tf.LlamaConfig(**kwargs)
        cls = tf.LlamaForCausalLM
    elif config.family == "bert":
        hf_config = tf.BertConfig(**kwargs)
        cls = tf.BertForMaskedLM
    else:
        raise ValueError(config.family)
    hf_config._attn_implementation = config.attn
    model = cls(hf_config)
    # Weights of the scale of build()'s: transformers' init (std 0.02, zero biases, unit norm
    # weights) gives logits of ~1e-2, under which an absolute tolerance of 1e-4 is lax.
    gen = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = hf_config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in embeddings:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(hidden))
            elif name.endswith("weight"):  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.eval()  # no dropout anywhere (the probabilities are 0 too)
    idx = torch.randint(0, config.vocab, (2, 8), generator=torch.Generator().manual_seed(seed + 1))
    return model, idx


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits


def loss_of(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against ``ids`` (a scalar touching every
    output; for decoders the same token, which is as good a target as any)."""
    logits = logits_of(out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids.reshape(-1))


def describe(config: Any) -> str:
    if isinstance(config, GenericConfig):
        return "GenericConfig(" + ", ".join(f"{k}={v!r}" for k, v in asdict(config).items()) + ")"
    return repr(config)


def features(config: Any) -> list[str]:
    """Tags of the options a configuration draws (benchmarks/random_models.py counts the
    outcomes per tag)."""
    if isinstance(config, HFConfig):
        return [config.family]
    tags: list[str] = []
    if config.moe == "loop":
        tags.append(f"moe=loop (gates {config.expert_gates})")
    elif config.moe == "stacked":
        gates = f", gates {config.expert_gates}" if config.expert_product in ("einsum", "bmm") \
            else ""
        tags.append(f"moe=stacked ({config.expert_product}{gates})")
    if config.moe != "none":
        tags.append(f"moe top_k={config.top_k}")
    tags += [name for name in ("qk_norm", "inplace_residual", "fused_qkv") if getattr(config, name)]
    if config.fused_qkv and config.n_kv_head < config.n_head:
        tags.append("fused_qkv with n_kv_head < n_head")
    return tags


# ---- hypothesis strategies --------------------------------------------------------------------

VOCABS = [64, 96, 100, 90]  # 100 is not a multiple of 8, 90 not of 4


def generic_configs() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def draw(draw: Any) -> GenericConfig:
        # Drawn first: hypothesis soon tries every value of a model's first choice, so a few
        # dozen examples already have both forms (drawn later, 40 examples held 1 MoE). A
        # mixture of experts in 2 models of 5; "none" first, so failures shrink to dense.
        moe = draw(st.sampled_from(["none", "loop", "stacked", "none", "none"]))
        n_head = draw(st.sampled_from([2, 4, 8]))
        n_kv_head = draw(st.sampled_from([d for d in (1, 2, 4, 8) if n_head % d == 0]))
        head_dim = draw(st.sampled_from([4, 8]))
        d_model = n_head * head_dim
        # 3 * d_model + 2 is not a multiple of 4
        d_ff = draw(st.sampled_from([2 * d_model, 4 * d_model, 3 * d_model, 3 * d_model + 2]))
        n_layer = draw(st.integers(1, 3))
        # experts are gelu or swiglu MLPs
        mlp = draw(st.sampled_from(["gelu", "swiglu", "relu"] if moe == "none"
                                   else ["gelu", "swiglu"]))
        fields = dict(
            norm=draw(st.sampled_from(["layer", "rms"])),
            prenorm=draw(st.booleans()),
            bias=draw(st.booleans()),
            tied=draw(st.booleans()),
            fused_qkv=draw(st.booleans()),
            vocab=draw(st.sampled_from(VOCABS)),
            causal=draw(st.booleans()),
            use_sdpa=draw(st.booleans()),
            rope=draw(st.booleans()),
            kv_repeat=draw(st.sampled_from(["expand", "interleave"])),
            qk_norm=draw(st.booleans()),
            inplace_residual=draw(st.booleans()),
        )
        if moe != "none":
            # about twice a dense model's time (E MLPs per layer; the in-place renormalization
            # makes autotp's capture functionalize the program): at most 2 layers
            n_layer = min(n_layer, 2)
            fields.update(n_expert=draw(st.integers(2, 4)), top_k=draw(st.sampled_from([1, 2])))
            if moe == "stacked":
                fields["expert_product"] = draw(st.sampled_from(
                    ["einsum", "bmm", "index", "index_select"]))
            if moe == "loop" or fields["expert_product"] in ("einsum", "bmm"):
                fields["expert_gates"] = draw(st.sampled_from(["scatter", "mask"]))
        return GenericConfig(n_layer=n_layer, d_model=d_model, n_head=n_head,
                             n_kv_head=n_kv_head, d_ff=d_ff, mlp=mlp, moe=moe, **fields)

    return draw()


def hf_configs() -> Any:
    from hypothesis import strategies as st

    @st.composite
    def draw(draw: Any) -> HFConfig:
        family = draw(st.sampled_from(["gpt2", "llama", "bert"]))
        n_head = draw(st.sampled_from([2, 4, 8]))
        head_dim = draw(st.sampled_from([4, 8]))
        hidden = n_head * head_dim
        n_layer = draw(st.integers(1, 3))
        vocab = draw(st.sampled_from(VOCABS))
        tied = draw(st.booleans())
        # transformers' default is sdpa; eager (a float mask built with aten.where, softmax
        # written out) a quarter of the time
        attn = draw(st.sampled_from(["sdpa", "sdpa", "sdpa", "eager"]))
        if family == "gpt2":
            inner = draw(st.sampled_from([None, 2 * hidden, 3 * hidden + 2]))
            fields = dict(n_layer=n_layer, n_embd=hidden, n_head=n_head, n_inner=inner,
                          vocab_size=vocab, n_positions=32, tie_word_embeddings=tied,
                          activation_function=draw(st.sampled_from(["gelu_new", "gelu", "relu"])),
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0)
        elif family == "llama":
            n_kv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if n_head % d == 0]))
            fields = dict(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                          num_key_value_heads=n_kv,
                          intermediate_size=draw(st.sampled_from([2 * hidden, 3 * hidden,
                                                                  3 * hidden + 2])),
                          vocab_size=vocab, max_position_embeddings=32, tie_word_embeddings=tied,
                          attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
                          hidden_act=draw(st.sampled_from(["silu", "gelu"])),
                          attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        else:
            fields = dict(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                          intermediate_size=draw(st.sampled_from([2 * hidden, 4 * hidden,
                                                                  3 * hidden + 2])),
                          vocab_size=vocab, max_position_embeddings=32, tie_word_embeddings=tied,
                          hidden_act=draw(st.sampled_from(["gelu", "relu"])),
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          pad_token_id=0)
        return HFConfig(family, tuple(fields.items()), attn)

    return draw()


# ---- the property -----------------------------------------------------------------------------

ATOL = 1e-4  # logits, loss and gradients: max abs diff
RTOL = 1e-4  # gradients: relative to the parameter's largest gradient entry (verify.compare)
SEED = 0


@dataclass
class Outcome:
    """One example: ``refused`` (autotp raised an AutotpError before running) or ``ran`` with
    the largest differences over all ranks; ``ok`` says whether they are within tolerance."""

    refused: str | None = None  # the AutotpError's message
    output_diff: float = 0.0
    loss_diff: float = 0.0
    grad_diff: float = 0.0  # max over parameters of max |g - g_ref|
    grad_rel: float = 0.0  # verify.compare's: relative to the parameter's (or 1% of the model's)
    worst_param: str = ""
    dropped: tuple[str, ...] = ()  # parameters the forward never uses, absent when sharded
    sharded: float = 0.0  # fraction of the parameters' elements that the plan shards

    @property
    def ok(self) -> bool:
        return self.refused is not None or (
            self.output_diff <= ATOL and self.loss_diff <= ATOL
            and self.grad_diff <= ATOL and self.grad_rel <= RTOL)


def unused_parameters(model: nn.Module, call: Any) -> set[str]:
    """Names of the parameters that get no gradient from one forward and backward."""
    model.zero_grad(set_to_none=True)
    logits_of(call(model)).sum().backward()
    unused = {name for name, p in model.named_parameters(remove_duplicate=False)
              if p.grad is None}
    model.zero_grad(set_to_none=True)
    return unused


def check_equivalence(config: Any, tp: int, seed: int = SEED, strict: bool = True,
                      sequence_parallel: bool = False) -> Outcome:
    """Build the model, shard it in simulation at ``tp`` and run one forward and backward on an
    input of another batch size and sequence length (3, 7) than the traced example (2, 8), on
    every rank and on the unsharded model (3, 12 with sequence parallelism, which needs tp to
    divide the sequence length). Exceptions other than AutotpError propagate."""
    import autotp
    from autotp.verification.verify import compare, reference_step, sharded_step

    hf = isinstance(config, HFConfig)
    model, example = build_hf(config, seed) if hf else build(config, seed)
    try:
        if hf:
            sim = autotp.simulate(model, tp, example_kwargs={"input_ids": example},
                                  strict=strict, sequence_parallel=sequence_parallel)
        else:
            sim = autotp.simulate(model, tp, example_args=(example,), strict=strict,
                                  sequence_parallel=sequence_parallel)
    except autotp.AutotpError as e:
        return Outcome(refused=str(e))

    ids = torch.randint(0, config.vocab, (3, 12 if sequence_parallel else 7),
                        generator=torch.Generator().manual_seed(seed + 2))

    def call(m: nn.Module) -> Any:
        return m(input_ids=ids) if hf else m(ids)

    def loss(out: Any) -> torch.Tensor:
        return loss_of(out, ids)

    unused = unused_parameters(model, call)
    reference = reference_step(model, call, loss, logits_of)
    results = sim.run(lambda module: sharded_step(module, call, loss, logits_of))
    params = sim.plan.params.values()
    outcome = Outcome(sharded=sum(math.prod(p.global_shape) for p in params
                                  if p.layout.startswith("S"))
                      / max(sum(math.prod(p.global_shape) for p in params), 1))
    for result in results:
        # A parameter the forward never reads (BertForMaskedLM's cls.predictions.bias when the
        # head is untied) has no gradient on either side; the sharded module leaves it out.
        dropped = sorted(name for name in unused if name not in result.grads)
        outcome.dropped = tuple(dropped)
        for name in dropped:
            reference.grads.pop(name, None)
        cmp = compare(reference, result)
        outcome.output_diff = max(outcome.output_diff, cmp.output_diff)
        outcome.loss_diff = max(outcome.loss_diff, cmp.loss_diff)
        outcome.grad_diff = max(outcome.grad_diff, cmp.grad_diff)
        if cmp.grad_rel >= outcome.grad_rel:
            outcome.grad_rel, outcome.worst_param = cmp.grad_rel, cmp.worst_param
    return outcome
