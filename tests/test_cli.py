"""The ``autotp`` command line: ``autotp.cli.main`` in this process as a user's argv runs it,
and through subprocesses (``python -m autotp``, the console script) where the process
matters: exit codes, byte-identical output across interpreters."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden", "gpt2_tp2.json")
SMALL_GPT2 = ["hf:gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4",
              "--set", "vocab_size=128", "--set", "n_positions=64"]
FACTORIES = os.path.join(HERE, "cli_factories.py")


def autotp_process(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "autotp", *args, "-q"], capture_output=True,
                            text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"autotp {' '.join(args)} failed:\n{result.stderr}")
    return result


def autotp(*args: str, check: bool = True) -> Any:
    """``autotp ARGS -q`` through ``autotp.cli.main``: returncode, stdout and stderr."""
    return run_cli(*args, "-q", check=check)


def run_cli(*args: str, check: bool = True) -> Any:
    """``autotp ARGS`` (as given: progress on) through ``autotp.cli.main``."""
    import torch

    from autotp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            torch.random.fork_rng(), _process_state():
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: an int, or None for success
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    result = SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    if check and result.returncode != 0:
        raise AssertionError(f"autotp {' '.join(args)} failed:\n{result.stderr}")
    return result


@contextlib.contextmanager
def _process_state() -> Any:
    """What a CLI run changes in the process, restored for the tests after it: torch's
    threads, sys.path and the modules a factory file was imported as, transformers'
    verbosity."""
    import torch
    import transformers

    threads, path, modules = torch.get_num_threads(), list(sys.path), set(sys.modules)
    verbosity = transformers.logging.get_verbosity()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith("autotp_user_"):
                del sys.modules[name]
        transformers.logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=None)
def small_gpt2_json() -> str:
    return str(autotp("plan", *SMALL_GPT2, "--tp", "2", "--format", "json").stdout)


def _without_sources(data: dict) -> dict:
    data = json.loads(json.dumps(data))
    for c in data["collectives"]:
        c.pop("source")
    return data


def test_plan_json_matches_the_reviewed_golden_plan_and_is_deterministic() -> None:
    first = autotp_process("plan", *SMALL_GPT2, "--tp", "2", "--format", "json").stdout
    second = autotp_process("plan", *SMALL_GPT2, "--tp", "2", "--format", "json").stdout
    assert first == second, "the same command must give byte-identical JSON"
    assert small_gpt2_json() == first  # and in this process
    data = json.loads(first)
    if os.environ.get("AUTOTP_UPDATE_GOLDEN"):
        with open(GOLDEN, "w", encoding="utf-8") as handle:
            handle.write(first)
    with open(GOLDEN, encoding="utf-8") as handle:
        golden = json.load(handle)
    # source lines move between transformers releases: compared separately below
    assert _without_sources(data) == _without_sources(golden)
    for c in data["collectives"]:  # the op's own line: the model file or the layer it calls
        assert c["source"].split(":")[0].endswith(".py") and c["source"].split(":")[1].isdigit()


def test_plan_json_is_megatron_for_gpt2() -> None:
    """The layouts Megatron-LM gives GPT-2 by hand, checked independently of the golden file:
    Conv1D weights are stored [in, out], so column parallel is dim 1 (blocked in 3 for the
    fused q|k|v) and row parallel is dim 0; row biases and norms are replicated."""
    data = json.loads(small_gpt2_json())
    params = data["params"]
    expected = {
        "attn.c_attn.weight": "S(1)x3", "attn.c_attn.bias": "S(0)x3",
        "attn.c_proj.weight": "S(0)", "attn.c_proj.bias": "R",
        "mlp.c_fc.weight": "S(1)", "mlp.c_fc.bias": "S(0)",
        "mlp.c_proj.weight": "S(0)", "mlp.c_proj.bias": "R",
        "ln_1.weight": "R", "ln_2.bias": "R",
    }
    for layer in (0, 1):
        for suffix, layout in expected.items():
            assert params[f"transformer.h.{layer}.{suffix}"]["layout"] == layout, suffix
    assert params["transformer.wte.weight"]["layout"] == "S(0)"
    assert params["transformer.wte.weight"]["aliases"] == ["transformer.wte.weight",
                                                           "lm_head.weight"]
    assert params["transformer.h.0.attn.c_attn.weight"]["local_shape"] == [64, 96]
    summary = data["summary"]
    assert summary["meets_bound"] and summary["groups"] == [
        {"layers": [0, 1], "forward": 2, "backward": 2}]
    for c in data["collectives"]:
        assert c["bytes"] > 0 and c["phase"] in ("forward", "backward")
    per_layer = [c for c in data["collectives"] if c["layer"] == 0]
    # 2 all-reduces of B*T*C fp32 values each way, at the default B = 8 and T = 2048
    row = 8 * 2048 * 64 * 4
    assert sorted((c["phase"], c["kind"], c["bytes"]) for c in per_layer) == [
        ("backward", "all_reduce", row)] * 2 + [("forward", "all_reduce", row)] * 2


def test_plan_table_folds_identical_layers_and_reports_the_bound() -> None:
    out = autotp("plan", *SMALL_GPT2, "--set", "n_layer=6", "--tp", "4").stdout
    assert "layers 0-5  (x6, identical)" in out
    assert "Megatron bound (2, 2): met" in out
    assert len(out.splitlines()) < 60


def test_plan_batch_seq_and_link_change_bytes_and_time() -> None:
    small = json.loads(autotp("plan", *SMALL_GPT2, "--tp", "2", "--format", "json",
                              "--batch", "1", "--seq", "128").stdout)
    large = json.loads(autotp("plan", *SMALL_GPT2, "--tp", "2", "--format", "json",
                              "--batch", "4", "--seq", "128", "--bandwidth", "10").stdout)
    assert large["summary"]["forward_bytes"] == 4 * small["summary"]["forward_bytes"]
    assert large["summary"]["time_ms"] > small["summary"]["time_ms"]


def test_plan_writes_a_file(tmp_path) -> None:
    target = tmp_path / "plan.json"
    autotp("plan", f"{FACTORIES}:mlp", "--tp", "2", "--format", "json", "-o", str(target))
    data = json.loads(target.read_text())
    assert data["params"]["up.weight"]["layout"] == "S(0)"
    assert data["params"]["down.weight"]["layout"] == "S(1)"


def test_unknown_model_type_suggests_a_close_one_in_one_line() -> None:
    result = autotp_process("plan", "hf:not_a_model", "--tp", "2", check=False)
    assert result.returncode == 2
    assert "unknown model type 'not_a_model'" in result.stderr and "llama" in result.stderr
    assert len(result.stderr) < 600, result.stderr  # no list of every type
    lama = autotp("plan", "hf:lama", "--tp", "2", check=False)
    assert lama.returncode == 2 and "did you mean hf:llama" in lama.stderr, lama.stderr


def test_a_hub_id_not_in_the_cache_says_how_to_pass_a_directory() -> None:
    """autotp reads a Hub id's config from transformers' cache only (no network): one not
    there is refused with how to pass a directory instead."""
    result = autotp("plan", "hf:no-such-org/no-such-model", "--tp", "2", check=False)
    assert result.returncode == 2, result.stderr
    assert "not in transformers' cache" in result.stderr, result.stderr
    assert "config.json" in result.stderr and "pass DIR as MODEL" in result.stderr


def test_a_config_the_library_rejects_is_the_users_input() -> None:
    """transformers' ValueError on the --set values: exit 2, its message and the flag."""
    result = autotp("verify", "hf:gpt2", "--tp", "2", "--set", "n_layer=2", "--set",
                    "n_embd=64", check=False)
    assert result.returncode == 2, result.stderr
    assert "transformers rejected the model hf:gpt2" in result.stderr
    assert "divisible by num_heads" in result.stderr and "--set n_embd=64" in result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


