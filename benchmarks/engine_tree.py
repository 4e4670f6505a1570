"""Engine step costs on random-weight targets (bf16, H200): eager engine vs the captured engine (CUDA graphs).

Per target and engine: the weight-bandwidth floor (bytes a step must read ÷ measured copy bandwidth),
the AR step, verify forward by budget (1…1024 tree nodes + root) ÷ AR step, DFlash and DDTree round
times ÷ AR step with per-stage times and overhead (build + commit), capture time; on hybrid targets
also the GDN token mixers' share of a verify (captured steps with and without them) and the peak extra
memory of an eager verify by budget. Drafters are random (acceptance is irrelevant to round cost).

    PYTHONPATH=src python benchmarks/engine_tree.py --target qwen3-8b-random       # CUDA
    PYTHONPATH=src python benchmarks/engine_tree.py --target smollm2-135m-shape    # launch-bound regime
    PYTHONPATH=src python benchmarks/engine_tree.py --target qwen3.6-27b-random    # hybrid GDN target
    PYTHONPATH=src python benchmarks/engine_tree.py --tiny --target ...            # CPU, seconds
Writes $OUT/engine_tree_<target>.json when $OUT is set. Needs only torch + transformers (+ PyYAML).
Verify times wait for the sampled tokens on the host (the loop needs them), as a round does.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from _out import write_record  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from draftforge.drafter.config import DFlashConfig  # noqa: E402
from draftforge.drafter.model import DFlashDrafter  # noqa: E402
from draftforge.engine import generate, make_method, wrap_target  # noqa: E402
from draftforge.engine.graph import CapturedEngine, verify_buckets  # noqa: E402
from draftforge.engine.span import chain_span, tree_span  # noqa: E402
from draftforge.engine.state import TargetState  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.engine.timing import Clock  # noqa: E402
from draftforge.engine.tree import build_tree, chain_tree, draft_topk  # noqa: E402
from draftforge.target.config import RandomTargetConfig, default_tap_ids  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402

VERIFY_BUDGETS = (1, 16, 32, 64, 128, 256, 512, 1024)
ROUND_BUDGETS = (16, 64, 256, 1024)
SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)  # fmt: skip


def target_spec(name: str, tiny: bool) -> tuple[RandomTargetConfig, list[int], int, int, int]:
    """→ random target spec, taps, drafter layers, block size, mask id."""
    import yaml

    if name == "smollm2-135m-shape":  # SmolLM2-135M's shape (conf/target/smollm2-135m.yaml), random weights
        spec = RandomTargetConfig(**SMOLLM2)
        taps, n_draft, block = default_tap_ids(30, 5), 3, 16
    else:
        conf = yaml.safe_load((REPO / f"conf/target/{name}.yaml").read_text())
        t, shape = conf["target"], conf.get("drafter") or {}  # taps: the target's; layers/block: its drafter shape
        spec = RandomTargetConfig(**t["random"])
        taps = list(t["drafter"]["target_layer_ids"])
        n_draft, block = int(shape.get("num_layers", 5)), int(shape.get("block_size", 16))
    if tiny:
        hybrid = spec.architecture.startswith("Qwen3_5")
        spec = RandomTargetConfig(architecture=spec.architecture, vocab_size=2048, hidden_size=128, intermediate_size=256,
                                  num_layers=8 if hybrid else 6, num_heads=4, num_kv_heads=2, head_dim=32,
                                  tie_word_embeddings=spec.tie_word_embeddings)  # fmt: skip
        taps, n_draft = [1, 3], 1
    return spec, taps, n_draft, block, 3


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (the floor's ceiling)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    bw = 10 * 2 * x.numel() / (ev[0].elapsed_time(ev[1]) / 1e3)
    del x, y
    return bw


def step_bytes(tm) -> int:
    """Weights one forward must read: every parameter except the embedding table (one row per token)."""
    total = sum(p.numel() * p.element_size() for p in tm.hf.parameters())
    if tm.embed.weight is not tm.lm_head.weight:
        total -= tm.embed.weight.numel() * tm.embed.weight.element_size()
    return total


def round_times(res, skip: int) -> dict[str, float]:
    """Median per-stage and whole-round ms over rounds ≥ 2 (round 1 reuses the prefill draft)."""
    st = res.stage_s
    rounds = [(st["draft"][r - 1], st["build"][r], st["verify"][r], st["commit"][r]) for r in range(1, len(res.accept_lengths))]
    rounds = rounds[skip:] or rounds
    out = {f"{name}_ms": 1e3 * median([r[i] for r in rounds]) for i, name in enumerate(("draft", "build", "verify", "commit"))}
    out["round_ms"] = 1e3 * median([sum(r) for r in rounds])
    out["overhead_ms"] = 1e3 * median([r[1] + r[3] for r in rounds])  # = round − draft − verify
    return out


def probe_tree(n: int, depth: int, seed: int = 0):
    """A best-first tree of n nodes (root included) over random per-depth top-64 drafts."""
    if n == 1:
        return chain_tree(1, [])
    g = torch.Generator().manual_seed(seed)
    logp, toks = draft_topk(torch.randn(depth, 64, generator=g) * 2, 64)
    return build_tree(1, logp, toks, n - 1)


def verify_probe(tm, eng, prompt: list[int], sizes: list[int], depth: int, reps: int) -> list[dict]:
    """Target verify forward + LM head + argmax on the host for a tree of n nodes after the prompt (not
    committed), median ms; eager rows also carry the peak memory the verify adds (MiB)."""
    clock = Clock(tm.device)
    cuda = tm.device.type == "cuda"
    ids = torch.tensor([prompt], device=tm.device)
    if eng is None:
        state = TargetState(tm, len(prompt) + max(sizes) + 8)
    else:
        eng.reset()
        state = eng.state
    forward(tm, state, chain_span(ids, 0, tm.dtype, commit_all=True))
    start = state.length
    out = []
    for n in sizes:
        tree = probe_tree(n, depth)
        times, peak = [], float("nan")
        for rep in range(reps + 1):
            if cuda and rep == 1:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = clock.now()
            if eng is None:
                span = tree_span(tree, start, tm.device, tm.dtype, tm.conv_kernel) if n > 1 else \
                    chain_span(ids[:, :1], start, tm.dtype, commit_all=False)
                h, _ = forward(tm, state, span)
                tm.lm_head(h[0]).argmax(-1).tolist()
            else:
                logits, _, _ = eng.verify(tree)
                logits.argmax(-1).tolist()
            times.append(clock.now() - t0)
            if cuda and rep == 1:
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        out.append({"budget": n - 1, "n": n, "verify_ms": 1e3 * median(times[1:]), "peak_extra_mib": peak})
    return out


def profile_ar_step(eng, top: int = 12) -> dict:
    """Kernels of one AR step (bucket 1) run un-graphed under the profiler: count, summed kernel time, and
    the top kernels by time. Graph replay runs the same kernels; the gap to the replayed step is launch cost."""
    from torch.profiler import ProfilerActivity, profile

    b = eng._buckets[1]
    eng.reset()
    eng._fill(b, [5], [-1], [0])
    for _ in range(3):
        eng._step(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng._step(b)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(ev.name, []).append(ev.device_time)
    total_us = sum(sum(v) for v in by_name.values())
    rows = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:top]
    return {"kernels": sum(len(v) for v in by_name.values()), "kernel_ms": total_us / 1e3,
            "top": [{"us": t, "count": c, "name": k[:90]} for t, c, k in rows]}


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen3-8b-random", help="qwen3-8b-random | smollm2-135m-shape | qwen3.6-27b-random")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU model of the target's kind (seconds)")
    ap.add_argument("--engines", default="eager,captured,compiled", help="eager | captured | compiled (captured + torch.compile) | "
                    "compiled_split (compiled + split-KV attention)")
    ap.add_argument("--verify-budgets", default=",".join(map(str, VERIFY_BUDGETS)))
    ap.add_argument("--round-budgets", default=",".join(map(str, ROUND_BUDGETS)))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=16, help="measured rounds per method")
    ap.add_argument("--skip", type=int, default=3, help="rounds discarded at the start of each run")
    ap.add_argument("--reps", type=int, default=5, help="repeats per verify-probe size")
    ap.add_argument("--profile", action="store_true", help="kernel table of one un-graphed AR step per captured engine")
    ap.add_argument("--lossless-prompts", type=int, default=0,
                    help="also check DDTree (budget 64) == AR tokens on this many random prompts (eager engine)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.prompt_len, args.rounds, args.skip, args.reps = min(args.prompt_len, 40), min(args.rounds, 4), 1, 1
    vbudgets = [int(b) for b in args.verify_budgets.split(",")]
    rbudgets = [int(b) for b in args.round_budgets.split(",")]
    engines = args.engines.split(",")
    spec, taps, n_draft, block, mask_id = target_spec(args.target, args.tiny)

    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the compute dtype on the device: no fp32 copy of a 27B model
    with torch.device(device):
        model = build_random_model(spec, dtype)
        tm = wrap_target(model, taps)
        dcfg = DFlashConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                            num_hidden_layers=n_draft, num_attention_heads=spec.num_heads,
                            num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
                            mask_token_id=mask_id, target_layer_ids=taps, block_size=block, rope_theta=spec.rope_theta,
                            target_num_layers=spec.num_layers)  # fmt: skip
        torch.manual_seed(1)
        drafter = DFlashDrafter(dcfg, attn_impl="sdpa").to(dtype).eval()
    torch.set_default_dtype(old)
    build_s = time.perf_counter() - t0
    print(f"[{args.target}] built {spec.num_layers}L H{spec.hidden_size} V{spec.vocab_size} hybrid={tm.hybrid} + "
          f"{n_draft}-layer drafter on {device} {dtype} in {build_s:.0f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, spec.vocab_size, (args.prompt_len,), generator=g).tolist()
    n_tok = args.skip + args.rounds + 2
    bw = copy_bandwidth(device)
    nbytes = step_bytes(tm)
    floor_ms = 1e3 * nbytes / bw if bw == bw else float("nan")
    report = {
        "target": args.target, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "torch": torch.__version__, "tiny": args.tiny, "hybrid": tm.hybrid,
        "shape": {"layers": spec.num_layers, "hidden": spec.hidden_size, "vocab": spec.vocab_size,
                  "kinds": {k: tm.kinds.count(k) for k in set(tm.kinds)}},
        "prompt_len": args.prompt_len, "rounds": args.rounds, "step_bytes": nbytes, "copy_bytes_per_s": bw,
        "floor_ms": floor_ms, "engines": {},
    }  # fmt: skip
    if device.type == "cuda":
        report["weights_mib"] = torch.cuda.memory_allocated() / 2**20
    capacity = args.prompt_len + n_tok + max(vbudgets + rbudgets) + 1 + 64
    if args.lossless_prompts:  # bf16 on a GPU: count prompts whose DDTree tokens differ from AR's (tie flips)
        same = 0
        for i in range(args.lossless_prompts):
            p = torch.randint(10, spec.vocab_size, (64,), generator=torch.Generator().manual_seed(100 + i)).tolist()
            ar_toks = generate(tm, None, p, 32).tokens
            tree_toks = generate(tm, make_method("ddtree", tm, drafter, 64), p, 32).tokens
            same += ar_toks == tree_toks
        report["lossless"] = {"prompts": args.lossless_prompts, "ddtree64_equal_ar": same, "new_tokens": 32}
        print(f"[{args.target}] lossless: DDTree(64) == AR on {same}/{args.lossless_prompts} prompts", flush=True)
    for engine in engines:
        eng = None
        rec: dict = {"engine": engine}
        if engine in ("captured", "compiled", "compiled_split"):
            buckets = verify_buckets([block] + [b + 1 for b in vbudgets + rbudgets])
            t1 = time.perf_counter()
            eng = CapturedEngine(tm, capacity, buckets, drafter=drafter, compile=engine.startswith("compiled"),
                                 split_attention=engine == "compiled_split")
            cap_s = eng.capture()
            rec["capture_s"] = time.perf_counter() - t1
            rec["capture_s_by_graph"] = cap_s
            rec["buckets"] = list(buckets)
            if device.type == "cuda":
                rec["engine_mib"] = torch.cuda.memory_allocated() / 2**20 - report["weights_mib"]
            print(f"[{args.target}] {engine}: {len(buckets)} verify graphs + drafter in {rec['capture_s']:.1f}s", flush=True)
            if args.profile and device.type == "cuda":
                rec["profile_ar"] = prof = profile_ar_step(eng)
                print(f"[{args.target}] {engine} AR step: {prof['kernels']} kernels, {prof['kernel_ms']:.2f} ms of kernel time; top:")
                for r in prof["top"]:
                    print(f"  {r['us']:9.1f} us  x{r['count']:4d}  {r['name']}")
        kw = {"engine": eng}
        generate(tm, None, prompt, n_tok, **kw)  # warm-up
        ar = generate(tm, None, prompt, n_tok, **kw)
        ar_ms = 1e3 * median(ar.stage_s["verify"][args.skip:])
        rec["ar_step_ms"] = ar_ms
        rec["ar_over_floor"] = ar_ms / floor_ms if floor_ms == floor_ms else None
        rec["verify"] = verify_probe(tm, eng, prompt, [b + 1 for b in vbudgets], block - 1, args.reps)
        for r in rec["verify"]:
            r["verify_over_ar"] = r["verify_ms"] / ar_ms
        rows = []
        for name, budget in [("dflash", None)] + [("ddtree", b) for b in rbudgets]:
            generate(tm, make_method(name, tm, drafter, budget), prompt, args.skip + 2, **kw)  # warm-up
            res = generate(tm, make_method(name, tm, drafter, budget), prompt, n_tok, **kw)
            row = {"method": name, "budget": budget if budget is not None else block - 1, "tau": res.tau,
                   **round_times(res, args.skip)}
            row["verify_over_ar"] = row["verify_ms"] / ar_ms
            row["round_over_ar"] = row["round_ms"] / ar_ms
            row["overhead_pct"] = 100.0 * row["overhead_ms"] / row["round_ms"]
            rows.append(row)
        rec["rounds"] = rows
        if eng is not None and tm.hybrid:  # GDN mixers' share of a captured verify
            share_sizes = [b + 1 for b in vbudgets if b in (0, 16, 64, 256, 1024)] or [1]
            no_gdn = CapturedEngine(tm, capacity, share_sizes, gdn_mixers=False)
            no_gdn.capture()
            without = {r["n"]: r["verify_ms"] for r in verify_probe(tm, no_gdn, prompt, share_sizes, block - 1, args.reps)}
            full = {r["n"]: r["verify_ms"] for r in rec["verify"]}
            rec["gdn_share"] = [{"budget": n - 1, "verify_ms": full[n], "without_gdn_ms": without[n],
                                 "gdn_share": 1 - without[n] / full[n]} for n in share_sizes]  # fmt: skip
            del no_gdn
        report["engines"][engine] = rec
        del eng
        free()
        print(f"\n[{args.target}] engine={engine}  AR step {ar_ms:.2f} ms  floor {floor_ms:.2f} ms  "
              f"(AR/floor {rec['ar_over_floor'] or float('nan'):.2f})", flush=True)
        print("verify by budget: ms (÷AR" + (", peak extra MiB)" if engine == "eager" else ")") + ": " + "  ".join(
            f"{r['budget']}: {r['verify_ms']:.2f} ({r['verify_over_ar']:.2f}x"
            + (f", {r['peak_extra_mib']:.0f}M" if engine == "eager" and r["peak_extra_mib"] == r["peak_extra_mib"] else "")
            + ")" for r in rec["verify"]))
        print(f"{'method':7} {'budget':>6} {'verify':>8} {'v/AR':>5} {'round':>8} {'r/AR':>5} {'draft':>7} "
              f"{'build':>6} {'commit':>6} {'ovh%':>5} {'tau':>5}")
        for r in rows:
            print(f"{r['method']:7} {r['budget']:>6} {r['verify_ms']:8.2f} {r['verify_over_ar']:5.2f} {r['round_ms']:8.2f} "
                  f"{r['round_over_ar']:5.2f} {r['draft_ms']:7.2f} {r['build_ms']:6.2f} {r['commit_ms']:6.2f} "
                  f"{r['overhead_pct']:5.1f} {r['tau']:5.2f}")
        if "gdn_share" in rec:
            print("GDN mixers' share of the captured verify: " + "  ".join(
                f"{r['budget']}: {100 * r['gdn_share']:.0f}%" for r in rec["gdn_share"]))
    report["ar_step_ms"] = min(r["ar_step_ms"] for r in report["engines"].values())
    report["ar_step_engine"] = min(report["engines"], key=lambda e: report["engines"][e]["ar_step_ms"])
    write_record(f"engine_tree_{args.target}", report)


if __name__ == "__main__":
    main()
