"""autotp on transformer code from codebases the project has never tested, against Megatron-LM.

    python -m benchmarks.unseen                     # every model, tp 2 and 4
    python -m benchmarks.unseen esm2 whisper --tp 2 # some models
    ... --set more    the second set's models (benchmarks/unseen_more.py); --set all: both
    ... --no-sim      plans only (no exactness check)
    ... --no-wide     skip the wide (hidden >= 1024, meta device) plans
    ... --verbose     every in-layer collective above the bound (node, module, source), and
                      what reads each replicated matrix
    ... --explain     each replicated matrix of the first --tp forced sharded (autotp explain)
    ... --json [F]    rows as JSON (default benchmarks/unseen.json); the baseline, run with the
                      package as it stood before a change, is benchmarks/unseen_baseline.json
                      (the second set's: unseen_more_baseline.json)

The models are built from the installed packages of other codebases: ESM (fair-esm), Whisper
(openai-whisper), torchtune, LitGPT, TransformerLens, vit-pytorch, PaLM (palm-rlhf-pytorch),
Perceiver (perceiver-pytorch), x-clip, nGPT-pytorch, local-attention, BS-RoFormer (bs-roformer).
A second set, benchmarks/unseen_more.py (`--set more`), has torchscale (RetNet, an encoder,
an encoder-decoder), conformer, st-moe-pytorch, soft-moe-pytorch, swin-transformer-pytorch,
linformer, g-mlp-pytorch, FLASH-pytorch, gateloop-transformer, yet-another-retnet and
tab-transformer-pytorch (FT-Transformer); the first set stays the default, comparable with its
baseline. None of them is used by the tests or the other benchmarks. pyproject.toml's `sweep`
extra pins them; their declared dependencies don't resolve with this project's (torchvision,
triton, an older huggingface-hub), so install the list with --no-deps (it names what they need):

    pip install --no-deps $(python -c "import tomllib; print(' '.join(tomllib.load(open(
        'pyproject.toml', 'rb'))['project']['optional-dependencies']['sweep']))")

Small configs (hidden 64, 2 layers, 4 or 8 heads, vocab 128 or ESM's 36), weights perturbed,
eval mode, a few tokens or patches.

Per model and tp, benchmarks/peers.py's `measure` does the work: simulate (strict=False) ->
outputs, loss and every gradient against the unsharded model; the plan's collectives per block
against Megatron's all-reduces (one of B x T_block x h per attention, cross-attention and MLP
sub-block, each way; a parallel attn+MLP block has one). Each row is classified:

    exact      simulate matched the unsharded model (outputs, loss, every gradient)
    mismatch   simulate ran, numbers differ
    refused    an autotp.AutotpError (first line)
    crash      any other exception, with the autotp file:line that raised it

Large replicated: a parameter kept whole (layout R) that Megatron shards: a matrix (a conv
kernel by its out x in channels) with both sides >= h/2, or a head-structured 3-D weight
(TransformerLens' W_Q [heads, d_model, d_head], W_O [heads, d_head, d_model]) whose two sides
are >= h/2, inside a block (a name with a module-list index), unless Megatron keeps it whole
too. At bound: no block has more collectives than Megatron's, the blocks' bytes within
Megatron's in total (each phase), no large replicated matrix and no fallback inside a block, no
error ("per block at bound", peers.py's verdict, also wants every block's bytes within: a
collective joined across two blocks is counted whole in the first).

The wide plan: the same model code at hidden >= 1024 (16 heads) built on the meta device (on
cpu where the model's own init can't run there: Whisper, TransformerLens),
`autotp.plan` only (no simulation) at tp 8, or 4 where the heads don't allow 8; its large
replicated matrices are counted and named (the ones a real deployment would hold whole).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import sys
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import autotp
from autotp.presentation.report import within_bound
from autotp.planner.bound import megatron_verdict
from autotp.verification.verify import perturb
from benchmarks import peers
from benchmarks.harness import Column, Stopwatch, markdown_table, write_json
from benchmarks.peers import B, Case, counts_text, measure

_HERE = os.path.dirname(os.path.abspath(__file__))

T = 16  # tokens of the text models

# torch.export's dumps of a graph it could not trace (the refusal's message says where)
for _log in ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export",
             "torch._export", "torch._subclasses.fake_tensor"):
    logging.getLogger(_log).setLevel(logging.CRITICAL)


# ---- importing model code whose package __init__ pulls in what CPU torch 2.13 lacks ---------

def submodule(package: str, name: str) -> types.ModuleType:
    """``package.name`` without running ``package/__init__.py`` (vit-pytorch's imports
    torchvision, bs-roformer's librosa): a bare package object with the installed path."""
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{package} is not installed (pip install -e .[sweep])")
        stub = types.ModuleType(package)
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = stub
    return importlib.import_module(f"{package}.{name}")


def x_clip_module() -> types.ModuleType:
    """x_clip imports torchvision's transforms at the top of visual_ssl.py (used only for
    its SSL augmentations, which these models turn off); torchvision has no CPU wheel for torch
    2.13, so an empty stand-in is put in its place when it is missing."""
    if "x_clip.x_clip" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module("x_clip.x_clip")
    tv = types.ModuleType("torchvision")
    tv.transforms = types.ModuleType("torchvision.transforms")  # type: ignore[attr-defined]
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = tv.transforms  # type: ignore[attr-defined]
    try:
        return importlib.import_module("x_clip.x_clip")
    finally:  # gone again: others (transformers) ask whether torchvision is installed
        del sys.modules["torchvision"], sys.modules["torchvision.transforms"]


def on_device(meta: bool):
    return torch.device("meta") if meta else torch.device("cpu")


def ready(model: nn.Module, meta: bool) -> nn.Module:
    """Small models: weights perturbed off their init (so norms, biases, zero-init layers are
    generic), eval mode. Meta models: eval mode only."""
    return model.eval() if meta else perturb(model).eval()


def tokens(vocab: int = 128, t: int = T) -> Callable[[], dict]:
    def inputs():
        torch.manual_seed(1)
        return {"x": torch.randint(4, vocab, (B, t))}
    return inputs


def serial(t: float) -> Callable[[str, int], tuple[list, list]]:
    """A serial attention + MLP block over t tokens: one all-reduce each, each way."""
    return lambda stack, i: ([t, t], [t, t])


def parallel(t: float, norms: int = 1) -> Callable[[str, int], tuple[list, list]]:
    """A parallel attention + MLP block (GPT-J / NeoX / PaLM): one all-reduce forward (the two
    row-parallel outputs summed first); backward one per norm the branches read (the column-
    parallel inputs' gradients meet only behind the norms: NeoX's two, PaLM's one)."""
    return lambda stack, i: ([t], [t] * norms)


class Call(nn.Module):
    """``model(**kwargs)`` as ``fn(model, **kwargs)``: a model whose forward takes positional
    arguments under other names, or returns a dict, called the same way as the others."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any]):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, **kwargs):
        return self.fn(self.model, **kwargs)


# ---- fair-esm: ESM-2, ESM-1b, MSA Transformer -------------------------------------------------

def esm_alphabet():
    import esm
    from esm.constants import proteinseq_toks
    # ESM's 33 tokens + 3 spare ones: a vocabulary divisible by 4, as the other models'
    return esm.data.Alphabet(standard_toks=list(proteinseq_toks["toks"]) + ["B1", "B2", "B3"],
                             prepend_toks=("<cls>", "<pad>", "<eos>", "<unk>"),
                             append_toks=("<mask>",), prepend_bos=True, append_eos=True)


def esm_tokens(shape):
    def inputs():
        torch.manual_seed(1)
        return {"tokens": torch.randint(4, 29, shape)}  # amino acids, no pad / mask
    return inputs


def esm2(dim, heads, meta=False):
    def build():
        from esm.model.esm2 import ESM2
        torch.manual_seed(0)
        with on_device(meta):
            model = ESM2(num_layers=2, embed_dim=dim, attention_heads=heads,
                         alphabet=esm_alphabet(), token_dropout=True)
        return ready(Call(model, lambda m, tokens: m(tokens)["logits"]), meta)
    return build, esm_tokens((B, T)), serial(T)


def esm1b(dim, heads, meta=False):
    def build():
        from esm.model.esm1 import ProteinBertModel
        torch.manual_seed(0)
        args = argparse.Namespace(arch="roberta_large", layers=2, embed_dim=dim,
                                  ffn_embed_dim=4 * dim, attention_heads=heads,
                                  max_positions=64, emb_layer_norm_before=True, final_bias=True)
        with on_device(meta):
            model = ProteinBertModel(args, esm_alphabet())
        return ready(Call(model, lambda m, tokens: m(tokens)["logits"]), meta)
    return build, esm_tokens((B, T)), serial(T)


def esm2_layers(model, tokens):
    """ESM-2's own modules (embedding, TransformerLayer stack, final norm, LM head) run by the
    harness: ESM2.forward's `if not padding_mask.any()` is data-dependent control flow that
    torch.export refuses (the esm2 row); no padding, no mask tokens here, so its token-dropout
    rescaling is one constant factor, left out."""
    x = (model.embed_scale * model.embed_tokens(tokens)).transpose(0, 1)  # T x B x h
    for layer in model.layers:
        x, _ = layer(x, self_attn_padding_mask=None, need_head_weights=False)
    return model.lm_head(model.emb_layer_norm_after(x).transpose(0, 1))


def esm2_composed(dim, heads, meta=False):
    build, inputs, megatron = esm2(dim, heads, meta)

    def composed():
        return ready(Call(build().model, esm2_layers), True)  # perturbed once, in build
    return composed, inputs, megatron


ROWS, COLS = 4, 8  # MSA: alignments x residues


def msa_layers(model, tokens):
    """The MSA Transformer's own modules run by the harness, without MSATransformer.forward's
    data-dependent `if not padding_mask.any()` (no padding here)."""
    b, r, c = tokens.shape
    x = model.embed_tokens(tokens)
    x = x + model.embed_positions(tokens.view(b * r, c)).view(x.shape)
    x = model.emb_layer_norm_before(x + model.msa_position_embedding[:, :r])
    x = x.permute(1, 2, 0, 3)  # R x C x B x h
    for layer in model.layers:
        x = layer(x, self_attn_padding_mask=None, need_head_weights=False)
    return model.lm_head(model.emb_layer_norm_after(x).permute(2, 0, 1, 3))


def esm_msa_composed(dim, heads, meta=False):
    build, inputs, megatron = esm_msa(dim, heads, meta)

    def composed():
        return ready(Call(build().model, msa_layers), True)
    return composed, inputs, megatron


def esm_msa(dim, heads, meta=False):
    def build():
        from esm.model.msa_transformer import MSATransformer
        torch.manual_seed(0)
        args = argparse.Namespace(layers=2, embed_dim=dim, ffn_embed_dim=4 * dim,
                                  attention_heads=heads, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, max_tokens_per_msa=2 ** 14,
                                  max_tokens=2 ** 14,
                                  max_positions=64, embed_positions_msa=True)
        with on_device(meta):
            model = MSATransformer(args, esm_alphabet())
        return ready(Call(model, lambda m, tokens: m(tokens)["logits"]), meta)
    # row attention (tied over the alignment's rows), column attention, FFN: each over the
    # whole MSA (rows x columns tokens)
    return build, esm_tokens((B, ROWS, COLS)), lambda s, i: ([ROWS * COLS] * 3,
                                                             [ROWS * COLS] * 3)


# ---- openai-whisper ---------------------------------------------------------------------------

T_AUDIO, T_TEXT = 8, 12


def no_sdpa(model, mel, tokens):
    """Whisper's own switch (whisper.model.disable_sdpa, a class attribute read at each call):
    q @ k^T, mask, softmax instead of scaled_dot_product_attention(is_causal=...)."""
    from whisper.model import disable_sdpa
    with disable_sdpa():
        return model(mel, tokens)


def whisper(dim, heads, meta=False, sdpa=True):
    def build():
        from whisper.model import ModelDimensions, Whisper
        torch.manual_seed(0)
        with on_device(meta):
            model = Whisper(ModelDimensions(
                n_mels=16, n_audio_ctx=T_AUDIO, n_audio_state=dim, n_audio_head=heads,
                n_audio_layer=2, n_vocab=128, n_text_ctx=T_TEXT, n_text_state=dim,
                n_text_head=heads, n_text_layer=2))
            if not meta:  # the decoder's positions are torch.empty until a checkpoint loads:
                # whatever memory held (NaN after another model's run), drawn here instead
                nn.init.normal_(model.decoder.positional_embedding, std=0.02)
        if sdpa:
            return ready(Call(model, lambda m, mel, tokens: m(mel, tokens)), meta)
        return ready(Call(model, no_sdpa), meta)

    def inputs():
        torch.manual_seed(1)
        return {"mel": torch.randn(B, 16, 2 * T_AUDIO),
                "tokens": torch.randint(0, 128, (B, T_TEXT))}

    def megatron(stack, i):
        if stack.endswith("encoder.blocks"):
            return [T_AUDIO] * 2, [T_AUDIO] * 2
        # self-attn, cross-attn, MLP; the cross-attn's k/v read the (trained) encoder output:
        # Megatron's backward all-reduce of B x T_audio x h for them
        return [T_TEXT] * 3, [T_TEXT] * 3 + [T_AUDIO]
    return build, inputs, megatron


# ---- torchtune ----------------------------------------------------------------------------------

def torchtune_model(family: str):
    def make(dim, heads, meta=False):
        def build():
            import importlib as il
            torch.manual_seed(0)
            kv = heads // 2  # GQA, 2 query heads per k/v head
            with on_device(meta):
                if family == "llama3":
                    fn = il.import_module("torchtune.models.llama3._component_builders").llama3
                    model = fn(vocab_size=128, num_layers=2, num_heads=heads, num_kv_heads=kv,
                               embed_dim=dim, max_seq_len=64, intermediate_dim=4 * dim)
                elif family == "qwen2":  # q/k/v biases
                    fn = il.import_module("torchtune.models.qwen2._component_builders").qwen2
                    model = fn(vocab_size=128, num_layers=2, num_heads=heads, num_kv_heads=kv,
                               embed_dim=dim, intermediate_dim=4 * dim, max_seq_len=64)
                elif family == "gemma":  # tied output, scaled embedding, GELU-tanh gate
                    fn = il.import_module("torchtune.models.gemma._component_builders").gemma
                    model = fn(vocab_size=128, num_layers=2, num_heads=heads,
                               head_dim=dim // heads, num_kv_heads=kv, embed_dim=dim,
                               intermediate_dim=4 * dim, max_seq_len=64)
                elif family == "gemma2":  # soft-capping, sandwich norms, sliding window
                    fn = il.import_module("torchtune.models.gemma2._component_builders").gemma2
                    model = fn(vocab_size=128, num_layers=2, num_heads=heads,
                               head_dim=dim // heads, num_kv_heads=kv, embed_dim=dim,
                               intermediate_dim=4 * dim, max_seq_len=64, sliding_window_size=8)
                else:  # phi3
                    fn = il.import_module("torchtune.models.phi3._component_builders").phi3
                    model = fn(vocab_size=128, num_layers=2, num_heads=heads, num_kv_heads=kv,
                               embed_dim=dim, intermediate_dim=4 * dim, max_seq_len=64)
            return ready(Call(model, lambda m, tokens: m(tokens)), meta)

        def inputs():
            torch.manual_seed(1)
            return {"tokens": torch.randint(0, 128, (B, T))}
        return build, inputs, serial(T)
    return make


# ---- litgpt -------------------------------------------------------------------------------------

def litgpt_model(kind: str):
    def make(dim, heads, meta=False):
        def build():
            from litgpt.config import Config
            from litgpt.model import GPT
            torch.manual_seed(0)
            common = dict(block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2,
                          n_embd=dim, n_head=heads, head_size=dim // heads)
            if kind == "pythia":  # GPT-NeoX: parallel residual, partial rotary, fused qkv
                cfg = Config(**common, rotary_percentage=0.25, parallel_residual=True,
                             bias=True, n_query_groups=heads, norm_class_name="LayerNorm",
                             mlp_class_name="GptNeoxMLP", intermediate_size=4 * dim)
            else:  # Llama 3: GQA in one fused qkv, RMSNorm, SwiGLU
                cfg = Config(**common, rotary_percentage=1.0, parallel_residual=False,
                             bias=False, n_query_groups=heads // 2, norm_class_name="RMSNorm",
                             mlp_class_name="LLaMAMLP", intermediate_size=4 * dim,
                             rope_base=500000)
            with on_device(meta):
                model = GPT(cfg)
            return ready(Call(model, lambda m, idx: m(idx)), meta)

        def inputs():
            torch.manual_seed(1)
            return {"idx": torch.randint(0, 128, (B, T))}
        return build, inputs, parallel(T, norms=2) if kind == "pythia" else serial(T)
    return make


# ---- transformer-lens -------------------------------------------------------------------------

def tl_model(kind: str):
    def make(dim, heads, meta=False):
        def build():
            from transformer_lens import HookedTransformer, HookedTransformerConfig
            torch.manual_seed(0)
            kw: dict[str, Any] = dict(n_layers=2, d_model=dim, n_ctx=64, d_head=dim // heads,
                                      n_heads=heads, d_mlp=4 * dim, d_vocab=128,
                                      device="meta" if meta else "cpu", seed=0)
            if kind == "gpt2":
                cfg = HookedTransformerConfig(**kw, act_fn="gelu_new", normalization_type="LN")
            else:  # GPT-J style: parallel attn + MLP, rotary
                cfg = HookedTransformerConfig(**kw, act_fn="gelu_new", normalization_type="LN",
                                              parallel_attn_mlp=True,
                                              positional_embedding_type="rotary",
                                              rotary_dim=dim // heads)
            with on_device(meta):
                model = HookedTransformer(cfg)
            return ready(Call(model, lambda m, tokens: m(tokens)), meta)

        def inputs():
            torch.manual_seed(1)
            return {"tokens": torch.randint(0, 128, (B, T))}
        # parallel: ln1 for the attention, ln2 for the MLP
        return build, inputs, serial(T) if kind == "gpt2" else parallel(T, norms=2)
    return make


# ---- vit-pytorch --------------------------------------------------------------------------------

IMG, PATCH = 16, 4
N_PATCH = (IMG // PATCH) ** 2


def image():
    def inputs():
        torch.manual_seed(1)
        return {"img": torch.randn(B, 3, IMG, IMG)}
    return inputs


def vit_model(kind: str):
    def make(dim, heads, meta=False):
        def build():
            torch.manual_seed(0)
            common = dict(image_size=IMG, patch_size=PATCH, num_classes=8, dim=dim, depth=2,
                          heads=heads, mlp_dim=4 * dim, dim_head=dim // heads)
            with on_device(meta):
                if kind == "vit":
                    model = submodule("vit_pytorch", "vit").ViT(**common)
                elif kind == "simple":  # sincos positions, mean pool, no cls
                    model = submodule("vit_pytorch", "simple_vit").SimpleViT(**common)
                elif kind == "deepvit":  # re-attention: heads mixed, LayerNorm over heads
                    model = submodule("vit_pytorch", "deepvit").DeepViT(**common)
                elif kind == "parallel":  # two attentions, two MLPs, summed
                    model = submodule("vit_pytorch", "parallel_vit").ViT(**common)
                else:  # CaiT: LayerScale, talking heads, class-attention layers
                    model = submodule("vit_pytorch", "cait").CaiT(**common, cls_depth=2)
            return ready(Call(model, lambda m, img: m(img)), meta)

        tokens_ = N_PATCH if kind == "simple" else N_PATCH + 1

        def megatron(stack, i):
            if kind == "cait":
                if "cls_transformer" in stack:
                    # the class token's attention over [cls; patches]: q on 1 token, k/v on
                    # 17 (the trained patches: a backward all-reduce), MLP on 1
                    return [1, 1], [1, N_PATCH + 1, 1]
                return [N_PATCH] * 2, [N_PATCH] * 2
            return [tokens_] * 2, [tokens_] * 2
        return build, image(), megatron
    return make


# ---- palm-rlhf-pytorch --------------------------------------------------------------------------

def palm(dim, heads, meta=False):
    def build():
        PaLM = importlib.import_module("palm_rlhf_pytorch.palm").PaLM
        torch.manual_seed(0)
        with on_device(meta):
            model = PaLM(num_tokens=128, dim=dim, depth=2, dim_head=dim // heads, heads=heads)
        return ready(Call(model, lambda m, x: m(x)), meta)
    # one fused projection (q | k | v | SwiGLU), multi-query attention (one k/v head: whole in
    # Megatron too, dim_head wide), attn_out + ff_out summed: one all-reduce each way
    return build, tokens(), parallel(T)


# ---- perceiver-pytorch --------------------------------------------------------------------------

LATENTS = 16


def perceiver(dim, heads, meta=False):
    def build():
        Perceiver = importlib.import_module("perceiver_pytorch.perceiver_pytorch").Perceiver
        torch.manual_seed(0)
        with on_device(meta):
            model = Perceiver(num_freq_bands=4, depth=2, max_freq=10.0, input_channels=3,
                              input_axis=2, num_latents=LATENTS, latent_dim=dim,
                              cross_heads=heads, latent_heads=heads, cross_dim_head=dim // heads,
                              latent_dim_head=dim // heads, num_classes=8, self_per_cross_attn=1)
        return ready(Call(model, lambda m, data: m(data)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"data": torch.randn(B, 4, 4, 3)}
    # latents: cross-attn (k/v read the data + Fourier features: an input, no gradient), its
    # MLP, self-attn, MLP: four all-reduces of B x latents x h each way
    return build, inputs, lambda s, i: ([LATENTS] * 4, [LATENTS] * 4)


# ---- x-clip -------------------------------------------------------------------------------------

def x_clip(dim, heads, meta=False):
    def build():
        CLIP = x_clip_module().CLIP
        torch.manual_seed(0)
        with on_device(meta):
            model = CLIP(dim_text=dim, dim_image=dim, dim_latent=dim, num_text_tokens=128,
                         text_enc_depth=2, text_seq_len=T, text_heads=heads,
                         text_dim_head=dim // heads, visual_enc_depth=2, visual_image_size=IMG,
                         visual_patch_size=PATCH, visual_heads=heads,
                         visual_dim_head=dim // heads, visual_patch_dropout=0.0)
        return ready(Call(model, lambda m, text, image: m(text, image)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"text": torch.randint(1, 128, (B, T)), "image": torch.randn(B, 3, IMG, IMG)}
    # text: T tokens + cls; image: 16 patches + cls; attn + MLP each
    return build, inputs, lambda s, i: ([T + 1] * 2, [T + 1] * 2) if "text" in s else \
        ([N_PATCH + 1] * 2, [N_PATCH + 1] * 2)


# ---- nGPT-pytorch -------------------------------------------------------------------------------

def ngpt(dim, heads, meta=False):
    def build():
        nGPT = importlib.import_module("nGPT_pytorch.nGPT").nGPT
        torch.manual_seed(0)
        with on_device(meta):
            model = nGPT(num_tokens=128, dim=dim, depth=2, dim_head=dim // heads, heads=heads,
                         attn_flash_kwargs=dict(enable_flash=False, enable_math=True,
                                                enable_mem_efficient=False))
        return ready(Call(model, lambda m, ids: m(ids)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"ids": torch.randint(0, 128, (B, T))}
    # hypersphere-normalized weights (parametrized l2norm) and residual stream; the bound
    # counts the activations' all-reduces only
    return build, inputs, serial(T)


# ---- local-attention ----------------------------------------------------------------------------

def local_transformer(dim, heads, meta=False):
    def build():
        LocalTransformer = importlib.import_module("local_attention.transformer").LocalTransformer
        torch.manual_seed(0)
        with on_device(meta):
            model = LocalTransformer(num_tokens=128, max_seq_len=64, dim=dim, depth=2,
                                     heads=heads, dim_head=dim // heads,
                                     local_attn_window_size=8, causal=True)
        return ready(Call(model, lambda m, x: m(x)), meta)
    # 4 hyper-connection residual streams (the default): each branch reads a mix of them and
    # writes into all; Megatron all-reduces the branch output once
    return build, tokens(), serial(T)


# ---- bs-roformer ------------------------------------------------------------------------------

N_FFT, HOP, SAMPLES = 62, 16, 112  # 32 frequency bins, 8 frames
BANDS = (16, 16)


def bs_roformer(dim, heads, meta=False):
    def build():
        BSRoformer = submodule("bs_roformer", "bs_roformer").BSRoformer
        torch.manual_seed(0)
        with on_device(meta):
            model = BSRoformer(dim, depth=1, time_transformer_depth=1, freq_transformer_depth=1,
                               freqs_per_bands=BANDS, dim_freqs_in=N_FFT // 2 + 1 - 1,
                               heads=heads, dim_head=dim // heads, flash_attn=False,
                               stft_n_fft=N_FFT, stft_hop_length=HOP, stft_win_length=N_FFT,
                               mask_estimator_depth=1, num_residual_streams=1)
        return ready(Call(model, lambda m, audio: m(audio)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"audio": torch.randn(B, SAMPLES)}
    frames = SAMPLES // HOP + 1
    band_tokens = len(BANDS) * frames
    # time and frequency transformers, each attn + MLP over every (band, frame) token. One
    # residual stream (local-attn has the hyper-connections); tracing the STFT takes ~20 s
    return build, inputs, lambda s, i: ([band_tokens] * 4, [band_tokens] * 4)


# ---- registry ------------------------------------------------------------------------------

@dataclass
class Model:
    name: str
    dist: str  # the PyPI distribution the model code comes from
    kind: str  # what it exercises
    make: Callable[..., tuple]  # (dim, heads, meta=False) -> (build, inputs, megatron)
    heads: int = 4  # small model (hidden 64)
    wide_heads: int = 16  # wide model (hidden 1024)
    wide_tp: int = 8
    # the wide model is built on the meta device; False where the model's own init can't be
    # (Whisper's alignment heads call to_sparse; TransformerLens moves to cfg.device): on cpu
    wide_meta: bool = True
    # the module lists that are its transformer blocks (prefixes of parameter names); None:
    # every module list. Others (BS-RoFormer's per-band projections and mask heads) count as
    # outside the blocks, as embeddings and heads do
    stacks: Optional[tuple[str, ...]] = None

    def in_stacks(self, name: str) -> bool:
        return self.stacks is None or any(name.startswith(s + ".") for s in self.stacks)

    def case(self) -> Case:
        build, inputs, megatron = self.make(64, self.heads)
        return Case(self.name, build, inputs, 64, megatron)


MODELS = [
    Model("esm2", "fair-esm", "protein LM (ESM-2): rotary, fairseq attention, token dropout",
          esm2),
    Model("esm1b", "fair-esm", "protein LM (ESM-1b): learned positions, tied LM head", esm1b),
    Model("esm-msa", "fair-esm", "MSA Transformer: tied row attention + column attention",
          esm_msa),
    Model("esm2-layers", "fair-esm", "ESM-2's modules without ESM2.forward's data-dependent "
          "branch", esm2_composed),
    Model("esm-msa-layers", "fair-esm", "the MSA Transformer's modules without its forward's "
          "data-dependent branch", esm_msa_composed),
    Model("whisper", "openai-whisper", "audio encoder-decoder: conv stem, cross-attention, "
          "tied logits", whisper, wide_meta=False),
    Model("whisper-nosdpa", "openai-whisper", "Whisper with its SDPA switched off (explicit "
          "softmax attention)", lambda d, h, meta=False: whisper(d, h, meta, sdpa=False),
          wide_meta=False),
    Model("tt-llama3", "torchtune", "dense decoder LLM: GQA, RoPE, SwiGLU",
          torchtune_model("llama3"), heads=8),
    Model("tt-qwen2", "torchtune", "dense decoder LLM: GQA with q/k/v biases",
          torchtune_model("qwen2"), heads=8),
    Model("tt-gemma", "torchtune", "dense decoder LLM: tied output, GELU gate, scaled embedding",
          torchtune_model("gemma"), heads=8),
    Model("tt-gemma2", "torchtune", "dense decoder LLM: logit soft-capping, sandwich norms, "
          "sliding window", torchtune_model("gemma2"), heads=8),
    Model("tt-phi3", "torchtune", "dense decoder LLM (Phi-3)", torchtune_model("phi3"), heads=8),
    Model("litgpt-pythia", "litgpt", "parallel attn+MLP (GPT-NeoX): fused qkv, partial rotary",
          litgpt_model("pythia")),
    Model("litgpt-llama", "litgpt", "dense decoder LLM: GQA in one fused qkv",
          litgpt_model("llama"), heads=8),
    Model("tl-gpt2", "transformer-lens", "GPT-2 in einsum form: per-head 3-D weights",
          tl_model("gpt2"), wide_meta=False),
    Model("tl-parallel", "transformer-lens", "parallel attn+MLP (GPT-J), rotary, einsum form",
          tl_model("parallel"), wide_meta=False),
    Model("vit", "vit-pytorch", "ViT: cls token, einops rearrange", vit_model("vit")),
    Model("simple-vit", "vit-pytorch", "SimpleViT: sincos positions, mean pool",
          vit_model("simple")),
    Model("deepvit", "vit-pytorch", "DeepViT: re-attention (heads mixed, LayerNorm over heads)",
          vit_model("deepvit")),
    Model("cait", "vit-pytorch", "CaiT: talking heads, LayerScale, class-attention",
          vit_model("cait")),
    Model("parallel-vit", "vit-pytorch", "parallel ViT: two attentions and two MLPs summed",
          vit_model("parallel")),
    Model("palm", "palm-rlhf-pytorch", "PaLM: parallel block, one fused projection, "
          "multi-query attention, xpos rotary", palm),
    Model("perceiver", "perceiver-pytorch", "Perceiver: latents cross-attend to the input, "
          "heads folded into the batch", perceiver),
    Model("x-clip", "x-clip", "CLIP: text and image towers, contrastive similarity", x_clip),
    Model("ngpt", "nGPT-pytorch", "nGPT: normalized weights (parametrizations), hypersphere "
          "residual", ngpt),
    Model("local-attn", "local-attention", "local windowed attention, hyper-connections",
          local_transformer),
    Model("bs-roformer", "bs-roformer", "band-split RoFormer: STFT, band / time / frequency "
          "transformers", bs_roformer, stacks=("model.layers",)),
]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ---- large replicated matrices ------------------------------------------------------------------

def large(shape: tuple, h: int) -> bool:
    """A matrix Megatron shards: both sides >= h/2 (a conv kernel by out x in channels), or a
    3-D head-structured weight [heads, in, d_head] / [heads, d_head, out] with two sides >= h/2
    (heads x d_head one of them)."""
    if len(shape) < 2:
        return False
    if min(shape[0], shape[1]) >= h // 2:
        return True
    if len(shape) == 3:
        return (shape[0] * shape[2] >= h // 2 and shape[1] >= h // 2) or \
            (shape[0] * shape[1] >= h // 2 and shape[2] >= h // 2)
    return False


_INDEXED = re.compile(r"\.\d+\.")


def large_replicated(plan, h: int, whole_ok=lambda n, s, tp: False,
                     in_stacks=lambda n: True) -> list[dict]:
    out = []
    for name, p in plan.params.items():
        # held whole, or in segments some held whole (a fused q|k|v's single k/v head) where
        # a rank holds more than 1.25/tp of the matrix (the slack of the plan's own verdict)
        mixed_heavy = "*" in p.layout and \
            math.prod(p.local_shape) > 1.25 * math.prod(p.global_shape) / plan.tp
        if not (p.layout.startswith("R") or mixed_heavy):
            continue
        if not large(tuple(p.global_shape), h):
            continue
        # inside a block: its first reader is in a layer, and its name has a module-list index
        in_layer = p.layer is not None and bool(_INDEXED.search(name)) and \
            in_stacks(name) and not whole_ok(name, p.global_shape, plan.tp)
        out.append({"name": name, "shape": list(p.global_shape), "layout": p.layout,
                    "in_layer": in_layer, "readers": None})
    return out


_FALLBACK_MODULE = re.compile(r"\((\S+) at \S+\)$")


def in_layer_fallbacks(plan, in_stacks=lambda n: True) -> list[str]:
    """The plan's fallbacks (values computed whole where a rule was missing or a reader needs
    all of it) that are inside a block: a parameter's first use, or the node's layer, in one of
    the model's block stacks."""
    out = []
    for f in plan.fallbacks:
        head = f.split(" ", 1)[0]
        p = plan.params.get(head)
        if p is not None:
            inside = p.layer is not None and in_stacks(head)
        else:
            node = f.split(" at ", 1)[1].split(":", 1)[0] if " at " in f else head
            module = _FALLBACK_MODULE.search(f)
            inside = plan.node_layers.get(node) is not None and \
                (module is None or in_stacks(module.group(1)))
        if inside:
            out.append(f)
    return out


