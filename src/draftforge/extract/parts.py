"""extract.jobs = K > 1: the marker each extract_part job writes, and what the merging `extract` job reads.

Invariant: part k of K extracts `plan.part(k, K)` (contiguous shard ranges, disjoint, covering the plan) into the
work folder a single job uses (shards/<plan key>/), with the plan a single job makes, so the merge's index.json
lists the same shard files with the same checksums as a one-job run. A part marker is written last, by the part's
rank 0, once every shard of its range is done (a rerun of a failed part resumes from its done shards); the merge
refuses markers that disagree with each other or with the target, naming the part to rerun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftforge.errors import StageError
from draftforge.extract.plan import ExtractPlan
from draftforge.extract.runner import read_done
from draftforge.io import read_json, write_json
from draftforge.paths import part_marker

PART_FORMAT = "draftforge.extract.part/1"


def write_part_marker(path: Path, plan: ExtractPlan, shard_dir: Path, *, part: int, parts: int, world_size: int,
                      extra_key: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """After the part's barrier: every shard of its range done, then the marker (atomically, last)."""
    shards = plan.part(part, parts)
    missing = [s.index for s in shards if read_done(shard_dir, s, plan.key) is None]
    if missing:
        raise StageError(f"{shard_dir}: shards {missing} of extract part {part} are not done (a rank failed or was "
                         "stopped); rerun the same command to compute them")  # fmt: skip
    record = {"format": PART_FORMAT, "part": part, "parts": parts, "world_size": world_size, "plan_key": plan.key,
              "extra_key": extra_key, "meta": meta, "shards": [s.index for s in shards]}  # fmt: skip
    write_json(path, record)
    return record


def read_part_markers(results_root: str | Path, experiment: str, parts: int, fingerprint: str) -> list[dict[str, Any]]:
    """The K part markers, checked to describe one plan for this target; a missing or stale one names its part."""
    records = []
    for k in range(parts):
        path = part_marker(results_root, experiment, k)
        if not path.is_file():
            raise StageError(f"{path}: missing: extract part {k} of {parts} has not finished (rule extract_part)")
        rec = read_json(path, what="extract part marker")
        if rec.get("format") != PART_FORMAT or rec.get("part") != k or rec.get("parts") != parts:
            raise StageError(f"{path}: not part {k} of extract.jobs={parts} (format {rec.get('format')!r}, part "
                             f"{rec.get('part')} of {rec.get('parts')}); rerun extract_part {k}")  # fmt: skip
        if rec["extra_key"].get("target") != fingerprint:
            raise StageError(f"{path}: extracted for target {str(rec['extra_key'].get('target'))[:12]}, not "
                             f"{fingerprint[:12]} (target.json); rerun the extract parts")  # fmt: skip
        if records and (rec["plan_key"], rec["extra_key"], rec["world_size"]) != (
            records[0]["plan_key"], records[0]["extra_key"], records[0]["world_size"]
        ):
            raise StageError(f"{path}: plan {rec['plan_key']} differs from part 0's {records[0]['plan_key']} (the "
                             "parts ran on different inputs or settings); rerun the extract parts")  # fmt: skip
        records.append(rec)
    return records
