"""The T > 0 lossless check on a finished experiment's real target and drafter, with its negative control.

Runs the evaluate stage's own runner (evaluate/runner.run_dataset with PIT values, evaluate/sampling_check) at
one temperature on one prompt set, and again with the verify forward sampling at `--control-scale` × T (a bug
of the kind the check exists for: the prompt's first token and AR stay right). Prints one line per
(run, method): tokens, accepted drafts, χ² p, TV to uniform, the TV detectable at power 0.8. The control must
fail where the tokens it tests come from drafted rounds; the clean run must pass.

    python benchmarks/sampling_check.py --exp-dir results/smoke [--drafter dflash] [--dataset mt_bench]
        [--prompts 8] [--max-new 64] [--temperature 1.0] [--budget 8] [--control-scale 0.8]
Writes $OUT/sampling_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _out import write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.chat import ChatMode  # noqa: E402
from draftforge.drafter import load_drafter  # noqa: E402
from draftforge.engine import loops, wrap_target  # noqa: E402
from draftforge.evaluate.config import EvaluateConfig  # noqa: E402
from draftforge.evaluate.prompts import eval_and_calibration_sets  # noqa: E402
from draftforge.evaluate.runner import EngineSet, run_dataset  # noqa: E402
from draftforge.evaluate.sampling_check import pooled_checks  # noqa: E402
from draftforge.target.load import load_target_model, load_tokenizer  # noqa: E402


def run(es: EngineSet, plan, dataset: str, prompts, temperature: float, seed: int, bins: int, alpha: float):
    started = time.monotonic()
    records = run_dataset(es, plan, dataset, prompts, temperature, seed, warmup=0, show=False, pit=True)
    return pooled_checks(records, bins, alpha), time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exp-dir", type=Path, required=True, help="results/<experiment> of a run that finished train")
    p.add_argument("--drafter", default="dflash", help="the drafter branch (train/<drafter>/drafter)")
    p.add_argument("--dataset", default="mt_bench")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=8, help="the DDTree budget")
    p.add_argument("--control-scale", type=float, default=0.8, help="the control's verify samples at this x T")
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    info = json.loads((args.exp_dir / "target" / "target.json").read_text())
    drafter_dir = args.exp_dir / "train" / args.drafter / "drafter"
    drafter = load_drafter(drafter_dir, dtype=torch.float32, device="cpu", attn_impl="sdpa")
    tm = wrap_target(load_target_model(info, dtype=torch.float32, device="cpu"), list(drafter.cfg.target_layer_ids))
    mode = ChatMode.record_of(json.loads((args.exp_dir / "train" / args.drafter / "metrics.json").read_text()))  # as trained
    es = EngineSet(tm=tm, drafter=drafter, tokenizer=load_tokenizer(info), max_new_tokens=args.max_new,
                   eos_ids=[int(e) for e in info.get("eos_token_ids") or []], chat_mode=mode)  # fmt: skip
    sets, _ = eval_and_calibration_sets(EvaluateConfig(datasets=[args.dataset], num_prompts=args.prompts, calibration_prompts=0))
    prompts = list(enumerate(sets[args.dataset]))
    plan = [("ar", None), ("dflash", None), ("ddtree", args.budget)]
    out = {"exp_dir": str(args.exp_dir), "drafter": args.drafter, "dataset": args.dataset, "prompts": len(prompts),
           "max_new_tokens": args.max_new, "temperature": args.temperature, "budget": args.budget,
           "control_scale": args.control_scale, "runs": {}}  # fmt: skip
    clean, seconds = run(es, plan, args.dataset, prompts, args.temperature, args.seed, args.bins, args.alpha)
    out["runs"]["clean"] = {"checks": clean, "seconds": seconds}
    real = loops.verify_round

    def control(tm, state, method, drafted, bonus, temperature, gen, timer, engine=None):
        return real(tm, state, method, drafted, bonus, args.control_scale * temperature, gen, timer, engine)

    loops.verify_round = control
    try:
        broken, seconds = run(es, plan[1:], args.dataset, prompts, args.temperature, args.seed, args.bins, args.alpha)
    finally:
        loops.verify_round = real
    out["runs"]["control"] = {"checks": broken, "seconds": seconds}
    print(f"{args.dataset}: {len(prompts)} prompts x {args.max_new} new tokens at T = {args.temperature:g}; "
          f"control: verify at {args.control_scale:g} x T")
    print(f"{'run':8} {'method':8} {'tokens':>6} {'drafts':>6} {'chi2 p':>9} {'TV':>6} {'TV det.':>7} verdict")
    for name, r in out["runs"].items():
        for c in r["checks"]:
            verdict = {True: "passed", False: "FAILED", None: "too few"}[c["passed"]]
            print(f"{name:8} {c['method']:8} {c['n']:6d} {c['accepted_drafts']:6d} {c['p_value'] or float('nan'):9.3g} "
                  f"{c['tv'] or float('nan'):6.3f} {c['detectable_tv']:7.3f} {verdict}")
    write_record("sampling_check", out)


if __name__ == "__main__":
    main()
