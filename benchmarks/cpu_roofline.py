"""CPU roofline of the default world's decoding: measured ceilings, the floors they imply, and the engine beside them.

One run, one machine (run it with the machine otherwise idle):
  1. ceilings: memory read bandwidth (a sum over 512 MiB: bytes read / s), copy bandwidth (read + written / s),
     fp32 matmul throughput (2048³ sgemm) and, where the CPU multiplies bf16 natively, bf16;
  2. floors of the target's verify(n) for n = 1 … 64 (n = 1 is the AR step) and of the drafter's block pass:
     max(bytes ÷ read bandwidth, FLOPs ÷ matmul throughput), bytes = every weight read once (+ the KV rows
     attention reads), FLOPs = 2 · n · weights (+ attention);
  3. the engine's measured costs on the same shapes (SmolLM2-135M's shape with random weights and the
     default drafter shape: costs depend on shapes, not on the weights): the AR step, verify(n), the
     drafter pass and whole DFlash / DDTree rounds, each ÷ its floor and ÷ the AR step.

    PYTHONPATH=src python benchmarks/cpu_roofline.py                  # ~3 min on 2 cores
    PYTHONPATH=src python benchmarks/cpu_roofline.py --tiny           # seconds (a smoke run)
    PYTHONPATH=src python benchmarks/cpu_roofline.py --draft-vocab 8192  # + the same drafter drafting from 8,192 tokens
Writes $OUT/cpu_roofline.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _out import write_record  # noqa: E402
from engine_tree import probe_tree, round_times, step_bytes, target_spec  # noqa: E402

from draftforge.drafter.config import DFlashConfig  # noqa: E402
from draftforge.drafter.model import DFlashDrafter  # noqa: E402
from draftforge.engine import cpu_linear, generate, make_method, wrap_target  # noqa: E402
from draftforge.engine.draft import DrafterContext  # noqa: E402
from draftforge.engine.span import chain_span, tree_span  # noqa: E402
from draftforge.engine.state import TargetState  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402
from draftforge.train.loop import cpu_has_fast_bf16  # noqa: E402

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 65)


def timed(fn, reps: int, warm: int = 2) -> float:
    """Median seconds of `fn()` over `reps` calls after `warm` warm-ups."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def ceilings(tiny: bool) -> dict[str, float]:
    n = (64 if tiny else 512) << 20
    x = torch.empty(n // 4, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    read = n / timed(lambda: x.sum(), 5)
    copy = 2 * n / timed(lambda: y.copy_(x), 5)
    m = 512 if tiny else 2048
    a, b = torch.randn(m, m), torch.randn(m, m)
    out = {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "fp32_flops": 2 * m**3 / timed(lambda: a @ b, 5)}
    if cpu_has_fast_bf16():
        ab, bb = a.bfloat16(), b.bfloat16()
        out["bf16_flops"] = 2 * m**3 / timed(lambda: ab @ bb, 5)
    return out


def target_floor(tm, n: int, past: int, ceil: dict[str, float]) -> dict[str, float]:
    """verify(n) after `past` committed rows: weights once + the KV rows attention reads; 2·n FLOPs per weight."""
    weights = step_bytes(tm) // 4  # fp32 values read (the embedding table only as the LM head)
    n_attn = tm.kinds.count("attention")
    kv_bytes = 4 * n_attn * 2 * tm.num_kv_heads * tm.head_dim * (past + n)
    attn_flops = 4 * n_attn * tm.num_heads * tm.head_dim * n * (past + n)
    nbytes, flops = 4 * weights + kv_bytes, 2 * n * weights + attn_flops
    t = max(nbytes / ceil["read_bytes_per_s"], flops / ceil["fp32_flops"])
    return {"bytes": nbytes, "flops": flops, "floor_ms": 1e3 * t,
            "bound": "memory" if nbytes / ceil["read_bytes_per_s"] >= flops / ceil["fp32_flops"] else "compute"}


def drafter_floor(d, tm, ceil: dict[str, float], ctx_rows: int) -> dict[str, float]:
    """One block pass: drafter weights once, the LM head over its predicting slots, its context K/V."""
    cfg = d.cfg
    body = sum(p.numel() for p in d.parameters())  # the draft head is a buffer: counted in `head`
    head = (cfg.draft_vocab_size or tm.vocab_size) * cfg.hidden_size  # the rows its head multiplies
    rows = cfg.block_size + ctx_rows  # q/k/v over [context; block], the rest over the block
    nbytes = 4 * (body + head) + 4 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 256
    flops = 2 * rows * body + 2 * cfg.n_draft * head
    t = max(nbytes / ceil["read_bytes_per_s"], flops / ceil["fp32_flops"])
    return {"bytes": nbytes, "flops": flops, "floor_ms": 1e3 * t}


def build(tiny: bool):
    spec, taps, n_layers, block, mask_id = target_spec("smollm2-135m-shape", tiny)
    tm = wrap_target(build_random_model(spec, torch.float32), taps)
    cfg = DFlashConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=n_layers, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
                       mask_token_id=mask_id, target_layer_ids=taps, block_size=block,
                       target_num_layers=spec.num_layers)  # fmt: skip
    torch.manual_seed(1)
    return tm, DFlashDrafter(cfg).eval()


