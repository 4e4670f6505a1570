"""τ per (drafter, method, budget) and dataset from evaluate's per-response records, over the first N prompts.

Branches evaluated with different `evaluate.num_prompts` compare on their common prompts: τ here is
decoded tokens ÷ rounds summed over the responses of prompts 0..N-1 (every turn), the same ratio the
stage's rows report over all of their prompts.

    python benchmarks/tau_table.py results/default/evaluate --prompts 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def tau_table(evaluate_dir: Path, prompts: int) -> dict[str, dict[str, float]]:
    """{"drafter method budget": {dataset: τ}} over eval-split responses with prompt_index < prompts."""
    sums: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (row, dataset) → [tokens, rounds]
    for branch in sorted(p for p in evaluate_dir.iterdir() if p.is_dir()):
        for path in sorted(branch.glob("*.json")):
            if path.name in ("evaluate.json", "provenance.json"):
                continue
            record = json.loads(path.read_text())
            for r in record.get("responses", []):
                if r["method"] == "ar" or r.get("split", "eval") != "eval" or r["prompt_index"] >= prompts:
                    continue
                key = (f"{branch.name} {r['method']} {r['budget'] or '-'}", record["dataset"])
                sums[key][0] += sum(r["accept_lengths"])
                sums[key][1] += len(r["accept_lengths"])
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for (row, dataset), (tokens, rounds) in sorted(sums.items()):
        table[row][dataset] = round(tokens / rounds, 3)
    return dict(table)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("evaluate_dir", type=Path)
    p.add_argument("--prompts", type=int, default=10**9)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    table = tau_table(args.evaluate_dir, args.prompts)
    datasets = sorted({d for row in table.values() for d in row})
    print("| drafter method budget | " + " | ".join(datasets) + " |")
    print("|---|" + "---|" * len(datasets))
    for row, taus in table.items():
        print(f"| {row} | " + " | ".join(f"{taus[d]:.2f}" if d in taus else "–" for d in datasets) + " |")
    if args.json:
        args.json.write_text(json.dumps({"prompts": args.prompts, "tau": table}, indent=1))


if __name__ == "__main__":
    main()
