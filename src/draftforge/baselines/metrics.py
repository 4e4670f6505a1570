"""vLLM's own counters → τ, per-position acceptance, timing summaries (pure Python, no vLLM import).

A snapshot is the plain form of `llm.get_metrics()`:
    {"counters": {name: int summed over label sets}, "vectors": {name: [int per position]}}
Every figure comes from the difference of two snapshots taken around a measured segment, so the
warm-up (and earlier segments in the same engine) never count.

τ (acceptance length, docs/architecture.md "Decoding and metrics") = tokens committed per target verification step, bonus included
= 1 + Δaccepted / Δdrafts. Per-position acceptance rate p_k = Δaccepted_per_pos[k] / Δdrafts.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)


def snapshot(metrics: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Plain snapshot of vLLM Metric objects (Counter has .value, Vector has .values; others skipped).

    Label sets of one name (engine index, model name) are summed: we run one engine per process.
    """
    counters: dict[str, int] = {}
    vectors: dict[str, list[int]] = {}
    for metric in metrics:
        if hasattr(metric, "values") and isinstance(metric.values, list):
            old = vectors.get(metric.name, [])
            new = [int(v) for v in metric.values]
            width = max(len(old), len(new))
            vectors[metric.name] = [
                (old[i] if i < len(old) else 0) + (new[i] if i < len(new) else 0) for i in range(width)
            ]
        elif type(metric).__name__ == "Counter":
            counters[metric.name] = counters.get(metric.name, 0) + int(metric.value)
    return {"counters": counters, "vectors": vectors}


def delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """after − before, counter by counter (a counter absent before counts from 0)."""
    counters = {
        name: int(value) - int(before.get("counters", {}).get(name, 0))
        for name, value in after.get("counters", {}).items()
    }
    vectors: dict[str, list[int]] = {}
    for name, values in after.get("vectors", {}).items():
        old = list(before.get("vectors", {}).get(name, []))
        vectors[name] = [int(v) - (int(old[i]) if i < len(old) else 0) for i, v in enumerate(values)]
    for name, values in {**counters, **{k: min(v, default=0) for k, v in vectors.items()}}.items():
        if values < 0:
            raise ValueError(f"metric {name} decreased between snapshots: not a monotonic counter")
    return {"counters": counters, "vectors": vectors}


def acceptance(d: Mapping[str, Any]) -> dict[str, Any]:
    """τ and acceptance figures from a snapshot delta; all None when no drafts happened (AR)."""
    counters = d.get("counters", {})
    drafts = int(counters.get(DRAFTS, 0))
    accepted = int(counters.get(ACCEPTED, 0))
    draft_tokens = int(counters.get(DRAFT_TOKENS, 0))
    per_pos = [int(v) for v in d.get("vectors", {}).get(ACCEPTED_PER_POS, [])]
    out: dict[str, Any] = {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "generation_tokens": int(counters.get(GENERATION_TOKENS, 0)),
        "tau": None,
        "draft_acceptance_rate": None,
        "acceptance_per_pos": None,
    }
    if drafts > 0:
        out["tau"] = 1.0 + accepted / drafts
        out["draft_acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
        out["acceptance_per_pos"] = [v / drafts for v in per_pos]
    return out


def check_consistency(acc: Mapping[str, Any]) -> list[str]:
    """Invariants of vLLM's counters; a non-empty list means the numbers cannot be trusted."""
    problems = []
    per_pos = acc.get("accepted_per_pos") or []
    if per_pos and sum(per_pos) != acc["num_accepted_tokens"]:
        problems.append(f"sum(accepted_per_pos)={sum(per_pos)} != accepted={acc['num_accepted_tokens']}")
    if any(b > a for a, b in zip(per_pos, per_pos[1:])):
        problems.append(f"accepted_per_pos not non-increasing: {per_pos}")
    if acc["num_accepted_tokens"] > acc["num_draft_tokens"]:
        problems.append("more accepted tokens than draft tokens")
    return problems


def timing_summary(prompts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Decode tokens/s, TPOT and TTFT over the prompts of one segment.

    Decode excludes prefill: tokens after the first one, over the time from first to last token.
    tokens_per_s = Σ(n_output − 1) / Σ decode_s; tpot_ms = mean over prompts of decode_s / (n_output − 1)
    (speedup = mean TPOT(AR) / mean TPOT(method)); wall tokens/s = Σ n_output / Σ wall_s, reported apart.
    """
    decoded = [p for p in prompts if p.get("decode_s") and p["n_output"] > 1]
    n_out = sum(int(p["n_output"]) for p in prompts)
    wall = sum(float(p["wall_s"]) for p in prompts)
    out: dict[str, Any] = {
        "n_prompts": len(prompts),
        "output_tokens": n_out,
        "wall_s": wall,
        "wall_tokens_per_s": n_out / wall if wall > 0 else None,
        "tokens_per_s": None,
        "tpot_ms": None,
        "ttft_ms": None,
    }
    if decoded:
        tokens = sum(int(p["n_output"]) - 1 for p in decoded)
        seconds = sum(float(p["decode_s"]) for p in decoded)
        out["tokens_per_s"] = tokens / seconds if seconds > 0 else None
        out["tpot_ms"] = 1000.0 * statistics.fmean(float(p["decode_s"]) / (int(p["n_output"]) - 1) for p in decoded)
    ttfts = [float(p["ttft_s"]) for p in prompts if p.get("ttft_s") is not None]
    if ttfts:
        out["ttft_ms"] = 1000.0 * statistics.fmean(ttfts)
    return out