def with_draft_vocab(d: DFlashDrafter, tm, size: int) -> DFlashDrafter:
    """`d`'s weights drafting from `size` tokens (random ones: the cost does not depend on which)."""
    import dataclasses

    dv = DFlashDrafter(dataclasses.replace(d.cfg, draft_vocab_size=size))
    dv.load_state_dict(d.state_dict(), strict=False)
    ids = torch.randperm(tm.vocab_size, generator=torch.Generator().manual_seed(3))[:size].sort().values
    dv.set_draft_vocab(ids, tm.lm_head.weight.detach())
    return dv.eval()


def dspark_of(d: DFlashDrafter, tm) -> DFlashDrafter:
    """A DSpark drafter on `d`'s backbone shape (DSpark's default block, Markov rank 256, confidence head), over
    `d`'s draft vocabulary when it has one (then its Markov W2 has those D rows)."""
    from draftforge.drafter.dspark import DSparkConfig, DSparkDrafter

    torch.manual_seed(2)
    ds = DSparkDrafter(DSparkConfig.from_dflash(d.cfg, markov_rank=256, enable_confidence_head=True,
                                                confidence_head_with_markov=True, bonus_anchor=False))
    ds.reset_parameters(std=0.02)
    if d.cfg.draft_vocab_size:
        ds.set_draft_vocab(d.draft_ids, tm.lm_head.weight.detach())
    return ds.eval()


def warm_up(tm, method, prompt: list[int], budget: int | None) -> None:
    """A short untimed decode, then every product route a decode may meet chosen, by the evaluate stage's rule
    (cpu_linear.decode_rows): no timed round pays for a route's timing."""
    generate(tm, method, prompt, 4)
    cpu_linear.pretune(sorted(cpu_linear.decode_rows(method.drafter.cfg.block_size,
                                                          [(budget + 1, method.verify_size)] if budget else [])))


def measure_verify(tm, prompt: list[int], n: int, reps: int) -> float:
    return timed(verify_probe(tm, prompt, n), reps)


def verify_probe(tm, prompt: list[int], n: int):
    """→ a call that verifies an n-node tree (a 1-token chain for n = 1) after the prompt, uncommitted."""
    ids = torch.tensor([prompt])
    state = TargetState(tm, len(prompt) + 80)
    forward(tm, state, chain_span(ids, 0, tm.dtype, commit_all=True))
    tree = probe_tree(n, 15)

    @torch.no_grad()  # as the engine's loops: a weight that requires grad would leave its packed path
    def one() -> None:
        if n == 1:
            span = chain_span(ids[:, :1], state.length, tm.dtype, commit_all=False)
        else:
            span = tree_span(tree, state.length, tm.device, tm.dtype, tm.conv_kernel)
        h, _ = forward(tm, state, span, want_taps=True)
        tm.lm_head(h[0]).argmax(-1).tolist()

    return one


def measure_draft(tm, d, prompt_len: int, reps: int) -> float:
    return timed(draft_probe(tm, d, prompt_len), reps)


