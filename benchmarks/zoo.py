"""Every causal-LM architecture the installed transformers ships, planned and run at tp 2.

    python -m benchmarks.zoo --json zoo-5.24.json          # sweep (over an hour, 2 cores)
    python -m benchmarks.zoo --only llama,mixtral          # a few model types
    python -m benchmarks.zoo --diff benchmarks/zoo_5.24.json new.json  # what moved since

Unlike benchmarks/family_coverage.py (a fixed list of families with hand-made configs), this walks
transformers' own registry of causal LMs (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), so a new or
changed architecture shows up without anyone adding it. Each config keeps its class defaults
with the common size fields shrunk (hidden 64, 2 layers, 8 heads, 4 k/v heads, vocabulary
128, experts 4); every weight is perturbed and the model is run unsharded and in simulation
on the same weights and inputs (benchmarks/family_coverage.py's row: logits, a loss, every
gradient). Per architecture it prints the status (exact / refused / MISMATCH / CRASH /
"not built": the shrunk config or its model could not be made, a limit of this sweep, not of
autotp), the collectives per layer and the bytes against Megatron's two all-reduces per
layer. "at bound": exact, at most (2, 2) collectives and 1.01x Megatron's bytes per layer.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any, Optional

from autotp.presentation.report import BOUND_BYTES, MEGATRON_BOUND
from benchmarks import family_coverage  # the row of one model
from benchmarks.harness import Stopwatch, read_json, write_json

ROOT = Path(__file__).resolve().parent.parent

SMALL = {  # field -> value, set where the config has the field
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2,
    "num_layers": 2, "num_attention_heads": 8, "n_head": 8, "num_key_value_heads": 4,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "head_dim": 8,
    "vocab_size": family_coverage.VOCAB, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "sliding_window": 16,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "layer_types": None, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}


def architectures() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def small_config(model_type: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = getattr(config, "text_config", None)
    for target in (config,) + ((text,) if text is not None and text is not config else ()):
        for key, value in SMALL.items():
            if key in target.to_dict() and value is not None:
                setattr(target, key, value)
        if "layer_types" in target.to_dict() and isinstance(target.layer_types, list):
            target.layer_types = target.layer_types[:2]
    return config


MAX_PARAMETERS = 20_000_000  # a config the shrinking missed (sub-configs of its own): skipped


def builder(model_type: str, class_name: str) -> Any:
    def build() -> Any:
        import torch
        import transformers

        cls = getattr(transformers, class_name)
        with torch.device("meta"):
            count = sum(p.numel() for p in cls(small_config(model_type)).parameters())
        if count > MAX_PARAMETERS:
            raise ValueError(f"{count / 1e6:.0f}M parameters after shrinking the config")
        return cls(small_config(model_type))
    build.__name__ = class_name
    return build


def inputs() -> dict[str, Any]:
    """The ids, with use_cache=False as autotp traces a transformers model: a model whose
    logits depend on it (Dory's recurrent loops read the cache inside one forward) is then
    compared with the computation autotp runs."""
    return {**family_coverage.text(), "use_cache": False}


def sweep(only: Optional[list[str]], tps: list[int], out: Optional[Path] = None,
          resume: bool = False, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The rows of every architecture; written to ``out`` after each one, and with
    ``resume`` the architectures already there are kept rather than run again."""
    import transformers

    rows = read_json(out) if resume and out and out.exists() else []
    done = {row["model_type"] for row in rows}
    for model_type, class_name in architectures().items():
        if (only and model_type not in only) or model_type in done or model_type in skip:
            continue
        name = f"zoo:{model_type}"
        family_coverage.FAMILIES[name] = family_coverage.Family(
            builder(model_type, class_name), inputs)
        clock = Stopwatch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = family_coverage.check_family(name, tps)
        for row in results:
            row["model_type"] = model_type
            row["transformers"] = transformers.__version__
            row["at_bound"] = at_bound(row)
            rows.append(row)
            print(f"{model_type:28s} tp={row['tp']} {summary(row)}  "
                  f"({clock.seconds:.1f} s)", flush=True)
        if out:
            write_json(out, rows)
    return rows


def status(row: dict[str, Any]) -> str:
    """The row's status; "not built" where the shrunk model failed before autotp ran (its
    construction or its unsharded step: family_coverage.py's setup, which takes no time)."""
    text = str(row["status"])
    if text.startswith("CRASH") and row.get("seconds") == 0.0:
        return f"not built: {row.get('detail', '')}"
    if text == "refused":
        return f"refused: {row.get('detail', '')}"
    return text


def at_bound(row: dict[str, Any]) -> bool:
    if not str(row.get("status", "")).startswith("exact"):
        return False
    counts = row.get("per_layer") or []
    ratios = row.get("bytes_ratio") or []
    # the distinct counts and the distinct bytes ratios of the layers, each against the bound
    return all(f <= MEGATRON_BOUND["forward"] and b <= MEGATRON_BOUND["backward"]
               for f, b in counts) and all(max(f, b) <= BOUND_BYTES for f, b in ratios)


def summary(row: dict[str, Any]) -> str:
    text = status(row)
    if not text.startswith("exact"):
        return text[:140]
    counts = ", ".join(f"({f}, {b})" for f, b in row.get("per_layer") or []) or "none"
    ratios = ", ".join(f"({f:g}, {b:g})" for f, b in row.get("bytes_ratio") or []) or "-"
    return f"{text}; per layer {counts}; x Megatron {ratios}" + \
        ("" if row["at_bound"] else "  ABOVE BOUND")


def totals(rows: list[dict[str, Any]]) -> str:
    words = {"planned": 0, "exact": 0, "at bound": 0, "refused": 0, "MISMATCH": 0, "CRASH": 0,
             "not built": 0}
    for row in rows:
        text = status(row)
        if text.startswith("not built"):
            words["not built"] += 1
            continue
        words["planned"] += 1
        word = family_coverage.status_word(text)
        words["exact" if word.startswith("exact") else word] = \
            words.get("exact" if word.startswith("exact") else word, 0) + 1
        words["at bound"] += bool(row["at_bound"])
    return ", ".join(f"{k} {v}" for k, v in words.items())


def diff(old_path: str, new_path: str) -> None:
    old = {(r["model_type"], r["tp"]): r for r in read_json(old_path)}
    new = {(r["model_type"], r["tp"]): r for r in read_json(new_path)}
    versions = [next(iter(d.values()))["transformers"] if d else "?" for d in (old, new)]
    print(f"transformers {versions[0]} -> {versions[1]}")
    print(f"  {versions[0]}: {totals(list(old.values()))}")
    print(f"  {versions[1]}: {totals(list(new.values()))}")
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            print(f"{key[0]:28s} tp={key[1]} only in {versions[1] if a is None else versions[0]}")
            continue
        if (summary(a), a["at_bound"]) != (summary(b), b["at_bound"]):
            print(f"{key[0]:28s} tp={key[1]}\n    {versions[0]}: {summary(a)}\n"
                  f"    {versions[1]}: {summary(b)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--tp", default="2", help="comma-separated degrees (default 2)")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the architectures already in --json, run the rest")
    parser.add_argument("--skip", default="", help="comma-separated model types not to run")
    args = parser.parse_args()
    if args.diff:
        diff(*args.diff)
        return
    import torch

    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    rows = sweep(args.only.split(",") if args.only else None,
                 [int(t) for t in args.tp.split(",")], Path(args.json) if args.json else None,
                 args.resume, tuple(t for t in args.skip.split(",") if t))
    print(totals(rows))


if __name__ == "__main__":
    main()
