"""One GPU's figures beside the estimator's: training steps, the ring attention, host syncs.

    python -m benchmarks.gpu_step                  # on one H100/H200, in under 7 minutes
    python -m benchmarks.gpu_step --dry-run        # the same code paths on the CPU, tiny sizes
    python -m benchmarks.gpu_step --parts step     # some parts only (step, ring, syncs)

Three parts, each under its own time budget (what starts after the budget is spent is
skipped with a line saying so) and its own ``try``: a failure prints one ``FAILED`` line
and the next part runs.

- ``step``: a bf16 training step (forward with ``labels=``, backward, AdamW, zero_grad) of a
  small GQA ``LlamaForCausalLM`` built from a config: the unsharded model eager and under
  ``torch.compile``; autotp at tp 1 and at tp 2 (``autotp.simulate``: both ranks threads
  sharing the one device), eager and with ``compile=True``. Per row: the median step time,
  ``torch.cuda.max_memory_allocated`` over the timed steps, and ``autotp.estimate``'s step
  time and memory per GPU for the same shape (mesh ``pp=1,dp=1,tp=N``, bf16 weights and
  Adam moments, no recomputation) on the matching preset (h100 or h200).
- ``ring``: ``benchmarks.ring_kernels`` at 16k tokens in bf16 (cp 2 against SDPA, forward
  and backward), beside the estimator's fused-attention time for the unsharded SDPA.
- ``syncs``: one whole training step at tp 2 + sequence parallelism and at cp 2 (simulated
  ranks) under ``torch.cuda.set_sync_debug_mode("error")``, after a step that warms; the
  first host synchronisation is reported as a ``FAIL`` line with the source line that asked
  for it. On the CPU (``--dry-run``) the ops that read a value on the host raise instead.

Rows go to ``--out`` (JSON lines, a row as it is measured), by default
``$OUT/gpu_step.jsonl`` where ``OUT`` is set, else ``/tmp/gpu_step.jsonl``.
``AUTOTP_GPU_CHECK_DRY=1`` is ``--dry-run``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import ring_kernels
from benchmarks.harness import Column, Stopwatch, append_rows, header, line, time_call


@dataclass(frozen=True)
class Sizes:
    """The shapes and repetitions of one run."""

    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32000
    batch: int = 4
    seq: int = 1024
    warmup: int = 3
    repeats: int = 10
    ring_seq: int = 16384
    ring_heads: int = 32
    ring_kv_heads: int = 8
    ring_dim: int = 128
    ring_repeats: int = 5


TINY = Sizes(layers=1, hidden=64, heads=4, kv_heads=2, vocab=256, batch=2, seq=32, warmup=2,
             repeats=2, ring_seq=256, ring_heads=4, ring_kv_heads=2, ring_dim=16,
             ring_repeats=1)
BUDGETS = {"step": 220.0, "ring": 60.0, "syncs": 90.0}  # seconds per part, on a device
PARTS = tuple(BUDGETS)
# the estimator's preset for a device whose name holds the key (else h100)
PRESETS = [("H200", "h200"), ("H100", "h100"), ("A100-SXM4-40GB", "a100-40gb"),
           ("A100", "a100-80gb"), ("V100", "v100")]
RANK_TIMEOUT = 600.0  # seconds a simulated rank waits for the other at a collective


@dataclass(frozen=True)
class Run:
    """Where and how this run measures."""

    device: torch.device
    sizes: Sizes
    hardware: str  # the estimator's preset
    backend: str  # torch.compile's (inductor on a device; eager on the CPU: no C++ needed)
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class OutOfBudget(Exception):
    """A part's time was spent before this item could start."""


class Budget:
    """A part's seconds; ``check(what, needs)`` raises ``OutOfBudget`` where fewer than
    ``needs`` of them are left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.clock = Stopwatch()

    def check(self, what: str, needs: float = 0.0) -> None:
        left = self.seconds - self.clock.seconds
        if left < needs or left <= 0:
            raise OutOfBudget(f"{what}: skipped, {max(left, 0):.0f} of the part's "
                              f"{self.seconds:.0f} s left")


def emit(run: Run, row: dict[str, Any]) -> None:
    append_rows(run.out, [row])


def failure(run: Run, part: str, what: str, exc: BaseException) -> None:
    """One line for a failed item (its traceback on stderr), and its row."""
    if isinstance(exc, OutOfBudget):
        print(f"  {part}: {exc}", flush=True)
        emit(run, {"part": part, "what": what, "skipped": str(exc)})
        return
    traceback.print_exc(file=sys.stderr)
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    print(f"  {part}: {what}: FAILED {type(exc).__name__}: {first}", flush=True)
    emit(run, {"part": part, "what": what, "error": f"{type(exc).__name__}: {first}"})


# ---- the model and its step ----------------------------------------------------------------


def build_model(sizes: Sizes, device: Any = "cpu") -> torch.nn.Module:
    """The GQA Llama of ``sizes`` in bf16 (seeded: every build has the same weights)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=sizes.layers, hidden_size=sizes.hidden,
        intermediate_size=sizes.hidden * 11 // 4 // 64 * 64 or 64,
        num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
        vocab_size=sizes.vocab, max_position_embeddings=max(sizes.seq, 128),
        attn_implementation="sdpa")
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()


