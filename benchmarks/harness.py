"""The one harness of autotp's benchmarks: how a time is taken, how two are compared, how a
run's rows are kept and shown. Every benchmark measures through it, so every number in
docs/*.md means the same thing:

- a **time** is the median of ``repeats`` timed calls after ``warmup`` untimed ones (the
  median keeps a burst of other work on a shared machine out; the warm-up keeps out the first
  calls' compilation and allocation);
- implementations compared with each other run **round robin** in one process: every
  repetition times each of them once, so a slow minute of the machine falls on all of them;
- a **ratio** is of two times from the same run, never of a number recorded earlier: where
  both have the same repetitions, the median of the per-repetition ratios (each pair ran
  seconds apart, so the machine's drift cancels), else (or where a benchmark's rows have
  always held it so: tp_bench's ``time_vs_*``) the ratio of the medians;
- a run's **rows** are flat JSON objects, kept in one file: JSON lines (a row a line, written
  as they come) or one JSON document (a list of rows, or a record holding them);
- a **table** is fixed-width columns, a title and a format for each.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

T = TypeVar("T")


# ---- times -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """The seconds of each timed repetition of one call."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def iqr(self) -> float:
        """The spread between the first and third quartile (0 for one repetition)."""
        if len(self.seconds) < 2:
            return 0.0
        first, _, third = statistics.quantiles(self.seconds, n=4)
        return third - first

    def stats_ms(self) -> dict[str, float]:
        """The row fields of a time: ``median_ms``, ``min_ms``, ``iqr_ms``."""
        return {"median_ms": 1e3 * self.median, "min_ms": 1e3 * self.min,
                "iqr_ms": 1e3 * self.iqr}


class Stopwatch:
    """Wall seconds since it was made: ``clock = Stopwatch()``, then ``clock.seconds``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


class Laps:
    """The seconds of a run's named stages, each timed once: ``with laps("export"): ...``,
    then ``laps.seconds`` (stage -> seconds, in the order they ran)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        clock = Stopwatch()
        yield
        self.seconds[stage] = clock.seconds


def time_call(fn: Callable[[], Any], *, warmup: int, repeats: int,
              before: Optional[Callable[[], Any]] = None,
              after: Optional[Callable[[], Any]] = None,
              combine: Optional[Callable[[float], float]] = None) -> Timing:
    """``fn`` called ``warmup`` times untimed, then ``repeats`` times timed. ``before`` runs
    ahead of each call, outside its time (a barrier); ``after`` inside it (a device
    synchronisation: the call's kernels finish in its time); ``combine`` turns each time into
    the one recorded (the slowest rank's, over a process group)."""
    return time_round_robin({"": fn}, warmup=warmup, repeats=repeats, before=before,
                            after=after, combine=combine)[""]


def round_robin(names: Sequence[str], run: Callable[[str], T], *, repeats: int,
                rotate: bool = False) -> dict[str, list[T]]:
    """``run(name)`` for every name in each of ``repeats`` repetitions: name -> its results
    in order. ``rotate``: repetition r starts at the r-th name, so that none always runs right
    after the same neighbour."""
    results: dict[str, list[T]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names) if rotate else 0
        for name in [*names[shift:], *names[:shift]]:
            results[name].append(run(name))
    return results


def time_round_robin(fns: Mapping[str, Callable[[], Any]], *, warmup: int, repeats: int,
                     before: Optional[Callable[[], Any]] = None,
                     after: Optional[Callable[[], Any]] = None,
                     combine: Optional[Callable[[float], float]] = None,
                     rotate: bool = False) -> dict[str, Timing]:
    """The time of each of ``fns``, measured round robin (``round_robin``): ``warmup``
    untimed repetitions, then ``repeats`` timed ones. ``before``, ``after`` and ``combine``
    as in ``time_call``."""

    def timed(name: str) -> float:
        if before is not None:
            before()
        start = time.perf_counter()
        fns[name]()
        if after is not None:
            after()
        seconds = time.perf_counter() - start
        return combine(seconds) if combine is not None else seconds

    names = list(fns)
    if warmup:
        round_robin(names, timed, repeats=warmup, rotate=rotate)
    times = round_robin(names, timed, repeats=repeats, rotate=rotate)
    return {name: Timing(tuple(times[name])) for name in names}


