"""``autotp.presentation.render``: the Graphviz digraph and the self-contained HTML page of a plan.

The DOT is checked structurally (and with Graphviz's ``dot`` when it is installed), the HTML
without a browser (self-contained, escaped, the embedded JSON round-trips to
``report.to_dict``) and, when Chromium is installed, in a real headless browser (its JS ran,
and its screenshot, decoded here, shows the plan's rows in their layouts' colours). Both tools
are optional: their tests skip cleanly without them.
A tiny Qwen3-MoE (4 experts) planned at tp 2 and 4 checks the page's mixture-of-experts rows.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Optional

import pytest
import torch

import autotp
from autotp.planner.cost import CostModel
from autotp.planner.plan import Plan
from autotp.presentation.dot import dot_quote, to_dot
from autotp.presentation.page import experts_per_rank, to_html
from autotp.presentation.render import CHECK_OPS, FILL, execution_order, layout_class
from autotp.presentation.report import fold_layers, group_names, human_bytes, to_dict, to_table
from tests.models import BUILDERS, qwen3_moe

COST = CostModel()


@pytest.fixture(scope="module")
def llama_plan() -> Plan:
    return autotp.plan(BUILDERS["llama"](), 4)


@pytest.fixture(scope="module")
def gpt2_plan() -> Plan:
    return autotp.plan(BUILDERS["gpt2"](), 4)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def moe_plan(request: pytest.FixtureRequest) -> Plan:
    """A tiny Qwen3-MoE: 2 layers, each with one block of 4 experts (gate_up_proj and
    down_proj stacked)."""
    pytest.importorskip("transformers")
    model = qwen3_moe()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autotp.plan(model, request.param, example_kwargs={"input_ids": ids})


def _plan(request: pytest.FixtureRequest, name: str) -> Plan:
    return request.getfixturevalue(f"{name}_plan")


def expected_param_rows(plan: Plan) -> int:
    """Rows of the parameter tables: one layer per group, and everything outside the layers."""
    return (sum(len(g.params) for g in fold_layers(plan))
            + sum(1 for p in plan.params.values() if p.layer is None))


def split_layers(plan: Plan) -> Plan:
    """The plan with a sharded matrix of layer 1 replicated: layers 0 and 1 now differ."""
    name = next(n for n, p in plan.params.items()
                if p.layer == 1 and p.layout.startswith("S") and len(p.global_shape) == 2)
    param = plan.params[name]
    params = dict(plan.params)
    params[name] = dataclasses.replace(param, layout="R", local_shape=param.global_shape)
    return plan.replaced(params=params)


# ---- where each collective comes from -------------------------------------------------------


def test_collectives_name_their_module_and_the_models_own_line(llama_plan: Plan) -> None:
    """Megatron's collectives of a LLaMA layer, located in the user's terms: the module path
    and the line of modeling_llama.py, never torch's ``F.linear`` in nn/modules/linear.py."""
    layer0 = [c for c in llama_plan.collectives if c.layer == 0]
    assert sorted(c.module for c in layer0 if c.phase == "forward") == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    for c in layer0:
        if c.phase == "backward":  # the gradient of the normed input, where it is read
            assert c.module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj",
                                "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.k_proj",
                                "model.layers.0.self_attn.v_proj"), c
    for c in llama_plan.collectives:
        if not c.node.startswith("grad sync"):
            assert c.source is not None and c.source.rsplit(":", 1)[0].endswith(
                os.path.join("llama", "modeling_llama.py")), c
    rows = to_dict(llama_plan, COST)["collectives"]
    assert {r["module"] for r in rows} >= {"model.layers.0.self_attn.o_proj", "lm_head"}
    table = to_table(llama_plan, COST)
    assert re.search(r"fwd all_reduce .* self_attn\.o_proj  modeling_llama\.py:\d+\n", table)
    assert "linear.py" not in table and "for all_reduce" not in table
    page = to_html(llama_plan, COST)
    assert '<td class="mono">model.layers.0.self_attn.o_proj</td>' in page


