"""Which transformers families autotp runs exactly, and at which cost: docs/coverage.md's table.

    python -m benchmarks.family_coverage               # print the table (tp 2 and 4)
    python -m benchmarks.family_coverage --record      # and write benchmarks/family_coverage.json
    python -m benchmarks.family_coverage --write-docs  # docs/coverage.md's table, from the record
    python -m benchmarks.family_coverage --families Mixtral,T5 --tp 2 --json rows.json

Each family is a small model from its transformers config (hidden 64, 2 layers, 8 heads,
vocabulary 128), every weight perturbed (biases and norm scales too), run unsharded and in
simulation at each tp on the same weights and inputs: logits (every floating output), a loss
over them, and every gradient. A row says "exact" (within the tolerances below), "exact, N
replicated" (exact, with matrices left replicated: the plan's fallbacks), "refused" (an
AutotpError naming what to change), "MISMATCH", or "CRASH: <type>: <message>" (any other
exception, in the reference run, the plan or the simulation).

The other columns are per transformer layer: the collectives rank 0 executed in one forward
and backward, from its communicator's log, in the layers other than None (embeddings, head,
the bucketed gradient sum) and -1; an encoder's layers and a decoder's are told apart by
the module list the plan records for each collective. Every distinct value over the layers
is listed, and where the tps differ, each tp's in tp order ("a / b"):

- collectives (fwd, bwd): how many ran in the forward and the backward of a layer.
- bytes (fwd, bwd): the bytes those collectives carried, as a multiple of Megatron's two
  all-reduces of B x T x h (2*B*T*h elements at the model's dtype; B, T: the example's batch
  and tokens, h: the hidden size). Each collective counts the bytes of the whole tensor the
  log records for it: the tensor reduced (all-reduce, reduce-scatter) or the tensor gathered
  (all-gather), whatever the tp and however the backend moves it.
- largest replicated: the largest 2-D parameter whose plan layout is replicated (an
  embedding too), as rows x columns.
- fallbacks: how many entries the plan's fallbacks list has.
- experts: how the stacked expert weights of a mixture of experts are held (``plan.experts``):
  whole (sharded along the experts), sliced (tensor parallel inside every expert),
  replicated; "-" for a model without grouped experts.
- at a published shape: the family at a size people train (``PUBLISHED``: the shapes of
  benchmarks/published.py, planned on meta with 2 layers at tp 8, or 4 where the heads
  forbid 8): at bound or ABOVE (at most 4 collectives each way, within 1.05x Megatron's
  bytes, no matrix above h x h/2 replicated, no fallback), the collectives and bytes per
  layer, the largest matrix kept whole. ``--no-published`` leaves it out.

The record, benchmarks/family_coverage.json (schema ``autotp.coverage/1``), holds every row of a
run with the numbers behind it, and the published shapes' rows; docs/coverage.md's table is
its rendering (``--write-docs``), and tests/test_coverage.py reruns families at tp = 2 and
checks each against its recorded row: the same plan (``planned``) and still exact.

    {"schema": "autotp.coverage/1", "tps": [int],
     "rows": [{"family": str, "tp": int, "model": str, "status": str, "detail": str,
               "fallbacks": int, "largest_replicated": [int, int] | null,
               "largest_replicated_param": str | null, "experts": str,
               "per_layer": [[fwd, bwd]], "bytes_ratio": [[fwd, bwd]], "megatron_bytes": int,
               "layers": {"model.layers.0": {"forward": int, "backward": int, ...}},
               "output_diff": float, "loss_diff": float, "grad_rel": float,
               "worst_param": str}],  # a refused or crashed row stops at what it reached
     "published": {family: {"name": str, "tp": int, "status": str, "counts": [[fwd, bwd]],
                            "ratios": [[fwd, bwd]], "largest": str, "fallbacks": int}}}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from benchmarks.harness import Stopwatch, jsonable, ratio_text, write_json

ROOT = Path(__file__).resolve().parent.parent

ATOL = 1e-4  # logits and loss, max abs; gradients relative (autotp.verification.verify.compare)
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
RECORD = ROOT / "benchmarks" / "family_coverage.json"
SCHEMA = "autotp.coverage/1"
# What a row measures rather than plans: it moves from run to run (rounding, the clock).
MEASURED = frozenset({"output_diff", "loss_diff", "grad_rel", "worst_param", "seconds"})
VOCAB = 128
BATCH, TOKENS = 2, 12
IMAGE, PATCH = 32, 8  # ViT: (32/8)^2 = 16 patches and the class token
TIMEOUT = 60.0  # seconds a simulated rank waits at a collective before the row says CRASH


def _tf() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _small(**extra: Any) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "max_position_embeddings": 64, **extra}


def _decoder(cls: str, config: str, **fields: Any) -> Callable[[], Any]:
    def build() -> Any:
        tf = _tf()
        return getattr(tf, cls)(getattr(tf, config)(**fields))
    build.__name__ = cls
    return build


def _ids(seed: int = 3, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randint(2, VOCAB, (BATCH, tokens), generator=torch.Generator().manual_seed(seed))


def text() -> dict[str, Any]:
    return {"input_ids": _ids()}


def seq2seq() -> dict[str, Any]:
    """Encoder and decoder inputs of the same length, so that one T sizes both."""
    return {"input_ids": _ids(), "decoder_input_ids": _ids(seed=4)}


def image() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator)}


@dataclass(frozen=True)
class Family:
    build: Callable[[], Any]
    inputs: Callable[[], dict[str, Any]] = text  # the example kwargs (fresh tensors each call)
    tokens: tuple[int, int] = (BATCH, TOKENS)  # B and T of those inputs, for the bytes column

    def model(self) -> torch.nn.Module:
        """Built from seed 0, every weight perturbed (0.05, seed 1), in eval mode: the same in
        every process."""
        from autotp.verification.verify import perturb

        torch.manual_seed(0)
        return perturb(self.build(), seed=1, std=0.05).eval()


def _family(cls: str, config: str, inputs: Callable[[], dict[str, Any]] = text,
            tokens: tuple[int, int] = (BATCH, TOKENS), **fields: Any) -> Family:
    return Family(_decoder(cls, config, **fields), inputs, tokens)


LLAMA_LIKE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=8, num_key_value_heads=4, **_small())
FAMILIES: dict[str, Family] = {
    "GPT-2": _family("GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=64, n_head=8,
                     vocab_size=VOCAB, n_positions=64),
    "LLaMA (GQA)": _family("LlamaForCausalLM", "LlamaConfig", **{**LLAMA_LIKE,
                                                                "num_key_value_heads": 2}),
    "Mistral": _family("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE),
    "Qwen2": _family("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE),
    "Gemma": _family("GemmaForCausalLM", "GemmaConfig", head_dim=8, **LLAMA_LIKE),
    "Starcoder2": _family("Starcoder2ForCausalLM", "Starcoder2Config", **LLAMA_LIKE),
    "GPT-NeoX": _family("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2,
                        hidden_size=64, intermediate_size=128, num_attention_heads=8,
                        **_small()),
    "OPT": _family("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=64,
                   ffn_dim=128, num_attention_heads=8, word_embed_proj_dim=64, **_small()),
    "Phi": _family("PhiForCausalLM", "PhiConfig", num_hidden_layers=2, hidden_size=64,
                   intermediate_size=128, num_attention_heads=8, **_small()),
    "GPT-J": _family("GPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=64, n_head=8,
                     rotary_dim=4, vocab_size=VOCAB, n_positions=64),
    "Bloom": _family("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=64, n_head=8,
                     vocab_size=VOCAB),
    "BERT": _family("BertModel", "BertConfig", num_hidden_layers=2, hidden_size=64,
                    intermediate_size=128, num_attention_heads=8, **_small()),
    "RoBERTa": _family("RobertaModel", "RobertaConfig", num_hidden_layers=2, hidden_size=64,
                       intermediate_size=128, num_attention_heads=8, pad_token_id=1,
                       **{**_small(), "max_position_embeddings": 70}),
    "DistilBERT": _family("DistilBertModel", "DistilBertConfig", n_layers=2, dim=64,
                          hidden_dim=128, n_heads=8, **_small()),
    "LLaMA sequence classification": _family("LlamaForSequenceClassification", "LlamaConfig",
                                             num_labels=4, pad_token_id=0, **LLAMA_LIKE),
    "BERT token classification": _family("BertForTokenClassification", "BertConfig",
                                         num_hidden_layers=2, hidden_size=64, num_labels=4,
                                         intermediate_size=128, num_attention_heads=8,
                                         **_small()),
    "Phi-3 (GQA, fused qkv)": _family("Phi3ForCausalLM", "Phi3Config", pad_token_id=0,
                                      **LLAMA_LIKE),
    "GPTBigCode (multi-query)": _family("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                                        n_layer=2, n_embd=64, n_head=8, multi_query=True,
                                        vocab_size=VOCAB, n_positions=64),
    "Falcon": _family("FalconForCausalLM", "FalconConfig", num_hidden_layers=2,
                      hidden_size=64, num_attention_heads=8, vocab_size=VOCAB),
    "Falcon (grouped k/v)": _family("FalconForCausalLM", "FalconConfig", num_hidden_layers=2,
                                    hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                                    new_decoder_architecture=True, vocab_size=VOCAB),
    # ---- dense decoders --------------------------------------------------------------------
    "Qwen3": _family("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, **LLAMA_LIKE),
    "OLMo2": _family("Olmo2ForCausalLM", "Olmo2Config", **LLAMA_LIKE),
    "Gemma3": _family("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=8, sliding_window=16,
                      **LLAMA_LIKE),
    "Granite": _family("GraniteForCausalLM", "GraniteConfig", **LLAMA_LIKE),
    "StableLM": _family("StableLmForCausalLM", "StableLmConfig", **LLAMA_LIKE),
    "Cohere": _family("CohereForCausalLM", "CohereConfig", **LLAMA_LIKE),
    # ---- mixtures of experts ---------------------------------------------------------------
    "Mixtral (MoE)": _family("MixtralForCausalLM", "MixtralConfig", num_local_experts=4,
                             num_experts_per_tok=2, **LLAMA_LIKE),
    "Qwen2-MoE (shared expert)": _family("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128, **LLAMA_LIKE),
    "Qwen3-MoE": _family("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, **LLAMA_LIKE),
    "OLMoE": _family("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
                     **LLAMA_LIKE),
    "DeepSeek-V3 (MLA, MoE)": _family(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        **{**LLAMA_LIKE, "num_key_value_heads": 8}, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=32),
    # ---- encoder-decoder, vision -----------------------------------------------------------
    "T5 (encoder-decoder)": _family("T5ForConditionalGeneration", "T5Config", seq2seq,
                                    num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128,
                                    d_kv=8, num_heads=8, vocab_size=VOCAB),
    "ViT": _family("ViTModel", "ViTConfig", image, (BATCH, (IMAGE // PATCH) ** 2 + 1),
                   num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=8, image_size=IMAGE, patch_size=PATCH),
}


def status_word(status: str) -> str:
    """The first word of a status cell: exact / exact, / refused / MISMATCH / CRASH."""
    return re.split(r"[ (:]", status.strip(), maxsplit=1)[0]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _crash(exc: BaseException) -> str:
    return f"CRASH: {type(exc).__name__}: {_first_line(exc)}"


def hidden_size(model: torch.nn.Module) -> int:
    config = model.config
    for name in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"no hidden size in {type(config).__name__}")


def largest_replicated(plan: Any) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """The largest 2-D parameter the plan keeps replicated (shape, name); (None, None): none."""
    best: tuple[int, Optional[tuple[int, ...]], Optional[str]] = (0, None, None)
    for name, param in plan.params.items():
        shape = tuple(param.global_shape)
        if len(shape) == 2 and param.layout.startswith("R") and shape[0] * shape[1] > best[0]:
            best = (shape[0] * shape[1], shape, name)
    return best[1], best[2]


def _stack(module: Optional[str]) -> str:
    """``encoder.block`` of ``encoder.block.0.layer.1.DenseReluDense.wo``: the module list
    the layer index counts in ("" where the path has no index)."""
    match = re.match(r"(.*?)\.\d+(?:\.|$)", module or "")
    return match.group(1) if match else ""


def layer_traffic(log: Any, plan: Any, unit: float) -> dict[tuple[str, int], dict[str, Any]]:
    """Per layer, (module list, index), of the layers not None nor -1: the collectives and
    the bytes / ``unit`` executed, per phase. The log numbers the layers of each module list
    from 0 (an encoder's and a decoder's layer 0 are both 0); the plan's record of each
    collective (the value it moves, labelled in the log) tells which list it serves."""
    stacks: dict[tuple[str, str, str, Optional[int]], str] = {}
    by_index: dict[Optional[int], set[str]] = {}
    for c in plan.collectives:
        stacks.setdefault((c.members[0], c.phase, c.kind, c.layer), _stack(c.module))
        if _stack(c.module):
            by_index.setdefault(c.layer, set()).add(_stack(c.module))
    for (node, phase, kind, layer), stack in stacks.items():  # no module (a weight's gather):
        if not stack and len(by_index.get(layer, ())) == 1:  # the one list of that index
            stacks[(node, phase, kind, layer)] = next(iter(by_index[layer]))
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for event in log.events:
        if event.layer is None or event.layer == -1:
            continue
        # a join's log label and plan record both start with its first value
        value = event.label.removeprefix("joined: ").split(" ")[0]
        key = (stacks.get((value, event.phase, event.kind, event.layer), ""), event.layer)
        entry = table.setdefault(key, {"forward": 0, "backward": 0,
                                       "forward_bytes": 0, "backward_bytes": 0})
        entry[event.phase] += 1
        entry[f"{event.phase}_bytes"] += event.nbytes
    for entry in table.values():
        entry["forward_ratio"] = entry["forward_bytes"] / unit
        entry["backward_ratio"] = entry["backward_bytes"] / unit
    return table


@contextlib.contextmanager
def _trace_once() -> Iterator[None]:
    """Inside, autotp traces a model once for all its tps: the plan and the rank programs are
    made from the capture afresh at each tp (the rewriter copies its graph), and torch.export
    is most of a row's time. A traced failure is raised again at the next tp."""
    import autotp.api as api

    original = getattr(api, "capture", None)
    if original is None:  # autotp changed: trace at every tp
        yield
        return
    cache: dict[tuple[int, int], Any] = {}

    def capture(model: Any, example_args: Any = None, example_kwargs: Any = None,
                *rest: Any, **options: Any) -> Any:
        if rest or options:
            return original(model, example_args, example_kwargs, *rest, **options)
        key = (id(model), id(example_kwargs))
        if key not in cache:
            try:
                cache[key] = original(model, example_args, example_kwargs)
            except Exception as exc:  # noqa: BLE001 - raised again, the same, at each tp
                cache[key] = exc
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    api.capture = capture
    try:
        yield
    finally:
        api.capture = original


