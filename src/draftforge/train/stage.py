"""`train` stage, one branch per listed drafter: the branch's drafter (conf/drafter/<name>.yaml: DFlash, DSpark, or
an MTP head) from extracted features → results/<exp>/train/<name>/{drafter/ | mtp/, metrics.json}.

`task_for(drafter)` is the one place a drafter type picks how its branch trains (a `branch.Branch`: the task
the one loop, `trainer.run`, trains on every rank, and the export rank 0 runs after it). The block drafters'
branch is `block_branch` here; the MTP head's is `train.mtp.mtp_branch`.

`train.features=offline` reads the extract stage's feature store; `online` reads the curate shards
and runs the target beside the drafter (train/online.py), in the same sequence order.

Single process or `torchrun` (NCCL on GPU, gloo on CPU). Resumable checkpoints live in
ctx.work_dir/checkpoints (mtp: mtp_checkpoints; outside the declared outputs); the export is the best
step by val simulated acceptance length (the last one when there is no val split).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from draftforge.chat import RECORD_KEY, ChatMode
from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.export import export_drafter
from draftforge.drafter.registry import build_model_config, resolve, type_of
from draftforge.drafter.settings import effective_loss_weights
from draftforge.errors import StageError
from draftforge.extract.preflight import FreeBytes, disk_free
from draftforge.io import read_json, sha256_file, sha256_json, write_json
from draftforge.stages import STAGE_MARKERS
from draftforge.target.load import read_target_info
from draftforge.train.branch import Branch, BranchBuilder, check_disk, open_device
from draftforge.train.config import TrainConfig
from draftforge.train.features import open_features
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import (
    BlockTask,
    TrainInputs,
    compute_dtype,
    draft_vocab_for,
    global_batch,
    loop_spec,
    make_objective,
    total_steps,
)
from draftforge.train.loss import resolve_gamma
from draftforge.train.stop import StopRequest
from draftforge.train.trainer import LoopResult, run

log = logging.getLogger(__name__)


def drafter_config(shape: Any, info: dict[str, Any]) -> DFlashConfig:
    """The branch's drafter (`drafter` section) on this target: its type's model config (drafter.registry)."""
    return build_model_config(shape, info)


def train_config(ctx) -> TrainConfig:
    plain = OmegaConf.to_container(ctx.cfg.train, resolve=True)
    return TrainConfig(**plain)


def drafter_numel(dcfg: DFlashConfig) -> int:
    from draftforge.drafter.export import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(dcfg).values())


def data_chat_mode(ctx, cfg: TrainConfig) -> ChatMode:
    """The chat mode of the data this branch trains on, as curate recorded it: read from the curate manifest
    (online) or the extract index, which carries it forward (offline). The export and metrics.json record it, and
    evaluate / baselines refuse to serve the drafter in another mode (draftforge.chat.check_served)."""
    marker = ctx.input_marker("curate" if cfg.features == "online" else "extract")
    return ChatMode.record_of(read_json(marker, what="training data record"))


def task_for(drafter: Any) -> BranchBuilder:
    """How the branch of this drafter (`drafter` section: its `type`) trains: the one switch on drafter type."""
    return resolve(type_of(drafter).train_branch)


def main(ctx, free_bytes: FreeBytes = disk_free) -> None:
    from draftforge.tracking import mlflow_run

    cfg = train_config(ctx)
    if cfg.features not in FEATURE_MODES:
        raise StageError(f"train.features={cfg.features!r}: use one of {list(FEATURE_MODES)}")
    info = read_target_info(ctx.input_marker("target"))
    try:
        branch = task_for(ctx.cfg.drafter)(ctx, cfg, info, free_bytes)
        if branch.task is None or branch.spec is None:  # nothing to train
            if ctx.is_rank0:
                write_json(ctx.out_dir / STAGE_MARKERS["train"], branch.finish(None, None))
            return
        with mlflow_run(**ctx.tracking_kwargs(), run_name=branch.run_name, params=branch.run_params) as run_log:
            with StopRequest().on_signals() as stop:
                result = run(branch.task, replace(branch.spec, logger=run_log, stop=stop))
            if result.interrupted:
                raise StageError(f"{branch.label}: stopped by {stop.reason or 'request'} after step {result.step}/"
                                 f"{result.total_steps}; checkpoint in {branch.spec.ckpt_dir}; rerun the same command to resume")
            if ctx.is_rank0:  # the export, then metrics.json (the marker) last
                metrics = branch.finish(result, run_log)
                metrics[RECORD_KEY] = data_chat_mode(ctx, cfg).kwargs  # the mode the drafter was trained in
                write_json(ctx.out_dir / STAGE_MARKERS["train"], metrics)
        if ctx.world_size > 1:
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


FEATURE_MODES = ("offline", "online")

# Knobs that do not change what is computed (a resumed run may change them freely).
_NOT_IN_RESUME_KEY = ("log_every", "eval_every", "ckpt_every", "keep_checkpoints", "prefetch", "cpu_procs", "gpus", "nodes",
                      "device", "dist_timeout_min", "export_dtype", "val_max_seqs", "val_num_anchors",
                      "mtp_steps", "mtp_batch_seqs", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "mtp_eval_every")


def offline_data_key(index_path: Path, reads_last_layer: bool) -> dict[str, Any]:
    """The part of the resume key naming the features a branch trains on: the extract index's taps key
    (the values' identity: inputs, plan and extraction settings, not timings) and whether the branch reads
    the last layer stored beside the taps. A branch reading only the taps keeps its key when another
    branch makes extract store the last layer too. An index without a taps key (older extract output) is
    keyed by its whole content."""
    index = read_json(index_path, what="extract index")
    key = (index.get("meta") or {}).get("taps_key")
    if key is None:
        return {"extract": sha256_file(index_path)}
    return {"extract_taps": key, **({"last_hidden": True} if reads_last_layer else {})}


def block_branch(ctx, cfg: TrainConfig, info: dict[str, Any], free_bytes: FreeBytes) -> Branch:
    """A DFlash / DSpark drafter's branch: features (offline or online), the objective's input check, the resume
    key; rank 0 exports the selected weights to out_dir/drafter."""
    shape = ctx.cfg.drafter
    dcfg = drafter_config(shape, info)
    loss_weights = effective_loss_weights(shape)
    if ctx.is_rank0:
        check_disk(ctx.work_dir / "checkpoints", ctx.out_dir, drafter_numel(dcfg), cfg, free_bytes)
    device = open_device(ctx, cfg)
    dtype = compute_dtype(cfg, device)
    obj = make_objective(cfg, dcfg, loss_weights, bool(shape.acceptance_weighting))
    needs_last = obj is not None and obj.needs_target  # the features carry the target's last layer
    if cfg.features == "online":
        from draftforge.extract.stage import check_curate
        from draftforge.train.online import open_online

        check_curate(ctx, info)
        target_dtype = getattr(torch, info.get("dtype") or "bfloat16") if device.type == "cuda" else torch.float32
        train_src, val_src, plan_key = open_online(ctx.input_dir("curate"), info, ctx.cfg.extract, device, target_dtype,
                                                   last=needs_last)  # fmt: skip
        data_key = {"features": "online", "curate": sha256_file(ctx.input_marker("curate")), "plan": plan_key,
                    **({"last_hidden": True} if needs_last else {})}  # fmt: skip
    else:
        train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        data_key = offline_data_key(ctx.input_marker("extract"), needs_last)
    if obj is not None and obj.needs_target and len(train_src[0]) < 4:
        where = "train.features=online" if cfg.features == "online" else str(ctx.input_marker("extract"))
        raise StageError(f"{where}: the {shape.name} drafter's objective {obj.weights} needs the target's last-layer "
                         "states, which these features do not carry; offline: list this drafter in `drafters` and "
                         "rerun extract (draftforge.drafter.settings.needs_last_layer decides what extract stores)")
    if val_src is None:
        log.warning("no val split: the export is the last checkpoint, no simulated acceptance")
    head = FrozenTargetHead.from_target(info["hf_path"], dtype=dtype, device=device)
    draft_ids, vocab_coverage = draft_vocab_for(train_src, dcfg)
    if draft_ids is not None:
        log.info("draft vocabulary: the %d most frequent answer tokens of the train split cover %.2f%% of them",
                 dcfg.draft_vocab_size, 100 * vocab_coverage)
    resume_key = sha256_json({"train": {k: v for k, v in ctx.params["train"].items() if k not in _NOT_IN_RESUME_KEY},
                              "drafter": dcfg.to_dict(), "loss_weights": loss_weights,
                              **({"acceptance_weighting": True} if shape.acceptance_weighting else {}),
                              "target": info["fingerprint"], **data_key,
                              "global_batch": global_batch(cfg, ctx.world_size)})
    inputs = TrainInputs(cfg=cfg, dcfg=dcfg, train_source=train_src, val_source=val_src, head=head,
                         ckpt_dir=ctx.work_dir / "checkpoints", resume_key=resume_key, device=device,
                         rank=ctx.rank, world=ctx.world_size, target_hf_path=info["hf_path"],
                         loss_weights=loss_weights, acceptance_weighting=bool(shape.acceptance_weighting),
                         draft_ids=draft_ids)
    run_params = {**ctx.params, "drafter": dcfg.to_dict(), "world_size": ctx.world_size, "device": str(device),
                  "global_batch": global_batch(cfg, ctx.world_size), "compute_dtype_used": str(dtype).removeprefix("torch."),
                  "loss_gamma_used": resolve_gamma(cfg.loss_gamma, dcfg.block_size),
                  "n_train_seqs": len(train_src), "features": cfg.features, "n_val_seqs": len(val_src) if val_src else 0,
                  **({"draft_vocab_coverage": vocab_coverage} if draft_ids is not None else {})}
    _, total = total_steps(cfg, len(train_src), ctx.world_size)

    def finish(result: LoopResult | None, run_log: Any) -> dict[str, Any]:
        assert result is not None
        return _finish(ctx, cfg, dcfg, info, result, run_log, len(train_src))

    return Branch(BlockTask(inputs), loop_spec(inputs, total), finish, run_name=f"train/{info['name']}", run_params=run_params)


def _finish(ctx, cfg: TrainConfig, dcfg: DFlashConfig, info: dict[str, Any], result: LoopResult, run_log: Any,
            n_train: int) -> dict[str, Any]:
    """Export the selected weights (the best val step's, from the run's checkpoints; else the last); metrics.json."""
    model = result.model
    selected = "last"
    if result.best_state is not None and result.best is not None:
        model.load_state_dict(result.best_state)
        selected = f"best val_sim_tau at step {result.best['step']}"
    drafter_dir = ctx.out_dir / "drafter"
    export_drafter(model, dcfg, drafter_dir, dtype=getattr(torch, cfg.export_dtype),
                   extra_config={"draftforge": {"target": info["name"], "target_fingerprint": info["fingerprint"],
                                                "selected": selected, "steps": result.step,
                                                RECORD_KEY: data_chat_mode(ctx, cfg).kwargs}})
    run_log.log_artifact(drafter_dir / "config.json", artifact_path="drafter")
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
        **({"replay": result.phases} if result.phases else {}),  # on-policy replay: the walk's record (its seconds)
    }
    if result.best:
        run_log.log_metrics({"best_val_sim_tau": result.best["val_sim_tau"], "best_val_acc": result.best["val_acc"]})
    log.info("train: %d steps; exported %s (%s)", result.step, drafter_dir, selected)
    return metrics
