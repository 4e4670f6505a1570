"""DDTree vs AR decode tokens/s on the real default-world target (CPU), measured in one run.

Needs a finished `target` and `train` stage: results/<exp>/target/target.json and
results/<exp>/train/<drafter>/drafter/. Runs the methods (AR, DFlash and DDTree by default; each tree method at
each budget) interleaved on the same prompts of one eval set (T = 0), checks losslessness, prints tokens/s, τ,
tok/s ÷ AR tok/s and the speedup (mean TPOT ratio, the evaluate stage's).

    python benchmarks/engine_cpu.py --experiment default --dataset humaneval --prompts 3 --budgets 16,32,64
    python benchmarks/engine_cpu.py --results-root <run>/results --drafter dflash_aw_b4 --dataset mt_bench \
        --prompts 6 --max-new-tokens 64 --methods ar,ddtree,ddtree_lookup --budgets 3,4,8
With --compare-layer-ops the same plan runs again with the layers' norms, SwiGLU and rotary on torch's ops
(`engine/layer_ops.py` off), the two ways alternating --turns times on the same engines; each method keeps its fastest
turn per way. Writes $OUT/engine_cpu.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from draftforge.chat import ChatMode  # noqa: E402
from draftforge.config import compose  # noqa: E402
from draftforge.drafter import load_drafter  # noqa: E402
from draftforge.engine import layer_ops, wrap_target  # noqa: E402
from draftforge.evaluate.aggregate import aggregate  # noqa: E402
from draftforge.evaluate.prompts import eval_prompt_sets  # noqa: E402
from draftforge.evaluate.runner import EngineSet, method_plan, run_dataset  # noqa: E402
from draftforge.paths import stage_dir, stage_marker  # noqa: E402
from draftforge.target.load import load_target_model, load_tokenizer, read_target_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="default")
    ap.add_argument("--results-root", default="")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--drafter", default="dflash", help="the train stage's drafter folder")
    ap.add_argument("--methods", default="ar,dflash,ddtree")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--compare-layer-ops", action="store_true",
                    help="also run the plan with the layers' element-wise work on torch's ops, alternating")
    ap.add_argument("--turns", type=int, default=1, help="with --compare-layer-ops: alternations of the two ways")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = [f"results_root={args.results_root}"] if args.results_root else []
    cfg = compose(args.experiment, overrides)
    root, exp = cfg.results_root, cfg.experiment_name
    info = read_target_info(stage_marker(root, exp, "target"))
    drafter = load_drafter(stage_dir(root, exp, "train", args.drafter) / "drafter", dtype=torch.float32, attn_impl="sdpa")
    tm = wrap_target(load_target_model(info), drafter.cfg.target_layer_ids)
    es = EngineSet(tm, drafter, load_tokenizer(info), [int(e) for e in info.get("eos_token_ids") or []], args.max_new_tokens,
                   chat_mode=ChatMode.of(cfg))
    plan = method_plan(args.methods.split(","), [int(b) for b in args.budgets.split(",")])
    ev = cfg.evaluate
    ev.datasets = [args.dataset]
    prompts = eval_prompt_sets(ev, limit=args.prompts)[args.dataset]
    ways = {"layer ops": True} | ({"torch ops": False} if args.compare_layer_ops else {})
    best: dict[str, dict[tuple[str, object], dict]] = {w: {} for w in ways}
    for _ in range(args.turns if args.compare_layer_ops else 1):
        for way, enabled in ways.items():
            layer_ops.ENABLED = enabled
            for r in aggregate(run_dataset(es, plan, args.dataset, list(enumerate(prompts)), 0.0, 0, warmup=1)):
                key = (r["method"], r["budget"])
                if key not in best[way] or r["tokens_per_s"] > best[way][key]["tokens_per_s"]:
                    best[way][key] = r
    layer_ops.ENABLED = True
    out = {}
    for way, by_key in best.items():
        rows = list(by_key.values())
        ar = next(r for r in rows if r["method"] == "ar")
        print(f"\n{info['name']} on CPU ({torch.get_num_threads()} threads), {args.dataset}, {len(prompts)} prompts, "
              f"{args.max_new_tokens} new tokens, T=0" + (f", {way}" if len(ways) > 1 else ""))
        print(f"{'method':14} {'budget':>6} {'tok/s':>7} {'÷ AR':>6} {'speedup':>7} {'tau':>5} {'round ms':>9} "
              f"{'ovh %':>6} {'mismatch':>8}")
        for r in rows:
            ratio = r["tokens_per_s"] / ar["tokens_per_s"]
            r["tokens_per_s_over_ar"] = ratio
            print(f"{r['method']:14} {str(r['budget'] or ''):>6} {r['tokens_per_s']:7.1f} {ratio:6.2f} "
                  f"{r['speedup_vs_ar']:7.2f} {r['tau']:5.2f} {(r['round_ms'] or 0):9.1f} {(r['overhead_pct'] or 0):6.1f} "
                  f"{r['lossless_mismatches']:>8}")
        out[way] = rows
    write_record("engine_cpu", {"target": info["name"], "dataset": args.dataset, "turns": args.turns,
                                "rows": out["layer ops"], **({"torch_ops_rows": out["torch ops"]} if len(ways) > 1 else {})})

if __name__ == "__main__":
    main()