def check_family(name: str, tps: list[int]) -> list[dict[str, Any]]:
    """One family at each tp of ``tps``: the rows of the table, with the numbers behind them.
    Never raises (but for KeyboardInterrupt): a failure is the row's status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _check_family(name, tps)


def _check_family(name: str, tps: list[int]) -> list[dict[str, Any]]:
    import autotp
    from autotp.verification.check_model import first_float, generic_loss
    from autotp.verification.verify import compare, reference_step, sharded_step

    family = FAMILIES[name]
    rows = [{"family": name, "tp": tp, "model": family.build.__name__, "detail": ""}
            for tp in tps]
    clock = Stopwatch()
    try:  # the model, its example and the unsharded step: the same at every tp
        model = family.model()
        for row in rows:
            row["model"] = type(model).__name__
        kwargs = family.inputs()

        def call(module: torch.nn.Module) -> Any:
            return module(**kwargs)

        reference = reference_step(model, call, generic_loss, first_float)
        dtype = next(model.parameters()).dtype
        batch, tokens = family.tokens
        # Megatron's per-layer traffic each way: two all-reduces of B x T x h
        unit = 2 * batch * tokens * hidden_size(model) * dtype.itemsize
    except Exception as exc:  # noqa: BLE001 - the family itself fails: every tp says so
        for row in rows:
            row.update(status=_crash(exc), detail=_first_line(exc), seconds=0.0)
        return rows
    setup = clock.seconds
    with _trace_once():
        for row in rows:
            clock = Stopwatch()
            _check_tp(row, model, kwargs, call, reference, unit, autotp, compare, sharded_step,
                      generic_loss, first_float)
            row["seconds"] = round(clock.seconds + setup / len(rows), 2)
    return rows


def _check_tp(row: dict[str, Any], model: Any, kwargs: dict[str, Any], call: Any,
              reference: Any, unit: float, autotp: Any, compare: Any, sharded_step: Any,
              loss: Any, pick: Any) -> None:
    tp = row["tp"]
    try:
        sim = autotp.simulate(model, tp, example_kwargs=kwargs, timeout=TIMEOUT)
    except autotp.AutotpError as exc:
        row.update(status="refused", detail=_first_line(exc))
        return
    except Exception as exc:  # noqa: BLE001 - a bug: the row says which
        row.update(status=_crash(exc), detail=_first_line(exc))
        return
    shape, param = largest_replicated(sim.plan)
    fallbacks = len(sim.plan.fallbacks)
    row.update(fallbacks=fallbacks, largest_replicated=list(shape) if shape else None,
               largest_replicated_param=param,
               experts=", ".join(sorted({how for _, how in sim.plan.experts.values()})) or "-")
    try:
        results = sim.run(lambda m: sharded_step(m, call, loss, pick))
        comparisons = [compare(reference, r) for r in results]
    except autotp.AutotpError as exc:
        row.update(status="refused", detail=_first_line(exc))
        return
    except Exception as exc:  # noqa: BLE001
        row.update(status=_crash(exc), detail=_first_line(exc))
        return
    worst = max(comparisons, key=lambda c: c.grad_rel)
    exact = all(c.ok(ATOL, ATOL) for c in comparisons)
    traffic = layer_traffic(sim.ranks[0].comm.log, sim.plan, unit)
    per_layer = sorted({(v["forward"], v["backward"]) for v in traffic.values()})
    ratios = sorted({(round(v["forward_ratio"], 3), round(v["backward_ratio"], 3))
                     for v in traffic.values()})
    status = "MISMATCH" if not exact else \
        (f"exact, {fallbacks} replicated" if fallbacks else "exact")
    row.update(status=status, output_diff=worst.output_diff, loss_diff=worst.loss_diff,
               grad_rel=worst.grad_rel, worst_param=worst.worst_param, per_layer=per_layer,
               bytes_ratio=ratios, megatron_bytes=unit,
               layers={f"{stack}.{index}".lstrip("."): v
                       for (stack, index), v in sorted(traffic.items())})


def check(name: str, tp: int) -> dict[str, Any]:
    """One family at one tp."""
    return check_family(name, [tp])[0]


# ---- the table ------------------------------------------------------------------------------


def _per_tp(values: list[str]) -> str:
    """One value if every tp agrees, else each tp's, in tp order ("-": none, or no plan)."""
    return values[0] if len(set(values)) == 1 else " / ".join(values)


