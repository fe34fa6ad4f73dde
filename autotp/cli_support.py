"""What the command line adds around the library so that it speaks to a user in the words of
the command line: flags (not Python arguments), one message per cause (not a torch.export
graph dump or a Python warning with a file and a line), model names checked before anything
is built (did you mean, Hub ids), the output format read from ``-o``'s suffix, and the exit
code by cause (a model library rejecting the user's config is the user's input: exit 2).

Nothing here changes what a plan or an estimate is; it only decides what reaches the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import logging
import os
import re
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional


from autotp.errors import ConfigError

# Python arguments in library messages -> what the command line takes instead
_FLAG_WORDS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\bstrict=False"), "--non-strict"),
    (re.compile(r"pass example_args=\(\.\.\.\) and/or example_kwargs=\{\.\.\.\}"),
     "return (model, example_args) or (model, example_args, example_kwargs) from a "
     "file.py:factory"),
    (re.compile(r"pass example_args or example_kwargs"),
     "return (model, example_args) from a file.py:factory"),
    (re.compile(r"\(in example_kwargs\)"), "(in the example a file.py:factory returns)"),
]


def in_flag_words(text: str) -> str:
    """``text`` with the library's Python arguments replaced by the command line's flags."""
    for pattern, words in _FLAG_WORDS:
        text = pattern.sub(words, text)
    return text


# ---- what reaches the terminal --------------------------------------------------------------

def _torch_loggers() -> list[logging.Logger]:
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] == "torch"]
    return [logging.getLogger(n) for n in ["torch", *names]]


@contextlib.contextmanager
def terminal(verbose: bool) -> Iterator[None]:
    """Without ``verbose``: torch's log records (torch.export's graph of a failed trace) held
    back, and Python warnings condensed: autotp's own (``autotp: ...``) printed as one
    ``autotp: warning:`` line each, others (torch's, transformers') dropped. With
    ``verbose``: everything as the libraries print it."""
    if verbose:
        yield
        return
    loggers = _torch_loggers()
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    real, held = sys.stderr, io.StringIO()  # torch.export prints a failed trace's graph there
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(held):
            warnings.simplefilter("always")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for line in held.getvalue().splitlines():  # autotp's own lines (wrote FILE) stay
            if line.startswith("autotp: "):
                print(line, file=real)
        seen: set[str] = set()
        for item in caught:
            text = str(item.message)
            if text.startswith("autotp: ") and text not in seen:
                seen.add(text)
                print("autotp: warning: " + in_flag_words(text[len("autotp: "):]), file=real)


# ---- models named on the command line -------------------------------------------------------

def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"hf:{c}" for c in close) + "?"
    return f"{len(known)} types are known, e.g. hf:llama, hf:gpt2, hf:mistral, hf:qwen2"


@contextlib.contextmanager
def model_source(spec: str) -> Iterator[str]:
    """The spec ``load_model`` reads for the one the user gave: an ``hf:`` type checked (a
    close name suggested), an ``hf:org/name`` Hub id read from transformers' cache through
    AutoConfig into a directory holding its config.json (the weights are not read)."""
    if not spec.startswith("hf:"):
        yield spec
        return
    from autotp.capture.named_models import known_model_types  # with the command, not --help

    name = spec[3:]
    if "/" not in name:
        known = known_model_types()
        if name not in known:
            raise ConfigError(f"unknown model type {name!r} for hf:; {_did_you_mean(name, known)} "
                              "(a Hub id is hf:org/name; a local model is a directory "
                              "with a config.json)")
        yield spec
        return
    from transformers import AutoConfig  # optional: transformers

    try:  # transformers' cache only: the command line reaches no network
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"the Hub model {name!r} is not in transformers' cache on this machine ({first}); "
            "autotp reads Hub configs from the cache only: download its config.json into a "
            f"directory DIR (e.g. huggingface-cli download {name} config.json --local-dir DIR "
            "where there is a network) and pass DIR as MODEL") from None
    with tempfile.TemporaryDirectory(prefix="autotp-config-") as directory:
        config.save_pretrained(directory)
        yield directory


# ---- output ---------------------------------------------------------------------------------

SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".json": "json", ".dot": "dot",
                  ".gv": "dot", ".txt": "table"}


def output_format(given: Optional[str], output: Optional[str], choices: list[str]) -> str:
    """``--format`` where given; else the one ``-o``'s suffix names (plan.html: html);
    else a table."""
    if given is not None:
        return given
    if output:
        inferred = SUFFIX_FORMATS.get(Path(output).suffix.lower())
        if inferred in choices:
            return inferred
    return "table"


# ---- exit codes by cause --------------------------------------------------------------------

_BUILDER = os.path.join("capture", "named_models.py")  # load_model and the factory it calls


def rejected_input(exc: BaseException) -> Optional[str]:
    """Where ``exc`` was raised while the user's model was being built from their MODEL and
    ``--set`` values (a config a model library refuses, a factory that raises): the library
    that refused it; otherwise None (an internal error)."""
    frames = traceback.extract_tb(exc.__traceback__)
    building = [i for i, f in enumerate(frames) if f.filename.endswith(_BUILDER)]
    if not building or not isinstance(exc, (ValueError, TypeError, KeyError, AssertionError,
                                            AttributeError, NotImplementedError)):
        return None
    below = frames[building[-1] + 1:]
    if not below:
        return None
    filename = below[-1].filename
    for library in ("transformers", "torch"):
        if f"{os.sep}{library}{os.sep}" in filename:
            return library
    return os.path.basename(filename)


def input_message(exc: BaseException, library: str, model: str, overrides: list[str]) -> str:
    given = " ".join(f"--set {o}" for o in overrides)
    change = (f"change the --set values ({given}) or the MODEL" if overrides else
              "change the MODEL or set its fields with --set KEY=VALUE")
    text = str(exc).strip() or type(exc).__name__
    return f"{library} rejected the model {model}: {text}\n  {change}"


# ---- flags ----------------------------------------------------------------------------------

class OnOff(argparse.BooleanOptionalAction):
    """``--flag``, ``--no-flag``, and ``--flag on`` / ``--flag off``: the spelling the
    estimate's ``best:`` line prints, so that the line pastes back as a command."""

    WORDS = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"
        self.metavar = "on|off"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        negative = bool(option_string and option_string.startswith("--no-"))
        if values is None:
            setattr(namespace, self.dest, not negative)
        elif not negative and str(values).lower() in self.WORDS:
            setattr(namespace, self.dest, self.WORDS[str(values).lower()])
        else:
            parser.error(f"{option_string} takes on or off (or nothing), got {values!r}")
