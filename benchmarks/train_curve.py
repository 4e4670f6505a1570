"""What limits the default world's drafter: val simulated τ vs training steps, data size and init.

Runs the pipeline's own pieces in memory on one device — the GGUF target conversion
(draftforge.target.gguf.convert_gguf), tapped-feature capture (draftforge.extract.capture.TapCapture,
fp32 forward, features kept in bf16 as the extract stage stores them) and the training loop
(draftforge.train.loop.train, cold or warm init, the same loss / schedule / val metrics) — over the
curate output of `experiment=default`, for a list of settings, and prints one table of val curves.

A setting is `key=value,...` over: steps, batch (sequences per step), anchors, lr, frac (fraction of
the train split used), init (cold|target), warmup (ratio), eval (every N steps), and the objective:
ce, tv (loss term weights; tv > 0 is the distribution objective of docs/architecture.md) and aw (1 =
acceptance weighting); vocab (> 0: a draft vocabulary of that many tokens, docs/architecture.md "Draft vocabulary",
chosen from the setting's train rows as the train stage does); replay (the fraction of steps after which on-policy
replay starts, 0 = off, docs/architecture.md "On-policy replay"), replay_share (the share of a walked row's anchors
drawn from its rejection positions) and replay_rows (rows walked, spread over the setting's train rows). Defaults are the default experiment's CPU settings (120 steps, 4 x 32 anchors,
lr 3e-3, cold, plain CE). The target's last-layer states are captured when any setting needs them.

    python benchmarks/train_curve.py --curate results/default/curate --target-json results/default/target/target.json \
        --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf  "steps=120" "steps=3000,batch=16,anchors=64"
Writes $OUT/train_curve.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from _out import write_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.drafter.config import DFlashConfig
from draftforge.extract.capture import TapCapture
from draftforge.train.config import TrainConfig
from draftforge.train.data import InMemorySource
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs, draft_vocab_for, train

# The default experiment's train settings (conf/experiment/default.yaml) that a setting may change.
BASE = {
    "steps": 120,
    "batch": 4,
    "anchors": 32,
    "lr": 3e-3,
    "frac": 1.0,
    "init": "cold",
    "warmup": 0.04,
    "eval": 40,
    "ce": 1.0,
    "tv": 0.0,
    "aw": 0,
    "vocab": 0,
    "replay": 0.0,
    "replay_share": 0.5,
    "replay_rows": 256,
}


def parse_setting(text: str) -> dict[str, Any]:
    out = dict(BASE)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in BASE:
            raise SystemExit(
                f"setting {text!r}: unknown key {key!r} (known: {', '.join(BASE)})"
            )
        out[key] = type(BASE[key])(value)
    if out["init"] not in ("cold", "target"):
        raise SystemExit(f"setting {text!r}: init must be cold or target")
    if out["aw"] not in (0, 1) or out["ce"] < 0 or out["tv"] < 0 or out["ce"] + out["tv"] <= 0:
        raise SystemExit(f"setting {text!r}: aw must be 0 or 1, ce and tv >= 0 with a positive sum")
    if not (0 <= out["replay"] < 1 and 0 <= out["replay_share"] <= 1):
        raise SystemExit(f"setting {text!r}: replay must be in [0, 1) (0 = off), replay_share in [0, 1]")
    return out


def loss_weights(s: dict[str, Any]) -> dict[str, float] | None:
    """The objective's term weights (None = plain CE, the stage's DFlash default)."""
    if s["tv"] == 0 and s["ce"] == 1.0:
        return None
    return {k: float(s[k]) for k in ("ce", "tv") if s[k] > 0}


def read_split(curate_dir: Path, split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(input_ids (T,) int64, loss_mask (T,) uint8)] of one curate split, in file order."""
    rows = []
    for path in sorted(curate_dir.glob(f"{split}-*.parquet")):
        table = pq.read_table(path, columns=["input_ids", "loss_mask"]).to_pydict()
        rows += [(torch.tensor(i, dtype=torch.int64), torch.tensor(m, dtype=torch.uint8))
                 for i, m in zip(table["input_ids"], table["loss_mask"])]  # fmt: skip
    if not rows:
        raise SystemExit(f"{curate_dir}: no {split}-*.parquet rows")
    return rows


