"""How autotp plans other codebases' transformer blocks, against Megatron-LM's bound.

    python -m benchmarks.peers                   # every case, tp 2 and 4
    python -m benchmarks.peers sd3 flux --tp 2   # some cases
    ... --no-sim      plans only (no exactness check)
    ... --verbose     every in-layer collective above the bound (node, module, source)
    ... --json F      rows as JSON

Per case and tp: simulate (strict=False) -> autotp.verification.verify's equivalence check
(tests/test_peers.py's, here at 1e-4): outputs and loss within 1e-4 (max abs), every parameter's
gradient within 1e-4 of its largest entry (at least 1% of the model's largest gradient: one
that is 0 in exact arithmetic is rounding noise), and the same after one SGD step on both.
Then the plan's collectives are grouped per block (module list entry: stack name from the
collective's module path, index from its layer label), bytes evaluated at the example's sizes
(symbols -> their example values), and compared with Megatron's: one all-reduce of
B x T_block x h forward and one backward per attention, cross-attention, MLP block (per
stream for joint blocks; a parallel attn+MLP block is one).
Large replicated = a 2-D parameter (a conv kernel: its out x in channels) in R with both
sides >= h/2.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional


import sympy
import torch
from torch import nn
import torch.nn.functional as F

import autotp
from autotp.presentation.report import within_bound
from autotp.verification.verify import measure_equivalence, perturb
from benchmarks.harness import Column, Stopwatch, markdown_table, write_json

TOL = 1e-4  # outputs and loss: max abs; gradients and parameters: of each one's largest entry
B = 2


def first(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def square_loss(out: Any) -> torch.Tensor:
    return first(out).float().square().mean()


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict]
    hidden: int
    # stack name -> index -> (forward token counts, backward token counts): Megatron's
    # all-reduces, one entry per all-reduce of B x tokens x h (a per-token statistic: tokens / h)
    megatron: Callable[[str, int], tuple[list[float], list[float]]]
    # a replicated matrix Megatron also holds whole (k/v heads fewer than tp): (name, shape, tp)
    whole_ok: Callable[[str, tuple, int], bool] = lambda name, shape, tp: False
    loss: Callable[[Any], torch.Tensor] = square_loss
    output: Callable[[Any], torch.Tensor] = first
    tps: tuple[int, ...] = (2, 4)


# ---- diffusers ----------------------------------------------------------------------------

T_IMG, T_TXT = 16, 6


def sd3(qk_norm=None, dual=(), layers=2):
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=layers, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
            pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8,
            qk_norm=qk_norm, dual_attention_layers=dual)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 8, 8),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "pooled_projections": torch.randn(B, 32),
                "timestep": torch.tensor([3.0, 7.0]), "return_dict": False}

    def megatron(stack, i):
        last = i == layers - 1
        extra = [T_IMG] if i in dual else []  # SD3.5's second (image-only) attention
        if last:  # context_pre_only: the context stream's q/k/v only, no to_add_out, no ff
            return [T_IMG] + extra + [T_IMG], [T_IMG, T_TXT] + extra + [T_IMG]
        return ([T_IMG, T_TXT] + extra + [T_IMG, T_TXT], [T_IMG, T_TXT] + extra + [T_IMG, T_TXT])
    return build, inputs, megatron


def flux(double=2):
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=double, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
            pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))).eval()

    def inputs():
        torch.manual_seed(1)
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                             indexing="ij"), -1).reshape(-1, 3)
        return {"hidden_states": torch.randn(B, T_IMG, 16),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "pooled_projections": torch.randn(B, 32), "timestep": torch.tensor([0.3, 0.7]),
                "img_ids": img_ids, "txt_ids": torch.zeros(T_TXT, 3), "return_dict": False}

    def megatron(stack, i):
        if stack == "single_transformer_blocks":  # parallel attn + MLP, one proj_out
            return [T_IMG + T_TXT], [T_IMG + T_TXT]
        return [T_IMG, T_TXT, T_IMG, T_TXT], [T_IMG, T_TXT, T_IMG, T_TXT]
    return build, inputs, megatron


def dit():
    def test_models():  # tests/models.py: the DiT tests/test_peers.py runs
        from tests import models
        return models

    def build():
        return test_models().dit().eval()

    def inputs():
        return test_models().dit_inputs()
    return build, inputs, lambda s, i: ([T_IMG, T_IMG], [T_IMG, T_IMG])


def pixart():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.PixArtTransformer2DModel(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
            num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=64,
            caption_channels=32, norm_num_groups=32)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([3, 7]),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
                "return_dict": False}
    # self-attn, cross-attn, MLP: 3 + 3 (cross-attn's k/v read the caption: Megatron's
    # backward all-reduce of B x T_txt x h for them, in a layer, when the caption trains)
    return build, inputs, lambda s, i: ([T_IMG] * 3, [T_IMG] * 3 + [T_TXT])


def auraflow():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.AuraFlowTransformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
            num_single_dit_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=64, out_channels=4,
            pos_embed_max_size=16)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 8, 8),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "timestep": torch.tensor([3.0, 7.0]), "return_dict": False}

    ctx = 8 + T_TXT  # 8 register tokens lead the caption

    def megatron(stack, i):
        if stack == "single_transformer_blocks":  # serial attn then MLP on [caption; image]
            return [ctx + T_IMG] * 2, [ctx + T_IMG] * 2
        # joint: to_out / to_add_out, ff / ff_context (never context_pre_only)
        return [T_IMG, ctx, T_IMG, ctx], [T_IMG, ctx, T_IMG, ctx]
    return build, inputs, megatron


def sana():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.SanaTransformer2DModel(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
            num_layers=2, num_cross_attention_heads=4, cross_attention_head_dim=16,
            cross_attention_dim=64, caption_channels=32, sample_size=4, patch_size=1)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 4, 4),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "timestep": torch.tensor([3, 7]), "return_dict": False}
    # linear self-attn, cross-attn, GLUMBConv (1x1 conv, depthwise 3x3, GLU chunk, 1x1 conv):
    # as PixArt, plus the trained caption's backward all-reduce for the cross-attn's k/v
    return build, inputs, lambda s, i: ([T_IMG] * 3, [T_IMG] * 3 + [T_TXT])


def hunyuan_dit(layers=4):
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.HunyuanDiT2DModel(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2,
            sample_size=8, hidden_size=64, num_layers=layers, cross_attention_dim=64,
            cross_attention_dim_t5=32, pooled_projection_dim=32, text_len=2, text_len_t5=4,
            use_style_cond_and_image_meta_size=False)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([3.0, 7.0]),
                "encoder_hidden_states": torch.randn(B, 2, 64),
                "text_embedding_mask": torch.ones(B, 2),
                "encoder_hidden_states_t5": torch.randn(B, 4, 32),
                "text_embedding_mask_t5": torch.ones(B, 4), "return_dict": False}
    # self-attn, cross-attn (caption: 2 CLIP + 4 T5 tokens, trained), MLP, as PixArt; the
    # long-skip blocks' skip_norm + skip_linear (2h -> h) run on the replicated stream in Megatron
    # too (LayerNorm over the whole 2h), no collective
    return build, inputs, lambda s, i: ([T_IMG] * 3, [T_IMG] * 3 + [T_TXT])


T_VID = 32  # 2 latent frames x 4 x 4 patches


def cogvideox():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
            time_embed_dim=32, text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8,
            sample_frames=5, patch_size=2, max_text_seq_length=T_TXT)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 2, 4, 8, 8),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "timestep": torch.tensor([3, 7]), "return_dict": False}
    # one attention and one MLP, both over [text; video] (shared weights, split after): one
    # all-reduce of the joint sequence each way per sub-block
    return build, inputs, lambda s, i: ([T_TXT + T_VID] * 2, [T_TXT + T_VID] * 2)


def ltx_video():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16,
            cross_attention_dim=64, num_layers=2, caption_channels=32)).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, T_IMG, 8),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "timestep": torch.tensor([3, 7]), "encoder_attention_mask": torch.ones(B, T_TXT),
                "num_frames": 1, "height": 4, "width": 4, "return_dict": False}
    # self-attn (rotary), cross-attn (trained caption), MLP, as PixArt. Its q/k RMSNorm spans all
    # heads (rms_norm_across_heads): with heads sharded, each of the four norms needs its
    # B x T mean of squares all-reduced forward, and its gradient backward (1/h of a row)
    stats = [T_IMG / 64] * 3 + [T_TXT / 64]
    return build, inputs, lambda s, i: ([T_IMG] * 3 + stats, [T_IMG] * 3 + [T_TXT] + stats)


def lumina_next():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.LuminaNextDiT2DModel(
            sample_size=8, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
            num_attention_heads=4, num_kv_heads=4, multiple_of=16, cross_attention_dim=64,
            learn_sigma=False)).eval()

    def inputs():
        from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, 4, 8, 8), "timestep": torch.tensor([0.3, 0.7]),
                "encoder_hidden_states": torch.randn(B, T_TXT, 64),
                "encoder_mask": torch.ones(B, T_TXT),
                "image_rotary_emb": get_2d_rotary_pos_embed_lumina(16, 8, 8),  # complex
                "cross_attention_kwargs": {}, "return_dict": False}
    # self- and cross-attn outputs mix per head (tanh gate) before one shared to_out: one
    # all-reduce; then the MLP. Backward: the image's q/k/v (both attns), the caption's k/v
    # (its norm1_context weight trains), the MLP. Its q/k LayerNorm spans all heads
    # (layer_norm_across_heads): with heads sharded, each of the four norms all-reduces two
    # B x T statistics each way, the mean and then the variance about it (the two-pass form:
    # one all-reduce of sum(x) and sum(x^2) would cancel digits where the mean is large)
    stats = [T_IMG / 64] * 6 + [T_TXT / 64] * 2
    return build, inputs, lambda s, i: ([T_IMG] * 2 + stats, [T_IMG, T_TXT, T_IMG] + stats)


def qwen_image():
    def build():
        import diffusers
        torch.manual_seed(0)
        return perturb(diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))).eval()

    def inputs():
        torch.manual_seed(1)
        return {"hidden_states": torch.randn(B, T_IMG, 16),
                "encoder_hidden_states": torch.randn(B, T_TXT, 32),
                "encoder_hidden_states_mask": torch.ones(B, T_TXT),
                "timestep": torch.tensor([0.3, 0.7]), "img_shapes": [(1, 4, 4)] * B,
                "return_dict": False}
    # every block double-stream as Flux's: to_out, to_add_out, img_mlp, txt_mlp
    return build, inputs, lambda s, i: ([T_IMG, T_TXT] * 2, [T_IMG, T_TXT] * 2)


# ---- x-transformers ---------------------------------------------------------------------

T_TOK = 16


def xt(kind="Decoder", ctx=False, **kw):
    def build():
        import x_transformers as xtr
        torch.manual_seed(0)
        layers = getattr(xtr, kind)(dim=64, depth=2, heads=4, cross_attend=ctx, **kw) if ctx \
            else getattr(xtr, kind)(dim=64, depth=2, heads=4, **kw)
        return perturb(xtr.TransformerWrapper(num_tokens=128, max_seq_len=32,
                                                attn_layers=layers)).eval()

    def inputs():
        torch.manual_seed(1)
        d = {"x": torch.randint(0, 128, (B, T_TOK))}
        if ctx:
            d["context"] = torch.randn(B, 8, 64)
        return d

    def megatron(stack, i):
        # entries: [attn, (cross), ff] x depth; a cross-attention's k/v read the context,
        # whose gradient (a model input here) is not needed: no backward all-reduce for it
        return [T_TOK], [T_TOK]
    return build, inputs, megatron


def xt_vit():
    def build():
        import x_transformers as xtr
        torch.manual_seed(0)
        return perturb(xtr.ViTransformerWrapper(
            image_size=16, patch_size=4, num_classes=10, num_register_tokens=4,
            attn_layers=xtr.Encoder(dim=64, depth=2, heads=4))).eval()

    def inputs():
        torch.manual_seed(1)
        return {"img": torch.randn(B, 3, 16, 16)}
    # 16 patches + 4 register tokens; per entry (attn, ff) one all-reduce each way
    return build, inputs, lambda s, i: ([20], [20])


# ---- peft adapters (LoRA, DoRA, IA3) on LLaMA and GPT-2 ---------------------------------

def lora_llama(targets=("q_proj", "v_proj"), dora=False, ia3=None):
    def build():
        import peft
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)
        # ia3: the feedforward targets (their input is scaled, the others' output)
        adapter = peft.IA3Config(target_modules=list(targets), feedforward_modules=list(ia3)) \
            if ia3 is not None else \
            peft.LoraConfig(r=4, target_modules=list(targets), use_dora=dora)
        return perturb(peft.get_peft_model(LlamaForCausalLM(cfg), adapter))

    def inputs():
        torch.manual_seed(1)
        t = torch.randint(0, 128, (B, T_TOK))
        return {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t}
    return build, inputs, lambda s, i: ([T_TOK, T_TOK], [T_TOK, T_TOK])


def lora_gpt2(targets=("c_attn",)):
    def build():
        import peft
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0)  # trained (not eval) as lora-llama: no dropout
        # GPT-2's Conv1D (weight in x out), c_attn fused q|k|v: fan_in_fan_out LoRA
        return perturb(peft.get_peft_model(GPT2LMHeadModel(cfg), peft.LoraConfig(
            r=4, target_modules=list(targets), fan_in_fan_out=True)))

    def inputs():
        torch.manual_seed(1)
        t = torch.randint(0, 128, (B, T_TOK))
        return {"input_ids": t, "labels": t}
    return build, inputs, lambda s, i: ([T_TOK, T_TOK], [T_TOK, T_TOK])


# ---- torchtitan-style llama3 (plain torch, complex rotary) -------------------------------

class TTAttention(nn.Module):
    type_as_v = False  # True: .type_as(xv), a tensor of another shape (a rule-gap repro)

    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.hd)
        xk = self.wk(x).view(bs, seqlen, -1, self.hd)
        xv = self.wv(x).view(bs, seqlen, -1, self.hd)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        fc = freqs_cis.view(1, seqlen, 1, -1)
        # torchtitan's apply_rotary_emb: xq_out.type_as(xq), xk_out.type_as(xk)
        other_q, other_k = (xv, xv) if self.type_as_v else (xq, xk)
        xq = torch.view_as_real(xq_ * fc).flatten(3).type_as(other_q)
        xk = torch.view_as_real(xk_ * fc).flatten(3).type_as(other_k)
        rep = self.n_heads // self.n_kv
        xk = xk[:, :, :, None, :].expand(bs, seqlen, self.n_kv, rep, self.hd).reshape(
            bs, seqlen, self.n_kv * rep, self.hd)
        xv = xv[:, :, :, None, :].expand(bs, seqlen, self.n_kv, rep, self.hd).reshape(
            bs, seqlen, self.n_kv * rep, self.hd)
        o = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2),
                                           xv.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TTFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden, bias=False),
                                     nn.Linear(hidden, dim, bias=False),
                                     nn.Linear(dim, hidden, bias=False))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TTBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.attention = TTAttention(dim, n_heads, n_kv)
        self.feed_forward = TTFeedForward(dim, 4 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TTTransformer(nn.Module):
    def __init__(self, vocab=128, dim=64, n_layers=2, n_heads=8, n_kv=4, max_seq=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        hd = dim // n_heads
        freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
        freqs = torch.outer(torch.arange(max_seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): TTBlock(dim, n_heads, n_kv) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        fc = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, fc)
        return self.output(self.norm(h))


def torchtitan(type_as_v=False):
    def build():
        torch.manual_seed(0)
        model = TTTransformer()
        for m in model.modules():
            if isinstance(m, TTAttention):
                m.type_as_v = type_as_v
        return perturb(model).eval()

    def inputs():
        torch.manual_seed(1)
        return {"tokens": torch.randint(0, 128, (B, T_TOK))}
    return build, inputs, lambda s, i: ([T_TOK, T_TOK], [T_TOK, T_TOK])


# ---- registry ----------------------------------------------------------------------------

def make_cases() -> dict[str, Case]:
    cases = {}

    def add(name, triple, hidden, **kw):
        b, i, m = triple
        cases[name] = Case(name, b, i, hidden, m, **kw)

    add("sd3", sd3(), 64)
    add("sd3-3layers", sd3(layers=3), 64)
    add("sd3-qknorm-dual", sd3(qk_norm="rms_norm", dual=(0,)), 64)
    add("flux", flux(), 64)
    add("flux-3double", flux(3), 64)
    add("pixart", pixart(), 64)
    add("dit", dit(), 64)
    add("auraflow", auraflow(), 64)
    add("sana", sana(), 64)
    # the long-skip block (layer 3 of 4): skip_linear (2h -> h) is whole in Megatron too
    add("hunyuan-dit", hunyuan_dit(), 64,
        whole_ok=lambda n, s, tp: "skip_linear" in n)
    add("cogvideox", cogvideox(), 64)
    add("ltx-video", ltx_video(), 64)
    add("lumina-next", lumina_next(), 64)
    add("qwen-image", qwen_image(), 64)
    add("xt-rotary", xt(rotary_pos_emb=True), 64)
    add("xt-qknorm", xt(attn_qk_norm=True), 64)
    add("xt-ffglu", xt(ff_glu=True), 64)
    add("xt-cross", xt("Encoder", ctx=True), 64)
    add("xt-talking", xt(attn_pre_talking_heads=True, attn_post_talking_heads=True), 64)
    add("xt-modern", xt(rotary_pos_emb=True, attn_qk_norm=True, ff_glu=True, use_rmsnorm=True),
        64)
    add("xt-gated", xt(attn_gate_values=True, residual_attn=True, sandwich_norm=True,
                       ff_swish=True, use_scalenorm=True), 64)
    add("xt-vit", xt_vit(), 64)
    def kv_whole(n: str, s: Any, tp: int) -> bool:  # 2 k/v heads: whole at tp 4, as Megatron
        return tp > 2 and 32 in s and ("k_proj" in n or "v_proj" in n)

    add("lora-llama", lora_llama(), 64, loss=lambda o: o.loss, whole_ok=kv_whole)
    add("lora-llama-all", lora_llama(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj")), 64, loss=lambda o: o.loss,
        whole_ok=kv_whole)
    # DoRA on q/v: the norm of W + BA over input features is local to column-parallel rows
    add("dora-llama", lora_llama(dora=True), 64, loss=lambda o: o.loss, whole_ok=kv_whole)
    add("ia3-llama", lora_llama(("k_proj", "v_proj", "down_proj"), ia3=("down_proj",)), 64,
        loss=lambda o: o.loss, whole_ok=kv_whole)
    add("lora-gpt2", lora_gpt2(), 64, loss=lambda o: o.loss)
    add("torchtitan-llama", torchtitan(), 64)
    add("tt-typeas-other", torchtitan(type_as_v=True), 64)
    return cases


# ---- measuring -------------------------------------------------------------------------------

def sym_values(captured) -> dict[str, int]:
    """Readable dim name (B, T, T2, ...) -> its value in the example."""
    names = captured.dim_names
    out = {}
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for size in val.shape:
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if expr in names:
                    out[names[expr]] = int(size.node.shape_env.backed_var_to_val[expr])
    return out


_STACK = re.compile(r"^(?P<stack>.*?)\.(?P<index>\d+)(?:\.|$)")


def block_of(c) -> Optional[tuple[str, int]]:
    if c.layer is None or c.layer < 0:
        return None
    m = _STACK.match(c.module or "")
    return (m.group("stack") if m else "?", c.layer)


def check_exact(model, kwargs, sim, loss_of, output_of) -> tuple[bool, str]:
    """The equivalence check's verdict and a note: the largest differences, or what differs."""
    results = measure_equivalence(model, sim, kwargs=kwargs, loss_fn=loss_of, pick=output_of)
    failures = [line for r in results for line in r.failures(TOL, TOL)]
    if failures:
        return False, "; ".join(failures)
    return True, (f"out {max(r.step.output_diff for r in results):.0e}, "
                  f"grad {max(r.step.grad_rel for r in results):.0e}, after a step "
                  f"{max(r.after_step.output_diff for r in results):.0e}")


