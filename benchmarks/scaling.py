"""Scaling of `extract` and `train` on N GPUs vs 1 GPU with the same per-GPU work.

Runs both stages through the project's own Snakemake rules (`resources: gpu=N`, torchrun inside the
rule) on a random-weight Qwen3-8B-shaped target (conf/experiment/scale.yaml; no download), first with
N GPUs, then with 1 GPU and 1/N of the data and global batch, and prints

    scaling efficiency = N-GPU throughput ÷ (N × 1-GPU throughput)

for extraction (tokens/s, from extract/index.json) and training (block tokens/s, steady state, from
train/metrics.json). Curate is replaced by synthetic token sequences of the target's vocabulary
written in the curate format (scaling does not depend on what the tokens say).

    python benchmarks/scaling.py --gpus 8                              # one 8-GPU node
    python benchmarks/scaling.py --cpu --gpus 2 --target tiny-random   # the same path on CPU (gloo)
Needs the project's environment (snakemake, hydra, mlflow; scripts/setup.sh). NVLink multicast stays
off (NCCL_NVLS_ENABLE=0). Writes $OUT/scaling.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def snakemake(root: Path, until: str, overrides: list[str], cores: int) -> float:
    """Run the DAG up to `until` for experiment=scale under results root `root`; returns wall seconds."""
    cmd = [str(Path(sys.executable).with_name("snakemake")), "--cores", str(cores), "--until", until,
           "--config", "experiment=scale", f"results_root={root}", f"overrides={json.dumps(overrides)}"]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((root / "scale" / "logs").glob("*.log")))
        raise SystemExit(f"snakemake --until {until} failed:\n{result.stderr[-3000:]}\n{logs}")
    return time.monotonic() - start


def write_synthetic_curate(curate_dir: Path, target: dict, n_seqs: int, min_len: int, max_len: int, seed: int) -> int:
    """Curate-format shards of random tokens (lengths uniform in [min_len, max_len]); returns tokens."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draftforge.io import atomic_path, write_json

    rng = np.random.default_rng(seed)
    curate_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for split, count in (("train", n_seqs), ("val", max(2, n_seqs // 50))):
        lengths = rng.integers(min_len, max_len + 1, size=count)
        ids = [rng.integers(16, target["vocab_size"], size=int(n), dtype=np.int32) for n in lengths]
        masks = [np.concatenate([np.zeros(n // 4, np.uint8), np.ones(n - n // 4, np.uint8)]) for n in lengths]
        table = pa.table({
            "id": [f"{split}-{i}" for i in range(count)], "source": ["synthetic"] * count,
            "input_ids": pa.array([a.tolist() for a in ids], pa.list_(pa.int32())),
            "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.uint8())),
            "n_tokens": pa.array(lengths.astype(np.int32)),
        })  # fmt: skip
        with atomic_path(curate_dir / f"{split}-00000.parquet", suffix=".parquet") as tmp:
            pq.write_table(table, tmp)
        total += int(lengths.sum()) if split == "train" else 0
    write_json(curate_dir / "manifest.json", {"synthetic": True, "target_fingerprint": target["fingerprint"],
                                              "counts": {"kept": n_seqs}})  # fmt: skip
    return total


def run_world(args: argparse.Namespace, n: int, work: Path) -> dict:
    """Target → synthetic curate → extract → train with n GPUs (or n CPU processes) and n× the work."""
    from draftforge.target.load import read_target_info

    root = work / f"n{n}"
    shutil.rmtree(root, ignore_errors=True)
    launch = [f"extract.cpu_procs={n}", f"train.cpu_procs={n}", "extract.gpus=0", "train.gpus=0", "train.compile=false"] if args.cpu else \
             [f"extract.gpus={n}", f"train.gpus={n}"]  # fmt: skip
    overrides = [f"target={args.target}", *launch, f"train.batch_seqs={args.seqs_per_gpu_step}",
                 f"train.max_steps={args.train_steps}", f"train.max_seq_len={args.max_len}", *args.override]  # fmt: skip
    snakemake(root, "target", overrides, args.cores)
    target = read_target_info(root / "scale" / "target" / "target.json")
    tokens = write_synthetic_curate(root / "scale" / "curate", target, n * args.seqs_per_gpu, args.min_len, args.max_len, seed=n)
    extract_wall = snakemake(root, "extract", overrides, args.cores)
    index = json.loads((root / "scale" / "extract" / "index.json").read_text())
    train_wall = snakemake(root, "train", overrides, args.cores)
    metrics = json.loads((root / "scale" / "train" / "dflash" / "metrics.json").read_text())
    return {
        "n": n, "tokens": tokens, "extract_wall_s": extract_wall, "train_wall_s": train_wall,
        "extract_tokens_per_s": index["throughput"]["tokens_per_s_total"],
        "train_block_tokens_per_s": metrics["throughput"]["block_tokens_per_s"],
        "train_ctx_tokens_per_s": metrics["throughput"]["ctx_tokens_per_s"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8, help="N: GPUs (or CPU processes with --cpu) of the scaled run")
    ap.add_argument("--cpu", action="store_true", help="gloo CPU processes instead of GPUs (tests the path)")
    ap.add_argument("--target", default="qwen3-8b-random")
    ap.add_argument("--seqs-per-gpu", type=int, default=256, help="curate sequences per GPU (extract work)")
    ap.add_argument("--seqs-per-gpu-step", type=int, default=1, help="sequences per GPU per optimizer step")
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", default="", help="results roots go here (default results/scaling)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    work = Path(args.work or REPO / "results" / "scaling").resolve()
    scaled, single = run_world(args, args.gpus, work), run_world(args, 1, work)
    n = args.gpus
    eff = {
        "extract": scaled["extract_tokens_per_s"] / (n * single["extract_tokens_per_s"]),
        "train": scaled["train_block_tokens_per_s"] / (n * single["train_block_tokens_per_s"]),
    }
    unit = "CPU procs" if args.cpu else "GPUs"
    print(f"\n{'stage':8} {f'{n} {unit} tok/s':>18} {f'1 {unit[:-1]} tok/s':>16} {'efficiency':>11} goal")
    print(f"{'extract':8} {scaled['extract_tokens_per_s']:18.0f} {single['extract_tokens_per_s']:16.0f} {eff['extract']:11.3f} >= 0.90")
    print(f"{'train':8} {scaled['train_block_tokens_per_s']:18.0f} {single['train_block_tokens_per_s']:16.0f} {eff['train']:11.3f} >= 0.85")
    record = {"n": n, "cpu": args.cpu, "target": args.target, "scaled": scaled, "single": single, "efficiency": eff}
    write_record("scaling", record)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