def readers(plan, rep: list[dict], depth: int = 3) -> None:
    """For each replicated matrix: the ops downstream of it (op, strategy, the model's source
    line) up to ``depth`` steps, the first of them where a shard would have had to be gathered
    being what keeps it whole (a first guess; `autotp explain` forces the alternatives)."""
    users: dict[str, list[str]] = {}
    for node, reads in plan.graph.items():
        for r in reads:
            users.setdefault(r, []).append(node)
    for r in rep:
        node = r["name"].replace(".", "_")
        if node not in plan.graph and node not in users:
            continue
        chain, frontier, seen = [], [node], {node}
        for _ in range(depth):
            nxt = []
            for n in frontier:
                for u in users.get(n, []):
                    if u in seen:
                        continue
                    seen.add(u)
                    c = plan.choices.get(u)
                    if c is not None:
                        chain.append(f"{u}={c.op} [{c.strategy}] -> {plan.values.get(u, '?')}"
                                     f" @ {peers._short(c.source)}")
                    nxt.append(u)
            frontier = nxt
        r["readers"] = chain[:8]


def explain(m: Model, tp: int, targets: list[str], limit: int = 3) -> dict[str, list[str]]:
    """`autotp explain` for replicated matrices: each sharded layout its readers accept,
    forced in turn with the rest re-planned: infeasible (the reason), or the collectives it
    would add (op node, module, model source): what keeping it whole saves. No sharded
    candidate at all: no reader has a rule taking it sharded."""
    from autotp.errors import PlanError
    from autotp.planner.problem import PlanOptions, block_counts, build_problem, leaf_candidates
    from autotp.planner.cost import CostModel
    from autotp.planner.solve import plan_graph
    from autotp.rules.registry import Registry

    case = m.case()
    model, kwargs = case.build(), case.inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured, plan = autotp.api.prepare(model, tp, example_kwargs=kwargs, strict=False)
        cost = CostModel()
        pnodes = build_problem(captured, tp, block_counts(captured.gm), Registry.default(), cost,
                               PlanOptions(strict=False))
        cands = leaf_candidates(pnodes, {pn.node.name: pn for pn in pnodes})
        out: dict[str, list[str]] = {}
        for target in targets[:limit]:
            node = next((n.name for n in captured.gm.graph.nodes
                         if n.op == "get_attr" and n.target == target), None)
            if node is None:
                continue
            lines = []
            sharded = [c for c in cands.get(node, []) if str(c) != plan.params[target].layout
                       and str(c) != "R"]
            if not sharded:
                lines.append("no reader's rule takes it sharded")
            base = {(c.phase, c.kind, c.node) for c in plan.collectives}
            for cand in sharded:
                try:
                    alt = plan_graph(captured, tp, cost_model=cost,
                                     options=PlanOptions(strict=False, force=((node, cand),)),
                                     model_name=type(model).__name__)
                except PlanError as exc:
                    lines.append(f"{cand}: infeasible: {str(exc).splitlines()[0][:300]}")
                    continue
                extra = [c for c in alt.collectives if (c.phase, c.kind, c.node) not in base]
                lines.append(f"{cand}: cost {alt.cost - plan.cost:+.3g}; adds " + "; ".join(
                    f"{c.phase} {c.kind} of {c.node} ({c.src}->{c.dst}) {c.module} @ "
                    f"{peers._short(c.source)}" for c in extra[:4]) + (" ..." if len(extra) > 4
                                                                      else ""))
            out[target] = lines
    return out


