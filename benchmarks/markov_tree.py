"""ddtree_markov's tree build on the default world's shapes, beside DDTree's, and other builds to compare.

The ddtree_markov round differs from a ddtree round only in the host work after the block pass (the tree
build); this times that work alone, interleaved, on random logits and a random rank-256 Markov head over
SmolLM2's 49,152-token vocabulary (depths 15, budgets 16 / 64), fp32 on the CPU.

    PYTHONPATH=src python benchmarks/markov_tree.py [--reps 5] [--other FILE]
`--other` names a Python file defining another `build_markov_tree(bonus, base, bias, budget)` (e.g. a
batched variant) to time beside the engine's and check for the same tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.engine import cpu_linear  # noqa: E402
from draftforge.engine.dspark import build_markov_tree  # noqa: E402
from draftforge.engine.tree import build_tree, draft_topk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--other", default="")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    base = 4 * torch.randn(15, args.vocab, generator=g)
    w1 = torch.randn(args.vocab, args.rank, generator=g) / args.rank**0.5
    w2 = torch.randn(args.vocab, args.rank, generator=g) / args.rank**0.5

    cpu_linear.register(w2)  # as the engine's methods do: the bias product on its measured route

    def bias(prev: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(w1[prev], w2)

    cpu_linear.pretune(range(1, 17))
    builders = {"engine": build_markov_tree}
    if args.other:
        spec = importlib.util.spec_from_file_location("other", args.other)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        builders["other"] = mod.build_markov_tree

    def ddtree(bonus: int, logits: torch.Tensor, _bias, budget: int):
        vals, toks = draft_topk(logits, budget)
        return build_tree(bonus, vals, toks, budget)

    builders["ddtree (no Markov)"] = ddtree
    times: dict[tuple[str, int], list[float]] = {}
    trees = {}
    for _ in range(args.reps):
        for budget in (16, 64):
            for name, fn in builders.items():
                t0 = time.perf_counter()
                tree = fn(7, base, bias, budget)
                times.setdefault((name, budget), []).append(time.perf_counter() - t0)
                trees[(name, budget)] = tree
    for budget in (16, 64):
        if "other" in builders:
            a, b = trees[("engine", budget)], trees[("other", budget)]
            same = sorted(zip(a.parents, a.tokens)) == sorted(zip(b.parents, b.tokens)) and len(a) == len(b)
            print(f"budget {budget}: the engine's and the other build's trees {'equal' if same else 'DIFFER'} ({len(a)} nodes)")
        for name in builders:
            print(f"budget {budget:>3} {name:>20}: {1e3 * statistics.median(times[(name, budget)]):8.1f} ms")


if __name__ == "__main__":
    main()
