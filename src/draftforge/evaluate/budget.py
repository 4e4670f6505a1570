"""The auto budget: a tree method's node budget chosen from its cost curve on calibration prompts (torch-free).

Per (dataset, temperature, tree method) evaluate runs every budget on calibration prompts, which are not
the evaluation prompts (evaluate/prompts.py: the next ones of the same held-out pool), and measures

- τ(b): tokens committed per round (target verify), bonus included, over the set's calibration rounds;
- cost(b): the mean round time, decode seconds ÷ rounds, pooled over every set's calibration rounds at that
  (temperature, method, budget), its median over the timed repeats. A round's cost is the engine's at that
  budget, not the prompts': its draft pass and its verify of a b-node tree do not depend on which set the prompt
  came from (a set's longer contexts raise every budget's cost alike, which leaves the choice unchanged), while
  its timing does depend on when it ran. Pooling times every set's rounds, spread over the stage's whole length,
  so a slow period of the host during one set's calibration is diluted by the other sets' rounds. The premise
  holds while the weights dominate a round (prompts of a few hundred tokens, as the default sets'); a set of
  much longer prompts (`long_context`), whose attention grows with the tree's rows, bends the pooled curve
  toward its own, and its auto ÷ oracle in the report shows what that costs.

τ(b) / cost(b) is the predicted decode tokens per second; `choose_budget` picks the budget maximising it (the
smallest within TIE_TOLERANCE of the maximum).
That budget is a function of the calibration records alone (evaluate runs them after the evaluation
prompts, but nothing of those enters the choice), so its evaluation tokens/s is an honest number; the oracle-best budget (highest tokens/s on the evaluation data, `aggregate.mark_best`) is
reported beside it, and auto ÷ oracle says what choosing on held-out data costs.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from draftforge.drafter.registry import tree_methods  # the registered types' tree methods (budget-swept)

Curve = Mapping[int, "tuple[float | None, float | None]"]  # budget → (τ, cost in seconds per round)


def _usable(x: float | None) -> bool:
    return x is not None and not math.isnan(x) and x > 0


def predicted_tokens_per_s(tau: float | None, cost_s: float | None) -> float | None:
    """τ / cost: tokens per round ÷ seconds per round (None when either is missing or not positive)."""
    return tau / cost_s if _usable(tau) and _usable(cost_s) else None


# Predicted rates within this fraction of the best are ties. Two calibration prompts per set measure τ to a few
# per cent (prompt sampling); a larger budget that wins by less than that is as likely noise as not, and it loses
# more where it is wrong (its verify costs more). Replayed on the 49 (set, temperature) groups of ten recorded CPU
# evaluate stages (benchmarks/auto_budget_replay.py; docs/benchmarks.md, "The auto budget's round cost, pooled over
# the sets"), auto ÷ oracle tokens/s: per-set costs 0.966 mean at tolerance 0 and 0.972 at 3%; pooled costs 0.979
# and 0.982, with 3 and 2 groups below 0.9.
TIE_TOLERANCE = 0.03


def choose_budget(curve: Curve, tolerance: float = TIE_TOLERANCE) -> int | None:
    """The smallest budget whose τ(b) / cost(b) is within `tolerance` of the highest (a tie goes to less work).
    Budgets without a usable τ or cost are skipped; None when none is usable."""
    rates = {int(b): r for b, r in ((b, predicted_tokens_per_s(*curve[b])) for b in curve) if r is not None}
    if not rates:
        return None
    top = max(rates.values())
    return min(b for b, r in rates.items() if r >= (1.0 - tolerance) * top)


def calibration_curves(records: Iterable[dict[str, Any]]) -> dict[tuple, dict[int, tuple[float | None, float | None]]]:
    """Calibration response records → {(dataset, temperature, method): {budget: (τ, cost_s)}} for tree methods.

    τ from the set's first repeat (tokens are the same in every repeat at T = 0); cost = the median over repeats
    of that repeat's decode seconds ÷ rounds, summed over every set's records at the same (temperature, method,
    budget) (so a slow period that lands on one repeat is dropped, and one that lands on one set is diluted).
    """
    groups: dict[tuple, dict[int, dict[int, list[dict[str, Any]]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    seconds: dict[tuple, float] = defaultdict(float)  # (temperature, method, budget, repeat) → every set's decode s
    rounds: dict[tuple, int] = defaultdict(int)  # the same key → every set's rounds
    for r in records:
        if r["method"] in tree_methods() and r.get("budget") is not None:
            temperature, budget, repeat = float(r["temperature"]), int(r["budget"]), int(r.get("repeat", 0))
            groups[(r["dataset"], temperature, r["method"])][budget][repeat].append(r)
            seconds[(temperature, r["method"], budget, repeat)] += r["decode_s"]
            rounds[(temperature, r["method"], budget, repeat)] += len(r["accept_lengths"])
    per_repeat: dict[tuple, list[float]] = defaultdict(list)
    for k, n in rounds.items():
        if n and seconds[k] > 0:
            per_repeat[k[:3]].append(seconds[k] / n)
    pooled = {k: statistics.median(v) for k, v in per_repeat.items()}  # (temperature, method, budget) → s per round
    curves: dict[tuple, dict[int, tuple[float | None, float | None]]] = {}
    for key, by_budget in groups.items():
        curve: dict[int, tuple[float | None, float | None]] = {}
        for budget, by_repeat in by_budget.items():
            accepts = [a for r in by_repeat[min(by_repeat)] for a in r["accept_lengths"]]
            tau = sum(accepts) / len(accepts) if accepts else None
            curve[budget] = (tau, pooled.get((key[1], key[2], budget)))
        curves[key] = curve
    return curves


def mark_auto(rows: list[dict[str, Any]], calibration_records: list[dict[str, Any]], requested: int) -> None:
    """Flag the auto budget on the tree rows and attach the calibration numbers. Pass every set's rows and
    calibration records at once: the round cost is pooled over the sets given (`calibration_curves`).

    Every tree-method row gets `auto_budget` (bool: this row's budget is the calibrated choice),
    `calibration_prompts` (calibration prompts measured for its dataset), `calibration_tau`,
    `calibration_round_ms` (the round cost pooled over the sets, see the module docstring) and
    `calibration_tokens_per_s` (τ / cost at its budget), and `auto_vs_best`:
    the auto budget's evaluation tokens/s ÷ the oracle-best budget's (the same on every row of the group;
    None without an auto budget, then `auto_budget_note` says why). Call after `mark_best`.
    """
    curves = calibration_curves(calibration_records)
    prompts: dict[str, set] = defaultdict(set)
    for r in calibration_records:
        prompts[r["dataset"]].add(r["prompt_index"])
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["method"] in tree_methods():
            groups[(row["dataset"], float(row["temperature"]), row["method"])].append(row)
    for key, group in groups.items():
        curve = curves.get(key, {})
        auto = choose_budget(curve)
        note = None
        if requested <= 0:
            note = "calibration disabled (evaluate.calibration_prompts = 0)"
        elif not prompts.get(key[0]):
            note = ("no calibration prompts: the evaluation prompts use the whole held-out set "
                    "(evaluate.num_prompts = 0 or a pool no larger than num_prompts)")
        elif auto is None:
            note = "calibration measured no usable round (τ or round cost missing)"
        by_budget = {row["budget"]: row for row in group}
        auto_row = by_budget.get(auto)
        best_row = next((row for row in group if row.get("best_budget")), None)
        ratio = None
        if auto_row is not None and best_row is not None and auto_row.get("tokens_per_s") and best_row.get("tokens_per_s"):
            ratio = auto_row["tokens_per_s"] / best_row["tokens_per_s"]
        for row in group:
            row.pop("auto_budget_note", None)  # a row marked before (a reused set's) keeps no stale note
            tau, cost = curve.get(row["budget"], (None, None))
            row.update(auto_budget=auto is not None and row["budget"] == auto, calibration_prompts=len(prompts.get(key[0], ())),
                       calibration_tau=tau, calibration_round_ms=None if cost is None else 1000.0 * cost,
                       calibration_tokens_per_s=predicted_tokens_per_s(tau, cost), auto_vs_best=ratio)  # fmt: skip
            if note:
                row["auto_budget_note"] = note
