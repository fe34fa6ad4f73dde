"""Decoding speed: autotp's generate() against torch DTensor and the unsharded model.

    python -m benchmarks.decode                          # LLaMA h=1024, 12 layers, 4 k/v heads
    python -m benchmarks.decode --tp 2 --batch 8 --new-tokens 32 --layers 4

For each tp, ``tp`` gloo processes build from the same weights (a transformers
``LlamaForCausalLM``):

    unsharded   the model itself (timed at tp=1 only: at tp>1 every rank would run it)
    dtensor     torch's ``parallelize_module``: q/k/v, gate/up column-wise, o/down row-wise,
                the embedding row-wise and the head column-wise with replicated outputs;
                attention runs on local heads, the model's own cache holds them
    autotp      ``autotp.parallelize(model, tp)``
    hf-tp-plan  transformers' own tensor parallelism, ``from_pretrained(dir, tp_plan="auto")``
                (the model saved once by rank 0; needs the accelerate package, else skipped)

and runs transformers' ``generate`` (greedy) on each, interleaved round-robin (each repetition
starting with the next implementation). A decode step's time is the median interval between
consecutive steps' logits (a logits processor notes them), over every step of every
repetition, the slowest rank's: the prefill and generate's setup are not in it, and the
median keeps a burst of other work on the machine out. The ratios against DTensor and the
unsharded model pair repetitions: the median over repetitions of the two step times' ratio
in that repetition, which cancels a shared machine's drift between repetitions
(``--impls ...,control`` times a copy of the unsharded model too: the spread of equal runs).
Also reported: tokens per second over the decode steps (batch / step time), per-rank weight and
KV-cache bytes, and whether the tokens equal the unsharded model's. On CPU the ranks share
this machine's cores, one thread each when there are more ranks than cores.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import Column, Timing, round_robin


def build_model(args: argparse.Namespace) -> Any:
    import transformers as tf

    tf.logging.set_verbosity_error()
    config = tf.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new_tokens + 8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    return model.to(device(args), getattr(torch, args.dtype))


def device(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", dist.get_rank() if dist.is_initialized() else 0)
    return torch.device("cpu")


def dtensor_model(model: Any, tp: int, kind: str) -> Any:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(kind, (tp,))
    copy_ = copy.deepcopy(model)
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(copy_.model.layers)):
        prefix = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[prefix + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[prefix + name] = RowwiseParallel()
    return parallelize_module(copy_, mesh, plan)


def hf_tp_plan(model: Any, rank: int, world: int, args: argparse.Namespace) -> Any:
    """transformers' ``tp_plan="auto"`` load of the same weights, or None without accelerate."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("accelerate") is None:
        return None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    directory = os.path.join(tempfile.gettempdir(), f"autotp-decode-{os.getppid()}")
    if rank == 0:
        model.save_pretrained(directory)
    dist.barrier()
    loaded = type(model).from_pretrained(directory, tp_plan="auto", dtype=model.dtype).eval()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    return loaded


def local_bytes(module: torch.nn.Module) -> int:
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def cache_bytes(cache: Any) -> int:
    if hasattr(cache, "nbytes") and isinstance(cache.nbytes, int):
        return cache.nbytes
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


class Eager:
    """A sharded model whose decode steps run op by op (no CUDA graph)."""

    def __init__(self, sharded: Any):
        self.sharded = sharded

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.sharded.generate(*args, cuda_graphs=False, **kwargs)

    def parameters(self) -> Any:
        return self.sharded.parameters()


