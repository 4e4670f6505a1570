"""Worker results → report rows (the keys shared with `evaluate`), speedup, lossless check.

Pure functions over plain dicts. Invariants: a row carries numbers only when its method's engine
ran (status "ok"); skipped/failed rows carry the reason and nulls. Speedup = mean TPOT(vLLM AR) /
mean TPOT(method) on the same dataset and temperature; lossless mismatches count, at T = 0, prompts
whose tokens differ from vLLM AR's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from draftforge.baselines.metrics import acceptance, check_consistency, delta, timing_summary
from draftforge.rows import Row, new_row

ENGINE = "vllm"


def empty_row(method: str, dataset: str, temperature: float, status: str, reason: str | None) -> Row:
    return new_row(dataset, method, ENGINE, temperature, status=status, reason=reason)


def segment_summary(segment: Mapping[str, Any]) -> dict[str, Any]:
    """Counters delta → acceptance; per-prompt records → timing. Consistency problems listed, not hidden."""
    d = delta(segment["metrics_before"], segment["metrics_after"])
    acc = acceptance(d)
    return {"counters_delta": d, "acceptance": acc, "timing": timing_summary(segment["prompts"]), "consistency_problems": check_consistency(acc)}  # fmt: skip


def method_rows(method: str, result: Mapping[str, Any], segments_plan: Sequence[Mapping[str, Any]], num_spec: int | None) -> list[dict[str, Any]]:
    """One row per (dataset, temperature) of the plan; numbers only from an "ok" result."""
    status = result.get("status", "failed")
    if status != "ok":
        return [empty_row(method, s["dataset"], s["temperature"], status, result.get("reason")) for s in segments_plan]
    rows = []
    for seg in result["segments"]:
        summary = segment_summary(seg)
        acc, timing = summary["acceptance"], summary["timing"]
        row = empty_row(method, seg["dataset"], seg["temperature"], "ok", None)
        tau = 1.0 if method == "ar" else acc["tau"]  # AR: one token per target forward by definition
        row.update(
            tokens_per_s=timing["tokens_per_s"],
            tpot_ms=timing["tpot_ms"],
            ttft_ms=timing["ttft_ms"],
            tau=tau,
            n_prompts=timing["n_prompts"],
            num_speculative_tokens=num_spec,
            wall_tokens_per_s=timing["wall_tokens_per_s"],
            output_tokens=timing["output_tokens"],
            num_drafts=acc["num_drafts"],
            num_draft_tokens=acc["num_draft_tokens"],
            num_accepted_tokens=acc["num_accepted_tokens"],
            draft_acceptance_rate=acc["draft_acceptance_rate"],
            acceptance_per_pos=acc["acceptance_per_pos"],
            counter_problems=summary["consistency_problems"] or None,
        )
        # vLLM's τ counts only steps that drafted; n-gram steps without a match verify 1 token. Over all
        # decode steps: tokens after the first / (those tokens − accepted) (the last step may overshoot).
        decode_tokens = acc["generation_tokens"] - timing["n_prompts"]
        steps = decode_tokens - acc["num_accepted_tokens"]
        row["tau_all_steps"] = decode_tokens / steps if steps > 0 else None
        if method != "ar" and acc["num_drafts"] == 0:
            row["reason"] = "no drafts were proposed: τ undefined"
        rows.append(row)
    return rows


def _tokens_by_prompt(result: Mapping[str, Any]) -> dict[tuple[str, float], dict[str, list[int]]]:
    out: dict[tuple[str, float], dict[str, list[int]]] = {}
    for seg in result.get("segments") or []:
        out[(seg["dataset"], float(seg["temperature"]))] = {p["id"]: p["token_ids"] for p in seg["prompts"]}
    return out


def add_comparisons(rows: list[dict[str, Any]], results: Mapping[str, Mapping[str, Any]]) -> None:
    """Fill speedup_vs_ar (all temperatures) and lossless_mismatches (T = 0) against the vLLM AR rows."""
    ar_rows = {(r["dataset"], r["temperature"]): r for r in rows if r["method"] == "ar" and r["status"] == "ok"}
    ar_tokens = _tokens_by_prompt(results.get("ar", {})) if results.get("ar", {}).get("status") == "ok" else {}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["dataset"], row["temperature"])
        ar = ar_rows.get(key)
        if ar and ar["tpot_ms"] and row["tpot_ms"]:
            row["speedup_vs_ar"] = ar["tpot_ms"] / row["tpot_ms"]
        if row["temperature"] == 0.0 and key in ar_tokens:
            mine = _tokens_by_prompt(results[row["method"]]).get(key, {})
            ref = ar_tokens[key]
            row["lossless_mismatches"] = sum(1 for pid, toks in mine.items() if ref.get(pid) != toks)


def concurrency_rows(method: str, result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Sweep results: aggregate output tokens/s over the wall time of c simultaneous requests, and τ."""
    if result.get("status") != "ok":
        return [{"method": method, "engine": ENGINE, "status": result.get("status", "failed"), "reason": result.get("reason")}]
    rows = []
    for rec in result.get("concurrency") or []:
        acc = acceptance(delta(rec["metrics_before"], rec["metrics_after"]))
        rows.append({
            "method": method, "engine": ENGINE, "status": "ok", "reason": None, "concurrency": rec["concurrency"],
            "n_requests": rec["n_requests"], "output_tokens": rec["output_tokens"], "wall_s": rec["wall_s"],
            "tokens_per_s": rec["output_tokens"] / rec["wall_s"] if rec["wall_s"] > 0 else None,
            "tau": 1.0 if method == "ar" else acc["tau"], "acceptance_per_pos": acc["acceptance_per_pos"],
        })  # fmt: skip
    return rows
