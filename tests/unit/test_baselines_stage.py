"""baselines stage end to end without an engine: vLLM unimportable → recorded skips (never numbers),
marker last, MLflow runs tagged; bad input → one StageError line, nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baselines_fixtures import fake_vllm  # noqa: E402
from draftforge.baselines.stage import main as baselines_main  # noqa: E402
from draftforge.cli import run_stage  # noqa: E402
from draftforge.io import write_json  # noqa: E402

EXP = "smoke"


def _args(root: Path, *extra: str) -> list[str]:
    return [f"experiment={EXP}", f"results_root={root}", "target=tiny-random", "baselines.datasets=[humaneval,chitchat]",
            "baselines.num_prompts=2", "baselines.max_new_tokens=8", *extra]  # fmt: skip


def test_unimportable_vllm_records_skips_for_every_method(tiny_target_info, tmp_path, monkeypatch):
    root = tmp_path / "results"
    write_json(root / EXP / "target" / "target.json", tiny_target_info)
    fake = fake_vllm(tmp_path / "fake", "raise ImportError('vllm._C: undefined symbol')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    run_stage("baselines", baselines_main, _args(root, "baselines.methods.dflash.enabled=false",
                                                 "baselines.methods.dspark.enabled=false"))

    out = root / EXP / "baselines" / "dflash"  # the dflash branch: AR, n-gram (DFlash disabled here)
    marker = json.loads((out / "baselines.json").read_text())
    assert {m: s["status"] for m, s in marker["methods"].items()} == {"ar": "skipped", "ngram": "skipped"}
    assert "undefined symbol" in marker["methods"]["ar"]["reason"]
    assert "undefined symbol" in marker["methods"]["ngram"]["reason"]  # not launched again after the first failure
    assert not (root / EXP / ".work" / "baselines" / "dflash" / "runs" / "ngram.spec.json").exists()
    assert len(marker["rows"]) == 2 * 2  # methods × datasets
    for row in marker["rows"]:
        assert row["status"] == "skipped" and row["engine"] == "vllm"
        assert all(row[k] is None for k in ("tokens_per_s", "tpot_ms", "ttft_ms", "tau", "speedup_vs_ar", "lossless_mismatches"))
    for method in ("ar", "ngram"):
        assert json.loads((out / f"{method}.json").read_text())["status"] == "skipped"

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[f"draftforge/{EXP}"], filter_string="tags.stage = 'baselines'")
    assert len(runs) == 4 and set(runs["tags.status"]) == {"skipped"} and set(runs["tags.engine"]) == {"vllm"}
    assert "undefined symbol" in runs["tags.reason"].iloc[0]


@pytest.mark.parametrize(
    "extra,message",
    [
        ((), "train/dflash/metrics.json: missing; run the `train` stage first"),
        (("+baselines.methods.medusa.enabled=true", "baselines.methods.dflash.enabled=false"), "override +baselines.methods.medusa.enabled=true"),
        (("baselines.methods.dflash.model=/nonexistent/drafter", "baselines.methods.dspark.enabled=false"), "/nonexistent/drafter: not an exported drafter"),
        (("baselines.max_new_tokens=0", "baselines.methods.dflash.enabled=false", "baselines.methods.dspark.enabled=false"), "baselines.max_new_tokens: 0 must be in [1, 32768]"),
    ],
)
def test_bad_input_is_one_stage_error(tiny_target_info, tmp_path, capsys, extra, message):
    root = tmp_path / "results"
    write_json(root / EXP / "target" / "target.json", tiny_target_info)
    with pytest.raises(SystemExit) as exc:
        run_stage("baselines", baselines_main, _args(root, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("draftforge baselines: error: ") and message in err[-1], err[-1]
    assert not (root / EXP / "baselines" / "dflash" / "baselines.json").exists()


def test_missing_target_is_one_stage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_stage("baselines", baselines_main, _args(tmp_path / "results"))
    assert "target/target.json: missing; run the `target` stage first" in capsys.readouterr().err
