"""PNG plots of the summary: tokens/s by method, τ and speedup vs DDTree budget, τ histograms, acceptance by draft
position, training curve."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from draftforge.drafter.registry import reference_type, tree_methods  # noqa: E402
from draftforge.io import atomic_path  # noqa: E402


def _save(fig, path: Path) -> Path:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _label(row: dict[str, Any]) -> str:
    from draftforge.report.rows import method_label

    budget = f"@{row['budget']}" if row.get("budget") not in (None, "", 0) else ""
    return f"{row['engine']}:{method_label(row)}{budget}"


def _err(row: dict[str, Any], key: str) -> tuple[float, float]:
    """(below, above) the median: the row's min..max spread over repeats (0, 0 without one)."""
    mid, lo, hi = row.get(key), row.get(f"{key}_min"), row.get(f"{key}_max")
    if mid is None or lo is None or hi is None:
        return 0.0, 0.0
    return max(0.0, float(mid) - float(lo)), max(0.0, float(hi) - float(mid))


def tokens_per_s_by_method(rows: list[dict[str, Any]], path: Path) -> Path:
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None]
    datasets = sorted({str(r.get("dataset")) for r in ok})
    fig, axes = plt.subplots(1, max(1, len(datasets)), figsize=(5.5 * max(1, len(datasets)), 4.5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        sub = [r for r in ok if str(r.get("dataset")) == dataset]
        labels = [_label(r) for r in sub]
        colors = ["tab:blue" if r["engine"] == "draftforge" else "tab:orange" for r in sub]
        errs = [_err(r, "tokens_per_s") for r in sub]
        ax.barh(labels, [float(r["tokens_per_s"]) for r in sub], color=colors,
                xerr=[[e[0] for e in errs], [e[1] for e in errs]], error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.set_title(dataset)
        ax.set_xlabel("decode tokens/s (batch 1; median, bars: min..max over repeats)")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("Decode throughput by method (blue: draftforge engine, orange: vLLM)")
    return _save(fig, path)


def ddtree_budget_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    """τ and speedup vs budget per dataset (and tree method). Speedup: median over repeats with min..max error
    bars; ★ marks the auto budget (calibrated), ○ the best budget (oracle, chosen on the evaluation data)."""
    series: dict[str, list[tuple[float, float, float, float, float, bool, bool]]] = defaultdict(list)
    chain: dict[str, float] = {}
    mtp: dict[str, list[tuple[str, float, float]]] = defaultdict(list)  # dataset → (label, τ, speedup)
    ref = reference_type()
    trees = tree_methods()
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        if ref is not None and r["method"] == ref.chain_method and r.get("tau") is not None:
            mtp[str(r.get("dataset"))].append((_label(r), float(r["tau"]), float(r.get("speedup_vs_ar") or 0)))
        if r["engine"] != "draftforge":
            continue
        if r["method"] in trees and r.get("budget"):
            # the first registered tree method (every block drafter's ddtree) keeps the bare dataset label
            key = str(r.get("dataset")) + ("" if r["method"] == trees[0] else f" ({r['method']})")
            below, above = _err(r, "speedup_vs_ar")
            series[key].append((float(r["budget"]), float(r.get("tau") or 0), float(r.get("speedup_vs_ar") or 0),
                                below, above, bool(r.get("auto_budget")), bool(r.get("best_budget"))))
        elif r["method"] == "dflash":
            chain[str(r.get("dataset"))] = float(r.get("tau") or 0)
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dataset, points in sorted(series.items()):
        points.sort()
        budgets = [p[0] for p in points]
        line = ax_tau.plot(budgets, [p[1] for p in points], marker="o", label=dataset)[0]
        if dataset in chain:
            ax_tau.axhline(chain[dataset], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax_speed.errorbar(budgets, [p[2] for p in points], yerr=[[p[3] for p in points], [p[4] for p in points]],
                          marker="o", markersize=4, capsize=3, color=line.get_color(), label=dataset)
        for p in points:
            if p[5]:  # auto budget (calibrated)
                ax_speed.plot([p[0]], [p[2]], marker="*", markersize=14, color=line.get_color(), markeredgecolor="black")
            if p[6]:  # best budget (oracle)
                ax_speed.plot([p[0]], [p[2]], marker="o", markersize=13, markerfacecolor="none", color=line.get_color())
        for i, (label, tau, speed) in enumerate(sorted(mtp.get(dataset, []))):  # MTP: one level line per engine
            style = (":", "-.")[i % 2]
            ax_tau.axhline(tau, color=line.get_color(), linestyle=style, linewidth=1.0, label=f"{dataset} {label}")
            ax_speed.axhline(speed, color=line.get_color(), linestyle=style, linewidth=1.0, label=f"{dataset} {label}")
    for ax, ylabel in ((ax_tau, "τ (tokens per verify; dashed: DFlash chain, dotted: MTP)"),
                       (ax_speed, "speedup vs AR (median, bars: min..max over repeats;\n"
                                  "★ auto budget (calibrated), ○ best (oracle); dotted: MTP)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTree node budget")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    return _save(fig, path)


def acceptance_histograms(rows: list[dict[str, Any]], path: Path) -> Path:
    hists = [r for r in rows if isinstance(r.get("tau_histogram"), (dict, list)) and r.get("status", "ok") == "ok"]
    n = max(1, len(hists))
    cols = min(4, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.6 * cols, 2.8 * ((n + cols - 1) // cols)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, hists):
        ax.set_visible(True)
        h = r["tau_histogram"]
        items = sorted((int(k), float(v)) for k, v in h.items()) if isinstance(h, dict) else list(enumerate(map(float, h)))
        ax.bar([k for k, _ in items], [v for _, v in items], color="tab:green")
        ax.set_title(f"{r.get('dataset')} {_label(r)}", fontsize=8)
        ax.set_xlabel("tokens committed per round", fontsize=7)
    fig.suptitle("Acceptance-length histograms")
    return _save(fig, path)


def position_acceptance(row: dict[str, Any]) -> list[float]:
    """[P(draft k accepted) for k = 1, 2, ...]: the share of rounds whose first k drafts were all accepted (a chain's
    position k, a tree's depth k), vLLM's `acceptance_per_pos` definition. From the engine's histogram of tokens
    committed per round (accepted drafts + the bonus token) or, for a vLLM row, its own per-position counters.
    Its sum is τ − 1; empty for a row with neither (AR)."""
    if row.get("acceptance_per_pos"):
        return [float(v) for v in row["acceptance_per_pos"]]
    h = row.get("tau_histogram")
    if not isinstance(h, dict) or not h:
        return []
    counts = {int(k) - 1: float(v) for k, v in h.items()}  # accepted drafts per round → rounds
    rounds = sum(counts.values())
    deepest = max(max(counts), 1)  # a drafter that never got a draft accepted: [0.0]
    return [sum(v for n, v in counts.items() if n >= k) / rounds for k in range(1, deepest + 1)] if rounds else []


def acceptance_by_position(rows: list[dict[str, Any]], path: Path) -> Path:
    """Per dataset: P(draft k accepted) against draft position (chains) / tree depth (trees), one line per
    method, budget and engine: where each drafter loses its drafts, not only how many it keeps."""
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r.get("method") != "ar" and position_acceptance(r)]
    datasets = sorted({str(r.get("dataset")) for r in ok}) or ["(no drafted rows)"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.2 * len(datasets), 4.2), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for r in (r for r in ok if str(r.get("dataset")) == dataset):
            per_pos = position_acceptance(r)
            style = "-" if r["engine"] == "draftforge" else "--"
            ax.plot(range(1, len(per_pos) + 1), per_pos, style, marker="o", markersize=3, label=_label(r))
        ax.set_title(dataset)
        ax.set_xlabel("draft position (chain) / depth (tree)")
        ax.set_ylabel("P(draft accepted): rounds reaching it ÷ rounds")
        ax.set_ylim(0, 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle("Acceptance by draft position (solid: draftforge engine, dashed: vLLM); each line sums to τ − 1")
    return _save(fig, path)


def training_curve(history: list[dict[str, Any]], path: Path) -> Path:
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history if "loss" in h]
    ax_loss.plot(steps, [h["loss"] for h in history if "loss" in h], linewidth=0.9)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("train loss (decayed CE)")
    val = [h for h in history if h.get("val_tau_sim") is not None]
    ax_tau.plot([h["step"] for h in val], [h["val_tau_sim"] for h in val], marker="o")
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("val simulated acceptance length")
    for ax in (ax_loss, ax_tau):
        ax.grid(alpha=0.3)
    fig.suptitle("Drafter training")
    return _save(fig, path)
