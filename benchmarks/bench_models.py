"""Unsharded reference models for the tensor-parallel benchmarks, in plain single-device PyTorch.

Both models take ``(idx, targets)`` and return the mean cross-entropy loss (the logits when
``targets`` is None), so every implementation computes the loss inside the model.

- ``GPT``: GPT-2-like. Learned positions, LayerNorm with bias, causal attention with separate
  q/k/v projections (with bias), GELU MLP (4x), lm_head tied to the token embedding.
- ``Llama``: LLaMA-like. RMSNorm, rotary positions, SwiGLU MLP, no biases, grouped-query
  attention (``n_kv_head`` k/v heads), untied lm_head.

Attention reshapes with the module's own head counts (``self.n_head``), as single-device code
does; an implementation that runs the module on local heads sets those counts itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 8
    d_model: int = 256
    tied: bool = True


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int = 4
    d_model: int = 256
    ffn_multiple_of: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def ffn_hidden(self) -> int:
        """LLaMA's SwiGLU width: 2/3 of 4d, rounded up to a multiple of ``ffn_multiple_of``."""
        hidden = int(2 * 4 * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


Config = Union[GPTConfig, LlamaConfig]

# Named sizes. "small" is the default CPU benchmark; "base" is GPT-2 small / a 124M-class
# LLaMA for GPU runs.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, seq_len=32, n_layer=2, n_head=4, d_model=64),
    "small": dict(vocab_size=8192, seq_len=128, n_layer=4, n_head=8, d_model=256),
    "medium": dict(vocab_size=16384, seq_len=256, n_layer=8, n_head=8, d_model=512),
    "base": dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
}


def make_config(model: str, size: str = "small", **overrides: Optional[int]) -> Config:
    """The config of ``model`` ("gpt2" or "llama") at a named size, with overrides (None
    values are ignored). LLaMA's k/v heads default to half the heads."""
    fields = dict(SIZES[size])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if model == "gpt2":
        fields.pop("n_kv_head", None)
        fields.pop("ffn_multiple_of", None)
        return GPTConfig(**fields)
    if model == "llama":
        fields.setdefault("n_kv_head", max(1, fields["n_head"] // 2))
        fields.setdefault("ffn_multiple_of", 64 if fields["d_model"] < 256 else 256)
        return LlamaConfig(**fields)
    raise ValueError(f"unknown model {model!r}: use 'gpt2' or 'llama'")


def build_model(cfg: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model: nn.Module = GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)
    return model


# ---- GPT-2-like ----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.head_dim = d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * self.head_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.o_proj(attend(self, x, cos, sin))


def attend(attn: nn.Module, x: torch.Tensor, cos: Optional[torch.Tensor],
           sin: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of ``attn``'s q/k/v projections over its ``n_head`` heads (all of
    them, or one rank's share), before the output projection: (B, T, n_head * head_dim)."""
    B, T, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(B, T, attn.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = attn.k_proj(x).view(B, T, attn.n_kv_head, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.n_kv_head, hd).transpose(1, 2)
    if cos is not None and sin is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if attn.n_kv_head != attn.n_head:
        rep = attn.n_head // attn.n_kv_head
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
    return y.transpose(1, 2).reshape(B, T, attn.n_head * hd)


class GPTMLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.up_proj = nn.Linear(d_model, 4 * d_model)
        self.down_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head, cfg.n_head, bias=True)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = GPTMLP(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.n_layer)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---- LLaMA-like ----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + hd/2) of each head by the position's angle; x is (B, nh, T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, hd) -> (B, n_kv * n_rep, T, hd), each k/v head serving n_rep query heads."""
    B, n_kv, T, hd = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head, cfg.n_kv_head, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.d_model // cfg.n_head, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self, cfg.n_layer)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2's initialization: N(0, 0.02), output projections scaled by 1/sqrt(2 n_layer)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("o_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, mean=0.0, std=0.02)


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matrix products (lookup tables excluded, a tied lm_head
    counted once): the N of the 6 N tokens estimate of training FLOPs."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def train_flops(cfg: Config, model: nn.Module, batch: int, seq: int) -> float:
    """FLOPs of one forward + backward: 6 N per token plus attention's 12 L T C per token
    (scores and weighted values, full square; causal kernels skip about half)."""
    tokens = batch * seq
    return 6.0 * matmul_params(model) * tokens + 12.0 * cfg.n_layer * seq * cfg.d_model * tokens


def make_batch(cfg: Config, batch: int, seed: int = 1,
               device: Union[str, torch.device] = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)
