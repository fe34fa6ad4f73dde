"""Progress of long work (autotp/progress.py): the stages the command line reports on stderr
(plain lines in a log, nothing with -q), the live line of a terminal, and the same events
for the Python API through the ``autotp`` logger or a callback."""

from __future__ import annotations

import contextlib
import io
import logging
import pytest
import torch

from autotp import progress

SMALL_LLAMA = ["hf:llama", "--tp", "2", "--set", "num_hidden_layers=2",
               "--set", "hidden_size=64", "--set", "num_attention_heads=4",
               "--set", "num_key_value_heads=2", "--set", "intermediate_size=128",
               "--set", "vocab_size=256"]


def _cli(*args: str) -> tuple[int, str, str]:
    from autotp.cli import main

    out, err = io.StringIO(), io.StringIO()  # not a terminal: plain lines
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            torch.random.fork_rng():
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_explain_reports_each_stage_on_stderr_as_plain_lines() -> None:
    pytest.importorskip("transformers")
    target = "model.layers.0.self_attn.o_proj.weight"
    code, out, err = _cli("explain", *SMALL_LLAMA, target)
    assert code == 0, err
    lines = err.splitlines()
    assert all(line.startswith("autotp: ") and "\r" not in line for line in lines), err
    for stage in ("building hf:llama on the meta device", "tracing with torch.export",
                  "planning tp=2", f"explaining {target}"):
        assert f"autotp: {stage} ..." in lines, err  # its start
        assert any(line.startswith(f"autotp: {stage}: ") and line.endswith(" s")
                   for line in lines), err  # its end, with its seconds
    # each candidate but the chosen one (the plan at hand) forced in turn, counted
    assert f"autotp: explaining {target}: 1 of 3: forcing R" in lines, err
    assert f"autotp: explaining {target}: 2 of 3: forcing S(0)" in lines, err
    assert "chosen S(1)" in out and "autotp:" not in out  # stdout stays clean


def test_quiet_prints_nothing_on_stderr() -> None:
    pytest.importorskip("transformers")
    code, out, err = _cli("plan", *SMALL_LLAMA, "-q")
    assert code == 0 and err == "" and "layers 0-1" in out, err


def test_a_terminal_gets_one_live_line() -> None:
    stream = io.StringIO()
    with progress.to_stream(stream, live=True):
        with progress.stage("planning tp=8"):
            progress.step("layer 0", 1, 2)
            with progress.stage("inner"):
                progress.step("detail")
            progress.note("a finding")
    text = stream.getvalue()
    assert "\n" not in text.split("autotp: a finding\n")[0]  # rewritten in place till then
    assert "\r\x1b[Kautotp: planning tp=8 (1 of 2: layer 0): inner (detail)" in text
    last = text.split("\r\x1b[K")[-2]  # the outermost stage's end stays, as a line
    assert last.startswith("autotp: planning tp=8: ") and last.endswith(" s\n"), text
    assert not text.endswith("\n") and text.endswith("\r\x1b[K")


def test_the_api_reports_through_a_callback_and_the_autotp_logger(caplog) -> None:
    import autotp

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16))
    example = (torch.randn(2, 16),)
    events: list[progress.Event] = []
    with progress.on_progress(events.append):
        autotp.plan(model, tp=2, example_args=example)
    starts = [e.stage for e in events if e.kind == "start"]
    assert starts[:2] == ["tracing with torch.export", "planning tp=2"], events
    ends = [e for e in events if e.kind == "end"]
    assert len(ends) == len(starts) and all(e.seconds is not None for e in ends)
    assert logging.getLogger("autotp").level == logging.NOTSET  # left as it was

    with caplog.at_level(logging.INFO, logger="autotp"):
        autotp.plan(model, tp=2, example_args=example)
    assert "tracing with torch.export ..." in caplog.messages, caplog.messages
    events.clear()
    autotp.plan(model, tp=2, example_args=example)  # nobody listening: nothing made
    assert events == []
