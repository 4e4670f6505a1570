"""The report's headline: per method and evaluation set, the speedup a user gets without looking at the
evaluation data (torch-free).

A tree method's cell is its row at the auto budget (chosen on calibration prompts, evaluate/budget.py),
with the oracle budget (highest tokens/s on the evaluation prompts) beside it; a chain method has one row.
Each cell also splits the speedup into its two factors, τ and the round cost in AR steps
(speedup = τ ÷ round cost, since TPOT(method) = round ÷ τ and an AR round commits one token), so a
drafter's share (τ) and the engine's share (round cost) are read apart (docs/architecture.md).
"""

from __future__ import annotations

import math
from typing import Any

from draftforge.drafter.registry import tree_methods
from draftforge.report.rows import to_float


def round_cost_steps(row: dict[str, Any]) -> float:
    """A round's cost in AR steps: τ ÷ speedup (nan when either is missing)."""
    tau, speedup = to_float(row.get("tau")), to_float(row.get("speedup_vs_ar"))
    return tau / speedup if speedup > 0 else math.nan


def headline_cells(rows: list[dict[str, Any]], choices: list[dict[str, Any]], temperature: float = 0.0) -> dict[tuple, dict[str, dict[str, Any]]]:
    """{(engine, drafter, method): {dataset: {"row", "oracle", "note"}}} for every drafted method at
    `temperature`: a chain method's row; a tree method's auto-budget row (None when there is none, with
    the reason in "note") and its oracle-best row."""
    trees = set(tree_methods())
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["method"] == "ar" or r.get("status", "ok") != "ok" or to_float(r.get("temperature")) != temperature:
            continue
        if r["method"] in trees and r["engine"] == "draftforge":
            continue  # from the budget choices below
        cells.setdefault((r["engine"], r.get("drafter"), r["method"]), {})[str(r.get("dataset"))] = {"row": r, "oracle": None}
    for c in choices:
        if c["temperature"] != temperature:
            continue
        cells.setdefault(("draftforge", c["drafter"], c["method"]), {})[c["dataset"]] = {
            "row": c["auto"], "oracle": c["best"], "note": c.get("note")}
    return cells


def _cell_text(cell: dict[str, Any]) -> str:
    row, oracle = cell["row"], cell.get("oracle")
    if row is None:
        text = "no auto budget"
    else:
        at = f" @{row['budget']}" if row.get("budget") is not None else ""
        text = (f"**{to_float(row.get('speedup_vs_ar')):.2f}×**{at} (τ {to_float(row.get('tau')):.2f} ÷ round "
                f"{round_cost_steps(row):.2f} AR)")
    if oracle is not None and (row is None or oracle.get("budget") != row.get("budget")):
        text += f"; oracle {to_float(oracle.get('speedup_vs_ar')):.2f}× @{oracle.get('budget')}"
    return text


def headline_lines(rows: list[dict[str, Any]], choices: list[dict[str, Any]], temperature: float = 0.0) -> list[str]:
    """The headline table at `temperature`: one line per engine × drafter branch × method, one column per set."""
    cells = headline_cells(rows, choices, temperature)
    datasets = sorted({d for per in cells.values() for d in per})
    if not cells:
        return [f"- (no drafted method measured at T = {temperature:g})"]
    head = ["engine", "drafter / method"] + datasets
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (engine, drafter, method), per in sorted(cells.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        label = f"{drafter} / `{method}`" if drafter else f"`{method}`"
        lines.append("| " + " | ".join([engine, label] + [_cell_text(per[d]) if d in per else "" for d in datasets]) + " |")
    return lines
