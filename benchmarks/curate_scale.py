"""Curate selection at scale: JSONL read + normalization + filters + decontamination + exact/near
dedup over N synthetic rows; prints rows/s and peak RSS. CPU only, no model.

    python benchmarks/curate_scale.py                     # 100K and 1M rows, each in its own process
    python benchmarks/curate_scale.py --rows 200000       # one size
    python benchmarks/curate_scale.py --tiny              # 5K rows, seconds

Synthetic data (deterministic): OpenAI-style records of 15-60 words from a 20K-word vocabulary,
~10% exact duplicates (case/punctuation changed), ~5% near duplicates (one word changed), ~0.2%
planted copies of the 1,000 synthetic eval prompts. Memory contract: the dedup index holds kept
rows only, and kept rows are bounded by the mixture quota (`--max-rows`, default 50K) while every
row is still read and checked (`read_past_quota`), so peak RSS must not grow with N.
With `--max-rows 0` (no quota) the index grows with the number of unique rows: the script then
reports bytes per kept row instead.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _vocab(n: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def _text(rng: random.Random, vocab: list[str]) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(15, 60))) + "?"


def write_data(path: Path, n_rows: int, eval_prompts: list[str], seed: int = 0) -> None:
    rng = random.Random(seed)
    vocab = _vocab(20000, random.Random(1))
    recent: list[str] = []
    with open(path, "w") as fh:
        for i in range(n_rows):
            u = rng.random()
            if u < 0.10 and recent:
                text = rng.choice(recent).upper() + "!"  # exact duplicate after normalization
            elif u < 0.15 and recent:
                ws = rng.choice(recent).split()
                ws[rng.randrange(len(ws))] = rng.choice(vocab)
                text = " ".join(ws)  # near duplicate
            elif u < 0.152:
                text = "Please solve: " + rng.choice(eval_prompts)  # planted eval copy
            else:
                text = _text(rng, vocab)
                recent.append(text)
                if len(recent) > 1000:
                    recent.pop(rng.randrange(len(recent)))
            rec = {"id": str(i), "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
            fh.write(json.dumps(rec) + "\n")


def run_one(n_rows: int, max_rows: int, workdir: Path) -> dict:
    from draftforge.curate.config import CurateConfig, SourceConfig
    from draftforge.curate.decontam import Decontaminator
    from draftforge.curate.select import select_rows
    from draftforge.curate.sources import iter_source

    rng = random.Random(7)
    vocab = _vocab(20000, random.Random(1))
    eval_prompts = [_text(rng, vocab) for _ in range(1000)]
    data = workdir / f"rows-{n_rows}.jsonl"
    t0 = time.perf_counter()
    write_data(data, n_rows, eval_prompts)
    t_write = time.perf_counter() - t0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = CurateConfig(sources=[SourceConfig(name="synthetic", kind="jsonl", path=str(data))], max_rows=max_rows or None)
    cfg.regenerate.enabled = True  # prompts end at the last user turn
    decon = Decontaminator({"synthetic_eval": eval_prompts}, ngram=6, threshold=0.5)
    kept = 0

    def sink(_rec: dict) -> None:
        nonlocal kept
        kept += 1

    t0 = time.perf_counter()
    items = lambda src: iter_source(src, min_chars=2, on_malformed="drop")  # noqa: E731
    sel = select_rows(cfg, items, decon, sink, read_past_quota=True)
    dt = time.perf_counter() - t0
    data.unlink()
    st = sel.per_source["synthetic"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rows": n_rows, "max_rows": max_rows, "kept": kept, "dropped": dict(st.dropped), "seconds": round(dt, 1),
        "rows_per_s": round(n_rows / dt, 1), "peak_rss_mib": round(peak / 2**20, 1),
        "rss_before_select_mib": round(rss_before * 1024 / 2**20, 1), "data_write_s": round(t_write, 1),
        "decontam": decon.report(),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=0, help="one size (default: 100K then 1M, separate processes)")
    ap.add_argument("--max-rows", type=int, default=50000, help="mixture quota (0 = none: index grows with unique rows)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by the parent process)")
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.max_rows = 5000, 2000
    with tempfile.TemporaryDirectory(prefix="curate-scale-") as tmp:
        if args.rows:
            result = run_one(args.rows, args.max_rows, Path(tmp))
            if args.json:
                print(json.dumps(result))
                return
            results = [result]
        else:
            results = []
            for n in (100_000, 1_000_000):  # fresh process each: peak RSS is per process
                cmd = [sys.executable, __file__, "--rows", str(n), "--max-rows", str(args.max_rows), "--json"]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                results.append(json.loads(out))
    print(f"{'rows':>9} {'quota':>7} {'kept':>7} {'rows/s':>9} {'peak RSS MiB':>13} {'decontam':>9} {'dup exact':>9} {'dup near':>9}")
    for r in results:
        d = r["dropped"]
        print(f"{r['rows']:>9} {r['max_rows']:>7} {r['kept']:>7} {r['rows_per_s']:>9} {r['peak_rss_mib']:>13} "
              f"{d.get('contaminated:synthetic_eval', 0):>9} {d.get('duplicate_exact', 0):>9} {d.get('duplicate_near', 0):>9}")  # fmt: skip
    write_record("curate_scale", results)


if __name__ == "__main__":
    main()