def batch(run: Run) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, run.sizes.vocab, (run.sizes.batch, run.sizes.seq), generator=gen)
    return {"input_ids": ids.to(run.device), "labels": ids.to(run.device)}


class Stepper:
    """One training step of one module: forward with labels, backward, AdamW, zero_grad."""

    def __init__(self, module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        self.module, self.inputs = module, inputs
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, foreach=True)

    def __call__(self, around: Callable[[], ContextManager[Any]] = nullcontext) -> None:
        """``around``: what forward and backward run inside."""
        with around():
            out = self.module(**self.inputs)
            loss = out.loss if hasattr(out, "loss") else out["loss"]
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def steps_of(target: Any, inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """A call that runs one training step of a module, or of every rank of a Simulation."""
    if hasattr(target, "ranks"):
        steppers = {id(r): Stepper(r, inputs) for r in target.ranks}
        return lambda: target.run(lambda rank: steppers[id(rank)]())
    return Stepper(target, inputs)


def free(run: Run) -> None:
    """Drop what earlier rows left: compiled code (which holds its model) and cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


# ---- part 1: training steps beside the estimate --------------------------------------------


def predicted(run: Run, tp: int) -> dict[str, Any]:
    """``autotp.estimate``'s step time and memory per GPU for this shape at tp."""
    import autotp

    model = build_model(run.sizes, "meta")
    s = run.sizes
    est = autotp.estimate(model, gpus=tp, global_batch=s.batch, seq=s.seq,
                          hardware=run.hardware, mesh=(1, 1, tp), micro_batch=s.batch,
                          checkpointing="none", sequence_parallel=False, precision="bf16",
                          dtype="bfloat16", cp=1)
    config = est.best or est.configs[0]
    return {"pred_ms": 1e3 * config.time.step if config.time else None,
            "pred_mib": config.memory.total / 2**20 if config.memory else None,
            "pred_fits": config.fits}


class How(Enum):
    """How a step row's program runs."""

    EAGER = "eager"
    TORCH_COMPILE = "torch.compile"  # of the unsharded model
    AUTOTP_COMPILE = "compile=True"  # autotp's option: each rank's program compiled


STEP_ROWS = [  # (name, tp, how): eager rows first, the compiled ones (slow to start) last
    ("unsharded", 1, How.EAGER), ("autotp", 1, How.EAGER), ("autotp", 2, How.EAGER),
    ("unsharded", 1, How.TORCH_COMPILE), ("autotp", 1, How.AUTOTP_COMPILE),
    ("autotp", 2, How.AUTOTP_COMPILE),
]
COMPILE_SECONDS = 45.0  # a compiled row is not started with less of the part's time left
STEP_COLUMNS = [
    Column("model", 10, "impl", left=True), Column("tp", 3, "tp"),
    Column("how", 14, "how", left=True), Column("step ms", 8, "step_ms", ".2f"),
    Column("pred ms", 8, "pred_ms", ".2f"), Column("peak MiB", 9, "peak_mib", ".0f"),
    Column("pred MiB", 9, "pred_x_mib", ".0f"), Column("ranks/dev", 9, "ranks"),
]


def step_target(run: Run, impl: str, tp: int, how: How,
                inputs: dict[str, torch.Tensor]) -> Any:
    import autotp

    model = build_model(run.sizes, run.device)
    if impl == "unsharded":
        return torch.compile(model, backend=run.backend) if how is How.TORCH_COMPILE else model
    compile_option: Any = False
    if how is How.AUTOTP_COMPILE:
        compile_option = True if run.backend == "inductor" else {"backend": run.backend}
    # a rank compiling a segment keeps the other waiting at the next collective: a long
    # timeout, so that inductor's first compilations on a fresh machine fit in it
    return autotp.simulate(model, tp, example_kwargs=inputs, compile=compile_option,
                           timeout=RANK_TIMEOUT)


def measure_step(run: Run, impl: str, tp: int, how: How,
                 estimates: dict[int, dict[str, Any]]) -> dict[str, Any]:
    inputs = batch(run)
    base = torch.cuda.memory_allocated() / 2**20 if run.cuda else None  # left by earlier rows
    target = step_target(run, impl, tp, how, inputs)
    step = steps_of(target, inputs)
    sync = torch.cuda.synchronize if run.cuda else None
    for _ in range(run.sizes.warmup):  # traces, compiles, makes the optimizer's state
        step()
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timing = time_call(step, warmup=0, repeats=run.sizes.repeats, after=sync)
    ranks = tp if impl == "autotp" else 1
    pred = estimates.get(tp, {})
    row = {"part": "step", "impl": impl, "tp": tp, "how": how.value, "ranks": ranks,
           "step_ms": 1e3 * timing.median, **timing.stats_ms(),
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if run.cuda else None,
           "base_mib": base,
           **pred}
    if pred.get("pred_mib") is not None:
        row["pred_x_mib"] = pred["pred_mib"] * ranks  # every rank's memory on the one device
    del target, step
    free(run)
    return row


def part_step(run: Run, budget: Budget) -> None:
    s = run.sizes
    print(f"step: LlamaForCausalLM {s.layers} layers, hidden {s.hidden}, {s.heads}/"
          f"{s.kv_heads} heads, vocab {s.vocab}, batch {s.batch} x {s.seq} tokens, bf16, "
          f"AdamW; median of {s.repeats} after {s.warmup}; estimate on {run.hardware}",
          flush=True)
    budget.check("step")
    estimates: dict[int, dict[str, Any]] = {}
    for tp in (1, 2):
        try:
            estimates[tp] = predicted(run, tp)
        except Exception as exc:  # noqa: BLE001 - the measurements still run
            failure(run, "step", f"estimate tp {tp}", exc)
    print(header(STEP_COLUMNS), flush=True)
    for impl, tp, how in STEP_ROWS:
        what = f"{impl} tp {tp} {how.value}"
        try:
            budget.check(what, needs=5.0 if how is How.EAGER else COMPILE_SECONDS)
            row = measure_step(run, impl, tp, how, estimates)
            print(line(STEP_COLUMNS, row), flush=True)
            emit(run, row)
        except Exception as exc:  # noqa: BLE001 - one line, and the next row
            failure(run, "step", what, exc)
            free(run)


# ---- part 2: the ring attention --------------------------------------------------------------


def attention_prediction(run: Run) -> float:
    """The estimator's seconds for one causal fused attention forward and backward at the ring
    part's shape (planner/job/timing.py's model: FLOPs at the preset's attention efficiency,
    backward 2.5 x forward)."""
    from autotp.planner.job.hardware import hardware

    s = run.sizes
    hw = hardware(run.hardware)
    forward = 2 * 2 * s.ring_seq ** 2 * s.ring_dim * s.ring_heads / 2  # causal: half the pairs
    return forward * 3.5 / (hw.flops["bfloat16"] * hw.attention_efficiency)


def part_ring(run: Run, budget: Budget) -> None:
    s = run.sizes
    args = argparse.Namespace(seq=s.ring_seq, heads=s.ring_heads, kv_heads=s.ring_kv_heads,
                              dim=s.ring_dim, repeats=s.ring_repeats, device=str(run.device))
    print(f"ring: S={s.ring_seq}, {s.ring_heads}/{s.ring_kv_heads} heads, head dim "
          f"{s.ring_dim}, batch 1, causal, bf16, forward + backward, cp 2 on one "
          f"{run.device.type} (ring ms: both ranks' work); pred: the estimator's SDPA",
          flush=True)
    budget.check("ring bfloat16")
    row = ring_kernels.measure(args, "bfloat16")
    row.update(part="ring", seq=s.ring_seq, pred_sdpa_ms=1e3 * attention_prediction(run))
    columns = [*ring_kernels.COLUMNS, Column("pred sdpa", 9, "pred_sdpa_ms", ".2f")]
    print(header(columns), flush=True)
    print(line(columns, row), flush=True)
    emit(run, row)


# ---- part 3: host synchronisations through a step ----------------------------------------


class HostSyncError(RuntimeError):
    """The CPU's stand-in for ``set_sync_debug_mode("error")``'s error."""


class RaiseOnHostSync(TorchDispatchMode):
    """Raises at the first op that reads a tensor's value on the host."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in ring_kernels.SYNCS:
            raise HostSyncError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


@contextmanager
def sync_errors(run: Run) -> Iterator[None]:
    """Every host synchronisation inside raises: the device's debug mode (for every thread of
    the process), or on the CPU a dispatch mode (entered by each rank: modes are per thread)."""
    if not run.cuda:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def where(exc: BaseException) -> str:
    """The innermost source line of the traceback outside torch itself: the code that asked
    for the value (autotp's, transformers', the benchmark's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(Path(torch.__file__).parent)
    for frame in reversed(frames):
        if not frame.filename.startswith(torch_dir) and frame.name != "__torch_dispatch__":
            parts = Path(frame.filename).parts
            short = "/".join(parts[-3:])
            return f"{short}:{frame.lineno} ({frame.name}): {(frame.line or '').strip()}"
    return "?"


def is_host_sync(exc: BaseException) -> bool:
    """The error of a host sync: the CPU's stand-in, or the device's debug mode's."""
    return isinstance(exc, HostSyncError) or "called a synchronizing CUDA operation" in str(exc)


SYNC_CASES = [("unsharded", {}), ("tp2-sp", {"tp": 2, "sequence_parallel": True}),
              ("cp2", {"tp": 1, "cp": 2})]


def synced_step(run: Run, case: str, options: dict[str, Any]) -> dict[str, Any]:
    import autotp

    inputs = batch(run)
    model = build_model(run.sizes, run.device)
    target = (autotp.simulate(model, example_kwargs=inputs, timeout=RANK_TIMEOUT, **options)
              if options else model)
    steps = {id(r): Stepper(r, inputs) for r in getattr(target, "ranks", [target])}

    def one(module: torch.nn.Module, checked: bool) -> None:
        # on the CPU the optimizer's reads of its step counts (CPU tensors on a device too)
        # are not syncs: only forward and backward are checked there
        steps[id(module)](RaiseOnHostSync if checked and not run.cuda else nullcontext)

    def step(checked: bool) -> None:
        if hasattr(target, "ranks"):
            target.run(lambda module: one(module, checked))
        else:
            one(target, checked)

    step(False)  # traces, checks the plan, makes the optimizer's state
    if run.cuda:
        torch.cuda.synchronize()
    row: dict[str, Any] = {"part": "syncs", "case": case}
    try:
        with sync_errors(run):
            step(True)
        row["first_sync"] = None
    except Exception as exc:  # noqa: BLE001 - the finding this part reports
        if not is_host_sync(exc):
            raise  # another failure: a FAILED line, not a finding
        traceback.print_exception(exc, file=sys.stderr)  # the whole stack, in the log
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        row["first_sync"] = f"{type(exc).__name__}: {message} at {where(exc)}"
    finally:
        if run.cuda:
            torch.cuda.synchronize()
    return row


def part_syncs(run: Run, budget: Budget) -> None:
    how = 'set_sync_debug_mode("error")' if run.cuda else "host reads raise (CPU)"
    print(f"syncs: one training step after a warm one, {how}", flush=True)
    for case, options in SYNC_CASES:
        try:
            budget.check(case)
            row = synced_step(run, case, options)
            free(run)
            verdict = "ok: no host sync" if row["first_sync"] is None else \
                f"FAIL first host sync: {row['first_sync']}"
            print(f"  {case:<10} {verdict}", flush=True)
            emit(run, row)
        except Exception as exc:  # noqa: BLE001 - one line, and the next case
            failure(run, "syncs", case, exc)
            free(run)


# ---- the run ---------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Run, Budget], None]] = {
    "ring": part_ring, "syncs": part_syncs, "step": part_step}  # the quick ones first


