"""The types are checked in the test command: ``py.typed`` ships, so mypy (configured in pyproject.toml's
``[tool.mypy]``) must pass on the whole package, and ``./dev test`` (and so CI) runs it here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


def test_the_package_type_checks() -> None:
    proc = _mypy()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


def test_the_configuration_catches_an_unguarded_optional(tmp_path: Path) -> None:
    """The check can fail: the configuration's strictness finds the kind of mistake it is there for."""
    code = tmp_path / "unguarded.py"
    code.write_text("from typing import Optional\n\n\n"
                    "def f(shell: Optional[dict[str, int]]) -> int:\n"
                    "    return shell['x']\n")
    proc = _mypy(str(code))
    assert proc.returncode == 1 and "[index]" in proc.stdout, proc.stdout + proc.stderr
