"""What one training step costs a rank beyond the unsharded model: ATen ops, host
synchronisations, graph breaks.

    python -m benchmarks.step_costs                      # tp2, tp2-sp, cp2, tp2-dropout
    python -m benchmarks.step_costs --cases tp2 --layers 4 --json out.json
    python -m benchmarks.step_costs --no-compile         # skip the graph-break count

Two gloo processes on this machine build a small HF ``LlamaForCausalLM`` (GQA: 8 query heads,
2 key/value heads; sdpa attention) from the same seed and run, per case, one training step
(forward with ``labels=``, backward) of the rank program beside one of the unsharded model,
each after a step that warms it (the first call traces and checks the plan):

    tp2          autotp.parallelize(model, tp=2)
    tp2-sp       the same with sequence_parallel=True
    cp2          autotp.parallelize(model, cp=2): ring attention over a sequence halved
    tp2-dropout  tp2 on the model with attention dropout (the kernel draws from a stream)

``StepCosts``, a ``TorchDispatchMode``, counts every op dispatched during the step (the
c10d collectives included, each one op) by kind, and the host synchronisations among them:
``aten.equal``, ``aten._local_scalar_dense`` (``.item()``, ``bool()`` of a tensor) and
``aten.is_nonzero``. Ops dispatched while a rank waits for a collective are the transport's,
not the program's, and are counted apart (``in waits``): gloo completes a reduce-scatter on
the waiting thread as an all-reduce and a copy of the rank's block (``split`` + ``copy_``),
which NCCL runs inside its kernel. Printed per case, rank 0 (the ranks run the same program):
ops per step (the program's: the transport's apart) and their ratio to the unsharded step,
the op kinds the rank runs more often than the
unsharded model, host synchronisations beyond the unsharded model's own, and with compile
the graph breaks torch._dynamo counts in one step of ``compile={"backend": "eager"}`` (the
breaks are dynamo's; the backend only changes what compiles each graph).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import Column, header, line, ratio_text, write_json

CASES = ("tp2", "tp2-sp", "cp2", "tp2-dropout")
# ops that wait for the device to hand a value to the host
HOST_SYNCS = ("aten::equal", "aten::_local_scalar_dense", "aten::is_nonzero")


class StepCosts(TorchDispatchMode):
    """Counts the ops dispatched under it: ``ops`` by schema name (``aten::mm``), and apart,
    in ``transport``, those dispatched while a collective is waited for (inside
    ``ProcessGroupComm._wait``, which ``waits_counted_apart`` marks)."""

    current: Optional["StepCosts"] = None  # the mode counting now (one per process)

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.transport: Counter[str] = Counter()
        self.waiting = False

    def __enter__(self) -> "StepCosts":
        StepCosts.current = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        StepCosts.current = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.OpOverload):
            (self.transport if self.waiting else self.ops)[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> Counter[str]:
        return Counter({k: self.ops[k] for k in HOST_SYNCS if self.ops[k]})


@contextlib.contextmanager
def waits_counted_apart() -> Iterator[None]:
    """Inside, the ops a ``ProcessGroupComm`` dispatches while it waits for a collective
    count as the transport's (``StepCosts.transport``)."""
    from autotp.runtime.comm import ProcessGroupComm

    wait = ProcessGroupComm._wait

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        mode = StepCosts.current
        if mode is None:
            return wait(self, *args, **kwargs)
        mode.waiting = True
        try:
            return wait(self, *args, **kwargs)
        finally:
            mode.waiting = False

    ProcessGroupComm._wait = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        ProcessGroupComm._wait = wait  # type: ignore[method-assign]


