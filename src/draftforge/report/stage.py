"""`report` stage: one table (summary.md / summary.csv) over every drafter branch, engine and method, plots, MLflow links."""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from draftforge.drafter.registry import MTP_HEAD, reference_type, type_of
from draftforge.drafter.settings import listed_drafters
from draftforge.io import read_json, write_json, write_text
from draftforge.paths import CONF_DIR, mlflow_uri
from draftforge.report import plots
from draftforge.report.categories import category_csv, category_lines
from draftforge.report.headline import headline_lines
from draftforge.report.parity import parity_block
from draftforge.report.rows import (
    AUTO_GOAL,
    AUTO_NAME,
    BEST_NAME,
    COLUMNS,
    budget_choices,
    collect_rows,
    fmt,
    method_label,
    to_float,
    vs_mtp,
    with_spread,
)
from draftforge.report.sampling import sampled_temperatures, sampling_check_lines
from draftforge.stages import PER_DRAFTER, STAGES
from draftforge.tracking import experiment_name, mlflow_run

log = logging.getLogger(__name__)


def summary_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: (method_label(row) if c == "method" else row.get(c, "")) for c in COLUMNS})
    return buf.getvalue()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """tokens/s and speedup as `median [min–max]` over repeats where measured; tree budgets flagged
    "auto" (calibrated) and "best" (oracle)."""
    header = ["dataset", "engine", "drafter", "method", "budget", "T", "tokens/s", "speedup vs AR", "τ", "TPOT ms", "mismatches", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        flags = [name for name, key in (("auto", "auto_budget"), ("best", "best_budget")) if r.get(key)]
        budget = fmt(r.get("budget")) + (f" ({', '.join(flags)})" if flags else "")
        cells = [
            fmt(r.get("dataset")), r["engine"], fmt(r.get("drafter")), method_label(r), budget, f"{to_float(r.get('temperature'), 0.0):g}",
            with_spread(r, "tokens_per_s", 1),
            with_spread(r, "speedup_vs_ar", 2), fmt(r.get("tau")), fmt(r.get("tpot_ms"), 1), fmt(r.get("lossless_mismatches")),
            r.get("status", "ok") + (f" ({r['reason']})" if r.get("reason") else "")
            + (f" (chat mode mismatch: {r['chat_mode_mismatch']})" if r.get("chat_mode_mismatch") else ""),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mlflow_links(results_root: Path, experiment: str, base_url: str, branches: list[str]) -> list[str]:
    """Markdown links to the FINISHED MLflow runs behind this report: per (stage, branch) of the current config
    (a once-stage has the branch ""; `branches` are the experiment's listed drafters, so a removed branch's runs
    are left out), the runs of its latest FINISHED run's config (`config_hash` tag), one per run name (the
    latest). Reruns with the same config never repeat a link; a resumed evaluate (its datasets logged by two
    processes) keeps all of its rows; runs of an older config of that stage are left out. The report's own
    stage is left out: its run is the one in progress."""
    try:
        import mlflow

        mlflow.set_tracking_uri(mlflow_uri(results_root))
        exp = mlflow.get_experiment_by_name(experiment_name(experiment))
        if exp is None:
            return []
        runs = mlflow.search_runs(experiment_ids=[exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], output_format="list")
    except Exception as exc:  # the report still renders without the store
        log.warning("MLflow store unreadable (%s); report has no run links", exc)
        return []
    groups: dict[tuple[str, str], dict[str, Any]] = {}  # (stage, branch) → its config hash and runs by name
    for run in runs:  # newest first
        tags = run.data.tags
        stage, branch = tags.get("stage", ""), tags.get("drafter", "")
        current = branch in branches if stage in PER_DRAFTER else branch == ""
        if stage not in STAGES or stage == "report" or not current:
            continue
        group = groups.setdefault((stage, branch), {"config_hash": tags.get("config_hash"), "runs": {}})
        name = run.info.run_name or run.info.run_id
        if tags.get("config_hash") == group["config_hash"] and name not in group["runs"]:
            group["runs"][name] = run
    order = {name: i for i, name in enumerate(branches)}
    links = []
    for stage, branch in sorted(groups, key=lambda k: (STAGES.index(k[0]), order.get(k[1], -1))):
        for run in sorted(groups[stage, branch]["runs"].values(), key=lambda r: r.info.start_time):
            url = f"{base_url}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
            where = f"stage `{stage}`" + (f", branch `{branch}`" if branch else "")
            links.append(f"- [{run.info.run_name or run.info.run_id}]({url}) — {where}")
    return links


# The plot files the report writes into its folder (training curves: one per branch). The folder is the
# report's own, so a plot it did not write this time (a removed branch, plots switched off) is stale.
PLOT_FILES = ("tokens_per_s.png", "ddtree_budget.png", "acceptance_hist.png", "acceptance_by_position.png")


def remove_stale_plots(out_dir: Path, figures: dict[str, Path]) -> list[Path]:
    """Delete the report's plot files that this run did not write; returns them."""
    keep = {p.name for p in figures.values()}
    stale = [p for p in sorted(out_dir.glob("*.png"))
             if p.name not in keep and (p.name in PLOT_FILES or p.name.startswith("training_curve_"))]
    for path in stale:
        path.unlink()
        log.info("report: removed %s (not a plot of this report: its branch is no longer listed, or plots are off)", path)
    return stale


def training_history(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """train/metrics.json curves → [{step, loss}…, {step, val_tau_sim}…] for the training plot."""
    curve = [{"step": h["step"], "loss": h["loss"]} for h in metrics.get("train_curve") or [] if "loss" in h]
    val = [{"step": e["step"], "val_tau_sim": e["val_sim_tau"]} for e in metrics.get("val_curve") or [] if "val_sim_tau" in e]
    return curve + val


def parity_text(parity: dict[str, Any]) -> list[str]:
    """The parity block as markdown lines."""
    tol = float(parity["tolerance"])
    lines = []
    for dataset, e in sorted((parity.get("datasets") or {}).items()):
        if e.get("rel_diff") is None:
            lines.append(f"- **{dataset}**: vLLM τ {fmt(e.get('vllm_tau'), 3)}, standalone τ {fmt(e.get('standalone_tau'), 3)} (not comparable)")
            continue
        verdict = "within" if e["within_tolerance"] else "OUTSIDE"
        lines.append(
            f"- **{dataset}**: τ vLLM {e['vllm_tau']:.3f} vs standalone {e['standalone_tau']:.3f} "
            f"(rel. diff {100 * e['rel_diff']:.1f}%, {verdict} {100 * tol:.0f}%)"
        )
    if not lines and parity.get("reason"):
        lines.append(f"- not checked: {parity['reason']}")
    return lines


def budget_choice_lines(choices: list[dict[str, Any]]) -> list[str]:
    """Per dataset × drafter branch × tree method: the auto budget (calibrated) beside the best budget (oracle)."""
    lines = []
    for c in choices:
        temp = f" (T = {c['temperature']:g})" if c["temperature"] else ""
        best = c["best"]
        best_text = (f"{BEST_NAME}: {best.get('budget')} — {with_spread(best, 'tokens_per_s', 1)} tok/s, "
                     f"τ {fmt(best.get('tau'))}, speedup {with_spread(best, 'speedup_vs_ar', 2)}× vs AR")
        auto = c["auto"]
        if auto is None:
            auto_text = f"{AUTO_NAME}: none — {c['note']}"
        else:
            auto_text = (f"{AUTO_NAME}: {auto.get('budget')} — {with_spread(auto, 'tokens_per_s', 1)} tok/s, "
                         f"τ {fmt(auto.get('tau'))}, speedup {with_spread(auto, 'speedup_vs_ar', 2)}× vs AR "
                         f"(chosen on {c['calibration_prompts']} calibration prompt(s): τ {fmt(auto.get('calibration_tau'))} ÷ "
                         f"round {fmt(auto.get('calibration_round_ms'), 1)} ms (pooled over the sets) = {fmt(auto.get('calibration_tokens_per_s'), 1)} "
                         f"tok/s predicted)")
        ratio = f"; auto = **{100 * c['auto_vs_best']:.0f}%** of the oracle's tokens/s" if c["auto_vs_best"] is not None else ""
        why = f". Below {100 * AUTO_GOAL:.0f}%: " + "; ".join(c["why"]) if c.get("why") else ""
        lines.append(f"- **{c['dataset']}**, {c['drafter']}/`{c['method']}`{temp}: {auto_text}; {best_text}{ratio}{why}")
    return lines


def vs_mtp_lines(table: dict[str, dict[str, Any]], has_mtp_rows: bool = False) -> list[str]:
    """The "vs MTP" table: best-budget DDTree tokens/s ÷ MTP tokens/s, per dataset, in each engine."""
    key = _ref_name()
    engines = sorted({e for v in table.values() for e in v[key]})
    if not table and has_mtp_rows:
        return ["- (no DDTree rows to compare: list a dflash or dspark drafter in `drafters`, with ddtree in evaluate.methods)"]
    if not engines:
        return ["- (no MTP rows: mtp is not in `drafters`, or not in evaluate.methods)"]
    head = ["dataset", "best tree (drafter/method@budget)", "tok/s"] + [f"vs MTP ({e}: {_mtp_name(table, e)})" for e in engines]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, v in table.items():
        cells = [dataset, v["ddtree_label"], fmt(v["ddtree_tokens_per_s"], 1)]
        for e in engines:
            m = v[key].get(e)
            cells.append(f"{m['ratio']:.2f}× ({fmt(m['tokens_per_s'], 1)} tok/s)" if m else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ref_name() -> str:
    """The tree-reference type's name (drafter.registry.reference_type): the key of its `vs_mtp` entries."""
    ref = reference_type()
    return ref.name if ref is not None else ""


def _mtp_name(table: dict[str, dict[str, Any]], engine: str) -> str:
    key = _ref_name()
    return next((v[key][engine]["label"] for v in table.values() if engine in v[key]), key)


def _ref_chain() -> str | None:
    ref = reference_type()
    return ref.chain_method if ref is not None else None


def branch_lines(drafters: dict[str, Any], trains: dict[str, dict[str, Any]]) -> list[str]:
    """One line per drafter branch: its shape and how its training went."""
    lines = []
    for name, d in drafters.items():
        t = trains[name]
        if type_of(d).artifact == MTP_HEAD:  # metrics.json holds the head's block under the artifact's name
            m = t.get(MTP_HEAD) or {}
            done = (f"trained {m.get('steps', '?')} steps (loss {fmt(m.get('loss_first'))} → {fmt(m.get('loss_last'))}); "
                    f"val simulated τ {fmt((m.get('best') or {}).get('val_mtp_sim_tau'))}") if m else "the target's native MTP layer"
            lines.append(f"- **{name}** (MTP head): {done}.")
            continue
        shape = t.get("drafter") or {}
        lines.append(
            f"- **{name}** ({d.type}): {shape.get('num_hidden_layers', '?')} layers, block {shape.get('block_size', '?')}, "
            f"taps {shape.get('target_layer_ids', '?')}; trained {t.get('steps', '?')} steps, val simulated τ "
            f"{fmt((t.get('best') or {}).get('val_sim_tau'))} ({t.get('selected', '?')})."
        )
    return lines


def build_report(ctx) -> dict[str, Any]:
    drafters = listed_drafters(ctx.cfg, CONF_DIR)
    rows = collect_rows([ctx.input_marker("evaluate", d) for d in drafters],
                        [ctx.input_marker("baselines", d) for d in drafters])
    target = read_json(ctx.input_marker("target"), what="target.json")
    trains = {d: read_json(ctx.input_marker("train", d), what="train metrics") for d in drafters}
    curate = read_json(ctx.input_marker("curate"), what="curate manifest")
    figures: dict[str, Path] = {}
    if ctx.cfg.report.plots:
        figures["tokens_per_s"] = plots.tokens_per_s_by_method(rows, ctx.out_dir / "tokens_per_s.png")
        figures["ddtree_budget"] = plots.ddtree_budget_sweep(rows, ctx.out_dir / "ddtree_budget.png")
        figures["acceptance"] = plots.acceptance_histograms(rows, ctx.out_dir / "acceptance_hist.png")
        figures["acceptance_by_position"] = plots.acceptance_by_position(rows, ctx.out_dir / "acceptance_by_position.png")
        for name, t in trains.items():
            history = training_history(t)
            if history:
                figures[f"training_{name}"] = plots.training_curve(history, ctx.out_dir / f"training_curve_{name}.png")
    remove_stale_plots(ctx.out_dir, figures)
    choices = budget_choices(rows)
    repeats = max((int(r.get("repeats") or 1) for r in rows if r["engine"] == "draftforge"), default=1)
    tol = float(ctx.cfg.report.parity_tolerance)
    sampled = sampled_temperatures(rows)
    parity = {f"{name}_T{t:g}" if t else name: parity_block(rows, tol, method=type_of(d).chain_method, drafter=name, temperature=t)
              for name, d in drafters.items() for t in [0.0, *sampled]}  # fmt: skip
    parity_lines = []
    for block in parity.values():
        at = f" (T = {block['temperature']:g})" if block["temperature"] else ""
        parity_lines += [f"### {block['drafter']}: vLLM `{block['method']}` vs the standalone `{block['method']}` chain{at}",
                         *parity_text(block), ""]  # fmt: skip
    checks = {d: read_json(ctx.input_marker("evaluate", d), what="draftforge results").get("sampling_checks") or []
              for d in drafters}  # fmt: skip
    sampled_lines = []
    for t in sampled:
        sampled_lines += [f"### T = {t:g}", *headline_lines(rows, choices, t), ""]
    mtp_table = vs_mtp(rows)
    links = mlflow_links(ctx.results_root, ctx.experiment, ctx.cfg.report.mlflow_ui_url.rstrip("/"), list(drafters))
    text = "\n".join([
        f"# draftforge report — experiment `{ctx.experiment}`",
        "",
        f"Target **{target['name']}** ({target['architecture']}, {target['num_layers']} layers, H {target['hidden_size']}). "
        f"Training set: {curate.get('counts', {}).get('kept', curate.get('kept', '?'))} conversations. Drafter branches "
        "(same features; each measures AR as its own speedup reference):",
        *branch_lines(drafters, trains),
        "",
        "Speedup = mean TPOT(AR) / mean TPOT(method) within one engine and branch; τ = tokens committed per target "
        "verify (bonus included).",
        f"Standalone-engine tokens/s and speedup: median over {repeats} interleaved timed repeat(s), [min–max] over "
        "repeats; speedup = median of the per-repeat TPOT ratios (AR and method timed side by side in each repeat).",
        f"Tree budgets: the **{AUTO_NAME}** maximises τ(b) / round cost(b) measured on calibration prompts (the next "
        f"prompts of each held-out set, disjoint from the evaluation prompts), chosen without the evaluation data; the **{BEST_NAME}** "
        "has the highest tokens/s on the evaluation prompts themselves (as published numbers do).",
        "",
        "## Headline: speedup vs AR per method and set (T = 0; tree methods at the auto budget, the oracle beside it)",
        "Each cell: speedup = τ ÷ round cost, the round in AR steps of the same engine and branch.",
        *headline_lines(rows, choices),
        "",
        "## Sampling (T > 0): the headline at each sampling temperature (its own calibrated budgets; the T > 0 "
        "prompts are `evaluate.sampled_datasets` / `sampled_prompts`)",
        *(sampled_lines or ["- (no sampling temperature in evaluate.temperatures)", ""]),
        "## Lossless at T > 0: each generated token's PIT under the target's own conditional, χ² against uniform "
        "(all sets pooled per method; docs/architecture.md, \"Lossless at T > 0\")",
        *(sampling_check_lines(checks) or ["- (no response at T > 0)"]),
        "",
        "## By prompt category (T = 0; the headline's rows: speedup× (τ) over each category's prompts only)",
        *(category_lines(rows, choices) or ["- (no row carries prompt categories)"]),
        "",
        f"## Tree budget per dataset, drafter and tree method: {AUTO_NAME} vs {BEST_NAME}",
        *(budget_choice_lines(choices) or ["- (no DDTree rows)"]),
        "",
        "## DDTree vs MTP (best tree tokens/s ÷ MTP tokens/s, T = 0; \"mtp (native)\": the target's own "
        "MTP layers, \"mtp (trained)\": the head trained by this pipeline)",
        *vs_mtp_lines(mtp_table, any(r["method"] == _ref_chain() and r.get("status", "ok") == "ok" for r in rows)),
        "",
        "## Train/serve parity (each branch's chain: vLLM τ vs standalone τ, same prompts, per temperature)",
        *(parity_lines or ["- (no drafter branches)"]),
        "## All runs",
        markdown_table(rows),
        "",
        "## Plots",
        *[f"![{name}]({path.name})" for name, path in figures.items()],
        "",
        f"## MLflow runs (`mlflow ui --backend-store-uri {mlflow_uri(ctx.results_root)}`)",
        *(links or ["- (no runs found)"]),
        "",
    ])  # fmt: skip
    write_text(ctx.out_dir / "summary.csv", summary_csv(rows))
    write_text(ctx.out_dir / "by_category.csv", category_csv(rows))
    write_json(ctx.out_dir / "parity.json", parity)
    return {"text": text, "rows": rows, "figures": figures, "parity": parity, "vs_mtp": mtp_table, "budget_choices": choices}


def main(ctx) -> None:
    with mlflow_run(**ctx.tracking_kwargs(), run_name="report", params=ctx.params) as run:
        report = build_report(ctx)
        run.log_metrics({"rows": len(report["rows"])})
        for name, block in report["parity"].items():
            for dataset, e in (block.get("datasets") or {}).items():
                if e.get("rel_diff") is not None:
                    run.log_metrics({f"parity_rel_diff_{name}_{dataset}": e["rel_diff"]})
        for dataset, v in report["vs_mtp"].items():
            for engine, m in v[_ref_name()].items():
                run.log_metrics({f"ddtree_vs_mtp_{engine}_{dataset}": m["ratio"]})
        for c in report["budget_choices"]:  # auto (calibrated) vs best (oracle) budget per dataset × branch × tree method
            suffix = f"{c['drafter']}_{c['method']}_{c['dataset']}" + (f"_T{c['temperature']:g}" if c["temperature"] else "")
            run.log_metrics({f"best_budget_{suffix}": float(c["best"]["budget"])})
            if c["auto"] is not None:
                run.log_metrics({f"auto_budget_{suffix}": float(c["auto"]["budget"])})
            if c["auto_vs_best"] is not None:
                run.log_metrics({f"auto_vs_best_tokens_per_s_{suffix}": c["auto_vs_best"]})
        for path in report["figures"].values():
            run.log_artifact(path)
        run.log_artifact(ctx.out_dir / "summary.csv")
        write_text(ctx.out_dir / "summary.md", report["text"])  # marker: last
        run.log_artifact(ctx.out_dir / "summary.md")
    log.info("report: %d rows → %s", len(report["rows"]), ctx.out_dir / "summary.md")