HEADER = ("| family | model | {tps} | collectives / layer (fwd, bwd) | bytes / layer, x Megatron "
          "(fwd, bwd) | largest replicated matrix | fallbacks | experts | at a published shape |")

# Each family's published shape in benchmarks/published.py: planned on meta (2 layers) at
# tp 8, or 4 where the heads forbid 8. Small configs hide what real shapes show.
PUBLISHED = {"LLaMA (GQA)": "LLaMA-3-8B", "Mistral": "Mistral-7B", "Qwen2": "Qwen2.5-7B",
             "Starcoder2": "StarCoder2-7B", "GPT-NeoX": "GPT-NeoX-20B", "Bloom": "BLOOM-7B",
             "Phi-3 (GQA, fused qkv)": "Phi-3-mini", "Falcon (grouped k/v)": "Falcon-40B",
             "Qwen3": "Qwen3-8B", "OLMo2": "OLMo-2-7B", "Gemma3": "Gemma-3-12B",
             "Mixtral (MoE)": "Mixtral-8x7B", "Qwen3-MoE": "Qwen3-30B-A3B",
             "DeepSeek-V3 (MLA, MoE)": "DeepSeek-V3"}


def published_rows(names: list[str]) -> dict[str, dict[str, Any]]:
    """family -> its published shape's row (benchmarks/published.py's ``Row`` as a dict),
    for ``names``."""
    from benchmarks import published

    out = {}
    for family in names:
        if family in PUBLISHED:
            name = PUBLISHED[family]
            row = published.plan_row(name, published.SHAPES[name])
            print(f"{family:32s} {name} at tp {row.tp}: {row.status} ({row.seconds:.1f} s)",
                  flush=True)
            out[family] = dataclasses.asdict(row)
    return out


