"""The suite plans afresh: a plan cached by one test (``autotp.planner.cache``) would hide
what another test changes (a monkeypatched search, a narrower beam). tests/test_cache.py
turns the cache on, in a temporary directory."""

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

os.environ["AUTOTP_CACHE"] = "0"
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: workers share the cores
    import torch

    torch.set_num_threads(1)


# ---- the slow tier ---------------------------------------------------------------------------
# `python -m pytest -q -n auto` runs the default tier; `python -m pytest -q -n auto -m slow`
# runs the slow tier (CI, .ci/run, runs both). The split is measured, not kept by hand: the
# tests that took at least SLOW_SECONDS (setup, call and teardown) in the full run recorded in
# tests/durations.json are slow (recorded with -n 2 on 2 cores: each test's seconds include
# sharing the cores with the other worker); a test the file does not know yet is in the
# default tier.
# Re-record after adding slow tests:
#   python -m pytest -q -n auto -m "slow or not slow" --record-durations tests/durations.json
SLOW_SECONDS = 8.0
DURATIONS_FILE = Path(__file__).with_name("durations.json")
DURATIONS: dict[str, float] = (json.loads(DURATIONS_FILE.read_text())
                               if DURATIONS_FILE.exists() else {})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", metavar="FILE",
                     help="write each test's seconds (setup, call and teardown) to FILE")


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--record-durations")
    if target and not hasattr(session.config, "workerinput"):
        with open(target, "w") as f:
            json.dump({k: round(v, 2) for k, v in sorted(_SECONDS.items())}, f, indent=0)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    for item in items:
        if DURATIONS.get(item.nodeid, 0.0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)
    yield  # the other plugins: -m deselects the other tier
    # the files with the most recorded seconds first, each file's tests in a row: the workers
    # (`-n`) take the longest work first, and a worker that runs several tests of a file in a
    # row makes its module fixtures once
    per_file: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        per_file[path] = per_file.get(path, 0.0) + DURATIONS.get(item.nodeid, 1.0)
    items.sort(key=lambda item: -per_file[item.nodeid.split("::")[0]])