# ---- rows -------------------------------------------------------------------------------------

def _where(exc: BaseException) -> dict:
    """The innermost frame inside autotp (``autotp/planner/solve.py:123``), and the innermost
    frame overall, of an exception's traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if f"{os.sep}autotp{os.sep}" in f.filename]
    short = lambda f: f"{f.filename.split(os.sep + 'autotp' + os.sep, 1)[-1]}:{f.lineno}"  # noqa
    at = f"autotp/{short(own[-1])}" if own else None
    last = frames[-1] if frames else None
    return {"at": at, "raised": f"{peers._short(last.filename)}:{last.lineno}" if last else None,
            "type": type(exc).__name__, "refused": isinstance(exc, autotp.AutotpError),
            "message": (str(exc).splitlines() or [""])[0][:300]}


def _on_error(row: dict, key: str, exc: BaseException) -> None:
    row.setdefault("exceptions", {})[key] = _where(exc)


peers.on_error = _on_error


def status(row: dict) -> tuple[str, Optional[dict]]:
    """exact / mismatch / refused / crash (and the exception), from peers' row."""
    exc = row.get("exceptions", {})
    for key in ("plan_error", "error", "exact_note"):
        if key in exc:
            e = exc[key]
            return ("refused" if e["refused"] else "crash"), e
    if "harness_error" in row:  # building the model, or this harness: not autotp's
        e = row["harness_error"]
        return ("crash" if e["at"] else "build-error"), e
    if "plan_error" in row:
        return "crash", None
    if row.get("exact") is True:
        return "exact", None
    if row.get("exact") is False:
        return "mismatch", None
    return "planned", None


