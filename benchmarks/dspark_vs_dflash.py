"""DFlash vs DSpark drafters on the same features of a small random target, and ddtree vs ddtree_markov.

A sandbox comparison (not the pipeline): a random Qwen3 target whose LM head is scaled up so its
next-token distributions are peaked; training text = the target's own samples (T = 1) from random
prompts; both drafters train on the same tapped features with the same steps; then the engine runs
dflash / dspark chains and ddtree / ddtree_markov trees on held-out prompts (T = 0) and reports τ.

    python benchmarks/dspark_vs_dflash.py --device cuda --steps 2000 --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def build_target(args, device):
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import build_random_model

    spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=2 * args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                              head_dim=args.hidden // 4, seed=0)
    model = build_random_model(spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)
    return model.to(device).eval()


@torch.no_grad()
def make_items(model, n, length, vocab, taps, device, seed, batch=64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    items = []
    while len(items) < n:
        b = min(batch, n - len(items))
        ids = torch.randint(4, vocab, (b, 8), generator=g).to(device)
        seqs = model.generate(ids, max_new_tokens=length - 8, min_new_tokens=length - 8, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        hs = model(seqs, output_hidden_states=True).hidden_states
        taps_t = torch.cat([hs[t + 1] for t in taps], -1).float().cpu()
        last = hs[-1].float().cpu()
        for i in range(b):
            mask = torch.zeros(seqs.shape[1], dtype=torch.uint8)
            mask[8:] = 1
            items.append((seqs[i].cpu(), mask, taps_t[i], last[i]))
    return items


def train_one(kind, model, items, val, args, device, taps):
    from draftforge.drafter.config import DFlashConfig
    from draftforge.drafter.dspark import DSparkConfig
    from draftforge.train.config import TrainConfig
    from draftforge.train.data import InMemorySource
    from draftforge.train.head import FrozenTargetHead
    from draftforge.train.loop import TrainInputs, train

    c = model.config
    base = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=c.head_dim, vocab_size=c.vocab_size, mask_token_id=3, target_layer_ids=list(taps),
                        block_size=args.block, target_num_layers=c.num_hidden_layers)
    dcfg = DSparkConfig.from_dflash(base, markov_rank=args.rank) if kind == "dspark" else base  # the type's objective
    cfg = TrainConfig(max_steps=args.steps, batch_seqs=8, num_anchors=64, lr=args.lr, eval_every=args.steps,
                      ckpt_every=10**9, log_every=10**9, val_max_seqs=16, val_num_anchors=64, init_from_target=False,
                      prefetch=2)
    head = FrozenTargetHead(model.get_input_embeddings().weight.detach().float(), model.lm_head.weight.detach().float())
    inp = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=InMemorySource(items), val_source=InMemorySource(val),
                      head=head.to(device), ckpt_dir=Path(args.work) / f"{kind}-{time.time_ns()}", resume_key=kind, device=device)
    t0 = time.perf_counter()
    res = train(inp)
    return res.model.eval(), {**res.evals[-1], "train_s": time.perf_counter() - t0,
                              "final_loss": res.history[-1]["loss"]}


def run_engine(tm, drafters, prompts, args):
    from draftforge.engine import generate, make_method

    rows = []
    plans = [("dflash", "dflash", None)] + [("dflash", "ddtree", b) for b in args.budgets]
    plans += [("dspark", "dspark", None), ("dspark", "dflash", None)]
    plans += [("dspark", "ddtree", b) for b in args.budgets] + [("dspark", "ddtree_markov", b) for b in args.budgets]
    for drafter_name, method, budget in plans:
        acc, rounds, t = 0, 0, 0.0
        for p in prompts:
            res = generate(tm, make_method(method, tm, drafters[drafter_name], budget), p, args.new_tokens)
            acc += sum(res.accept_lengths)
            rounds += len(res.accept_lengths)
            t += res.decode_s
        rows.append({"drafter": drafter_name, "method": method, "budget": budget, "tau": acc / rounds,
                     "decode_s": t})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--head-scale", type=float, default=4.0)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--n-eval", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work", default="/tmp/dspark_bench")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_target(args, device)
    taps = tuple(sorted({0, args.layers // 2, args.layers - 2}))
    t0 = time.perf_counter()
    items = make_items(model, args.n_train, args.seq_len, args.vocab, taps, device, seed=1)
    val = make_items(model, 16, args.seq_len, args.vocab, taps, device, seed=2)
    print(f"data: {time.perf_counter() - t0:.1f}s", flush=True)
    drafters, train_metrics = {}, {}
    for kind in ("dflash", "dspark"):
        drafters[kind], train_metrics[kind] = train_one(kind, model, items, val, args, device, taps)
        print(kind, {k: round(v, 4) if isinstance(v, float) else v for k, v in train_metrics[kind].items()}, flush=True)
    from draftforge.engine import wrap_target

    tm = wrap_target(model, taps)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, args.vocab, (8,), generator=g).tolist() for _ in range(args.n_eval)]
    rows = run_engine(tm, drafters, prompts, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "train": train_metrics, "engine": rows}, indent=1))


if __name__ == "__main__":
    main()
