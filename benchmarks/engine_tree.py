"""DDTree round cost on a random-weight Qwen3-8B-shaped target (bf16, H200) vs one AR step.

For budgets 16…1024: verify-forward time and whole-round time ÷ one AR step time, per-stage times,
and engine overhead = round − draft − verify (tree build + walk/compaction/context gather) as % of the
round (goal at budget 256: ≤ 10%). The drafter is random (acceptance is irrelevant to round cost).

    PYTHONPATH=src python benchmarks/engine_tree.py            # CUDA, conf/target/qwen3-8b-random.yaml
    PYTHONPATH=src python benchmarks/engine_tree.py --tiny     # CPU, seconds
Writes $OUT/engine_tree.json when $OUT is set. Needs only torch + transformers (+ PyYAML, which
transformers installs) and this repo on PYTHONPATH. Stage times wait for the GPU at each boundary
(torch.cuda.synchronize), as the engine's Clock always does.
"""

from __future__ import annotations

import argparse
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
from draftforge.engine import generate_ar, generate_ddtree, generate_dflash, wrap_target  # noqa: E402
from draftforge.engine.target import KVCache, causal_mask, forward  # noqa: E402
from draftforge.engine.timing import Clock  # noqa: E402
from draftforge.engine.tree import build_tree, draft_topk, tree_inputs  # noqa: E402
from draftforge.target.config import RandomTargetConfig  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402

BUDGETS = (16, 32, 64, 128, 256, 512, 1024)


def target_spec(tiny: bool) -> tuple[RandomTargetConfig, list[int], int, int, int]:
    """→ random target spec, taps, drafter layers, block size, mask id (from the conf yaml)."""
    import yaml

    conf = yaml.safe_load((REPO / "conf/target/qwen3-8b-random.yaml").read_text())
    d = conf["drafter"]
    if tiny:
        spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=128,
                                  intermediate_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32)
        return spec, [1, 3], 1, int(d["block_size"]), int(d["mask_token_id"])
    return RandomTargetConfig(**conf["random"]), list(d["target_layer_ids"]), int(d["num_layers"]), \
        int(d["block_size"]), int(d["mask_token_id"])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def round_times(res, skip: int) -> dict[str, float]:
    """Median per-stage and whole-round seconds over rounds ≥ 2 (round 1 reuses the prefill draft)."""
    st = res.stage_s
    rounds = [(st["draft"][r - 1], st["build"][r], st["verify"][r], st["commit"][r]) for r in range(1, len(res.accept_lengths))]
    rounds = rounds[skip:] or rounds
    out = {name: median([r[i] for r in rounds]) for i, name in enumerate(("draft", "build", "verify", "commit"))}
    out["round"] = median([sum(r) for r in rounds])
    out["overhead"] = median([r[1] + r[3] for r in rounds])  # = round − draft − verify
    return out


