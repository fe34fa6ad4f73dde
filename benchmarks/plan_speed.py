"""Time each stage of autotp on LLaMA-2 7B and 70B shapes (meta device: no weights), and
``autotp plan`` in a fresh process against a bare torch.export in a fresh process.

    python -m benchmarks.plan_speed [--tp 8] [--shapes 7b 70b] [--fresh 70b]

Stages: export (torch.export of the layers traced, the rest stamped, and normalization),
rules (strategies of every node), plan (the dynamic program and the Plan), gradflow (the
static gradient check of the Plan), rewrite (one rank's program). Prints a table, and one
JSON line per shape.

Fresh processes (``--fresh``, the shapes to compare): the command line's ``autotp plan
hf:llama --set ... --tp 8`` (import, build on meta, trace, plan, write the JSON) with an
empty plan cache and again with the plan it cached, the same with every layer traced
(``AUTOTP_TRACE_EVERY_LAYER=1``), and a bare ``torch.export`` of the
same model with autotp's symbolic batch and sequence (import, build on meta, export), each
with its wall time and peak host memory (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks.harness import Column, Laps, Stopwatch, print_row, ratio, ratio_text, table


SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
               num_key_value_heads=32, num_hidden_layers=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                num_key_value_heads=8, num_hidden_layers=80),
}


class NoComm:
    """The rewrite only stores the communicator; nothing runs here."""

    rank, world_size = 0, 8
    log = None


def run(shape: str, tp: int) -> dict:
    import transformers

    import autotp
    from autotp.capture.trace import capture
    from autotp.planner.cost import CostModel
    from autotp.planner.solve import (PlanOptions, assemble, block_counts, build_problem,
                                      solve)
    from autotp.weights.materialize import DeferredWeights, ModelWeights
    from autotp.planner.gradflow import check_gradient_flow
    from autotp.runtime.rewrite import rewrite
    from autotp.rules.registry import Registry

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**SHAPES[shape])
    with autotp.empty_weights():
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    laps = Laps()
    with laps("export"):
        captured = capture(model, example_kwargs={"input_ids": ids})
    cost_model, options = CostModel(), PlanOptions()
    with laps("rules"):
        pnodes = build_problem(captured, tp, block_counts(captured.gm), Registry.default(),
                               cost_model, options)
    with laps("plan"):
        decisions, total, _ = solve(pnodes, tp, cost_model, options)
        plan = assemble(captured, pnodes, decisions, total, tp, cost_model, options, shape)
    with laps("gradflow"):
        check_gradient_flow(plan, captured.gm)
    comm = NoComm()
    comm.world_size = tp
    with laps("rewrite"):
        # a model without weights: the program gets meta parameters of the local shapes
        rewrite(captured, plan, 0, comm,  # type: ignore[arg-type]
                weights=DeferredWeights(ModelWeights(model)))
    times = laps.seconds
    per_layer = {(plan.count("forward", layer), plan.count("backward", layer))
                 for layer in range(config.num_hidden_layers)}
    return {"shape": shape, "tp": tp, "layers": config.num_hidden_layers,
            "nodes": len(captured.gm.graph.nodes), **{k: round(v, 3) for k, v in times.items()},
            "after_export": round(sum(v for k, v in times.items() if k != "export"), 3),
            "per_layer_fwd_bwd": sorted(per_layer)}


BARE_EXPORT = """
import time
start = time.perf_counter()
import torch, transformers
from torch.export import Dim
transformers.logging.set_verbosity_error()
config = transformers.LlamaConfig(**{fields!r})
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
torch.export.export(model, (), {{"input_ids": ids, "use_cache": False}}, strict=False,
                    dynamic_shapes={{"input_ids": {{0: Dim.AUTO, 1: Dim.AUTO}},
                                    "use_cache": None}})
"""

CLI = """
import runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_module("autotp", run_name="__main__")
except SystemExit as exit:
    if exit.code:
        raise