# ---- ratios ------------------------------------------------------------------------------


Times = Union[Timing, Sequence[float]]


def ratio(numerator: Times, denominator: Times, *, paired: bool = True) -> float:
    """``numerator``'s time over ``denominator``'s, both of the same run. ``paired`` and as
    many repetitions each: the median of the per-repetition ratios; else the ratio of the
    medians."""
    a = numerator.seconds if isinstance(numerator, Timing) else tuple(numerator)
    b = denominator.seconds if isinstance(denominator, Timing) else tuple(denominator)
    if paired and len(a) == len(b):
        return statistics.median(x / y for x, y in zip(a, b))
    return statistics.median(a) / statistics.median(b)


def ratio_text(value: Optional[float], digits: int = 2, suffix: str = "", *,
               trim: bool = False) -> str:
    """A ratio as a table shows it; ``-`` where there is none. ``trim``: without trailing
    zeros (``0.5``, ``1``, ``0``), as docs/coverage.md's table shows bytes against Megatron's."""
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    if trim:
        text = text.rstrip("0").rstrip(".") if value else "0"
    return text + suffix


# ---- rows --------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """``value`` as JSON holds it (what JSON cannot hold as its ``str``)."""
    return json.loads(json.dumps(value, default=str))


def append_rows(path: Union[str, Path], rows: Iterable[Mapping[str, Any]], *,
                sort_keys: bool = False) -> None:
    """``rows`` added to the JSON-lines file ``path``, a row a line."""
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=sort_keys, default=str) + "\n")


def write_rows(path: Union[str, Path], rows: Iterable[Mapping[str, Any]], *,
               sort_keys: bool = False) -> None:
    """The JSON-lines file ``path``, begun afresh with ``rows``."""
    Path(path).write_text("")
    append_rows(path, rows, sort_keys=sort_keys)


def read_rows(path: Union[str, Path]) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_json(path: Union[str, Path], value: Any) -> None:
    """One JSON document (a list of rows, or a record holding them), indented one space."""
    Path(path).write_text(json.dumps(value, indent=1, default=str) + "\n", encoding="utf-8")


def read_json(path: Union[str, Path]) -> Any:
    """A JSON document that ``write_json`` wrote."""
    return json.loads(Path(path).read_text())


def print_row(row: Mapping[str, Any]) -> None:
    """A row on stdout as one JSON line (for a caller that reads the output)."""
    print(json.dumps(row, default=str), flush=True)


# ---- tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A table column: its title, width, and how a row shows in it (``cell(row)`` -> text,
    or a format spec applied to ``row[key]``)."""

    title: str
    width: int
    key: str = ""
    spec: str = ""
    cell: Optional[Callable[[Mapping[str, Any]], str]] = None
    left: bool = False

    def text(self, row: Mapping[str, Any]) -> str:
        if self.cell is not None:
            return self.cell(row)
        value = row.get(self.key)
        return "-" if value is None else format(value, self.spec)

    def fit(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"


def header(columns: Sequence[Column], sep: str = " ") -> str:
    """The line of titles (for a table printed a row at a time, as rows are measured)."""
    return sep.join(c.fit(c.title) for c in columns).rstrip()


def line(columns: Sequence[Column], row: Mapping[str, Any], sep: str = " ") -> str:
    """One row of the table."""
    return sep.join(c.fit(c.text(row)) for c in columns).rstrip()


def table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]], *,
          sep: str = " ") -> str:
    """The rows under a line of titles, a column each."""
    return "\n".join([header(columns, sep), *(line(columns, row, sep) for row in rows)])


def markdown_table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> str:
    """The same table as Markdown, for a page of docs/ (the widths are not used)."""
    lines = ["| " + " | ".join(c.title.strip() for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.text(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