def test_grad_sync_names_are_folded_by_layer(llama_plan: Plan) -> None:
    """The after-backward sum of replicated parameters lists each parameter once with its
    layers as a range, not one name per layer (128 names for a 32-layer LLaMA)."""
    synced = sorted(n for n, p in llama_plan.params.items() if p.grad_sync)
    assert "model.layers.1.self_attn.k_proj.weight" in synced  # k/v: 2 heads at tp 4
    line = next(line for line in to_table(llama_plan, COST).splitlines() if "grad sync:" in line)
    assert "model.layers.{0-1}.self_attn.k_proj.weight" in line
    assert "model.layers.0." not in line and "model.layers.1." not in line
    assert group_names(["a.3.w", "a.0.w", "a.1.w", "a.9.w", "b"]) == "a.{0-1, 3, 9}.w, b"


def test_summary_counts_collectives_in_words(llama_plan: Plan) -> None:
    lines = llama_plan.summary().splitlines()
    for layer in (0, 1):  # Megatron: two all-reduces each way per layer
        assert f"  layer {layer}: forward: 2 all-reduces; backward: 2 all-reduces" in lines
    # the embedding's all-reduce, the logits' all-gather; the gradients into lm_head and the
    # after-backward sync of the replicated k/v projections
    assert ("  outside the layers: forward: 1 all-gather, 1 all-reduce; "
            "backward: 2 all-reduces") in lines


def test_plan_json_without_module_paths_still_loads(llama_plan: Plan) -> None:
    data = json.loads(llama_plan.to_json())
    assert Plan.from_json(json.dumps(data)).collectives == llama_plan.collectives
    for c in data["axes"]["tp"]["collectives"]:
        del c["module"]  # a plan written before collectives had module paths
    old = Plan.from_json(json.dumps(data))
    assert [dataclasses.replace(c, module=None) for c in llama_plan.collectives] == \
        old.collectives


# ---- DOT -----------------------------------------------------------------------------------


