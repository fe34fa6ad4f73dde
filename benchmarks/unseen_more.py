"""A second set of codebases for benchmarks/unseen.py: `python -m benchmarks.unseen --set more`
(``--set all``: both sets).

    python -m benchmarks.unseen --set more                      # every model of this set
    python -m benchmarks.unseen --set more swin conformer --tp 2

The models: torchscale (RetNet; an encoder with relative position buckets and sub-LayerNorms
inside attention and FFN; a post-LN DeepNet encoder-decoder), conformer (the Conformer block:
two half FFNs, Shaw relative positions, a convolution module with GLU, depthwise conv and
BatchNorm), st-moe-pytorch (top-2 routed experts with capacity, GShard-style dispatch and
combine einsums), soft-moe-pytorch (soft slots), swin-transformer-pytorch (shifted windows by
torch.roll, a relative position table indexed by a constant, four stages of doubling width),
linformer (keys and values projected along the sequence), g-mlp-pytorch (spatial gating: a
LayerNorm and a token-mixing matrix between the two FFN matrices), FLASH-pytorch (gated
attention units: one shared q/k head, quadratic + linear attention over groups), gateloop-
transformer (complex gated linear recurrence by an associative scan, under checkpoint),
yet-another-retnet (retention with GroupNorm over the heads), tab-transformer-pytorch (FT-
Transformer: per-feature tokens of a table). Nothing else in the project uses them; pyproject's
`sweep` extra pins them (install with --no-deps, as its comment says).

Three rows are a model again with what stops torch.export taken out, to see what autotp
plans behind it: st-moe-static (st-moe's data-dependent one-hot made static and its per-call
``Module.to`` of the experts a no-op, by a patch while it runs), gateloop-nockpt (the package's
option to checkpoint the gate loop off), flash-nocache (rotary-embedding-torch's frequency
cache, a buffer written in forward, off by its own switch).

Small configs as unseen.py's (hidden 64, 2 layers or blocks, 4 heads, vocab 128), weights
perturbed, eval mode; the wide plan at hidden 1024. The two mixture-of-experts codebases ship
layers, not models: their layers sit in a plain pre-norm decoder written here (q/k/v/out
linears, scaled_dot_product_attention), the same for both, so what differs is the codebase's.
"""
from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import unseen  # the harness: `python -m benchmarks.unseen_more` runs its main
from benchmarks.unseen import B, T, Call, Model, on_device, ready, serial, tokens

# ---- torchscale ----------------------------------------------------------------------------------


def torchscale_module(name: str) -> types.ModuleType:
    """``torchscale.architecture.<name>``. torchscale imports fairscale's checkpoint_wrapper and
    wrap (used only with checkpoint_activations / fsdp, off here) and timm's drop_path (used
    only with drop_path_rate > 0, off here); timm needs torchvision, which has no CPU wheel for
    torch 2.13. Stand-ins are put in their place while it is imported, then taken out again
    (others ask whether timm is installed)."""
    full = f"torchscale.architecture.{name}"
    if full in sys.modules:
        return sys.modules[full]
    stubs = {}
    if importlib.util.find_spec("fairscale") is None:
        fs = types.ModuleType("fairscale")
        fs.nn = types.ModuleType("fairscale.nn")  # type: ignore[attr-defined]
        fs.nn.checkpoint_wrapper = fs.nn.wrap = lambda m, *a, **k: m  # type: ignore
        stubs.update({"fairscale": fs, "fairscale.nn": fs.nn})  # type: ignore[attr-defined]
    if importlib.util.find_spec("timm") is None:
        timm = types.ModuleType("timm")
        timm.models = types.ModuleType("timm.models")  # type: ignore[attr-defined]
        timm.models.layers = types.ModuleType("timm.models.layers")  # type: ignore
        timm.models.layers.drop_path = None  # type: ignore[attr-defined]
        stubs.update({"timm": timm, "timm.models": timm.models,  # type: ignore[attr-defined]
                      "timm.models.layers": timm.models.layers})  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        return importlib.import_module(full)
    finally:
        for key in stubs:
            del sys.modules[key]


