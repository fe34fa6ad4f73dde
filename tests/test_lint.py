"""The code stays ruff clean, and the package (autotp, rules, planner) type-checks."""

from __future__ import annotations

import os
import subprocess
import sys

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
