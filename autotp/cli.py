"""autotp command line: plan, explain, verify and estimate tensor-parallel jobs.

    autotp plan hf:llama --tp 8                         # the 7B shape, on the meta device
    autotp plan hf:gpt2 --tp 4 --format json -o plan.json
    autotp explain hf:llama --tp 8 model.layers.0.self_attn.o_proj.weight
    autotp verify hf:llama --tp 4 --set num_hidden_layers=2 --set hidden_size=256 [--procs]
    autotp estimate hf:llama --gpus 64 --hardware a100-80gb --global-batch 512 --seq 4096
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from typing import Any, Optional

# The parser is built from these alone (torch, no planner, no torch.export, no transformers):
# each command imports what it runs (``autotp --help`` costs little beyond ``import torch``).
import autotp
from autotp import progress
from autotp.cli_support import (OnOff, in_flag_words, input_message, model_source,
                                output_format, rejected_input, terminal)
from autotp.errors import AutotpError, ConfigError
from autotp.ops import positive_int
from autotp.planner.job.hardware import PRESETS
from autotp.planner.job.memory import OPTIMIZER_MOMENTS, PRECISIONS


def _cost_model(args: argparse.Namespace) -> Any:
    from autotp.planner.cost import CostModel

    return CostModel(bandwidth=args.bandwidth * 1e9, latency=args.latency * 1e-6,
                     step_latency=args.step_latency * 1e-6,
                     batch=args.batch, seq=args.seq)


def _options(args: argparse.Namespace) -> Any:
    """The library's options (``autotp.Options``) the command line gives."""
    from autotp.options import Options

    return Options(strict=args.strict, sequence_parallel=args.sequence_parallel,
                   gather_outputs="never" if getattr(args, "sharded_outputs", False) else
                   "read",
                   cost_model=_cost_model(args))


def _mesh(args: argparse.Namespace) -> Any:
    """The axes the command line names, checked as ``autotp.parallelize`` checks them."""
    from autotp.mesh import FLAGS, resolve_mesh

    return resolve_mesh(tp=args.tp, cp=getattr(args, "cp", 1), ep=getattr(args, "ep", 1),
                        sequence_parallel=args.sequence_parallel, spelling=FLAGS)


SEQ = 2048  # the sequence length bytes and times are counted at, in every subcommand
DTYPES = ["bfloat16", "float16", "float32"]
VERBOSE_HELP = ("the libraries' own output too (torch's logs, Python warnings) and the trace "
                "of an error")


