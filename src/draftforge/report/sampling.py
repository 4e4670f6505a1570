"""The report's T > 0 sections: the lossless check evaluate ran (evaluate/sampling_check.py, pooled per
branch, temperature and method) and the temperatures to show beside T = 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from draftforge.evaluate.sampling_check import check_line


def sampled_temperatures(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """The temperatures above 0 of the standalone engine's rows."""
    return sorted({float(r.get("temperature") or 0.0) for r in rows if r.get("engine") == "draftforge"} - {0.0})


def sampling_check_lines(checks: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per (branch, temperature, method) (evaluate/sampling_check.check_line)."""
    return [f"- {branch} · {check_line(c)}" for branch, rows in sorted(checks.items()) for c in rows]
