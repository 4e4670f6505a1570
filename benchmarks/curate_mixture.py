"""How many conversations an experiment's curate mixture yields before regeneration (no model needed).

Runs the curate stage's own selection (sources → filters → decontamination against every evaluation
set → exact/near dedup → mixture quotas → split) for `experiment=NAME` and prints per source: rows in,
kept, drops by reason, and the selection rate. The prompt-token filter needs the target's tokenizer;
without `--tokenizer DIR` it is skipped (the character filter still applies), so the kept count is an
upper bound by the few prompts over curate.filters.max_prompt_tokens.

    PYTHONPATH=src python benchmarks/curate_mixture.py --experiment gpu [--no-quota] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from _out import write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.config import compose  # noqa: E402
from draftforge.curate.decontam import Decontaminator  # noqa: E402
from draftforge.curate.select import select_rows  # noqa: E402
from draftforge.curate.sources import iter_source  # noqa: E402
from draftforge.curate.stage import curate_config, load_eval_sets  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default="gpu")
    ap.add_argument("--no-quota", action="store_true", help="read every source whole (what each can give)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder of the target (prompt-token filter)")
    ap.add_argument("override", nargs="*")
    args = ap.parse_args()
    cfg = compose(args.experiment, args.override)
    ccfg = curate_config(cfg)
    if args.no_quota:
        ccfg.max_rows = None
    t0 = time.perf_counter()
    eval_sets = load_eval_sets(cfg, ccfg)
    decon = Decontaminator(eval_sets, ngram=ccfg.decontam.ngram, threshold=ccfg.decontam.threshold,
                           min_shared_ngrams=ccfg.decontam.min_shared_ngrams)  # fmt: skip
    count_tokens = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        from draftforge.chat import ChatMode, prompt_ids

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        mode = ChatMode.of(cfg)  # the target's chat mode, as the curate stage counts prompt tokens
        count_tokens = lambda msgs: len(prompt_ids(tok, msgs, mode))  # noqa: E731
    kept = Counter()
    sel = select_rows(ccfg, lambda s: iter_source(s, min_chars=ccfg.filters.min_chars, on_malformed=ccfg.filters.on_malformed,
                                                  eval_cfg=cfg.get("evaluate")),
                      decon, lambda rec: kept.update([rec["source"]]), count_tokens=count_tokens)  # fmt: skip
    seconds = time.perf_counter() - t0
    per = {k: v.to_dict() for k, v in sel.per_source.items()}
    print(f"{'source':16s} {'in':>8s} {'kept':>8s}  drops")
    for name, st in per.items():
        print(f"{name:16s} {st['in']:8d} {kept[name]:8d}  {dict(st['dropped'])}")
    print(f"total kept {sel.n_rows} (splits {dict(sel.splits)}) in {seconds:.0f} s = {sum(s['in'] for s in per.values()) / seconds:.0f} rows/s; "
          f"decontamination {sel.decontam}")  # fmt: skip
    write_record("curate_mixture", {"experiment": args.experiment, "no_quota": args.no_quota, "kept": sel.n_rows,
                                    "per_source": per, "splits": dict(sel.splits), "decontamination": sel.decontam,
                                    "seconds": seconds, "token_filter": bool(args.tokenizer)})  # fmt: skip


if __name__ == "__main__":
    main()
