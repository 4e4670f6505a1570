"""A/B of one training step of a listed drafter on a finished run's real features: the target-normaliser cache
(train/lse_cache.py) on against off, in one process, on the same batches; with `--whole-vocab`, a third arm drafts
over the target's whole vocabulary (`drafter.draft_vocab_size=0`, the step before the draft vocabulary and the cache).

The stage's own branch builder (`train.stage.block_branch`) builds two BlockTasks from `results/<exp>/extract`; one
has its cache removed. The cache is first filled for every train sequence (what the first epoch pays, timed apart);
then both tasks take the same `--steps` batches of a later epoch, alternating in groups of `--group` steps, each step
forward + backward + AdamW. Prints ms/step (min and median of the groups' means) and their ratio.

    PYTHONPATH=src python benchmarks/train_step_ab.py --results results --drafter dflash_aw_b4 \
        [--steps 120 --group 10]
    # a DSpark drafter over 8,192 rows against its whole vocabulary (every arm takes the --set overrides first)
    PYTHONPATH=src python benchmarks/train_step_ab.py --results results --drafter dspark \
        --set drafter.draft_vocab_size=8192 --whole-vocab
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(results: str, drafter: str, experiment: str, *overrides: str):
    from draftforge.cli import make_context
    from draftforge.target.load import read_target_info
    from draftforge.train.stage import block_branch, train_config

    ctx = make_context("train", [f"experiment={experiment}", f"results_root={results}", f"drafter={drafter}",
                                 "tracking.enabled=false", *overrides])  # fmt: skip
    cfg = train_config(ctx)
    info = read_target_info(ctx.input_marker("target"))
    return block_branch(ctx, cfg, info, lambda _p: 1 << 40)


def step(task, opt, seqs: list[int], step_index: int, epoch: int) -> float:
    t0 = time.perf_counter()
    pending = task.forward(task.batch(seqs, step_index, epoch))
    task.backward(pending, pending.sums)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--drafter", default="dflash_aw_b4")
    ap.add_argument("--experiment", default="default")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--group", type=int, default=10)
    ap.add_argument("--whole-vocab", action="store_true", help="a third arm: the whole vocabulary, no cache")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every arm (repeatable), e.g. drafter.draft_vocab_size=8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    cached, plain = (build(args.results, args.drafter, args.experiment, *args.set).task for _ in range(2))
    if cached.lse_cache is None:
        raise SystemExit(f"drafter {args.drafter}: no target-normaliser cache (needs a draft vocabulary and a distribution objective)")
    plain.lse_cache = None
    n = cached.n_train
    dtype = next(cached.model.parameters()).dtype
    t0 = time.perf_counter()
    for i in range(n):
        cached.lse_cache.rows[i] = cached.lse_cache.compute(i, dtype)
    fill = time.perf_counter() - t0
    print(f"cache fill (the first epoch's share): {n} sequences, {cached.lse_cache.computed} positions in {fill:.1f} s "
          f"({1e6 * fill / max(1, cached.lse_cache.computed):.0f} µs a position)")
    arms = {"cache": cached, "no cache": plain}
    if args.whole_vocab:
        arms["whole vocab"] = build(args.results, args.drafter, args.experiment, *args.set, "drafter.draft_vocab_size=0").task
    opts = {name: torch.optim.AdamW(t.model.parameters(), lr=1e-3) for name, t in arms.items()}
    bs = cached.inp.cfg.batch_seqs
    for name, t in arms.items():  # warm-up
        step(t, opts[name], list(range(bs)), 0, 1)
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for g in range(0, args.steps, args.group):
        turn = (g // args.group) % len(names)
        for name in names[turn:] + names[:turn]:  # each arm goes first in turn
            dt = [step(arms[name], opts[name], [(g + k) * bs % n + j for j in range(bs)], g + k, 1) for k in range(args.group)]
            times[name].append(sum(dt) / len(dt))
    print(f"{'':12} {'min ms/step':>12} {'median':>8}   ({args.steps} steps each, groups of {args.group}, in turn)")
    for name, v in times.items():
        print(f"{name:12} {1e3 * min(v):12.1f} {1e3 * statistics.median(v):8.1f}")
    for name in names[1:]:
        print(f"{name} ÷ cache: min {min(times[name]) / min(times['cache']):.3f}, "
              f"median {statistics.median(times[name]) / statistics.median(times['cache']):.3f}")


if __name__ == "__main__":
    main()
