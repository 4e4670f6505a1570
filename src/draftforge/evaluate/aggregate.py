"""Per-response records → one row per (dataset, temperature, method, budget) (metrics: docs/architecture.md, "Decoding and metrics").

Records carry `repeat` (timed pass, runner.run_dataset) and `split` ("eval" / "calibration"); rows are
built from the eval records, calibration records only choose the auto budget (evaluate/budget.py).

- tokens_per_s: per repeat, decode tokens / decode seconds summed over responses (prefill, TTFT and the
  draft's first context prefill excluded); the row reports the median over repeats and
  tokens_per_s_min / tokens_per_s_max (the spread: with a handful of repeats min..max is what there is).
- speedup_vs_ar: per repeat, mean TPOT(AR) / mean TPOT(method) on the same prompts; the row reports the
  median of these per-repeat ratios (and their min / max), not the ratio of medians: each per-repeat
  ratio pairs AR and the method timed side by side, prompt by prompt, so a slow period that lands on a
  repeat scales both and cancels, while a ratio of medians may divide numbers from different periods.
- tpot_ms, ttft_ms, stage_ms: medians over repeats of the per-repeat means.
- tau: tokens committed per target verification forward, bonus included, over all rounds (first repeat:
  tokens are deterministic, repeats only re-time; `repeat_mismatches` counts responses of later
  repeats whose tokens differ from the first's — 0 expected at T = 0).
- lossless_mismatches (T = 0 only): responses whose tokens differ from AR's on the same prompt/turn.
- prompt_tokens: the mean prompt length (tokens, each turn's whole context) of the row's responses.
- sampling_check (T > 0, records with `pit` values): the χ² uniformity test of the row's PIT values
  (evaluate/sampling_check.py), the lossless check at T > 0.
- by_category (records with a `category`): per prompt category, τ, rounds, prompts, prompt_tokens and
  speedup_vs_ar computed as the row's from that category's responses only (a set's single category repeats
  the row's figures).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any, Sequence

from draftforge.drafter.registry import method_order, source_key_of_method, tree_methods
from draftforge.evaluate.budget import mark_auto
from draftforge.evaluate.sampling_check import uniformity
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


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def _spread(xs: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the known values."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def _by_repeat(rs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rs:
        out[int(r.get("repeat", 0))].append(r)
    return dict(sorted(out.items()))


def _tokens_per_s(rs: list[dict[str, Any]]) -> float | None:
    decode_s = sum(r["decode_s"] for r in rs)
    return sum(r["n_decode"] for r in rs) / decode_s if decode_s > 0 else None


def _speedups(rs: list[dict[str, Any]], ar_rs: list[dict[str, Any]]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) over repeats of mean TPOT(AR) ÷ mean TPOT(method), each repeat's pair side by side."""
    base = {k: _mean([r["tpot_s"] for r in rep]) for k, rep in _by_repeat(ar_rs).items()}
    mine = {k: _mean([r["tpot_s"] for r in rep]) for k, rep in _by_repeat(rs).items()}
    return _spread([base[k] / t for k, t in mine.items() if base.get(k) and t])


def by_category(all_rs: list[dict[str, Any]], ar_rs: list[dict[str, Any]], first_repeat: int) -> dict[str, dict[str, Any]]:
    """{category: {tau, rounds, n_prompts, prompt_tokens (mean), speedup_vs_ar}} of one row's responses (empty
    when none has a category)."""
    out: dict[str, dict[str, Any]] = {}
    for cat in sorted({str(r["category"]) for r in all_rs if r.get("category") is not None}):
        rs = [r for r in all_rs if r.get("category") == cat]
        accepts = [a for r in rs if int(r.get("repeat", 0)) == first_repeat for a in r["accept_lengths"]]
        out[cat] = {"tau": sum(accepts) / len(accepts) if accepts else None, "rounds": len(accepts),
                    "n_prompts": len({r["prompt_index"] for r in rs}), "prompt_tokens": _mean([r.get("prompt_len") for r in rs]),
                    "speedup_vs_ar": _speedups(rs, [r for r in ar_rs if r.get("category") == cat])[0]}
    return out


def aggregate(records: list[dict[str, Any]], engine: str = "draftforge", calibration_prompts: int = 0,
              check_bins: int = 10, check_alpha: float = 0.001) -> list[Row]:
    """Rows of every set's records: `rows_of` the eval records, then the auto budget chosen from the calibration
    records (split "calibration") when `calibration_prompts` (the requested evaluate.calibration_prompts) > 0
    (`budget.mark_auto`, which pools the round cost over every set given here)."""
    rows = rows_of(records, engine, check_bins, check_alpha)
    mark_auto(rows, calibration_records(records), calibration_prompts)
    return rows


def calibration_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("split", "eval") == "calibration"]


