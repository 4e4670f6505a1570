"""index.json: the extract stage's marker, written last by rank 0 once every shard is complete.

Fields: format, target_fingerprint, target_layer_ids, hidden_size, n_taps, feature_dim, storage_dtype,
scale_granularity (fp8), plan_key, splits {split: {n_shards, n_seqs, n_tokens, n_loss_tokens}},
n_seqs, n_tokens, n_bytes, shards [{file, split, n_seqs, n_tokens, n_loss_tokens, n_bytes, sha256}],
throughput {world_size, per_rank [...], tokens_per_s_total, ...}, meta (compute dtype, attention, ...).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from draftforge.errors import StageError
from draftforge.extract.plan import ExtractPlan
from draftforge.extract.runner import done_path, read_done
from draftforge.extract.shard_format import FORMAT, INDEX_NAME, shard_name
from draftforge.io import atomic_path, read_json, sha256_file, write_json

log = logging.getLogger(__name__)


def verify_owned(plan: ExtractPlan, shard_dir: Path, rank: int, world_size: int, part: int = 0, parts: int = 1) -> int:
    """Re-hash this rank's shards (of its part) done by an earlier run; a mismatch forgets the shard (recomputed).
    Returns the number of shards forgotten."""
    bad = 0
    for shard in plan.owned(rank, world_size, part, parts):
        rec = read_done(shard_dir, shard, plan.key)
        if rec is None:
            continue
        path = shard_dir / rec["file"]
        if sha256_file(path, chunk=8 << 20) != rec["sha256"]:
            log.warning("%s: checksum differs from its done record: recomputing it", path)
            done_path(shard_dir, shard.index).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            bad += 1
    return bad


def link_into(src: Path, dst: Path) -> None:
    """Make dst the same file as src (hard link; copy when across filesystems); atomic."""
    if dst.exists() and os.path.samefile(src, dst):
        return
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            log.warning("%s: hard link impossible (another filesystem?): copying", dst)
            shutil.copyfile(src, tmp)


def throughput(shard_dir: Path, world_size: int) -> dict[str, Any]:
    per_rank = []
    for r in range(world_size):
        path = shard_dir / f"stats-rank{r}.json"
        per_rank.append(read_json(path, what="rank stats") if path.is_file() else {"rank": r, "missing": True})
    tokens = sum(p.get("tokens", 0) for p in per_rank)
    slowest = max((p.get("seconds", 0.0) for p in per_rank), default=0.0)
    padded = sum(p.get("padded_tokens", 0) for p in per_rank)
    return {
        "world_size": world_size,
        "per_rank": per_rank,
        "tokens_computed": tokens,
        "tokens_per_s_total": round(tokens / slowest, 1) if slowest > 0 else 0.0,
        "padding_efficiency": round(tokens / padded, 4) if padded else None,
        "bytes_written": sum(p.get("bytes_written", 0) for p in per_rank),
        "shards_computed": sum(p.get("shards_computed", 0) for p in per_rank),
        "shards_resumed": sum(p.get("shards_resumed", 0) for p in per_rank),
    }


def build_index(plan: ExtractPlan, shard_dir: Path, *, taps: list[int], hidden_size: int, fingerprint: str,
                storage_dtype: str) -> dict[str, Any]:  # fmt: skip
    shards: list[dict[str, Any]] = []
    for shard in plan.shards:
        rec = read_done(shard_dir, shard, plan.key)
        if rec is None:
            raise StageError(f"{shard_dir / shard_name(shard.index)}: missing or incomplete (a rank failed or "
                             "was stopped); rerun the same command to compute the missing shards")  # fmt: skip
        shards.append({k: rec[k] for k in ("file", "split", "n_seqs", "n_tokens", "n_loss_tokens", "n_bytes", "sha256")})
    splits: dict[str, dict[str, int]] = {}
    for s in shards:
        agg = splits.setdefault(s["split"], {"n_shards": 0, "n_seqs": 0, "n_tokens": 0, "n_loss_tokens": 0})
        agg["n_shards"] += 1
        for k in ("n_seqs", "n_tokens", "n_loss_tokens"):
            agg[k] += s[k]
    index = {
        "format": FORMAT,
        "target_fingerprint": fingerprint,
        "target_layer_ids": list(taps),
        "layer_id_convention": "L = output of decoder layer L (0-based) = HF hidden_states[L+1]",
        "hidden_size": hidden_size,
        "n_taps": len(taps),
        "feature_dim": len(taps) * hidden_size,
        "storage_dtype": storage_dtype,
        "plan_key": plan.key,
        "splits": splits,
        "n_seqs": sum(s["n_seqs"] for s in shards),
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "n_bytes": sum(s["n_bytes"] for s in shards),
        "shards": shards,
    }
    if storage_dtype == "float8_e4m3fn":
        index["scale_granularity"] = "token,tap"  # hidden_scale (N, n_taps) float32
    return index


def finalize(ctx, plan: ExtractPlan, shard_dir: Path, *, taps: list[int], hidden_size: int, fingerprint: str,
             storage_dtype: str, meta: dict[str, Any], record: dict[str, Any] | None = None,
             ranks: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Rank 0 after the barrier (or the merge of extract.jobs parts): check every shard, link them into out_dir, write
    index.json last. `record`: top-level keys carried from upstream (the curate data's chat mode). `ranks`: the
    processes whose stats-rank<r>.json to sum (default: this job's world size; parts × ranks per part for a merge)."""
    from draftforge.tracking import mlflow_run

    out_dir = Path(ctx.out_dir)
    index = build_index(plan, shard_dir, taps=taps, hidden_size=hidden_size, fingerprint=fingerprint,
                        storage_dtype=storage_dtype)  # fmt: skip
    index.update(record or {})
    index["throughput"] = throughput(shard_dir, ranks or ctx.world_size)
    index["meta"] = meta
    (out_dir / INDEX_NAME).unlink(missing_ok=True)  # never a marker beside shards being replaced
    wanted = {s["file"] for s in index["shards"]}
    for stale in out_dir.glob("shard-*.safetensors"):
        if stale.name not in wanted:
            stale.unlink()
    for name in sorted(wanted):
        link_into(shard_dir / name, out_dir / name)
    tp = index["throughput"]
    metrics = {"tokens_per_s_total": tp["tokens_per_s_total"], "bytes_written": tp["bytes_written"],
               "n_tokens": index["n_tokens"], "n_seqs": index["n_seqs"], "n_shards": len(index["shards"]),
               "shards_computed": tp["shards_computed"], "shards_resumed": tp["shards_resumed"],
               "index_bytes": index["n_bytes"]}  # fmt: skip
    if tp["padding_efficiency"] is not None:
        metrics["padding_efficiency"] = tp["padding_efficiency"]
    for p in tp["per_rank"]:
        if "tokens_per_s" in p:
            metrics[f"tokens_per_s_rank{p['rank']}"] = p["tokens_per_s"]
    with mlflow_run(**ctx.tracking_kwargs(), run_name="extract", params=ctx.params) as run:
        run.log_metrics(metrics)
        write_json(out_dir / INDEX_NAME, index)  # the marker: last
        run.log_artifact(out_dir / INDEX_NAME)
    log.info("extract: %d shards, %d sequences, %d tokens, %.2f GiB; %.0f tokens/s total", len(index["shards"]),
             index["n_seqs"], index["n_tokens"], index["n_bytes"] / 2**30, tp["tokens_per_s_total"])  # fmt: skip
    return index