def ts_retnet(dim, heads, meta=False):
    def build():
        retnet = torchscale_module("retnet")
        config = importlib.import_module("torchscale.architecture.config")
        torch.manual_seed(0)
        # values 2x the width (the paper's), GLU FFN, per-head RMSNorm of the retention
        args = config.RetNetConfig(decoder_embed_dim=dim, decoder_value_embed_dim=2 * dim,
                                   decoder_retention_heads=heads, decoder_ffn_embed_dim=2 * dim,
                                   decoder_layers=2, vocab_size=128)
        with on_device(meta):
            model = retnet.RetNetDecoder(args, embed_tokens=nn.Embedding(128, dim))
        return ready(Call(model, lambda m, x: m(x)[0]), meta)
    return build, tokens(), serial(T)


def ts_encoder(dim, heads, meta=False):
    def build():
        encoder = torchscale_module("encoder")
        config = importlib.import_module("torchscale.architecture.config")
        torch.manual_seed(0)
        # subln (the default): a LayerNorm on the attention's heads before out_proj, and one
        # between fc1 and fc2; T5-style bucketed relative position bias, B*heads folded
        args = config.EncoderConfig(encoder_embed_dim=dim, encoder_attention_heads=heads,
                                    encoder_ffn_embed_dim=4 * dim, encoder_layers=2,
                                    vocab_size=128, rel_pos_buckets=32, max_rel_pos=64)
        with on_device(meta):
            model = encoder.Encoder(args, embed_tokens=nn.Embedding(128, dim))
        return ready(Call(model, lambda m, x: m(x)["encoder_out"]), meta)
    return build, tokens(), serial(T)


T_SRC, T_TGT = 12, 8


def ts_encdec(dim, heads, meta=False):
    def build():
        encdec = torchscale_module("encoder_decoder")
        config = importlib.import_module("torchscale.architecture.config")
        torch.manual_seed(0)
        # DeepNet: post-LN, residuals scaled by alpha; relative position bias on both sides
        args = config.EncoderDecoderConfig(
            encoder_embed_dim=dim, encoder_attention_heads=heads, encoder_ffn_embed_dim=4 * dim,
            encoder_layers=2, decoder_embed_dim=dim, decoder_attention_heads=heads,
            decoder_ffn_embed_dim=4 * dim, decoder_layers=2, vocab_size=128, deepnorm=True,
            rel_pos_buckets=32, max_rel_pos=64)
        with on_device(meta):
            model = encdec.EncoderDecoder(args, encoder_embed_tokens=nn.Embedding(128, dim),
                                          decoder_embed_tokens=nn.Embedding(128, dim))
        return ready(Call(model, lambda m, src, tgt: m(src, tgt)[0]), meta)

    def inputs():
        torch.manual_seed(1)
        return {"src": torch.randint(4, 128, (B, T_SRC)), "tgt": torch.randint(4, 128, (B, T_TGT))}

    def megatron(stack, i):
        if stack.endswith("encoder.layers"):
            return [T_SRC] * 2, [T_SRC] * 2
        # self-attn, cross-attn, FFN; the cross-attention's k/v read the encoder output:
        # Megatron's backward all-reduce of B x T_src x h for them
        return [T_TGT] * 3, [T_TGT] * 3 + [T_SRC]
    return build, inputs, megatron


# ---- conformer -----------------------------------------------------------------------------------

def conformer(dim, heads, meta=False):
    def build():
        Conformer = importlib.import_module("conformer.conformer").Conformer
        torch.manual_seed(0)
        with on_device(meta):
            model = Conformer(dim, depth=2, dim_head=dim // heads, heads=heads,
                              conv_kernel_size=7)
        return ready(Call(model, lambda m, x: m(x)), meta)

    def inputs():  # frames of audio features, already at the model's width
        torch.manual_seed(1)
        return {"x": torch.randn(B, T, dim)}
    # half FFN, attention, convolution module (pointwise conv -> GLU -> depthwise conv ->
    # BatchNorm -> pointwise conv), half FFN: four all-reduces each way
    return build, inputs, lambda s, i: ([T] * 4, [T] * 4)


