"""The code stays ruff clean, and the package (autotp, rules, planner) type-checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_clean() -> None:
    # through this interpreter (python -m ruff), never PATH: an unactivated venv still runs it
    pytest.importorskip("ruff", reason="ruff is a test dependency: pip install -e '.[test]'")
    result = _run("ruff", "check", "autotp", "rules", "planner", "tests", "examples",
                  "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    pytest.importorskip("mypy")
    result = _run("mypy", "autotp", "rules", "planner", "--ignore-missing-imports",
                  "--follow-imports=silent")
    assert result.returncode == 0, result.stdout + result.stderr


# sys.path edits and PYTHONPATH set for a child: how a file would reach a neighbour by its plain
# name instead of as tests.models, benchmarks.peers, examples.nanogpt
PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path \+=|site\.addsitedir\("
                       r"|PYTHONPATH=")


def test_no_sys_path_edits() -> None:
    """tests/, benchmarks/ and examples/ are packages of the checkout: each imports the others
    from the repository root (pytest's ``pythonpath``, ``python -m benchmarks.NAME``), never by
    adding a folder to ``sys.path``."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("tests", "benchmarks", "examples")
             for path in sorted(Path(ROOT, folder).glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if PATH_EDIT.search(line) and path.name != "test_lint.py"]
    assert not found, found


# a module named by its file (planner/cost.py) or by a short dotted name (``planner.cost``)
PACKAGES = "planner|rules|capture|runtime|weights|integrations|presentation|verification"
OTHER_NAMING = re.compile(rf"\b(?:autotp/)?(?:{PACKAGES})/[a-z_/]+\.py\b"
                          rf"|``(?:{PACKAGES})\.[a-z_.]+``")


def test_modules_named_one_way() -> None:
    """The package's docstrings and comments name a module by its import path
    (``autotp.planner.cost``), the name a reader can import or look up."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("autotp", "planner", "rules")
             for path in sorted(Path(ROOT, folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if OTHER_NAMING.search(line)]
    assert not found, found
