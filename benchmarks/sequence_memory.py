"""Activation memory per rank: unsharded, tensor parallel, and with sequence parallelism.

    python -m benchmarks.sequence_memory [--tp 2 4] [--layers 4] [--hidden 512] [--seq 256]

Activation memory is what autograd keeps from the forward pass for the backward pass: every
tensor saved for backward, counted once per storage (``autotp.verification.saved_tensors``) while
one training forward runs (HF models with ``labels=``, dropout on). Parameters are not counted.
The sharded runs use the in-process simulation (the same per-rank programs as
``autotp.parallelize``); each rank is measured in its own thread. The counting hooks are set
around the call, outside the program's own (which store each gathered input of a product as
its sequence shard, ``autotp.runtime.regather``): the program hands them what it really keeps.
"SP, gathered kept" is sequence parallelism with ``keep_gathered=True``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.harness import Column, table, write_rows



def build(kind: str, layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=8,
                                         vocab_size=vocab, n_positions=1024)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                                      intermediate_size=hidden * 8 // 3 // 64 * 64,
                                      num_attention_heads=8, num_key_value_heads=8,
                                      vocab_size=vocab, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config)


def measure(kind: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    import autotp
    from autotp.verification.saved_tensors import count_saved

    model = build(kind, args.layers, args.hidden, args.vocab)
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids[:2, :16], "labels": ids[:2, :16]}
    params = list(model.parameters())

    def forward(m: torch.nn.Module) -> Any:
        return m(input_ids=ids, labels=ids).loss

    def activations(m: torch.nn.Module) -> int:
        # parameters are saved for backward too (by the matmuls): not activations
        with count_saved(exclude=[*m.parameters(), *params]) as saved:
            loss = forward(m)
        del loss
        return saved.nbytes

    row: dict[str, Any] = {"model": kind, "tp": tp, "layers": args.layers,
                           "hidden": args.hidden, "batch": args.batch, "seq": args.seq,
                           "vocab": args.vocab}
    row["unsharded"] = activations(model)
    for label, sp, keep in (("tensor_parallel", False, False),
                            ("sequence_parallel_gathered_kept", True, True),
                            ("sequence_parallel", True, False)):
        sim = autotp.simulate(model, tp, example_kwargs=example, sequence_parallel=sp,
                              keep_gathered=keep, gather_outputs=False)
        per_rank = sim.run(activations)
        row[label] = max(per_rank)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", help="also write the rows as JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [measure(kind, tp, args) for kind in args.models for tp in args.tp]
    mib = 1 << 20
    print(f"activation memory per rank (saved for backward), B={args.batch} T={args.seq} "
          f"hidden={args.hidden} layers={args.layers} vocab={args.vocab}, fp32")

    def mib_column(title: str, key: str) -> Column:
        return Column(title, 11, cell=lambda r: f"{r[key] / mib:.1f}Mi")

    def saves(r: dict[str, Any]) -> str:
        tp_, sp = r["tensor_parallel"], r["sequence_parallel"]
        return f"{(tp_ - sp) / mib:.1f} MiB ({1 - sp / tp_:.0%})"

    print(table([
        Column("model", 6, "model", left=True), Column("tp", 2, "tp"),
        mib_column("unsharded", "unsharded"), mib_column("TP", "tensor_parallel"),
        mib_column("SP, kept", "sequence_parallel_gathered_kept"),
        mib_column("TP+SP", "sequence_parallel"),
        Column("TP/unsh.", 9, cell=lambda r: f"{r['tensor_parallel'] / r['unsharded']:.3f}"),
        Column("SP/unsh.", 9, cell=lambda r: f"{r['sequence_parallel'] / r['unsharded']:.3f}"),
        Column("SP saves vs TP", 20, cell=saves)], rows))
    if args.json:
        write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
