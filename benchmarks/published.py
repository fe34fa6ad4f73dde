"""Plans at published shapes: the transformers families at the sizes people train, on meta.

    python -m benchmarks.published                     # the table
    python -m benchmarks.published --only Gemma-2-2B,Falcon-40B --json rows.json

Small configs hide what real shapes show (a head_dim that is not hidden / heads, a grouped
fused qkv, more k/v heads than tp, a vocabulary tp does not divide). Each row builds the
model from its published config on the meta device with 2 layers (planning needs no weights)
and plans it at tp 8, or tp 4 where the heads forbid 8. Per layer it prints:

- collectives (fwd, bwd): the plan's collectives in one transformer layer, each way;
- bytes: what they carry, as a multiple of Megatron's two all-reduces of B x T x h each way
  (the bytes of the whole tensor each collective reduces or gathers, at the model's dtype);
- largest replicated: the largest matrix the plan keeps whole, and whether it is above
  h x h/2 (the judged limit);
- fallbacks: the plan's fallbacks list (ops computed replicated, matrices left whole).

A row is "at bound" (``autotp.presentation.report.within_bound``) with at most 4 collectives
each way per layer, bytes within 1.01x Megatron's, no matrix above h x h/2 replicated and no
fallback; otherwise "ABOVE", or "refused: <the error>".
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from benchmarks.harness import Column, Stopwatch, markdown_table, write_json


BATCH, SEQ = 1, 4096  # the bytes ratio does not depend on them; the plan is priced here


@dataclass(frozen=True)
class Shape:
    model_type: str
    fields: dict[str, Any]
    heads: int
    tp: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


SHAPES: dict[str, Shape] = {
    "LLaMA-3-8B": Shape("llama", dict(hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      vocab_size=128256), 32),
    "Mistral-7B": Shape("mistral", dict(hidden_size=4096, intermediate_size=14336,
                                        num_attention_heads=32, num_key_value_heads=8,
                                        vocab_size=32000, sliding_window=4096), 32),
    "Qwen2.5-7B": Shape("qwen2", dict(hidden_size=3584, intermediate_size=18944,
                                      num_attention_heads=28, num_key_value_heads=4,
                                      vocab_size=152064), 28, tp=4),
    "Gemma-2-2B": Shape("gemma2", dict(hidden_size=2304, intermediate_size=9216,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       head_dim=256, vocab_size=256000,
                                       query_pre_attn_scalar=256, sliding_window=4096), 8),
    "Gemma-3-12B": Shape("gemma3_text", dict(hidden_size=3840, intermediate_size=15360,
                                             num_attention_heads=16, num_key_value_heads=8,
                                             head_dim=256, vocab_size=262208,
                                             query_pre_attn_scalar=256,
                                             sliding_window=1024), 16),
    "OLMo-2-7B": Shape("olmo2", dict(hidden_size=4096, intermediate_size=11008,
                                     num_attention_heads=32, num_key_value_heads=32,
                                     vocab_size=100352), 32),
    "Phi-3-mini": Shape("phi3", dict(hidden_size=3072, intermediate_size=8192,
                                     num_attention_heads=32, num_key_value_heads=32,
                                     vocab_size=32064), 32),
    "Falcon-40B": Shape("falcon", dict(hidden_size=8192, num_attention_heads=128,
                                       num_kv_heads=8, new_decoder_architecture=True,
                                       parallel_attn=True, bias=False, vocab_size=65024,
                                       ffn_hidden_size=32768), 128),
    "GPT-NeoX-20B": Shape("gpt_neox", dict(hidden_size=6144, intermediate_size=24576,
                                           num_attention_heads=64, vocab_size=50432), 64),
    "StarCoder2-7B": Shape("starcoder2", dict(hidden_size=4608, intermediate_size=18432,
                                              num_attention_heads=36, num_key_value_heads=4,
                                              vocab_size=49152), 36, tp=4),
    "Mixtral-8x7B": Shape("mixtral", dict(hidden_size=4096, intermediate_size=14336,
                                          num_attention_heads=32, num_key_value_heads=8,
                                          num_local_experts=8, num_experts_per_tok=2,
                                          vocab_size=32000), 32),
    "Qwen3-8B": Shape("qwen3", dict(hidden_size=4096, intermediate_size=12288,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    vocab_size=151936), 32),
    "BLOOM-7B": Shape("bloom", dict(hidden_size=4096, n_head=32, vocab_size=250880), 32),
    "Qwen3-30B-A3B": Shape("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144,
                                             num_attention_heads=32, num_key_value_heads=4,
                                             num_experts=128,
                                             num_experts_per_tok=8, moe_intermediate_size=768,
                                             vocab_size=151936), 32),
    # layer 0 dense (as the first three of the published 61), layer 1 a MoE layer
    "DeepSeek-V3": Shape("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432,
                                             num_attention_heads=128, num_key_value_heads=128,
                                             q_lora_rank=1536, kv_lora_rank=512,
                                             qk_rope_head_dim=64, qk_nope_head_dim=128,
                                             v_head_dim=128, n_routed_experts=256,
                                             n_shared_experts=1, moe_intermediate_size=2048,
                                             num_experts_per_tok=8, n_group=8, topk_group=4,
                                             first_k_dense_replace=1, vocab_size=129280), 128),
}
LAYERS = {"bloom": "n_layer"}  # the config field for the depth, where it is not the usual one


@dataclass
class Row:
    name: str
    tp: int
    status: str
    counts: list[tuple[int, int]] = field(default_factory=list)
    ratios: list[tuple[float, float]] = field(default_factory=list)
    largest: str = "-"
    fallbacks: int = 0
    seconds: float = 0.0


def plan_row(name: str, shape: Shape) -> Row:
    import autotp
    from autotp.capture.named_models import load_model
    from autotp.presentation.report import SEQUENCE_PARALLEL_BOUND, evaluate_bytes, within_bound

    fields = {**shape.fields, LAYERS.get(shape.model_type, "num_hidden_layers"): 2}
    clock = Stopwatch()
    try:
        loaded = load_model(f"hf:{shape.model_type}", fields, meta=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autotp.plan(loaded.model, shape.tp, strict=False)
    except autotp.AutotpError as exc:
        first = str(exc).splitlines()[0]
        return Row(name, shape.tp, f"refused: {first[:110]}",
                   seconds=clock.seconds)
    hidden = shape.fields["hidden_size"]
    itemsize = 4  # meta models are built in float32; Megatron's bytes at the same dtype
    megatron = 2 * BATCH * SEQ * hidden * itemsize
    per: dict[int, dict[str, list[int]]] = {}
    for c in plan.collectives:
        if c.layer is None or c.layer < 0:
            continue
        per.setdefault(c.layer, {"forward": [], "backward": []})[c.phase].append(
            evaluate_bytes(c.bytes_expr, BATCH, SEQ))
    row = Row(name, shape.tp, "", seconds=clock.seconds)
    for layer in sorted(per):
        fwd, bwd = per[layer]["forward"], per[layer]["backward"]
        row.counts.append((len(fwd), len(bwd)))
        row.ratios.append((sum(fwd) / megatron, sum(bwd) / megatron))
    replicated = [(p.global_shape, n) for n, p in plan.params.items()
                  if len(p.global_shape) == 2 and p.layout.startswith("R")]
    big = [s for s, _ in replicated if min(s) > hidden // 2 and max(s) >= hidden]
    if replicated:
        shape_, param = max(replicated, key=lambda x: x[0][0] * x[0][1])
        row.largest = f"{shape_[0]}x{shape_[1]} ({param.split('.')[-2]})"
    row.fallbacks = len(plan.fallbacks)
    # counts against sequence parallelism's bound: a joined statistic (OLMo-2's q and k
    # norms) is a third collective of a layer at Megatron's bytes
    limit = SEQUENCE_PARALLEL_BOUND
    at_bound = (all(within_bound(f, rf, limit["forward"]) and
                    within_bound(b, rb, limit["backward"])
                    for (f, b), (rf, rb) in zip(row.counts, row.ratios))
                and not big and not row.fallbacks and row.counts)
    row.status = "at bound" if at_bound else "ABOVE"
    return row


def _distinct(values: list[Any], fmt: str) -> str:
    seen: list[Any] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return " ".join(fmt.format(*v) for v in seen) or "-"


COLUMNS = [
    Column("model", 0, "name"), Column("tp", 0, "tp"), Column("status", 0, "status"),
    Column("collectives (fwd, bwd)", 0, cell=lambda r: _distinct(r["counts"], "({}, {})")),
    Column("bytes vs Megatron (fwd, bwd)", 0,
           cell=lambda r: _distinct(r["ratios"], "({:.2f}, {:.2f})")),
    Column("largest replicated", 0, "largest"), Column("fallbacks", 0, "fallbacks"),
]


def table(rows: list[Row]) -> str:
    return markdown_table(COLUMNS, [vars(r) for r in rows])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row names")
    parser.add_argument("--json", metavar="PATH", help="also write the rows there as JSON")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(SHAPES)}")
    rows = []
    for name in names:
        rows.append(plan_row(name, SHAPES[name]))
        r = rows[-1]
        print(f"{r.name}: {r.status} {r.counts[:2]} {r.ratios[:2]} {r.largest} "
              f"({r.seconds:.1f} s)", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        write_json(args.json, [vars(r) for r in rows])
    return 0 if all(r.status == "at bound" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
