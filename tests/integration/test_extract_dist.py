"""The extract CLI for real: torchrun with 2 gloo processes == 1 process (by checksum), a SIGKILLed
run resumes computing only missing shards, MLflow gets per-rank throughput, errors exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftforge.io import read_json
from extract_fixtures import EXPERIMENT, make_experiment, overrides

pytestmark = pytest.mark.integration
VENV_BIN = Path(sys.executable).parent
LONG = {"train": [[20 + (7 * i) % 50 for i in range(24)], [15 + (5 * i) % 40 for i in range(12)]], "val": [[30, 8, 41, 17]]}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return env


def _cmd(root: Path, nproc: int, *extra: str) -> list[str]:
    args = overrides(root, "extract.tokens_per_shard=120", "extract.storage_dtype=bfloat16", *extra)
    if nproc == 1:
        return [sys.executable, "-m", "draftforge.extract", *args]
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m", "draftforge.extract", *args]


def _run(root: Path, nproc: int, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(root, nproc, *extra), env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _index(root: Path) -> dict:
    return read_json(root / EXPERIMENT / "extract" / "index.json")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_target_info):
    root = tmp_path_factory.mktemp("x1")
    make_experiment(root, tiny_target_info, LONG)
    _run(root, 1)
    return _index(root)


def test_two_gloo_processes_write_the_same_shards_as_one(tmp_path, one_process, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LONG)
    _run(tmp_path, 2, "extract.cpu_procs=2", "tracking.enabled=true")
    two = _index(tmp_path)
    assert len(one_process["shards"]) >= 6
    assert [s["sha256"] for s in two["shards"]] == [s["sha256"] for s in one_process["shards"]]
    per_rank = two["throughput"]["per_rank"]
    assert [p["rank"] for p in per_rank] == [0, 1]
    assert all(p["shards_computed"] >= 3 and p["tokens_per_s"] > 0 for p in per_rank)
    assert sum(p["shards_computed"] for p in per_rank) == len(two["shards"])

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[f"draftforge/{EXPERIMENT}"], filter_string="tags.stage = 'extract'")
    assert len(runs) == 1  # rank 0 only
    for key in ("tokens_per_s_rank0", "tokens_per_s_rank1", "tokens_per_s_total", "bytes_written"):
        assert runs[f"metrics.{key}"].iloc[0] > 0


def test_sigkilled_run_resumes_only_missing_shards(tmp_path, one_process, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LONG)
    work = tmp_path / EXPERIMENT / ".work" / "extract" / "shards"
    proc = subprocess.Popen(_cmd(tmp_path, 1), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(list(work.glob("*/shard-*.done.json"))) < 2:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    done = len(list(work.glob("*/shard-*.done.json")))
    total = len(one_process["shards"])
    assert 2 <= done < total, f"kill landed after {done}/{total} shards"
    assert not (tmp_path / EXPERIMENT / "extract" / "index.json").exists()
    _run(tmp_path, 1)
    index = _index(tmp_path)
    tp = index["throughput"]
    assert tp["shards_resumed"] == done  # done records are written (atomically) after their shard
    assert tp["shards_computed"] + tp["shards_resumed"] == total
    assert index["shards"] == one_process["shards"]


def test_cli_error_is_one_line_exit_2(tmp_path, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LONG)
    (tmp_path / EXPERIMENT / "curate" / "train-00001.parquet").write_bytes(b"not parquet")
    proc = subprocess.run(_cmd(tmp_path, 1), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "train-00001.parquet: not a readable parquet file" in errors[0], proc.stderr
