"""Tensor-parallel training steps: autotp against hand-written Megatron and torch DTensor.

    python -m benchmarks.tp_bench                                 # CPU/gloo: gpt2, llama at tp 2, 4
    python -m benchmarks.tp_bench --models llama --tp 2 --reps 30 --size medium
    python -m benchmarks.tp_bench --device cuda --tp 1 --size base --dtype bfloat16

For each model and tp, ``tp`` processes build every implementation from the same weights and
feed them the same batch:

    unsharded         the reference model on every rank (no communication)
    megatron          benchmarks/megatron_ref.py (f/g operators, vocabulary-parallel loss)
    dtensor           torch's parallelize_module with the per-linear recipe
    dtensor-prepare   the same plus PrepareModuleInput on attention/MLP (one input all-reduce
                      per module in backward)
    autotp            autotp.parallelize(model, example_args=(idx, targets))
    autotp-compile    the same with compile=True (opt-in: --impls ...,autotp-compile)
    megatron-compile  torch.compile of the megatron module (opt-in, the reference for
                      autotp-compile: dynamo traces its c10d all-reduces as functional ones)

and measures, per implementation: the loss and full gradients of one step against the
unsharded model; one instrumented step (collectives executed, by phase and kind, and their
bytes; memory allocated during the step); then ``--warmup`` and ``--reps`` timed steps
(forward, backward, optimizer step, zero_grad), round-robin across the implementations so
that drifts of the machine hit all of them alike. A rep's time is the slowest rank's.

Writes one JSON line per (model, tp, implementation) to ``--out`` and prints a summary.
On CPU, tp processes share this machine's cores (one thread each): with more ranks than
cores the unsharded rows time the oversubscribed machine, not one core.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import bench_models as bm
from benchmarks.harness import (Column, Stopwatch, Timing, append_rows, ratio, ratio_text,
                                table, time_round_robin, write_rows)
from benchmarks.step_probe import StepProbe

IMPLS = ("unsharded", "megatron", "dtensor", "dtensor-prepare", "autotp")
# torch.compile (inductor) of each rank's program and of the hand-written reference
OPTIONAL_IMPLS = ("autotp-compile", "megatron-compile")


@dataclass
class Impl:
    name: str
    module: nn.Module
    optimizer: Any  # step() and zero_grad(set_to_none=True)
    context: Callable[[], ContextManager[Any]]  # forward and backward run inside it
    full_grads: Callable[[], dict[str, torch.Tensor]]  # collective
    local_params: Callable[[], dict[str, torch.Tensor]]  # reference name -> local tensor


def _optimizer(name: str, params: list[nn.Parameter], lr: float,
               foreach: Optional[bool] = None) -> torch.optim.Optimizer:
    """``foreach=None``: torch's default (the multi-tensor kernels on CUDA, not on CPU)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    raise ValueError(f"unknown optimizer {name!r}")