def _add_model_args(parser: argparse.ArgumentParser, *, costs: bool = True) -> None:
    """The model and the plan: every subcommand but ``estimate``. ``costs``: the sizes and
    the link its collectives are counted at (``plan`` and ``explain``; ``verify`` runs the
    model instead)."""
    parser.add_argument("model", help="hf:<model_type>, a directory with config.json, or "
                                      "file.py:factory / package.module:factory")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field (repeatable)")
    parser.add_argument("--non-strict", dest="strict", action="store_false",
                        help="replicate ops without a rule (recorded) instead of failing")
    parser.add_argument("--sequence-parallel", action=OnOff, default=False,
                        help="shard the activations between blocks along the sequence "
                             "(default: off)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="build the model in this dtype (default: its config's, float32 "
                             "for a factory's own)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    if not costs:
        return
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallelism: experts also split over this many "
                             "data-parallel ranks (default 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallelism: the sequence split over this many ranks "
                             "(inside --tp; default 1)")
    parser.add_argument("--batch", type=int, default=8,
                        help="batch size B the bytes are counted at (default 8)")
    parser.add_argument("--seq", type=int, default=SEQ,
                        help=f"sequence length T the bytes are counted at (default {SEQ})")
    parser.add_argument("--bandwidth", type=float, default=100.0,
                        help="link GB/s per rank (default 100)")
    parser.add_argument("--latency", type=float, default=10.0,
                        help="a collective's launch latency, us (default 10)")
    parser.add_argument("--step-latency", type=float, default=3.4,
                        help="latency per ring step, us (an all-reduce has 2(tp-1) steps; "
                             "default 3.4)")


def _prepare(args: argparse.Namespace, *, meta: bool) -> tuple[Any, Any, Any, Any]:
    """The model the command line names, built, traced and planned as ``autotp.plan`` does
    (``autotp.api.prepare``): the loaded model, its capture, its plan and the mesh."""
    from autotp.api import prepare
    from autotp.capture.named_models import load_model, parse_overrides

    mesh = _mesh(args)  # before the model is built: a wrong command line costs nothing
    with progress.stage(f"building {args.model}" + (" on the meta device" if meta else "")), \
            model_source(args.model) as source:
        loaded = load_model(source, parse_overrides(args.overrides), meta=meta)
        loaded.cast(args.dtype)
    captured, plan = prepare(loaded.model, mesh=mesh, options=_options(args),
                             example_args=loaded.example_args,
                             example_kwargs=loaded.example_kwargs, model_name=args.model)
    return loaded, captured, plan, mesh


def _emit(text: str, args: argparse.Namespace) -> None:
    """``text`` to ``-o FILE`` (saying so on stderr) or to stdout."""
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
        if not args.quiet:
            print(f"autotp: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def cmd_plan(args: argparse.Namespace) -> int:
    from autotp.presentation.dot import to_dot
    from autotp.integrations.export import to_tp_plan
    from autotp.presentation.page import to_html
    from autotp.presentation.report import to_json, to_table

    _, _, plan, _ = _prepare(args, meta=True)
    cost_model = _cost_model(args)
    form = output_format(args.format, args.output, PLAN_FORMATS)
    if form == "table":
        text = to_table(plan, cost_model)
    elif form == "json":
        text = to_json(plan, cost_model)
    elif form == "dot":
        text = to_dot(plan, cost_model)
    elif form == "tp-plan":
        text = to_tp_plan(plan).to_json()
    else:
        text = to_html(plan, cost_model)
    _emit(text, args)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autotp.presentation.explain import explain

    from autotp.planner.context import outer_search

    _, captured, plan, mesh = _prepare(args, meta=True)
    # the plan's own search (at --tp 1 --cp C, the cp group's)
    degree, options = outer_search(mesh.tp, mesh.cp, _options(args).plan_options(mesh.ep))
    told = explain(captured, plan, args.target, degree, _cost_model(args), options,
                   model_name=args.model)
    print(told.heading)
    print(f"{len(told.alternatives)} candidate(s); each forced in turn, everything else "
          "re-planned:")
    for alt in told.alternatives:
        if alt.infeasible is not None:
            print(f"  {alt.label:<48} infeasible: {alt.infeasible}")
            continue
        mark = "chosen " if alt.chosen else "       "
        print(f"  {mark}{alt.label:<48} collectives: forward {alt.forward:+d}, backward "
              f"{alt.backward:+d}; parameters per rank {alt.param_mib:+.1f} MiB; "
              f"cost {alt.cost:+.3g}")
    print("cost = parameter memory (matrices dominate) + alpha-beta communication + compute; "
          "the chosen candidate has the least cost")
    for line in told.kept_whole:
        print(f"kept whole although tp could shard it; what stops each way: {line}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from autotp.capture.named_models import parse_overrides
    from autotp.verification.check_model import check_model

    how = f"running {args.tp} gloo processes" if args.procs else \
        "tracing, planning, rewriting and running all ranks"
    with progress.stage(f"building {args.model} with random weights, {how}"), \
            model_source(args.model) as source:
        checked = check_model(source, parse_overrides(args.overrides), args.tp,
                              strict=args.strict, sequence_parallel=args.sequence_parallel,
                              procs=args.procs, dtype=args.dtype)
    if checked.proven:  # simulate raised if the proof fails; each process proves its own
        print(f"gradient flow: each of {checked.proven} trainable parameters gets its whole "
              "gradient in its own layout (proven on the plan)")
    outcome = checked.outcome
    if not outcome["counts_agree"]:
        print("the ranks executed different collectives")
    print(f"{args.model} tp={args.tp} ({'gloo processes' if args.procs else 'simulation'}, "
          f"worst of {args.tp} ranks: rank {outcome['rank']}): "
          f"max |output diff| {outcome['output_diff']:.2e}, |loss diff| "
          f"{outcome['loss_diff']:.2e}, max |grad diff| {outcome['grad_diff']:.2e} "
          f"({outcome['grad_rel']:.2e} relative, {outcome['worst_param']})")
    counts = outcome["counts"]
    per_layer = sorted({(v["forward"], v["backward"]) for k, v in counts.items()
                        if k is not None and k != -1})
    print(f"collectives executed per layer (forward, backward): {per_layer}")
    if checked.ok(args.atol):
        print("OK: the sharded model matches the unsharded one")
        return 0
    print(f"MISMATCH (tolerance {args.atol:g})")
    found = checked.first_divergence(args.atol)
    print(found if found else "no forward value diverges: the difference is in the backward "
          "pass (gradients)")
    return EXIT_VERDICT


def cmd_estimate(args: argparse.Namespace) -> int:
    from autotp.capture.named_models import load_model, parse_overrides
    from autotp.planner.job import hardware as hw_module
    from autotp.planner.job.configure import (Estimate, Planner, Request, attention_heads,
                                              capture_for_training, parse_mesh_dims, search,
                                              training_example)
    from autotp.planner.job.estimate_view import write
    from autotp.planner.job.memory import precision

    base = hw_module.hardware(args.hardware)
    if args.calibrate or args.calibrate_anyway:
        refusal = calibration_refusal(base.name)
        if refusal and not args.calibrate_anyway:
            raise ConfigError(refusal + ": run --calibrate on that GPU, pass --hardware "
                              "the preset this device is, or --calibrate-anyway to write "
                              "this device's numbers under the name anyway")
        with progress.stage(f"measuring this device against {base.name}"):
            measured, _ = hw_module.calibrate(base, dtype=args.dtype)
        path = args.output or f"{measured.name}.json"
        hw_module.save(measured, path)
        if not args.quiet:
            print(f"autotp: wrote {path} (use --hardware {path})", file=sys.stderr)
        return 0
    if args.model is None:
        raise ConfigError("autotp estimate needs a MODEL (or --calibrate)")
    if args.gpus is None or args.global_batch is None:
        raise ConfigError("autotp estimate needs --gpus N and --global-batch B")
    cp = None if args.cp is None else positive_int("--cp", args.cp)
    mesh = None
    if args.mesh:
        dims = parse_mesh_dims(args.mesh)
        mesh = (dims["pp"], dims["dp"], dims["tp"])
        if cp is not None and "cp=" in args.mesh.replace(" ", "") and cp != dims["cp"]:
            raise ConfigError(f"--cp {cp} and --mesh {args.mesh} disagree: give cp once")
        cp = dims["cp"] if cp is None else cp
        size = dims["pp"] * dims["dp"] * cp * dims["tp"]
        if size != args.gpus:  # before tracing: a wrong product is seconds, not minutes
            raise ConfigError(f"--mesh {args.mesh} is pp={dims['pp']} x dp={dims['dp']} x "
                              f"cp={cp} x tp={dims['tp']} = {size} GPUs, not the {args.gpus} "
                              "of --gpus: change --mesh or --gpus")
    start = time.perf_counter()
    with progress.stage(f"building {args.model} on the meta device"), \
            model_source(args.model) as source:
        loaded = load_model(source, parse_overrides(args.overrides), meta=True)
    example_args, example_kwargs = loaded.example_args, loaded.example_kwargs
    if example_args is None and example_kwargs is None:
        example_kwargs = training_example(loaded.model)
    profiled, planned = capture_for_training(loaded.model, example_args, example_kwargs,
                                             args.dtype)
    req = Request(
        gpus=args.gpus, global_batch=args.global_batch, seq=args.seq,
        gpus_per_node=args.gpus_per_node, micro_batch=args.micro_batch, cp=cp,
        mesh=mesh, checkpointing=args.checkpointing,
        sequence_parallel=args.sequence_parallel,
        dtype=args.dtype, precision=args.precision, optimizer=args.optimizer,
        dp_shard=args.dp_shard, tp_across_nodes=args.tp_across_nodes,
        max_micro_batch=args.max_micro_batch, ep=args.ep)
    planner = Planner(profiled, args.model, args.seq, attention_heads(loaded.model), planned)
    configs = search(planner, base, req)
    est = Estimate(model=args.model, hardware=base, gpus=req.gpus,
                   global_batch=req.global_batch, seq=req.seq, dtype=req.dtype,
                   precision=precision(req.precision, req.optimizer).name, configs=configs,
                   seconds=time.perf_counter() - start)
    text = write(est, output_format(args.format, args.output, ESTIMATE_FORMATS), top=args.top)
    _emit(text, args)
    return 0 if est.best is not None else EXIT_VERDICT


def _add_estimate_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", help="hf:<model_type>, a directory with config.json, "
                                            "or file.py:factory / package.module:factory")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, or a factory keyword (repeatable)")
    s.add_argument("--gpus", type=int, help="GPUs in all")
    s.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    s.add_argument("--hardware", default="h100",
                   help=f"{', '.join(PRESETS)}, or a JSON/TOML file (default h100)")
    s.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    s.add_argument("--micro-batch", type=int, help="sequences per micro-batch (searched)")
    s.add_argument("--max-micro-batch", type=int, default=8,
                   help="the largest micro-batch searched (default 8)")
    s.add_argument("--seq", type=int, default=SEQ, help=f"sequence length (default {SEQ})")
    s.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="compute dtype (default bfloat16)")
    s.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS),
                   help="bf16-mixed (16-bit weights and grads, float32 master and moments), "
                        "fp16-mixed, bf16 (everything in bfloat16, the moments too) or fp32")
    s.add_argument("--optimizer", default="adam", choices=list(OPTIMIZER_MOMENTS),
                   help="the optimizer whose state is counted (default adam)")
    s.add_argument("--dp-shard", default="fsdp", choices=["fsdp", "optimizer", "none"],
                   help="what data parallelism shards: everything (FSDP2, default), the "
                        "optimizer state, or nothing (DDP)")
    s.add_argument("--mesh", help="evaluate this mesh only: pp=P,dp=D,tp=T (and cp=C)")
    s.add_argument("--ep", type=int,
                   help="expert parallelism: split the experts over ep of the dp ranks too "
                        "(searched for a mixture of experts; 1 otherwise)")
    s.add_argument("--cp", type=int,
                   help="context parallelism: the sequence split over this many ranks "
                        "(searched; 1 for none)")
    s.add_argument("--checkpointing", choices=["none", "selective", "full"],
                   help="activation recomputation (searched)")
    s.add_argument("--sequence-parallel", action=OnOff, default=None,
                   help="with or without sequence parallelism (default: both searched)")
    s.add_argument("--tp-across-nodes", action="store_true",
                   help="also try tp larger than a node")
    s.add_argument("--format", choices=ESTIMATE_FORMATS,
                   help="a ranked table (default), JSON, or one self-contained HTML page "
                        "(default: the one -o's suffix names, .json or .html; else a table)")
    s.add_argument("--top", type=int, default=20, help="rows of the table (default 20)")
    s.add_argument("-o", "--output", help="write to this file instead of stdout")
    s.add_argument("--calibrate", action="store_true",
                   help="measure this machine's GPU (GEMMs, memory, collectives) starting "
                        "from --hardware, and write a hardware file (-o FILE); refused "
                        "where this device is not that GPU")
    s.add_argument("--calibrate-anyway", action="store_true",
                   help="--calibrate on a device that is not --hardware's GPU (a CPU, another "
                        "GPU): its own numbers, written under that name")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    s.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)


