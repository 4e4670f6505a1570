"""Faults and bad inputs a new user hits, through the real stages on tiny inputs: a drafter of another
target, several stages creating the MLflow store at once, a full disk and a killed train, bad input
files and keys, and an unsafe checkpoint. Each ends in one line naming the file or key; nothing
finished is lost."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.cli import run_stage  # noqa: E402
from draftforge.errors import StageError  # noqa: E402
from draftforge.io import write_json  # noqa: E402
from evaluate_fixtures import tiny_pipeline  # noqa: E402
from train_fixtures import synthetic_items, write_extract_index  # noqa: E402

pytestmark = pytest.mark.integration
PY = sys.executable


def _one_error_line(capsys, stage: str) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"draftforge {stage}: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines[-20:])
    return errors[0]


@pytest.mark.parametrize("stage", ["evaluate", "baselines"])
def test_drafter_of_another_target_is_refused(tmp_path, capsys, stage):
    from draftforge.baselines.stage import main as baselines_main
    from draftforge.evaluate.stage import main as evaluate_main

    root = tmp_path / "results"
    tiny_pipeline(root)
    cfg_path = root / "smoke" / "train" / "dflash" / "drafter" / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf["draftforge"] = {"target": "qwen3-8b", "target_fingerprint": "f" * 64}  # same shape, another target
    cfg_path.write_text(json.dumps(hf))
    args = ["experiment=smoke", "target=tiny-random", f"results_root={root}", "tracking.enabled=false",
            "evaluate.datasets=[chitchat]", "evaluate.num_prompts=1", "evaluate.max_new_tokens=4",
            "evaluate.methods=[ar,dflash]", "evaluate.warmup=0"]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_stage(stage, evaluate_main if stage == "evaluate" else baselines_main, args)
    assert exc.value.code == 2
    line = _one_error_line(capsys, stage)
    assert str(cfg_path) in line and "trained for another target" in line and "'qwen3-8b'" in line, line
    assert not (root / "smoke" / stage / "dflash" / f"{stage}.json").exists()


# What every stage does at its start on rank 0: open its MLflow run on <results_root>/mlflow.db.
_OPEN_RUN = """
import sys, time
from draftforge.tracking import mlflow_run
root, experiment, at = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, at - time.time()))  # start together, after the imports
with mlflow_run(results_root=root, experiment=experiment, stage="target", run_name="target/tiny-random") as run:
    run.log_metrics({"num_layers": 4})
