"""`extract` stage entry: plan, preflight, per-rank extraction, then index.json on rank 0.

Launch: `python -m draftforge.extract experiment=NAME` or
`torchrun --nproc_per_node N -m draftforge.extract experiment=NAME` (NCCL on GPUs with
device = cuda:LOCAL_RANK, gloo on CPU). Rank r extracts shards i ≡ r (mod N); after a barrier rank 0
checks every shard's done record, hard-links the shards into the output folder and writes index.json
last (the marker). Shards stay in the work area, so a rerun after a failure resumes (see runner.py).
With extract.jobs = K > 1, Snakemake runs K part jobs (`extract.part=k`: the k-th contiguous shard range, same
plan, same work area), each ending with its part marker, then this stage once more (part -1) to merge: it reads
the markers and writes index.json as above, without loading the target (parts.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from draftforge.chat import RECORD_KEY, ChatMode
from draftforge.errors import StageError
from draftforge.extract.index import finalize, verify_owned
from draftforge.extract.parts import read_part_markers, write_part_marker
from draftforge.extract.plan import ExtractPlan, plan_extraction
from draftforge.extract.preflight import FreeBytes, check_disk, disk_free, estimate_bytes
from draftforge.extract.runner import TargetView, read_done, run_rank
from draftforge.io import read_json, sha256_json, write_json
from draftforge.paths import part_marker
from draftforge.runtime import dtype_named, init_distributed, pick_device

log = logging.getLogger(__name__)


class Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), no-ops otherwise."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_min: int) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.active = init_distributed(world_size, device, timeout_min)

    def barrier(self) -> None:
        if self.active:
            torch_dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.active and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def compute_dtype(cfg, info: dict[str, Any], device: torch.device) -> torch.dtype:
    name = cfg.compute_dtype or (info.get("dtype") or "bfloat16" if device.type == "cuda" else "float32")
    return dtype_named("extract.compute_dtype", name)


def attn_impl(cfg, device: torch.device) -> str:
    return cfg.attn_implementation if cfg.attn_implementation != "auto" else ("sdpa" if device.type == "cuda" else "eager")


def check_curate(ctx, info: dict[str, Any]) -> dict[str, Any]:
    """The curate manifest, checked to belong to this target."""
    manifest_path = ctx.input_marker("curate")
    manifest = read_json(manifest_path, what="curate manifest")
    fp = manifest.get("target_fingerprint")
    if fp is not None and fp != info["fingerprint"]:
        raise StageError(
            f"{manifest_path}: target_fingerprint {str(fp)[:12]} != target.json fingerprint "
            f"{info['fingerprint'][:12]}: curate ran for another target; rerun curate"
        )
    return manifest


def make_plan(ctx, extra_key: dict[str, Any]) -> ExtractPlan:
    cfg = ctx.cfg.extract
    return plan_extraction(
        ctx.input_dir("curate"), list(cfg.splits), max_seq_len=cfg.max_seq_len,
        tokens_per_shard=cfg.tokens_per_shard, seqs_per_shard=cfg.seqs_per_shard, sort_window=cfg.sort_window,
        extra_key=extra_key,
    )  # fmt: skip


def run_extract(ctx, *, free_bytes: FreeBytes = disk_free, stop_after: int | None = None) -> dict[str, Any] | None:
    """The whole stage for this rank (of this part); returns the index (rank 0 of a single job, or the merge) or
    None. `free_bytes` is the free-space probe (injectable for tests); `stop_after` ends after that many shards
    (kill test)."""
    from draftforge.target.load import load_target_model, read_target_info

    cfg = ctx.cfg.extract
    if cfg.jobs > 1 and cfg.part < 0:
        return merge_parts(ctx)
    part, parts = max(cfg.part, 0), cfg.jobs
    global_rank = part * ctx.world_size + ctx.rank  # its stats file: ranks of all parts side by side
    target_json = ctx.input_marker("target")
    info = read_target_info(target_json)
    data_mode = ChatMode.record_of(check_curate(ctx, info))  # the chat mode curate rendered the sequences in
    taps = list(info["drafter"].get("target_layer_ids") or [])
    if not taps or sorted(set(taps)) != taps or taps[0] < 0 or taps[-1] >= int(info["num_layers"]):
        raise StageError(f"{target_json}: drafter.target_layer_ids {taps} must be strictly increasing ids "
                         f"in [0, {info['num_layers']}) (output of decoder layer i)")  # fmt: skip
    device = pick_device("extract.device", cfg.device, cfg.gpus, ctx.local_rank)
    dtype, attn = compute_dtype(cfg, info, device), attn_impl(cfg, device)
    from draftforge.drafter.settings import needs_last_layer

    store_last = needs_last_layer(ctx.cfg)  # the target's next-token distribution for a listed drafter
    extra_key = {"target": info["fingerprint"], "taps": taps, "storage": cfg.storage_dtype, "dtype": str(dtype),
                 "attn": attn, "device": device.type, "tokens_per_batch": cfg.tokens_per_batch,
                 "batch_fill": cfg.batch_fill}
    if store_last:  # only then: plans (and resumable shards) without it keep their key
        extra_key["last_hidden"] = True
    plan = make_plan(ctx, extra_key)
    shard_dir = Path(ctx.work_dir) / "shards" / plan.key
    dist = Dist(ctx.rank, ctx.world_size, device, cfg.dist_timeout_min)
    try:
        if cfg.verify_resumed:
            verify_owned(plan, shard_dir, ctx.rank, ctx.world_size, part, parts)
        dist.barrier()
        error = None
        if ctx.is_rank0:
            remaining = [s for s in plan.part(part, parts) if read_done(shard_dir, s, plan.key) is None]
            need = estimate_bytes(remaining, len(taps) * info["hidden_size"], len(taps), cfg.storage_dtype)
            error = check_disk(shard_dir, need, cfg.disk_margin, free_bytes)
            log.info("plan %s: %d shards (%d to do), %d tokens; estimated %.2f GiB to write", plan.key,
                     len(plan.shards), len(remaining), sum(s.n_tokens for s in plan.shards), need / 2**30)  # fmt: skip
        error = dist.broadcast(error)
        if error:
            raise StageError(error)
        model = load_target_model(info, dtype=dtype, device=str(device))
        model.set_attn_implementation(attn)
        target = TargetView(model, taps, int(info["hidden_size"]), int(info["vocab_size"]),
                            int(info.get("pad_token_id") or 0), info["fingerprint"])  # fmt: skip
        stats = run_rank(
            plan, target, shard_dir, rank=ctx.rank, world_size=ctx.world_size, storage_dtype=cfg.storage_dtype,
            tokens_per_batch=cfg.tokens_per_batch, batch_fill=cfg.batch_fill, max_seq_len=cfg.max_seq_len, device=device,
            stop_after_last_tap=cfg.stop_after_last_tap, store_last=store_last, progress=True, stop_after=stop_after,
            writer_threads=cfg.writer_threads, part=part, parts=parts,
        )  # fmt: skip
        write_json(shard_dir / f"stats-rank{global_rank}.json", {**stats.as_dict(), "rank": global_rank, "part": part,
                   "world_size": ctx.world_size, "device": str(device), "pid": os.getpid()})  # fmt: skip
        if stop_after is not None:
            return None
        dist.barrier()
        if not ctx.is_rank0:
            return None
        meta = {"target_name": info["name"], "compute_dtype": str(dtype).removeprefix("torch."),
                "attn_implementation": attn, "device": device.type, "max_seq_len": cfg.max_seq_len,
                "n_truncated": plan.n_truncated, "last_hidden": store_last,
                "taps_key": taps_key(plan, extra_key)}  # fmt: skip
        if parts > 1:  # a part job: its marker; the merge (part -1) writes the index
            write_part_marker(part_marker(ctx.results_root, ctx.experiment, part), plan, shard_dir, part=part,
                              parts=parts, world_size=ctx.world_size, extra_key=extra_key, meta=meta)  # fmt: skip
            return None
        return finalize(ctx, plan, shard_dir, taps=taps, hidden_size=int(info["hidden_size"]),
                        fingerprint=info["fingerprint"], storage_dtype=cfg.storage_dtype, meta=meta,
                        record={RECORD_KEY: data_mode.kwargs})  # fmt: skip
    finally:
        dist.close()


def merge_parts(ctx) -> dict[str, Any]:
    """extract.jobs > 1, after every part: the plan the parts recorded (rebuilt from the curate files and checked
    against their key), then index.json over their shards. Loads no model and needs no device."""
    from draftforge.target.load import read_target_info

    cfg = ctx.cfg.extract
    info = read_target_info(ctx.input_marker("target"))
    data_mode = ChatMode.record_of(check_curate(ctx, info))
    markers = read_part_markers(ctx.results_root, ctx.experiment, cfg.jobs, info["fingerprint"])
    extra_key = markers[0]["extra_key"]
    plan = make_plan(ctx, extra_key)
    if plan.key != markers[0]["plan_key"]:
        raise StageError(f"{part_marker(ctx.results_root, ctx.experiment, 0).parent}: the parts extracted plan "
                         f"{markers[0]['plan_key']}, the curate files now plan {plan.key}; rerun the extract parts")  # fmt: skip
    shard_dir = Path(ctx.work_dir) / "shards" / plan.key
    return finalize(ctx, plan, shard_dir, taps=list(extra_key["taps"]), hidden_size=int(info["hidden_size"]),
                    fingerprint=info["fingerprint"], storage_dtype=cfg.storage_dtype, meta=markers[0]["meta"],
                    record={RECORD_KEY: data_mode.kwargs}, ranks=cfg.jobs * int(markers[0]["world_size"]))  # fmt: skip


def taps_key(plan: ExtractPlan, extra_key: dict[str, Any]) -> str:
    """What decides the tapped features' values: the plan's inputs and settings and the extraction keys,
    without whether the last layer is stored too (the taps are the same either way). A branch that reads
    only the taps keys its training resume on this, so listing a drafter that needs the last layer does not
    restart the other branches' training (train/stage.py)."""
    return sha256_json({"inputs": plan.inputs_key, **{k: v for k, v in extra_key.items() if k != "last_hidden"}})[:16]


def main(ctx) -> None:
    run_extract(ctx)