def strip_dot_strings(text: str) -> str:
    """DOT with every double-quoted string removed (escapes honoured)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def node_ids(dot: str) -> set[str]:
    return set(re.findall(r'^\s*"((?:[^"\\]|\\.)*)" \[', dot, flags=re.M))


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_dot_is_a_well_formed_digraph(request: pytest.FixtureRequest, model: str) -> None:
    plan = _plan(request, model)
    dot = to_dot(plan, COST)
    assert dot.startswith("digraph autotp {\n") and dot.endswith("}\n")
    bare = strip_dot_strings(dot)
    depth = 0
    for char in bare:
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth >= 0
    assert depth == 0
    # Outside strings, a statement holds only keywords, punctuation and "" placeholders.
    assert not re.search(r"[^\s{}\[\]=;,\-\>\"a-z_]", bare), "unquoted text in the DOT"
    assert dot == to_dot(plan, COST), "not deterministic"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_dot_folds_layers_into_a_cluster(request: pytest.FixtureRequest, model: str) -> None:
    plan = _plan(request, model)
    dot = to_dot(plan, COST)
    groups = fold_layers(plan)
    assert [g.layers for g in groups] == [[0, 1]]
    assert 'subgraph "cluster_layers_0" {' in dot
    assert '"layers 0-1 (x2)\\n' in dot
    assert "cluster_layers_1" not in dot
    ids = node_ids(dot)
    drawn_ops = {n for n in plan.graph
                 if plan.node_layers.get(n) == 0 and plan.ops[n] not in CHECK_OPS}
    skipped_ops = {n for n in plan.graph if plan.node_layers.get(n) == 1}
    assert drawn_ops <= ids
    assert not skipped_ops & ids, "nodes of folded layers are drawn"
    # The last layer's output is read outside the layers: drawn from the cluster.
    assert re.search(r'-> "[^"]+" \[label="from layer 1", style="dashed", '
                     r'ltail="cluster_layers_0"\]', dot)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_dot_shows_every_parameter_of_the_first_layer(request: pytest.FixtureRequest,
                                                      model: str) -> None:
    plan = _plan(request, model)
    dot = to_dot(plan, COST)
    for name, param in plan.params.items():
        if param.layer in (0, None):
            local = "×".join(map(str, param.local_shape))
            assert re.search(re.escape(f'[label="{name}\\n{param.layout}  ') + r"[^\"]*"
                             + re.escape(f"→ {local}"), dot), name
        else:
            assert f'"{name}\\n' not in dot, f"{name} of a folded layer is drawn"
    assert 'shape="cylinder"' in dot


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_dot_marks_every_collective(request: pytest.FixtureRequest, model: str) -> None:
    plan = _plan(request, model)
    dot = to_dot(plan, COST)
    data = to_dict(plan, COST)
    kinds = {c.kind for c in plan.collectives}
    assert kinds >= {"all_reduce"}
    for record, row in zip(plan.collectives, data["collectives"]):
        if record.layer not in (0, None):
            continue  # folded: layer 0's identical collectives stand for it
        phase = {"forward": "fwd", "backward": "bwd"}[record.phase]
        label = f"{record.kind} {phase} {human_bytes(row['bytes'])}  {record.src}→{record.dst}"
        assert label in dot, label
    # One diamond line per collective of the drawn layers (a grad sync adds a caption line).
    diamonds = re.findall(r'^\s*"collective:[^"]*" \[label="([^"]*)"', dot, flags=re.M)
    lines = [line for label in diamonds for line in label.split("\\n")
             if not line.startswith("grad sync")]
    assert len(lines) == sum(1 for c in plan.collectives if c.layer in (0, None))
    assert {line.split()[0] for line in lines} == kinds


def test_dot_of_a_plan_read_back_from_json(llama_plan: Plan) -> None:
    """A plan read back from JSON keeps the graph in execution order, and draws the same."""
    again = Plan.from_json(llama_plan.to_json())
    assert list(again.graph) == list(llama_plan.graph)
    assert execution_order(again) == list(llama_plan.graph)
    assert sorted(to_dot(again, COST).splitlines()) == \
        sorted(to_dot(llama_plan, COST).splitlines())


def test_dot_of_layers_that_differ(llama_plan: Plan) -> None:
    plan = split_layers(llama_plan)
    assert [g.layers for g in fold_layers(plan)] == [[0], [1]]
    dot = to_dot(plan, COST)
    assert 'subgraph "cluster_layers_0" {' in dot and 'subgraph "cluster_layers_1" {' in dot
    assert '"layer 1\\n' in dot
    assert "from layer" not in dot
    assert {n for n in plan.graph
            if plan.node_layers.get(n) == 1 and plan.ops[n] not in CHECK_OPS} <= node_ids(dot)


def test_runtime_checks_are_not_drawn(llama_plan: Plan) -> None:
    """torch.export's ``_assert_tensor_metadata`` nodes (dtype checks, no value) are dropped
    at capture, so neither the plan nor the pictures hold one; run-time checks that remain
    (``CHECK_OPS``) are not drawn; nothing else is left out."""
    assert "aten._assert_tensor_metadata.default" not in set(llama_plan.ops.values())
    checks = {n for n, op in llama_plan.ops.items() if op in CHECK_OPS}
    dot, page = to_dot(llama_plan, COST), to_html(llama_plan, COST)
    assert "_assert_tensor_metadata" not in dot and "_assert_tensor_metadata" not in page
    outside = {n for n in llama_plan.choices if llama_plan.node_layers.get(n) is None}
    assert outside - checks and outside - checks <= node_ids(dot)


def test_dot_quote_escapes() -> None:
    assert dot_quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert dot_quote("x -> y; }") == '"x -> y; }"'


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_graphviz_renders_the_dot(request: pytest.FixtureRequest, model: str,
                                  tmp_path: Path) -> None:
    plan = _plan(request, model)
    for variant in (plan, split_layers(plan)):
        source = tmp_path / "plan.dot"
        source.write_text(to_dot(variant, COST), encoding="utf-8")
        done = subprocess.run(["dot", "-Tsvg", str(source), "-o", str(tmp_path / "plan.svg")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "Error" not in done.stderr and "Warning" not in done.stderr, done.stderr
        assert "<svg" in (tmp_path / "plan.svg").read_text(encoding="utf-8")


# ---- HTML without a browser -----------------------------------------------------------------


def embedded_json(page: str) -> dict:
    found = re.findall(r'<script type="application/json" id="autotp-plan">(.*?)</script>', page,
                       flags=re.S)
    assert len(found) == 1
    return json.loads(found[0])


def test_html_is_self_contained(llama_plan: Plan) -> None:
    page = to_html(llama_plan, COST)
    assert page.startswith("<!DOCTYPE html>")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(//|[a-z]+:)""", page, flags=re.I)
    assert not re.search(r"<link\b", page, flags=re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", page, flags=re.I)
    assert "@import" not in page and "url(" not in page
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', page)
    assert csp is not None and html.unescape(csp.group(1)).startswith("default-src 'none';")
    assert page.count("<style>") == 1 and page.count("<script>") == 1
    assert len(page.encode()) < 200_000


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_html_embeds_the_report_data(request: pytest.FixtureRequest, model: str) -> None:
    plan = _plan(request, model)
    page = to_html(plan, COST)
    assert embedded_json(page) == to_dict(plan, COST)
    meta = re.search(r'<meta name="autotp-summary" content="([^"]*)">', page)
    assert meta is not None
    assert json.loads(html.unescape(meta.group(1))) == to_dict(plan, COST)["summary"]
    assert page == to_html(plan, COST), "not deterministic"


def test_html_has_one_section_per_group_of_identical_layers(llama_plan: Plan) -> None:
    page = to_html(llama_plan, COST)
    groups = fold_layers(llama_plan)
    assert len(re.findall(r'<details class="group" open data-layers=', page)) == len(groups)
    assert "<summary>layers 0-1 ×2, identical: 2 fwd + 2 bwd all-reduces" in page
    assert page.count('<details class="group outside" open>') == 1
    assert page.count('class="param-row"') == expected_param_rows(llama_plan)
    for name, param in llama_plan.params.items():
        assert (f'data-name="{name}"' in page) == (param.layer in (0, None)), name
    assert "collectives of layer 0" in page and "dataflow of layer 0" in page
    for op in ("linear", "scaled_dot_product_attention"):
        assert f'<span class="op mono">{op}</span>' in page
    assert page.count('<li class="mark">') == sum(
        1 for c in llama_plan.collectives if c.layer in (0, None) and c.node in llama_plan.graph)

    split = split_layers(llama_plan)
    page = to_html(split, COST)
    assert len(re.findall(r'<details class="group" open data-layers=', page)) == 2
    assert "<summary>layer 1: 2 fwd + 2 bwd all-reduces" in page
    assert page.count('class="param-row"') == expected_param_rows(split) == len(split.params)


def test_html_escapes_text(llama_plan: Plan) -> None:
    evil = '<script>alert("x")</script>&amp;'
    plan = llama_plan.replaced(model=evil, fallbacks=[f"{evil} at node"])
    page = to_html(plan, COST)
    assert evil not in page
    assert html.escape(evil) in page
    assert embedded_json(page)["model"] == evil
    assert page.count("<script") == 2  # the data and the code, nothing injected


def test_cli_writes_html(tmp_path: Path) -> None:
    from autotp.cli import main

    out = tmp_path / "plan.html"
    spec = f"{Path(__file__).with_name('models.py')}:llama"
    assert main(["plan", spec, "--tp", "4", "--format", "html", "-o", str(out), "-q"]) == 0
    page = out.read_text(encoding="utf-8")
    assert embedded_json(page)["tp"] == 4
    assert "layers 0-1 ×2, identical" in page


# ---- HTML: mixture of experts ---------------------------------------------------------------


def experts_sections(page: str) -> list[tuple[str, str]]:
    """(data-layers, inner HTML) of each experts section, in page order."""
    return re.findall(r'<section class="experts" data-layers="([^"]*)">(.*?)</section>', page,
                      flags=re.S)


def experts_rows(page: str) -> dict[str, str]:
    """data-block -> the row's HTML, one per MoE block shown."""
    rows = re.findall(r'<tr class="experts-row" data-block="([^"]*)"[^>]*>(.*?)</tr>', page,
                      flags=re.S)
    assert len({block for block, _ in rows}) == len(rows), "a block shown twice"
    return {html.unescape(block): row for block, row in rows}


def test_html_groups_the_stacked_experts_of_each_moe_block(moe_plan: Plan) -> None:
    tp = moe_plan.tp
    per_rank = 4 // tp
    assert sorted(moe_plan.experts) == [f"model.layers.{i}.mlp.experts.{w}"
                                        for i in (0, 1) for w in ("down_proj", "gate_up_proj")]
    assert all(v == [4, "whole"] for v in moe_plan.experts.values()), moe_plan.experts
    page = to_html(moe_plan, COST)
    # identical layers fold: one section, one row naming the block of both layers
    assert [layers for layers, _ in experts_sections(page)] == ["0-1"]
    rows = experts_rows(page)
    assert list(rows) == ["model.layers.{0-1}.mlp.experts"]
    row = rows["model.layers.{0-1}.mlp.experts"]
    assert '<td class="mono block">mlp.experts' in row
    assert f'<span class="edim">{per_rank} of 4 per rank, whole</span>' in row
    assert row.index(">gate_up_proj<") < row.index(">down_proj<")  # the plan's order
    assert row.count(">S(0)·experts</span>") == 2  # dim 0, the experts, is what is split
    assert f"[4 experts]×64×64 → [{per_rank} experts]×64×64" in row
    assert f"[4 experts]×64×32 → [{per_rank} experts]×64×32" in row
    assert "1 MoE block</span></summary>" in page
    # the summary line, at the top: before the cards and every section
    line = re.search(r'<p class="moe experts-summary">(.*?)</p>', page)
    assert line is not None and line.start() < page.index('<div class="cards">')
    assert html.escape(moe_plan.experts_summary()) in line.group(1)
    assert f"whole, {per_rank} of 4 per rank (4 stacked weights)" in line.group(1)
    # routed values: a dashed badge in the dataflow, and a legend entry
    routed = sum(1 for n, v in moe_plan.values.items()
                 if "@experts" in v and moe_plan.node_layers.get(n) == 0)
    assert routed and f"{routed} values of rows routed to the experts" in page
    assert '<span class="badge lay-sharded routed">S(0)@experts</span>' in page
    assert '<span class="badge lay-tuple routed">(S(0)@experts, S(0)@experts)</span>' in page
    # the rest of the page is unchanged by the experts
    assert embedded_json(page) == to_dict(moe_plan, COST)
    assert page.count('class="param-row"') == expected_param_rows(moe_plan)
    assert page == to_html(moe_plan, COST), "not deterministic"


def test_html_experts_of_layers_that_differ(moe_plan: Plan) -> None:
    plan = split_layers(moe_plan)
    page = to_html(plan, COST)
    assert [layers for layers, _ in experts_sections(page)] == ["0", "1"]
    rows = experts_rows(page)
    assert list(rows) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for row in rows.values():
        assert f"{4 // plan.tp} of 4 per rank, whole" in row
        assert ">gate_up_proj<" in row and ">down_proj<" in row


def test_html_experts_sliced_replicated_and_mixed(moe_plan: Plan) -> None:
    """How a rank holds a block's experts, in words, for each kind ``plan.experts`` names."""
    tp = moe_plan.tp

    def held(kinds: dict[str, str]) -> str:
        params = dict(moe_plan.params)
        for name in moe_plan.experts:
            how = kinds[name.rsplit(".", 1)[1]]
            p = params[name]
            layout = {"whole": "S(0)", "sliced": "S(2)", "replicated": "R"}[how]
            local = p.global_shape if how == "replicated" else \
                p.global_shape[:2] + (p.global_shape[2] // tp,) if how == "sliced" else \
                p.local_shape
            params[name] = dataclasses.replace(p, layout=layout, local_shape=local)
        plan = moe_plan.replaced(
            params=params,
            experts={k: [4, kinds[k.rsplit(".", 1)[1]]] for k in moe_plan.experts})
        page = to_html(plan, COST)
        assert html.escape(plan.experts_summary()) in page
        (row,) = experts_rows(page).values()
        cell = re.search(r'<span class="edim">(.*?)</span>', row)
        assert cell is not None
        return cell.group(1)

    sliced = held({"gate_up_proj": "sliced", "down_proj": "sliced"})
    assert sliced == f"sliced: every rank holds a 1/{tp} slice of every expert"
    assert held({"gate_up_proj": "replicated", "down_proj": "replicated"}) == \
        "replicated: every rank holds all 4 experts"
    assert held({"gate_up_proj": "whole", "down_proj": "sliced"}) == (
        f"gate_up_proj: {4 // tp} of 4 per rank, whole; down_proj: sliced: every rank holds "
        f"a 1/{tp} slice of every expert")


def test_experts_per_rank_in_words() -> None:
    assert experts_per_rank(128, "whole", 8) == "16 of 128 per rank, whole"
    assert experts_per_rank(128, "whole", 4, ep=2) == "16 of 128 per rank, whole (tp 4 × ep 2)"
    assert experts_per_rank(128, "sliced", 8) == \
        "sliced: every rank holds a 1/8 slice of every expert"
    assert experts_per_rank(128, "replicated", 8) == "replicated: every rank holds all 128 experts"


def test_html_of_a_dense_model_has_no_experts(request: pytest.FixtureRequest) -> None:
    for model in ("llama", "gpt2"):
        plan = _plan(request, model)
        assert not plan.experts
        page = to_html(plan, COST)
        assert not experts_sections(page) and not experts_rows(page)
        for text in ("experts-summary", "mixture of experts", "MoE block", "@experts",
                     " routed"):
            assert text not in page, (model, text)


def chromium() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    browser = chromium()
    assert browser is not None
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    env = dict(os.environ, HOME=str(tmp_path))
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=90,
                          env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def page_file(llama_plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "plan.html"
    path.write_text(to_html(llama_plan, COST), encoding="utf-8")
    return path


needs_chromium = pytest.mark.skipif(chromium() is None or sys.platform == "win32",
                                    reason="chromium is not installed")


@needs_chromium
def test_browser_runs_the_page_script(llama_plan: Plan, page_file: Path,
                                      tmp_path: Path) -> None:
    done = run_chromium(["--dump-dom", page_file.as_uri()], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None
    assert 'data-ready="1"' in body.group(0), "the page's script did not run"
    assert f'data-collectives="{len(llama_plan.collectives)}"' in body.group(0)
    count = re.search(r'<span id="param-count">(\d+)</span>', dom)
    assert count is not None
    assert int(count.group(1)) == expected_param_rows(llama_plan)


@needs_chromium
def test_browser_filters_parameter_rows(llama_plan: Plan, page_file: Path,
                                        tmp_path: Path) -> None:
    """``#filter=TEXT`` fills the filter box: only the matching rows stay visible."""
    done = run_chromium(["--dump-dom", page_file.as_uri() + "#filter=MLP"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-ready="1"' in dom
    expected = sum(1 for n, p in llama_plan.params.items()
                   if p.layer in (0, None) and "mlp" in n)
    assert 0 < expected < expected_param_rows(llama_plan)
    count = re.search(r'<span id="param-count">(\d+)</span>', dom)
    assert count is not None and int(count.group(1)) == expected
    rows = re.findall(r'<tr class="param-row" data-name="([^"]*)"[^>]*?( hidden="")?>', dom)
    assert len(rows) == expected_param_rows(llama_plan)
    assert sorted(name for name, hidden in rows if not hidden) == sorted(
        n for n, p in llama_plan.params.items() if p.layer in (0, None) and "mlp" in n)


def decode_png(data: bytes) -> torch.Tensor:
    """The pixels (height, width, RGB) of an 8-bit, non-interlaced RGB or RGBA PNG, the kind
    Chromium writes: the chunks' zlib stream, unfiltered row by row (PNG spec, section 9)."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    pos, header, compressed = 8, None, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed.append(body)
        pos += 12 + length
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4  # bytes per pixel
    stride = width * bpp
    raw = zlib.decompress(b"".join(compressed))
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        # each byte adds a guess from the byte one pixel to the left (0 in the first pixel),
        # the one above (0 in the first row) or both
        if kind == 1:  # Sub: left
            for i in range(bpp, stride):
                row[i] = (row[i] + row[i - bpp]) & 0xFF
        elif kind == 2:  # Up: above
            row = bytearray((x + up) & 0xFF for x, up in zip(row, prev))
        elif kind == 3:  # Average: their mean
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + (left + prev[i]) // 2) & 0xFF
        elif kind == 4:  # Paeth: whichever of left, above, above-left is nearest to
            for i in range(bpp):  # left + above - above-left
                row[i] = (row[i] + prev[i]) & 0xFF
            for i in range(bpp, stride):
                left, up, corner = row[i - bpp], prev[i], prev[i - bpp]
                to_left, to_up = abs(up - corner), abs(left - corner)
                to_corner = abs(left + up - 2 * corner)
                if to_left <= to_up and to_left <= to_corner:
                    row[i] = (row[i] + left) & 0xFF
                elif to_up <= to_corner:
                    row[i] = (row[i] + up) & 0xFF
                else:
                    row[i] = (row[i] + corner) & 0xFF
        rows.append(bytes(row))
        prev = row
    pixels = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
    return pixels.view(height, width, bpp)[..., :3]


def colour_bands(pixels: torch.Tensor, colours: dict[str, str]) -> list[set[str]]:
    """Top to bottom, each run of pixel rows where some of ``colours`` (name -> "#rrggbb")
    is drawn: the names drawn in it. A badge's flat fill is exact; its text and rounded
    corners blend, and the rows between two table rows hold none."""
    drawn = {name: (pixels == torch.tensor(list(bytes.fromhex(hex_[1:])), dtype=torch.uint8))
             .all(-1).any(-1).tolist() for name, hex_ in colours.items()}
    bands: list[set[str]] = []
    previous: set[str] = set()
    for y in range(pixels.shape[0]):
        here = {name for name, rows in drawn.items() if rows[y]}
        if here and not previous:
            bands.append(set())
        if here:
            bands[-1] |= here
        previous = here
    return bands


@needs_chromium
def test_browser_draws_the_plans_rows_in_their_layouts_colours(
        llama_plan: Plan, page_file: Path, tmp_path: Path) -> None:
    """The screenshot, decoded: top to bottom, the layout badges of layer 0's parameter
    table (one band of colour per row, the parameters in name order) and then of its
    collectives (from and to), each in its layout's fill (sharded, replicated, partial)."""
    png = tmp_path / "plan.png"
    done = run_chromium([f"--screenshot={png}", "--window-size=1280,2000", page_file.as_uri()],
                        tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    pixels = decode_png(png.read_bytes())
    assert pixels.shape == (2000, 1280, 3)
    # the fill of "none" (no layout) is also the strategy tags' background: not a layout's
    bands = colour_bands(pixels, {k: v for k, v in FILL.items() if k != "none"})
    params = [{layout_class(p.layout)} for _, p in sorted(llama_plan.params.items())
              if p.layer == 0]
    collectives = [{layout_class(c["from"]), layout_class(c["to"])}
                   for c in to_dict(llama_plan, COST)["collectives"] if c["layer"] == 0]
    assert {"sharded"} in params and {"replicated"} in params
    assert {"partial", "replicated"} in collectives  # the o_proj's and down_proj's sums
    expected = params + collectives
    assert any(bands[i:i + len(expected)] == expected for i in range(len(bands))), \
        (expected, bands)


def test_the_python_entry_points_give_what_the_command_line_writes(llama_plan: Plan) -> None:
    """``plan.table()``, ``plan.report()`` and ``plan.to_html()`` are the CLI's table, JSON
    (schema autotp.plan/1) and page: every parameter's layout and every collective."""
    from autotp.presentation.page import to_html
    from autotp.presentation.report import to_dict, to_table
    from autotp.planner.cost import CostModel

    cost = CostModel()
    table = llama_plan.table()
    assert table == to_table(llama_plan, cost)
    for name, param in llama_plan.params.items():  # identical layers folded into one block
        short = re.sub(r"^.*\.\d+\.", "", param.names[0])
        assert re.search(rf"{re.escape(short)} +\S+ {re.escape(param.layout)} ", table), name
    report = llama_plan.report()
    assert report == to_dict(llama_plan, cost) and report["schema"] == "autotp.plan/1"
    assert len(report["collectives"]) == len(llama_plan.collectives)
    assert llama_plan.to_html() == to_html(llama_plan, cost)
