"""Result rows: one per dataset × method × budget × temperature, built by `evaluate` (standalone engine)
and `baselines` (vLLM) and joined by `report` into one table (torch-free)."""

from __future__ import annotations

from typing import Any, Optional, TypedDict


class Row(TypedDict, total=False):
    """The keys every result row carries (None when not measured); stages add their own extra keys."""

    dataset: str
    engine: str  # "draftforge" (evaluate) or "vllm" (baselines)
    drafter: Optional[str]  # the drafter branch that measured the row (conf/drafter/<name>.yaml)
    method: str
    budget: Optional[int]  # DDTree node budget; None for other methods
    temperature: float
    n_prompts: Optional[int]
    tokens_per_s: Optional[float]
    tpot_ms: Optional[float]
    ttft_ms: Optional[float]
    tau: Optional[float]  # tokens committed per target verification forward, bonus included
    speedup_vs_ar: Optional[float]  # mean TPOT(AR) / mean TPOT(method), same engine and prompts
    lossless_mismatches: Optional[int]  # T = 0: responses whose tokens differ from AR's
    status: str  # "ok", "skipped" or "failed"
    reason: Optional[str]
    mtp_source: Optional[str]  # method mtp: "native" (the target's MTP layers) or "trained" (train/mtp)


# The shared keys in summary.csv column order.
ROW_KEYS: tuple[str, ...] = (
    "dataset", "engine", "drafter", "method", "budget", "temperature", "n_prompts", "tokens_per_s", "tpot_ms",
    "ttft_ms", "tau", "speedup_vs_ar", "lossless_mismatches", "status",
)  # fmt: skip


def new_row(dataset: str, method: str, engine: str, temperature: float, **values: Any) -> Row:
    """A row with every shared key (None unless given in `values`, status "ok"), plus any extra `values`."""
    row: dict[str, Any] = {k: None for k in ROW_KEYS}
    row.update(dataset=dataset, method=method, engine=engine, temperature=float(temperature), status="ok")
    row.update(values)
    return row  # type: ignore[return-value]
