"""`train` stage, one branch per listed drafter: the branch's drafter (conf/drafter/<name>.yaml: DFlash, DSpark, or
an MTP head) from extracted features → results/<exp>/train/<name>/{drafter/ | mtp/, metrics.json}.

`train.features=offline` reads the extract stage's feature store; `online` reads the curate shards
and runs the target beside the drafter (train/online.py), in the same sequence order.

Single process or `torchrun` (NCCL on GPU, gloo on CPU). Resumable checkpoints live in
ctx.work_dir/checkpoints (outside the declared outputs); the export is the best checkpoint by val
simulated acceptance length (the last one when there is no val split).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.export import export_drafter
from draftforge.drafter.mtp import wants_trained_head
from draftforge.drafter.settings import effective_loss_weights
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
from draftforge.train.stop import StopRequest

log = logging.getLogger(__name__)


def drafter_config(shape: Any, info: dict[str, Any]) -> DFlashConfig:
    """The branch's drafter (`drafter` section) on this target, with DSpark heads for a dspark drafter."""
    base = DFlashConfig.from_target(info, shape)
    if shape.type != "dspark":
        return base
    from draftforge.drafter.dspark import DSparkConfig

    return DSparkConfig.from_dflash(base, markov_rank=shape.markov_rank, enable_confidence_head=shape.confidence_head,
                                    confidence_head_with_markov=shape.confidence_head_with_markov and shape.markov_rank > 0,
                                    bonus_anchor=shape.bonus_anchor)


def train_config(ctx) -> TrainConfig:
    plain = OmegaConf.to_container(ctx.cfg.train, resolve=True)
    return TrainConfig(**plain)


def disk_needed(n_params: int, cfg: TrainConfig) -> int:
    """Bytes train writes at most for a model of n_params trainable parameters: `keep_checkpoints` + 1 in
    flight (fp32 weights + AdamW moments), best.pt (fp32 weights) and the export (export_dtype)."""
    export_bytes = torch.empty((), dtype=getattr(torch, cfg.export_dtype)).element_size()
    return n_params * (12 * (max(cfg.keep_checkpoints, 1) + 1) + 4 + export_bytes) + (1 << 20)


def drafter_numel(dcfg: DFlashConfig) -> int:
    from draftforge.drafter.export import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(dcfg).values())


def check_disk(ckpt_dir: Path, out_dir: Path, n_params: int, cfg: TrainConfig, free_bytes: FreeBytes) -> None:
    """Refuse to start (one line) when checkpoints and the export cannot fit; nothing is touched."""
    have = sum(p.stat().st_size for p in ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else 0
    need = max(0, disk_needed(n_params, cfg) - have)
    free = min(free_bytes(ckpt_dir), free_bytes(out_dir))
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
    shape = ctx.cfg.drafter
    if shape.type == "mtp":
        return main_mtp(ctx, cfg, info, free_bytes)
    dcfg = drafter_config(shape, info)
    loss_weights = effective_loss_weights(shape)
    if ctx.is_rank0:
        check_disk(ctx.work_dir / "checkpoints", ctx.out_dir, drafter_numel(dcfg), cfg, free_bytes)
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

        obj = make_objective(cfg, dcfg, loss_weights, bool(shape.acceptance_weighting))
        if obj is not None and obj.needs_target and len(train_src[0]) < 4:
            where = "train.features=online" if cfg.features == "online" else str(ctx.input_marker("extract"))
            raise StageError(f"{where}: the {shape.name} drafter's objective {obj.weights} needs the target's last-layer "
                             "states, which these features do not carry; offline: list this drafter in `drafters` and "
                             "rerun extract (draftforge.drafter.settings.needs_last_layer decides what extract stores)")
        if val_src is None:
            log.warning("no val split: the export is the last checkpoint, no simulated acceptance")
        head = FrozenTargetHead.from_target(info["hf_path"], dtype=dtype, device=device)
        resume_key = sha256_json({"train": {k: v for k, v in ctx.params["train"].items() if k not in _NOT_IN_RESUME_KEY},
                                  "drafter": dcfg.to_dict(), "loss_weights": loss_weights,
                                  **({"acceptance_weighting": True} if shape.acceptance_weighting else {}),
                                  "target": info["fingerprint"], **data_key,
                                  "global_batch": global_batch(cfg, ctx.world_size)})
        inputs = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=train_src, val_source=val_src, head=head,
                             ckpt_dir=ctx.work_dir / "checkpoints", resume_key=resume_key, device=device,
                             rank=ctx.rank, world=ctx.world_size, target_hf_path=info["hf_path"],
                             loss_weights=loss_weights, acceptance_weighting=bool(shape.acceptance_weighting))
        run_params = {**ctx.params, "drafter": dcfg.to_dict(), "world_size": ctx.world_size, "device": str(device),
                      "global_batch": global_batch(cfg, ctx.world_size), "compute_dtype_used": str(dtype).removeprefix("torch."),
                      "loss_gamma_used": resolve_gamma(cfg.loss_gamma, dcfg.block_size),
                      "n_train_seqs": len(train_src), "features": cfg.features, "n_val_seqs": len(val_src) if val_src else 0}
        with mlflow_run(**ctx.tracking_kwargs(), run_name=f"train/{info['name']}", params=run_params) as run:
            inputs.logger = run
            with StopRequest().on_signals() as stop:
                inputs.stop = stop
                result = train(inputs)
            if result.interrupted:
                raise StageError(f"train: stopped by {stop.reason or 'request'} after step {result.step}/{result.total_steps}; "
                                 f"checkpoint in {inputs.ckpt_dir}; rerun the same command to resume")
            if ctx.is_rank0:
                _finish(ctx, cfg, dcfg, info, result, run, len(train_src), resume_key)
        if ctx.world_size > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FEATURE_MODES = ("offline", "online")

