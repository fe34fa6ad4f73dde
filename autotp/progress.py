"""Progress of long work (tracing, planning each distinct layer, explain's forced candidates,
estimate's ranking) as records of the ``autotp`` logger at INFO: silent unless someone
listens. The only state is that logger (its handlers and level); a stage's clock is its own.

    with stage("tracing with torch.export"):          # start and end (with its seconds)
        ...
        step("layer 3", done=1, total=2)              # a step of the innermost open stage

Listening:
    logging.getLogger("autotp").setLevel(logging.INFO)   # plain ``logging``: every record's
                                                         # message reads as one line
    with autotp.progress.on_progress(callback): ...      # callback(Event) for each event
    with autotp.progress.to_stream(sys.stderr): ...      # the command line's: one live line
                                                         # on a terminal, plain lines otherwise
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Optional, ParamSpec, TextIO, TypeVar

LOGGER = logging.getLogger("autotp")

Kind = Literal["start", "step", "end", "note"]
Params = ParamSpec("Params")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Event:
    """One progress event. ``stage``: the stage's name (a step's and a note's: empty, they
    belong to the innermost open stage); ``seconds``: an ended stage's duration."""
    kind: Kind
    stage: str = ""
    detail: str = ""
    done: Optional[int] = None
    total: Optional[int] = None
    seconds: Optional[float] = None

    def text(self) -> str:
        """The event as one line, without the ``autotp:`` prefix."""
        if self.kind == "start":
            return f"{self.stage} ..."
        if self.kind == "end":
            return f"{self.stage}: {self.seconds:.1f} s"
        count = f"{self.done} of {self.total}: " if self.done is not None and self.total \
            else ""
        return count + self.detail


def _emit(event: Event) -> None:
    LOGGER.info("%s", event.text(), extra={"autotp_progress": event})


def listening() -> bool:
    """Whether anyone receives progress (callers skip the work of describing a step)."""
    return LOGGER.isEnabledFor(logging.INFO)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """A stage of long work: its start, and its end with its seconds (also when it raises)."""
    if not listening():
        yield
        return
    start = time.perf_counter()
    _emit(Event("start", name))
    try:
        yield
    finally:
        _emit(Event("end", name, seconds=time.perf_counter() - start))


def staged(name: str) -> Callable[[Callable[Params, Result]], Callable[Params, Result]]:
    """A function whose every call is a stage: ``@staged("tracing with torch.export")``."""
    def decorate(function: Callable[Params, Result]) -> Callable[Params, Result]:
        @functools.wraps(function)
        def run(*args: Params.args, **kwargs: Params.kwargs) -> Result:
            with stage(name):
                return function(*args, **kwargs)
        return run
    return decorate


def step(detail: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
    """A step of the innermost open stage: ``done`` of ``total`` where they are known."""
    if listening():
        _emit(Event("step", detail=detail, done=done, total=total))


def note(text: str) -> None:
    """A line of its own (what the work found, not how far it is)."""
    if listening():
        _emit(Event("note", detail=text))


@contextmanager
def _listened(handler: logging.Handler) -> Iterator[None]:
    """``handler`` on the ``autotp`` logger, at INFO, for the block's duration."""
    level = LOGGER.level
    LOGGER.addHandler(handler)
    if not LOGGER.isEnabledFor(logging.INFO):
        LOGGER.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)


class _Callback(logging.Handler):
    def __init__(self, callback: Callable[[Event], None]):
        super().__init__(logging.INFO)
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "autotp_progress", None)
        self.callback(event if isinstance(event, Event) else
                      Event("note", detail=record.getMessage()))


@contextmanager
def on_progress(callback: Callable[[Event], None]) -> Iterator[None]:
    """``callback(event)`` for every progress event (and every other INFO record of autotp,
    as a note) while the block runs."""
    with _listened(_Callback(callback)):
        yield


class _Stream(logging.Handler):
    """Progress on a stream. ``live`` (a terminal): one line rewritten in place, showing the
    open stages and the latest step, each outermost stage left as a line with its seconds;
    otherwise plain lines (a log): each stage's start and end, each note, the steps of the
    outermost stage, and those of a stage within it at most one a second."""

    def __init__(self, stream: TextIO, live: bool):
        super().__init__(logging.INFO)
        self.stream, self.live = stream, live
        self.open: list[list[str]] = []  # per open stage: [its name, its latest step]
        self.written = 0.0  # when the last line was

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "autotp_progress", None)
        if not isinstance(event, Event):
            event = Event("note", detail=record.getMessage())
        if event.kind == "start":
            self.open.append([event.stage, ""])
        elif event.kind == "end" and self.open:
            self.open.pop()
        elif event.kind == "step" and self.open:
            self.open[-1][1] = event.text()
        if not self.live:
            now = time.monotonic()
            if event.kind != "step" or len(self.open) <= 1 or now - self.written >= 1.0:
                self.written = now
                self._write(f"autotp: {self._prefix(event)}{event.text()}\n")
            return
        if event.kind == "note" or not self.open:
            self._write(f"\r\x1b[Kautotp: {event.text()}\n")
        if self.open:
            self._write("\r\x1b[K" + self._clip("autotp: " + ": ".join(
                name + (f" ({latest})" if latest else "") for name, latest in self.open)))

    def _prefix(self, event: Event) -> str:
        """A step is its stage's: ``planning: 2 of 3: layer 1``."""
        return f"{self.open[-1][0]}: " if event.kind == "step" and self.open else ""

    def _clip(self, line: str) -> str:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        return line if len(line) <= width else line[: width - 3] + "..."

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


@contextmanager
def to_stream(stream: TextIO, live: Optional[bool] = None) -> Iterator[None]:
    """Progress written to ``stream`` while the block runs: a live line where ``live`` (by
    default: where the stream is a terminal), plain lines otherwise."""
    if live is None:
        isatty = getattr(stream, "isatty", None)
        live = bool(isatty and isatty())
    handler = _Stream(stream, live)
    try:
        with _listened(handler):
            yield
    finally:
        if live:
            handler._write("\r\x1b[K")  # nothing half-written ahead of what follows


__all__ = ["Event", "LOGGER", "listening", "note", "on_progress", "stage", "staged", "step",
           "to_stream"]
