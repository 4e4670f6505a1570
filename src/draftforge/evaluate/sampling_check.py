"""Losslessness at T > 0 on the real target (docs/architecture.md, "Lossless at T > 0").

At T = 0 a speculative method is lossless when its tokens equal AR's. At T > 0 it is lossless when every
token it commits is a draw from the target's own conditional softmax(logits(prefix) / T). The check:

1. `pit_values`: one fresh teacher-forced target forward over prompt + response (a chain prefill: no KV
   cache reuse, no tree, nothing the decoding loop shares) gives each generated token's conditional; the
   token's randomized probability integral transform is u = F(x⁻) + V·p(x), with tokens ranked by
   probability (most likely first, ties by id) and V ~ U(0, 1) from its own stream. Under losslessness each
   u is U(0, 1) given everything before it, so a response's u's are i.i.d. uniform (the Rosenblatt
   transform), and so are responses pooled from different prompts or methods.
2. `uniformity`: Pearson's χ² of the u's in `bins` equal bins against uniform, its p-value, the histogram's
   total-variation distance to uniform, and the power statement `detectable_tv`: every histogram at TV ≥ it
   from uniform is rejected with probability ≥ `power` at level `alpha` (for a TV δ the smallest
   non-centrality is 4nδ², reached with the deviation spread evenly over all bins).

The ranking puts the typical bugs in the bottom bins: a verify that keeps a draft the target did not sample
(greedy acceptance), a temperature applied twice or not at all, a stale cache. Only whole responses are
tested: the tokens selected by an outcome (say, the accepted drafts alone) are not uniform by design.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draftforge.engine.target import TargetModel

POWER = 0.8  # the probability `detectable_tv` is stated at


def pit_values(tm: TargetModel, prompt_ids: Sequence[int], tokens: Sequence[int], temperature: float,
               seed: int) -> list[float]:
    """Each generated token's randomized PIT under the target's conditional at `temperature` (> 0). Torch is
    imported here: the statistics below stay importable by torch-free readers (aggregate, report)."""
    import torch

    from draftforge.engine.span import chain_span
    from draftforge.engine.state import TargetState
    from draftforge.engine.target import forward

    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: the PIT needs a sampling temperature > 0")
    if not tokens:
        return []
    seq = list(prompt_ids) + list(tokens)
    p0, n = len(prompt_ids), len(tokens)
    with torch.no_grad():
        state = TargetState(tm, len(seq) + 1)
        ids = torch.tensor([seq], device=tm.device, dtype=torch.long)  # (1, P + n)
        h, _ = forward(tm, state, chain_span(ids, 0, tm.dtype, commit_all=True))  # (1, P + n, H)
        logits = tm.lm_head(h[0, p0 - 1:p0 - 1 + n])  # (n, V): row i predicts tokens[i]
        probs = torch.softmax(logits.double() / temperature, dim=-1).cpu()  # (n, V)
    x = torch.tensor(list(tokens), dtype=torch.long).unsqueeze(1)  # (n, 1)
    px = probs.gather(1, x)  # (n, 1)
    ids_v = torch.arange(probs.shape[1]).unsqueeze(0)  # (1, V)
    ranked_before = (probs > px) | ((probs == px) & (ids_v < x))  # (n, V): more likely, or as likely and lower id
    before = (probs * ranked_before).sum(dim=1)  # (n,)
    v = torch.rand(n, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)  # (n,)
    u = before + v * px.squeeze(1)
    return [min(max(float(a), 0.0), 1.0) for a in u]


def _ncx2_power(dof: int, lam: float, crit: float) -> float:
    from scipy.stats import ncx2

    return float(ncx2.sf(crit, dof, lam))


def detectable_tv(n: int, bins: int, alpha: float, power: float = POWER) -> float | None:
    """The smallest TV distance from uniform (of the binned u's) the χ² test detects with probability ≥ power
    at level alpha from n values; None when n = 0."""
    if n <= 0:
        return None
    from scipy.optimize import brentq
    from scipy.stats import chi2

    dof = bins - 1
    crit = float(chi2.isf(alpha, dof))
    hi = 1.0
    while _ncx2_power(dof, hi, crit) < power:
        hi *= 2.0
    lam = brentq(lambda x: _ncx2_power(dof, x, crit) - power, 0.0, hi, xtol=1e-6)
    return min(1.0, math.sqrt(lam / (4.0 * n)))


def uniformity(u: Sequence[float], bins: int, alpha: float) -> dict[str, Any]:
    """χ² of the u's against uniform in `bins` equal bins → {n, bins, chi2, dof, p_value, tv, detectable_tv,
    alpha, power, passed}; passed is None below 5 expected values per bin (too few to test)."""
    from scipy.stats import chi2

    n = len(u)
    counts = [0] * bins
    for value in u:
        counts[min(int(value * bins), bins - 1)] += 1
    out: dict[str, Any] = {"n": n, "bins": bins, "alpha": alpha, "power": POWER, "counts": counts,
                           "chi2": None, "dof": bins - 1, "p_value": None, "tv": None,
                           "detectable_tv": detectable_tv(n, bins, alpha), "passed": None}
    if n < 5 * bins:
        return out
    expected = n / bins
    stat = sum((c - expected) ** 2 / expected for c in counts)
    out.update(chi2=stat, p_value=float(chi2.sf(stat, bins - 1)),
               tv=0.5 * sum(abs(c / n - 1.0 / bins) for c in counts))
    out["passed"] = out["p_value"] >= alpha
    return out


def pooled_checks(records: Iterable[dict[str, Any]], bins: int, alpha: float) -> list[dict[str, Any]]:
    """Per (temperature, method): every PIT value of that method's responses, all sets, budgets and splits
    pooled (independent draws), tested together; plus the tokens committed from accepted drafts, for scale.
    Only records with PIT values count (first repeat at T > 0: later repeats redraw the same tokens)."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in (r for r in records if r.get("pit")):
        groups.setdefault((float(r["temperature"]), str(r["method"])), []).append(r)
    out = []
    for (temp, method), rs in sorted(groups.items()):
        u = [x for r in rs for x in r["pit"]]
        drafted = sum(a - 1 for r in rs for a in r.get("accept_lengths", []))
        out.append({"temperature": temp, "method": method, "responses": len(rs), "accepted_drafts": drafted,
                    **uniformity(u, bins, alpha)})
    return out


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.3g}"


def check_line(c: Mapping[str, Any]) -> str:
    """One pooled check as text (the evaluate log's line and the report's): tokens, χ² p-value, TV to uniform,
    the TV detectable at the stated power, and the verdict (FAILED in capitals)."""
    verdict = {True: "passed", False: "**FAILED**", None: "too few tokens to test"}[c.get("passed")]
    return (f"T = {float(c['temperature']):g} · `{c['method']}`: {c['n']} tokens of {c['responses']} responses "
            f"({c['accepted_drafts']} from accepted drafts); χ² p = {_fmt(c.get('p_value'))}, TV to uniform "
            f"{_fmt(c.get('tv'))}; a TV ≥ {_fmt(c.get('detectable_tv'))} is detected with probability {c['power']} at "
            f"α = {c['alpha']:g}: {verdict}")
