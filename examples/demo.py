"""autotp demo: parallelize an unmodified Hugging Face GPT-2 over 2 CPU processes (gloo).

    python examples/demo.py [--tp 2] [--layers 4]

Each process builds the same GPT2LMHeadModel (random weights, fixed seed), calls
``autotp.parallelize``, runs a forward and backward pass, and checks logits, loss and every
parameter's gradient against the unsharded model. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch



def build_gpt2(layers: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=256, n_head=8, n_positions=256,
                                     vocab_size=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def worker(rank: int, world_size: int, layers: int) -> dict[str, Any]:
    import autotp
    from autotp.verification.verify import compare, layer_counts, reference_step, sharded_step

    torch.set_num_threads(1)
    model = build_gpt2(layers)
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids[:2, :16], "labels": ids[:2, :16]}
    sharded = autotp.parallelize(model, tp=world_size, example_kwargs=example)

    def call(m: torch.nn.Module) -> Any:
        return m(input_ids=ids, labels=ids)

    def loss(out: Any) -> torch.Tensor:
        return out.loss

    def logits(out: Any) -> torch.Tensor:
        return out.logits

    reference = reference_step(model, call, loss, logits)
    got = sharded_step(sharded, call, loss, logits)
    cmp = compare(reference, got)
    return {
        "summary": sharded.plan.summary(),
        "cmp": cmp,
        "counts": layer_counts(sharded.comm.log),
        "local": sum(p.numel() for p in sharded.parameters()),
        "full": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    from autotp.runtime.launch import run_processes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"parallelizing a {args.layers}-layer GPT-2 over {args.tp} gloo processes ...")
    results = run_processes(worker, args.tp, args.layers)
    print(results[0]["summary"])
    ok = True
    for rank, r in enumerate(results):
        cmp = r["cmp"]
        print(f"rank {rank}: {r['local']:,} of {r['full']:,} parameters; "
              f"max |logits diff| {cmp.output_diff:.2e}, |loss diff| {cmp.loss_diff:.2e}, "
              f"max |grad diff| {cmp.grad_diff:.2e} ({cmp.worst_param})")
        ok &= cmp.ok()
    counts = results[0]["counts"]
    layers = sorted(k for k in counts if k is not None)
    per_layer = {(counts[k]["forward"], counts[k]["backward"]) for k in layers}
    print(f"collectives executed per layer (forward, backward): {sorted(per_layer)}"
          " -- Megatron's bound is (2, 2)")
    ok &= per_layer == {(2, 2)}
    print("MATCH: sharded outputs and gradients equal the unsharded model" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