class StepClock:
    """A logits processor that notes when each step's logits arrive: the intervals are the
    decode steps (the model's forward plus generate's own work, the same for every
    implementation)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import autotp
    from transformers import LogitsProcessorList

    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = build_model(args)
    impls: dict[str, Any] = {}
    if world == 1:
        impls["unsharded"] = model
        if "control" in args.impls:  # the same model again: how far apart equal runs land
            import copy

            impls["control"] = copy.deepcopy(model)
    impls["dtensor"] = dtensor_model(model, world, args.device)
    impls["autotp"] = autotp.parallelize(model, tp=world)
    if args.device == "cuda":  # autotp's decode step without its CUDA graph
        impls["autotp-eager"] = Eager(impls["autotp"])
    hf = hf_tp_plan(model, rank, world, args) if "hf-tp-plan" in args.impls else None
    if hf is not None:
        impls["hf-tp-plan"] = hf
    impls = {name: module for name, module in impls.items() if name in args.impls}
    generator = torch.Generator().manual_seed(1)
    rows = []
    for batch in args.batch:
        ids = torch.randint(3, args.vocab, (batch, args.prompt), generator=generator)
        ids = ids.to(device(args))
        mask = torch.ones_like(ids)

        def generate(module: Any, new: int, ids: torch.Tensor = ids,
                     mask: torch.Tensor = mask) -> tuple[list[float], Any]:
            clock = StepClock()
            dist.barrier()
            out = module.generate(ids, attention_mask=mask, max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False,
                                  logits_processor=LogitsProcessorList([clock]),
                                  return_dict_in_generate=True)
            return clock.steps(), out

        for module in impls.values():  # warm-up: builds the decoding programs
            generate(module, 2)
        names = list(impls)
        runs = round_robin(names, lambda name: generate(impls[name], args.new_tokens),
                           repeats=args.reps, rotate=True)
        outputs = {name: runs[name][-1][1] for name in names}
        times = {name: Timing(tuple(t for steps, _ in runs[name] for t in steps))
                 for name in names}
        per_rep = {name: [Timing(tuple(steps)).median for steps, _ in runs[name]]
                   for name in names}
        medians = torch.tensor([[times[name].median] + per_rep[name]
                                for name in names], dtype=torch.float64, device=device(args))
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
        reference = outputs.get("unsharded", outputs.get("dtensor", outputs["autotp"])).sequences
        for name, (step, *reps) in zip(names, medians.tolist()):
            module = impls[name]
            rows.append({
                "tp": world, "batch": batch, "impl": name, "step_ms": 1e3 * step,
                "rep_ms": [1e3 * r for r in reps],
                "tokens_per_s": batch / step,
                "weight_bytes": local_bytes(module),
                "cache_bytes": cache_bytes(outputs[name].past_key_values),
                "same_tokens": bool(torch.equal(outputs[name].sequences, reference)),
            })
    return rows


def ratio(row: dict[str, Any], reference: dict[str, Any]) -> float:
    """``row``'s step time over ``reference``'s: where both ran in the same process, the
    median of the per-repetition ratios (each pair ran minutes apart at most, so the drift
    of a shared machine cancels), else the ratio of the medians."""
    if row["tp"] == reference["tp"] and len(row["rep_ms"]) == len(reference["rep_ms"]):
        return harness.ratio(row["rep_ms"], reference["rep_ms"])
    return row["step_ms"] / reference["step_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--tp", type=ints, default=[1, 2, 4])
    parser.add_argument("--batch", type=ints, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--impls", type=lambda text: text.split(","),
                        default=["unsharded", "dtensor", "autotp", "autotp-eager", "hf-tp-plan"],
                        help="also: control (a copy of the unsharded model, timed as one "
                        "more implementation: the spread of equal runs)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="append one JSON line per row")
    args = parser.parse_args()

    from autotp.runtime.launch import run_processes

    rows: list[dict[str, Any]] = []
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda" and max(args.tp) > torch.cuda.device_count():
        raise SystemExit(f"--tp {max(args.tp)} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    for tp in args.tp:
        rows += run_processes(worker, tp, args, backend=backend, timeout=3600)[0]
    by_key = {(r["tp"], r["batch"], r["impl"]): r for r in rows}
    print(f"LLaMA h={args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} "
          f"k/v heads, vocab {args.vocab}; prompt {args.prompt}, {args.new_tokens} new tokens; "
          f"{args.dtype}; " + (torch.cuda.get_device_name() if args.device == "cuda" else
                               f"{os.cpu_count()} cores"))

    def against(impl: str, tp: Optional[int] = None) -> Callable[[Mapping[str, Any]], str]:
        def cell(r: Mapping[str, Any]) -> str:
            reference = by_key.get((tp or r["tp"], r["batch"], impl))
            return harness.ratio_text(ratio(r, reference) if reference else None)
        return cell

    mib = 2**20
    print(harness.table([
        Column("tp", 3, "tp"), Column("batch", 5, "batch"), Column("impl", 10, "impl"),
        Column("step ms", 8, "step_ms", ".1f"), Column("tok/s", 7, "tokens_per_s", ".1f"),
        Column("vs dtensor", 10, cell=against("dtensor")),
        Column("vs tp1", 7, cell=against("unsharded", tp=1)),
        Column("weights MiB", 11, cell=lambda r: f"{r['weight_bytes'] / mib:.1f}"),
        Column("cache MiB", 9, cell=lambda r: f"{r['cache_bytes'] / mib:.2f}"),
        Column("same", 5, cell=lambda r: str(r["same_tokens"]))], rows))
    if args.out:
        harness.append_rows(args.out, rows)


if __name__ == "__main__":
    main()