def build(layers: int, hidden: int, vocab: int, dropout: float) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=256, attention_dropout=dropout,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def counted_step(model: torch.nn.Module, ids: torch.Tensor) -> StepCosts:
    """One training step (forward with labels, backward) counted, after one that warms."""
    for counting in (False, True):
        model.zero_grad(set_to_none=True)
        costs = StepCosts()
        with costs if counting else _nothing():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    return costs


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def graph_breaks(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Graph breaks and graphs dynamo counts in one compiled training step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": int(counters["stats"]["unique_graphs"])}


def _options(case: str) -> dict[str, Any]:
    if case == "cp2":
        return {"cp": 2}
    return {"tp": 2, "sequence_parallel": case == "tp2-sp"}


def rank_costs(rank: int, world_size: int, cases: list[str], layers: int, hidden: int,
               vocab: int, batch: int, seq: int, compile: bool) -> list[dict[str, Any]]:
    """Per case: this rank's step costs and the unsharded model's (run in each process)."""
    import autotp

    torch.set_num_threads(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids, "labels": ids}
    rows = []
    for case in cases:
        dropout = 0.1 if case == "tp2-dropout" else 0.0
        model = build(layers, hidden, vocab, dropout)
        reference = counted_step(model, ids)
        sharded = autotp.parallelize(model, example_kwargs=example, gather_outputs=False,
                                     **_options(case))
        with waits_counted_apart():
            costs = counted_step(sharded, ids)
        row: dict[str, Any] = {
            "case": case, "rank": rank,
            "unsharded_ops": reference.total, "rank_ops": costs.total,
            "ratio": costs.total / reference.total,
            "transport_ops": sum(costs.transport.values()),
            "transport": dict(costs.transport.most_common()),
            "excess": dict((costs.ops - reference.ops).most_common()),
            "fewer": dict((reference.ops - costs.ops).most_common()),
            "unsharded_syncs": dict(reference.syncs), "rank_syncs": dict(costs.syncs),
            "log_events": len(getattr(sharded.comm.log, "events", ())),
        }
        if compile:
            row["unsharded_compile"] = graph_breaks(torch.compile(model, backend="eager"), ids)
            compiled = autotp.parallelize(build(layers, hidden, vocab, dropout),
                                          example_kwargs=example, gather_outputs=False,
                                          compile={"backend": "eager"}, **_options(case))
            row["rank_compile"] = graph_breaks(compiled, ids)
        rows.append(row)
    return rows


def _syncs(found: dict[str, int]) -> str:
    return ", ".join(f"{k.split('::')[1]} {v}" for k, v in sorted(found.items())) or "0"


def _breaks(row: Mapping[str, Any]) -> str:
    if "rank_compile" not in row:
        return ""
    u, r = row["unsharded_compile"], row["rank_compile"]
    return (f"{u['graph_breaks']} ({u['graphs']} graphs) | "
            f"{r['graph_breaks']} ({r['graphs']} graphs)")


COLUMNS = [
    Column("case", 12, "case", left=True), Column("unsharded", 9, "unsharded_ops"),
    Column("rank", 7, "rank_ops"),
    Column("in waits", 8, "transport_ops"),
    Column("ratio", 6, cell=lambda r: ratio_text(r["ratio"], suffix="x")),
    Column(" host syncs (unsharded | rank)", 32, left=True,
           cell=lambda r: f" {_syncs(r['unsharded_syncs']):<12} | {_syncs(r['rank_syncs'])}"),
    Column("graph breaks (unsharded | rank)", 1, cell=_breaks, left=True),
]


def report(rows: list[dict[str, Any]], top: int) -> str:
    lines = [header(COLUMNS)]
    for row in rows:
        lines.append(line(COLUMNS, row))
        excess = list(row["excess"].items())[:top]
        lines.append("    more: " + ", ".join(f"{k.split('::')[-1]} +{v}" for k, v in excess))
        fewer = list(row["fewer"].items())[:top]
        lines.append("    fewer: " + ", ".join(f"{k.split('::')[-1]} -{v}" for k, v in fewer))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--top", type=int, default=8, help="op kinds listed per case")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--json", help="write the rows (both ranks) here")
    args = parser.parse_args(argv)

    import transformers  # noqa: F401 - preloaded by the workers' fork server

    from autotp.runtime.launch import run_processes

    per_rank = run_processes(rank_costs, 2, args.cases, args.layers, args.hidden, args.vocab,
                             args.batch, args.seq, args.compile, timeout=1800.0)
    print(report(per_rank[0], args.top))
    if args.json:
        write_json(args.json, [row for rows in per_rank for row in rows])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
