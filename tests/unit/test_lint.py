"""The code passes `ruff check` (configuration in pyproject.toml; scripts/test.sh runs it too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff not installed (pip install -e '.[test]')")
def test_ruff_check_passes() -> None:
    result = subprocess.run([RUFF, "check", "src", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