# ---- mixture-of-experts layers in a plain decoder ------------------------------------------------

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k,
                                                                               self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class MoEBlock(nn.Module):
    def __init__(self, dim, heads, moe, residual):
        super().__init__()
        self.norm, self.attn, self.moe, self.residual = nn.LayerNorm(dim), \
            Attention(dim, heads), moe, residual

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        out = self.moe(x)
        out = out[0] if isinstance(out, tuple) else out
        return out if self.residual else x + out  # residual: the layer adds its own


class MoEDecoder(nn.Module):
    def __init__(self, dim, heads, moe, residual=False, depth=2, vocab=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([MoEBlock(dim, heads, moe(), residual) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def static_one_hot(indexes, max_length):
    """st-moe's ``safe_one_hot`` without its data-dependent class count (``indexes.max() + 2``
    classes when that is more than ``max_length``, a Python ``max`` of a tensor that
    torch.export refuses: the st-moe row): an index past ``max_length`` clamped to it, whose
    class is cut off the same way, so the same zero row."""
    return F.one_hot(indexes.clamp(max=max_length), max_length + 1)[..., :max_length]


def st_moe(dim, heads, meta=False, static=False):
    def call(model, x):
        """static: while the model runs, st-moe's one-hot made static, and its Experts'
        ``all_experts_to_cpu_besides`` (each forward moves the experts in use to their device
        and the rest to cpu: ``Module.to`` inside forward, which torch.export can't trace) a
        no-op: one process, every expert where it is."""
        if not static:
            return model(x)
        st = sys.modules["st_moe_pytorch.st_moe_pytorch"]
        saved = st.safe_one_hot, st.Experts.all_experts_to_cpu_besides
        st.safe_one_hot = static_one_hot
        st.Experts.all_experts_to_cpu_besides = lambda self, selection: None
        try:
            return model(x)
        finally:
            st.safe_one_hot, st.Experts.all_experts_to_cpu_besides = saved

    def build():
        st = importlib.import_module("st_moe_pytorch.st_moe_pytorch")
        torch.manual_seed(0)

        def moe():
            # 4 experts (GEGLU, hidden 2*dim), top-2; a second-expert threshold of ~0 routes
            # every token's second choice (the package draws a random number against it,
            # in eval too); capacity 8 of the 16 tokens per expert
            return st.SparseMoEBlock(st.MoE(dim, num_experts=4, expert_hidden_mult=3,
                                            gating_top_n=2, threshold_eval=1e-9,
                                            capacity_factor_eval=2.0, is_distributed=False),
                                     add_ff_before=False, add_ff_after=False)
        with on_device(meta):
            model = MoEDecoder(dim, heads, moe, residual=True)
        return ready(Call(model, call), meta)
    # attention, experts (each column / row parallel, summed by the combine einsum): one each
    return build, tokens(), serial(T)


def soft_moe(dim, heads, meta=False):
    def build():
        SoftMoE = importlib.import_module("soft_moe_pytorch.soft_moe").SoftMoE
        torch.manual_seed(0)
        with on_device(meta):
            model = MoEDecoder(dim, heads, lambda: SoftMoE(
                dim, seq_len=T, num_experts=4, is_distributed=False,
                offload_unused_experts_to_cpu=False))
        return ready(Call(model, lambda m, x: m(x)), meta)
    # 4 experts x 4 slots, each slot a softmax mix of all tokens; one all-reduce each
    return build, tokens(), serial(T)


# ---- swin-transformer-pytorch --------------------------------------------------------------------

SWIN_IMG, SWIN_DOWN, SWIN_WINDOW = 16, (2, 2, 1, 1), 2
SWIN_TOKENS = (64, 16, 16, 16)  # the stages' grids: 8x8, then 4x4


def swin(dim, heads, meta=False):
    def build():
        SwinTransformer = importlib.import_module(
            "swin_transformer_pytorch.swin_transformer").SwinTransformer
        torch.manual_seed(0)
        with on_device(meta):
            # 4 stages of widths dim x (1, 2, 4, 8), heads doubling with them
            model = SwinTransformer(hidden_dim=dim, layers=(2, 2, 2, 2),
                                    heads=(heads, 2 * heads, 4 * heads, 8 * heads),
                                    head_dim=dim // heads, window_size=SWIN_WINDOW,
                                    downscaling_factors=SWIN_DOWN, num_classes=8)
        return ready(Call(model, lambda m, img: m(img)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"img": torch.randn(B, 3, SWIN_IMG, SWIN_IMG)}

    def megatron(stack, i):
        # stage k (1-based): width 2^(k-1) x h over its grid; a block of the stage's list is a
        # regular and a shifted Swin block: two attentions and two MLPs
        k = int(stack.split("stage")[-1].split(".")[0])
        t = SWIN_TOKENS[k - 1] * 2 ** (k - 1)
        return [t] * 4, [t] * 4
    return build, inputs, megatron


# ---- linformer -----------------------------------------------------------------------------------

def linformer(dim, heads, meta=False):
    def build():
        LinformerLM = importlib.import_module("linformer.linformer").LinformerLM
        torch.manual_seed(0)
        with on_device(meta):
            model = LinformerLM(num_tokens=128, dim=dim, seq_len=T, depth=2, k=8, heads=heads,
                                dim_head=dim // heads)
        return ready(Call(model, lambda m, x: m(x)), meta)
    return build, tokens(), serial(T)


# ---- g-mlp-pytorch -------------------------------------------------------------------------------

def gmlp(dim, heads, meta=False):
    def build():
        gMLP = importlib.import_module("g_mlp_pytorch.g_mlp_pytorch").gMLP
        torch.manual_seed(0)
        with on_device(meta):
            model = gMLP(num_tokens=128, dim=dim, depth=2, seq_len=T, heads=heads, ff_mult=4,
                         causal=True)
        return ready(Call(model, lambda m, x: m(x)), meta)
    # proj_in (column parallel, its output split in res | gate), the spatial gating unit
    # (LayerNorm of the gate, a per-head token-mixing matrix), proj_out: one MLP
    return build, tokens(), lambda s, i: ([T], [T])


# ---- FLASH-pytorch -------------------------------------------------------------------------------

def flash(dim, heads, meta=False, cache=True):
    def build():
        FLASHTransformer = importlib.import_module("flash_pytorch.flash_pytorch").FLASHTransformer
        torch.manual_seed(0)
        with on_device(meta):
            model = FLASHTransformer(dim=dim, num_tokens=128, depth=2, group_size=8,
                                     query_key_dim=dim // 4, causal=True)
        if not cache:  # rotary-embedding-torch's own switch (FLASH's constructor doesn't pass it)
            model.layers[0].rotary_pos_emb.cache_if_possible = False
        return ready(Call(model, lambda m, x: m(x)), meta)
    # one gated attention unit per layer: v and gate column parallel, the shared q/k (dim/4
    # wide, whole in Megatron too), to_out row parallel: one all-reduce each way
    return build, tokens(), lambda s, i: ([T], [T])


# ---- gateloop-transformer ------------------------------------------------------------------------

def gateloop(dim, heads, meta=False, checkpoint=True):
    def build():
        Transformer = importlib.import_module("gateloop_transformer.gateloop_transformer"
                                              ).Transformer
        torch.manual_seed(0)
        with on_device(meta):
            model = Transformer(dim, num_tokens=128, depth=2, gate_loop_heads=heads,
                                checkpoint_gate_looped_attn=checkpoint)
        return ready(Call(model, lambda m, x: m(x)), meta)
    # gate-looped attention (q/k/v per head, a complex state transition per head) and FFN
    return build, tokens(), serial(T)


# ---- yet-another-retnet --------------------------------------------------------------------------

def yar_retnet(dim, heads, meta=False):
    def build():
        RetNet = importlib.import_module("yet_another_retnet.retnet").RetNet
        torch.manual_seed(0)
        with on_device(meta):
            model = RetNet(num_tokens=128, d_model=dim, nhead=heads, num_layers=2, dropout=0.0,
                           dim_feedforward=4 * dim)
        return ready(Call(model, lambda m, x: m.forward_parallel(x)), meta)
    return build, tokens(), serial(T)


# ---- tab-transformer-pytorch ---------------------------------------------------------------------

CATEGORIES, N_CONT = (10, 5, 6, 5, 8), 3
T_TAB = len(CATEGORIES) + N_CONT + 1  # one token per column, and a cls token


def ft_transformer(dim, heads, meta=False):
    def build():
        FTTransformer = importlib.import_module("tab_transformer_pytorch.ft_transformer"
                                                ).FTTransformer
        torch.manual_seed(0)
        with on_device(meta):
            model = FTTransformer(categories=CATEGORIES, num_continuous=N_CONT, dim=dim, depth=2,
                                  heads=heads, dim_head=dim // heads, dim_out=4,
                                  num_residual_streams=1)
        return ready(Call(model, lambda m, categ, numer: m(categ, numer)), meta)

    def inputs():
        torch.manual_seed(1)
        return {"categ": torch.stack([torch.randint(0, c, (B,)) for c in CATEGORIES], -1),
                "numer": torch.randn(B, N_CONT)}
    return build, inputs, serial(T_TAB)


# ---- registry ------------------------------------------------------------------------------------

MODELS = [
    Model("ts-retnet", "torchscale", "RetNet: multi-scale retention (decay mask, theta shift, "
          "per-head RMSNorm, swish gate), GLU FFN", ts_retnet),
    Model("ts-encoder", "torchscale", "encoder: sub-LayerNorms inside attention and FFN, "
          "bucketed relative position bias", ts_encoder),
    Model("ts-encdec", "torchscale", "DeepNet encoder-decoder: post-LN, scaled residuals, "
          "cross-attention, relative positions", ts_encdec),
    Model("conformer", "conformer", "Conformer: half FFNs, Shaw relative positions, conv module "
          "(GLU, depthwise conv, BatchNorm)", conformer),
    Model("st-moe", "st-moe-pytorch", "top-2 routed experts with capacity, GShard dispatch / "
          "combine einsums", st_moe),
    Model("st-moe-static", "st-moe-pytorch", "st-moe with its one-hot's data-dependent class "
          "count made static (the harness's patch)", lambda d, h, meta=False: st_moe(d, h, meta,
                                                                                  static=True)),
    Model("soft-moe", "soft-moe-pytorch", "soft MoE: slots as softmax mixes of the tokens",
          soft_moe),
    Model("swin", "swin-transformer-pytorch", "Swin: window attention, torch.roll shifts, "
          "relative position table, stages of doubling width", swin),
    Model("linformer", "linformer", "Linformer: keys and values projected along the sequence",
          linformer),
    Model("gmlp", "g-mlp-pytorch", "gMLP: spatial gating unit (LayerNorm, token mixing) between "
          "the FFN matrices", gmlp),
    Model("flash", "FLASH-pytorch", "FLASH: gated attention units, shared q/k, quadratic + "
          "linear attention over groups", flash),
    Model("flash-nocache", "FLASH-pytorch", "FLASH without the rotary embedding's frequency "
          "cache (written into a buffer in forward)", lambda d, h, meta=False: flash(
              d, h, meta, cache=False)),
    Model("gateloop", "gateloop-transformer", "GateLoop: complex gated linear recurrence "
          "(associative scan, checkpointed)", gateloop),
    Model("gateloop-nockpt", "gateloop-transformer", "GateLoop without its activation "
          "checkpointing (the option's off)", lambda d, h, meta=False: gateloop(
              d, h, meta, checkpoint=False)),
    Model("yar-retnet", "yet-another-retnet", "RetNet: retention with GroupNorm over the heads",
          yar_retnet),
    Model("ft-transformer", "tab-transformer-pytorch", "FT-Transformer: a token per table "
          "column, cls token", ft_transformer, wide_meta=False),
]


if __name__ == "__main__":
    sys.exit(unseen.main(["--set", "more", *sys.argv[1:]]))