# where measure records an exception under row[key], it also calls on_error(row, key, exc)
# when set (benchmarks/unseen.py notes where autotp raised it); None: nothing more is recorded
on_error: Optional[Callable[[dict, str, BaseException], None]] = None


def _noted(row: dict, key: str, exc: BaseException) -> None:
    if on_error is not None:
        on_error(row, key, exc)


def measure(case: Case, tp: int, simulate: bool, verbose: bool) -> dict:
    row: dict[str, Any] = {"model": case.name, "tp": tp}
    clock = Stopwatch()
    model, kwargs = case.build(), case.inputs()
    sim = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if simulate:
                sim = autotp.simulate(model, tp, example_kwargs=kwargs, strict=False)
                captured, plan = sim.captured, sim.plan
            else:
                captured, plan = autotp.api.prepare(model, tp, example_kwargs=kwargs,
                                                    strict=False)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            _noted(row, "error", exc)
            if simulate:  # the plan alone, to still report it
                try:
                    captured, plan = autotp.api.prepare(model, tp, example_kwargs=kwargs,
                                                        strict=False)
                except Exception as exc2:  # noqa: BLE001
                    row["plan_error"] = f"{type(exc2).__name__}: {str(exc2).splitlines()[0][:300]}"
                    _noted(row, "plan_error", exc2)
                    return row
            else:
                row["plan_error"] = row.pop("error")
                return row
    if sim is not None:
        try:
            row["exact"], row["exact_note"] = check_exact(model, kwargs, sim, case.loss,
                                                          case.output)
        except Exception as exc:  # noqa: BLE001
            row["exact"], row["exact_note"] = False, f"{type(exc).__name__}: {exc}"[:300]
            _noted(row, "exact_note", exc)
    elif "error" in row:
        row["exact"] = None
    values = sym_values(captured)
    h, item = case.hidden, 4

    def nbytes(expr: str) -> int:
        e = sympy.sympify(expr)
        return int(e.subs({s: values[str(s)] for s in e.free_symbols}))

    per: dict[tuple[str, int], dict[str, list]] = {}
    outside = {"forward": [], "backward": []}
    for c in plan.collectives:
        blk = block_of(c)
        rec = (c.kind, nbytes(c.bytes_expr), c)
        if blk is None:
            outside[c.phase].append(rec)
        else:
            per.setdefault(blk, {"forward": [], "backward": []})[c.phase].append(rec)
    blocks = []
    over = False
    for blk in sorted(per):
        mf, mb = case.megatron(*blk)
        meg_f, meg_b = sum(mf) * B * h * item, sum(mb) * B * h * item
        # Megatron's bound counts activation-sized collectives; a norm's statistics over
        # sharded features (one or two numbers a row) are listed apart: under an eighth of
        # the block's largest collective (planner/bound.py's measure)
        largest = max((x[1] for ph in per[blk].values() for x in ph), default=0)
        small = {ph: [x for x in v if 8 * x[1] < largest] for ph, v in per[blk].items()}
        f, b = ([x for x in per[blk][ph] if 8 * x[1] >= largest]
                for ph in ("forward", "backward"))
        rf = sum(x[1] for x in f) / meg_f
        rb = sum(x[1] for x in b) / meg_b if meg_b else (0.0 if not b else float("inf"))
        above = not (within_bound(len(f), rf, len(mf)) and within_bound(len(b), rb, len(mb)))
        over |= above
        blocks.append({"block": f"{blk[0]}.{blk[1]}", "fwd": len(f), "bwd": len(b),
                       "megatron": (len(mf), len(mb)), "bytes": (round(rf, 3), round(rb, 3)),
                       "above": above,
                       "small": (len(small["forward"]), len(small["backward"])),
                       "detail": [(c.phase, k, n, c.node, c.module, _short(c.source), c.src, c.dst)
                                  for k, n, c in f + b]})
    row["blocks"] = blocks
    row["outside"] = {ph: [(k, n, c.node[:60]) for k, n, c in v] for ph, v in outside.items()}
    stacks = {b["block"].rsplit(".", 1)[0] for b in blocks}
    rep = []
    for n, p in plan.params.items():
        # a matrix, or a conv kernel by its out x in channels (Sana's 1x1 convs are its MLP)
        if len(p.global_shape) >= 2 and (p.layout.startswith("R") or "*" in p.layout):
            if min(p.global_shape[:2]) >= h // 2:
                in_layer = any(n.startswith(s + ".") for s in stacks) and \
                    not case.whole_ok(n, p.global_shape, tp)
                rep.append((n, p.global_shape, p.layout, in_layer))
    row["replicated"] = rep
    row["fallbacks"] = list(plan.fallbacks)
    big_in_layer = [r for r in rep if r[3]]
    ok = not over and not big_in_layer and not plan.fallbacks and "error" not in row
    row["verdict"] = "at bound" if ok else "ABOVE"
    if not ok and not over and not big_in_layer and "error" not in row:
        row["verdict"] = "per-layer at bound; fallbacks"
    row["seconds"] = round(clock.seconds, 1)
    row["_plan"] = plan
    return row


