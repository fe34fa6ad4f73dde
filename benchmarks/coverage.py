"""Which transformers families autotp runs exactly, and at which cost: the README's table.

    python benchmarks/coverage.py                  # print the table (tp 2 and 4)
    python benchmarks/coverage.py --write-readme   # and replace it in README.md

Each family is a small model from its transformers config, every weight perturbed (biases
and norm scales too), run unsharded and in simulation at each tp on the same weights and
inputs: logits (every floating output), a loss over them, and every gradient. A row says
"exact" (within the tolerances below), "exact, N replicated" (exact, with matrices left
replicated: the plan's fallbacks), "refused" (an AutotpError naming what to change) or
"MISMATCH". The collectives column is the set of (forward, backward) counts per layer.
tests/test_coverage.py runs every family at tp = 2 and checks the README's rows.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ATOL = 1e-4  # logits and loss, max abs; gradients relative (autotp.verify.compare)
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
VOCAB = 128


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
    return build


LLAMA_LIKE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=8, num_key_value_heads=4, **_small())
FAMILIES: dict[str, Callable[[], Any]] = {
    "GPT-2": _decoder("GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=64, n_head=8,
                      vocab_size=VOCAB, n_positions=64),
    "LLaMA (GQA)": _decoder("LlamaForCausalLM", "LlamaConfig", **{**LLAMA_LIKE,
                                                                 "num_key_value_heads": 2}),
    "Mistral": _decoder("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE),
    "Qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE),
    "Gemma": _decoder("GemmaForCausalLM", "GemmaConfig", head_dim=8, **LLAMA_LIKE),
    "Starcoder2": _decoder("Starcoder2ForCausalLM", "Starcoder2Config", **LLAMA_LIKE),
    "GPT-NeoX": _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2,
                         hidden_size=64, intermediate_size=128, num_attention_heads=8,
                         **_small()),
    "OPT": _decoder("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=64,
                    ffn_dim=128, num_attention_heads=8, word_embed_proj_dim=64, **_small()),
    "Phi": _decoder("PhiForCausalLM", "PhiConfig", num_hidden_layers=2, hidden_size=64,
                    intermediate_size=128, num_attention_heads=8, **_small()),
    "GPT-J": _decoder("GPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=64, n_head=8,
                      rotary_dim=4, vocab_size=VOCAB, n_positions=64),
    "Bloom": _decoder("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=64, n_head=8,
                      vocab_size=VOCAB),
    "BERT": _decoder("BertModel", "BertConfig", num_hidden_layers=2, hidden_size=64,
                     intermediate_size=128, num_attention_heads=8, **_small()),
    "RoBERTa": _decoder("RobertaModel", "RobertaConfig", num_hidden_layers=2, hidden_size=64,
                        intermediate_size=128, num_attention_heads=8, pad_token_id=1,
                        **{**_small(), "max_position_embeddings": 70}),
    "DistilBERT": _decoder("DistilBertModel", "DistilBertConfig", n_layers=2, dim=64,
                           hidden_dim=128, n_heads=8, **_small()),
    "LLaMA sequence classification": _decoder("LlamaForSequenceClassification", "LlamaConfig",
                                              num_labels=4, pad_token_id=0, **LLAMA_LIKE),
    "BERT token classification": _decoder("BertForTokenClassification", "BertConfig",
                                          num_hidden_layers=2, hidden_size=64, num_labels=4,
                                          intermediate_size=128, num_attention_heads=8,
                                          **_small()),
    "Phi-3 (GQA, fused qkv)": _decoder("Phi3ForCausalLM", "Phi3Config", pad_token_id=0,
                                       **LLAMA_LIKE),
    "GPTBigCode (multi-query)": _decoder("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                                         n_layer=2, n_embd=64, n_head=8, multi_query=True,
                                         vocab_size=VOCAB, n_positions=64),
    "Falcon": _decoder("FalconForCausalLM", "FalconConfig", num_hidden_layers=2,
                       hidden_size=64, num_attention_heads=8, vocab_size=VOCAB),
}


def perturb(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def check(name: str, tp: int) -> dict[str, Any]:
    """One family at one tp: the row of the table, with the numbers behind it."""
    import autotp
    from autotp.cli import first_float, generic_loss
    from autotp.verify import compare, layer_counts, reference_step, sharded_step

    torch.manual_seed(0)
    model = perturb(FAMILIES[name]()).eval()
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = {"input_ids": ids}
    row: dict[str, Any] = {"family": name, "tp": tp, "model": type(model).__name__}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sim = autotp.simulate(model, tp, example_kwargs=kwargs)
    except autotp.AutotpError as exc:
        row.update(status="refused", detail=str(exc).splitlines()[0])
        return row

    def call(module: torch.nn.Module) -> Any:
        return module(**kwargs)

    reference = reference_step(model, call, generic_loss, first_float)
    results = sim.run(lambda m: sharded_step(m, call, generic_loss, first_float))
    worst = max((compare(reference, r) for r in results), key=lambda c: c.grad_rel)
    exact = all(compare(reference, r).ok(ATOL, ATOL) for r in results)
    counts = layer_counts(sim.ranks[0].comm.log)
    per_layer = sorted({(v["forward"], v["backward"]) for k, v in counts.items()
                        if k is not None and k != -1})
    fallbacks = len(sim.plan.fallbacks)
    status = "MISMATCH" if not exact else \
        (f"exact, {fallbacks} replicated" if fallbacks else "exact")
    row.update(status=status, output_diff=worst.output_diff, loss_diff=worst.loss_diff,
               grad_rel=worst.grad_rel, per_layer=per_layer, fallbacks=fallbacks, detail="")
    return row


def table(rows: list[dict[str, Any]], tps: list[int]) -> str:
    by = {(r["family"], r["tp"]): r for r in rows}
    head = "| family | model | " + " | ".join(f"tp = {tp}" for tp in tps) + \
        " | collectives per layer (fwd, bwd) |"
    lines = [head, "|" + "---|" * (3 + len(tps))]
    for family in dict.fromkeys(r["family"] for r in rows):
        cells, layers = [], set()
        for tp in tps:
            r = by[(family, tp)]
            cell = r["status"]
            if r["status"] == "refused":
                cell += f": {r['detail'][:90]}"
            elif "output_diff" in r:
                cell += f" ({max(r['output_diff'], r['loss_diff']):.0e}, grad {r['grad_rel']:.0e})"
                layers.update(r["per_layer"])
            cells.append(cell)
        lines.append(f"| {family} | {by[(family, tps[0])]['model']} | " + " | ".join(cells) +
                     f" | {', '.join(map(str, sorted(layers))) or '-'} |")
    return "\n".join(lines)


def readme_rows(readme: str) -> dict[str, list[str]]:
    """family -> the status words of each tp column in the README's generated table."""
    section = readme[readme.index(BEGIN):readme.index(END)]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] not in ("family", "---"):
            out[cells[0]] = [re.split(r"[ (:]", c, maxsplit=1)[0] for c in cells[2:-1]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tps = [int(x) for x in args.tp.split(",")]
    rows = []
    for name in FAMILIES:
        for tp in tps:
            rows.append(check(name, tp))
            r = rows[-1]
            print(f"{name:32s} tp={tp}: {r['status']} {r.get('detail', '')[:100]}", flush=True)
    text = table(rows, tps)
    print()
    print(text)
    if args.write_readme:
        path = ROOT / "README.md"
        readme = path.read_text()
        start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
        note = ("\n<!-- generated by python benchmarks/coverage.py --write-readme; "
                "(max abs diff of outputs and loss, max relative gradient diff) -->\n")
        path.write_text(readme[:start] + note + text + "\n" + readme[end:])
        print(f"wrote the table into {path}")


if __name__ == "__main__":
    main()