def verify_probe(tm, prompt: list[int], sizes: list[int], reps: int = 5) -> list[dict]:
    """Target forward + LM head over n tokens after the prompt, causal mask vs a tree mask of the same
    n (random best-first tree), median ms. Separates token-count effects (e.g. GEMM shapes) from
    mask effects (SDPA kernel choice) in the verify cost."""
    clock = Clock(tm.device)
    cache = KVCache(tm, len(prompt) + max(sizes) + 8)
    forward(tm, cache, torch.tensor([prompt], device=tm.device), torch.arange(len(prompt), device=tm.device))
    start = cache.length
    g = torch.Generator().manual_seed(0)
    out = []
    for n in sizes:
        logp, toks = draft_topk(torch.randn(15, 64, generator=g), 64)
        tree = build_tree(1, logp, toks, n - 1)
        t_ids, t_pos, t_mask = tree_inputs(tree, start, tm.device, tm.dtype)
        c_ids = t_ids
        c_pos = torch.arange(start, start + n, device=tm.device)
        c_mask = causal_mask(start, n, tm.device, tm.dtype)
        row = {"n": n}
        for name, ids, pos, mask in (("causal", c_ids, c_pos, c_mask), ("tree", t_ids, t_pos, t_mask)):
            times = []
            for _ in range(reps + 1):
                t0 = clock.now()
                h, _ = forward(tm, cache, ids, pos, mask, True)
                tm.lm_head(h[0]).argmax(-1).tolist()
                times.append(clock.now() - t0)
                cache.crop(start)
            row[f"{name}_ms"] = 1e3 * median(times[1:])
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny CPU model (seconds)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=24, help="measured rounds per budget")
    ap.add_argument("--skip", type=int, default=4, help="rounds discarded at the start of each run")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.prompt_len, args.rounds, args.skip = min(args.prompt_len, 64), min(args.rounds, 6), min(args.skip, 1)
    spec, taps, n_draft, block, mask_id = target_spec(args.tiny)
    t0 = time.perf_counter()
    with torch.device(device):  # initialise weights directly on the device (8B on CPU is slow)
        model = build_random_model(spec, dtype)
    tm = wrap_target(model, taps)
    dcfg = DFlashConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_hidden_layers=n_draft,
                        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                        vocab_size=spec.vocab_size, mask_token_id=mask_id, target_layer_ids=taps, block_size=block,
                        rope_theta=spec.rope_theta, target_num_layers=spec.num_layers)
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlashDrafter(dcfg, attn_impl="sdpa").to(dtype).eval()
    print(f"built target {spec.num_layers}L H{spec.hidden_size} V{spec.vocab_size} + drafter on {device} {dtype} "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, spec.vocab_size, (args.prompt_len,), generator=g).tolist()
    n_tok = args.skip + args.rounds + 2

    ar = generate_ar(tm, prompt, n_tok)  # warm-up
    ar = generate_ar(tm, prompt, n_tok)
    ar_step = median(ar.stage_s["verify"][args.skip:])
    rows = []
    chain = generate_dflash(tm, drafter, prompt, n_tok)
    chain = generate_dflash(tm, drafter, prompt, n_tok)
    rows.append({"method": "dflash", "budget": block - 1, "tau": chain.tau, **{k: v * 1e3 for k, v in round_times(chain, args.skip).items()}})
    for budget in [int(b) for b in args.budgets.split(",")]:
        generate_ddtree(tm, drafter, prompt, args.skip + 2, budget=budget)  # warm-up this shape
        res = generate_ddtree(tm, drafter, prompt, n_tok, budget=budget)
        rows.append({"method": "ddtree", "budget": budget, "tau": res.tau, **{k: v * 1e3 for k, v in round_times(res, args.skip).items()}})
    probe = verify_probe(tm, prompt, [16, 17, 24, 32, 33, 64, 65, 257] if not args.tiny else [16, 17, 33])
    for r in rows:
        r["verify_over_ar"] = r["verify"] / (ar_step * 1e3)
        r["round_over_ar"] = r["round"] / (ar_step * 1e3)
        r["overhead_pct"] = 100.0 * r["overhead"] / r["round"]
    print(f"\nAR step: {ar_step * 1e3:.2f} ms  (prompt {args.prompt_len} tokens)")
    print(f"{'method':7} {'budget':>6} {'verify ms':>9} {'verify/AR':>9} {'round ms':>9} {'round/AR':>8} "
          f"{'draft':>7} {'build':>7} {'commit':>7} {'ovh %':>6} {'tau':>5}")
    for r in rows:
        print(f"{r['method']:7} {r['budget']:>6} {r['verify']:9.2f} {r['verify_over_ar']:9.2f} {r['round']:9.2f} "
              f"{r['round_over_ar']:8.2f} {r['draft']:7.2f} {r['build']:7.2f} {r['commit']:7.2f} "
              f"{r['overhead_pct']:6.1f} {r['tau']:5.2f}")
    print("\nverify forward + LM head by token count (ms): causal mask vs tree mask, same n")
    print("  ".join(f"n={p['n']}: {p['causal_ms']:.2f}/{p['tree_ms']:.2f}" for p in probe))
    at256 = next((r for r in rows if r["method"] == "ddtree" and r["budget"] == 256), None)
    if at256:
        verdict = "PASS" if at256["overhead_pct"] <= 10 else "FAIL"
        print(f"\nengine overhead at budget 256: {at256['overhead_pct']:.1f}% of the round (goal <= 10%: {verdict})")
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
        "target": {"layers": spec.num_layers, "hidden": spec.hidden_size, "vocab": spec.vocab_size},
        "prompt_len": args.prompt_len, "rounds": args.rounds, "ar_step_ms": ar_step * 1e3, "rows": rows,
        "verify_probe": probe, "torch": torch.__version__, "tiny": args.tiny,
    }  # fmt: skip
    write_record("engine_tree", report)


if __name__ == "__main__":
    main()
