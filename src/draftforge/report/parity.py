"""Train/serve parity: vLLM τ beside the standalone engine's τ of one method, same prompts, one temperature
(T = 0, and each sampling temperature both engines ran: there τ is itself an average over random draws) — the
chain method of each drafter branch: `dflash`, `dspark` (our drafters) and `mtp` (the MTP head, native
or trained).

Computed here, in `report` (the one stage that declares both `evaluate` and `baselines` as inputs), over
the rows `report.rows.collect_rows` joined: a changed evaluate or baselines result always reruns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _method_at(rows: Sequence[Mapping[str, Any]], engine: str, method: str, drafter: str | None,
               temperature: float) -> dict[str, Mapping[str, Any]]:
    """The first row of `method` (of one drafter branch, or any) at `temperature` with a τ, per dataset, of one engine."""
    found: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        if row.get("engine") != engine or row.get("method") != method or row.get("tau") is None:
            continue
        if drafter is not None and row.get("drafter") != drafter:
            continue
        if float(row.get("temperature") or 0.0) == temperature:
            found.setdefault(str(row.get("dataset")), row)
    return found


def parity_block(rows: Sequence[Mapping[str, Any]], tolerance: float, method: str = "dflash",
                 drafter: str | None = None, temperature: float = 0.0) -> dict[str, Any]:
    """Per dataset |τ_vllm − τ_standalone| / τ_standalone of `method` (of one drafter branch, or any) at
    `temperature` against `tolerance`; `all_within` over the checked."""
    ours = _method_at(rows, "draftforge", method, drafter, temperature)
    vllm = _method_at(rows, "vllm", method, drafter, temperature)
    block: dict[str, Any] = {"tolerance": tolerance, "method": method, "drafter": drafter, "temperature": temperature,
                             "datasets": {}, "all_within": None}
    for dataset in sorted(set(ours) | set(vllm)):
        mine, theirs = vllm.get(dataset), ours.get(dataset)
        entry: dict[str, Any] = {
            "vllm_tau": float(mine["tau"]) if mine else None,
            "standalone_tau": float(theirs["tau"]) if theirs else None,
            "vllm_n_prompts": mine.get("n_prompts") if mine else None,
            "standalone_n_prompts": theirs.get("n_prompts") if theirs else None,
            "rel_diff": None,
            "within_tolerance": None,
        }
        if mine and theirs and float(theirs["tau"]) > 0:
            entry["rel_diff"] = abs(float(mine["tau"]) - float(theirs["tau"])) / float(theirs["tau"])
            entry["within_tolerance"] = entry["rel_diff"] <= tolerance
        block["datasets"][dataset] = entry
    checked = [e["within_tolerance"] for e in block["datasets"].values() if e["within_tolerance"] is not None]
    block["available"] = bool(checked)
    if checked:
        block["all_within"] = all(checked)
    else:
        name = "DFlash" if method == "dflash" else method
        block["reason"] = f"no dataset has both a vLLM {name} τ and a standalone {name} τ at T={temperature:g}"
    return block