"""


def test_stages_creating_the_mlflow_store_at_once(tmp_path):
    """Three stages start together on a fresh results root: each creates/opens results/mlflow.db."""
    root = tmp_path / "results"
    experiments = ["smoke", "default", "scale"]
    at = time.time() + 4
    procs = [subprocess.Popen([PY, "-c", _OPEN_RUN, str(root), e, str(at)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for e in experiments]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n\n".join(o[-2500:] for o in outs)
    with sqlite3.connect(root / "mlflow.db") as db:
        rows = db.execute("select e.name, r.status from runs r join experiments e on r.experiment_id = e.experiment_id").fetchall()
    assert sorted(rows) == sorted((f"draftforge/{e}", "FINISHED") for e in experiments)


def _train_runs(db: Path) -> list[str]:
    with sqlite3.connect(db) as con:
        return [r[0] for r in con.execute("select r.status from runs r join tags t on t.run_uuid = r.run_uuid "
                                          "where t.key = 'stage' and t.value = 'train' order by r.start_time")]  # fmt: skip


def test_full_disk_and_killed_train(tmp_path, capsys, tiny_target_info):
    """A SIGKILLed train leaves its MLflow run RUNNING and its checkpoints; too little disk is refused up
    front in one line, touching nothing; the next train marks the killed run KILLED and finishes."""
    from draftforge.train.stage import main as train_main

    root = tmp_path / "results"
    write_json(root / "smoke" / "target" / "target.json", tiny_target_info)
    items = synthetic_items(tiny_target_info, 6, seed=3)
    write_extract_index(root / "smoke" / "extract", {"train": items[:4], "val": items[4:]}, tiny_target_info)
    args = ["experiment=smoke", "target=tiny-random", f"results_root={root}", "train.num_anchors=8", "train.batch_seqs=2",
            "train.val_max_seqs=2", "train.val_num_anchors=8", "train.ckpt_every=1", "train.eval_every=2", "train.log_every=1"]  # fmt: skip
    ckpts = root / "smoke" / ".work" / "train" / "dflash" / "checkpoints"
    proc = subprocess.Popen([PY, "-m", "draftforge.train", *args, "train.max_steps=100000"], start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (root / "mlflow.db").is_file() and list(ckpts.glob("step-*.pt")) and _train_runs(root / "mlflow.db") == ["RUNNING"]:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    kept = sorted(p.name for p in ckpts.glob("step-*.pt"))
    assert kept and _train_runs(root / "mlflow.db") == ["RUNNING"]

    with pytest.raises(SystemExit) as exc:
        run_stage("train", functools.partial(train_main, free_bytes=lambda path: 1000), [*args, "train.max_steps=2"])
    assert exc.value.code == 2
    line = _one_error_line(capsys, "train")
    assert f"{ckpts}: not enough disk for training checkpoints and the export" in line and "1000 B is free" in line, line
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == kept and not (root / "smoke" / "train" / "dflash" / "metrics.json").exists()

    run_stage("train", train_main, [*args, "train.max_steps=2"])
    assert (root / "smoke" / "train" / "dflash" / "metrics.json").is_file()
    assert _train_runs(root / "mlflow.db") == ["KILLED", "FINISHED"]


def _target_folder_with_bad_config(tmp_path: Path, info: dict) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(info["hf_path"], folder)
    (folder / "config.json").write_bytes((folder / "config.json").read_bytes().replace(b'"', b'\xff"', 1))
    return folder


@pytest.mark.parametrize("case", ["no_datasets", "config_not_utf8", "results_root_in_proc"])
def test_bad_input_is_one_line(tmp_path, capsys, tiny_target_info, case):
    from draftforge.evaluate.stage import main as evaluate_main
    from draftforge.target.stage import main as target_main

    root = tmp_path / "results"
    base = ["experiment=smoke", "target=tiny-random", "tracking.enabled=false"]
    if case == "no_datasets":
        write_json(root / "smoke" / "target" / "target.json", tiny_target_info)
        args = [*base, f"results_root={root}", "evaluate.datasets=[]", "evaluate.methods=[ar]"]
        stage, main, want = "evaluate", evaluate_main, "evaluate.datasets: empty"
    elif case == "config_not_utf8":
        folder = _target_folder_with_bad_config(tmp_path, tiny_target_info)
        stage, main, want = "target", target_main, f"{folder / 'config.json'}: not UTF-8"
        args = [*base, f"results_root={root}", "target.source=hf_dir", f"target.path={folder}"]
    else:
        stage, main, args, want = "target", target_main, [*base, "results_root=/proc/draftforge"], "results_root=/proc/draftforge: cannot create"
    with pytest.raises(SystemExit) as exc:
        run_stage(stage, main, args)
    assert exc.value.code == 2
    line = _one_error_line(capsys, stage)
    assert want in line, line
    assert not (root / "smoke" / "evaluate" / "dflash" / "evaluate.json").exists()
    assert not (root / "smoke" / "target" / "target.json").exists() or stage == "evaluate"


def test_jsonl_with_one_bad_byte_drops_only_that_line(tmp_path):
    from draftforge.curate.config import SourceConfig
    from draftforge.curate.schema import Drop
    from draftforge.curate.sources import iter_jsonl

    path = tmp_path / "chats.jsonl"
    good = [json.dumps({"id": f"c{i}", "prompt": f"question number {i}?"}) for i in range(3)]
    path.write_bytes("\n".join(good[:2]).encode() + b'\n{"id": "bad", "prompt": "caf\xe9"}\n' + good[2].encode() + b"\n")
    src = SourceConfig(name="mine", kind="jsonl", path=str(path))
    items = list(iter_jsonl(src, min_chars=1, on_malformed="drop"))
    drops = [i for i in items if isinstance(i, Drop)]
    assert len(items) == 4 and len(drops) == 1 and drops[0].detail == "chats.jsonl:3"
    with pytest.raises(StageError, match=rf"^{path}:3: not UTF-8 .*curate.on_malformed=drop"):
        list(iter_jsonl(src, min_chars=1, on_malformed="error"))


def test_checkpoint_loading_never_runs_pickled_code(tmp_path):
    """A checkpoint that needs anything beyond tensors and plain containers is refused (weights_only
    with an explicit allow-list), and the code it carries does not run."""
    import torch

    from draftforge.train.checkpoint import load_latest, save_checkpoint

    ckpt_dir = tmp_path / "checkpoints"
    real = {"resume_key": "k", "step": 3, "model": {"w": torch.ones(2)}, "rng": {"python": __import__("random").getstate()}}
    save_checkpoint(ckpt_dir, 3, real)
    assert load_latest(ckpt_dir, "k")["step"] == 3
    witness = tmp_path / "ran"
    save_checkpoint(ckpt_dir, 4, {"resume_key": "k", "step": 4, "evil": _Evil(str(witness))})
    with pytest.raises(StageError, match=r"step-00000004\.pt: not a loadable draftforge checkpoint .*delete it"):
        load_latest(ckpt_dir, "k")
    assert not witness.exists()


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_full_disk_is_one_line(tmp_path, capsys):
    """Writing on a full disk (/dev/full: the kernel's own ENOSPC) through a plain write and through
    torch.save, wrapped in another error as stage code does: one line and exit 2, not tracebacks."""
    import torch

    def stage_main(use_torch: bool):
        def main(ctx):
            try:
                if use_torch:
                    torch.save({"w": torch.zeros(1 << 16)}, "/dev/full")
                else:
                    Path("/dev/full").write_text("x" * (1 << 16))
            except Exception as exc:
                raise RuntimeError("while saving a checkpoint") from exc
        return main

    for use_torch in (True, False):
        with pytest.raises(SystemExit) as exc:
            run_stage("train", stage_main(use_torch), ["experiment=smoke", "target=tiny-random", f"results_root={tmp_path}"])
        assert exc.value.code == 2
        assert "disk full or write failed" in _one_error_line(capsys, "train")


# Another experiment's timed stage on this machine, holding the timing lock until killed.
_HOLD_TIMING_LOCK = """
import sys, time
from draftforge.timing_lock import TimingLockConfig, hold_timing_lock
with hold_timing_lock(TimingLockConfig(dir=sys.argv[1]), experiment="other", stage="evaluate", branch="dspark"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("stage", ["evaluate", "baselines"])
def test_a_timed_stage_waits_for_another_experiments_timing(tmp_path, capsys, stage):
    """evaluate and baselines take the machine-wide timing lock before any engine loads: while another
    experiment's stage times, they wait, and past timing_lock.timeout_s end in one line naming it, writing nothing."""
    from draftforge.baselines.stage import main as baselines_main
    from draftforge.evaluate.stage import main as evaluate_main

    root, locks = tmp_path / "results", tmp_path / "locks"
    tiny_pipeline(root)
    holder = subprocess.Popen([PY, "-c", _HOLD_TIMING_LOCK, str(locks)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["experiment=smoke", "target=tiny-random", f"results_root={root}", "tracking.enabled=false",
                "evaluate.datasets=[chitchat]", "evaluate.num_prompts=1", "evaluate.max_new_tokens=4",
                "evaluate.methods=[ar,dflash]", "evaluate.warmup=0", "baselines.methods.ngram.enabled=false",
                f"timing_lock.dir={locks}", "timing_lock.timeout_s=2"]  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            run_stage(stage, evaluate_main if stage == "evaluate" else baselines_main, args)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert exc.value.code == 2
    line = _one_error_line(capsys, stage)
    assert f"{locks}/draftforge-timing.lock: waited 2 s (timing_lock.timeout_s)" in line, line
    assert f"still held by pid {holder.pid} on " in line and "(experiment 'other', evaluate/dspark, since " in line, line
    out = root / "smoke" / stage / "dflash"
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["provenance.json"]  # written before the stage ran
