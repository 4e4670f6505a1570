"""The engine benchmark script keeps running standalone (`--tiny` on CPU) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_engine_tree_tiny(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/engine_tree.py"), "--tiny", "--budgets", "16,256"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine overhead at budget 256" in proc.stdout
    report = json.loads((tmp_path / "engine_tree.json").read_text())
    rows = {(r["method"], r["budget"]): r for r in report["rows"]}
    assert set(rows) == {("dflash", 15), ("ddtree", 16), ("ddtree", 256)}
    for r in rows.values():
        assert r["verify"] > 0 and r["round"] >= r["verify"] and 0 <= r["overhead_pct"] < 100