def _branch_line() -> int:
    """The line of BranchyMLP's branch on a tensor's value, the one the message points at."""
    from tests.cli_factories import BranchyMLP

    lines, first = inspect.getsourcelines(BranchyMLP.forward)
    return first + next(i for i, text in enumerate(lines) if "if h.sum()" in text)


def test_a_failed_trace_prints_autotps_message_only() -> None:
    """No torch.export graph dump, no torch log lines; the whole text under -v."""
    result = run_cli("plan", f"{FACTORIES}:branchy_mlp", "--tp", "2", check=False)
    assert result.returncode == 2
    assert "def forward" not in result.stderr and "torch.ops.aten" not in result.stderr
    assert f"cli_factories.py:{_branch_line()}" in result.stderr
    assert "example_kwargs" not in result.stderr
    verbose = run_cli("plan", f"{FACTORIES}:branchy_mlp", "--tp", "2", "-v", check=False)
    assert verbose.returncode == 2 and "def forward" in verbose.stderr


def test_messages_name_flags_not_python_arguments() -> None:
    from autotp.cli_support import in_flag_words

    assert in_flag_words("use tp in {1, 2}, or strict=False to replicate it") == \
        "use tp in {1, 2}, or --non-strict to replicate it"
    assert "example_args=" not in in_flag_words(
        "autotp needs example inputs to trace this model: pass example_args=(...) and/or "
        "example_kwargs={...} with tensors")


