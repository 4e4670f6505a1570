"""Regenerate a curate output's answers with a longer budget, for the "whole answers" recipe comparison.

Curate regenerates each row's last assistant turn with the target (greedy) up to
`curate.regenerate.max_new_tokens` (64 on the default world, where most answers are cut). This script keeps each
row's prompt tokens (everything before its first supervised token) and greedily regenerates the answer with the
converted target through curate's own `hf` backend (draftforge.curate.regenerate.HFBackend) on one device, up to
--max-new tokens, ending at the chat's end-of-turn tokens as curate does. It writes train-/val-00000.parquet in curate's row format (input_ids, loss_mask: 1 on the
answer and its end-of-turn token), which `benchmarks/train_curve.py --curate` reads. It is a measurement tool:
the pipeline's way to get longer answers is `curate.regenerate.max_new_tokens`.

    python benchmarks/regen_answers.py --curate results/default/curate --hf-dir <converted target> \
        --out /tmp/long --max-new 384
Prints the share of answers still cut at --max-new and how many regenerated answers start with the stored one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def prompt_len(mask: list[int]) -> int:
    """Tokens before the first supervised one (the prompt, up to and including the assistant header)."""
    return mask.index(1) if 1 in mask else len(mask)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--curate", type=Path, required=True)
    p.add_argument("--hf-dir", type=Path, required=True, help="the converted target folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new", type=int, default=384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-rows", type=int, default=0, help="first N rows of each split (0 = all; a smoke check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftforge.curate.config import RegenerateConfig
    from draftforge.curate.regenerate import HFBackend
    from draftforge.curate.tokenize import end_of_turn_ids

    device = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")  # the end-of-turn token a finished answer is stored with
    newline = tok.encode("\n", add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).to(device).eval()
    backend = HFBackend(model, tok, RegenerateConfig(backend="hf", max_new_tokens=args.max_new, batch_size=args.batch),
                        end_of_turn_ids(tok, [eos_id]))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for split in ("train", "val"):
        table = pa.concat_tables([pq.read_table(f) for f in sorted(args.curate.glob(f"{split}-*.parquet"))])
        if args.max_rows:
            table = table.slice(0, args.max_rows)
        rows = table.to_pydict()
        cuts = [prompt_len(m) for m in rows["loss_mask"]]
        prompts = [ids[:c] for ids, c in zip(rows["input_ids"], cuts)]
        t0 = time.perf_counter()
        gens = backend.generate(prompts, [0] * len(prompts))  # greedy: the seeds are unused
        answers = [g.token_ids + ([eos_id] if g.finished else []) for g in gens]
        seconds = time.perf_counter() - t0
        stored = [ids[c:] for ids, c in zip(rows["input_ids"], cuts)]
        same_start = sum(a[: min(len(a), len(s), 64)] == s[: min(len(a), len(s), 64)] for a, s in zip(answers, stored))
        cut = sum(not a or a[-1] != eos_id for a in answers)
        rows["input_ids"] = [pr + a + (newline if a and a[-1] == eos_id else []) for pr, a in zip(prompts, answers)]
        rows["loss_mask"] = [[0] * len(pr) + [1] * len(a) + [0] * (len(ids) - len(pr) - len(a))
                             for pr, a, ids in zip(prompts, answers, rows["input_ids"])]
        rows["n_tokens"] = [len(ids) for ids in rows["input_ids"]]
        pq.write_table(pa.table({k: rows[k] for k in table.schema.names}), args.out / f"{split}-00000.parquet")
        summary[split] = {"rows": len(answers), "cut_at_max_new": cut, "cut_share": cut / max(1, len(answers)),
                          "answer_tokens": sum(map(len, answers)), "same_first_64": same_start, "seconds": seconds}
        print(f"{split}: {json.dumps(summary[split])}", flush=True)
    (args.out / "regen_summary.json").write_text(json.dumps({"max_new": args.max_new, **summary}, indent=2))


if __name__ == "__main__":
    main()