def _short(src: Optional[str]) -> str:
    if not src:
        return "-"
    return src.split("site-packages/")[-1]


def counts_text(blocks) -> str:
    seen: dict[str, list] = {}
    for b in blocks:
        stack = b["block"].rsplit(".", 1)[0].split(".")[-1]
        key = f"({b['fwd']},{b['bwd']})"
        seen.setdefault(stack, [])
        if key not in seen[stack]:
            seen[stack].append(key)
    return "; ".join(f"{s}: {' '.join(v)}" for s, v in seen.items())


def bytes_text(blocks) -> str:
    vals = []
    for b in blocks:
        t = f"({b['bytes'][0]:.2f},{b['bytes'][1]:.2f})"
        if t not in vals:
            vals.append(t)
    return " ".join(vals)


def print_row(row: dict, verbose: bool) -> None:
    if "plan_error" in row:
        print(f"{row['model']:18s} tp={row['tp']} PLAN FAILED: {row['plan_error']}")
        return
    ex = row.get("exact")
    ex_t = "exact" if ex else ("NOT exact" if ex is False else "-")
    note = row.get("exact_note", row.get("error", ""))
    print(f"{row['model']:18s} tp={row['tp']} {ex_t} [{note}]"
          f"  {row['verdict']}  ({row['seconds']} s)")
    if "error" in row:
        print(f"    simulate error: {row['error']}")
    print(f"    per block (fwd,bwd): {counts_text(row['blocks'])}   Megatron: "
          f"{sorted({str(b['megatron']) for b in row['blocks']})}")
    print(f"    bytes x Megatron: {bytes_text(row['blocks'])}")
    o = row["outside"]
    print(f"    outside blocks: fwd {[(k, n) for k, n, _ in o['forward']]} "
          f"bwd {[(k, n) for k, n, _ in o['backward']]}")
    replicated = [(name, shape, layout) + (() if inside else ("Megatron-whole/outside",))
                  for name, shape, layout, inside in row["replicated"]]
    print(f"    replicated >= h/2: {replicated or '-'}")
    print(f"    fallbacks: {row['fallbacks'] or '-'}")
    if verbose:
        for b in row["blocks"]:
            if b["above"] or verbose > 1:
                print(f"    -- {b['block']} ({b['fwd']},{b['bwd']}) vs {b['megatron']}")
                for d in b["detail"]:
                    print("       ", d)