def published_cell(row: Optional[dict[str, Any]]) -> str:
    if row is None:
        return "-"
    head = f"{row['name']}, tp {row['tp']}: {row['status']}"
    if not row["counts"]:
        return _short(head)
    counts = " ".join(dict.fromkeys(f"({f}, {b})" for f, b in row["counts"]))
    ratios = " ".join(dict.fromkeys(f"({f:.2f}, {b:.2f})" for f, b in row["ratios"]))
    whole = f", {row['largest']} whole" if row["largest"] != "-" else ""
    return f"{head}, {counts}, {ratios} x Megatron{whole}"


def _short(text: str, limit: int = 100) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def table(rows: list[dict[str, Any]], tps: list[int],
          published: Optional[dict[str, dict[str, Any]]] = None) -> str:
    by = {(r["family"], r["tp"]): r for r in rows}
    head = HEADER.format(tps=" | ".join(f"tp = {tp}" for tp in tps))
    lines = [head, "|" + "---|" * (8 + len(tps))]
    published = published or {}
    for family in dict.fromkeys(r["family"] for r in rows):
        cells: list[str] = []
        counts, ratios, largest, fallbacks, experts = [], [], [], [], []
        for i, tp in enumerate(tps):
            r = by[(family, tp)]
            word = status_word(r["status"])
            if word in ("refused", "CRASH"):
                before = by[(family, tps[i - 1])] if i else None
                if before is not None and (before["status"], before["detail"]) == \
                        (r["status"], r["detail"]):
                    cell = f"{word} (as tp = {tps[i - 1]})"  # the same reason: said once
                elif word == "refused":
                    cell = _short(f"refused: {r['detail']}")
                else:
                    cell = _short(r["status"])
            elif "output_diff" in r:
                cell = (f"{r['status']} ({max(r['output_diff'], r['loss_diff']):.0e}, "
                        f"grad {r['grad_rel']:.0e})")
                counts.append(", ".join(str((f, b)) for f, b in r["per_layer"]) or "-")
                pairs = (f"({ratio_text(f, trim=True)}, {ratio_text(b, trim=True)})"
                         for f, b in r["bytes_ratio"])
                ratios.append(", ".join(dict.fromkeys(pairs)) or "-")
            else:
                cell = r["status"]
            if "output_diff" not in r:
                counts.append("-")
                ratios.append("-")
            cells.append(cell)
            shape = r.get("largest_replicated")
            largest.append("×".join(map(str, shape)) if shape else "-")
            fallbacks.append(str(r["fallbacks"]) if "fallbacks" in r else "-")
            experts.append(r.get("experts", "-"))
        lines.append(f"| {family} | {by[(family, tps[0])]['model']} | " + " | ".join(cells) +
                     f" | {_per_tp(counts)} | {_per_tp(ratios)} | {_per_tp(largest)} | "
                     f"{_per_tp(fallbacks)} | {_per_tp(experts)} | "
                     f"{published_cell(published.get(family))} |")
    return "\n".join(lines)