@pytest.mark.parametrize("suffix, start", [(".html", "<!DOCTYPE html>"), (".json", "{"),
                                            (".dot", "digraph")])
def test_output_suffix_picks_the_format(tmp_path, suffix: str, start: str) -> None:
    target = tmp_path / f"plan{suffix}"
    autotp("plan", f"{FACTORIES}:mlp", "--tp", "2", "-o", str(target))
    assert target.read_text().lstrip().startswith(start), target.read_text()[:80]
    table = tmp_path / "plan.txt"  # --format wins over the suffix
    autotp("plan", f"{FACTORIES}:mlp", "--tp", "2", "--format", "table", "-o", str(table))
    assert table.read_text().startswith("autotp plan: ")


def test_plan_takes_dtype() -> None:
    data = json.loads(autotp("plan", *SMALL_GPT2, "--tp", "2", "--dtype", "bfloat16",
                             "--format", "json").stdout)
    full = json.loads(small_gpt2_json())
    first = next(c for c in full["collectives"] if c["phase"] == "forward")
    half = next(c for c in data["collectives"] if c["phase"] == "forward")
    assert half["bytes"] * 2 == first["bytes"]  # bfloat16 activations: half the bytes


def test_calibrate_without_the_named_gpu_is_refused(tmp_path) -> None:
    from autotp.cli import calibration_refusal

    if calibration_refusal("h100") is None:
        pytest.skip("this machine has an H100")
    target = tmp_path / "hw.json"
    result = autotp("estimate", "--calibrate", "--hardware", "h100", "-o", str(target),
                    check=False)
    assert result.returncode == 2 and "--calibrate-anyway" in result.stderr
    assert not target.exists()


def test_estimate_best_line_parses_back_and_mesh_is_checked_first() -> None:
    from autotp.cli import build_parser

    command = ["estimate", *SMALL_GPT2, "--gpus", "4", "--global-batch", "8", "--seq", "64"]
    out = autotp(*command).stdout
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    flags = best[len("best: "):].split(":")[0].split()
    args = build_parser().parse_args([*command, *flags])
    assert args.mesh and args.micro_batch and args.sequence_parallel in (True, False)
    assert args.sequence_parallel == ("--sequence-parallel on" in best)
    import time

    start = time.perf_counter()
    wrong = autotp(*command, "--mesh", "pp=1,dp=2,tp=4", check=False)
    assert wrong.returncode == 2 and "= 8 GPUs, not the 4 of --gpus" in wrong.stderr
    assert time.perf_counter() - start < 2.0  # refused before building and tracing


@pytest.mark.parametrize("spec, message", [
    ("tests/no_such_file.py:build", "no such file"),
    (f"{FACTORIES}:missing", "has no callable 'missing'"),
    (f"{FACTORIES}:not_a_model", "returned str, not a torch.nn.Module"),
    ("no_such_package.module:factory", "cannot import 'no_such_package.module'"),
])
def test_bad_factories_say_what_is_wrong(spec: str, message: str) -> None:
    result = autotp("plan", spec, "--tp", "2", check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_tp_not_dividing_heads_names_valid_values() -> None:
    result = autotp("plan", *SMALL_GPT2, "--tp", "3", check=False)
    assert result.returncode == 2
    assert "tp=3 does not divide the 4 attention heads; use tp in {1, 2, 4}" in result.stderr


def test_explain_shows_candidates_and_the_chosen_one() -> None:
    out = autotp("explain", *SMALL_GPT2, "--tp", "2", "transformer.h.0.attn.c_proj.weight").stdout
    assert "stored S(0)" in out
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    assert any(line.strip().startswith("chosen S(0)") for line in lines)
    replicated = next(line for line in lines if line.strip().startswith("R "))
    assert "parameters per rank +" in replicated  # replicating costs memory


def test_explain_with_cp_explains_the_context_parallel_plan() -> None:
    """``--tp 1 --cp 2``: the candidates are the cp group's (two ranks, the sequence split),
    where a parameter is held whole and splitting it adds collectives."""
    out = autotp("explain", *SMALL_GPT2, "--tp", "1", "--cp", "2",
                 "transformer.h.0.attn.c_proj.weight").stdout
    assert "stored R" in out, out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert any(line.startswith("chosen R") for line in lines), out
    split = [line for line in lines if line.startswith(("S(0)", "S(1)"))]
    assert len(split) == 2 and all("forward +1, backward +1" in line for line in split), out


def test_explain_an_op_marks_its_chosen_strategy() -> None:
    """An op's candidates are its rules' strategies: the plan's own is marked and costs no more
    than the plan; the others cost at least as much, or no plan takes them."""
    import transformers

    from autotp.capture.trace import capture
    from autotp.presentation.explain import explain
    from autotp.planner.cost import CostModel
    from autotp.planner.solve import PlanOptions, plan_graph

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64,
                                                                 n_head=4, vocab_size=128))
    captured = capture(model, (), {"input_ids": torch.randint(0, 128, (2, 8))})
    plan = plan_graph(captured, 2)
    node = next(n for n, c in plan.choices.items() if c.op == "aten.mm.default")
    told = explain(captured, plan, node, 2, CostModel(), PlanOptions())
    assert told.heading.startswith(f"{node} = aten.mm.default")
    chosen = [a for a in told.alternatives if a.chosen]
    assert len(chosen) == 1 and chosen[0].cost == pytest.approx(0.0, abs=1e-6)
    assert len(told.alternatives) > 1
    assert all(a.infeasible is not None or a.cost >= -1e-6 for a in told.alternatives)