def rows_of(records: list[dict[str, Any]], engine: str = "draftforge", check_bins: int = 10,
            check_alpha: float = 0.001) -> list[Row]:
    """Rows of the eval records (all repeats; calibration records are skipped), the oracle budget marked; no auto
    budget (that needs every set's calibration: `budget.mark_auto`). check_bins / check_alpha: the T > 0 rows'
    uniformity test (evaluate.sampling_check)."""
    records = [r for r in records if r.get("split", "eval") == "eval"]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[_key(r)].append(r)
    first_repeat = min((int(r.get("repeat", 0)) for r in records), default=0)
    first = {k: [r for r in rs if int(r.get("repeat", 0)) == first_repeat] for k, rs in groups.items()}
    ar_tokens = {(r["dataset"], float(r["temperature"]), r["prompt_index"], r["turn"]): r["tokens"]
                 for r in records if r["method"] == "ar" and int(r.get("repeat", 0)) == first_repeat}
    ar_records = {(d, t): rs for (d, t, m, _), rs in groups.items() if m == "ar"}
    rows: list[Row] = []
    order = method_order()  # ar, the chains, then the trees by budget
    for (dataset, temp, method, budget), all_rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 9), kv[0][3] or 0)):
        rs = first[(dataset, temp, method, budget)]
        reps = _by_repeat(all_rs)
        accepts = [a for r in rs for a in r["accept_lengths"]]
        decode_tokens = sum(r["n_decode"] for r in rs)
        tps, tps_min, tps_max = _spread([_tokens_per_s(rep) for rep in reps.values()])
        ar_rs = ar_records.get((dataset, temp), [])
        speedup, speedup_min, speedup_max = _speedups(all_rs, ar_rs)
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
        ref_tokens = {(r["prompt_index"], r["turn"]): r["tokens"] for r in rs}
        repeat_mismatches = sum(1 for r in all_rs if int(r.get("repeat", 0)) != first_repeat
                                and r["tokens"] != ref_tokens.get((r["prompt_index"], r["turn"])))  # fmt: skip
        stage_ms = {s: _ms(_median([_mean([x for r in rep for x in r["stage_s"].get(s, [])]) for rep in reps.values()]))
                    for s in STAGES}  # fmt: skip
        known = [v for v in stage_ms.values() if v is not None]
        round_ms = sum(known) if known else None  # mean round = sum of mean stage times
        overhead = (stage_ms["build"] or 0) + (stage_ms["commit"] or 0)
        rows.append(new_row(
            dataset, method, engine, temp, budget=budget,
            tokens_per_s=tps, tokens_per_s_min=tps_min, tokens_per_s_max=tps_max,
            tpot_ms=_ms(_median([_mean([r["tpot_s"] for r in rep]) for rep in reps.values()])),
            ttft_ms=_ms(_median([_mean([r["ttft_s"] for r in rep]) for rep in reps.values()])),
            tau=sum(accepts) / len(accepts) if accepts else None,
            speedup_vs_ar=speedup, speedup_vs_ar_min=speedup_min, speedup_vs_ar_max=speedup_max,
            repeats=len(reps), repeat_mismatches=repeat_mismatches,
            lossless_mismatches=mismatches, mismatch_positions=mismatch_at,
            n_prompts=len({r["prompt_index"] for r in rs}), n_responses=len(rs),
            prompt_tokens=_mean([r.get("prompt_len") for r in rs]),
            decode_tokens=decode_tokens, rounds=len(accepts),
            tau_histogram={str(k): v for k, v in sorted(Counter(accepts).items())},
            stage_ms=stage_ms, round_ms=round_ms,
            overhead_pct=100.0 * overhead / round_ms if round_ms and method != "ar" else None,
            draft_prefill_ms=_ms(_median([_mean([r["draft_prefill_s"] for r in rep]) for rep in reps.values()])) if method != "ar" else None,
            by_category=by_category(all_rs, ar_rs, first_repeat),
        ))  # fmt: skip
        pit = [u for r in rs for u in r.get("pit") or []]
        if pit:
            rows[-1]["sampling_check"] = uniformity(pit, check_bins, check_alpha)
        source_key = source_key_of_method(method)  # whose weights ran it (an MTP row: native / trained)
        if source_key:
            rows[-1][source_key] = rs[0].get(source_key)
    mark_best(rows)
    return rows


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000.0 * s


def mark_best(rows: list[dict[str, Any]]) -> None:
    """Flag the budget with the highest tokens/s per (dataset, temperature) of each tree method: chosen on
    the evaluation data itself, as the published numbers do."""
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        if row["method"] not in tree_methods() or row["tokens_per_s"] is None:
            continue
        k = (row["dataset"], row["temperature"], row["method"])
        if k not in best or row["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = row
    for row in rows:
        if row["method"] in tree_methods():
            row["best_budget"] = best.get((row["dataset"], row["temperature"], row["method"])) is row