def measure_model(m: Model, tp: int, simulate: bool, verbose: int) -> dict:
    case = m.case()
    try:
        row = measure(case, tp, simulate, verbose)
    except Exception as exc:  # noqa: BLE001  (building the model, or the harness)
        row = {"model": m.name, "tp": tp, "harness_error": _where(exc)}
        if verbose:
            traceback.print_exc()
    row["codebase"], row["version"] = m.dist, version(m.dist)
    plan = row.pop("_plan", None)
    if plan is not None:
        rep = large_replicated(plan, case.hidden, case.whole_ok, m.in_stacks)
        # blocks of module lists that are no transformer blocks: outside, as embeddings
        others = [b for b in row["blocks"] if not m.in_stacks(b["block"])]
        row["blocks"] = [b for b in row["blocks"] if m.in_stacks(b["block"])]
        row["other_lists"] = [(b["block"], b["fwd"], b["bwd"]) for b in others]
        readers(plan, [r for r in rep if r["in_layer"]])
        row["large_replicated"] = rep
        row["fallbacks_in_layers"] = in_layer_fallbacks(plan, m.in_stacks)
        above = [b for b in row["blocks"] if b["above"]]
        row["above_blocks"] = [b["block"] for b in above]
        row["totals"] = totals(case, row["blocks"])
        clean = not any(r["in_layer"] for r in rep) and not row["fallbacks_in_layers"] and \
            "error" not in row and "exceptions" not in row
        # peers' verdict: every block within Megatron's count and bytes
        row["per_block_at_bound"] = clean and not above
        # at bound: no block with more collectives than Megatron's, and the blocks' bytes
        # within Megatron's in total (a collective joined across two blocks, as Whisper's
        # encoder MLP with the decoder's first self-attention, is over in one block only)
        more = [b for b in row["blocks"] if b["fwd"] > b["megatron"][0] or
                b["bwd"] > b["megatron"][1]]
        # and blocks found at all: a plan whose layers went unseen proves nothing
        row["at_bound"] = clean and not more and row["totals"]["within"] and bool(row["blocks"])
        row["plan_verdict"] = megatron_verdict(plan).as_dict()  # the plan's own, alongside
        meg = sorted({tuple(b["megatron"]) for b in row["blocks"]})
        row["megatron_counts"] = [list(x) for x in meg]
        row["collectives"] = counts_text(row["blocks"])
        row["summary"] = plan.summary()
    else:
        row["at_bound"] = False
    row["status"], row["exception"] = status(row)
    return row


