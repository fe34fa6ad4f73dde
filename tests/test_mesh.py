"""The parallel axes as one ``autotp.mesh.Mesh`` and the options as one ``autotp.Options``:
the same plans whichever way the caller names them, one clear error per wrong mesh, and
``autotp.parallelize(model, mesh=device_mesh)`` on a (dp, cp, tp) mesh of 8 gloo processes
against the unsharded model."""

from __future__ import annotations

import inspect

import pytest

import autotp
from autotp.errors import ConfigError
from autotp.mesh import FLAGS, Axis, Mesh, check_axes, resolve_mesh
from autotp.options import PLANNING, Options
from autotp.runtime.launch import run_processes
from tests import context_cases as cc
from tests import mesh_cases, models


def test_degrees_make_the_mesh_and_its_plan_axis() -> None:
    """The plan runs over tp, or over cp where tp is 1; the other axis of several ranks is
    beside it."""
    plain = resolve_mesh(tp=4)
    assert (plain.tp, plain.cp, plain.ep) == (4, 1, 1)
    assert plain.plan_axis.name == "tp" and plain.outer_axis is None
    alone = resolve_mesh(tp=1, cp=2)
    assert alone.plan_axis.name == "cp" and alone.outer_axis is None
    assert alone["cp"].layout is not None and alone["cp"].layout.chunks_of(1) == (1, 2)
    inside = resolve_mesh(tp=2, cp=2)
    assert inside.plan_axis.name == "tp" and inside.outer_axis is inside["cp"]
    assert [a.name for a in inside.sample_axes] == ["tp", "cp"]
    experts = resolve_mesh(tp=2, ep=2)
    assert experts.outer_axis is experts["ep"] and len(experts.sample_axes) == 1
    assert [a.name for a in inside] == ["dp", "pp", "cp", "tp", "ep"]


