"""The engine's CPU decode-attention kernel against SDPA on one attention call, µs, over a grid of cache lengths and
folded query rows (a KV group's query heads × the span's nodes): where `blocks.KERNEL_ATTENTION_ROWS` comes from.

    PYTHONPATH=src python benchmarks/cpu_attention.py                     # SmolLM2-135M's heads: 3 KV heads × 64
    PYTHONPATH=src python benchmarks/cpu_attention.py --lengths 300 --rows 3,12
Writes $OUT/cpu_attention.json when $OUT is set. Each cell: min over 7 repetitions of 300 calls, the two ways
alternating, an additive mask of zeros for more than one node's rows (as a tree verify passes), none for one node's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _out import write_record  # noqa: E402

from draftforge.engine import cpu_kernel  # noqa: E402


def best_us(fns: dict[str, Callable[[], object]], reps: int = 7, calls: int = 300) -> dict[str, float]:
    out = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        for _ in range(20):
            f()
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            out[name] = min(out[name], (time.perf_counter() - t0) / calls * 1e6)
    return out


def time_cell(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None) -> dict[str, float]:
    """q (1, G, R, D) over k, v (1, G, L, D), mask (1, 1, R, L) or None → µs of SDPA and of the kernel."""
    L, scale = k.shape[2], q.shape[3] ** -0.5
    m2 = None if m is None else m[0, 0]
    return best_us({"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale),
                    "kernel": lambda: cpu_kernel.decode_attention(q[0], k[0], v[0], m2, L, scale)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", default="300,1000")
    ap.add_argument("--rows", default="3,6,12,15,24,39,51")
    args = ap.parse_args()
    if not cpu_kernel.available("decode_attention"):
        sys.exit(f"the decode-attention kernel is unavailable: {cpu_kernel.unavailable_reason('decode_attention')}")
    G, D = args.kv_heads, args.head_dim
    lengths, rows = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.rows.split(",")]
    cache = torch.randn(2, G, max(lengths) + 64, D)
    cells = []
    with torch.no_grad():
        for L in lengths:
            k, v = cache[0, :, :L][None], cache[1, :, :L][None]
            for R in rows:
                q = torch.randn(1, G, R, D)
                us = time_cell(q, k, v, torch.zeros(1, 1, R, L) if R > G else None)
                cells.append({"length": L, "rows": R, "sdpa_us": us["sdpa"], "kernel_us": us["kernel"]})
    write_record("cpu_attention", {"threads": torch.get_num_threads(), "kv_heads": G, "head_dim": D, "cells": cells})
    print(f"{G} KV heads × head dim {D}, {torch.get_num_threads()} threads; µs SDPA / kernel (SDPA ÷ kernel)")
    for L in lengths:
        print(f"L {L:>5}: " + "  ".join(f"R {c['rows']}: {c['sdpa_us']:.0f} / {c['kernel_us']:.0f} "
                                        f"({c['sdpa_us'] / c['kernel_us']:.2f})" for c in cells if c["length"] == L))


if __name__ == "__main__":
    main()
