"""τ and speedup by prompt category (torch-free): where a drafter pays and where it does not.

Evaluate rows carry `by_category` (evaluate/aggregate.py: each category's τ, rounds, prompts and speedup over
that category's responses only). The report shows, for the headline's cells (a chain method's row, a tree
method's row at the auto budget; report/headline.py), one column per (set, category) at T = 0 with its mean
prompt length (τ and speedup against prompt length: the long_context set's columns beside the short sets'),
and writes every category figure of every row to by_category.csv.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from draftforge.report.headline import headline_cells
from draftforge.report.rows import to_float

CSV_COLUMNS = ("dataset", "category", "engine", "drafter", "method", "budget", "temperature", "n_prompts",
               "prompt_tokens", "rounds", "tau", "speedup_vs_ar")  # fmt: skip


def category_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (row, category) of every row that has categories."""
    out = []
    for r in rows:
        for category, stats in sorted((r.get("by_category") or {}).items()):
            out.append({**{k: r.get(k) for k in ("dataset", "engine", "drafter", "method", "budget", "temperature")},
                        "category": category, **{k: stats.get(k) for k in CSV_COLUMNS[7:]}})
    return out


def category_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(category_rows(rows))
    return buf.getvalue()


def category_lines(rows: list[dict[str, Any]], choices: list[dict[str, Any]]) -> list[str]:
    """Markdown table at T = 0: a line per headline cell's (engine, drafter, method), a column per (set, category),
    cells `speedup× (τ)`; empty when no row has categories."""
    cells = headline_cells(rows, choices)
    table: dict[tuple, dict[tuple[str, str], dict[str, Any]]] = {}
    for key, per_set in cells.items():
        for dataset, cell in per_set.items():
            row = cell.get("row")
            for category, stats in ((row or {}).get("by_category") or {}).items():
                table.setdefault(key, {})[(dataset, category)] = {**stats, "budget": row.get("budget")}
    columns = sorted({col for per in table.values() for col in per})
    if not columns:
        return []
    tokens = {col: stats.get("prompt_tokens") for per in table.values() for col, stats in per.items()}
    head = ["engine", "drafter / method"] + [f"{d} · {c}" + (f" (~{tokens[(d, c)]:,.0f} tok)" if tokens.get((d, c)) else "")
                                             for d, c in columns]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (engine, drafter, method), per in sorted(table.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        label = f"{drafter} / `{method}`" if drafter else f"`{method}`"
        texts = []
        for col in columns:
            stats = per.get(col)
            texts.append("" if stats is None else
                         f"{to_float(stats.get('speedup_vs_ar')):.2f}× (τ {to_float(stats.get('tau')):.2f})")
        lines.append("| " + " | ".join([engine, label, *texts]) + " |")
    return lines