def test_verify_in_simulation_and_processes() -> None:
    for extra in ([], ["--procs"]):
        out = autotp("verify", f"{FACTORIES}:nanogpt", "--tp", "2", *extra).stdout
        assert "OK: the sharded model matches the unsharded one" in out
        assert "[(2, 2)]" in out


def test_verify_a_model_with_dropout_compares_in_eval_mode() -> None:
    """GPT-2's dropouts would draw other masks on the ranks than on the unsharded model."""
    out = autotp("verify", *SMALL_GPT2, "--tp", "2").stdout
    assert "OK: the sharded model matches the unsharded one" in out


def test_python_m_and_console_script_agree() -> None:
    import sysconfig

    # the console script installed beside this interpreter (never looked up on PATH)
    script = os.path.join(sysconfig.get_path("scripts"), "autotp")
    assert os.path.exists(script), f"no console script at {script}: pip install -e ."
    a = subprocess.run([script, "plan", f"{FACTORIES}:mlp", "--tp", "2", "--format", "json",
                        "-q"], capture_output=True, text=True, timeout=120).stdout
    b = autotp_process("plan", f"{FACTORIES}:mlp", "--tp", "2", "--format", "json").stdout
    assert a == b and a


def test_verify_reports_a_mismatch_and_the_first_diverging_node() -> None:
    result = autotp("verify", f"{FACTORIES}:noisy_mlp", "--tp", "2", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH" in result.stdout
    assert "first diverging value: dropout = aten.dropout.default" in result.stdout
    assert "cli_factories.py" in result.stdout  # the user's source line


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    import autotp as package

    result = autotp("--version", check=False)
    assert result.returncode == 0
    assert result.stdout.strip() == f"autotp {version('autotp')}" == \
        f"autotp {package.__version__}"


def test_subcommands_share_their_flags_and_take_only_what_they_use() -> None:
    """One spelling and one default per flag across subcommands; verify takes no byte-count
    or link flags it would ignore; choices are checked by the parser (exit code 2)."""
    from autotp.cli import SEQ, build_parser

    parser = build_parser()
    plan = parser.parse_args(["plan", "hf:gpt2", "--tp", "2"])
    estimate = parser.parse_args(["estimate", "hf:gpt2"])
    assert plan.seq == estimate.seq == SEQ
    assert plan.sequence_parallel is False and estimate.sequence_parallel is None
    for command in (["plan", "hf:gpt2", "--tp", "2"], ["estimate", "hf:gpt2"]):
        assert parser.parse_args([*command, "--sequence-parallel"]).sequence_parallel is True
        assert parser.parse_args([*command, "--no-sequence-parallel"]).sequence_parallel is False
    for ignored in ("--ep", "--batch", "--seq", "--bandwidth", "--latency"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["verify", "hf:gpt2", "--tp", "2", ignored, "1"])
        assert exc.value.code == 2
    for bad in (["--dtype", "float8"], ["--precision", "bf17"], ["--optimizer", "adagrad"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["estimate", "hf:gpt2", *bad])
        assert exc.value.code == 2
    helps = [action.help for sub in parser._subparsers._group_actions[0].choices.values()
             for action in sub._actions if action.dest == "format"]
    assert len(helps) == 2 and all(helps), helps
    text = parser.format_help()
    assert "``" not in text and "exit codes" in text
    for command in ("plan", "explain", "verify", "estimate"):  # listed, with an example
        assert f"autotp {command} " in text


def test_an_internal_error_exits_3_and_says_it_is_a_bug(monkeypatch) -> None:
    import autotp.cli as cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_plan", broken)
    result = autotp("plan", f"{FACTORIES}:mlp", "--tp", "2", check=False)
    assert result.returncode == 3 and "internal error" in result.stderr, result.stderr
