"""Collect the comparable rows of `evaluate` (standalone engine) and `baselines` (vLLM) into one table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftforge.drafter.registry import reference_type, source_key_of_method, tree_methods
from draftforge.errors import StageError
from draftforge.io import read_json
from draftforge.rows import ROW_KEYS

# One row per dataset × method × budget; the columns of summary.csv in this order: the shared keys, then the
# standalone engine's timing spread over repeats and its tree-budget flags (empty for vLLM rows), then the label of a
# drafter measured in another chat mode than it was trained in (empty unless allow_chat_mode_mismatch ran it).
COLUMNS: tuple[str, ...] = ROW_KEYS + (
    "tokens_per_s_min", "tokens_per_s_max", "speedup_vs_ar_min", "speedup_vs_ar_max", "repeats",
    "auto_budget", "best_budget", "chat_mode_mismatch",
)  # fmt: skip
AUTO_NAME = "auto budget (calibrated)"
AUTO_GOAL = 0.9  # auto tokens/s ÷ oracle tokens/s below this: the report says why
BEST_NAME = "best budget (oracle, chosen on eval data)"


def _rows_of(data: Any, path: Path, engine: str) -> list[dict[str, Any]]:
    """The `rows` of one stage's loaded marker JSON (read from `path`), each with engine and status."""
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise StageError(f"{path}: expected a 'rows' list")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "method" not in row:
            raise StageError(f"{path}: rows[{i}] lacks 'method'")
        out.append({"engine": row.get("engine", engine), "status": row.get("status", "ok"), **row})
    return out


def collect_rows(evaluate_jsons: Sequence[Path], baselines_jsons: Sequence[Path]) -> list[dict[str, Any]]:
    """Both engines' rows from every drafter branch (the evaluate and baselines markers), sorted by dataset,
    engine, drafter, method, budget."""
    rows: list[dict[str, Any]] = []
    for path in evaluate_jsons:
        rows += _rows_of(read_json(path, what="draftforge results"), path, "draftforge")
    for path in baselines_jsons:
        rows += _rows_of(read_json(path, what="vllm results"), path, "vllm")
    return sorted(rows, key=lambda r: (str(r.get("dataset")), r["engine"], str(r.get("drafter")), r["method"],
                                       to_float(r.get("budget"), -1)))


def to_float(value: Any, default: float = math.nan) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def best_ddtree(rows: list[dict[str, Any]], methods: Sequence[str] | None = None,
                drafter: str | None = None) -> dict[str, dict[str, Any]]:
    """Per dataset, the tree row (of `methods`, default every registered tree method; of one drafter branch
    or any) with the highest tokens/s, chosen on the evaluation data itself."""
    methods = tree_methods() if methods is None else methods
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["method"] not in methods or row.get("status", "ok") != "ok":
            continue
        if drafter is not None and row.get("drafter") != drafter:
            continue
        current = best.get(row.get("dataset"))
        if current is None or to_float(row.get("tokens_per_s"), 0) > to_float(current.get("tokens_per_s"), 0):
            best[row.get("dataset")] = row
    return best


def budget_choices(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, temperature, drafter branch, tree method) of the standalone engine: the auto (calibrated)
    and the oracle-best budget's rows, auto tokens/s ÷ oracle tokens/s, and why there is no auto budget if so."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("engine") == "draftforge" and row["method"] in tree_methods() and row.get("status", "ok") == "ok":
            key = (str(row.get("dataset")), to_float(row.get("temperature"), 0.0), str(row.get("drafter")), row["method"])
            groups.setdefault(key, []).append(row)
    out = []
    for (dataset, temp, drafter, method), group in sorted(groups.items()):
        auto = next((r for r in group if r.get("auto_budget")), None)
        best = next((r for r in group if r.get("best_budget")), None)
        if best is None:  # rows without flags: today's rule, highest tokens/s
            best = max(group, key=lambda r: to_float(r.get("tokens_per_s"), -1.0))
        ratio = None
        if auto is not None and to_float(best.get("tokens_per_s"), 0) > 0:
            ratio = to_float(auto.get("tokens_per_s")) / to_float(best["tokens_per_s"])
        note = next((r["auto_budget_note"] for r in group if r.get("auto_budget_note")), None)
        if auto is None and note is None:
            note = "these rows carry no auto budget (evaluate ran without calibration)"
        why = miss_reasons(auto, best, group) if ratio is not None and ratio < AUTO_GOAL else []
        out.append({"dataset": dataset, "temperature": temp, "drafter": drafter, "method": method, "auto": auto, "best": best,
                    "auto_vs_best": ratio, "note": note, "why": why,
                    "calibration_prompts": max((int(r.get("calibration_prompts") or 0) for r in group), default=0)})
    return out