PLAN_FORMATS = ["table", "json", "dot", "html", "tp-plan"]
ESTIMATE_FORMATS = ["table", "json", "html"]


def calibration_refusal(name: str) -> Optional[str]:
    """Why this process's device cannot be measured as the GPU ``name`` names (``h100``,
    ``a100-80gb``), or None where it is that GPU."""
    import torch

    if not torch.cuda.is_available():
        return f"--calibrate measures a GPU, and this machine has none to measure as {name}"
    device = torch.cuda.get_device_name()
    if name.split("-")[0].lower() not in device.lower():  # h100 in "NVIDIA H100 80GB HBM3"
        return f"this GPU is {device}, not the {name} of --hardware"
    return None


def _installed_version() -> str:
    return autotp.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(line for line in __doc__.splitlines()[1:] if line)
        + "\n\nexit codes: 0 done, 1 a verdict (a mismatch, nothing fits), 2 a wrong "
          "command line or input, 3 an internal error")
    parser.add_argument("--version", action="version", version=f"autotp {_installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="show the tensor-parallel plan of a model")
    _add_model_args(p)
    p.add_argument("--format", choices=PLAN_FORMATS,
                   help="a table (default), JSON (schema autotp.plan/1), Graphviz DOT, one "
                        "self-contained HTML page, or transformers' tp_plan as JSON with what "
                        "it cannot express (schema autotp.tp_plan/1); default: the one -o's "
                        "suffix names (.json, .html, .dot), else a table")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.add_argument("--sharded-outputs", action="store_true",
                   help="return sharded outputs (e.g. vocabulary-sharded logits) ungathered")
    p.set_defaults(func=cmd_plan)
    e = sub.add_parser("explain", help="why a parameter or node got its layout")
    _add_model_args(e)
    e.add_argument("target", help="a parameter name or a graph node name")
    e.set_defaults(func=cmd_explain)
    v = sub.add_parser("verify", help="compare the sharded model with the unsharded one")
    _add_model_args(v, costs=False)
    v.add_argument("--procs", action="store_true", help="real gloo processes, not simulation")
    v.add_argument("--atol", type=float, default=1e-4, help="tolerance (outputs, gradients)")
    v.set_defaults(func=cmd_verify)
    s = sub.add_parser("estimate",
                       help="memory and step time of every tp x cp x pp x dp, ranked")
    _add_estimate_args(s)
    s.set_defaults(func=cmd_estimate)
    return parser


# exit codes: 0 done; 1 a verdict (verify: a mismatch; estimate: nothing fits); 2 the
# command line or the input is wrong (argparse, or an AutotpError that says what to change);
# 3 an internal error (a bug in autotp)
EXIT_VERDICT, EXIT_INPUT, EXIT_INTERNAL = 1, 2, 3


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    try:
        quiet = getattr(args, "quiet", False)  # progress on stderr (stdout stays clean)
        with contextlib.nullcontext() if quiet else progress.to_stream(sys.stderr), \
                terminal(verbose):
            return int(args.func(args))
    except AutotpError as exc:
        if verbose:
            traceback.print_exc()
        print(f"autotp: error: {in_flag_words(str(exc))}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - autotp's bug, unless the user's model refused
        library = rejected_input(exc)  # the user's MODEL and --set values (exit 2)
        if library is not None:
            if verbose:
                traceback.print_exc()
            print(f"autotp: error: {input_message(exc, library, args.model, args.overrides)}",
                  file=sys.stderr)
            return EXIT_INPUT
        traceback.print_exc()
        print("autotp: internal error (a bug in autotp, not in your command): please report "
              "it with the command line and the trace above", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
