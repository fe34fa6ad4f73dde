"""Measure sharded-vs-unsharded differences and collectives per layer for the test models.

    python -m benchmarks.equivalence            # simulation at tp 2, 4, 8 and gloo at tp 2, 4

Prints one row per (model, tp, mode): max |logits diff|, |loss diff|, max |grad diff| (and
relative), collectives executed per layer (forward, backward).
"""

from __future__ import annotations

from benchmarks.harness import Column, header, line


def simulation_row(name: str, tp: int) -> dict:
    import autotp
    from autotp.verification.verify import compare, layer_counts, reference_step, sharded_step
    from tests.models import BUILDERS, batch, example, loss_of, main_output

    model = BUILDERS[name]()
    args, kwargs = example(name)
    sim = autotp.simulate(model, tp, example_args=args, example_kwargs=kwargs)
    ids = batch()
    call = lambda m: m(ids)  # noqa: E731
    loss = lambda out: loss_of(out, ids)  # noqa: E731
    reference = reference_step(model, call, loss, main_output)
    results = sim.run(lambda m: sharded_step(m, call, loss, main_output))
    cmps = [compare(reference, r) for r in results]
    counts = layer_counts(sim.ranks[0].comm.log)
    return _row(cmps, counts)


def _row(cmps: list, counts: dict) -> dict:
    per_layer = sorted({(v["forward"], v["backward"]) for k, v in counts.items()
                        if k is not None and k != -1})
    return {"logits": max(c.output_diff for c in cmps), "loss": max(c.loss_diff for c in cmps),
            "grad": max(c.grad_diff for c in cmps), "grad_rel": max(c.grad_rel for c in cmps),
            "per_layer": per_layer}


def main() -> None:
    from autotp.runtime.launch import run_processes
    from tests.dist_cases import equivalence_case

    columns = [Column("model", 7, "model", left=True), Column("tp", 3, "tp"),
               Column("mode", 10, "mode", left=True), Column("logits", 9, "logits", ".1e"),
               Column("loss", 9, "loss", ".1e"), Column("grad", 9, "grad", ".1e"),
               Column("grad rel", 9, "grad_rel", ".1e"),
               Column(" per layer (fwd, bwd)", 1, cell=lambda r: f" {r['per_layer']}",
                      left=True)]
    print(header(columns))
    for name in ["gpt2", "llama", "bert", "nanogpt"]:
        for tp in (2, 4, 8):
            row = {"model": name, "tp": tp, "mode": "simulation", **simulation_row(name, tp)}
            print(line(columns, row), flush=True)
        for tp in (2, 4):
            results = run_processes(equivalence_case, tp, name)
            row = {"model": name, "tp": tp, "mode": "gloo",
                   "logits": max(x["output_diff"] for x in results),
                   "loss": max(x["loss_diff"] for x in results),
                   "grad": max(x["grad_diff"] for x in results),
                   "grad_rel": max(x["grad_rel"] for x in results),
                   "per_layer": sorted({(v["forward"], v["backward"]) for k, v in
                                        results[0]["counts"].items() if k != -1})}
            print(line(columns, row), flush=True)


if __name__ == "__main__":
    main()
