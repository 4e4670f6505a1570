"""Score an exported drafter on an experiment's val split: loss, per-slot accuracy, simulated τ.

The train stage's own val metric (draftforge.train.loop.evaluate) on as many val sequences as asked,
spread evenly over the split, so a finished run can be re-scored on the whole split without retraining.

    python benchmarks/score_drafter.py --exp default [--val-seqs 64] [--anchors 32] [--dtype bfloat16] [--block 4]

--block B scores the same weights drafting a shorter block (the first B − 1 draft slots, the later mask slots
removed from the block's attention): whether a drafter trained on 16 slots keeps its first slots' accuracy when a
decode needs only a few of them (a DDTree of budget b reaches depth b at most).
Writes $OUT/score_drafter.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from _out import write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.drafter.export import load_drafter  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.features import open_features  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.loop import TrainInputs, evaluate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exp", default="default")
    p.add_argument("--drafter", default="dflash", help="the drafter branch (results/<exp>/train/<drafter>/)")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    p.add_argument("--val-seqs", type=int, default=1_000_000, help="val sequences scored (default: all)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per val sequence")
    p.add_argument("--dtype", default="bfloat16", help="autocast dtype of the scoring forward")
    p.add_argument("--block", type=int, default=0, help="draft this block size with the same weights (0: as trained)")
    args = p.parse_args()
    exp = args.results / args.exp
    info = json.loads((exp / "target" / "target.json").read_text())
    dtype = getattr(torch, args.dtype)
    _, val = open_features(exp / "extract", info, dtype=torch.float32)
    if val is None:
        raise SystemExit(f"{exp / 'extract'}: no val split")
    model = load_drafter(exp / "train" / args.drafter / "drafter", dtype=torch.float32)
    if args.block:
        if not 2 <= args.block <= model.cfg.block_size:
            raise SystemExit(f"--block {args.block}: use 2 … the trained block size {model.cfg.block_size}")
        model.cfg.block_size = args.block  # the model and the scorer read the block size from here
    dcfg = model.cfg
    head = FrozenTargetHead.from_target(info["hf_path"], dtype=dtype)
    cfg = replace(TrainConfig(), val_max_seqs=args.val_seqs, val_num_anchors=args.anchors, max_seq_len=1024)
    inp = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=val, val_source=val, head=head, ckpt_dir=Path("."), resume_key="")
    metrics = evaluate(model, inp, dtype)
    n = min(len(val), args.val_seqs)
    slots = " ".join(f"{metrics[f'val_acc_slot_{k}']:.3f}" for k in range(1, dcfg.block_size))
    print(f"{args.exp}: {n} of {len(val)} val seqs x {args.anchors} anchors ({int(metrics['val_blocks'])} blocks): "
          f"loss {metrics['val_loss']:.3f} acc {metrics['val_acc']:.3f} sim τ {metrics['val_sim_tau']:.3f}")  # fmt: skip
    print(f"per-slot top-1 accuracy (slots 1..{dcfg.block_size - 1}): {slots}")
    write_record("score_drafter", {"experiment": args.exp, "drafter": args.drafter, "block_size": dcfg.block_size,
                                   "n_val_seqs": n, "anchors": args.anchors, **metrics})


if __name__ == "__main__":
    main()
