"""The code stays ruff clean, and the pure-data core (layouts, rules, plan, cost) type-checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPED = ["autotp/layout.py", "rules", "planner/plan.py", "planner/transitions.py",
         "planner/cost.py"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean() -> None:
    result = _run("ruff", "check", "autotp", "rules", "planner", "tests", "examples",
                  "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_on_the_typed_core() -> None:
    pytest.importorskip("mypy")
    result = _run("mypy", *TYPED, "--ignore-missing-imports", "--follow-imports=silent")
    assert result.returncode == 0, result.stdout + result.stderr
