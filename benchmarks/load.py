"""Loading a LLaMA-shaped checkpoint: autotp.from_pretrained against the naive path.

    python -m benchmarks.load                 # ~1.1B parameters, bf16, tp 1, 2, 4
    python -m benchmarks.load --layers 4      # smaller and faster
    python -m benchmarks.load --fresh --tp 1 --layers 24 --hidden 1024 --intermediate 4096 \
        --heads 16 --kv-heads 8 --shard-mb 200  # 0.44B: start-up in fresh processes

``--fresh``: each load is a new interpreter, timed from its start to the loaded model
(imports included), one gloo process at tp 1 against transformers' own ``from_pretrained``
of the same directory; prints both and their ratio.

Writes a checkpoint with random weights (bf16, several safetensors files, streamed: the
writer never holds the model), then loads it in CPU processes (gloo) at each tp, two ways,
interleaved:

    autotp   autotp.from_pretrained(dir, tp): the model on meta, each rank reads its slices
    naive    transformers' from_pretrained (the whole model on every rank), then
             autotp.parallelize

and prints wall time and peak resident memory (VmHWM) per rank, next to an empty process
(the same imports and process group, nothing loaded) and the rank's share of the weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from autotp.runtime.launch import run_processes
from benchmarks.harness import (Stopwatch, Timing, print_row, ratio, ratio_text, round_robin,
                                time_round_robin)


def _config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=2048, dtype=torch.bfloat16,
        architectures=["LlamaForCausalLM"])


def write_checkpoint(args: argparse.Namespace, directory: Path) -> int:
    """Random bf16 weights in transformers' layout, one tensor in memory at a time."""
    import transformers

    from autotp.weights.tensorfile import Spec, file_names, plan_files, write_file, write_index

    config = _config(args)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    specs = [Spec(name, torch.bfloat16, tuple(p.shape))
             for name, p in model.named_parameters()]
    groups = plan_files(specs, int(args.shard_mb * 2**20))
    names = file_names(len(groups))
    generator = torch.Generator().manual_seed(0)

    def produce(spec: Spec) -> torch.Tensor:
        return (0.02 * torch.randn(spec.shape, generator=generator)).to(torch.bfloat16)

    directory.mkdir(parents=True, exist_ok=True)
    for name, group in zip(names, groups):
        write_file(directory / name, group, produce)
    write_index(directory, names, groups)
    config.save_pretrained(directory)
    return sum(s.nbytes for s in specs)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def load_case(rank: int, world_size: int, directory: str, mode: str) -> dict[str, float]:
    import transformers

    import autotp

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    clock = Stopwatch()
    hf_time = 0.0
    if mode == "autotp":
        sharded = autotp.from_pretrained(directory, tp=world_size)
    elif mode == "naive":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                                  dtype=torch.bfloat16)
        hf_time = clock.seconds
        sharded = autotp.parallelize(model, tp=world_size)
        del model
    else:
        sharded = None
    seconds = clock.seconds
    local = 0 if sharded is None else sum(
        t.numel() * t.element_size() for t in [*sharded.parameters(), *sharded.buffers()])
    return {"seconds": seconds, "hf_seconds": hf_time, "peak": _status("VmHWM"),
            "local": local}


FRESH_HF = """
import time
start = time.perf_counter()
import torch, transformers
transformers.logging.set_verbosity_error()
transformers.AutoModelForCausalLM.from_pretrained({directory!r}, dtype=torch.bfloat16)
print("seconds", time.perf_counter() - start)
"""

FRESH_AUTOTP = """
import time
start = time.perf_counter()
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r})
dist.init_process_group("gloo", rank=0, world_size=1)
import transformers, autotp
transformers.logging.set_verbosity_error()
autotp.from_pretrained({directory!r}, tp=1)
print("seconds", time.perf_counter() - start)
dist.destroy_process_group()
"""


def fresh(directory: Path, reps: int) -> None:
    """Wall time of a fresh process that loads the checkpoint, from the interpreter's start:
    transformers' from_pretrained and autotp's at tp 1 (imports included in both)."""
    import subprocess

    from autotp.runtime.launch import free_port

    def fresh_process(code: Callable[[], str]) -> Callable[[], Any]:
        return lambda: subprocess.run([sys.executable, "-c", code()], check=True,
                                      capture_output=True)

    times = time_round_robin({  # interleaved
        "transformers": fresh_process(lambda: FRESH_HF.format(directory=str(directory))),
        "autotp": fresh_process(lambda: FRESH_AUTOTP.format(directory=str(directory),
                                                            port=str(free_port())))},
        warmup=0, repeats=reps)
    row = {"transformers_s": times["transformers"].median, "autotp_s": times["autotp"].median,
           "ratio": ratio(times["autotp"], times["transformers"], paired=False)}
    print(f"fresh process, tp 1: autotp.from_pretrained {row['autotp_s']:.1f} s, "
          f"transformers' from_pretrained {row['transformers_s']:.1f} s: "
          f"{ratio_text(row['ratio'], suffix='x')}", flush=True)
    print_row(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=500.0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--dir", default=None, help="keep the checkpoint here (default: temp)")
    parser.add_argument("--fresh", action="store_true",
                        help="time fresh processes at tp 1 instead (imports included)")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="autotp-load-"))
    clock = Stopwatch()
    full = write_checkpoint(args, root)
    params = full // 2
    print(f"checkpoint: {params / 1e9:.2f}B parameters, {full / 2**30:.2f} GiB bf16 in "
          f"{len(list(root.glob('*.safetensors')))} files, written in "
          f"{clock.seconds:.1f} s ({root})", flush=True)
    if args.fresh:
        fresh(root, max(args.reps, 3))
        args.tp = ""
    gib = 2**30
    rows = []
    for tp in [int(x) for x in args.tp.split(",") if x]:
        empty = max(r["peak"] for r in run_processes(load_case, tp, str(root), "empty",
                                                     timeout=1800))
        runs = round_robin(["autotp", "naive"],  # interleaved
                           lambda mode, tp=tp: run_processes(load_case, tp, str(root), mode,
                                                             timeout=1800),
                           repeats=args.reps)
        row = {"tp": tp, "empty": empty / gib, "share": full / tp / gib}
        for mode, reps in runs.items():  # a repetition's time: the slowest rank's
            row[f"{mode}_s"] = Timing(tuple(max(r["seconds"] for r in rep) for rep in reps)).median
            row[f"{mode}_peak"] = max(r["peak"] for rep in reps for r in rep) / gib
        row["hf_s"] = Timing(tuple(max(r["hf_seconds"] for r in rep)
                                   for rep in runs["naive"])).median
        row["bound"] = 1.15 * full / tp / gib + row["empty"]
        rows.append(row)
        print_row(row)
    if rows:
        print()
        print("| tp | share of weights | empty process | autotp peak RSS | naive peak RSS | "
              "autotp ≤ 1.15 × share + empty | autotp load | transformers load | naive total |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            ok = "yes" if r["autotp_peak"] <= r["bound"] else "NO"
            print(f"| {r['tp']} | {r['share']:.2f} GiB | {r['empty']:.2f} GiB | "
                  f"{r['autotp_peak']:.2f} GiB | {r['naive_peak']:.2f} GiB | {ok} "
                  f"({r['bound']:.2f} GiB) | {r['autotp_s']:.1f} s | {r['hf_s']:.1f} s | "
                  f"{r['naive_s']:.1f} s |")
    if not args.dir:
        for file in root.iterdir():
            os.remove(file)
        root.rmdir()


if __name__ == "__main__":
    main()
