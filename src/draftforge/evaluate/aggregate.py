"""Per-response records → one row per (dataset, temperature, method, budget) (metrics: docs/architecture.md, "Decoding and metrics").

- tokens_per_s: decode tokens / decode seconds summed over responses (prefill, TTFT and the draft's
  first context prefill excluded); tpot_ms: mean per-response decode time per decode token.
- tau: tokens committed per target verification forward, bonus included, over all rounds.
- speedup_vs_ar: mean TPOT(AR) / mean TPOT(method) on the same prompts.
- lossless_mismatches (T = 0 only): responses whose tokens differ from AR's on the same prompt/turn.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Sequence

from draftforge.rows import Row, new_row

STAGES = ("draft", "build", "verify", "commit")


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def _key(r: dict[str, Any]) -> tuple:
    return (r["dataset"], float(r["temperature"]), r["method"], r["budget"])


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (len of the shorter when one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def aggregate(records: list[dict[str, Any]], engine: str = "draftforge") -> list[Row]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[_key(r)].append(r)
    ar_tokens = {(r["dataset"], float(r["temperature"]), r["prompt_index"], r["turn"]): r["tokens"]
                 for r in records if r["method"] == "ar"}
    ar_tpot = {(d, t): _mean([r["tpot_s"] for r in rs]) for (d, t, m, _), rs in groups.items() if m == "ar"}
    rows: list[Row] = []
    order = {"ar": 0, "mtp": 1, "dflash": 2, "dspark": 3, "ddtree": 4, "ddtree_markov": 5}  # chains, then trees by budget
    for (dataset, temp, method, budget), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 9), kv[0][3] or 0)):
        accepts = [a for r in rs for a in r["accept_lengths"]]
        decode_tokens = sum(r["n_decode"] for r in rs)
        decode_s = sum(r["decode_s"] for r in rs)
        tpot = _mean([r["tpot_s"] for r in rs])
        base = ar_tpot.get((dataset, temp))
        mismatches = None
        mismatch_at: list[int] = []
        if temp == 0.0:
            mismatches = 0
            for r in rs:
                ref = ar_tokens.get((dataset, temp, r["prompt_index"], r["turn"]))
                at = first_mismatch(r["tokens"], ref) if ref is not None else None
                if at is not None:
                    mismatches += 1
                    mismatch_at.append(at)
        stage_ms = {s: _ms(_mean([x for r in rs for x in r["stage_s"].get(s, [])])) for s in STAGES}
        known = [v for v in stage_ms.values() if v is not None]
        round_ms = sum(known) if known else None  # mean round = sum of mean stage times
        overhead = (stage_ms["build"] or 0) + (stage_ms["commit"] or 0)
        rows.append(new_row(
            dataset, method, engine, temp, budget=budget,
            tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None,
            tpot_ms=_ms(tpot), ttft_ms=_ms(_mean([r["ttft_s"] for r in rs])),
            tau=sum(accepts) / len(accepts) if accepts else None,
            speedup_vs_ar=(base / tpot) if base and tpot else None,
            lossless_mismatches=mismatches, mismatch_positions=mismatch_at,
            n_prompts=len({r["prompt_index"] for r in rs}), n_responses=len(rs),
            decode_tokens=decode_tokens, rounds=len(accepts),
            tau_histogram={str(k): v for k, v in sorted(Counter(accepts).items())},
            stage_ms=stage_ms, round_ms=round_ms,
            overhead_pct=100.0 * overhead / round_ms if round_ms and method != "ar" else None,
            draft_prefill_ms=_ms(_mean([r["draft_prefill_s"] for r in rs])) if method != "ar" else None,
        ))  # fmt: skip
        if method == "mtp":
            rows[-1]["mtp_source"] = rs[0].get("mtp_source")
    mark_best(rows)
    return rows


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000.0 * s


def mark_best(rows: list[dict[str, Any]]) -> None:
    """Flag the budget with the highest tokens/s per (dataset, temperature) of each tree method: chosen on
    the evaluation data itself, as the published numbers do."""
    trees = ("ddtree", "ddtree_markov")
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        if row["method"] not in trees or row["tokens_per_s"] is None:
            continue
        k = (row["dataset"], row["temperature"], row["method"])
        if k not in best or row["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = row
    for row in rows:
        if row["method"] in trees:
            row["best_budget"] = best.get((row["dataset"], row["temperature"], row["method"])) is row
