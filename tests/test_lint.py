"""The code stays ruff clean, and the pure-data core (layouts, rules, plan, cost) type-checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPED = ["autotp/layout.py", "rules", "planner/plan.py", "planner/transitions.py",
         "planner/cost.py", "planner/gradflow.py", "planner/coalesce.py", "planner/blockers.py",
         "autotp/capture/sums.py", "autotp/capture/branches.py", "autotp/features/verify.py",
         "autotp/features/clipping.py", "autotp/features/saved_tensors.py"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_clean() -> None:
    # through this interpreter (python -m ruff), never PATH: an unactivated venv still runs it
    pytest.importorskip("ruff", reason="ruff is a test dependency: pip install -e '.[test]'")
    result = _run("ruff", "check", "autotp", "rules", "planner", "tests", "examples",
                  "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_on_the_typed_core() -> None:
    pytest.importorskip("mypy")
    result = _run("mypy", *TYPED, "--ignore-missing-imports", "--follow-imports=silent")
    assert result.returncode == 0, result.stdout + result.stderr
