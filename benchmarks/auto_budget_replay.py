"""Replay the auto budget's choice on recorded evaluate stages: for each (set, temperature, tree method) of each
evaluate.json, the budget `evaluate/budget.choose_budget` picks from the calibration rates the rows carry, at
tie tolerances 0 and the module's TIE_TOLERANCE, and its evaluation tokens/s ÷ the oracle budget's.

    PYTHONPATH=src python benchmarks/auto_budget_replay.py docs/cpu-runs/*/evaluate-*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from draftforge.evaluate import budget


def replay(path: Path, tolerances: list[float]) -> list[str]:
    rows = json.loads(path.read_text()).get("rows", [])
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("calibration_tokens_per_s") and r.get("tokens_per_s"):
            groups[(r["dataset"], r["temperature"], r["method"])].append(r)
    lines = []
    for key, group in sorted(groups.items()):
        oracle = max(r["tokens_per_s"] for r in group)
        rate = {r["budget"]: (r["calibration_tokens_per_s"], 1.0) for r in group}  # (τ/cost, 1): the rate itself
        by_budget = {r["budget"]: r["tokens_per_s"] for r in group}
        cells = []
        for tol in tolerances:
            b = budget.choose_budget(rate, tol)
            cells.append(f"tol {tol:.2f}: {b} ({by_budget[b] / oracle:.2f})")
        lines.append(f"{path.name} {key[0]} T={key[1]} {key[2]}  " + "  ".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for f in args.files:
        print("\n".join(replay(f, [0.0, budget.TIE_TOLERANCE])))


if __name__ == "__main__":
    main()
