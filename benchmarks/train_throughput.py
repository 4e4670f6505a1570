"""DFlash drafter training throughput and MFU (GPU benchmark).

Default: Qwen3-8B-shaped drafter (5 layers, H 4096, 32 heads / 8 KV, head_dim 128, MLP 12288, 5 taps),
frozen bf16 LM head + embeddings (vocab 151936), 512 anchors x block 16 on a 3072-token context of
random features, bf16 autocast, fp32 master weights, fused AdamW, grad clip: the real training step
(draftforge.train.loop.forward_batch + the loop's optimizer code path).

FLOPs per step (useful work; a matmul of m x k by k x n = 2mkn):
  trainable matmuls (fwd + dgrad + wgrad = 3x fwd):
    per layer: block q,k,v,o: 2*Q*H*(2*Dq + 2*Dkv); context k,v: 2*T*H*2*Dkv; MLP: 2*Q*3*H*I
  attention (fwd + 2x bwd = 3x fwd): 4*Dq*sum over queries of visible keys (context < anchor + block)
  fc (fwd + wgrad only; features need no grad = 2x): 2*T*F*H
  frozen LM head on valid slots only (fwd + dgrad = 2x): 2*M*H*V (a draft vocabulary: its D rows instead of V)
  with Q = N*B block tokens, M = valid slots, T context tokens, Dq = heads*hd, Dkv = kv_heads*hd.
MFU = FLOPs / step time / peak (989 TFLOP/s bf16 dense, H100/H200 SXM), also vs a measured bf16
matmul ceiling on this device.

    python benchmarks/train_throughput.py            # CUDA
    python benchmarks/train_throughput.py --tiny     # CPU smoke (seconds)
    python benchmarks/train_throughput.py --shape smollm2 --layers 3 --anchors 32 --seq-len 160 --cpu  # default world
    python benchmarks/train_throughput.py --shape smollm2 ... --draft-vocab 0,8192 --rounds 3  # side by side
With several --draft-vocab sizes each is one drafter + optimizer in the same process, timed in turn over
--rounds rounds (A B A B ...), so host drift hits every size alike; each size reports its fastest round.
Writes $OUT/train_throughput.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftforge.drafter.attention import resolve_impl  # noqa: E402
from draftforge.drafter.config import DFlashConfig  # noqa: E402
from draftforge.drafter.model import DFlashDrafter  # noqa: E402
from draftforge.train import loss as loss_mod  # noqa: E402
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.data import collate  # noqa: E402
from draftforge.train.head import FrozenTargetHead  # noqa: E402
from draftforge.train.loop import forward_batch, make_objective  # noqa: E402
from draftforge.train.loss import slot_weights  # noqa: E402

PEAK_BF16 = 989e12


def shape(args) -> DFlashConfig:
    if args.shape == "smollm2":  # the default world: SmolLM2-135M target, its 3-layer drafter (conf/target)
        return DFlashConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64, vocab_size=49152, mask_token_id=3,
                            target_layer_ids=[1, 8, 14, 20, 27], block_size=args.block, target_num_layers=30)
    if args.tiny:
        return DFlashConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=4096, mask_token_id=3,
                            target_layer_ids=[1, 3, 5], block_size=args.block, target_num_layers=8)
    return DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=args.layers, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, mask_token_id=151669,
                        target_layer_ids=[1, 9, 17, 25, 33], block_size=args.block, target_num_layers=36,
                        rope_theta=1e6, max_position_embeddings=40960)


def make_batch(cfg: DFlashConfig, T: int, n_anchors: int, n_seqs: int, seed: int, with_last: bool = False):
    """Random tokens (of a draft vocabulary of ids 0..D-1 when the config has one), features and anchors."""
    g = torch.Generator().manual_seed(seed)
    seqs, anchors = [], []
    for _ in range(n_seqs):
        ids = torch.randint(0, cfg.draft_vocab_size or cfg.vocab_size, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.uint8)
        mask[: T // 8] = 0  # a prompt
        hidden = torch.randn(T, cfg.feature_dim, generator=g)
        cand = torch.arange(T // 8, T - 1)
        anchors.append(cand[torch.randperm(cand.numel(), generator=g)[:n_anchors]].sort().values)
        last = (torch.randn(T, cfg.hidden_size, generator=g),) if with_last else ()  # the target's last layer
        seqs.append((ids, mask, hidden, *last))
    return collate(seqs, anchors, cfg.block_size, cfg.mask_token_id)


def step_flops(cfg: DFlashConfig, batch) -> dict[str, float]:
    H, I, V, F = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.feature_dim
    Dq, Dkv, B = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.block_size
    real = batch.valid[..., 1]  # (S, N) real anchors
    Q = float(real.sum()) * B
    T = float(batch.n_tokens)
    M = float(batch.valid.sum())
    visible = float(((batch.anchors.float() + B) * B * real).sum())  # keys seen, summed over queries
    L = cfg.num_hidden_layers
    layers = L * (2 * Q * H * (2 * Dq + 2 * Dkv) + 2 * T * H * 2 * Dkv + 2 * Q * 3 * H * I)
    attn = L * 4 * Dq * visible
    V = cfg.draft_vocab_size or V  # the rows the drafter's head multiplies
    out = {"layers": 3 * layers, "attention": 3 * attn, "fc": 2 * (2 * T * F * H), "lm_head": 2 * (2 * M * H * V)}
    out["total"] = sum(out.values())
    out.update(Q=Q, T=T, M=M)
    return out


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Variant:
    """One drafter (a draft vocabulary size) with its optimizer: `time(n)` runs n steps, `result(step_s)` reports."""

    def __init__(self, args, draft_vocab: int = 0) -> None:
        self.args, self.draft_vocab = args, draft_vocab
        self.one_step, self.info = prepare(args, draft_vocab)
        self.times: list[float] = []

    def time(self, n: int) -> float:
        device = self.info["device"]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            self.info["last_loss"] = self.one_step()
        sync(device)
        self.times.append((time.perf_counter() - t0) / n)
        return self.times[-1]


def prepare(args, draft_vocab: int = 0):
    """The drafter, its frozen head, optimizer and batch → (one training step, what the report needs)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny and not args.cpu else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = dataclasses.replace(shape(args), draft_vocab_size=draft_vocab)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, attn_impl=args.attn).to(device)
    head = FrozenTargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02,
                            torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device) * 0.02)
    if draft_vocab:  # which D tokens does not change the step's cost: the first D (make_batch draws from them)
        model.set_draft_vocab(torch.arange(draft_vocab, device=device), head.lm_head)
    impl = resolve_impl(args.attn, device)
    compiled = False
    if args.compile and device.type == "cuda":
        for layer in model.layers:
            layer.compile()
        loss_mod.compile_loss()
        compiled = True
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    weights = slot_weights(cfg.block_size, 7.0).to(device)
    batch = make_batch(cfg, args.seq_len, args.anchors, args.seqs, 0, with_last=args.acceptance_weighting)
    flops = step_flops(cfg, batch)
    gpu_batch = batch.to(device)
    gpu_batch.tapped = gpu_batch.tapped.to(dtype)

    obj = make_objective(TrainConfig(), cfg, acceptance_weighting=args.acceptance_weighting) if args.acceptance_weighting else None

    def one_step() -> float:  # the loop's own forward (BlockTask.forward) + the optimizer step of trainer.run
        ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
        with ctx:
            out = forward_batch(model, head, gpu_batch, weights, impl, obj)
        loss = out.weighted_ce_sum / out.weight_sum.clamp_min(1e-6)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return one_step, {"device": device, "dtype": dtype, "cfg": cfg, "params": params, "impl": impl,
                      "compiled": compiled, "flops": flops}