"""

REPORT = """
import resource, sys
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _fresh(code: str, env: dict) -> tuple[float, float]:
    """Wall seconds and peak resident GiB of ``code`` run by a new interpreter."""
    import subprocess

    clock = Stopwatch()
    done = subprocess.run([sys.executable, "-c", code + REPORT], env=env, check=True,
                          capture_output=True, text=True)
    seconds = clock.seconds
    peak = [line for line in done.stderr.splitlines() if line.startswith("peak_kib")][-1]
    return seconds, int(peak.split()[1]) / 2**20


def fresh(shape: str, tp: int) -> dict:
    import tempfile

    env = dict(os.environ)  # the child imports the installed autotp, as a user's would
    env.pop("AUTOTP_TRACE_EVERY_LAYER", None)
    out = os.path.join(tempfile.mkdtemp(), "plan.json")
    argv = ["autotp", "plan", "hf:llama", "--tp", str(tp), "-q", "--format", "json", "-o", out]
    for key, value in SHAPES[shape].items():
        argv += ["--set", f"{key}={value}"]
    row: dict = {"shape": shape, "tp": tp}
    row["bare_s"], row["bare_gib"] = _fresh(BARE_EXPORT.format(fields=SHAPES[shape]), env)
    # a first run (the plan cache empty), then a second one reading the plan it wrote
    env.update(AUTOTP_CACHE="1", AUTOTP_CACHE_DIR=tempfile.mkdtemp())
    row["plan_s"], row["plan_gib"] = _fresh(CLI.format(argv=argv), env)
    with open(out) as handle:
        stamped = json.load(handle)
    row["cached_s"], row["cached_gib"] = _fresh(CLI.format(argv=argv), env)
    every = dict(env, AUTOTP_TRACE_EVERY_LAYER="1", AUTOTP_CACHE="0")
    row["every_s"], row["every_gib"] = _fresh(CLI.format(argv=argv), every)
    with open(out) as handle:
        row["same_plan"] = _collectives(json.load(handle)) == _collectives(stamped)
    row["ratio"] = ratio([row["plan_s"]], [row["bare_s"]])
    return row


def _collectives(plan_json: dict) -> list:
    """Per layer, the collectives and the parameters' layouts."""
    return [sorted(map(str, plan_json.get("collectives", []))),
            sorted((k, str(v)) for k, v in plan_json.get("params", {}).items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--shapes", nargs="*", default=["7b", "70b"], choices=list(SHAPES))
    parser.add_argument("--fresh", nargs="*", default=["70b"], choices=list(SHAPES))
    args = parser.parse_args()
    for shape in args.fresh:
        row = fresh(shape, args.tp)
        print(f"{shape} tp={args.tp}, fresh processes: autotp plan {row['plan_s']:.1f} s "
              f"({row['plan_gib']:.2f} GiB peak), again with the plan cached "
              f"{row['cached_s']:.1f} s, every layer traced {row['every_s']:.1f} s "
              f"({row['every_gib']:.2f} GiB), bare torch.export {row['bare_s']:.1f} s "
              f"({row['bare_gib']:.2f} GiB): {ratio_text(row['ratio'], suffix='x')} the bare "
              f"export; same plan as every layer traced: {row['same_plan']}")
        print_row(row)
    rows = [run(shape, args.tp) for shape in args.shapes]
    print(table([
        Column("shape", 5, "shape", left=True), Column("layers", 6, "layers"),
        Column("nodes", 6, "nodes"), Column("export s", 9, "export", ".2f"),
        Column("rules s", 8, "rules", ".2f"), Column("plan s", 7, "plan", ".2f"),
        Column("gradflow s", 11, "gradflow", ".3f"), Column("rewrite s", 10, "rewrite", ".2f"),
        Column("after export s", 15, "after_export", ".2f"),
        Column(" per layer (fwd, bwd)", 1, cell=lambda r: f" {r['per_layer_fwd_bwd']}",
               left=True)], rows))
    for r in rows:
        print_row(r)


if __name__ == "__main__":
    main()
