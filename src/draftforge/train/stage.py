"""`train` stage: DFlash drafter from extracted features → results/<exp>/train/{drafter/, metrics.json}.

Single process or `torchrun` (NCCL on GPU, gloo on CPU). Resumable checkpoints live in
ctx.work_dir/checkpoints (outside the declared outputs); the export is the best checkpoint by val
simulated acceptance length (the last one when there is no val split).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.mtp import wants_trained_head
from draftforge.drafter.export import export_drafter
from draftforge.errors import StageError
from draftforge.io import sha256_file, sha256_json, write_json
from draftforge.paths import STAGE_MARKERS
from draftforge.target.load import read_target_info
from draftforge.train.checkpoint import load_best
from draftforge.train.config import TrainConfig
from draftforge.train.features import open_features
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs, compute_dtype, train

log = logging.getLogger(__name__)


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if (cfg.gpus > 0 and torch.cuda.is_available()) else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise StageError("train.device=cuda: no CUDA device visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(ctx, device: torch.device, timeout_min: int) -> None:
    if ctx.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_min))


def train_config(ctx) -> TrainConfig:
    plain = OmegaConf.to_container(ctx.cfg.train, resolve=True)
    return TrainConfig(**plain)


def main(ctx) -> None:
    from draftforge.tracking import mlflow_run

    cfg = train_config(ctx)
    info = read_target_info(ctx.input_marker("target"))
    index_path = ctx.input_marker("extract")
    dcfg = DFlashConfig.from_target(info)
    device = pick_device(cfg, ctx.local_rank)
    init_distributed(ctx, device, cfg.dist_timeout_min)
    try:
        dtype = compute_dtype(cfg, device)
        feat_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=feat_dtype, mtp=cfg.mtp)
        if val_src is None:
            log.warning("extract index has no val split: the export is the last checkpoint, no simulated acceptance")
        head = FrozenTargetHead.from_target(info["hf_path"], dtype=dtype, device=device)
        resume_key = sha256_json({"train": {k: v for k, v in ctx.params["train"].items() if k not in _NOT_IN_RESUME_KEY},
                                  "drafter": dcfg.to_dict(), "target": info["fingerprint"], "extract": sha256_file(index_path)})
        inputs = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=train_src, val_source=val_src, head=head,
                             ckpt_dir=ctx.work_dir / "checkpoints", resume_key=resume_key, device=device,
                             rank=ctx.rank, world=ctx.world_size, target_hf_path=info["hf_path"])
        run_params = {**ctx.params, "drafter": dcfg.to_dict(), "world_size": ctx.world_size, "device": str(device),
                      "n_train_seqs": len(train_src), "n_val_seqs": len(val_src) if val_src else 0}
        with mlflow_run(**ctx.tracking_kwargs(), run_name=f"train/{info['name']}", params=run_params) as run:
            inputs.logger = run
            result = train(inputs)
            if ctx.is_rank0:
                mtp = None
                if wants_trained_head(info, cfg.mtp):
                    from draftforge.train.mtp import run_mtp_training

                    mtp = run_mtp_training(ctx, cfg, info, device, run)
                _finish(ctx, cfg, dcfg, info, result, run, len(train_src), mtp)
        if ctx.world_size > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Knobs that do not change what is computed (a resumed run may change them freely).
_NOT_IN_RESUME_KEY = ("log_every", "eval_every", "ckpt_every", "keep_checkpoints", "prefetch", "cpu_procs", "gpus",
                      "device", "dist_timeout_min", "export_dtype", "val_max_seqs", "val_num_anchors",
                      "mtp", "mtp_steps", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "mtp_eval_every")


def _finish(ctx, cfg: TrainConfig, dcfg: DFlashConfig, info: dict[str, Any], result, run, n_train: int,
            mtp: dict[str, Any] | None = None) -> None:
    """Export the selected weights, then write metrics.json (the marker) last."""
    best = load_best(ctx.work_dir / "checkpoints")
    model = result.model
    selected = "last"
    if best is not None and result.best is not None:
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