class _PerKind:
    """One optimizer over the DTensor parameters and one over the plain ones (norms, biases
    that ``parallelize_module`` leaves alone): the multi-tensor (foreach) kernels, torch's
    default on CUDA, refuse a list mixing the two."""

    def __init__(self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 params: list[nn.Parameter]):
        from torch.distributed.tensor import DTensor

        kinds = ([p for p in params if isinstance(p, DTensor)],
                 [p for p in params if not isinstance(p, DTensor)])
        self.optimizers = [make(kind) for kind in kinds if kind]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_impl(name: str, ref: nn.Module, rank: int, tp: int, example: tuple,
               spec: dict[str, Any]) -> Impl:
    """Implementation ``name`` of this rank, built from the unsharded ``ref``'s weights."""
    from contextlib import nullcontext

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return _optimizer(spec["optim"], params, spec["lr"], spec.get("foreach"))

    opt = lambda m: make(list(m.parameters()))  # noqa: E731
    if name == "unsharded":
        model = copy.deepcopy(ref)
        return Impl(name, model, opt(model), nullcontext,
                    lambda: {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                    lambda: dict(model.named_parameters()))
    if name in ("megatron", "megatron-compile"):
        from benchmarks import megatron_ref

        meg = megatron_ref.from_reference(ref, rank, tp, None)
        run = torch.compile(meg) if name == "megatron-compile" else meg
        return Impl(name, run, opt(meg), nullcontext,
                    lambda: megatron_ref.full_grads(ref, meg),
                    lambda: megatron_ref.local_params(ref, meg))
    if name in ("dtensor", "dtensor-prepare"):
        from benchmarks import dtensor_ref
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(spec["device"], (tp,))
        dmod = dtensor_ref.parallelize(ref, mesh, prepare_inputs=name == "dtensor-prepare")
        return Impl(name, dmod, _PerKind(make, list(dmod.parameters())),
                    dtensor_ref.loss_context,
                    lambda: dtensor_ref.full_grads(dmod),
                    lambda: dtensor_ref.local_params(dmod))
    if name in ("autotp", "autotp-compile"):
        import autotp

        sharded = autotp.parallelize(copy.deepcopy(ref), tp=tp, example_args=example,
                                     compile=name == "autotp-compile")

        def autotp_local() -> dict[str, torch.Tensor]:
            out = {}
            for target, tensor in sharded.local_parameters().items():
                for ref_name in sharded.plan.params[target].names:
                    out[ref_name] = tensor
            return out

        return Impl(name, sharded, opt(sharded), nullcontext,
                    lambda: autotp.full_state_dict(sharded, grads=True), autotp_local)
    raise ValueError(f"unknown implementation {name!r}; choose from {IMPLS}")


def _value(loss: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def train_step(impl: Impl, idx: torch.Tensor, targets: torch.Tensor,
               probe: Optional[StepProbe] = None) -> torch.Tensor:
    """Forward, backward, optimizer step, zero_grad; ``probe.phase`` follows along."""
    with impl.context():
        if probe is not None:
            probe.phase = "forward"
        loss = impl.module(idx, targets)
        if probe is not None:
            probe.phase = "backward"
        loss.backward()
    if probe is not None:
        probe.phase = "optimizer"
    impl.optimizer.step()
    impl.optimizer.zero_grad(set_to_none=True)
    return loss


def check_step(impl: Impl, idx: torch.Tensor, targets: torch.Tensor,
               ref_grads: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Forward and backward only: the loss and the diffs of every full gradient."""
    with impl.context():
        loss = impl.module(idx, targets)
        loss.backward()
    grads = impl.full_grads()
    impl.optimizer.zero_grad(set_to_none=True)
    missing = sorted(set(ref_grads) - set(grads))
    if missing:
        raise RuntimeError(f"{impl.name}: no gradient for {missing}")
    return _value(loss), grads


def param_bytes(ref: nn.Module, local: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    """This rank's parameter bytes, and the bound sharded/tp + replicated from the unsharded
    sizes and this implementation's split (a parameter is sharded if its local piece is
    smaller than the full one)."""
    seen, local_bytes, bound, full_bytes, replicated = set(), 0, 0.0, 0, []
    for name, param in ref.named_parameters():
        piece = local[name]
        nbytes = param.numel() * param.element_size()
        full_bytes += nbytes
        if piece.numel() < param.numel():
            bound += nbytes / tp
        else:
            bound += nbytes
            if param.dim() >= 2:
                replicated.append(name)
        if piece.data_ptr() not in seen:
            seen.add(piece.data_ptr())
            local_bytes += piece.numel() * piece.element_size()
    return {"param_bytes": local_bytes, "param_bytes_bound": int(bound),
            "param_bytes_full": full_bytes, "replicated_matrices": replicated}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _barrier(device: str) -> None:
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag)
    _sync(device)


def bench_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: build, check, instrument and time every implementation."""
    torch.set_num_threads(1)
    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    dtype = getattr(torch, spec["dtype"])
    cfg = bm.make_config(spec["model"], spec["size"], **spec["overrides"])
    ref = bm.build_model(cfg, seed=spec["seed"]).to(device=device, dtype=dtype)
    idx, targets = bm.make_batch(cfg, spec["batch"], seed=spec["seed"] + 1, device=device)
    ref_loss = ref(idx, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    grad_scale = max(g.abs().max().item() for g in ref_grads.values())

    impls: dict[str, Impl] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in spec["impls"]:
        row: dict[str, Any] = {"impl": name}
        rows[name] = row
        try:
            impl = build_impl(name, ref, rank, world_size, (idx, targets), spec)
            loss, grads = check_step(impl, idx, targets, ref_grads)
            row["loss"] = loss
            row["loss_diff"] = abs(loss - float(ref_loss))
            diffs = {n: (grads[n].float() - g.float()).abs().max().item()
                     for n, g in ref_grads.items()}
            worst = max(diffs, key=diffs.__getitem__)
            row["grad_diff"] = diffs[worst]
            row["grad_diff_param"] = worst
            row["grad_rel"] = diffs[worst] / grad_scale
            row.update(param_bytes(ref, impl.local_params(), world_size))
            del grads
            train_step(impl, idx, targets)  # creates the optimizer state
            impls[name] = impl
        except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=6)
        # every rank must run the same implementations, or the collectives mismatch
        oks: list[Any] = [None] * world_size
        dist.all_gather_object(oks, "error" not in row)
        if not all(oks) and name in impls:
            del impls[name]
            row.setdefault("error", "failed on another rank")

    for name, impl in impls.items():  # one instrumented step each
        _barrier(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        own_log = getattr(getattr(impl.module, "comm", None), "log", None)
        if name == "autotp" and own_log is not None:
            own_log.clear()  # autotp's own record of the collectives it ran, to cross-check
        probe = StepProbe()
        with probe:
            train_step(impl, idx, targets, probe)
        _sync(device)
        row = rows[name]
        row["collectives"] = probe.counts()
        row["collective_bytes"] = probe.bytes()
        row["peak_step_bytes"] = probe.peak_bytes
        if name == "autotp" and own_log is not None:
            row["autotp_log_collectives"] = _log_counts(own_log.events)
        if device == "cuda":
            row["cuda_peak_step_bytes"] = torch.cuda.max_memory_allocated() - before

    steps = {name: functools.partial(train_step, impl, idx, targets)
             for name, impl in impls.items()}
    times = time_round_robin(steps, warmup=spec["warmup"], repeats=spec["reps"],
                             before=lambda: _barrier(device), after=lambda: _sync(device))
    for name in impls:
        rows[name]["times"] = list(times[name].seconds)
    _barrier(device)
    return {"rows": [rows[n] for n in spec["impls"]], "flops": bm.train_flops(
        cfg, ref, spec["batch"], cfg.seq_len), "config": cfg.__dict__.copy()}


def _log_counts(events: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for event in events:
        kinds = out.setdefault(event.phase, {})
        kinds[event.kind] = kinds.get(event.kind, 0) + 1
    return {phase: dict(sorted(k.items())) for phase, k in sorted(out.items())}


# ---- aggregation and report ----------------------------------------------------------------


def combine(results: list[dict[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Per implementation: the ranks' rows merged (times: slowest rank per rep; diffs and
    memory: the largest over ranks). The ratios are of the medians."""
    out = []
    timings: dict[str, Timing] = {}
    for i in range(len(spec["impls"])):
        per_rank = [r["rows"][i] for r in results]
        row = dict(per_rank[0])
        row.pop("times", None)
        row.update(model=spec["model"], tp=spec["tp"], device=spec["device"],
                   dtype=spec["dtype"], batch=spec["batch"], config=results[0]["config"],
                   optim=spec["optim"])
        errors = [r.get("error") for r in per_rank if r.get("error")]
        if errors:
            row["error"] = errors[0]
            out.append(row)
            continue
        for key in ("loss_diff", "grad_diff", "grad_rel", "peak_step_bytes",
                    "cuda_peak_step_bytes", "param_bytes"):
            if key in row:
                row[key] = max(r[key] for r in per_rank)
        reps = Timing(tuple(max(ts) for ts in zip(*(r["times"] for r in per_rank))))
        timings[row["impl"]] = reps
        row["step_ms"] = [1e3 * t for t in reps.seconds]
        row.update(reps.stats_ms())
        row["tflops_per_device"] = results[0]["flops"] / reps.median / spec["tp"] / 1e12
        out.append(row)
    for row in out:
        if "error" in row:
            continue
        for other in ("megatron", "unsharded"):
            if other in timings:
                row[f"time_vs_{other}"] = ratio(timings[row["impl"]], timings[other],
                                                paired=False)
        if "megatron" in timings and row["impl"] != "unsharded":
            meg = next(r for r in out if r["impl"] == "megatron")
            row["collectives_equal_megatron"] = row["collectives"] == meg["collectives"]
            row["bytes_equal_megatron"] = row["collective_bytes"] == meg["collective_bytes"]
    return out


def _count_text(counts: dict[str, dict[str, int]], phase: str) -> str:
    short = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs"}
    kinds = counts.get(phase, {})
    return " ".join(f"{n}{short.get(k, k)}" for k, n in kinds.items()) or "0"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _colls(phase: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda r: _count_text(r["collectives"], phase)


COLUMNS = [
    Column("model", 5, "model", left=True), Column("tp", 2, "tp"),
    Column("impl", 15, "impl", left=True),
    Column("median ms", 9, "median_ms", ".1f"), Column("min", 8, "min_ms", ".1f"),
    Column("IQR", 7, "iqr_ms", ".1f"),
    Column("/megatron", 9, cell=lambda r: ratio_text(r.get("time_vs_megatron"))),
    Column("/unshard", 8, cell=lambda r: ratio_text(r.get("time_vs_unsharded"))),
    Column(" fwd colls", 11, cell=_colls("forward"), left=True),
    Column("bwd colls", 10, cell=_colls("backward"), left=True),
    Column("coll MB", 7, cell=lambda r: _mb(sum(sum(k.values())
                                                for k in r["collective_bytes"].values()))),
    Column("=meg", 5, cell=lambda r: _yes(r.get("collectives_equal_megatron"))),
    Column("=bytes", 6, cell=lambda r: _yes(r.get("bytes_equal_megatron"))),
    Column("param MB", 8, cell=lambda r: _mb(r["param_bytes"])),
    Column("bound", 6, cell=lambda r: _mb(r["param_bytes_bound"])),
    Column("peak MB", 7, cell=lambda r: _mb(r.get("cuda_peak_step_bytes",
                                                   r["peak_step_bytes"]))),
    Column("loss diff", 9, "loss_diff", ".1e"), Column("grad diff", 9, "grad_diff", ".1e"),
]


def print_table(rows: list[dict[str, Any]], device: str) -> None:
    columns = COLUMNS + ([Column("TFLOP/s", 8, "tflops_per_device", ".2f")]
                         if device == "cuda" else [])
    print(table(columns, [r for r in rows if "error" not in r]))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<6}{r['tp']:>3} {r['impl']:<16}"
                  f"ERROR {r['error'].splitlines()[0][:150]}")


def _yes(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "no")


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """Checks worth a line under the table."""
    out = []
    megatron = {(r["model"], r["tp"]): r for r in rows
                if r["impl"] == "megatron" and "error" not in r}
    for r in rows:
        if "error" in r or r["tp"] < 2 or r["impl"] == "unsharded":
            continue
        meg = megatron.get((r["model"], r["tp"]), {})
        for phase in ("forward", "backward"):
            if not r["collectives"].get(phase):
                out.append(f"{r['model']} tp={r['tp']} {r['impl']}: no collective seen in "
                           f"{phase}")
        if meg:
            mine, theirs = set(r["replicated_matrices"]), set(meg["replicated_matrices"])
            if theirs - mine:
                out.append(f"{r['model']} tp={r['tp']} {r['impl']}: shards "
                           f"{sorted(theirs - mine)}, which megatron replicates")
            if mine - theirs:
                out.append(f"{r['model']} tp={r['tp']} {r['impl']}: replicates "
                           f"{sorted(mine - theirs)}, which megatron shards")
        own = r.get("autotp_log_collectives")
        if own is not None and own != {k: v for k, v in r["collectives"].items()
                                       if k != "optimizer"}:
            out.append(f"{r['model']} tp={r['tp']} autotp: its own log {own} differs from "
                       f"the counted collectives {r['collectives']}")
        if r.get("collectives") and r["collectives"].get("optimizer"):
            out.append(f"{r['model']} tp={r['tp']} {r['impl']}: optimizer collectives "
                       f"{r['collectives']['optimizer']}")
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    p.add_argument("--tp", default=None, help="comma-separated degrees (CPU: 2,4; cuda: 1)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--size", default=None, choices=sorted(bm.SIZES),
                   help="named size (default: small on CPU, base on cuda)")
    for flag in ("vocab-size", "seq-len", "n-layer", "n-head", "n-kv-head", "d-model"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="default: 4 on CPU, 8 on cuda")
    p.add_argument("--optim", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tp_bench.jsonl")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    from autotp.runtime.launch import run_processes

    args = parse_args(argv)
    cuda = args.device == "cuda"
    degrees = [int(t) for t in (args.tp or ("1" if cuda else "2,4")).split(",")]
    overrides = {k: getattr(args, k) for k in ("vocab_size", "seq_len", "n_layer", "n_head",
                                               "n_kv_head", "d_model")}
    if cuda and max(degrees) > torch.cuda.device_count():
        raise SystemExit(f"tp={max(degrees)} needs {max(degrees)} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    all_rows: list[dict[str, Any]] = []
    write_rows(args.out, [])
    for model in args.models.split(","):
        for tp in degrees:
            spec = dict(model=model, tp=tp, impls=args.impls.split(","), reps=args.reps,
                        warmup=args.warmup, device=args.device, dtype=args.dtype,
                        size=args.size or ("base" if cuda else "small"),
                        overrides=overrides, batch=args.batch or (8 if cuda else 4),
                        optim=args.optim, lr=args.lr, seed=args.seed)
            clock = Stopwatch()
            results = run_processes(bench_worker, tp, spec,
                                    backend="nccl" if cuda else "gloo", timeout=1800)
            rows = combine(results, spec)
            append_rows(args.out, rows, sort_keys=True)
            all_rows.extend(rows)
            print(f"# {model} tp={tp}: {clock.seconds:.0f} s, "
                  f"config {results[0]['config']}, batch {spec['batch']}", flush=True)
    print()
    print_table(all_rows, args.device)
    for line in notes(all_rows):
        print("note:", line)
    peak = ("cuda max_memory_allocated during the step, over the memory before it" if cuda else
            "bytes of tensors allocated during one step and alive at once (activations, grads,"
            " temporaries, comm buffers; parameters and optimizer state excluded)")
    print(f"peak MB: {peak}. coll MB: payload of every collective in one step. "
          f"bound: sharded/tp + replicated parameter bytes. Results: {args.out}")
    return 1 if any("error" in r for r in all_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