def default_out() -> Path:
    return Path(os.environ.get("OUT") or "/tmp") / "gpu_step.jsonl"


def make_run(dry: bool, out: Optional[str]) -> Run:
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run (or AUTOTP_GPU_CHECK_DRY=1)")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    name = "" if dry else torch.cuda.get_device_name(device).upper()
    hardware = next((preset for key, preset in PRESETS if key in name), "h100")
    return Run(device=device, sizes=TINY if dry else Sizes(), hardware=hardware,
               backend="eager" if dry else "inductor", out=Path(out) if out else default_out())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        default=os.environ.get("AUTOTP_GPU_CHECK_DRY") == "1",
                        help="the same code paths on the CPU at tiny sizes")
    parser.add_argument("--parts", nargs="+", default=list(RUNNERS), choices=PARTS)
    parser.add_argument("--out", help="JSON lines (default: $OUT/gpu_step.jsonl, else /tmp)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiplies every part's seconds")
    args = parser.parse_args(argv)
    run = make_run(args.dry_run, args.out)
    if not run.cuda:
        torch.set_num_threads(1)  # tiny ops: more threads only wait for each other
    run.out.parent.mkdir(parents=True, exist_ok=True)
    run.out.write_text("")
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(run.device)
    print(f"gpu_step on {name}, torch {torch.__version__}, rows to {run.out}", flush=True)
    for part in [p for p in RUNNERS if p in args.parts]:
        clock = Stopwatch()
        budget = Budget(BUDGETS[part] * args.budget_scale)
        try:
            RUNNERS[part](run, budget)
        except Exception as exc:  # noqa: BLE001 - one line, and the next part
            failure(run, part, part, exc)
            free(run)
        print(f"{part}: done in {clock.seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