def draft_probe(tm, d, prompt_len: int):
    """→ a call that runs one round's block pass: 2 newly committed context rows, then the block."""
    ctx = DrafterContext(d, tm)
    feats = torch.randn(1, prompt_len, d.cfg.feature_dim)
    ctx.add(feats)
    ctx.block_logits(5, prompt_len)
    new = torch.randn(1, 2, d.cfg.feature_dim)

    def one() -> None:  # a round: 2 newly committed rows, then the block at the same start (cache cropped)
        ctx.length = prompt_len - 2
        ctx.add(new)
        ctx.block_logits(5, prompt_len)

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--budgets", default="4,8,16,32")
    ap.add_argument("--dspark", action="store_true",
                    help="also time the dflash / dspark chains and ddtree / ddtree_markov at budget 64 on a DSpark drafter "
                         "(with --draft-vocab: also on one over that many rows)")
    ap.add_argument("--dspark-reps", type=int, default=3, help="turns of the four DSpark methods (each keeps its fastest)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="also time the drafter pass and the DFlash / DDTree rounds with a draft vocabulary of this size")
    ap.add_argument("--compare-routes", nargs="?", const="fixed", choices=["fixed", "library"], default=None,
                    help="also time verify(n ≤ 17), the drafter pass and the rounds on another CPU path, alternating "
                         "with the current one: fixed = the former rule of engine/cpu_linear.py with unfused "
                         "projections (the default), library = measured routes without the engine's AVX2 kernel")
    ap.add_argument("--compare-kernel", metavar="CPP", default=None,
                    help="also time verify(n ≤ 17), the drafter pass and the rounds with the engine's kernel built from "
                         "this source instead (e.g. a former commit's: git show REV:src/draftforge/engine/csrc/"
                         "skinny_linear.cpp > /tmp/k.cpp), alternating with the current one on the same routes")
    args = ap.parse_args()
    if args.compare_routes and args.compare_kernel:
        ap.error("--compare-routes and --compare-kernel: one A/B per run")
    if args.tiny:
        args.prompt_len, args.reps, args.rounds = 40, 2, 4
    ceil = ceilings(args.tiny)
    tm, d = build(args.tiny)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, tm.vocab_size, (args.prompt_len,), generator=g).tolist()
    rec = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "commit": _git_sha()},
           "ceilings": ceil, "prompt_len": args.prompt_len, "verify": [], "rounds": []}
    for n in SIZES:
        fl = target_floor(tm, n, args.prompt_len, ceil)
        ms = 1e3 * measure_verify(tm, prompt, n, args.reps)
        rec["verify"].append({"n": n, "ms": ms, **fl, "over_floor": ms / fl["floor_ms"]})
    ar_ms = rec["verify"][0]["ms"]
    for r in rec["verify"]:
        r["over_ar"] = r["ms"] / ar_ms
    n_tok = args.rounds + 4
    drafters = [("", d)] + ([(f"D{args.draft_vocab}", with_draft_vocab(d, tm, args.draft_vocab))] if args.draft_vocab else [])
    for tag, drafter in drafters:  # the whole vocabulary, then (--draft-vocab) the same weights on D rows
        dfl = drafter_floor(drafter, tm, ceil, ctx_rows=2)
        draft_ms = 1e3 * measure_draft(tm, drafter, args.prompt_len, args.reps)
        rec["draft" + (f"_{tag}" if tag else "")] = {"ms": draft_ms, **dfl, "over_floor": draft_ms / dfl["floor_ms"],
                                                     "over_ar": draft_ms / ar_ms}  # fmt: skip
        for name, b in [("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",")]:
            warm_up(tm, make_method(name, tm, drafter, b), prompt, b)
            res = generate(tm, make_method(name, tm, drafter, b), prompt, n_tok)
            rt = round_times(res, 1)
            n_verify = (b + 1) if b else d.cfg.block_size
            floor = target_floor(tm, n_verify, args.prompt_len, ceil)["floor_ms"] + dfl["floor_ms"]
            rec["rounds"].append({"method": name, "budget": b, **({"drafter": tag} if tag else {}), **rt, "floor_ms": floor,
                                  "over_floor": rt["round_ms"] / floor, "over_ar": rt["round_ms"] / ar_ms})
    # the DSpark methods on a DSpark drafter of the same backbone (random heads, rank 256); with --draft-vocab also
    # over the same D rows
    # over the same D rows. The four methods take turns --dspark-reps times; each keeps its fastest generation (by
    # median round), and the median over the turns is recorded beside it: a verify of 65 rows varies by ±20% on a
    # noisy host, more than the methods differ.
    for tag, drafter in drafters if args.dspark else []:
        ds = dspark_of(drafter, tm)
        plan = (("dflash", None), ("dspark", None), ("ddtree", 64), ("ddtree_markov", 64))
        for name, b in plan:
            warm_up(tm, make_method(name, tm, ds, b), prompt, b)
        turns: dict[str, list[dict[str, float]]] = {name: [] for name, _ in plan}
        for _ in range(args.dspark_reps):
            for name, b in plan:
                turns[name].append(round_times(generate(tm, make_method(name, tm, ds, b), prompt, n_tok), 1))
        for name, b in plan:
            rt = min(turns[name], key=lambda t: t["round_ms"])
            median_ms = statistics.median(t["round_ms"] for t in turns[name])
            rec["rounds"].append({"method": name, "budget": b, "drafter": "dspark" + (f" {tag}" if tag else ""), **rt,
                                  "over_ar": rt["round_ms"] / ar_ms, "round_ms_median_of_turns": median_ms})
    if args.compare_routes or args.compare_kernel:
        rec["routes_ab"] = routes_ab(tm, drafters[-1][1], prompt, args, ar_ms)
    rec["tuned_routes"] = cpu_linear.tuned_routes()
    write_record("cpu_roofline", rec)
    c = rec["ceilings"]
    print(f"read {c['read_bytes_per_s'] / 1e9:.1f} GB/s  copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s  "
          f"fp32 {c['fp32_flops'] / 1e9:.0f} GFLOP/s" + (f"  bf16 {c['bf16_flops'] / 1e9:.0f} GFLOP/s" if "bf16_flops" in c else ""))
    print(f"{'verify n':>9} {'ms':>8} {'floor':>8} {'bound':>7} {'/floor':>7} {'/AR':>6}")
    for r in rec["verify"]:
        print(f"{r['n']:>9} {r['ms']:8.1f} {r['floor_ms']:8.1f} {r['bound']:>7} {r['over_floor']:7.2f} {r['over_ar']:6.2f}")
    for key in [k for k in rec if k.startswith("draft")]:
        dr = rec[key]
        print(f"{key:>9} {dr['ms']:8.1f} {dr['floor_ms']:8.1f} {'':>7} {dr['over_floor']:7.2f} {dr['over_ar']:6.2f}")
    print(f"{'round':>9} {'ms':>8} {'floor':>8} {'/floor':>7} {'/AR':>6} {'draft':>7} {'verify':>7} {'other':>6}")
    for r in rec["rounds"]:
        label = r["method"] + (f"-{r['budget']}" if r["budget"] else "") + (f" ({r['drafter']})" if r.get("drafter") else "")
        floor = f"{r['floor_ms']:8.1f} {r['over_floor']:7.2f}" if "floor_ms" in r else f"{'':>8} {'':>7}"
        turns = f"  (median of turns {r['round_ms_median_of_turns']:.1f})" if "round_ms_median_of_turns" in r else ""
        print(f"{label:>9} {r['round_ms']:8.1f} {floor} {r['over_ar']:6.2f} "
              f"{r['draft_ms']:7.1f} {r['verify_ms']:7.1f} {r['overhead_ms']:6.1f}{turns}")
    if "routes_ab" in rec:
        ab, o = rec["routes_ab"], args.compare_routes or "baseline"
        print(f"current CPU path (auto) vs {o}, min ms auto / {o} ({o} ÷ auto):")
        print("  " + "  ".join(f"{'v' + str(r['n']) if r['n'] != 'draft' else 'draft'} {r['auto_ms']:.1f} / {r[o + '_ms']:.1f} "
                               f"({r[o + '_over_auto']:.2f})" for r in ab["probes"]))
        print("  " + "  ".join(f"{r['method']}{'-' + str(r['budget']) if r['budget'] else ''} {r['auto_ms']:.1f} / "
                               f"{r[o + '_ms']:.1f} ({r[o + '_over_auto']:.2f})" for r in ab["rounds"]))
    print("routes chosen: " + "; ".join(f"{shape}: " + " ".join(f"{rows}→{v['route']}" for rows, v in per.items())
                                        for shape, per in rec["tuned_routes"].items()))


def routes_ab(tm, d, prompt: list[int], args, ar_ms: float) -> dict:
    """verify(n ≤ 17), the drafter's pass and the rounds two ways, alternating call by call (probes) or run by run
    (rounds) so host noise hits both alike, min of each: `auto` = the engine's CPU path (measured routes, fused
    q/k/v and gate/up) and the other policy `args.compare_routes`: `fixed` = the former path
    (DRAFTFORGE_CPU_LINEAR=fixed, each projection on its own) or `library` (measured routes without the engine's
    kernel, fused); or, with `args.compare_kernel`, `baseline` = the same routes with the kernel built from that
    source. other ÷ auto > 1: the current path is faster."""
    import dataclasses

    from draftforge.engine.blocks import FusedLayer
    from draftforge.engine.fused import plain_blocks
    from draftforge.engine.target import LayerRuntime

    unfused = dataclasses.replace(tm, runtime=LayerRuntime(fused=[FusedLayer() for _ in tm.kinds], blocks=plain_blocks()))
    from draftforge.engine import cpu_kernel

    keep = os.environ.get("DRAFTFORGE_CPU_LINEAR")
    other = args.compare_routes or "baseline"
    ways = {"auto": ("auto", tm), other: ("auto" if other == "baseline" else other, unfused if other == "fixed" else tm)}
    kernels = {"auto": cpu_kernel._modules["skinny_linear"] if cpu_kernel.available() else None}
    kernels[other] = kernels["auto"]
    if args.compare_kernel:
        if kernels["auto"] is None:
            raise SystemExit(f"--compare-kernel: the engine's kernel is unavailable here ({cpu_kernel.unavailable_reason()})")
        kernels[other] = cpu_kernel.build(Path(args.compare_kernel), "draftforge_skinny_linear_baseline")

    def use(way: str) -> Any:
        os.environ["DRAFTFORGE_CPU_LINEAR"] = ways[way][0]
        if kernels[way] is not None:
            cpu_kernel._modules["skinny_linear"] = kernels[way]
        return ways[way][1]

    out: dict = {"probes": [], "rounds": []}
    n_tok = args.rounds + 4
    methods = [("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    probes = [(n, {w: verify_probe(t, prompt, n) for w, (_, t) in ways.items()}) for n in SIZES if n <= 17]
    probes.append(("draft", {w: draft_probe(tm, d, args.prompt_len) for w in ways}))
    try:
        for n, fns in probes:
            times: dict[str, list[float]] = {"auto": [], other: []}
            for i in range(2 * (args.reps + 2)):
                way = ("auto", other)[i % 2]
                use(way)
                t0 = time.perf_counter()
                fns[way]()
                times[way].append(1e3 * (time.perf_counter() - t0))
            auto, alt = min(times["auto"][1:]), min(times[other][1:])  # the first call of each: warm-up, tuning
            out["probes"].append({"n": n, "auto_ms": auto, f"{other}_ms": alt, f"{other}_over_auto": alt / auto})
        for name, b in methods:
            rounds: dict[str, list[float]] = {"auto": [], other: []}
            for i in range(6):
                way = ("auto", other)[i % 2]
                t = use(way)
                if i < 2:
                    warm_up(t, make_method(name, t, d, b), prompt, b)
                rounds[way].append(round_times(generate(t, make_method(name, t, d, b), prompt, n_tok), 1)["round_ms"])
            auto, alt = min(rounds["auto"]), min(rounds[other])
            out["rounds"].append({"method": name, "budget": b, "auto_ms": auto, f"{other}_ms": alt,
                                  f"{other}_over_auto": alt / auto, "auto_over_ar": auto / ar_ms})  # fmt: skip
    finally:
        if kernels["auto"] is not None:
            cpu_kernel._modules["skinny_linear"] = kernels["auto"]
        if keep is None:
            os.environ.pop("DRAFTFORGE_CPU_LINEAR", None)
        else:
            os.environ["DRAFTFORGE_CPU_LINEAR"] = keep
    return out


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
