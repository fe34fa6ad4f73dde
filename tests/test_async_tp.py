"""async_tp=True: torch's micro-pipeline pass over the compiled rank program. Off CUDA it
cannot run, and every way of asking for it where it cannot says what to change; the
options it hands torch.compile keep the user's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autotp
import autotp.api
from autotp.errors import ConfigError
from autotp.runtime import async_tp
from autotp.runtime.comm import ProcessGroupComm
from autotp.runtime.launch import run_processes


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


X = torch.randn(2, 8, 16)


@pytest.mark.parametrize("options, says", [
    ({"sequence_parallel": True}, "pass compile=True"),
    ({"sequence_parallel": True, "compile": {"backend": "eager"}}, "backend 'eager'"),
    ({"compile": True}, "pass sequence_parallel=True"),
    ({"compile": True, "sequence_parallel": True}, "ranks in processes"),
])
def test_async_tp_where_it_cannot_run_says_what_to_change(options: dict[str, Any],
                                                         says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        autotp.simulate(MLP(), 2, example_args=(X,), async_tp=True, **options)


def _on_gloo(rank: int, world_size: int, untraced: bool = False) -> str:
    if untraced:  # refused before anything is traced or planned
        autotp.api._prepare = _never
    try:
        autotp.parallelize(MLP(), tp=2, example_args=(X,), sequence_parallel=True,
                           compile=True, async_tp=True)
    except ConfigError as exc:
        return str(exc)
    return "built"


def test_async_tp_on_a_gloo_group_of_cpus_is_refused() -> None:
    for said in run_processes(_on_gloo, 2, timeout=120):
        assert "needs CUDA GPUs and an NCCL group" in said and "cpu with gloo" in said, said


def test_the_pass_is_added_to_the_users_compile_options(monkeypatch: Any) -> None:
    enabled = []
    monkeypatch.setattr(async_tp, "_enable_symmetric_memory", enabled.append)
    comm = object.__new__(ProcessGroupComm)
    comm.backend, comm.group_name = "nccl", "7"
    asked = {"mode": "max-autotune-no-cudagraphs", "options": {"epilogue_fusion": False}}
    options = async_tp.compile_options(asked, comm, True, torch.device("cuda", 0))
    # torch.compile takes a mode or options, not both: the mode's options stand for it
    assert options == {"options": {**torch._inductor.list_mode_options(asked["mode"]),
                                   "epilogue_fusion": False, "_micro_pipeline_tp": True}}
    assert options["options"]["max_autotune"] is True
    assert asked["options"] == {"epilogue_fusion": False}  # the caller's dict untouched
    assert enabled == ["7"]
    assert async_tp.compile_options(True, comm, True, torch.device("cuda", 0)) == \
        {"options": {"_micro_pipeline_tp": True}}


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("traced and planned before async_tp was checked")


def test_async_tp_is_refused_before_tracing(monkeypatch: Any) -> None:
    """The checks come before capture and planning (minutes on a large model): nothing is
    traced when the answer is no."""
    monkeypatch.setattr(autotp.api, "_prepare", _never)
    with pytest.raises(ConfigError, match="pass sequence_parallel=True"):
        autotp.simulate(MLP(), 2, example_args=(X,), compile=True, async_tp=True)
    for said in run_processes(_on_gloo, 2, True, timeout=120):
        assert "needs CUDA GPUs and an NCCL group" in said, said
