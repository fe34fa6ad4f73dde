"""The rewriter's docstring lists its passes in the order ``rewrite`` runs them: read from the
source (``ast``), so a pass added, removed or moved without the list fails here."""

from __future__ import annotations

import ast
import inspect
import re

from autotp.runtime import rewrite as rewriter


def _called_passes() -> list[str]:
    """The passes ``rewrite`` calls, first call of each, in source order: the functions it
    hands the program's graph to."""
    tree = ast.parse(inspect.getsource(rewriter.rewrite))
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name)
                    and any(isinstance(a, ast.Name) and a.id == "graph" for a in n.args)),
                   key=lambda n: (n.lineno, n.col_offset))
    seen: list[str] = []
    for call in calls:
        name = call.func.id  # type: ignore[attr-defined]
        if name not in seen:
            seen.append(name)
    return seen


def _listed_passes() -> list[str]:
    doc = rewriter.__doc__ or ""
    return re.findall(r"^    ([a-z_]+)\s{2,}", doc, flags=re.MULTILINE)


def test_the_docstring_lists_every_pass_in_order() -> None:
    called = _called_passes()
    assert len(called) >= 15, called  # the reading of the source found the passes
    assert _listed_passes() == called