# Knobs that do not change what is computed (a resumed run may change them freely).
_NOT_IN_RESUME_KEY = ("log_every", "eval_every", "ckpt_every", "keep_checkpoints", "prefetch", "cpu_procs", "gpus",
                      "device", "dist_timeout_min", "export_dtype", "val_max_seqs", "val_num_anchors",
                      "mtp_steps", "mtp_batch_seqs", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "mtp_eval_every")


def main_mtp(ctx, cfg: TrainConfig, info: dict[str, Any], free_bytes: FreeBytes = disk_free) -> None:
    """The mtp branch: train the MiMo-form MTP head (target without MTP layers) into out_dir/mtp, or record that
    the target's native MTP layer serves (nothing to train); metrics.json last."""
    from draftforge.tracking import mlflow_run

    mtp: dict[str, Any] | None = None
    if wants_trained_head(info):
        if cfg.features == "online":
            raise StageError("drafter=mtp with train.features=online: the MTP head trains on the target's final-normed "
                             "last layer, which only the extract stage stores (offline); use train.features=offline "
                             "or drop mtp from `drafters`")
        device = pick_device("train.device", cfg.device, cfg.gpus, ctx.local_rank)
        init_distributed(ctx.world_size, device, cfg.dist_timeout_min)
        try:
            with mlflow_run(**ctx.tracking_kwargs(), run_name=f"train/{info['name']}/mtp", params=ctx.params) as run:
                from draftforge.train.mtp import MTP_CHECKPOINTS, run_mtp_training

                def disk_check(n_params: int) -> None:  # rank 0, once the head's size is known, before any write
                    check_disk(ctx.work_dir / MTP_CHECKPOINTS, ctx.out_dir, n_params, cfg, free_bytes)

                with StopRequest().on_signals() as stop:
                    mtp = run_mtp_training(ctx, cfg, info, device, run, stop, disk_check if ctx.is_rank0 else None)  # every rank trains; rank 0 exports (None elsewhere)
                if mtp and mtp.get("best"):
                    run.log_metrics({"best_val_mtp_sim_tau": mtp["best"]["val_mtp_sim_tau"]})
            if ctx.world_size > 1:
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if ctx.is_rank0:
        write_json(ctx.out_dir / STAGE_MARKERS["train"], {
            "target": info["name"], "target_fingerprint": info["fingerprint"], "drafter_type": "mtp",
            "mtp_source": "trained" if mtp else "native", "mtp": mtp,
        })  # fmt: skip
        log.info("train: mtp head %s", "trained" if mtp else "native (the target's own MTP layer; nothing to train)")


def _finish(ctx, cfg: TrainConfig, dcfg: DFlashConfig, info: dict[str, Any], result, run, n_train: int,
            resume_key: str) -> None:
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
        "drafter_type": ctx.cfg.drafter.type,
    }
    if result.best:
        run.log_metrics({"best_val_sim_tau": result.best["val_sim_tau"], "best_val_acc": result.best["val_acc"]})
    write_json(ctx.out_dir / STAGE_MARKERS["train"], metrics)
    log.info("train: %d steps; exported %s (%s)", result.step, drafter_dir, selected)
