"""Repeated layers traced in part (``autotp.capture.repeat``): a model whose list of layers
is traced a few entries deep and stamped to its full depth gets the program and the plan a
full trace gives; layers that only look alike are traced on their own.

Programs are compared node by node (op, arguments, module path, source line, shape), with
get_attr nodes by parameter name and the rest by position; plans are compared as JSON with
each node name of the stamped program translated to the name of the node at its position
in the full one (export numbers its symbolic-size nodes by how many it made, so a few names
differ).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autotp
from autotp.capture.trace import capture
from autotp.planner.solve import PlanOptions, plan_graph
from autotp.verification.verify import assert_equivalent
from benchmarks import family_coverage as cov
from tests.test_coverage import ALL

ATOL = 1e-4
# Families where no list can be traced in part at 6 layers, and why
WHOLE = {
    "Gemma3": "five sliding layers to one global: the global one's pair occurs once",
}


def _canonical(gm: fx.GraphModule) -> tuple[list[Any], list[str], dict[str, Any]]:
    ids: dict[fx.Node, Any] = {}
    calls = 0
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            ids[node] = ("attr", node.target)
        else:
            ids[node], calls = ("node", calls), calls + 1

    def key(arg: Any) -> Any:
        if isinstance(arg, fx.Node):
            return ids[arg]
        if isinstance(arg, (list, tuple)):
            return tuple(key(a) for a in arg)
        if isinstance(arg, dict):
            return tuple((k, key(v)) for k, v in arg.items())
        return repr(arg)

    rows = [(n.op, str(n.target), key(n.args), key(n.kwargs),
             str(n.meta.get("nn_module_stack")), _stack_trace(n),
             str(getattr(n.meta.get("val"), "shape", None)))
            for n in gm.graph.nodes if n.op != "get_attr"]
    attrs = sorted(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    return rows, attrs, {n.name: ids[n] for n in gm.graph.nodes}


_GENERATED = re.compile(r"<eval_with_key>\.\d+")


def _stack_trace(node: fx.Node) -> Any:
    """The node's stack trace; a frame of code that torch.fx generated (transformers 5.20's
    experts) is numbered by how many modules it generated before: not compared."""
    trace = node.meta.get("stack_trace")
    return _GENERATED.sub("<eval_with_key>", trace) if trace else trace


def _translated(plan_json: str, names: dict[str, str]) -> Any:
    """Node names translated; an op's name (``getitem``) may also be a node's: kept."""
    def walk(value: Any, field: str = "") -> Any:
        if isinstance(value, dict):
            return {names.get(k, k): (v if field == "ops" else walk(v, k))
                    for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and field != "op":
            return _GENERATED.sub("<eval_with_key>", names.get(value, value))
        return value

    return walk(json.loads(plan_json))


def assert_same_capture(model: nn.Module, kwargs: dict[str, Any], tp: int = 2,
                        strict: bool = True) -> dict[str, tuple[int, int]]:
    """The stamped capture is the full one, and so are its plan's layouts and collectives;
    returns what was traced in part."""
    once = capture(model, example_kwargs=kwargs)
    full = capture(model, example_kwargs=kwargs, layers_once=False)
    rows_once, attrs_once, ids_once = _canonical(once.gm)
    rows_full, attrs_full, ids_full = _canonical(full.gm)
    assert attrs_once == attrs_full
    assert len(rows_once) == len(rows_full)
    for a, b in zip(rows_once, rows_full):
        assert a == b
    by_id = {v: k for k, v in ids_full.items()}
    names = {name: by_id[i] for name, i in ids_once.items()}
    options = PlanOptions(strict=strict)
    plan_once = plan_graph(once, tp, options=options).to_json()
    plan_full = plan_graph(full, tp, options=options).to_json()
    once_json, full_json = _translated(plan_once, names), _translated(plan_full, {})
    # each axis's cost is a float sum whose order follows set iteration
    pairs = list(zip(once_json["axes"].values(), full_json["axes"].values()))
    for once_axis, full_axis in pairs:
        assert once_axis.pop("cost") == pytest.approx(full_axis.pop("cost"), rel=1e-9)
    for once_part, full_part in [(once_json, full_json), *pairs]:
        for key in full_part:
            if isinstance(full_part[key], list) and once_part[key] != full_part[key]:
                diff = [(a, b) for a, b in zip(once_part[key], full_part[key]) if a != b]
                assert not diff, (key, diff[:2])
    assert once_json == full_json
    return once.traced_layers


def _deeper(model: nn.Module, layers: int) -> nn.Module:
    """The same family with ``layers`` layers (every list of them), built on meta."""
    fields = model.config.to_dict()
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers",
                "num_decoder_layers"):
        if key in fields:
            fields[key] = layers
    fields.pop("layer_types", None)
    config = type(model.config).from_dict(fields)
    with autotp.empty_weights():
        return type(model)(config)


# By default, one family of each way a list of layers is built and read: plain decoder
# layers, layers whose first one holds the model's sizes (Bloom), per-layer constants
# (Falcon), experts, dense layers then experts (DeepSeek), two lists (T5). Every family of
# the coverage table with AUTOTP_COVERAGE_ALL=1 (about 5 minutes).
DEFAULT = {"LLaMA (GQA)", "Bloom", "Falcon", "Mixtral (MoE)", "DeepSeek-V3 (MLA, MoE)",
           "T5 (encoder-decoder)"}
FAMILIES = [name for name in cov.FAMILIES if ALL or name in DEFAULT]


@pytest.mark.parametrize("name", FAMILIES)
def test_coverage_families_traced_once_plan_as_traced_in_full(name: str) -> None:
    family = cov.FAMILIES[name]
    with autotp.empty_weights():
        small = family.build()
    model = _deeper(small, 6)
    traced = assert_same_capture(model, family.inputs(), strict=False)
    if name in WHOLE:
        assert not traced, WHOLE[name]
    else:
        assert traced and all(n < 6 for n, total in traced.values()), traced


def _llama(layers: int, **extra: Any) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=layers, vocab_size=128, **extra)
    return transformers.LlamaForCausalLM(config)


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 12)) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def test_a_stamped_model_trains_exactly_at_tp_2() -> None:
    """Three of eight layers traced; logits, loss, every gradient and one SGD step of the
    sharded model against the unsharded one (a batch and length other than the traced
    example's)."""
    model = _llama(8)
    sim = autotp.simulate(model, 2, example_kwargs={"input_ids": _ids()})
    assert sim.captured.traced_layers == {"model.layers": (3, 8)}
    ids = _ids(1, (3, 9))

    def loss(out: Any) -> torch.Tensor:
        logits = out.logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    assert_equivalent(model, sim, kwargs={"input_ids": ids}, loss_fn=loss, atol=ATOL,
                      grad_rtol=ATOL)


# ---- layers that look alike but are not ----------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.gelu = False  # a flag read in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = torch.nn.functional.gelu(h) if self.gelu else torch.relu(h)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, layers: int = 8, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _traced_and_exact(model: nn.Module) -> dict[str, tuple[int, int]]:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    traced = assert_same_capture(model, {"x": x})
    captured = capture(model, example_kwargs={"x": x})
    torch.testing.assert_close(captured.gm(x=x), model(x), rtol=0, atol=0)
    return traced


def test_identical_blocks_are_stamped() -> None:
    assert _traced_and_exact(Stack()) == {"blocks": (3, 8)}


def test_a_flag_read_in_forward_sets_a_layer_apart() -> None:
    model = Stack()
    model.blocks[6].gelu = True
    assert _traced_and_exact(model) == {}  # its pair occurs once: traced in full


def test_a_hook_on_one_layer_sets_it_apart() -> None:
    model = Stack()
    model.blocks[5].register_forward_hook(lambda module, args, out: out * 2)
    # traced itself among the first seven; the eighth is stamped from an unhooked block
    assert _traced_and_exact(model) == {"blocks": (7, 8)}


def test_a_forward_set_on_one_layer_sets_it_apart() -> None:
    model = Stack()
    block = model.blocks[7]
    block.forward = lambda x: x - block.down(block.up(x))  # type: ignore[method-assign]
    assert _traced_and_exact(model) == {}


def test_a_layer_of_another_class_sets_it_apart() -> None:
    class Other(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.down(torch.relu(self.up(x)))

    model = Stack()
    model.blocks[6] = Other(16)
    assert _traced_and_exact(model) == {}


def test_a_forward_reading_the_layer_index_is_traced_in_full() -> None:
    """GPT-2 scaling attention by 1 / (layer index + 1): the traced layers differ in a
    constant, so no layer is stamped from another."""
    import transformers

    config = transformers.GPT2Config(n_layer=6, n_embd=32, n_head=4, vocab_size=64,
                                     n_positions=32, scale_attn_by_inverse_layer_idx=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    captured = capture(model, example_kwargs={"input_ids": ids})
    assert captured.traced_layers == {}
    torch.testing.assert_close(captured.gm(input_ids=ids, use_cache=False).logits,
                               model(input_ids=ids, use_cache=False).logits,
                               rtol=0, atol=0)


def test_alternating_layers_are_stamped_by_kind() -> None:
    """Two kinds of block alternating (sliding and global attention, dense and MoE): each
    (previous kind, kind) pair is traced twice, the rest stamped."""
    model = Stack(layers=10)
    for index in range(1, 10, 2):
        model.blocks[index].gelu = True
    assert _traced_and_exact(model) == {"blocks": (6, 10)}


def test_every_layer_is_traced_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTP_TRACE_EVERY_LAYER", "1")
    x = torch.randn(2, 5, 16)
    assert capture(Stack(), example_kwargs={"x": x}).traced_layers == {}


class DepthScaled(Stack):
    """Scales each residual branch by the depth it reads off the list (DeepNet-style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (block(x) - x) / len(self.blocks)
        return self.head(x)


def test_a_forward_reading_the_list_length_is_traced_in_full() -> None:
    assert _traced_and_exact(DepthScaled()) == {}
