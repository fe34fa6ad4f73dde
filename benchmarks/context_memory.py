"""Activation memory per rank against the context-parallel degree, measured.

    python -m benchmarks.context_memory [--tp 1 2] [--cp 1 2 4] [--layers 4] [--hidden 256]
                                        [--seq 512]

Activation memory is what autograd keeps from the forward pass for the backward pass: every
tensor saved for backward, counted once per storage (``autotp.verification.saved_tensors``),
parameters excluded. Each cp runs in the in-process simulation (the rank programs
``autotp.parallelize(..., cp=)`` builds), each rank measured in its own thread; the table
shows the largest rank. Two programs of transformers' LLaMA (SDPA, causal, GQA):

- ``layers``: ``LlamaModel`` (the decoder without its head), output returned as each rank's
  sequence shard (``gather_outputs=False``);
- ``with loss``: ``LlamaForCausalLM`` with ``labels=``: the model's own loss, which reads
  its logits as batch x sequence rows (``logits.view(-1, vocab)``), sharded by sequence.

At tp > 1 every row runs with sequence parallelism: cp 1 is sequence parallelism alone,
cp > 1 context parallelism inside it (``parallelize(model, tp=T, cp=C,
sequence_parallel=True)``), at the same sequence.

``x cp`` is the activation memory at cp times cp over cp 1's at the same tp: 1.00 where
everything scales as 1/cp. ``predicted`` is what ``autotp estimate`` counts for the same
program at that tp and cp (``build_profile(..., cp=)``: the tp plan's program on 1/cp of the
sequence, the attention core and mask rows at seq/cp x seq), beside the measurement.
``fwd+bwd s`` is the largest rank's forward and backward, and ``/ cp 1`` its ratio to cp 1's
at the same tp (sequence parallelism alone at tp > 1): simulated ranks are threads sharing
this machine's cores, so the times show the work each rank does and what the simulation
costs, not a GPU's step time.
"""

from __future__ import annotations

import argparse
import sys
import warnings
import torch

from benchmarks.harness import Column, Stopwatch, header, line, ratio_text



def build(head: bool, args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      vocab_size=args.vocab, max_position_embeddings=args.seq,
                                      attn_implementation="sdpa")
    cls = transformers.LlamaForCausalLM if head else transformers.LlamaModel
    return cls(config).eval()


def measure(head: bool, tp: int, cp: int, args: argparse.Namespace) -> tuple[int, float]:
    """(the largest rank's activation bytes, seconds of its forward and backward)."""
    import autotp
    from autotp.verification.saved_tensors import count_saved

    model = build(head, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids} if head else {"input_ids": ids}
    example = {k: v[:2, :64] for k, v in inputs.items()}
    params = list(model.parameters())

    def step(m: torch.nn.Module) -> tuple[int, float]:
        clock = Stopwatch()
        with count_saved(exclude=[*m.parameters(), *params]) as saved:
            out = m(**inputs)
        loss = out.loss if head else out.last_hidden_state.float().pow(2).mean()
        loss.backward()
        return saved.nbytes, clock.seconds

    if tp == cp == 1:
        return step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = autotp.simulate(model, tp, cp=cp, example_kwargs=example, gather_outputs=False,
                              sequence_parallel=tp > 1)
    per_rank = sim.run(step)
    return max(b for b, _ in per_rank), max(t for _, t in per_rank)


_PLANNED: dict[tuple[bool, int], tuple] = {}


def predicted(head: bool, tp: int, cp: int, args: argparse.Namespace) -> int:
    """The activation bytes ``autotp estimate`` counts for one rank at ``tp`` and ``cp``."""
    from autotp.capture.trace import capture
    from autotp.planner.job.memory import end_activations, layer_activations
    from autotp.planner.job.profile import build_profile
    from autotp.planner.solve import PlanOptions, plan_graph

    if (head, tp) not in _PLANNED:
        model = build(head, args)
        ids = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(1))
        example = {"input_ids": ids, "labels": ids} if head else {"input_ids": ids}
        captured = capture(model, example_kwargs=example)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_graph(captured, tp, options=PlanOptions(sequence_parallel=tp > 1))
        _PLANNED[head, tp] = (captured, plan)
    captured, plan = _PLANNED[head, tp]
    prof = build_profile(captured, plan, args.batch, args.seq, dtype_bytes=4, cp=cp)
    return int(sum(layer_activations(prof, "none").values()) +
               end_activations(prof, "first") + end_activations(prof, "last"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    mib = 1 << 20
    print(f"activation memory per rank (saved for backward), LLaMA B={args.batch} "
          f"T={args.seq} hidden={args.hidden} layers={args.layers} vocab={args.vocab}, fp32; "
          "simulated ranks (threads)")
    columns = [
        Column("program", 10, "program", left=True), Column("tp", 3, "tp"), Column("cp", 3, "cp"),
        Column("per rank", 10, cell=lambda r: f"{r['bytes'] / mib:.1f}Mi"),
        Column("/ cp 1", 7, "bytes_vs_cp1", ".3f"),
        Column("x cp", 6, cell=lambda r: ratio_text(r["bytes_vs_cp1"] * r["cp"])),
        Column("predicted", 10, cell=lambda r: f"{r['predicted'] / mib:.1f}Mi"),
        Column("pred/meas", 9, cell=lambda r: ratio_text(r["predicted"] / r["bytes"])),
        Column("fwd+bwd s", 10, "seconds", ".2f"), Column("/ cp 1", 7, "time_vs_cp1", ".2f")]
    print(header(columns))
    for head in (False, True):
        for tp in args.tp:
            base = None
            for cp in args.cp:
                nbytes, seconds = measure(head, tp, cp, args)
                if cp == 1:
                    base = (nbytes, seconds)
                row = {"program": "with loss" if head else "layers", "tp": tp, "cp": cp,
                       "bytes": nbytes, "seconds": seconds,
                       "bytes_vs_cp1": nbytes / base[0] if base else float("nan"),
                       "time_vs_cp1": seconds / base[1] if base else float("nan"),
                       "predicted": predicted(head, tp, cp, args)}
                print(line(columns, row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
