"""Worker results → report rows (the keys shared with `evaluate`), speedup, lossless check, parity.

Pure functions over plain dicts. Invariants: a row carries numbers only when its method's engine
ran (status "ok"); skipped/failed rows carry the reason and nulls. Speedup = mean TPOT(vLLM AR) /
mean TPOT(method) on the same dataset and temperature; lossless mismatches count, at T = 0, prompts
whose tokens differ from vLLM AR's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftforge.baselines.metrics import acceptance, check_consistency, delta, timing_summary

ENGINE = "vllm"
ROW_KEYS = ("dataset", "method", "budget", "engine", "temperature", "tokens_per_s", "tpot_ms", "ttft_ms", "tau",
            "speedup_vs_ar", "lossless_mismatches", "n_prompts")  # fmt: skip


def empty_row(method: str, dataset: str, temperature: float, status: str, reason: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_KEYS}
    row.update(dataset=dataset, method=method, engine=ENGINE, temperature=float(temperature), status=status, reason=reason)
    return row


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


def standalone_dflash_tau(evaluate_marker: Path, method: str = "dflash") -> dict[str, dict[str, Any]]:
    """Our engine's rows of `method` (DFlash by default) at T = 0 per dataset, from the evaluate stage's marker."""
    try:
        data = json.loads(evaluate_marker.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    found: dict[str, dict[str, Any]] = {}
    for row in data.get("rows") or [] if isinstance(data, dict) else []:
        if not isinstance(row, dict) or row.get("method") != method or row.get("engine") == ENGINE:
            continue
        if row.get("tau") is None or float(row.get("temperature") or 0.0) != 0.0:
            continue
        found.setdefault(str(row.get("dataset")), row)
    return found


def parity_block(rows: Sequence[Mapping[str, Any]], evaluate_dir: Path, tolerance: float, method: str = "dflash") -> dict[str, Any]:
    """vLLM τ beside our standalone τ of one method (DFlash, or the MTP head), same prompts, T = 0
    (|Δ| / standalone ≤ tolerance)."""
    marker = evaluate_dir / "evaluate.json"
    block: dict[str, Any] = {"tolerance": tolerance, "source": str(marker), "datasets": {}, "all_within": None}
    if not marker.is_file():
        block["available"] = False
        block["reason"] = "no finished evaluate stage (evaluate.json): run evaluate, then rerun baselines"
        return block
    ours = standalone_dflash_tau(marker, method)
    vllm_rows = {r["dataset"]: r for r in rows if r["method"] == method and r["temperature"] == 0.0 and r.get("tau") is not None}
    for dataset in sorted(set(ours) | set(vllm_rows)):
        mine, theirs = vllm_rows.get(dataset), ours.get(dataset)
        entry: dict[str, Any] = {
            "vllm_tau": mine["tau"] if mine else None,
            "standalone_tau": float(theirs["tau"]) if theirs else None,
            "vllm_n_prompts": mine["n_prompts"] if mine else None,
            "standalone_n_prompts": theirs.get("n_prompts") if theirs else None,
            "rel_diff": None,
            "within_tolerance": None,
        }
        if mine and theirs and float(theirs["tau"]) > 0:
            entry["rel_diff"] = abs(mine["tau"] - float(theirs["tau"])) / float(theirs["tau"])
            entry["within_tolerance"] = entry["rel_diff"] <= tolerance
        block["datasets"][dataset] = entry
    checked = [e["within_tolerance"] for e in block["datasets"].values() if e["within_tolerance"] is not None]
    block["available"] = bool(checked)
    if checked:
        block["all_within"] = all(checked)
    else:
        block["reason"] = f"no dataset has both a vLLM {method} τ and a standalone {method} τ at T=0"
    return block


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
