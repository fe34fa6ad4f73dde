"""What README.md and docs/*.md show runs, or at least calls what exists the way it exists.

Every ```python block carries a marker on the line before it:

- ``<!-- docs-test: run -->``: executed here, as written (CPU, one process);
- ``<!-- docs-test: check -->``: a fragment of a program that needs GPUs or a process group
  (``model``, ``ids`` are the reader's): it must compile, every ``autotp.…`` it calls must
  exist, and each call's arguments must bind to that function's signature (and those of
  the functions it imports by name: ``init_device_mesh``, ``fully_shard``, ...).

Every command line in a ```bash block that runs ``autotp`` must parse with autotp's own
parser, and every flag given to an ``examples/*.py`` script or a ``python -m benchmarks.NAME``
module must be one its parser defines.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import shlex
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

import autotp
from autotp.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- docs-test: (run|check) -->")


class Block:
    def __init__(self, page: Path, line: int, lang: str, code: str, mark: Optional[str]):
        self.page, self.line, self.lang, self.code, self.mark = page, line, lang, code, mark

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        start, lang = i, opening.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.search(before)
        yield Block(page, start + 1, lang, "\n".join(lines[start + 1:end]),
                    mark.group(1) if mark else None)
        i = end + 1


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]


def test_the_pages_have_blocks() -> None:
    assert len(PAGES) >= 10 and len(PYTHON) >= 8, [str(p) for p in PAGES]


def test_every_python_block_is_marked() -> None:
    unmarked = [b.where for b in PYTHON if b.mark is None]
    assert not unmarked, f"python blocks without a docs-test marker: {unmarked}"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.mark == "run"],
                         ids=lambda b: b.where)
def test_block_runs(block: Block) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block.code, block.where, "exec"), {"__name__": "__docs__"})


def _imported(tree: ast.AST) -> dict[str, Any]:
    """The names a fragment imports (``from m import f``; ``import m``), resolved."""
    names: dict[str, Any] = {"autotp": autotp}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    names[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module_name = alias.name if alias.asname else alias.name.split(".")[0]
                try:
                    names[alias.asname or module_name] = importlib.import_module(module_name)
                except ImportError:
                    continue
    return names


def _resolve(func: ast.expr, names: dict[str, Any]) -> Optional[tuple[str, Any]]:
    """The object a call's function names, when it is rooted at an imported name."""
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in names:
        return None
    obj = names[func.id]
    path = func.id
    for part in reversed(parts):
        path += "." + part
        if not hasattr(obj, part):
            raise AssertionError(f"{path} does not exist")
        obj = getattr(obj, part)
    return path, obj


@pytest.mark.parametrize("block", [b for b in PYTHON if b.mark == "check"],
                         ids=lambda b: b.where)
def test_fragment_calls_what_exists(block: Block) -> None:
    tree = ast.parse(block.code, block.where)
    names = _imported(tree)
    checked = 0
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        try:
            found = _resolve(call.func, names)
        except AssertionError as exc:
            raise AssertionError(f"{block.where}: {exc}") from None
        if found is None or not callable(found[1]) or inspect.ismodule(found[1]):
            continue
        path, fn = found
        if any(isinstance(a, ast.Starred) for a in call.args) or \
                any(k.arg is None for k in call.keywords):
            continue  # *args / **kwargs: nothing to bind statically
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*call.args, **{k.arg: k.value for k in call.keywords if k.arg})
        except TypeError as exc:
            raise AssertionError(f"{block.where}: {path}(...) does not bind to "
                                 f"{path}{signature}: {exc}") from None
        checked += 1
    assert checked, f"{block.where}: no call of autotp or an imported function to check"


def _command_lines(block: Block) -> Iterator[list[str]]:
    text = re.sub(r"\\\n\s*", " ", block.code)
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            yield shlex.split(line.replace("[", "").replace("]", ""))


def usage_blocks(script: Path) -> Iterator[Block]:
    """The command lines of a script's docstring (indented ``torchrun ...`` or ``python
    ...`` lines, continued by backslashes), as one shell block each: the usage a reader of
    the example copies."""
    doc = ast.get_docstring(ast.parse(script.read_text(), str(script)), clean=False) or ""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s+(torchrun|python3?) ", line) and not lines[i - 1].endswith("\\"):
            end = i
            while lines[end].endswith("\\") and end + 1 < len(lines):
                end += 1
            yield Block(script, i + 2, "bash", "\n".join(lines[i:end + 1]), None)


SCRIPTS = sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
SHELL = [b for b in ALL if b.lang == "bash"] + [b for script in SCRIPTS
                                                for b in usage_blocks(script)]
AUTOTP_LINES = [(b, argv) for b in SHELL for argv in _command_lines(b)
                if argv and argv[0] == "autotp"]
