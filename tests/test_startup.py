"""A fast start: ``import autotp`` and ``autotp --help`` load neither transformers nor the
planner, the capture or the runtime (each is imported where it is first used). Checked on
``sys.modules`` in a fresh interpreter, not timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("transformers", "autotp.planner.solve", "autotp.planner.problem",
         "autotp.capture.trace", "autotp.runtime", "autotp.api", "autotp.integrations",
         "autotp.presentation", "autotp.verification",
         "torch._dynamo")


def _loaded_after(code: str) -> list[str]:
    script = (f"import sys\n{code}\nimport json\n"
              "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_import_autotp_loads_nothing_heavy() -> None:
    loaded = _loaded_after("import autotp")
    assert "autotp" in loaded and not _heavy(loaded), _heavy(loaded)


def test_help_loads_nothing_heavy() -> None:
    loaded = _loaded_after("from autotp.cli import main\n"
                           "try:\n    main(['estimate', '--help'])\n"
                           "except SystemExit:\n    pass\n"
                           "try:\n    main(['--help'])\n"
                           "except SystemExit:\n    pass")
    assert "autotp.cli" in loaded and not _heavy(loaded), _heavy(loaded)


def test_the_api_names_load_on_first_use() -> None:
    loaded = _loaded_after("import autotp\nassert autotp.Shard(0).dim == 0\n"
                           "assert callable(autotp.plan)\n"
                           "assert autotp.api.default_device is not None")
    assert "autotp.api" in loaded and "autotp.layout" in loaded


def test_every_public_name_resolves() -> None:
    import autotp

    missing = [name for name in autotp.__all__ if getattr(autotp, name, None) is None]
    assert not missing, missing
    assert set(autotp.__all__) <= set(dir(autotp))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        autotp.not_a_name  # noqa: B018