# ---- the record --------------------------------------------------------------------------


def record(rows: list[dict[str, Any]], tps: list[int],
           published: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A run as benchmarks/family_coverage.json holds it: every row and published row, without the
    seconds each took (the machine's, not autotp's)."""
    def drop_seconds(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k != "seconds"}

    return jsonable({"schema": SCHEMA, "tps": tps, "rows": [drop_seconds(r) for r in rows],
                   "published": {f: drop_seconds(r) for f, r in published.items()}})


def read_record(path: Path = RECORD) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("schema") != SCHEMA:
        raise SystemExit(f"{path}: schema {data.get('schema')!r}, not {SCHEMA!r}")
    return data


def planned(row: dict[str, Any]) -> dict[str, Any]:
    """What a row says of the plan and its program: everything but what is ``MEASURED``
    (the status words, the reason of a refusal, the collectives and bytes of each layer, what
    is left replicated, the experts)."""
    return jsonable({k: v for k, v in row.items() if k not in MEASURED})


def render(data: dict[str, Any]) -> str:
    """docs/coverage.md's table of a record."""
    return table(data["rows"], data["tps"], data["published"])


def write_docs(data: dict[str, Any]) -> None:
    path = ROOT / "docs" / "coverage.md"
    page = path.read_text()
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    note = ("\n<!-- generated from benchmarks/family_coverage.json by python "
            "benchmarks/family_coverage.py --write-docs; status: (max abs diff of outputs and "
            "loss, max relative gradient diff); bytes: per layer, over Megatron's two "
            "all-reduces of B x T x h -->\n")
    path.write_text(page[:start] + note + render(data) + "\n" + page[end:])
    print(f"wrote the table of {RECORD.name} into {path}")


def select(spec: Optional[str]) -> list[str]:
    """The families a ``--families`` value names, in FAMILIES order. Names are separated by
    commas (a name with a comma in it, "Phi-3 (GQA, fused qkv)", is read whole); each is a
    whole name or the part before its parenthesis ("Phi-3"), in any case."""
    if not spec:
        return list(FAMILIES)

    def key(text: str) -> str:
        return " ".join(text.lower().split())

    names = {key(n): n for n in FAMILIES}
    names.update({key(n.split(" (")[0]): n for n in FAMILIES if key(n.split(" (")[0]) not in names})
    parts, chosen, i = spec.split(","), set(), 0
    while i < len(parts):
        for j in range(len(parts), i, -1):  # the longest run of parts that is a name
            found = names.get(key(",".join(parts[i:j])))
            if found:
                chosen.add(found)
                i = j
                break
        else:
            raise SystemExit(f"--families: no family {parts[i].strip()!r}; the families: "
                             + "; ".join(FAMILIES))
    return [n for n in FAMILIES if n in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--families", help="comma-separated names (default: all)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the run there, as benchmarks/family_coverage.json "
                             "holds it")
    parser.add_argument("--record", action="store_true",
                        help=f"write the run to {RECORD.relative_to(ROOT)} (every family)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"replace docs/coverage.md's table with {RECORD.relative_to(ROOT)}'s "
                             "(after --record, the new one's); alone, it runs nothing")
    parser.add_argument("--no-published", action="store_true",
                        help="leave out the published shapes' column (about 2 minutes)")
    args = parser.parse_args()
    if args.write_docs and not args.record:
        write_docs(read_record())
        return
    torch.set_num_threads(1)
    tps = [int(x) for x in args.tp.split(",")]
    names = select(args.families)
    if args.record and (names != list(FAMILIES) or args.no_published):
        raise SystemExit("--record writes the whole table: run it without --families and "
                         "--no-published")
    rows = []
    clock = Stopwatch()
    for name in names:
        for r in check_family(name, tps):
            rows.append(r)
            print(f"{name:32s} tp={r['tp']}: {r['status'][:70]:40s} {r['seconds']:5.1f} s "
                  f"{r['detail'][:80] if r['status'] == 'refused' else ''}", flush=True)
    print(f"{len(names)} families, tp {args.tp}: {clock.seconds:.0f} s")
    data = record(rows, tps, {} if args.no_published else published_rows(names))
    print()
    print(render(data))
    for path in ([Path(args.json)] if args.json else []) + ([RECORD] if args.record else []):
        write_json(path, data)
        print(f"wrote {len(rows)} rows to {path}")
    if args.write_docs:
        write_docs(data)


if __name__ == "__main__":
    main()