def capture_features(
    hf_dir: Path, layer_ids: list[int], rows, device: torch.device, with_last: bool = False
) -> list[tuple]:
    """Per row (ids, mask, hidden (T, n_taps·H)[, last (T, H)]) bf16 on the host: one fp32 forward each."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        .to(device)
        .eval()
    )
    cap = TapCapture(model, layer_ids, capture_last=with_last)
    out = []
    for ids, mask in rows:
        x = ids[None].to(device)
        hidden = cap.run(x, torch.ones_like(x))  # (T, n_taps·H)
        item = (ids, mask, hidden.to(torch.bfloat16).cpu())
        out.append(item + (cap.last_out.to(torch.bfloat16).cpu(),) if with_last else item)
    del model
    return out


def run_setting(
    s: dict[str, Any],
    base_cfg: TrainConfig,
    dcfg: DFlashConfig,
    train_items,
    val_items,
    head,
    hf_dir,
    device,
) -> dict[str, Any]:
    n_train = max(s["batch"], int(len(train_items) * s["frac"]))
    cfg = replace(base_cfg, max_steps=s["steps"], batch_seqs=s["batch"], num_anchors=s["anchors"], lr=s["lr"],
                  warmup_ratio=s["warmup"], init_from_target=s["init"] == "target", eval_every=s["eval"],
                  ckpt_every=10**9, log_every=10**9, replay_from=s["replay"], replay_share=s["replay_share"],
                  replay_rows=s["replay_rows"])  # fmt: skip
    dcfg = replace(dcfg, draft_vocab_size=s["vocab"])
    train_source = InMemorySource(train_items[:n_train])
    draft_ids, vocab_coverage = draft_vocab_for(train_source, dcfg)
    with tempfile.TemporaryDirectory() as ckpt:
        inp = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=train_source,
                          val_source=InMemorySource(val_items), head=head, ckpt_dir=Path(ckpt),
                          resume_key=json.dumps(s, sort_keys=True), device=device, target_hf_path=str(hf_dir),
                          loss_weights=loss_weights(s), acceptance_weighting=bool(s["aw"]), draft_ids=draft_ids)  # fmt: skip
        t0 = time.perf_counter()
        result = train(inp)
        wall = time.perf_counter() - t0
    seen = s["steps"] * s["batch"]
    return {
        "setting": s,
        "n_train_seqs": n_train,
        "draft_vocab_coverage": vocab_coverage,
        "epochs": seen / n_train,
        "wall_s": wall,
        "step_s": (result.throughput or {}).get("seconds", wall)
        / max(1.0, (result.throughput or {}).get("steps", s["steps"])),
        "final_train_loss": result.history[-1]["loss"] if result.history else None,
        "curve": [
            {k: e[k] for k in ("step", "val_loss", "val_acc", "val_sim_tau")}
            for e in result.evals
        ],
        "best": result.best,
        # on-policy replay: its step, rows walked, walk τ, rejection positions, walk wall seconds (not in step_s)
        "replay": result.phases[0] if result.phases else None,
    }


def drafter_section(target_name: str):
    """The dflash drafter section the stages compose for this target (its conf/target file's shape)."""
    from omegaconf import OmegaConf

    from draftforge.config import compose

    return OmegaConf.to_object(compose("default", [f"target={target_name}"]).drafter)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--curate", type=Path, required=True, help="results/default/curate")
    p.add_argument(
        "--target-json",
        type=Path,
        required=True,
        help="results/default/target/target.json",
    )
    p.add_argument("--val-curate", type=Path, help="read the val split from this curate output instead (one val set "
                   "for train data of different curate settings)")
    p.add_argument("--gguf", type=Path, help="convert this GGUF (else --hf-dir)")
    p.add_argument("--hf-dir", type=Path, help="an already converted HF folder")
    p.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "draftforge-cache"
    )
    p.add_argument(
        "--val-seqs",
        type=int,
        default=24,
        help="val sequences scored (the default experiment's val_max_seqs)",
    )
    p.add_argument(
        "--max-train",
        type=int,
        default=0,
        help="cap on train rows (0 = all; a CPU smoke check)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("settings", nargs="*", default=["steps=120"])
    args = p.parse_args()
    settings = [parse_setting(t) for t in args.settings]
    device = torch.device(args.device)
    info = json.loads(args.target_json.read_text())
    if args.gguf is not None:
        from draftforge.target.gguf import convert_gguf

        hf_dir = convert_gguf(args.gguf, args.cache, info["name"])
    elif args.hf_dir is not None:
        hf_dir = args.hf_dir
    else:
        raise SystemExit("give --gguf or --hf-dir")
    info = {**info, "hf_path": str(hf_dir)}
    dcfg = DFlashConfig.from_target(info, drafter_section(info["name"]))
    t0 = time.perf_counter()
    train_rows, val_rows = (
        read_split(args.curate, "train"),
        read_split(args.val_curate or args.curate, "val")[: args.val_seqs],
    )
    if args.max_train:
        train_rows = train_rows[: args.max_train]
    layer_ids = list(info["drafter"]["target_layer_ids"])
    from draftforge.train.loop import make_objective

    # the train loop's own rule for whether an objective reads the target's next-token distribution
    objs = [make_objective(TrainConfig(), dcfg, loss_weights(s), bool(s["aw"])) for s in settings]
    with_last = any(o is not None and o.needs_target for o in objs)
    train_items = capture_features(hf_dir, layer_ids, train_rows, device, with_last)
    val_items = capture_features(hf_dir, layer_ids, val_rows, device, with_last)
    extract_s = time.perf_counter() - t0
    n_tok = sum(int(item[0].numel()) for item in train_items)
    print(
        f"features: {len(train_items)} train / {len(val_items)} val seqs, {n_tok} train tokens, {extract_s:.1f} s"
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = FrozenTargetHead.from_target(hf_dir, dtype=dtype, device=device)
    base_cfg = replace(
        TrainConfig(),
        max_seq_len=1024,
        val_max_seqs=args.val_seqs,
        val_num_anchors=32,
        seed=0,
    )
    results = []
    record = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "target": info["name"],
              "curate": str(args.curate), "val_curate": str(args.val_curate or args.curate),
              "n_train_seqs": len(train_items), "n_val_seqs": len(val_items), "train_tokens": n_tok,
              "feature_s": extract_s, "results": results}  # fmt: skip
    for s in settings:
        res = run_setting(
            s, base_cfg, dcfg, train_items, val_items, head, hf_dir, device
        )
        results.append(res)
        best = res["best"] or {}
        curve = " ".join(f"{e['step']}:{e['val_sim_tau']:.3f}" for e in res["curve"])
        rep = res["replay"]
        walk = (f" | replay at {rep['replay_step']:.0f}: {rep['replay_rows']:.0f} rows, walk τ {rep['replay_walk_tau']:.3f}, "
                f"{rep['replay_rejections']:.0f} rejections, {rep['replay_walk_s']:.1f} s") if rep else ""
        print(
            f"{json.dumps(s)} | seqs {res['n_train_seqs']} epochs {res['epochs']:.1f} | {res['step_s'] * 1e3:.0f} ms/step | "
            f"train loss {res['final_train_loss']:.3f} | best val τ {best.get('val_sim_tau', float('nan')):.3f} "
            f"loss {best.get('val_loss', float('nan')):.3f} acc1 {best.get('val_acc_slot_1', float('nan')):.3f} | curve {curve} | "
            f"wall {res['wall_s']:.0f} s{walk}",
            flush=True,
        )
        write_record(
            "train_curve", record
        )  # after every setting: a killed run keeps what finished
    print(
        f"\n{'steps':>6} {'batch':>5} {'anch':>5} {'lr':>7} {'frac':>5} {'init':>6} {'ce':>4} {'tv':>4} {'aw':>2} {'rep':>4} {'epochs':>6} {'trainL':>7} {'valL':>6} {'acc1':>6} {'acc2':>6} {'acc':>6} {'τ_sim':>6}"
    )
    for r in results:
        s, b = r["setting"], r["best"] or {}
        print(
            f"{s['steps']:>6} {s['batch']:>5} {s['anchors']:>5} {s['lr']:>7.0e} {s['frac']:>5.2f} {s['init']:>6} "
            f"{s['ce']:>4.1f} {s['tv']:>4.1f} {s['aw']:>2} {s['replay']:>4.2f} {r['epochs']:>6.1f} "
            f"{r['final_train_loss']:>7.3f} {b.get('val_loss', float('nan')):>6.3f} {b.get('val_acc_slot_1', float('nan')):>6.3f} "
            f"{b.get('val_acc_slot_2', float('nan')):>6.3f} {b.get('val_acc', float('nan')):>6.3f} {b.get('val_sim_tau', float('nan')):>6.3f}"
        )


if __name__ == "__main__":
    main()
