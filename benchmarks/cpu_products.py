"""The CPU routes of one product x·Wᵀ, timed per weight shape and row count (what engine/cpu_linear.py chooses from).

For each shape (N, K), a group of random weights of that shape adding up to more than the caches (--group-mib,
as a decode step streams its weights from memory) is multiplied by an x of `rows` rows through each route of
engine/cpu_linear.py (`run_route`): gemv (F.linear, MKL), left (W·xᵀ, output copied row-major), packed (oneDNN over
a copy reordered once) and kernel (the engine's AVX2 kernel, engine/cpu_kernel.py, where it builds).
The routes alternate within each repetition so host noise hits each alike; the table shows the minimum per call
over the repetitions and which route is fastest. Shapes default to SmolLM2-135M's fused target projections
(q/k/v 960 × 576, gate/up 3,072 × 576), o_proj 576 × 576, down_proj 576 × 1,536 and its LM head 49,152 × 576.

    PYTHONPATH=src python benchmarks/cpu_products.py [--rows 1,2,5,8,16,17] [--shapes 960x576,…]  # ~2 min
    … --compare-kernel /tmp/k.cpp   # + the kernel built from another source (e.g. git show REV:src/draftforge/
                                    #   engine/csrc/skinny_linear.cpp > /tmp/k.cpp) as route `baseline`
Writes $OUT/cpu_products.json when $OUT is set. Run with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from _out import write_record

from draftforge.engine import cpu_linear

SHAPES = "960x576,576x576,3072x576,576x1536,49152x576"


def time_shape(n: int, k: int, rows_list: list[int], group_mib: int, reps: int, baseline: Any = None) -> list[dict]:
    count = max(1, (group_mib << 20) // (n * k * 4))
    ws = [torch.randn(n, k) * 0.02 for _ in range(count)]
    usable = cpu_linear.candidates("auto", (n, k))  # the routes the engine's tuner chooses among for this shape
    calls: dict[str, Callable] = {r: partial(cpu_linear.run_route, r) for r in usable}
    if baseline is not None and "kernel" in usable:
        calls["baseline"] = baseline.skinny_linear
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k)
        best = {r: float("inf") for r in calls}
        for rep in range(reps + 1):
            for route, call in calls.items():
                t0 = time.perf_counter()
                for w in ws:
                    call(x, w, None)
                if rep:  # the first repetition warms up
                    best[route] = min(best[route], (time.perf_counter() - t0) / count)
        fastest = min(usable, key=best.get)  # of the engine's routes
        out.append({"shape": f"{n}x{k}", "rows": rows, "weights_timed": count,
                    "us": {r: 1e6 * t for r, t in best.items()}, "fastest": fastest})  # fmt: skip
        us = "  ".join(f"{r} {1e6 * t:8.1f}" for r, t in best.items())
        print(f"{n:>6}x{k:<5} rows {rows:>3}  {us}  → {fastest}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,2,3,4,5,8,9,16,17,32,65")
    ap.add_argument("--group-mib", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare-kernel", metavar="CPP", default=None,
                    help="also time the kernel built from this source, as route `baseline`, beside the engine's")
    args = ap.parse_args()
    baseline = None
    if args.compare_kernel:
        from draftforge.engine import cpu_kernel

        if not cpu_kernel.available():
            raise SystemExit(f"--compare-kernel: the engine's kernel is unavailable here ({cpu_kernel.unavailable_reason()})")
        baseline = cpu_kernel.build(Path(args.compare_kernel), "draftforge_skinny_linear_baseline")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; µs per call (min of {args.reps})")
    table = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        table += time_shape(n, k, rows, args.group_mib, args.reps, baseline)
    write_record("cpu_products", {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": table})


if __name__ == "__main__":
    main()