def totals(case: Case, blocks: list[dict]) -> dict:
    """The blocks' collectives added up, each phase: count and bytes against Megatron's sums
    (a collective joined across two blocks, e.g. Whisper's encoder MLP with a decoder value,
    is counted whole in the first block: over there, under in the other)."""
    out: dict[str, Any] = {}
    for k, phase in enumerate(("forward", "backward")):
        n = sum(1 for b in blocks for d in b["detail"] if d[0] == phase)
        nbytes = sum(d[2] for b in blocks for d in b["detail"] if d[0] == phase)
        meg = [case.megatron(*_split_block(b["block"]))[k] for b in blocks]
        mn, mbytes = sum(len(x) for x in meg), sum(sum(x) for x in meg) * B * case.hidden * 4
        out[phase] = {"count": n, "megatron": mn, "bytes_ratio":
                      round(nbytes / mbytes, 3) if mbytes else (0.0 if not nbytes else None)}
    out["within"] = all(within_bound(out[p]["count"], out[p]["bytes_ratio"], out[p]["megatron"])
                        for p in ("forward", "backward"))
    return out


def _split_block(block: str) -> tuple[str, int]:
    stack, index = block.rsplit(".", 1)
    return stack, int(index)


def wide_plan(m: Model) -> dict:
    """The model at hidden 1024 (16 heads) on the meta device: autotp.plan only."""
    dim = 1024
    tp = m.wide_tp if m.wide_heads % m.wide_tp == 0 else 4
    out: dict[str, Any] = {"model": m.name, "hidden": dim, "heads": m.wide_heads, "tp": tp}
    clock = Stopwatch()
    try:
        build, inputs, _ = m.make(dim, m.wide_heads, meta=m.wide_meta)
        model, kwargs = build(), inputs()
        out["device"] = "meta" if m.wide_meta else "cpu"
    except Exception as exc:  # noqa: BLE001
        out["build_error"] = _where(exc)
        return out
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autotp.plan(model, tp, example_kwargs=kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001
        out["plan_error"] = _where(exc)
        out["seconds"] = round(clock.seconds, 1)
        return out
    rep = large_replicated(plan, dim, in_stacks=m.in_stacks)
    inside = [r for r in rep if r["in_layer"]]
    readers(plan, inside)
    out["large_replicated"] = len(inside)
    out["names"] = [r["name"] for r in inside]
    out["detail"] = inside
    out["outside"] = [r["name"] for r in rep if not r["in_layer"]]
    out["fallbacks"] = list(plan.fallbacks)
    out["fallbacks_in_layers"] = in_layer_fallbacks(plan, m.in_stacks)
    out["collectives"] = {"forward": plan.count("forward"), "backward": plan.count("backward")}
    out["seconds"] = round(clock.seconds, 1)
    return out


# ---- printing --------------------------------------------------------------------------------

def row_text(row: dict) -> str:
    st = row["status"]
    if row["exception"]:
        e = row["exception"]
        st += f" [{e['type']}: {e['message'][:120]} @ {e['at'] or e['raised']}]"
    elif st == "mismatch":
        st += f" [{row.get('exact_note', '')}]"
    coll = row.get("collectives", "-")
    meg = row.get("megatron_counts", "-")
    rep = [r for r in row.get("large_replicated", []) if r["in_layer"]]
    bound = "yes" if row.get("at_bound") else "no"
    if row.get("totals") and not row.get("at_bound"):
        bound += f" (totals {'within' if row['totals']['within'] else 'over'})"
    return (f"{row['model']:14s} {row['codebase']:18s} tp={row['tp']}  {st}\n"
            f"    per block (fwd,bwd): {coll or '-'}   Megatron: {meg}   at bound: {bound}   "
            f"large replicated: {len(rep)}{' ' + str([r['name'] for r in rep]) if rep else ''}"
            + (f"   fallbacks: {len(row['fallbacks'])} ({len(row['fallbacks_in_layers'])} in "
               "layers)" if row.get("fallbacks") else "")
            + f"   ({row.get('seconds', '-')} s)")


def wide_text(w: dict) -> str:
    head = f"{w['model']:14s} wide h={w['hidden']} tp={w['tp']}:"
    for key in ("build_error", "plan_error"):
        if key in w:
            e = w[key]
            return f"{head} {key} {e['type']}: {e['message'][:120]} @ {e['at'] or e['raised']}"
    names = f" {w['names']}" if w["names"] else ""
    return (f"{head} large replicated {w['large_replicated']}{names}; "
            f"collectives fwd {w['collectives']['forward']} bwd {w['collectives']['backward']}"
            f"; fallbacks {len(w['fallbacks'])} ({len(w['fallbacks_in_layers'])} in layers)"
            f" ({w['seconds']} s)")


def summary_columns(wides: list[dict]) -> list[Column]:
    """The run's table: a row per model and tp, with the model's wide plan beside it."""
    wide_of = {w["model"]: w for w in wides}

    def result(row: dict) -> str:
        e = row["exception"]
        return row["status"] + (f": {e['type']} @ {e['at'] or e['raised']}" if e else "")

    def wide(row: dict) -> str:
        w = wide_of.get(row["model"])
        return "-" if w is None else (str(w["large_replicated"]) if "large_replicated" in w
                                      else "error")

    return [
        Column("model", 0, "model"),
        Column("codebase", 0, cell=lambda r: f"{r['codebase']} {r['version']}"),
        Column("tp", 0, "tp"), Column("result", 0, cell=result),
        Column("per block (fwd,bwd)", 0, cell=lambda r: str(r.get("collectives", "-"))),
        Column("Megatron", 0, cell=lambda r: str(r.get("megatron_counts", "-"))),
        Column("at bound", 0, cell=lambda r: "yes" if r.get("at_bound") else "no"),
        Column("large repl.", 0, cell=lambda r: str(sum(
            1 for x in r.get("large_replicated", []) if x["in_layer"]))),
        Column("wide large repl.", 0, cell=wide),
    ]


def summary(rows: list[dict], wides: list[dict]) -> dict:
    n = len(rows)
    by = {k: [r for r in rows if r["status"] == k]
          for k in ("exact", "mismatch", "refused", "crash", "planned")}
    sim = [r for r in rows if r["status"] != "planned"]
    return {
        "rows": n,
        "build_errors": [f"{r['model']} tp={r['tp']}: {r['exception']['type']}: "
                         f"{r['exception']['message'][:160]} @ {r['exception']['raised']}"
                         for r in rows if r["status"] == "build-error"],
        "exact_pct": round(100 * len(by["exact"]) / len(sim), 1) if sim else None,
        "at_bound_pct": round(100 * sum(1 for r in rows if r.get("at_bound")) / n, 1)
        if n else None,
        "mismatch": [f"{r['model']} tp={r['tp']}" for r in by["mismatch"]],
        "crashes": [f"{r['model']} tp={r['tp']}: {r['exception']['type']}: "
                    f"{r['exception']['message'][:160]} @ "
                    f"{r['exception']['at'] or r['exception']['raised']}"
                    if r["exception"] else f"{r['model']} tp={r['tp']}"
                    for r in by["crash"]],
        "refusals": [f"{r['model']} tp={r['tp']}: {r['exception']['type']}: "
                     f"{r['exception']['message'][:160]}" for r in by["refused"]],
        "wide_large_replicated": {w["model"]: w.get("large_replicated", "error") for w in wides},
    }


def model_set(name: str) -> list[Model]:
    """The models of a set: ``first`` (this file's), ``more`` (benchmarks/unseen_more.py's),
    ``all``."""
    if name == "first":
        return MODELS
    from benchmarks import unseen_more  # it imports this module's Model and helpers

    return unseen_more.MODELS if name == "more" else MODELS + unseen_more.MODELS


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--set", choices=("first", "more", "all"), default="first",
                    help="the models of this file (first), of unseen_more.py (more), or both")
    ap.add_argument("--tp", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--no-wide", action="store_true")
    ap.add_argument("--verbose", "-v", action="count", default=0)
    ap.add_argument("--explain", action="store_true",
                    help="force the first replicated matrices sharded (tp of the first --tp)")
    ap.add_argument("--json", nargs="?", const="",
                    help="write the rows as JSON (default file: benchmarks/unseen.json, "
                    "unseen_more.json with --set more, unseen_all.json with --set all)")
    a = ap.parse_args(argv)
    models = model_set(a.set)
    if a.json == "":
        a.json = os.path.join(_HERE, "unseen.json" if a.set == "first" else
                              f"unseen_{a.set}.json")
    by_name = {m.name: m for m in models}
    unknown = [n for n in a.models if n not in by_name]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {list(by_name)}")
    chosen = [by_name[n] for n in a.models] if a.models else models
    print(f"autotp from {os.path.dirname(autotp.__file__)}; torch {torch.__version__}")
    rows, wides = [], []
    for m in chosen:
        for tp in a.tp:
            row = measure_model(m, tp, not a.no_sim, a.verbose)
            print(row_text(row))
            if a.verbose:
                for b in row.get("blocks", []):
                    if b["above"]:
                        print(f"    -- {b['block']} ({b['fwd']},{b['bwd']}) vs {b['megatron']}")
                        for d in b["detail"]:
                            print("       ", d)
                for r in row.get("large_replicated", []):
                    if r["in_layer"]:
                        print(f"    whole: {r['name']} {r['shape']} <- {r['readers']}")
            if a.explain and tp == a.tp[0]:
                whole = [r["name"] for r in row.get("large_replicated", []) if r["in_layer"]]
                if whole:
                    try:
                        row["explain"] = explain(m, tp, whole)
                    except Exception as exc:  # noqa: BLE001
                        row["explain"] = {"error": [f"{type(exc).__name__}: {exc}"[:300]]}
                    for name, lines in row["explain"].items():
                        for line in lines:
                            print(f"    explain {name}: {line}")
            sys.stdout.flush()
            rows.append(row)
        if not a.no_wide:
            w = wide_plan(m)
            w["codebase"], w["version"] = m.dist, version(m.dist)
            print(wide_text(w))
            if a.verbose:
                for r in w.get("detail", []):
                    print(f"    whole: {r['name']} {r['shape']} <- {r['readers']}")
            sys.stdout.flush()
            wides.append(w)

    print()
    print(markdown_table(summary_columns(wides), rows))
    s = summary(rows, wides)
    print(f"\nexact {s['exact_pct']}% of simulated rows; at bound {s['at_bound_pct']}%; "
          f"{len(s['crashes'])} crash(es), {len(s['refusals'])} refusal(s), "
          f"{len(s['mismatch'])} mismatch(es)")
    for key, label in (("crashes", "crash"), ("refusals", "refused"), ("mismatch", "mismatch"),
                       ("build_errors", "build error")):
        for line in s[key]:
            print(f"  {label}: {line}")
    if a.json:
        write_json(a.json, {
            "autotp": os.path.dirname(autotp.__file__), "torch": torch.__version__,
            "models": [{"name": m.name, "codebase": m.dist, "version": version(m.dist),
                        "kind": m.kind} for m in chosen],
            "rows": rows, "wide": wides, "summary": s})
    return 0


if __name__ == "__main__":  # run benchmarks.unseen, the module unseen_more imports, not a copy
    from benchmarks import unseen

    sys.exit(unseen.main())
