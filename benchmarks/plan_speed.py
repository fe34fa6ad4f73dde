"""Time each stage of autotp on LLaMA-2 7B and 70B shapes (meta device: no weights).

    python benchmarks/plan_speed.py [--tp 8] [--shapes 7b 70b]

Stages: export (torch.export + normalization), rules (strategies of every node), plan (the
dynamic program and the Plan), gradflow (the static gradient check of the Plan), rewrite (one
rank's program). Prints a table, and one JSON line
per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    times = {}
    start = time.perf_counter()
    captured = capture(model, example_kwargs={"input_ids": ids})
    times["export"] = time.perf_counter() - start
    cost_model, options = CostModel(), PlanOptions()
    start = time.perf_counter()
    pnodes = build_problem(captured, tp, block_counts(captured.gm), Registry.default(),
                           cost_model, options)
    times["rules"] = time.perf_counter() - start
    start = time.perf_counter()
    decisions, total = solve(pnodes, tp, cost_model, options)
    plan = assemble(captured, pnodes, decisions, total, tp, cost_model, options, shape)
    times["plan"] = time.perf_counter() - start
    start = time.perf_counter()
    check_gradient_flow(plan, captured.gm)
    times["gradflow"] = time.perf_counter() - start
    comm = NoComm()
    comm.world_size = tp
    start = time.perf_counter()
    # a model without weights: the program gets meta parameters of the local shapes
    rewrite(captured, plan, 0, comm,  # type: ignore[arg-type]
            weights=DeferredWeights(ModelWeights(model)))
    times["rewrite"] = time.perf_counter() - start
    per_layer = {(plan.count("forward", layer), plan.count("backward", layer))
                 for layer in range(config.num_hidden_layers)}
    return {"shape": shape, "tp": tp, "layers": config.num_hidden_layers,
            "nodes": len(captured.gm.graph.nodes), **{k: round(v, 3) for k, v in times.items()},
            "after_export": round(sum(v for k, v in times.items() if k != "export"), 3),
            "per_layer_fwd_bwd": sorted(per_layer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--shapes", nargs="+", default=["7b", "70b"], choices=list(SHAPES))
    args = parser.parse_args()
    rows = [run(shape, args.tp) for shape in args.shapes]
    print(f"{'shape':<6}{'layers':>7}{'nodes':>7}{'export s':>10}{'rules s':>9}{'plan s':>8}"
          f"{'gradflow s':>12}{'rewrite s':>11}{'after export s':>16}  per layer (fwd, bwd)")
    for r in rows:
        print(f"{r['shape']:<6}{r['layers']:>7}{r['nodes']:>7}{r['export']:>10.2f}"
              f"{r['rules']:>9.2f}{r['plan']:>8.2f}{r['gradflow']:>12.3f}{r['rewrite']:>11.2f}"
              f"{r['after_export']:>16.2f}  {r['per_layer_fwd_bwd']}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
