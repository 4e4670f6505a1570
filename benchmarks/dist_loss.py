"""Cost of the distribution objective's forward + backward: chunked recompute vs the whole-vocabulary path.

    PYTHONPATH=src python benchmarks/dist_loss.py                     # the CPU default world's batch
    PYTHONPATH=src python benchmarks/dist_loss.py --rows 512 --vocab 49152 --hidden 576 --rank 256

Random fp32 tensors of one step's shapes (rows = seqs × anchors × block slots, the Markov head's rank r);
prints ms per forward + backward for each path and their ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.train.dspark_loss import dist_terms  # noqa: E402


def step_ms(chunk: int, h, W, y, ht, e, w2, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        leaves = [t.clone().requires_grad_() for t in (h, e, w2)]
        t0 = time.perf_counter()
        terms, _ = dist_terms(leaves[0], W, y, ht, leaves[1], leaves[2], chunk=chunk)
        terms.sum().backward()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])  # the first rep warms the allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    h, W, ht, e, w2 = mk(a.rows, a.hidden), mk(a.vocab, a.hidden), mk(a.rows, a.hidden), mk(a.rows, a.rank), mk(a.vocab, a.rank)
    y = torch.randint(0, a.vocab, (a.rows,), generator=g)
    chunked = step_ms(a.chunk, h, W, y, ht, e, w2, a.reps)
    whole = step_ms(a.vocab, h, W, y, ht, e, w2, a.reps)
    print(f"rows {a.rows} vocab {a.vocab} hidden {a.hidden} rank {a.rank} threads {torch.get_num_threads()}")
    print(f"chunked ({a.chunk}) {chunked:.0f} ms   whole {whole:.0f} ms   chunked / whole {chunked / whole:.2f}")


if __name__ == "__main__":
    main()
