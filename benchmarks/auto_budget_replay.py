"""Replay the auto budget's choice on recorded evaluate stages: for each (set, temperature, tree method) of each
evaluate.json, the budget `evaluate/budget.choose_budget` picks from the calibration numbers the rows carry, and
its evaluation tokens/s ÷ the oracle budget's, under two cost rules and two tie tolerances:

- `own`: each set's own calibration round cost (what evaluate did before costs were pooled);
- `pooled`: the mean over the stage's sets of their round costs at that (temperature, method, budget) — the rows'
  unweighted stand-in for `budget.calibration_curves`, which pools decode seconds ÷ rounds over the records. On a
  stage that already pooled, every set carries the pooled cost and both rules agree.

    PYTHONPATH=src python benchmarks/auto_budget_replay.py docs/cpu-runs/*/evaluate-*.json

The last lines summarise each rule over every group: mean and lowest auto ÷ oracle, and how many fall below 0.9.

`--records DIR` replays exactly instead, where a stage's responses are still at hand: it aggregates every response of
`results/<exp>/evaluate/<drafter>/<dataset>.json` with the current code (`evaluate.aggregate`, which calls
`budget.mark_auto`) and prints each tree budget's calibration τ, round cost, predicted rate and evaluation tokens/s.

    PYTHONPATH=src python benchmarks/auto_budget_replay.py --records results/default/evaluate/dflash_aw_b4
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from draftforge.evaluate import budget

Rule = tuple[str, float]  # (cost rule, tie tolerance)


def replay(path: Path, rules: list[Rule]) -> list[tuple[str, dict[Rule, float]]]:
    """[(group label, {rule: auto ÷ oracle})] for the stage's tree-method groups with calibration numbers."""
    rows = json.loads(path.read_text()).get("rows", [])
    groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        if r.get("calibration_tau") and r.get("calibration_round_ms") and r.get("tokens_per_s"):
            groups[(r["dataset"], r["temperature"], r["method"])][r["budget"]] = r
    costs: dict[tuple, list[float]] = defaultdict(list)
    for (_, temperature, method), by_budget in groups.items():
        for b, r in by_budget.items():
            costs[(temperature, method, b)].append(r["calibration_round_ms"])
    out = []
    for key, by_budget in sorted(groups.items()):
        oracle = max(r["tokens_per_s"] for r in by_budget.values())
        ratios = {}
        for rule in rules:
            cost = {b: (statistics.mean(costs[(key[1], key[2], b)]) if rule[0] == "pooled" else r["calibration_round_ms"])
                    for b, r in by_budget.items()}
            chosen = budget.choose_budget({b: (r["calibration_tau"], cost[b]) for b, r in by_budget.items()}, rule[1])
            ratios[rule] = by_budget[chosen]["tokens_per_s"] / oracle
        out.append((f"{path.parent.name}/{path.name} {key[0]} T={key[1]} {key[2]}", ratios))
    return out


def replay_records(folder: Path, calibration_prompts: int) -> list[str]:
    """One line per tree-method row of the stage's responses aggregated by the current code."""
    from draftforge.evaluate.aggregate import aggregate

    records = []
    for f in sorted(folder.glob("*.json")):
        if f.name not in ("evaluate.json", "provenance.json"):
            records += json.loads(f.read_text())["responses"]
    lines = []
    for r in aggregate(records, calibration_prompts=calibration_prompts):
        if r.get("calibration_round_ms") is not None:
            lines.append(f"{r['dataset']} T={r['temperature']} {r['method']} budget {r['budget']}: calibration τ "
                         f"{r['calibration_tau']:.2f}, round {r['calibration_round_ms']:.1f} ms, predicted "
                         f"{r['calibration_tokens_per_s']:.1f} tok/s; evaluation {r['tokens_per_s']:.1f} tok/s"
                         f"{'  <- auto' if r['auto_budget'] else ''}; auto ÷ oracle {r['auto_vs_best']:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--records", type=Path, help="an evaluate/<drafter> folder: replay its responses exactly")
    ap.add_argument("--calibration-prompts", type=int, default=2, help="the stage's evaluate.calibration_prompts")
    args = ap.parse_args()
    if args.records:
        print("\n".join(replay_records(args.records, args.calibration_prompts)))
        return
    rules: list[Rule] = [(c, t) for c in ("own", "pooled") for t in (0.0, budget.TIE_TOLERANCE)]
    every: dict[Rule, list[float]] = defaultdict(list)
    for f in args.files:
        for label, ratios in replay(f, rules):
            print(label, "  ".join(f"{c} tol {t:.2f}: {q:.2f}" for (c, t), q in ratios.items()))
            for rule, q in ratios.items():
                every[rule].append(q)
    for (c, t), qs in every.items():
        print(f"{c:6} tol {t:.2f}: {len(qs)} groups, auto ÷ oracle mean {statistics.mean(qs):.3f}, "
              f"lowest {min(qs):.2f}, below 0.9: {sum(q < 0.9 for q in qs)}")


if __name__ == "__main__":
    main()
