"""Plans kept across processes: a restarted job, or every rank of one, plans a model once.

A plan is a function of the captured program (ops, arguments, shapes, dtypes, which
parameters train, module paths and source lines, which the plan quotes), of tp, the options
and the cost model, and of autotp's own code. The cache key is a hash of all of these, so a
change to any of them (an edited model file, a new autotp) misses: nothing is invalidated by
hand, and a stale plan cannot be read. Only plans made with the default rules are kept (a
test's or a user's registry is code the key cannot see).

Where: ``$AUTOTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/autotp/plans``, else
``~/.cache/autotp/plans``. ``AUTOTP_CACHE=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from autotp.capture.trace import Captured
from autotp.ops import path_attr
from autotp.planner.plan import Plan


# code torch.fx generated is numbered by how many modules the process generated before
_GENERATED = re.compile(r"(?<=<eval_with_key>)\.\d+")


def enabled() -> bool:
    return os.environ.get("AUTOTP_CACHE", "1") not in ("0", "", "off", "false")


def directory() -> Path:
    if os.environ.get("AUTOTP_CACHE_DIR"):
        return Path(os.environ["AUTOTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "autotp" / "plans"


def cached(captured: Captured, key_parts: tuple[Any, ...],
           make: Callable[[], Plan]) -> Plan:
    """The plan of ``captured`` for ``key_parts`` (tp, options, cost model, model name):
    read from the cache, or made by ``make`` and written there."""
    if not enabled():
        return make()
    key = plan_key(captured, key_parts)
    path = directory() / f"{key}.json"
    try:
        return Plan.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, or unreadable (a write cut short): planned again and rewritten
    plan = make()
    _write(path, plan.to_json())
    return plan


def _write(path: Path, text: str) -> None:
    """Atomically (ranks of one job write the same plan at once); a read-only or full disk
    only costs the next process a plan."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except OSError:
        pass


def plan_key(captured: Captured, key_parts: tuple[Any, ...]) -> str:
    digest = hashlib.sha256()
    digest.update(_code_digest().encode())
    digest.update(torch.__version__.encode())
    digest.update(repr(key_parts).encode())
    digest.update(repr(sorted((str(k), v) for k, v in captured.dim_names.items())).encode())
    digest.update(repr(sorted(captured.aliases.items())).encode())
    for line in _program_lines(captured.gm):
        digest.update(line.encode())
    return digest.hexdigest()[:32]


def _program_lines(gm: fx.GraphModule) -> Any:
    """Everything of the program that a plan depends on or quotes, one line per node."""
    for node in gm.graph.nodes:
        tensor: Optional[torch.Tensor] = None
        if node.op == "get_attr":
            tensor = _attr(gm, str(node.target))
        yield repr((node.name, node.op, str(node.target), str(node.args), str(node.kwargs),
                    _meta(node.meta.get("val")), _meta(tensor),
                    None if tensor is None else tensor.requires_grad,
                    str(node.meta.get("nn_module_stack")),
                    _GENERATED.sub("", node.meta.get("stack_trace") or "")))


def _attr(gm: fx.GraphModule, target: str) -> Optional[torch.Tensor]:
    value = path_attr(gm, target, None)
    return value if isinstance(value, torch.Tensor) else None


def _meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (str(tuple(val.shape)), str(val.dtype), val.requires_grad)
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) for v in val)
    return repr(val) if isinstance(val, (int, float, bool, torch.SymInt)) else None


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """autotp's own source: a change to any rule, pass or planner file is a new key."""
    import autotp  # layer: the top package imports this module
    from autotp import planner, rules  # layer: from the top package, as above

    digest = hashlib.sha256()
    for package in (autotp, planner, rules):
        assert package.__file__ is not None, "a regular package, not a namespace one"
        root = Path(package.__file__).parent
        for file in sorted(root.rglob("*.py")):
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