def _planned(cell: Callable[[dict], str]) -> Callable[[dict], str]:
    """A summary cell, ``-`` in the row of a case that failed to plan."""
    return lambda row: "-" if "plan_error" in row else cell(row)


SUMMARY = [
    Column("model", 0, "model"), Column("tp", 0, "tp"),
    Column("exact", 0, cell=_planned(lambda r: {True: "yes", False: "NO"}.get(r.get("exact"),
                                                                              "-"))),
    Column("per block (fwd, bwd)", 0, cell=_planned(lambda r: counts_text(r["blocks"]))),
    Column("bytes x Megatron", 0, cell=_planned(lambda r: bytes_text(r["blocks"]))),
    Column("verdict", 0, cell=lambda r: (f"refused: {r['plan_error']}" if "plan_error" in r
                                         else r["verdict"])),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--tp", type=int, nargs="*", default=None)
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--verbose", "-v", action="count", default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    cases = make_cases()
    names = a.cases or list(cases)
    rows = []
    for name in names:
        case = cases[name]
        for tp in a.tp or case.tps:
            try:
                row = measure(case, tp, not a.no_sim, a.verbose)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                row = {"model": name, "tp": tp, "plan_error": "crash"}
            print_row(row, a.verbose)
            sys.stdout.flush()
            row.pop("_plan", None)
            rows.append(row)
    print()
    print(markdown_table(SUMMARY, rows))
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
