"""report: MTP rows named by their source, the "vs MTP" table, MTP levels in the budget plot."""

from __future__ import annotations

from draftforge.report import plots
from draftforge.report.rows import method_label, vs_mtp
from draftforge.report.stage import markdown_table, parity_text, vs_mtp_lines


def _row(engine, method, tps, budget=None, tau=2.0, source=None):
    r = {"dataset": "humaneval", "engine": engine, "method": method, "budget": budget, "temperature": 0.0,
         "tokens_per_s": tps, "tau": tau, "speedup_vs_ar": tps / 10, "status": "ok"}
    if source:
        r["mtp_source"] = source
    return r


def test_vs_mtp_and_names(tmp_path):
    rows = [_row("draftforge", "ar", 10.0, tau=1.0), _row("draftforge", "ddtree", 30.0, 16), _row("draftforge", "ddtree", 40.0, 32),
            _row("draftforge", "mtp", 20.0, source="trained"), _row("vllm", "mtp", 25.0, source="trained"),
            _row("vllm", "ar", 12.0, tau=1.0)]
    assert method_label(rows[3]) == "mtp (trained)" and method_label(rows[0]) == "ar"
    table = vs_mtp(rows)
    assert table["humaneval"]["ddtree_tokens_per_s"] == 40.0
    assert table["humaneval"]["mtp"]["draftforge"]["ratio"] == 2.0 and table["humaneval"]["mtp"]["vllm"]["ratio"] == 1.6
    text = "\n".join(vs_mtp_lines(table))
    assert "vs MTP (draftforge: mtp (trained))" in text and "2.00×" in text and "1.60×" in text
    assert "mtp (trained)" in markdown_table(rows)
    assert "no MTP rows" in vs_mtp_lines(vs_mtp(rows[:3]))[0]
    mtp_only = [rows[0], rows[3]]  # an mtp-only experiment: MTP rows, nothing to compare them with
    assert "no DDTree rows" in vs_mtp_lines(vs_mtp(mtp_only), has_mtp_rows=True)[0]
    parity = {"tolerance": 0.05, "datasets": {"humaneval": {"vllm_tau": 2.0, "standalone_tau": 2.02, "rel_diff": 0.0099,
                                                            "within_tolerance": True}}}  # fmt: skip
    assert "within 5%" in parity_text(parity)[0]
    path = plots.ddtree_budget_sweep(rows, tmp_path / "budget.png")
    assert path.stat().st_size > 1000
