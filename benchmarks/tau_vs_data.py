"""τ vs training data: one or more recipes (drafters) trained on 1K / 5K / 20K / 50K conversations, val τ_sim
and engine τ (DFlash, DDTree best budget) against data per recipe, and the calibration of val τ_sim against
engine DFlash τ.

Input: a finished curate stage with at least max(sizes) train rows (`experiment=gpu` curates ~52K) and
its target.json. For each size N the script builds `<out>/n<N>/<exp>/` with the target, a curate
folder holding N train rows drawn uniformly (nested: 1K ⊂ 5K ⊂ …; every N has the mixture's
source shares) and the *whole* val split (the same val rows for every N), then, for each drafter of
`--drafters` (default `dflash`), runs the pipeline's own `train` and `evaluate` stages there (one process
each, the experiment's config plus `overrides` plus `drafter=<name>`; outputs in
`<out>/n<N>/<exp>/{train,evaluate}/<name>`). A (size, drafter) whose `evaluate.json` exists is not rerun,
and one whose train `metrics.json` exists is only evaluated, so sizes can be run one command at a time
(`--sizes 1000,5000` then `--sizes 20000`) and the table (one row per size and recipe) and plot (one line
per recipe) come out of whatever has finished; `--summarize-only` writes them without running anything.

    PYTHONPATH=src python benchmarks/tau_vs_data.py --experiment gpu --curate results/gpu/curate \
        --target-json results/gpu/target/target.json --out results/tau_vs_data --sizes 1000,5000,20000,50000 \
        [--drafters dflash,dflash_aw] [--reuse 50000=results] [-- evaluate.num_prompts=5 ...]

`--reuse N=ROOT` takes size N's train and evaluate outputs (every drafter's) from an existing results root
(e.g. the `experiment=gpu` run itself, whose curate had ≥ 50K rows) instead of training again.
`--reuse-train N/DRAFTER=ROOT` copies only that drafter's finished train folder (ROOT/<exp>/train/DRAFTER)
into size N's root and evaluates it there with this run's overrides; it must be the same recipe (same rows,
drafter config and schedule). Writes
`<out>/tau_vs_data.{json,md,png}` (and $OUT/tau_vs_data.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from _out import write_record

REPO = Path(__file__).resolve().parents[1]


def subset_curate(src: Path, dst: Path, n_train: int, seed: int = 0) -> int:
    """n_train train rows drawn uniformly (one seeded permutation, so smaller sizes are subsets of
    larger ones and every size has the full mixture's source shares) + every val row → dst."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True, exist_ok=True)
    table = pa.concat_tables([pq.read_table(f) for f in sorted(src.glob("train-*.parquet"))])
    if table.num_rows < n_train:
        raise SystemExit(f"{src}: only {table.num_rows} train rows, asked for {n_train}")
    pick = np.sort(np.random.default_rng(seed).permutation(table.num_rows)[:n_train])
    pq.write_table(table.take(pa.array(pick)), dst / "train-00000.parquet")
    for f in sorted(src.glob("val-*.parquet")):
        shutil.copy2(f, dst / f.name)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["subset_of"] = {"curate": str(src), "n_train": n_train, "seed": seed}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return n_train


def run_stage(stage: str, experiment: str, root: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", f"draftforge.{stage}", f"experiment={experiment}", f"results_root={root}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=REPO)


def summarize(n: int, drafter: str, exp_dir: Path) -> dict[str, Any]:
    metrics = json.loads((exp_dir / "train" / drafter / "metrics.json").read_text())
    rows = json.loads((exp_dir / "evaluate" / drafter / "evaluate.json").read_text())["rows"]
    out: dict[str, Any] = {"n_train": n, "recipe": drafter, "features": metrics.get("features"), "steps": metrics["steps"],
                           "val_sim_tau": (metrics.get("best") or {}).get("val_sim_tau"),
                           "val_loss": (metrics.get("best") or {}).get("val_loss"), "datasets": {}}  # fmt: skip
    for r in rows:
        if float(r.get("temperature", 0.0)) != 0.0 or r.get("tau") is None:
            continue
        d = out["datasets"].setdefault(r["dataset"], {"dflash_tau": None, "ddtree_best_tau": None, "ddtree_best_budget": None})
        if r["method"] == "dflash":
            d["dflash_tau"] = r["tau"]
        elif r["method"] == "ddtree" and (d["ddtree_best_tau"] is None or r["tau"] > d["ddtree_best_tau"]):
            d["ddtree_best_tau"], d["ddtree_best_budget"] = r["tau"], r["budget"]
    taus = [d["dflash_tau"] for d in out["datasets"].values() if d["dflash_tau"] is not None]
    trees = [d["ddtree_best_tau"] for d in out["datasets"].values() if d["ddtree_best_tau"] is not None]
    out["dflash_tau_mean"] = sum(taus) / len(taus) if taus else None
    out["ddtree_best_tau_mean"] = sum(trees) / len(trees) if trees else None
    if out["val_sim_tau"] and out["dflash_tau_mean"]:
        out["calibration_gap_pct"] = 100.0 * (out["val_sim_tau"] - out["dflash_tau_mean"]) / out["dflash_tau_mean"]
    return out


def table(results: list[dict[str, Any]]) -> str:
    datasets = sorted({d for r in results for d in r["datasets"]})
    head = "| conversations | recipe | steps | val τ_sim | " + " | ".join(f"{d} DFlash τ / DDTree τ (budget)" for d in datasets) + \
           " | mean DFlash τ | mean DDTree τ | τ_sim − DFlash τ |"  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        cells = []
        for d in datasets:
            x = r["datasets"].get(d, {})
            cells.append(f"{_f(x.get('dflash_tau'))} / {_f(x.get('ddtree_best_tau'))} ({x.get('ddtree_best_budget')})")
        gap = r.get("calibration_gap_pct")
        lines.append(f"| {r['n_train']:,} | {r['recipe']} | {r['steps']} | {_f(r['val_sim_tau'])} | " + " | ".join(cells) +
                     f" | {_f(r['dflash_tau_mean'])} | {_f(r['ddtree_best_tau_mean'])} | {'' if gap is None else f'{gap:+.1f}%'} |")  # fmt: skip
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r["recipe"] for r in results))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, recipe in enumerate(recipes):
        rs, color = [r for r in results if r["recipe"] == recipe], f"C{k}"
        ns = [r["n_train"] for r in rs]
        ax.plot(ns, [r["val_sim_tau"] for r in rs], "o-", color=color, label=f"{recipe}: val τ_sim")
        ax.plot(ns, [r["dflash_tau_mean"] for r in rs], "s--", color=color, label=f"{recipe}: engine DFlash τ")
        ax.plot(ns, [r["ddtree_best_tau_mean"] for r in rs], "^:", color=color, label=f"{recipe}: engine DDTree τ (best budget)")
        cal = [r for r in rs if r["dflash_tau_mean"] and r["val_sim_tau"]]
        bx.plot([r["dflash_tau_mean"] for r in cal], [r["val_sim_tau"] for r in cal], "o", color=color, label=recipe)
        for r in cal:
            bx.annotate(f"{r['n_train']:,}", (r["dflash_tau_mean"], r["val_sim_tau"]), color=color)
    ax.set_xscale("log")
    sizes = sorted({r["n_train"] for r in results})
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("training conversations")
    ax.set_ylabel("τ (tokens per verify)")
    ax.set_title("τ vs data (engine τ: mean over sets)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    xy = [v for r in results if r["dflash_tau_mean"] and r["val_sim_tau"] for v in (r["dflash_tau_mean"], r["val_sim_tau"])]
    lim = [1.0, max(xy + [2.0]) * 1.05]
    bx.plot(lim, lim, "k--", lw=0.8, label="τ_sim = engine τ")
    bx.set_xlabel("engine DFlash τ")
    bx.set_ylabel("val τ_sim")
    bx.set_title("calibration of the offline estimate")
    bx.grid(alpha=0.3)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_pair(args: argparse.Namespace, n: int, drafter: str, overrides: list[str], reuse_train: dict[tuple[int, str], Path]) -> None:
    """Size n, one drafter: subset (once per size), train unless its metrics exist, evaluate."""
    root = args.out / f"n{n}"
    exp_dir = root / args.experiment
    if (exp_dir / "evaluate" / drafter / "evaluate.json").is_file():
        print(f"n={n} {drafter}: done before", flush=True)
        return
    (exp_dir / "target").mkdir(parents=True, exist_ok=True)
    shutil.copy2(args.target_json, exp_dir / "target" / "target.json")
    if not (exp_dir / "curate" / "manifest.json").is_file():
        subset_curate(args.curate, exp_dir / "curate", n)
    train_dir, src = exp_dir / "train" / drafter, reuse_train.get((n, drafter))
    if src is not None and not (train_dir / "metrics.json").is_file():
        shutil.copytree(src / args.experiment / "train" / drafter, train_dir, dirs_exist_ok=True)
    if not (train_dir / "metrics.json").is_file():
        run_stage("train", args.experiment, root, [*overrides, f"drafter={drafter}"])
    run_stage("evaluate", args.experiment, root, [*overrides, f"drafter={drafter}"])


def main() -> None:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default="gpu")
    ap.add_argument("--curate", type=Path, required=True)
    ap.add_argument("--target-json", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "tau_vs_data")
    ap.add_argument("--sizes", default="1000,5000,20000,50000")
    ap.add_argument("--drafters", default="dflash", help="comma-separated drafter names (conf/drafter), one recipe each")
    ap.add_argument("--reuse", action="append", default=[], help="N=RESULTS_ROOT: size N's outputs from that root")
    ap.add_argument("--reuse-train", action="append", default=[], help="N/DRAFTER=RESULTS_ROOT: that finished train, evaluated here")
    ap.add_argument("--summarize-only", action="store_true", help="write the table and plot of what has finished; run nothing")
    args = ap.parse_args(argv)
    reuse = {int(k): Path(v) for k, v in (r.split("=", 1) for r in args.reuse)}
    reuse_train = {(int(k.split("/")[0]), k.split("/")[1]): Path(v) for k, v in (r.split("=", 1) for r in args.reuse_train)}
    drafters = [d for d in args.drafters.split(",") if d]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    for n in [] if args.summarize_only else sizes:
        for drafter in drafters if n not in reuse else []:
            run_pair(args, n, drafter, overrides, reuse_train)
    results = []
    for drafter in drafters:
        for n in sorted(set(sizes) | set(reuse)):
            exp_dir = (reuse[n] if n in reuse else args.out / f"n{n}") / args.experiment
            if (exp_dir / "evaluate" / drafter / "evaluate.json").is_file():
                results.append(summarize(n, drafter, exp_dir))
    if not results:
        raise SystemExit("no size has finished yet")
    md = table(results)
    print(md)
    (args.out / "tau_vs_data.md").write_text(md + "\n")
    (args.out / "tau_vs_data.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "tau_vs_data.png")
    write_record("tau_vs_data", results)
    if os.environ.get("OUT"):
        shutil.copy2(args.out / "tau_vs_data.png", Path(os.environ["OUT"]) / "tau_vs_data.png")


if __name__ == "__main__":
    main()
