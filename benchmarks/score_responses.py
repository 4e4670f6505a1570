"""Val τ_sim on the evaluation's own answers: is the train stage's metric calibrated, or are its rows the gap?

The train stage scores a drafter on val rows of the training mixture (simulated chain acceptance, teacher-forced:
`train.loop.evaluate`); the evaluate stage decodes other prompts. This script scores the same exported drafter with
the same function on the answers the evaluate stage served: for each set, every T = 0 evaluation prompt (every turn)
with AR's own answer (the target's greedy text, which every lossless method reproduces), the target's features
computed over prompt + answer as extract computes them, anchors on every answer position. Beside each set it puts
the engine's chain τ on the same prompts (the evaluate record) and the train stage's val τ_sim; gap = engine chain τ ÷
the score − 1 (docs/benchmarks.md's calibration convention).

If τ_sim on the served answers matches the engine's chain τ, the metric is calibrated and any gap between val τ_sim
and the engine is the difference between the val rows and the evaluation prompts.

    python benchmarks/score_responses.py --results results --exp default --drafter dflash_aw_b4
    python benchmarks/score_responses.py --results results --draft-vocabs 8192,16384,0   # the same weights over wider
                                                                                         # draft vocabularies (0: all)
With `--draft-vocabs` a drafter with a draft vocabulary is also scored over D other tokens: its head is the target's
frozen LM-head rows, so the same trained weights draft from the D most frequent supervised tokens of the train split
(chosen as the train stage chooses them) or, with 0, from the whole vocabulary.
Writes $OUT/score_responses.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge import chat  # noqa: E402
from draftforge.config import compose  # noqa: E402
from draftforge.drafter.export import load_drafter  # noqa: E402
from draftforge.drafter.vocab import choose_draft_vocab  # noqa: E402
from draftforge.evaluate.prompts import eval_and_calibration_sets  # noqa: E402
from draftforge.evaluate.runner import answer_message, split_turns, with_answers  # noqa: E402
from draftforge.target.load import load_target_model, load_tokenizer  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.features import open_features  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.loop import TrainInputs, evaluate  # noqa: E402
from draftforge.train.online import OnlineTarget  # noqa: E402


def served_items(responses: list[dict], prompts: list, tok, mode, target: OnlineTarget) -> list[tuple[torch.Tensor, ...]]:
    """AR's T = 0 evaluation answers → one (ids, loss mask on the answer, taps, last layer) item per turn, the
    conversation rebuilt as the evaluate stage built it (each later turn after AR's own earlier answers)."""
    ar = [r for r in responses if r["method"] == "ar" and r["temperature"] == 0.0 and r["split"] == "eval"
          and r["repeat"] == 0]  # fmt: skip
    by_prompt: dict[int, dict[int, list[int]]] = {}
    for r in ar:
        by_prompt.setdefault(int(r["prompt_index"]), {})[int(r["turn"])] = [int(t) for t in r["tokens"]]
    items = []
    for index, answers in sorted(by_prompt.items()):
        earlier: list[dict[str, str]] = []
        for turn, conv in enumerate(split_turns(prompts[index])):
            if turn not in answers:
                break
            prompt = chat.prompt_ids(tok, with_answers(conv, earlier) if turn else conv, mode)
            ids = np.asarray(prompt + answers[turn], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[len(prompt):] = 1  # the answer's tokens are the labels, as curate masks a regenerated turn
            taps, last = target.features(ids)
            items.append((torch.from_numpy(ids), torch.from_numpy(mask), taps, last))
            earlier.append(answer_message(tok, answers[turn]))  # as the evaluate stage continues a conversation
    return items


def over_vocab(model: torch.nn.Module, size: int, counts: torch.Tensor, lm_head: torch.Tensor) -> torch.nn.Module:
    """`model`'s trained weights drafting from the `size` most frequent of the train split's supervised tokens
    (`counts`, as the train stage chooses them; 0: the whole vocabulary); `model` itself at its own size."""
    if size == model.cfg.draft_vocab_size:
        return model
    other = type(model)(replace(model.cfg, draft_vocab_size=size))
    other.load_state_dict({k: v for k, v in model.state_dict().items() if k not in ("draft_ids", "draft_head")},
                          strict=False)  # fmt: skip
    if size:
        other.set_draft_vocab(choose_draft_vocab(counts, size), lm_head)
    return other.eval()


def coverage(model: torch.nn.Module, items: list[tuple[torch.Tensor, ...]]) -> float:
    """The share of the served answers' tokens (the masked labels) the drafter can draft (1.0: the whole vocabulary)."""
    labels = torch.cat([ids[mask.bool()] for ids, mask, *_ in items])
    if not model.cfg.draft_vocab_size:
        return 1.0
    return float(torch.isin(labels, model.draft_ids.to(labels.device)).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    p.add_argument("--exp", default="default")
    p.add_argument("--drafter", default="dflash_aw_b4", help="the branch (results/<exp>/{train,evaluate}/<drafter>/)")
    p.add_argument("--anchors", type=int, default=1024, help="anchors per answer (default: every answer position)")
    p.add_argument("--draft-vocabs", default="", help="comma-separated draft vocabulary sizes to score the same weights "
                                                      "over (0: the whole vocabulary); default: the drafter's own")
    args = p.parse_args()
    exp = args.results / args.exp
    info = json.loads((exp / "target" / "target.json").read_text())
    cfg = compose(args.exp, [f"results_root={args.results}", f"drafter={args.drafter}"])
    model = load_drafter(exp / "train" / args.drafter / "drafter", dtype=torch.float32)
    hf = load_target_model(info, dtype=torch.float32)
    hf.set_attn_implementation("eager")  # as extract computes features on a CPU
    target = OnlineTarget(hf, list(info["drafter"]["target_layer_ids"]), torch.device("cpu"), torch.float32, last=True)
    tok, mode = load_tokenizer(info), chat.ChatMode.of(cfg)
    head = FrozenTargetHead.from_target(info["hf_path"], dtype=torch.float32)
    tcfg = replace(TrainConfig(), val_max_seqs=1_000_000, val_num_anchors=args.anchors, max_seq_len=4096)
    sets, _ = eval_and_calibration_sets(cfg.evaluate)
    train_metrics = json.loads((exp / "train" / args.drafter / "metrics.json").read_text())
    val_tau = float(train_metrics["best"]["val_sim_tau"])
    record = json.loads((exp / "evaluate" / args.drafter / "evaluate.json").read_text())
    own = model.cfg.draft_vocab_size
    sizes = [int(x) for x in args.draft_vocabs.split(",")] if args.draft_vocabs else [own]
    if sizes != [own] and not own:
        p.error(f"--draft-vocabs: {args.drafter} drafts from the whole vocabulary already")
    lm_head = hf.lm_head.weight.detach().float()
    counts = open_features(exp / "extract", info)[0].label_counts(model.cfg.vocab_size) if sizes != [own] else None
    if counts is not None:
        print(f"train split: {int(counts.sum())} supervised tokens of {int((counts > 0).sum())} distinct ids")
    served = {dataset: served_items(json.loads((exp / "evaluate" / args.drafter / f"{dataset}.json").read_text())["responses"],
                                    prompts, tok, mode, target) for dataset, prompts in sets.items()}  # fmt: skip
    rows: list[dict] = []
    for size in sizes:
        scored = over_vocab(model, size, counts, lm_head)
        for dataset, items in served.items():
            inp = TrainInputs(cfg=tcfg, dcfg=scored.cfg, train_source=items, val_source=items, head=head,
                              ckpt_dir=Path("."), resume_key="", acceptance_weighting=bool(cfg.drafter.acceptance_weighting))
            m = evaluate(scored, inp, torch.float32)
            chain = next(r for r in record["rows"] if r["dataset"] == dataset and r["method"] in ("dflash", "dspark")
                         and r["engine"] == "draftforge" and r["temperature"] == 0.0)  # fmt: skip
            rows.append({"dataset": dataset, "draft_vocab": size, "coverage": coverage(scored, items),
                         "answers": len(items), "blocks": int(m["val_blocks"]),
                         "engine_chain_tau": chain["tau"], "served_sim_tau": m["val_sim_tau"],
                         "served_analytic_tau": m.get("val_analytic_tau"), "val_sim_tau": val_tau,
                         "gap_served": chain["tau"] / m["val_sim_tau"] - 1, "gap_val": chain["tau"] / val_tau - 1})
    print(f"{args.drafter}: val τ_sim {val_tau:.3f} (train stage, val rows of the mixture)")
    print("| set | draft vocabulary (answer tokens in it) | answers | blocks | engine chain τ | τ_sim on the served answers "
          "| gap | val τ_sim's gap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['draft_vocab'] or 'whole'} ({100 * r['coverage']:.1f}%) | {r['answers']} | {r['blocks']} | "
              f"{r['engine_chain_tau']:.3f} | "
              f"{r['served_sim_tau']:.3f} | {100 * r['gap_served']:+.1f}% | {100 * r['gap_val']:+.1f}% |")
    write_record("score_responses", {"results": str(exp), "drafter": args.drafter, "val_sim_tau": val_tau, "rows": rows})


if __name__ == "__main__":
    main()
