"""The report's T > 0 sections: the lossless check evaluate ran (evaluate/sampling_check.py, pooled per
branch, temperature and method) and the temperatures to show beside T = 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def sampled_temperatures(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """The temperatures above 0 of the standalone engine's rows."""
    return sorted({float(r.get("temperature") or 0.0) for r in rows if r.get("engine") == "draftforge"} - {0.0})


def _p(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.3g}"


def sampling_check_lines(checks: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per (branch, temperature, method): tokens, χ² p-value, TV to uniform, the TV the test detects
    at its stated power, and the verdict (FAILED in capitals: the method's T > 0 tokens are not the target's)."""
    lines = []
    for branch, rows in sorted(checks.items()):
        for c in rows:
            verdict = {True: "passed", False: "**FAILED**", None: "too few tokens to test"}[c.get("passed")]
            lines.append(
                f"- {branch} · T = {float(c['temperature']):g} · `{c['method']}`: {c['n']} tokens of {c['responses']} "
                f"responses ({c['accepted_drafts']} from accepted drafts); χ² p = {_p(c.get('p_value'))}, TV to uniform "
                f"{_p(c.get('tv'))}; a TV ≥ {_p(c.get('detectable_tv'))} is detected with probability {c['power']} at "
                f"α = {c['alpha']:g}: {verdict}")
    return lines