@pytest.mark.parametrize("mesh,sequence_parallel,words", [
    (Mesh.of({"cp": Axis("cp", 2), "ep": Axis("ep", 2)}), False,
     "cp=2 with ep=2: expert parallelism across context-parallel ranks is not there yet; "
     "pass no ep with cp"),
    (Mesh.of({"cp": Axis("cp", 2)}), True,
     "cp=2 with sequence_parallel at tp=1: context parallelism shards the sequence itself; "
     "pass sequence_parallel only with tp > 1"),
    (Mesh.of({"pp": Axis("pp", 2), "tp": Axis("tp", 2)}), False,
     "the mesh has a pp axis of 2 ranks, and parallelize builds the whole model on every "
     "rank: build the stages with autotp.pipeline_stages"),
])
def test_axes_that_do_not_compose_are_one_error_each(mesh: Mesh, sequence_parallel: bool,
                                                     words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_axes(mesh, sequence_parallel=sequence_parallel)
    assert str(refused.value).startswith(words), str(refused.value)


def test_the_command_line_is_refused_in_its_own_words() -> None:
    with pytest.raises(ConfigError, match="--cp 2 with --sequence-parallel at --tp 1"):
        resolve_mesh(tp=1, cp=2, sequence_parallel=True, spelling=FLAGS)
    with pytest.raises(ConfigError, match="--tp must be a positive int, got 0"):
        resolve_mesh(tp=0, spelling=FLAGS)
    with pytest.raises(ConfigError, match="pass mesh= or the groups"):
        resolve_mesh(mesh=object(), group=object())
    with pytest.raises(ConfigError, match="planning and simulation take the degrees"):
        resolve_mesh(tp=2, group=object())


def test_options_are_one_value_given_as_keywords_or_whole() -> None:
    """Keywords, ``options=``, and both (keywords over the value) plan identically; the
    signature and help() list every option; a keyword an entry point does not take is
    refused by name, with the closest one."""
    inputs = cc.model_inputs("llama", False)
    by_keywords = autotp.plan(models.llama(), 2, example_kwargs=inputs, gather_outputs=False)
    whole = Options(example_kwargs=inputs, gather_outputs=False)
    by_value = autotp.plan(models.llama(), 2, options=whole)
    over = autotp.plan(models.llama(), 2, options=Options(gather_outputs=False),
                       example_kwargs=inputs)
    assert by_keywords.to_json() == by_value.to_json() == over.to_json()
    shown = inspect.signature(autotp.parallelize).parameters
    assert {"mesh", "group", "cp_group", "sequence_parallel", "checkpoint", "device"} <= \
        set(shown)
    assert shown["gather_outputs"].default == "read"
    assert tuple(n for n in inspect.signature(autotp.plan).parameters if n in PLANNING) == \
        PLANNING
    assert "``keep_gathered``: with sequence parallelism" in autotp.simulate.__doc__
    with pytest.raises(ConfigError, match="unexpected keyword 'sequence_paralel'; did you "
                                          "mean sequence_parallel"):
        autotp.plan(models.llama(), 2, sequence_paralel=True)
    with pytest.raises(ConfigError, match="grad_sync is an option of building a rank"):
        autotp.plan(models.llama(), 2, grad_sync="per_use")


def test_a_mesh_plans_as_its_degrees() -> None:
    """``plan(mesh=...)`` and ``simulate(mesh=...)`` with an autotp Mesh: the plan of the
    same degrees, the ranks tp rank t of cp rank c at ``c * tp + t``."""
    inputs = cc.model_inputs("llama", False)
    mesh = resolve_mesh(tp=2, cp=2)
    by_mesh = autotp.plan(models.llama(), mesh=mesh, example_kwargs=inputs)
    by_degrees = autotp.plan(models.llama(), 2, cp=2, example_kwargs=inputs)
    assert by_mesh.to_json() == by_degrees.to_json() and by_mesh.cp == 2
    sim = autotp.simulate(models.llama(), mesh=mesh, example_kwargs=inputs)
    assert [(m.comm.rank, m.cp_comm.rank) for m in sim.ranks] == \
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(ConfigError, match="pass the tensor-parallel degree tp="):
        autotp.plan(models.llama(), example_kwargs=inputs)


def test_sequence_parallel_norm_gradients_are_summed_over_tp_and_averaged_over_dp() -> None:
    """(dp 2, tp 2) with sequence parallelism and autotp's own dp mean: after two
    accumulated backwards every gradient is within 1e-6 of the unsharded model's on the
    whole batch, the norms' weights included (the bucket sums them over tp before the dp
    mean reads them)."""
    for rank, r in enumerate(run_processes(mesh_cases.dp_tp_sequence_parallel, 4,
                                           timeout=300)):
        assert r["deferred"] and all("norm" in k for k in r["deferred"]), (rank, r)
        worst = max(r["diffs"], key=r["diffs"].get)
        assert r["diffs"][worst] < 1e-6, (rank, worst, r["diffs"][worst])


@pytest.mark.slow
def test_eight_gloo_processes_parallelize_over_a_dp_cp_tp_device_mesh() -> None:
    """8 gloo processes, ``parallelize(model, mesh=init_device_mesh(..., (2, 2, 2),
    mesh_dim_names=("dp", "cp", "tp")))``: tp and cp from the mesh (tp rank = rank % 2, cp
    rank = rank // 2 % 2), FSDP2 per layer and at the root over dp x cp flattened (padded
    LLaMA): the first step's gradients within 1e-5 of the unsharded model's on the whole
    batch; over 2 AdamW steps after ``clip_grad_norm_`` (within 1e-5 relative), the dp-mean
    loss within 1e-5 and the parameters within 1e-4. An unknown dim name, a tp= the mesh
    does not have, a mesh with groups, cp with ep and a pp axis are each refused by one
    error that says what to change."""
    for rank, r in enumerate(run_processes(mesh_cases.dp_cp_tp_mesh, 8, timeout=500)):
        assert r["grad_diff"] < 1e-5 and r["norm_diff"] < 1e-5, (rank, r)
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-4 and r["names"], (rank, r)
        assert r["rings"] == 2 and r["degrees"] == (2, 2), (rank, r)
        assert r["ranks"] == (rank % 2, rank // 2 % 2), (rank, r)
        errors = r["errors"]
        assert "dim(s) 'fsdp', which autotp does not know" in errors["unknown dim"]
        assert "tp=4 but the mesh's 'tp' dim has 2 rank(s): pass tp=2" in errors["tp degree"]
        assert "pass mesh= or the groups" in errors["mesh and group"]
        assert "cp=2 with ep=4" in errors["cp with ep"]
        assert "autotp.pipeline_stages(model, mesh)" in errors["pp"]
