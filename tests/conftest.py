"""Shared fixtures: tiny random targets described by a real target.json (built once per session)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (scripts/test.sh: one worker per core) each worker's torch takes its share of the cores, so
# workers do not oversubscribe them; set before anything imports torch. Pipeline stages set their own threads.
# Each worker also times under a timing lock of its own (draftforge/timing_lock.py): the suite compares no
# timings, and a machine-wide lock would idle one worker while the other's pipeline holds it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))
    _lock_dir = Path(tempfile.gettempdir()) / f"draftforge-timing-{os.getppid()}-{os.environ['PYTEST_XDIST_WORKER']}"
    _lock_dir.mkdir(exist_ok=True)
    os.environ.setdefault("DRAFTFORGE_TIMING_LOCK_DIR", str(_lock_dir))

REPO = Path(__file__).resolve().parents[1]


def _tiny_target(results_root: Path, architecture: str = "LlamaForCausalLM", **shape) -> dict:
    from draftforge.config import compose
    from draftforge.target.stage import resolve_target

    overrides = ["target=tiny-random", f"target.architecture={architecture}", f"target.random.architecture={architecture}"]
    overrides += [f"target.random.{k}={v}" for k, v in shape.items()]
    cfg = compose("smoke", overrides)
    return resolve_target(cfg.target, results_root)


@pytest.fixture(scope="session")
def tiny_target_info(tmp_path_factory) -> dict:
    """target.json record of a 4-layer random Llama (H 128, byte-level ChatML tokenizer)."""
    return _tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_qwen3_target_info(tmp_path_factory) -> dict:
    """target.json record of a 4-layer random Qwen3 (q/k norms) with the same shape."""
    return _tiny_target(tmp_path_factory.mktemp("tiny-qwen3-target"), architecture="Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def smollm2_target_info() -> dict:
    """The real default-world target (converted once into results/cache; ~1 min the first time)."""
    from draftforge.config import compose
    from draftforge.paths import default_results_root
    from draftforge.target.stage import resolve_target

    return resolve_target(compose("smoke").target, default_results_root())


@pytest.fixture(scope="session")
def smoke_repo(tmp_path_factory) -> Path:
    """A clean copy of the repo after `snakemake --cores all --config experiment=smoke` (every stage, local
    executor): the local pipeline test checks it, the SLURM pipeline test compares its own run with it."""
    from workflow_fixtures import smoke_pipeline

    return smoke_pipeline(tmp_path_factory.mktemp("clean-clone"))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster (scripts/slurm_local.sh) for the session, or the test skipped with the reason
    (tests/slurm_fixtures.py)."""
    from slurm_fixtures import local_slurm

    yield from local_slurm(tmp_path_factory.mktemp("slurm"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """A worker's own timing-lock folder goes with it (one per worker and run would pile up in /tmp)."""
    lock_dir = os.environ.get("DRAFTFORGE_TIMING_LOCK_DIR", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and Path(lock_dir).name.startswith("draftforge-timing-"):
        import shutil

        shutil.rmtree(lock_dir, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under `--dist loadgroup` every `xdist_group` test must carry its group in its node id (how pytest-xdist sends a
    group to one worker): a pytest/xdist pair that drops it would build the shared pipeline fixtures on every worker,
    silently doubling the suite's time."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {lost[:2]}...: use the pytest pyproject.toml pins (< 9)")
