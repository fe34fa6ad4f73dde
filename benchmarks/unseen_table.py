"""The unseen-code sweep before and after, as one markdown table (docs/coverage.md's).

    python -m benchmarks.unseen_table benchmarks/unseen_baseline.json benchmarks/unseen_after.json

Per model and tp: the result (exact / crash / refused), whether every block is within
Megatron's count and bytes with no large matrix replicated (``at bound``, as
benchmarks/unseen.py decides it), the large replicated matrices at h = 64 and in the wide plan
(h = 1024 on meta, tp 8); then the totals of each run.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.harness import read_json


def _rows(path: str) -> tuple[dict[tuple[str, int], dict], dict[str, dict], dict]:
    data = read_json(path)
    rows = {(r["model"], int(r["tp"])): r for r in data["rows"]}
    wide = {w["model"]: w for w in data["wide"]}
    return rows, wide, data


def _result(row: dict[str, Any]) -> str:
    status = row.get("status", "?")
    return "exact" if status == "exact" else status


def _large(row: dict[str, Any]) -> str:
    large = row.get("large_replicated")
    return "-" if large is None else str(len(large))


def _wide(wide: dict[str, Any]) -> str:
    if wide.get("plan_error"):
        return "refused" if (wide.get("plan_error") or {}).get("refused") else "error"
    return str(wide.get("large_replicated", "-"))


def _verdict(row: dict[str, Any]) -> str:
    return "yes" if str(row.get("at_bound")) == "True" else "no"


def table(before_path: str, after_path: str) -> str:
    before, wide_before, data_before = _rows(before_path)
    after, wide_after, data_after = _rows(after_path)
    lines = ["| model | codebase | tp | before: result, at bound, large repl. (wide) | "
             "after: result, at bound, large repl. (wide) | collectives per block after |",
             "|---|---|---|---|---|---|"]
    for key in sorted(after, key=lambda k: (list(after).index(k))):
        b, a = before.get(key, {}), after[key]
        model, tp = key
        lines.append(
            f"| {model} | {a.get('codebase', '')} {a.get('version', '')} | {tp} | "
            f"{_result(b)}, {_verdict(b)}, {_large(b)} ({_wide(wide_before.get(model, {}))}) | "
            f"{_result(a)}, {_verdict(a)}, {_large(a)} ({_wide(wide_after.get(model, {}))}) | "
            f"{a.get('collectives', '')} |")
    for name, data in (("before", data_before), ("after", data_after)):
        s = data["summary"]
        lines.append(f"\n{name}: {s['rows']} rows; exact {s['exact_pct']} %, at bound "
                     f"{s['at_bound_pct']} %, {len(s['crashes'])} crashes, "
                     f"{len(s['refusals'])} refusals, {len(s['mismatch'])} mismatches")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2]))
