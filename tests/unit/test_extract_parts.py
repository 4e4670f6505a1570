"""extract.jobs = K: K part jobs over contiguous shard ranges, each resumable, then a merge that writes the index a
single job writes (same shard files and checksums). On CPU, in one process, without a scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draftforge.errors import StageError
from draftforge.extract.stage import run_extract
from draftforge.io import read_json, write_json
from draftforge.paths import part_marker
from extract_fixtures import EXPERIMENT, LENGTHS, context, make_experiment


def _run(root: Path, *extra: str, **kw) -> dict[str, Any] | None:
    return run_extract(context(root, *extra), **kw)


def _computed(index: dict[str, Any]) -> dict[str, Any]:
    """What the extraction computed: everything but the throughput record (who ran it, how fast)."""
    return {k: v for k, v in index.items() if k != "throughput"}


@pytest.fixture(scope="module")
def one_job(tmp_path_factory, tiny_target_info) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one-job")
    make_experiment(root, tiny_target_info, LENGTHS)
    return _run(root)


def test_parts_merge_into_the_one_job_index(tmp_path, one_job, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    parts = 3
    for k in range(parts):
        assert _run(tmp_path, f"extract.jobs={parts}", f"extract.part={k}") is None  # a part writes no index
    assert not (tmp_path / EXPERIMENT / "extract" / "index.json").exists()
    ranges = [read_json(part_marker(tmp_path, EXPERIMENT, k))["shards"] for k in range(parts)]
    assert all(r == list(range(r[0], r[-1] + 1)) for r in ranges if r)  # contiguous
    assert sum(ranges, []) == list(range(len(one_job["shards"])))  # disjoint, covering the plan in order
    assert len(one_job["shards"]) > parts  # the fixture's plan has more shards than parts
    merged = _run(tmp_path, f"extract.jobs={parts}")
    assert _computed(merged) == _computed(one_job)  # shard files and sha256, plan key, splits, meta
    assert _computed(read_json(tmp_path / EXPERIMENT / "extract" / "index.json")) == _computed(one_job)
    tp = merged["throughput"]
    assert tp["world_size"] == parts and tp["shards_computed"] == len(one_job["shards"])


def test_a_stopped_part_resumes_and_the_merge_waits_for_it(tmp_path, one_job, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    _run(tmp_path, "extract.jobs=2", "extract.part=0")
    assert _run(tmp_path, "extract.jobs=2", "extract.part=1", stop_after=1) is None  # "killed" after one shard
    with pytest.raises(StageError, match=r"part-1.json: missing: extract part 1 of 2 has not finished"):
        _run(tmp_path, "extract.jobs=2")
    _run(tmp_path, "extract.jobs=2", "extract.part=1")  # the rerun resumes
    shard_dir = next((tmp_path / EXPERIMENT / ".work" / "extract" / "shards").iterdir())
    stats = read_json(shard_dir / "stats-rank1.json")  # part 1's rank 0
    assert stats["part"] == 1 and stats["shards_resumed"] == 1 and stats["shards_computed"] >= 1
    assert _computed(_run(tmp_path, "extract.jobs=2")) == _computed(one_job)


def test_the_merge_refuses_parts_of_another_plan(tmp_path, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    for k in range(2):
        _run(tmp_path, "extract.jobs=2", f"extract.part={k}")
    marker = part_marker(tmp_path, EXPERIMENT, 1)
    write_json(marker, {**read_json(marker), "plan_key": "0123456789abcdef"})
    with pytest.raises(StageError, match=r"part-1.json: plan 0123456789abcdef differs from part 0's"):
        _run(tmp_path, "extract.jobs=2")


def test_part_outside_the_jobs_fails_at_compose(tmp_path):
    from draftforge.config import compose

    with pytest.raises(StageError, match=r"extract.part: 2 must be -1 \(all\) or in \[0, extract.jobs=2\)"):
        compose("smoke", ["extract.jobs=2", "extract.part=2"])
