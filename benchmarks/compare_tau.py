"""τ and speedup of two evaluate records side by side, per (set, temperature, method, budget).

Decoding at T = 0 is deterministic, so a τ difference between two records of the same prompts is the drafters'
(e.g. two training schedules); speedups carry each run's timing noise.

    python benchmarks/compare_tau.py A/evaluate.json B/evaluate.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

Key = tuple[str, float, str, int]


def drafted_rows(path: str) -> dict[Key, dict[str, Any]]:
    """The record's drafted methods that ran (status ok), by (set, T, method, budget)."""
    rows = json.load(open(path))["rows"]
    return {(r["dataset"], r["temperature"], r["method"], r["budget"] or 0): r
            for r in rows if r.get("status") == "ok" and r["method"] != "ar"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="evaluate.json (A)")
    ap.add_argument("b", help="evaluate.json (B)")
    args = ap.parse_args()
    a, b = drafted_rows(args.a), drafted_rows(args.b)
    print(f"{'set':14} {'T':>3} {'method':>12} {'tau A':>7} {'tau B':>7} {'dtau':>6} {'spd A':>6} {'spd B':>6}")
    for key in sorted(set(a) & set(b)):
        ra, rb = a[key], b[key]
        method = key[2] + (f"-{key[3]}" if key[3] else "")
        print(f"{key[0]:14} {key[1]:3.0f} {method:>12} {ra['tau']:7.3f} {rb['tau']:7.3f} {rb['tau'] - ra['tau']:+6.3f} "
              f"{ra['speedup_vs_ar']:6.2f} {rb['speedup_vs_ar']:6.2f}")


if __name__ == "__main__":
    main()
