"""The training loop: DFlash blocks, decayed CE, AdamW + cosine/warmup, clip, DDP, eval, resume.

Distributed invariant: each rank takes `batch_seqs` sequences per step (global batch = batch_seqs x
world); the loss is normalized by the *global* sum of valid-slot weights and scaled by the world size
(DDP averages gradients), so W ranks of b sequences compute exactly the gradient one process computes
on the same W*b sequences.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.dspark import DSparkDrafter, is_dspark
from draftforge.drafter.model import DFlashDrafter
from draftforge.drafter.settings import default_loss_weights
from draftforge.train.checkpoint import load_latest, rng_state, save_best, save_checkpoint, set_rng_state
from draftforge.train.config import TrainConfig
from draftforge.train.data import (
    Batch,
    FeatureSource,
    Prefetcher,
    collate,
    draw_anchors,
    epoch_order,
    rank_share,
    truncate,
)
from draftforge.train.dspark_loss import analytic_stats, check_weights, objective, summarize_analytic
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loss import BlockOutputs, block_losses, compile_loss, slot_stats, slot_weights, summarize

log = logging.getLogger(__name__)
VAL_SEED_OFFSET = 1_000_003


@dataclass
class TrainInputs:
    cfg: TrainConfig
    dcfg: DFlashConfig
    train_source: FeatureSource
    val_source: FeatureSource | None
    head: FrozenTargetHead  # on `device`, in the compute dtype
    ckpt_dir: Path
    resume_key: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world: int = 1
    target_hf_path: str | None = None  # warm start source (cfg.init_from_target)
    logger: Any = None  # draftforge.tracking.RunLogger (rank 0) or None
    # Objective term weights (drafter.settings.effective_loss_weights); None → the drafter type's default.
    loss_weights: dict[str, float] | None = None


@dataclass
class TrainResult:
    model: DFlashDrafter
    history: list[dict[str, float]]
    evals: list[dict[str, float]]
    best: dict[str, Any] | None
    step: int
    total_steps: int
    interrupted: bool = False
    # Steady-state speed of this process's steps (first 2 excluded: compile/warm-up), evals and
    # checkpoints excluded: {"steps", "seconds", "ctx_tokens_per_s", "block_tokens_per_s"} (global).
    throughput: dict[str, float] | None = None


def global_batch(cfg: TrainConfig, world: int) -> int:
    """Sequences per optimizer step over all ranks."""
    return cfg.batch_seqs * max(1, world)


def total_steps(cfg: TrainConfig, n_seq: int, world: int = 1) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps)."""
    per_epoch = -(-n_seq // global_batch(cfg, world))
    total = cfg.max_steps if cfg.max_steps > 0 else per_epoch * cfg.epochs
    return per_epoch, total


def lr_lambda(total: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, round(total * warmup_ratio)) if warmup_ratio > 0 else 0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.compute_dtype:
        return getattr(torch, cfg.compute_dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def save_checkpoint_rank0(ckpt_dir: Path, step: int, payload: Callable[[], dict[str, Any]], *, keep: int, rank: int,
                          world: int) -> None:
    """Rank 0 writes `payload()` as the step's checkpoint (atomically, `latest` names it, `keep` newest kept);
    every rank waits for it, so no rank runs ahead of the newest checkpoint."""
    if rank == 0:
        save_checkpoint(ckpt_dir, step, payload(), keep=keep)
    if world > 1:
        dist.barrier()


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


def batches(inp: TrainInputs, start_step: int, per_epoch: int, total: int) -> Iterator[tuple[int, int, Batch]]:
    """(global step, epoch, batch) from start_step on; this rank's share of each global batch."""
    cfg, dcfg = inp.cfg, inp.dcfg
    feat_dtype = compute_dtype(cfg, inp.device)
    step = start_step
    while step < total:
        epoch, in_epoch = divmod(step, per_epoch)
        order = epoch_order(len(inp.train_source), global_batch(cfg, inp.world), cfg.seed, epoch)
        for seqs_of_step in order[in_epoch:]:
            if step >= total:
                return
            mine = rank_share(seqs_of_step, inp.rank, inp.world)
            items = [truncate(inp.train_source[i], cfg.max_seq_len) for i in mine]
            anchors = [draw_anchors(it[1], cfg.num_anchors, cfg.seed, epoch, i) for it, i in zip(items, mine)]
            batch = collate(items, anchors, dcfg.block_size, dcfg.mask_token_id, feat_dtype, *convention(dcfg))
            yield step, epoch, (batch.pin_memory() if inp.device.type == "cuda" else batch)
            step += 1


def convention(dcfg: DFlashConfig) -> tuple[int, int]:
    """(first predicting slot, prediction offset): DFlash (1, 0); DSpark per its bonus_anchor."""
    return (dcfg.first_slot, dcfg.pred_offset) if is_dspark(dcfg) else (1, 0)


@dataclass
class Objective:
    """The distribution objective (train/dspark_loss.py); None in forward_batch = the CE-only DFlash path."""

    weights: dict[str, float]
    conf_weight: float = 0.0
    chunk: int = 8192

    @property
    def needs_target(self) -> bool:
        """Whether the target's next-token distribution (its last-layer states) is required."""
        return self.weights.get("kl", 0) > 0 or self.weights.get("tv", 0) > 0 or self.conf_weight > 0


def make_objective(cfg: TrainConfig, dcfg: DFlashConfig, loss_weights: dict[str, float] | None = None) -> Objective | None:
    """None for plain CE (the DFlash path); else the distribution objective with these term weights."""
    weights = check_weights(dict(loss_weights) if loss_weights else default_loss_weights("dspark" if is_dspark(dcfg) else "dflash"))
    if not is_dspark(dcfg) and weights == {"ce": 1.0}:
        return None
    conf = cfg.confidence_loss_weight if (is_dspark(dcfg) and dcfg.enable_confidence_head) else 0.0
    return Objective(weights, conf, cfg.loss_vocab_chunk)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def dist_block_losses(model, h: torch.Tensor, head: FrozenTargetHead, batch: Batch, weights: torch.Tensor,
                      obj: Objective) -> BlockOutputs:
    """Valid slots through the distribution objective (+ Markov bias and confidence for DSpark)."""
    S, N, B = batch.valid.shape
    flat = batch.valid.reshape(-1)
    hv = h.reshape(S * N * B, -1)[flat]
    y = batch.targets.reshape(-1)[flat]
    prev = batch.prev_ids.reshape(-1)[flat]
    w_row = weights.to(h.device)[None, None, :].expand(S, N, B).reshape(-1)[flat]
    ht = None
    if batch.last is not None:
        k = torch.arange(B, device=h.device)
        pos = (batch.anchors[:, :, None] + k + batch.pred_offset - 1).clamp(0, batch.last.shape[1] - 1)  # (S, N, B)
        seq = torch.arange(S, device=h.device)[:, None, None].expand(S, N, B)
        ht = batch.last[seq.reshape(-1)[flat], pos.reshape(-1)[flat]].to(hv.dtype)
    raw = _unwrap(model)
    e = w2 = conf_logit = None
    if isinstance(raw, DSparkDrafter) and raw.markov_head is not None:
        e = raw.markov_embed(prev).to(hv.dtype)
        w2 = raw.markov_head.markov_w2.weight
    if isinstance(raw, DSparkDrafter) and raw.confidence_head is not None:
        conf_logit = raw.confidence_logit(hv, prev)
    out = objective(hv, head.lm_head, y, w_row, obj.weights, ht=ht, e=e, w2=w2, conf_logit=conf_logit,
                    conf_weight=obj.conf_weight, chunk=obj.chunk)
    correct = torch.zeros(S * N * B, dtype=torch.bool, device=h.device)
    correct[flat] = out.hits
    res = BlockOutputs(out.weighted_sum, out.weight_sum, correct.view(S, N, B), batch.valid)
    res.extra = out  # type: ignore[attr-defined]  (analytic val metrics)
    return res


def forward_batch(model: torch.nn.Module, head: FrozenTargetHead, batch: Batch, weights: torch.Tensor, attn_impl: str | None,
                  obj: Objective | None = None):
    block_embeds = head.embed_ids(batch.block_ids).float()  # (S, N*B, H)
    h = model(batch.tapped, block_embeds, batch.anchors, attn_impl)
    if obj is not None:
        return dist_block_losses(model, h, head, batch, weights, obj)
    return block_losses(h, head.lm_head, batch.targets, batch.valid, weights)


def val_indices(n_total: int, n_max: int) -> list[int]:
    """Up to n_max val sequences spread evenly over the split (extract shards are length-sorted, so a
    prefix would score only the longest sequences)."""
    n = min(n_total, max(0, n_max))
    return [i * n_total // n for i in range(n)] if n else []


@torch.no_grad()
def evaluate(model: DFlashDrafter, inp: TrainInputs, dtype: torch.dtype) -> dict[str, float]:
    """Val loss, per-slot top-1 accuracy, simulated acceptance length; sharded over ranks, all-reduced."""
    cfg, dcfg = inp.cfg, inp.dcfg
    src = inp.val_source
    first, _ = convention(dcfg)
    weights = slot_weights(dcfg.block_size, cfg.loss_gamma, first).to(inp.device)
    obj = make_objective(cfg, dcfg, inp.loss_weights)
    picked = val_indices(len(src), cfg.val_max_seqs) if src is not None else []
    B = dcfg.block_size
    n_draft = B - first
    sums = torch.zeros(2 * B + 2, device=inp.device, dtype=torch.float64)
    ana: torch.Tensor | None = None
    loss_sums = torch.zeros(2, device=inp.device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for i in picked[inp.rank :: inp.world]:
        item = truncate(src[i], cfg.max_seq_len)
        anchors = draw_anchors(item[1], cfg.val_num_anchors, cfg.seed + VAL_SEED_OFFSET, 0, i)
        if anchors.numel() == 0:
            continue
        batch = collate([item], [anchors], B, dcfg.mask_token_id, dtype, *convention(dcfg)).to(inp.device)
        with _autocast(inp.device, dtype):
            out = forward_batch(model, inp.head, batch, weights, cfg.attn_impl, obj)
        sums += slot_stats(out, batch.valid[..., first], first).double()
        extra = getattr(out, "extra", None)
        if extra is not None and extra.accept is not None:
            idx = batch.valid.reshape(-1).nonzero().squeeze(-1)
            part = analytic_stats(extra.accept, extra.conf, idx % B - first, idx // B, batch.valid.shape[0] * batch.valid.shape[1], n_draft)
            ana = part if ana is None else ana + part
        loss_sums += torch.stack([out.weighted_ce_sum.detach().double(), out.weight_sum.double()])
    model.train(was_training)
    _all_reduce(sums, inp.world)
    _all_reduce(loss_sums, inp.world)
    metrics = {f"val_{k}": v for k, v in summarize(sums.cpu(), B, first).items()}
    if obj is not None and obj.needs_target:
        if ana is None:  # this rank had no rows: zeros keep the all-reduce in step
            ana = analytic_stats(torch.zeros(0, device=inp.device), None, torch.zeros(0, dtype=torch.long, device=inp.device),
                                 torch.zeros(0, dtype=torch.long, device=inp.device), 0, n_draft)
        _all_reduce(ana, inp.world)
        with_conf = is_dspark(dcfg) and dcfg.enable_confidence_head
        metrics.update({f"val_{k}": v for k, v in summarize_analytic(ana.cpu(), n_draft, with_conf).items()})
    metrics["val_loss"] = float(loss_sums[0] / loss_sums[1]) if loss_sums[1] > 0 else float("nan")
    metrics["val_blocks"] = float(sums[-1])
    return metrics


def build_model(inp: TrainInputs) -> DFlashDrafter:
    torch.manual_seed(inp.cfg.seed)
    cls = DSparkDrafter if is_dspark(inp.dcfg) else DFlashDrafter
    model = cls(inp.dcfg, attn_impl=inp.cfg.attn_impl)
    if inp.cfg.init_from:
        init_from_drafter(model, inp.cfg.init_from)
        log.info("warm start: backbone from the drafter in %s", inp.cfg.init_from)
    elif inp.cfg.init_from_target and inp.target_hf_path:
        from draftforge.drafter.warm_start import init_from_target

        used = init_from_target(model, inp.target_hf_path, list(inp.cfg.init_layers) if inp.cfg.init_layers else None)
        log.info("warm start: draft layers from target layers %s", used)
    return model.to(inp.device)


def init_from_drafter(model: DFlashDrafter, directory: str) -> None:
    """Copy a trained drafter's backbone (fc, norms, layers) into `model`; DSpark heads stay fresh.

    The source's shape (layers, width, taps, block size) must match; its block convention may differ
    (a DFlash drafter warm-starts a DSpark one)."""
    from safetensors.torch import load_file

    from draftforge.drafter.config import read_exported_config
    from draftforge.errors import StageError

    src_cfg = read_exported_config(directory)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "target_layer_ids", "layer_types", "vocab_size")
    diff = [k for k in keys if getattr(src_cfg, k) != getattr(model.cfg, k)]
    if diff:
        raise StageError(f"train.init_from={directory}: drafter shape differs in {diff}")
    tensors = load_file(str(Path(directory) / "model.safetensors"))
    own = model.state_dict()
    backbone = {k: v.to(own[k].dtype) for k, v in tensors.items() if k in own and not k.startswith(("markov_head.", "confidence_head."))}
    missing = [k for k in own if not k.startswith(("markov_head.", "confidence_head.")) and k not in backbone]
    if missing:
        raise StageError(f"train.init_from={directory}: missing {missing[:4]}")
    model.load_state_dict(backbone, strict=False)


def train(inp: TrainInputs, stop_at_step: int | None = None) -> TrainResult:
    """Train (or resume) to cfg's total steps; `stop_at_step` simulates an interruption (tests)."""
    cfg, dcfg, rank0 = inp.cfg, inp.dcfg, inp.rank == 0
    if cfg.batch_seqs < 1:
        raise ValueError(f"train.batch_seqs={cfg.batch_seqs}: need >= 1 sequence per rank")
    per_epoch, total = total_steps(cfg, len(inp.train_source), inp.world)
    dtype = compute_dtype(cfg, inp.device)
    model = build_model(inp)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                            fused=inp.device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio))
    step, history, evals, best = 0, [], [], None
    payload = load_latest(inp.ckpt_dir, inp.resume_key)
    if payload is not None:
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        sched.load_state_dict(payload["scheduler"])
        step, history, evals, best = payload["step"], payload["history"], payload["evals"], payload["best"]
        set_rng_state(payload["rng"])
    ddp = model
    if inp.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[inp.device.index] if inp.device.type == "cuda" else None)
    if cfg.compile:  # per layer: the mask is built outside the compiled regions
        for layer in model.layers:
            layer.compile()
        compile_loss()
    fwd_model = ddp
    weights = slot_weights(dcfg.block_size, cfg.loss_gamma, convention(dcfg)[0]).to(inp.device)
    obj = make_objective(cfg, dcfg, inp.loss_weights)

    def checkpoint(at: int) -> None:
        save_checkpoint_rank0(inp.ckpt_dir, at, lambda: {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": at, "history": history, "evals": evals, "best": best, "rng": rng_state(),
            "resume_key": inp.resume_key, "dcfg": dcfg.to_dict(),
        }, keep=cfg.keep_checkpoints, rank=inp.rank, world=inp.world)

    def run_eval(at: int) -> None:
        nonlocal best
        if inp.val_source is None:
            return
        metrics = evaluate(model, inp, dtype)
        metrics["step"] = at
        evals.append(metrics)
        if best is None or metrics["val_sim_tau"] > best["val_sim_tau"]:
            best = dict(metrics)
            if rank0:
                save_best(inp.ckpt_dir, model.state_dict(), {"metrics": best, "resume_key": inp.resume_key})
        if rank0 and inp.logger is not None:
            inp.logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=at)
        if rank0:
            log.info("step %d: val loss %.4f acc %.3f sim_tau %.3f", at, metrics["val_loss"], metrics["val_acc"], metrics["val_sim_tau"])

    interrupted = False
    model.train()
    it = Prefetcher(batches(inp, step, per_epoch, total), depth=cfg.prefetch)
    bar = tqdm(total=total, initial=step, disable=not rank0, desc="train", unit="step")
    t_last, tok_acc, blk_acc = time.perf_counter(), 0.0, 0.0
    first_step, speed = step, {"steps": 0.0, "seconds": 0.0, "ctx_tokens": 0.0, "block_tokens": 0.0}
    t_step = time.perf_counter()
    try:
        for step_now, epoch, batch in it:
            batch = batch.to(inp.device)
            with _autocast(inp.device, dtype):
                out = forward_batch(fwd_model, inp.head, batch, weights, cfg.attn_impl, obj)
            sums = torch.stack([out.weight_sum.float(), out.weighted_ce_sum.detach().float(),
                                torch.tensor(float(batch.n_tokens), device=inp.device),
                                batch.valid[..., convention(dcfg)[0]].sum().float() * dcfg.block_size])
            _all_reduce(sums, inp.world)
            w_global = sums[0].clamp_min(1e-6)
            loss = out.weighted_ce_sum / w_global * inp.world
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step = step_now + 1
            tok_acc += float(sums[2])  # float(): syncs the device, so step times are real
            blk_acc += float(sums[3])
            if step_now >= first_step + 2:
                speed["steps"] += 1
                speed["seconds"] += time.perf_counter() - t_step
                speed["ctx_tokens"] += float(sums[2])
                speed["block_tokens"] += float(sums[3])
            rec = {"step": step, "epoch": epoch, "loss": float(sums[1] / w_global), "lr": sched.get_last_lr()[0],
                   "grad_norm": float(grad_norm)}
            history.append(rec)
            bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                dt = max(time.perf_counter() - t_last, 1e-9)
                rec_log = {**rec, "ctx_tokens_per_s": tok_acc / dt, "block_tokens_per_s": blk_acc / dt}
                t_last, tok_acc, blk_acc = time.perf_counter(), 0.0, 0.0
                if rank0 and inp.logger is not None:
                    inp.logger.log_metrics({k: v for k, v in rec_log.items() if k != "step"}, step=step)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}")
            if step % cfg.eval_every == 0 or step == total:
                run_eval(step)
            if step % cfg.ckpt_every == 0 or step == total:
                checkpoint(step)
            if stop_at_step is not None and step >= stop_at_step and step < total:
                if step % cfg.ckpt_every:
                    checkpoint(step)
                interrupted = True
                break
            t_step = time.perf_counter()
    finally:
        it.close()
        bar.close()
    throughput = None
    if speed["seconds"] > 0:
        throughput = {"steps": speed["steps"], "seconds": speed["seconds"],
                      "ctx_tokens_per_s": speed["ctx_tokens"] / speed["seconds"],
                      "block_tokens_per_s": speed["block_tokens"] / speed["seconds"]}  # fmt: skip
    return TrainResult(model, history, evals, best, step, total, interrupted, throughput)
