"""benchmarks/harness.py: what a benchmark's time, ratio, rows and table mean, on known
numbers."""

from __future__ import annotations

import pytest

from benchmarks.harness import (Column, Timing, append_rows, markdown_table, ratio, ratio_text,
                                read_json, read_rows, round_robin, table, time_round_robin,
                                write_json, write_rows)


def test_a_time_is_the_median_of_the_repeats() -> None:
    t = Timing((0.004, 0.001, 0.003, 0.002, 0.100))  # one burst of other work: out
    assert t.median == 0.003 and t.min == 0.001
    # quartiles 1.5 and 52 ms (statistics.quantiles' exclusive method): the spread shows it
    assert t.stats_ms() == pytest.approx({"median_ms": 3.0, "min_ms": 1.0, "iqr_ms": 50.5})
    assert Timing((0.5,)).iqr == 0.0


def test_round_robin_runs_every_name_each_repetition() -> None:
    order: list[str] = []
    done = round_robin(["a", "b", "c"], lambda n: order.append(n) or len(order), repeats=2)
    assert order == ["a", "b", "c", "a", "b", "c"] and done == {"a": [1, 4], "b": [2, 5],
                                                                "c": [3, 6]}
    order.clear()
    round_robin(["a", "b", "c"], order.append, repeats=3, rotate=True)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_warm_up_calls_are_not_timed() -> None:
    calls: list[str] = []
    times = time_round_robin({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")},
                             warmup=2, repeats=3, before=lambda: calls.append("|"),
                             combine=lambda seconds: 1.0)
    assert calls == ["|", "x", "|", "y"] * 5
    assert times["x"].seconds == times["y"].seconds == (1.0, 1.0, 1.0)


def test_a_ratio_pairs_repetitions_of_the_same_run() -> None:
    # the machine slowed down in the second repetition: both ran 3x slower then
    a, b = Timing((2.0, 6.0, 2.2)), Timing((1.0, 3.0, 1.0))
    assert ratio(a, b) == 2.0  # median of 2.0, 2.0, 2.2
    assert ratio(a, b, paired=False) == pytest.approx(2.2 / 1.0)
    assert ratio([3.0, 5.0], [1.0]) == 4.0  # unpaired: medians
    assert [ratio_text(None), ratio_text(1.5, suffix="x"), ratio_text(0.5, trim=True),
            ratio_text(1.0, trim=True), ratio_text(0.0, trim=True)] == ["-", "1.50x", "0.5",
                                                                       "1", "0"]


def test_tables_show_each_row_in_its_columns() -> None:
    rows = [{"impl": "megatron", "ms": 12.345, "vs": None},
            {"impl": "autotp", "ms": 1.5, "vs": 0.1216}]
    columns = [Column("impl", 9, "impl", left=True), Column("ms", 7, "ms", ".1f"),
               Column("vs", 5, cell=lambda r: ratio_text(r["vs"]))]
    assert table(columns, rows).splitlines() == ["impl           ms    vs",
                                                  "megatron     12.3     -",
                                                  "autotp        1.5  0.12"]
    assert markdown_table(columns, rows).splitlines() == [
        "| impl | ms | vs |", "|---|---|---|", "| megatron | 12.3 | - |",
        "| autotp | 1.5 | 0.12 |"]


def test_rows_read_back_as_written(tmp_path) -> None:
    lines = tmp_path / "rows.jsonl"
    write_rows(lines, [{"tp": 2, "step_ms": [1.0, 2.0]}])
    append_rows(lines, [{"tp": 4, "step_ms": [3.0]}])
    assert read_rows(lines) == [{"tp": 2, "step_ms": [1.0, 2.0]}, {"tp": 4, "step_ms": [3.0]}]
    document = tmp_path / "run.json"
    write_json(document, {"rows": [{"tp": 2, "shape": (4, 8)}]})
    assert read_json(document) == {"rows": [{"tp": 2, "shape": [4, 8]}]}
