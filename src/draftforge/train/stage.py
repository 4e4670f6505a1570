"""`train` stage: a DFlash (or DSpark: train.drafter_type) drafter from extracted features → results/<exp>/train/{drafter/, metrics.json}.

`train.features=offline` reads the extract stage's feature store; `online` reads the curate shards
and runs the target beside the drafter (train/online.py), in the same sequence order.

Single process or `torchrun` (NCCL on GPU, gloo on CPU). Resumable checkpoints live in
ctx.work_dir/checkpoints (outside the declared outputs); the export is the best checkpoint by val
simulated acceptance length (the last one when there is no val split).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.export import export_drafter
from draftforge.drafter.mtp import wants_trained_head
from draftforge.errors import StageError
from draftforge.extract.preflight import FreeBytes, disk_free, fmt_bytes
from draftforge.io import sha256_file, sha256_json, write_json
from draftforge.runtime import init_distributed, pick_device
from draftforge.stages import STAGE_MARKERS
from draftforge.target.load import read_target_info
from draftforge.train.checkpoint import load_best
from draftforge.train.config import TrainConfig
from draftforge.train.features import open_features
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs, compute_dtype, global_batch, train
from draftforge.train.loss import resolve_gamma

log = logging.getLogger(__name__)


def drafter_config(cfg: TrainConfig, info: dict[str, Any]) -> DFlashConfig:
    """The drafter's shape from target.json, with DSpark heads when train.drafter_type is dspark."""
    base = DFlashConfig.from_target(info)
    if cfg.drafter_type == "dflash":
        return base
    if cfg.drafter_type != "dspark":
        raise StageError(f"train.drafter_type={cfg.drafter_type!r}: use dflash or dspark")
    from draftforge.drafter.dspark import DSparkConfig

    return DSparkConfig.from_dflash(base, markov_rank=cfg.markov_rank, enable_confidence_head=cfg.confidence_head,
                                    confidence_head_with_markov=cfg.confidence_head_with_markov and cfg.markov_rank > 0,
                                    bonus_anchor=cfg.bonus_anchor)


def train_config(ctx) -> TrainConfig:
    plain = OmegaConf.to_container(ctx.cfg.train, resolve=True)
    return TrainConfig(**plain)


def disk_needed(dcfg: DFlashConfig, cfg: TrainConfig) -> int:
    """Bytes train writes at most: `keep_checkpoints` + 1 in flight (fp32 weights + AdamW moments),
    best.pt (fp32 weights) and the export (export_dtype)."""
    from draftforge.drafter.export import expected_shapes

    n_params = sum(math.prod(shape) for shape in expected_shapes(dcfg).values())
    export_bytes = torch.empty((), dtype=getattr(torch, cfg.export_dtype)).element_size()
    return n_params * (12 * (max(cfg.keep_checkpoints, 1) + 1) + 4 + export_bytes) + (1 << 20)


def check_disk(ctx, dcfg: DFlashConfig, cfg: TrainConfig, free_bytes: FreeBytes) -> None:
    """Refuse to start (one line) when checkpoints and the export cannot fit; nothing is touched."""
    ckpt_dir = ctx.work_dir / "checkpoints"
    have = sum(p.stat().st_size for p in ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else 0
    need = max(0, disk_needed(dcfg, cfg) - have)
    free = min(free_bytes(ckpt_dir), free_bytes(ctx.out_dir))
    if need * DISK_MARGIN > free:
        raise StageError(f"{ckpt_dir}: not enough disk for training checkpoints and the export: need ~{fmt_bytes(need)} "
                         f"(x {DISK_MARGIN} margin) but {fmt_bytes(free)} is free; free space, point results_root "
                         f"elsewhere, or lower train.keep_checkpoints (now {cfg.keep_checkpoints})")  # fmt: skip


DISK_MARGIN = 1.2


def main(ctx, free_bytes: FreeBytes = disk_free) -> None:
    from draftforge.tracking import mlflow_run

    cfg = train_config(ctx)
    if cfg.features not in FEATURE_MODES:
        raise StageError(f"train.features={cfg.features!r}: use one of {list(FEATURE_MODES)}")
    info = read_target_info(ctx.input_marker("target"))
    if cfg.features == "online" and wants_trained_head(info, cfg.mtp):
        raise StageError("train.mtp with train.features=online: the MTP head trains on the target's final-normed "
                         "last layer, which only the extract stage stores (offline); use train.features=offline "
                         "or train.mtp=false")
    dcfg = drafter_config(cfg, info)
    if ctx.is_rank0:
        check_disk(ctx, dcfg, cfg, free_bytes)
    device = pick_device("train.device", cfg.device, cfg.gpus, ctx.local_rank)
    init_distributed(ctx.world_size, device, cfg.dist_timeout_min)
    try:
        dtype = compute_dtype(cfg, device)
        if cfg.features == "online":
            from draftforge.extract.stage import check_curate
            from draftforge.train.online import open_online

            check_curate(ctx, info)
            target_dtype = getattr(torch, info.get("dtype") or "bfloat16") if device.type == "cuda" else torch.float32
            train_src, val_src, plan_key = open_online(ctx.input_dir("curate"), info, ctx.cfg.extract, device, target_dtype)
            data_key = {"features": "online", "curate": sha256_file(ctx.input_marker("curate")), "plan": plan_key}
        else:
            index_path = ctx.input_marker("extract")
            train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            data_key = {"extract": sha256_file(index_path)}
        from draftforge.train.loop import make_objective

        obj = make_objective(cfg, dcfg)
        if obj is not None and obj.needs_target and len(train_src[0]) < 4:
            where = "train.features=online" if cfg.features == "online" else str(ctx.input_marker("extract"))
            raise StageError(f"{where}: the {cfg.drafter_type} objective {obj.weights} needs the target's last-layer "
                             "states, which these features do not carry; offline: rerun extract with this train "
                             "config (draftforge.train.config.needs_last_layer decides what extract stores)")
        if val_src is None:
            log.warning("no val split: the export is the last checkpoint, no simulated acceptance")
        head = FrozenTargetHead.from_target(info["hf_path"], dtype=dtype, device=device)
        resume_key = sha256_json({"train": {k: v for k, v in ctx.params["train"].items() if k not in _NOT_IN_RESUME_KEY},
                                  "drafter": dcfg.to_dict(), "target": info["fingerprint"], **data_key,
                                  "global_batch": global_batch(cfg, ctx.world_size)})
        inputs = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=train_src, val_source=val_src, head=head,
                             ckpt_dir=ctx.work_dir / "checkpoints", resume_key=resume_key, device=device,
                             rank=ctx.rank, world=ctx.world_size, target_hf_path=info["hf_path"])
        run_params = {**ctx.params, "drafter": dcfg.to_dict(), "world_size": ctx.world_size, "device": str(device),
                      "global_batch": global_batch(cfg, ctx.world_size), "loss_gamma_used": resolve_gamma(cfg.loss_gamma, dcfg.block_size),
                      "n_train_seqs": len(train_src), "features": cfg.features, "n_val_seqs": len(val_src) if val_src else 0}
        with mlflow_run(**ctx.tracking_kwargs(), run_name=f"train/{info['name']}", params=run_params) as run:
            inputs.logger = run
            result = train(inputs)
            if ctx.is_rank0:
                mtp = None
                if wants_trained_head(info, cfg.mtp):
                    from draftforge.train.mtp import run_mtp_training

                    mtp = run_mtp_training(ctx, cfg, info, device, run)
                _finish(ctx, cfg, dcfg, info, result, run, len(train_src), resume_key, mtp)
        if ctx.world_size > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FEATURE_MODES = ("offline", "online")