def result(args, v: Variant) -> dict:
    info = v.info
    device, dtype, cfg, params, flops = info["device"], info["dtype"], info["cfg"], info["params"], info["flops"]
    step_s = min(v.times)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            v.one_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    ceiling = matmul_ceiling(device, dtype, 8192 if device.type == "cuda" else 512)
    achieved = flops["total"] / step_s
    res = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "attn_impl": info["impl"],
        "compiled": info["compiled"],
        "shape": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size,
                  "vocab": cfg.vocab_size, "draft_vocab": cfg.draft_vocab_size or cfg.vocab_size, "n_taps": cfg.n_taps,
                  "block": cfg.block_size},
        "params": sum(p.numel() for p in params),
        "seq_len": args.seq_len, "anchors": args.anchors, "seqs_per_step": args.seqs,
        "step_s": step_s, "step_s_per_round": v.times, "final_loss": info["last_loss"],
        "block_tokens_per_s": flops["Q"] / step_s,
        "context_tokens_per_s": flops["T"] / step_s,
        "valid_slots_per_s": flops["M"] / step_s,
        "flops_per_step": {k: flops[k] for k in ("layers", "attention", "fc", "lm_head", "total")},
        "achieved_tflops": achieved / 1e12,
        "mfu_vs_peak": achieved / PEAK_BF16 if device.type == "cuda" else None,
        "matmul_ceiling_tflops": ceiling / 1e12,
        "mfu_vs_ceiling": achieved / ceiling,
        "flops_formula": "3*layers(block qkvo + ctx kv + MLP) + 3*attention(visible keys) + 2*fc + 2*lm_head(valid slots); matmul = 2mkn",
    }
    if device.type == "cuda":
        res["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def run(args) -> list[dict]:
    """Every --draft-vocab size: warm-up, then --rounds rounds of --steps steps taken in turn."""
    variants = [Variant(args, d) for d in args.draft_vocab]
    for v in variants:
        for _ in range(args.warmup):
            v.one_step()
    for _ in range(args.rounds):
        for v in variants:
            v.time(args.steps)
    return [result(args, v) for v in variants]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (seconds)")
    p.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "smollm2"],
                   help="smollm2: the default world's drafter (use --layers 3 --anchors 32 --seq-len 160 on a CPU)")
    p.add_argument("--acceptance-weighting", action="store_true", help="the dflash_aw objective (default world)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of the timed steps")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--seqs", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attn", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--draft-vocab", default="0", help="comma-separated draft vocabulary sizes (0: the whole vocabulary)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds per size, taken in turn (the fastest counts)")
    args = p.parse_args()
    args.draft_vocab = [int(d) for d in args.draft_vocab.split(",")]
    if args.tiny:
        args.anchors, args.seq_len, args.steps, args.warmup = min(args.anchors, 32), min(args.seq_len, 256), min(args.steps, 3), 1
    try:
        results = run(args)
    except Exception as exc:  # a compile failure must not hide the eager number
        if not args.compile or args.tiny:
            raise
        print(f"compiled run failed ({type(exc).__name__}: {str(exc)[:300]}); rerunning eager", file=sys.stderr)
        loss_mod._CE["fn"] = loss_mod._ce_chunk
        args.compile = False
        torch.cuda.empty_cache()
        results = run(args)
        for res in results:
            res["compile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    first = results[0]
    print(f"device {first['device']}  attn {first['attn_impl']}  compiled {first['compiled']}  params {first['params'] / 1e6:.1f}M")
    print(f"{'draft V':>8} {'step ms':>10} {'blk tok/s':>12} {'ctx tok/s':>12} {'TFLOP/s':>9} {'MFU(peak)':>10} "
          f"{'MFU(ceil)':>10} {'ceil TF/s':>10} {'× first':>8}")
    for res in results:
        mfu = f"{res['mfu_vs_peak']:.1%}" if res["mfu_vs_peak"] is not None else "n/a"
        res["speedup_vs_first"] = res["block_tokens_per_s"] / first["block_tokens_per_s"]
        print(f"{res['shape']['draft_vocab']:8d} {res['step_s'] * 1e3:10.1f} {res['block_tokens_per_s']:12.0f} "
              f"{res['context_tokens_per_s']:12.0f} {res['achieved_tflops']:9.2f} {mfu:>10} {res['mfu_vs_ceiling']:10.1%} "
              f"{res['matmul_ceiling_tflops']:10.1f} {res['speedup_vs_first']:8.2f}")
        f = res["flops_per_step"]
        print(f"  FLOPs/step: layers {f['layers']:.3g} attention {f['attention']:.3g} fc {f['fc']:.3g} lm_head {f['lm_head']:.3g} total {f['total']:.3g}")
    print(f"formula: {first['flops_formula']}")
    write_record("train_throughput", results[0] if len(results) == 1 else {"variants": results})


if __name__ == "__main__":
    main()