SCRIPT = re.compile(r"^(examples|benchmarks)/\w+\.py$")
MODULE = re.compile(r"^(examples|benchmarks)\.(\w+)$")  # python -m benchmarks.NAME


def script_at(argv: list[str]) -> Optional[int]:
    """Where the script of a command line is (its flags follow): ``examples/x.py`` or the
    module of ``-m benchmarks.x``; None for a line that runs neither."""
    for i, a in enumerate(argv):
        if SCRIPT.match(a) or (MODULE.match(a) and i > 0 and argv[i - 1] == "-m"):
            return i
    return None


def split_line(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """A command line of a script: what comes before it (``torchrun --nproc-per-node 8``,
    ``python -m``), the script's file relative to the repository root, its arguments."""
    at = script_at(argv)
    if at is None:
        raise ValueError(f"no example or benchmark in {argv}")
    module = MODULE.match(argv[at])
    script = f"{module.group(1)}/{module.group(2)}.py" if module else argv[at]
    return argv[:at], script, argv[at + 1:]


EXAMPLE_LINES = [(b, argv) for b in SHELL for argv in _command_lines(b)
                 if script_at(argv) is not None]


def test_the_pages_show_commands() -> None:
    assert len(AUTOTP_LINES) >= 5 and len(EXAMPLE_LINES) >= 5


@pytest.mark.parametrize(("block", "argv"), AUTOTP_LINES,
                         ids=[f"{b.where}:{' '.join(a[1:3])}" for b, a in AUTOTP_LINES])
def test_command_line_parses(block: Block, argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"{block.where}: {' '.join(argv)} does not parse") from exc


PLACEHOLDER = re.compile(r"^path/to/")  # a reader's own file: the line shows the form only


def _expected_exit(argv: list[str]) -> int:
    """0, but ``estimate --calibrate`` measures a GPU: refused (2) where this machine has
    none of the named kind."""
    if "--calibrate" in argv:
        from autotp.cli import calibration_refusal

        return 0 if calibration_refusal(argv[argv.index("--hardware") + 1]) is None else 2
    return 0


@pytest.mark.parametrize(("block", "argv"), AUTOTP_LINES,
                         ids=[f"{b.where}:{' '.join(a[1:3])}" for b, a in AUTOTP_LINES])
def test_command_line_runs(block: Block, argv: list[str], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each documented command, run as written (with its optional flags, in a fresh
    directory for its -o files): the exit code the page promises, and nothing on stderr but
    autotp's own lines (no Python warnings, no torch.export dumps)."""
    if any(PLACEHOLDER.match(a.split(":")[0]) for a in argv):
        pytest.skip(f"{block.where}: {argv[1]} of a placeholder path")
    from tests.test_cli import run_cli

    monkeypatch.chdir(tmp_path)
    result = run_cli(*argv[1:], check=False)
    expected = _expected_exit(argv)
    assert result.returncode == expected, \
        f"{block.where}: {' '.join(argv)} exited {result.returncode}:\n{result.stderr}"
    foreign = [line for line in result.stderr.splitlines()
               if line.strip() and not line.startswith(("autotp: ", "  "))]
    assert not foreign, f"{block.where}: {' '.join(argv)} printed {foreign[:5]}"
    if expected == 0 and "-o" in argv:
        target = tmp_path / argv[argv.index("-o") + 1]
        if target.suffix == ".html":
            assert "<html" in target.read_text()[:500].lower(), target.read_text()[:200]
        else:
            assert json.loads(target.read_text())
    if expected == 2:
        assert "--calibrate-anyway" in result.stderr, result.stderr


def _flags(script: str) -> set[str]:
    """The flags ``script``'s argument parser defines: the ``--`` strings of its
    ``add_argument`` calls (read from the source, without starting a process)."""
    tree = ast.parse((ROOT / script).read_text(), script)
    flags = set()
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            flags |= {a.value for a in call.args if isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.startswith("--")}
            if any(k.arg == "action" and isinstance(k.value, ast.Attribute)
                   and k.value.attr == "BooleanOptionalAction" for k in call.keywords):
                flags |= {"--no-" + f[2:] for f in flags}
    return flags | {"--help"}


def test_benchmarks_are_shown_as_modules() -> None:
    """A benchmark imports its neighbours as ``benchmarks.…`` and ``tests.…``: it runs from the
    repository root as ``python -m benchmarks.NAME``; as a file it could not import them."""
    as_files = [f"{b.where}: {' '.join(argv)}" for b, argv in EXAMPLE_LINES
                if any(SCRIPT.match(a) and a.startswith("benchmarks/") for a in argv)]
    missing = [f"{b.where}: {split_line(argv)[1]}" for b, argv in EXAMPLE_LINES
               if not (ROOT / split_line(argv)[1]).exists()]
    assert not as_files and not missing, (as_files, missing)


def test_example_flags_exist() -> None:
    wrong = []
    for block, argv in EXAMPLE_LINES:
        _, script, args = split_line(argv)
        flags = [a.split("=")[0] for a in args if a.startswith("--")]
        listed = _flags(script)
        wrong += [f"{block.where}: {script} {flag}" for flag in flags if flag not in listed]
    assert not wrong, f"flags the examples do not take: {wrong}"


def test_the_json_schema_lists_every_key_the_plan_writes() -> None:
    """docs/command-line.md's schema against a plan autotp wrote (the golden GPT-2 plan):
    every key at every level is documented."""

    page = (ROOT / "docs" / "command-line.md").read_text()
    schema = next(b.code for b in blocks(ROOT / "docs" / "command-line.md")
                  if '"schema": "autotp.plan/1"' in b.code)
    plan = json.loads((ROOT / "tests" / "golden" / "gpt2_tp2.json").read_text())
    keys = set(plan) | set(plan["summary"]) | set(next(iter(plan["params"].values()))) | \
        set(plan["collectives"][0])
    missing = sorted(k for k in keys if f'"{k}"' not in schema)
    assert not missing and "why_replicated" in schema and '"experts"' in schema, \
        (missing, page.count("schema"))


def test_usage_shows_parallelize_with_every_parameter() -> None:
    """docs/usage.md's signature line of ``parallelize`` names every parameter it has."""
    page = (ROOT / "docs" / "usage.md").read_text()
    shown = page[page.index("`autotp.parallelize("):]
    shown = shown[:shown.index(")` returns")]
    missing = [name for name in inspect.signature(autotp.parallelize).parameters
               if name not in shown]
    assert not missing, f"docs/usage.md's parallelize signature lacks {missing}"


def _defaults(script: str) -> dict[str, Any]:
    """``--flag`` -> its default, for the int flags ``script``'s parser defines."""
    tree = ast.parse((ROOT / script).read_text(), script)
    found: dict[str, Any] = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument" and \
                call.args and isinstance(call.args[0], ast.Constant):
            default = next((k.value for k in call.keywords if k.arg == "default"), None)
            if isinstance(default, ast.Constant):
                found[call.args[0].value] = default.value
    return found


def _heads_in_code(script: str) -> Optional[int]:
    """The head count an example's model is built with where no flag sets it."""
    sizes = set(re.findall(r"(?:num_attention_heads|n_head)=(\d+)", (ROOT / script).read_text()))
    return int(sizes.pop()) if len(sizes) == 1 else None


def test_documented_launches_divide_the_model() -> None:
    """Each documented ``torchrun`` of an example: the processes make the mesh its flags ask
    for (dp x pp x tp = nodes x processes per node), and the tensor-parallel degree divides
    the model's heads, and the heads its width (a tp that does not is refused at run time:
    the docs must not show one)."""
    wrong = []
    for block, argv in EXAMPLE_LINES:
        if argv[0] != "torchrun":
            continue
        before, script, args = split_line(argv)
        launcher = dict(zip(before, before[1:]))
        world = int(launcher.get("--nproc-per-node", 1)) * int(launcher.get("--nnodes", 1))
        given = dict(zip(args, args[1:]))
        values = {**_defaults(script), **{k: v for k, v in given.items() if k.startswith("--")}}
        dp, pp = int(values.get("--dp", 1)), int(values.get("--pp", 1))
        tp = int(values["--tp"]) if "--tp" in values else world // (dp * pp)
        if dp * pp * tp != world:
            wrong.append(f"{block.where}: {world} processes for dp {dp} x pp {pp} x tp {tp}")
        heads = values.get("--n-head", values.get("--heads")) or _heads_in_code(script)
        width = values.get("--n-embd", values.get("--hidden"))
        if heads is not None and int(heads) % tp:
            wrong.append(f"{block.where}: tp {tp} does not divide {heads} heads")
        if heads is not None and width is not None and int(width) % int(heads):
            wrong.append(f"{block.where}: {heads} heads do not divide width {width}")
    assert not wrong, wrong


def test_every_environment_variable_autotp_reads_is_documented() -> None:
    read = set()
    for folder in ("autotp", "planner", "rules"):
        for path in (ROOT / folder).rglob("*.py"):
            read |= set(re.findall(r"environ(?:\.get\(|\[)\"(AUTOTP_[A-Z_]+)", path.read_text()))
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    documented = set(re.findall(r"`(AUTOTP_[A-Z_]+)", page))
    assert read and read == documented, (read, documented)