# Knobs that do not change what is computed (a resumed run may change them freely).
_NOT_IN_RESUME_KEY = ("log_every", "eval_every", "ckpt_every", "keep_checkpoints", "prefetch", "cpu_procs", "gpus",
                      "device", "dist_timeout_min", "export_dtype", "val_max_seqs", "val_num_anchors",
                      "mtp", "mtp_steps", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "mtp_eval_every")


def _finish(ctx, cfg: TrainConfig, dcfg: DFlashConfig, info: dict[str, Any], result, run, n_train: int, resume_key: str,
            mtp: dict[str, Any] | None = None) -> None:
    """Export the selected weights, then write metrics.json (the marker) last."""
    best = load_best(ctx.work_dir / "checkpoints")
    model = result.model
    selected = "last"
    if best is not None and result.best is not None:
        if best.get("resume_key", resume_key) != resume_key:  # best.pt of another target/config: never export it
            raise StageError(f"{ctx.work_dir / 'checkpoints' / 'best.pt'}: written by a run for another target or config; "
                             "delete it and rerun train")  # fmt: skip
        model.load_state_dict(best["model"])
        selected = f"best val_sim_tau at step {result.best['step']}"
    drafter_dir = ctx.out_dir / "drafter"
    export_drafter(model, dcfg, drafter_dir, dtype=getattr(torch, cfg.export_dtype),
                   extra_config={"draftforge": {"target": info["name"], "target_fingerprint": info["fingerprint"],
                                                "selected": selected, "steps": result.step}})
    run.log_artifact(drafter_dir / "config.json", artifact_path="drafter")
    last = result.history[-1] if result.history else {}
    metrics = {
        "target": info["name"],
        "target_fingerprint": info["fingerprint"],
        "drafter_dir": str(drafter_dir),
        "selected": selected,
        "steps": result.step,
        "total_steps": result.total_steps,
        "n_train_seqs": n_train,
        "world_size": ctx.world_size,
        "features": cfg.features,
        "global_batch": global_batch(cfg, ctx.world_size),
        "loss_gamma": resolve_gamma(cfg.loss_gamma, dcfg.block_size),
        "throughput": result.throughput,
        "final_train_loss": last.get("loss"),
        "best": result.best,
        "last_eval": result.evals[-1] if result.evals else None,
        "val_curve": [{k: e[k] for k in ("step", "val_loss", "val_acc", "val_sim_tau")} for e in result.evals],
        "train_curve": result.history[:: max(1, len(result.history) // 200)],
        "drafter": dcfg.to_dict(),
        "mtp": mtp,  # the trained MTP head (train.mtp on, target without MTP layers) or None
    }
    if mtp and mtp.get("best"):
        run.log_metrics({"best_val_mtp_sim_tau": mtp["best"]["val_mtp_sim_tau"]})
    if result.best:
        run.log_metrics({"best_val_sim_tau": result.best["val_sim_tau"], "best_val_acc": result.best["val_acc"]})
    write_json(ctx.out_dir / STAGE_MARKERS["train"], metrics)
    log.info("train: %d steps; exported %s (%s)", result.step, drafter_dir, selected)
