"""The coverage record is what the families do: they run at tp = 2 here.

benchmarks/family_coverage.json is written by ``python -m benchmarks.family_coverage --record``
(docs/coverage.md's coverage table is its rendering, ``--write-docs``). This test reruns
families at tp = 2 and checks each against its recorded row: the same plan and program
(``family_coverage.planned``: the status, a refusal's reason, the collectives and bytes of every
layer, what is left replicated, the experts), and, where the record says exact, exact still
(within 1e-4 abs on outputs and loss and 1e-4 relative on gradients).

Every family runs but those in ``LIKE`` and ``IN_FAMILY_TESTS`` (run by
tests/test_families.py): near copies of a family that does run (the same
kind of layer: attention, MLP, norms, experts), skipped by default to keep the suite short (a family
costs 1 to 6 s, mostly torch.export). ``AUTOTP_COVERAGE_ALL=1`` runs them too, and
``python -m benchmarks.family_coverage`` runs every family at tp 2 and 4. A new family runs by
default unless it is added to ``LIKE``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import autotp
from benchmarks import family_coverage as cov

RECORD = cov.read_record()
RECORDED = {row["family"]: row for row in RECORD["rows"] if row["tp"] == 2}
RERECORD = "re-record: python -m benchmarks.family_coverage --record --write-docs"
ALL = os.environ.get("AUTOTP_COVERAGE_ALL", "") not in ("", "0")

# skipped family -> the family it is a near copy of (which runs)
LIKE = {
    "Mistral": "LLaMA (GQA)",
    "Qwen2": "LLaMA (GQA)",
    "Gemma": "LLaMA (GQA)",
    "Starcoder2": "LLaMA (GQA)",
    "Granite": "LLaMA (GQA)",
    "StableLM": "LLaMA (GQA)",
    "Qwen3": "Gemma3",  # per-head q/k norms
    "Cohere": "Phi",  # attention and MLP in parallel off one norm
    "GPT-J": "Phi",
    "RoBERTa": "BERT",
    "Qwen3-MoE": "Mixtral (MoE)",
    "OLMoE": "Mixtral (MoE)",
}


# Families that tests/test_families.py runs at tp = 2 with stronger checks (exactness,
# collectives and bytes per layer, what is sharded): not run twice by default.
IN_FAMILY_TESTS = {"Mixtral (MoE)", "Qwen2-MoE (shared expert)", "DeepSeek-V3 (MLA, MoE)",
                   "Gemma3", "Phi-3 (GQA, fused qkv)", "Falcon", "Falcon (grouped k/v)", "OLMo2",
                   "GPTBigCode (multi-query)"}


def _family(name: str) -> object:
    if name in LIKE and not ALL:
        return pytest.param(name, marks=pytest.mark.skip(
            reason=f"like {LIKE[name]}; AUTOTP_COVERAGE_ALL=1 runs it"))
    if name in IN_FAMILY_TESTS and not ALL:
        return pytest.param(name, marks=pytest.mark.skip(
            reason="checked in tests/test_families.py; AUTOTP_COVERAGE_ALL=1 runs it here"))
    return name


def test_the_record_lists_every_family() -> None:
    """Every family at every tp of the record, in FAMILIES order; its rendering (the
    docs/coverage.md's table) has a row for each."""
    assert [(r["family"], r["tp"]) for r in RECORD["rows"]] == \
        [(name, tp) for name in cov.FAMILIES for tp in RECORD["tps"]], RERECORD
    assert 2 in RECORD["tps"]
    assert all(name in cov.FAMILIES and like in cov.FAMILIES and like not in LIKE
               for name, like in LIKE.items()), LIKE
    lines = cov.render(RECORD).splitlines()
    assert len(lines) == 2 + len(cov.FAMILIES)
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| {f}" for f in cov.FAMILIES]


@pytest.mark.parametrize("family", [_family(name) for name in cov.FAMILIES])
def test_family_matches_its_recorded_row(family: str) -> None:
    assert family in RECORDED, RERECORD
    recorded = RECORDED[family]
    row = cov.check(family, 2)
    got, want = cov.planned(row), cov.planned(recorded)
    changed = {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys()
               if got.get(k) != want.get(k)}
    assert not changed, f"{family} at tp 2, (now, recorded): {changed}; {RERECORD}"
    status = cov.status_word(row["status"])
    if status.startswith("exact"):
        assert row["output_diff"] <= cov.ATOL and row["grad_rel"] <= cov.ATOL, row
    if status == "exact,":  # matrices left replicated are listed in the plan
        assert row["fallbacks"] > 0, row
    if status == "refused":  # with the reason, as the docs' row shows it
        assert row["detail"], row


def test_cross_entropy_with_label_smoothing_gathers_the_logits() -> None:
    """The fused op stays (it has no vocabulary-parallel form): computed on whole logits,
    whose collective the plan shows, and exact."""

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.up = torch.nn.Linear(32, 128)
            self.out = torch.nn.Linear(128, 64)

        def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = self.out(torch.relu(self.up(self.embed(ids))))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                   label_smoothing=0.1)

    torch.manual_seed(0)
    model = Head()
    ids = torch.randint(0, 64, (2, 8))
    targets = torch.randint(0, 64, (2, 8))
    sim = autotp.simulate(model, 2, example_args=(ids, targets))
    expected = model(ids, targets)
    expected.backward()
    losses = sim.run(lambda m: float(m(ids, targets)))
    assert max(abs(x - float(expected)) for x in losses) <= 1e-5
    # the whole logits (B x T x 64 fp32 = 256 bytes a token) cross the ranks before the op
    assert any(c.phase == "forward" and c.bytes_expr == "256*B*T"
               for c in sim.plan.collectives), sim.plan.collectives
    assert any("cross_entropy" in op for op in sim.plan.ops.values()), "the fused op stays"