def _seen(r: dict[str, Any]) -> str:
    """One budget's calibration (evaluation) τ and round cost."""
    return (f"{r.get('budget')}: τ {fmt(r.get('calibration_tau'))} ({fmt(r.get('tau'))}), round "
            f"{fmt(r.get('calibration_round_ms'), 0)} ({fmt(r.get('round_ms'), 0)}) ms")


def miss_reasons(auto: dict[str, Any], best: dict[str, Any], group: list[dict[str, Any]]) -> list[str]:
    """Why the auto budget's tokens/s falls short of the oracle's: timing noise (overlapping repeat spreads, or
    one pass), calibration prompts that mispredict τ (the rule on the evaluation data picks the oracle's
    budget), or a rule whose cost model misses time outside rounds (it picks the auto budget again)."""
    why = []
    repeats = int(auto.get("repeats") or 1)
    lo, hi = best.get("tokens_per_s_min"), auto.get("tokens_per_s_max")
    if repeats <= 1:
        why.append("one timed pass per budget: no spread to tell noise from a real difference")
    elif lo is not None and hi is not None and to_float(hi) >= to_float(lo):
        why.append(f"repeat spreads overlap (auto max {to_float(hi):.1f} ≥ oracle min {to_float(lo):.1f} tok/s): "
                   f"not distinguishable at {repeats} repeats")
    scored = [r for r in group if to_float(r.get("round_ms"), 0) > 0 and r.get("tau") is not None]
    if scored:
        on_eval = max(scored, key=lambda r: to_float(r["tau"]) / to_float(r["round_ms"]))
        if on_eval.get("budget") == best.get("budget"):
            why.append(f"the τ ÷ round-cost rule on the evaluation prompts picks {best.get('budget')}, as the oracle does; "
                       f"calibration (evaluation) prompts measured {_seen(auto)}; {_seen(best)} — "
                       "more calibration prompts or repeats narrow this")
        elif on_eval.get("budget") == auto.get("budget"):
            why.append(f"the rule picks {auto.get('budget')} on the evaluation prompts too: time outside the rounds "
                       "(prefill, first token) or timing noise separates it from the highest-tokens/s budget")
        else:
            why.append(f"the rule on the evaluation prompts picks {on_eval.get('budget')}, a third budget: τ and round "
                       "costs differ between the calibration and evaluation prompts")
    return why


def with_spread(row: dict[str, Any], key: str, digits: int) -> str:
    """`median [min–max]` when the row carries a spread over repeats, else the value alone."""
    value = fmt(row.get(key), digits)
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if value and lo is not None and hi is not None and int(row.get("repeats") or 1) > 1:
        value += f" [{fmt(lo, digits)}–{fmt(hi, digits)}]"
    return value


def method_label(row: dict[str, Any]) -> str:
    """The method as the report names it: a row of a type with a source key says whose weights ran it
    ("mtp (native)" / "mtp (trained)")."""
    key = source_key_of_method(str(row.get("method")))
    source = row.get(key) if key else None
    return f"{row['method']} ({source})" if source else str(row["method"])


def vs_mtp(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dataset: the best tree row's tokens/s (standalone engine, any drafter branch, any tree method, each
    at its auto budget where evaluate calibrated one)
    ÷ the reference chain's tokens/s in each engine (the registry's tree-reference type, MTP:
    {dataset: {"ddtree_tokens_per_s", "ddtree_label", <type name>: {engine: {"label", "tokens_per_s", "ratio"}}}}),
    T = 0 rows."""
    ref = reference_type()
    at_zero = [r for r in rows if to_float(r.get("temperature"), 0.0) == 0.0]
    if any(r.get("auto_budget") for r in at_zero):  # calibrated budgets only: no choice on the evaluation data
        at_zero = [r for r in at_zero if r["method"] not in tree_methods() or r.get("auto_budget")]
    best = best_ddtree(at_zero)
    out: dict[str, dict[str, Any]] = {}
    if ref is None:
        return out
    for dataset, d in sorted(best.items()):
        entry: dict[str, Any] = {"ddtree_tokens_per_s": d.get("tokens_per_s"), ref.name: {},
                                 "ddtree_label": f"{d.get('drafter')}/{d['method']}@{d.get('budget')}"}
        for r in rows:
            if r.get("dataset") != dataset or r["method"] != ref.chain_method or r.get("status", "ok") != "ok":
                continue
            if to_float(r.get("temperature"), 0.0) != 0.0 or not to_float(r.get("tokens_per_s"), 0):
                continue
            ratio = to_float(d.get("tokens_per_s"), math.nan) / to_float(r["tokens_per_s"])
            entry[ref.name][r["engine"]] = {"label": method_label(r), "tokens_per_s": r["tokens_per_s"], "ratio": ratio}
        out[dataset] = entry
    return out


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)
