"""Plans cached across processes (autotp.planner.cache): a second plan of the same program
is read, not searched, and equals the first; anything the plan depends on (the model's
code, tp, autotp's own code) is a new key; a cache that is off or broken only costs a plan.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import autotp
import autotp.planner.solve as solve
from autotp.capture.trace import capture
from autotp.planner.cache import plan_key

MODEL = '''
import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.{act}(self.up(x)))
'''


def _model(tmp_path: Path, act: str, name: str) -> torch.nn.Module:
    path = tmp_path / f"{name}.py"
    path.write_text(MODEL.format(act=act))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.MLP()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "plans"
    monkeypatch.setenv("AUTOTP_CACHE", "1")
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(directory))
    return directory


def _x() -> dict[str, Any]:
    return {"x": torch.randn(2, 5, 16)}


def test_a_second_plan_is_read_not_searched(cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path, "relu", "cached_mlp")
    first = autotp.plan(model, 2, example_kwargs=_x())
    assert len(list(cache.glob("*.json"))) == 1

    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("planned again")

    monkeypatch.setattr(solve, "_search_further", no_search)
    second = autotp.plan(model, 2, example_kwargs=_x())
    assert second.to_json() == first.to_json()
    assert [(c.kind, c.phase) for c in second.collectives] == [("all_reduce", "forward")]
    with pytest.raises(AssertionError, match="planned again"):  # another tp: not cached
        autotp.plan(model, 4, example_kwargs=_x())


def test_an_edited_model_file_misses(cache: Path, tmp_path: Path) -> None:
    """The same module path and shapes, one op changed in the model's file: a new key."""
    relu = capture(_model(tmp_path, "relu", "edited_mlp"), example_kwargs=_x())
    gelu = capture(_model(tmp_path, "tanh", "edited_mlp"), example_kwargs=_x())
    key = (2, "options")
    assert plan_key(relu, key) != plan_key(gelu, key)
    assert plan_key(relu, key) == plan_key(
        capture(_model(tmp_path, "relu", "edited_mlp"), example_kwargs=_x()), key)
    assert plan_key(relu, key) != plan_key(relu, (4, "options"))


def test_autotps_own_code_is_part_of_the_key(cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import autotp.planner.cache as plan_cache

    captured = capture(_model(tmp_path, "relu", "versioned_mlp"), example_kwargs=_x())
    before = plan_key(captured, (2,))
    monkeypatch.setattr(plan_cache, "_code_digest", lambda: "another autotp")
    assert plan_key(captured, (2,)) != before


def test_off_writes_nothing(cache: Path, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTP_CACHE", "0")
    autotp.plan(_model(tmp_path, "relu", "uncached_mlp"), 2, example_kwargs=_x())
    assert not cache.exists()


def test_a_broken_entry_is_planned_again(cache: Path, tmp_path: Path) -> None:
    model = _model(tmp_path, "relu", "broken_mlp")
    first = autotp.plan(model, 2, example_kwargs=_x())
    [entry] = cache.glob("*.json")
    entry.write_text(first.to_json()[:100])  # a write cut short
    assert autotp.plan(model, 2, example_kwargs=_x()).to_json() == first.to_json()
    assert entry.read_text() == first.to_json()
