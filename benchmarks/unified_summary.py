"""Fold the unified-engine GPU run's files (benchmarks/gpu_unified.sh) into records and print the tables.

    python benchmarks/unified_summary.py --call1 DIR1 --call2 DIR2 --commit SHA --device "NVIDIA H200"
Writes docs/gpu-runs/engine_tree_8b.json, engine_tree_27b.json (both repeats), prints markdown tables for
docs/gpu-runs/unified-engine/summary.md. Datasheet bandwidth: H200 4.8 TB/s, H100 (SXM) 3.35 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATASHEET = {"H200": 4.8e12, "H100": 3.35e12}
CMD = {"8b": "cd benchmarks && python3 engine_tree.py --target qwen3-8b-random --engines compiled_split",
       "27b": "cd benchmarks && python3 engine_tree.py --target qwen3.6-27b-random --engines compiled_split "
              "--verify-budgets 1,16,64 --round-budgets 16,64"}


def engine_rows(dirs: list[Path], commit: str) -> None:
    print("| target | run | card | floor ms (measured copy BW) | floor ms (datasheet) | AR step ms | AR ÷ floor (measured) | "
          "AR ÷ floor (datasheet) | verify 1+64 ms (÷ AR) | DDTree-64 round ms (÷ AR) | DFlash round ÷ AR | capture s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tag in ("8b", "27b"):
        runs = []
        for r in (1, 2):
            for d in dirs:
                f = d / f"engine_tree_{tag}_r{r}.json"
                if f.is_file():
                    runs.append(json.loads(f.read_text()))
                    break
        if not runs:
            continue
        card = runs[0]["device"]
        ds = next((v for k, v in DATASHEET.items() if k in card), float("nan"))
        for i, rec in enumerate(runs, 1):
            e = rec["engines"]["compiled_split"]
            v64 = next(v for v in e["verify"] if v["budget"] == 64)
            d64 = next(r for r in e["rounds"] if r["method"] == "ddtree" and r["budget"] == 64)
            dfl = next(r for r in e["rounds"] if r["method"] == "dflash")
            floor_ds = 1e3 * rec["step_bytes"] / ds
            rec["floor_ms_datasheet"] = floor_ds
            rec["datasheet_bytes_per_s"] = ds
            print(f"| {rec['target']} | {i} | {card} | {rec['floor_ms']:.2f} ({rec['copy_bytes_per_s'] / 1e12:.2f} TB/s) | "
                  f"{floor_ds:.2f} ({ds / 1e12:.2f} TB/s) | {e['ar_step_ms']:.2f} | {e['ar_over_floor']:.2f}× | "
                  f"{e['ar_step_ms'] / floor_ds:.2f}× | {v64['verify_ms']:.2f} ({v64['verify_over_ar']:.2f}×) | "
                  f"{d64['round_ms']:.2f} ({d64['round_over_ar']:.2f}×) | {dfl['round_over_ar']:.2f}× | {e['capture_s']:.0f} |")
        out = {"command": CMD[tag] + "  (PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests; via benchmarks/gpu_unified.sh)",
               "commit": commit, "device": card, "runs": runs}
        (REPO / f"docs/gpu-runs/engine_tree_{tag}.json").write_text(json.dumps(out, indent=1) + "\n")
    print()


def mismatch_rows(path: Path) -> None:
    rec = json.loads(path.read_text())
    print("| dtype / engine | responses | DDTree-64 ≠ AR | DDTree-256 ≠ AR | first differing positions | fp32 gap between the two tokens (bf16 noise bound) | verdicts |")
    print("|---|---|---|---|---|---|---|")
    for key, res in rec["mismatch"].items():
        pos, gaps, verdicts = [], [], []
        for row in res["rows"]:
            for k, c in row.items():
                if isinstance(c, dict) and not c["equal"]:
                    pos.append(f"{k[6:]}:{c['first_diff']}")
                    m = c.get("margins")
                    if m:
                        gaps.append(f"{m['fp32_gap']:.3f} ({m['bf16_noise_bound']:.3f})")
                        verdicts.append(m["verdict"])
        mm = res["mismatches"]
        vc = {v: verdicts.count(v) for v in sorted(set(verdicts))}
        print(f"| {key} | {res['responses']} | {mm.get('ddtree64', 0)} | {mm.get('ddtree256', 0)} | {', '.join(pos) or '—'} | "
              f"{'; '.join(gaps) or '—'} | {vc or '—'} |")
    print()
    print("| dtype | engine | capacity | prompt (tokens) | AR tok/s (median of runs) | tpot ms | TTFT ms |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in rec.get("ar_gap", {}).items():
        for r in rows:
            if "tok_s" in r:
                print(f"| {name} | {r['engine']} | {r['capacity'] or '—'} | {r['prompt']} ({r['prompt_len']}) | {r['tok_s']:.1f} "
                      f"({', '.join(f'{x:.0f}' for x in r['tok_s_runs'])}) | {r['tpot_ms']:.2f} | {r['ttft_ms']:.1f} |")
            else:
                print(f"| {name} | {r['engine']} | {r['capacity']} | — | {r.get('skipped') or r.get('error')} | | |")
    taus = [c["tau"] for res in rec["mismatch"].values() for row in res["rows"] for c in row.values() if isinstance(c, dict)]
    if taus:
        print(f"\nτ over all tree generations: median {statistics.median(taus):.2f}, max {max(taus):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--call1", type=Path, required=True)
    ap.add_argument("--call2", type=Path)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    dirs = [d for d in (args.call1, args.call2) if d]
    engine_rows(dirs, args.commit)
    for d in dirs:
        if (d / "bf16_mismatch.json").is_file():
            mismatch_rows(d / "bf16_mismatch.json")


if __name__ == "__main__":
    main()
