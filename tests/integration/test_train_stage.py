"""The train stage end to end through its CLI: target.json + extract output → drafter/ + metrics.json.

Single process and torchrun with 2 gloo processes; bad input (features of another target / other
taps) is one StageError line with exit status 2 and leaves earlier outputs intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.io import write_json  # noqa: E402
from train_fixtures import synthetic_items, with_last, write_extract_index  # noqa: E402

pytestmark = pytest.mark.integration
PY = sys.executable
OVERRIDES = ["experiment=smoke", "target=tiny-random", "train.max_steps=6", "train.num_anchors=8", "train.batch_seqs=2",
             "train.eval_every=3", "train.ckpt_every=3", "train.log_every=2", "train.val_max_seqs=2", "train.val_num_anchors=8"]


def _world(root: Path, info: dict, items, **index_kw) -> None:
    write_json(root / "smoke" / "target" / "target.json", info)
    write_extract_index(root / "smoke" / "extract", {"train": items[:6], "val": items[6:]}, info, **index_kw)


def _run(cmd: list[str], root: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd + OVERRIDES + [f"results_root={root}"], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def items(tiny_target_info):
    return synthetic_items(tiny_target_info, 8, seed=5)


def test_stage_trains_exports_and_resumes(tiny_target_info, items, tmp_path):
    _world(tmp_path, tiny_target_info, items)
    proc = _run([PY, "-m", "draftforge.train"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "smoke" / "train" / "dflash"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 and [e["step"] for e in metrics["val_curve"]] == [3, 6]
    assert metrics["selected"].startswith("best val_sim_tau")
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == tiny_target_info["drafter"]["target_layer_ids"]
    from draftforge.drafter.export import load_drafter

    load_drafter(out / "drafter")
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("draftforge/smoke")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.stage = 'train'")
    logged = run.data.metrics
    for key in ("loss", "lr", "grad_norm", "block_tokens_per_s", "val_sim_tau", "val_acc_slot_1", "best_val_sim_tau"):
        assert key in logged, key
    assert len(client.get_metric_history(run.info.run_id, "val_sim_tau")) == 2
    assert (tmp_path / "smoke" / ".work" / "train" / "dflash" / "checkpoints" / "latest").is_file()
    # rerun: everything is in the checkpoint, nothing is retrained
    again = _run([PY, "-m", "draftforge.train"], tmp_path)
    assert again.returncode == 0 and "resuming from" in again.stderr


@pytest.mark.parametrize("drafter", ["dflash", "mtp"])
def test_stage_under_torchrun_two_gloo_processes(tiny_target_info, items, tmp_path, drafter):
    """2 gloo ranks: the dflash branch trains the drafter, the mtp branch the MTP head (global MTP batch 2 x 1);
    every rank trains, rank 0 exports."""
    _world(tmp_path, tiny_target_info, with_last(tiny_target_info, items) if drafter == "mtp" else items)
    extra = ["drafter=mtp", "train.mtp_steps=4", "train.mtp_eval_every=2", "train.mtp_rows=16"] if drafter == "mtp" else []
    proc = _run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "draftforge.train",
                 "train.cpu_procs=2", *extra], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "smoke" / "train" / drafter / "metrics.json").read_text())
    if drafter == "dflash":
        assert metrics["world_size"] == 2 and metrics["steps"] == 6
        return
    mtp = metrics["mtp"]
    assert mtp["world_size"] == 2 and mtp["global_batch"] == 2 and [e["step"] for e in mtp["val_curve"]] == [2, 4]
    assert (tmp_path / "smoke" / "train" / "mtp" / "mtp" / "model.safetensors").is_file()
    ckpts = tmp_path / "smoke" / ".work" / "train" / "mtp" / "mtp_checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000004.pt"


@pytest.mark.parametrize("kind", ["fingerprint", "taps"])
def test_stage_refuses_features_of_another_target(tiny_target_info, items, tmp_path, kind):
    kw = {"fingerprint": "0" * 64} if kind == "fingerprint" else {"taps": [0, 3]}
    _world(tmp_path, tiny_target_info, items, **kw)
    keep = tmp_path / "smoke" / "train" / "dflash" / "drafter" / "keep.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("earlier output")
    proc = _run([PY, "-m", "draftforge.train"], tmp_path)
    assert proc.returncode == 2
    err = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "index.json" in err[0] and ("target" in err[0] or "tapped layers" in err[0]), proc.stderr[-2000:]
    assert keep.read_text() == "earlier output"
    assert not (tmp_path / "smoke" / "train" / "dflash" / "metrics.json").exists()


def test_stage_trains_mtp_head(tiny_target_info, items, tmp_path):
    """The mtp branch (drafter=mtp): features carry `last_hidden` (the final-normed last layer); the stage trains
    an MTP head only and exports it in vLLM's MiMo MTP format (train/mtp/mtp/), loadable as the engine's head.
    Without `last_hidden`: one StageError naming the rule; with train.features=online: one StageError."""
    from draftforge.drafter.mtp import load_mtp_head

    mtp_args = [PY, "-m", "draftforge.train", "drafter=mtp", "train.mtp_steps=6", "train.mtp_eval_every=3",
                "train.mtp_rows=16"]
    _world(tmp_path, tiny_target_info, items)
    bad = _run(mtp_args, tmp_path)
    assert bad.returncode == 2 and "needs_last_layer" in bad.stderr.strip().splitlines()[-1], bad.stderr[-2000:]
    online = _run(mtp_args + ["train.features=online"], tmp_path)
    assert online.returncode == 2 and "train.features=online" in online.stderr.strip().splitlines()[-1], online.stderr[-2000:]
    _world(tmp_path, tiny_target_info, with_last(tiny_target_info, items))
    proc = _run(mtp_args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "smoke" / "train" / "mtp"
    assert not (out / "drafter").exists()  # the mtp branch trains no block drafter
    mtp = json.loads((out / "metrics.json").read_text())["mtp"]
    assert mtp["steps"] == 6 and [e["step"] for e in mtp["val_curve"]] == [3, 6] and mtp["format"] == "mimo"
    cfg = json.loads((out / "mtp" / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    head = load_mtp_head(out / "mtp")
    assert head.source == "trained" and head.form == "mimo" and head.hidden_size == tiny_target_info["hidden_size"]


def test_stage_trains_and_exports_a_dspark_drafter(tiny_target_info, items, tmp_path):
    """drafter=dspark on features with the target's last layer → a DSpark export with analytic metrics, over a
    draft vocabulary as conf/drafter/dspark.yaml drafts (64 of this target's 512 tokens; the default's 8,192 is more
    than it has); the same features without the last layer → one StageError naming the switch."""
    args = [PY, "-m", "draftforge.train", "drafter=dspark", "drafter.markov_rank=8", "drafter.draft_vocab_size=64"]
    _world(tmp_path, tiny_target_info, items)
    bad = _run(args, tmp_path)
    assert bad.returncode == 2 and "needs_last_layer" in bad.stderr.strip().splitlines()[-1]
    _world(tmp_path, tiny_target_info, with_last(tiny_target_info, items))
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "smoke" / "train" / "dspark"
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["markov_rank"] == 8 and cfg["sample_from_anchor"] is True
    assert cfg["draft_vocab_size"] == 64
    metrics = json.loads((out / "metrics.json").read_text())
    assert "val_analytic_tau" in metrics["best"] and "val_conf_ece" in metrics["best"]
    from draftforge.drafter.dspark import DSparkDrafter
    from draftforge.drafter.export import load_drafter

    drafter = load_drafter(out / "drafter")
    assert isinstance(drafter, DSparkDrafter) and drafter.markov_head.markov_w2.weight.shape == (64, 8)  # (D, r)


def test_stage_resumes_an_interrupted_mtp_head(tiny_target_info, items, tmp_path, monkeypatch):
    """The mtp branch killed inside MTP step 5: no marker; the rerun resumes from the step-3 checkpoint and
    writes the metrics and export an uninterrupted run writes."""
    import draftforge.train.mtp as mtp_train
    from draftforge.cli import run_stage
    from draftforge.train.stage import main

    data = with_last(tiny_target_info, items)
    args = [*OVERRIDES, "drafter=mtp", "train.mtp_steps=6", "train.mtp_eval_every=2", "train.mtp_rows=16",
            "tracking.enabled=false"]
    once, twice = tmp_path / "once", tmp_path / "twice"
    for root in (once, twice):
        _world(root, tiny_target_info, data)
    run_stage("train", main, [*args, f"results_root={once}"])

    real, calls = mtp_train.depth_ce_sums, []

    def killed_in_step_5(*a, **kw):
        calls.append(1)
        if len(calls) == 5:  # one sequence per step: the 5th call is step 5
            raise RuntimeError("killed")
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(mtp_train, "depth_ce_sums", killed_in_step_5)
        with pytest.raises(RuntimeError, match="killed"):
            run_stage("train", main, [*args, f"results_root={twice}"])
    ckpts = twice / "smoke" / ".work" / "train" / "mtp" / "mtp_checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000003.pt"
    assert not (twice / "smoke" / "train" / "mtp" / "metrics.json").exists()
    run_stage("train", main, [*args, f"results_root={twice}"])
    got, want = (json.loads((r / "smoke" / "train" / "mtp" / "metrics.json").read_text())["mtp"] for r in (twice, once))
    assert got["resumed_from"] == 3 and want["resumed_from"] is None
    for key in ("best", "val_curve", "loss_first", "loss_last", "steps", "selected"):
        assert got[key] == want[key], key
    weights = "smoke/train/mtp/mtp/model.safetensors"
    assert (twice / weights).read_bytes() == (once / weights).read_bytes()


def test_mtp_branch_refuses_too_little_disk_before_writing(tiny_target_info, items, tmp_path, capsys):
    """The MTP head's checkpoints are budgeted like the drafter's: one line naming mtp_checkpoints, exit 2, and
    no checkpoint, export or marker written."""
    import functools

    from draftforge.cli import run_stage
    from draftforge.train.stage import main

    _world(tmp_path, tiny_target_info, with_last(tiny_target_info, items))
    args = [*OVERRIDES, "drafter=mtp", "train.mtp_steps=2", "tracking.enabled=false", f"results_root={tmp_path}"]
    with pytest.raises(SystemExit) as exc:
        run_stage("train", functools.partial(main, free_bytes=lambda path: 1000), args)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    ckpts = tmp_path / "smoke" / ".work" / "train" / "mtp" / "mtp_checkpoints"
    assert len(err) == 1 and f"{ckpts}: not enough disk for training checkpoints" in err[0] and "1000 B is free" in err[0]
    assert not list(ckpts.glob("*.pt")) and not (tmp_path / "smoke" / "train" / "mtp" / "metrics.json").exists()


def test_sigterm_stops_after_a_checkpointed_step_and_a_rerun_resumes(tiny_target_info, items, tmp_path):
    """SIGTERM (a scheduler's preemption) mid-training: the stage finishes its step, writes that step's checkpoint,
    exits 2 with one line naming the step, and writes no marker; the same command then resumes from that step."""
    import signal
    import time

    _world(tmp_path, tiny_target_info, items)
    args = [PY, "-m", "draftforge.train", *OVERRIDES, f"results_root={tmp_path}", "train.max_steps=1000",
            "train.ckpt_every=50", "train.eval_every=100000", "tracking.enabled=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    ckpts = tmp_path / "smoke" / ".work" / "train" / "dflash" / "checkpoints"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not (ckpts / "step-00000050.pt").is_file():
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("draftforge train: error: train: stopped by SIGTERM after step ") and "rerun" in last, last
    step = int(last.split("after step ")[1].split("/")[0])
    assert 50 <= step < 1000 and (ckpts / f"step-{step:08d}.pt").is_file()  # the stop step itself is checkpointed
    assert not (tmp_path / "smoke" / "train" / "dflash" / "metrics.json").exists()
    again = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert again.returncode == 0 and f"(step {step})" in again.stderr, again.stderr[-3000:]  # resumed there
    assert json.loads((tmp_path / "smoke" / "train" / "dflash" / "metrics.json").read_text())["steps"] == 1000


def test_stage_trains_a_drafter_with_a_draft_vocabulary(tiny_target_info, items, tmp_path):
    """drafter.draft_vocab_size on the acceptance-weighted objective: the export carries the D most frequent train
    labels (vLLM's d2t + lm_head), the run records their coverage, and the drafter loads for the engine."""
    _world(tmp_path, tiny_target_info, with_last(tiny_target_info, items))
    proc = _run([PY, "-m", "draftforge.train", "drafter=dflash_aw", "drafter.draft_vocab_size=64"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "smoke" / "train" / "dflash_aw"
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64
    metrics = json.loads((out / "metrics.json").read_text())
    assert "val_analytic_tau" in metrics["best"]
    from collections import Counter

    from draftforge.drafter.export import load_drafter

    labels = Counter(t for ids, mask, *_ in items[:6] for t, m in zip(ids.tolist(), mask.tolist()) if m)
    drafter = load_drafter(out / "drafter")
    assert set(drafter.draft_ids.tolist()) >= {t for t, _ in labels.most_common(8)}  # the frequent ones, whatever ties
    assert "draft vocabulary: the 64 most frequent answer tokens" in proc.stderr
    bad = _run([PY, "-m", "draftforge.train", "drafter=mtp", "drafter.draft_vocab_size=64"], tmp_path)
    assert bad.returncode == 2 and "drafter.draft_vocab_size" in bad.stderr.strip().splitlines()[-1]
