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
    acceptance_weighting: bool = False  # drafter.acceptance_weighting (see make_objective)
    stop: Any = None  # a train.stop.StopRequest: asked once per step whether to stop after it (None: never)


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


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's AVX512/AMX bf16 paths). Without them torch
    emulates bf16 matmuls ~10x slower than fp32 (AVX2 EPYC: 4 vs 38 GFLOP/s per core, docs/benchmarks.md)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """train.compute_dtype: "" = bf16 autocast on CUDA, fp32 on CPU; "auto" = bf16 autocast on CUDA and on
    CPUs with native bf16, else fp32; else the dtype named."""
    if cfg.compute_dtype in ("", "auto"):
        fast = device.type == "cuda" or (cfg.compute_dtype == "auto" and device.type == "cpu" and cpu_has_fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    from draftforge.runtime import dtype_named

    dtype = dtype_named("train.compute_dtype", cfg.compute_dtype)
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        log.warning("train.compute_dtype=bfloat16: this CPU has no native bf16 matmul, so each step runs ~10x "
                    "slower than float32; set train.compute_dtype=auto (or float32)")
    return dtype


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
    acceptance_weighting: bool = False  # position weights × the chance of reaching the position

    @property
    def needs_target(self) -> bool:
        """Whether the target's next-token distribution (its last-layer states) is required."""
        return (self.weights.get("kl", 0) > 0 or self.weights.get("tv", 0) > 0 or self.conf_weight > 0
                or self.acceptance_weighting)


def make_objective(cfg: TrainConfig, dcfg: DFlashConfig, loss_weights: dict[str, float] | None = None,
                   acceptance_weighting: bool = False) -> Objective | None:
    """None for plain CE (the DFlash path); else the distribution objective with these term weights."""
    weights = check_weights(dict(loss_weights) if loss_weights else default_loss_weights("dspark" if is_dspark(dcfg) else "dflash"))
    if not is_dspark(dcfg) and weights == {"ce": 1.0} and not acceptance_weighting:
        return None
    conf = cfg.confidence_loss_weight if (is_dspark(dcfg) and dcfg.enable_confidence_head) else 0.0
    return Objective(weights, conf, cfg.loss_vocab_chunk, acceptance_weighting)


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
    reach = None
    if obj.acceptance_weighting:  # (block, draft index) of each valid row; a block's first draft slot is index 0
        idx = flat.nonzero().squeeze(-1)
        first = convention(raw.cfg)[0]
        reach = (idx // B, idx % B - first, S * N, B - first)
    out = objective(hv, head.lm_head, y, w_row, obj.weights, ht=ht, e=e, w2=w2, conf_logit=conf_logit,
                    conf_weight=obj.conf_weight, chunk=obj.chunk, reach=reach)
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
    obj = make_objective(cfg, dcfg, inp.loss_weights, inp.acceptance_weighting)
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


@dataclass
class TrainState:
    """What a checkpoint holds and each optimizer step advances."""

    model: DFlashDrafter
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    best: dict[str, Any] | None = None

    def payload(self, inp: TrainInputs) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "step": self.step, "history": self.history, "evals": self.evals, "best": self.best, "rng": rng_state(),
                "resume_key": inp.resume_key, "dcfg": inp.dcfg.to_dict()}  # fmt: skip


def new_state(inp: TrainInputs, total: int) -> TrainState:
    """A fresh model and optimizer, or the newest checkpoint with this resume key restored into them."""
    cfg = inp.cfg
    model = build_model(inp)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                            fused=inp.device.type == "cuda")
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio)))
    payload = load_latest(inp.ckpt_dir, inp.resume_key)
    if payload is not None:
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        state.sched.load_state_dict(payload["scheduler"])
        state.step, state.history, state.evals, state.best = payload["step"], payload["history"], payload["evals"], payload["best"]
        set_rng_state(payload["rng"])
    return state


def training_module(model: DFlashDrafter, inp: TrainInputs) -> torch.nn.Module:
    """What the forward runs through: DDP over ranks (else the model itself), draft layers compiled on request."""
    if inp.cfg.compile:  # per layer: the mask is built outside the compiled regions
        for layer in model.layers:
            layer.compile()
        compile_loss()
    if inp.world > 1:
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[inp.device.index] if inp.device.type == "cuda" else None)
    return model


@dataclass
class StepContext:
    """The per-run constants an optimizer step needs."""

    fwd: torch.nn.Module  # training_module(model)
    weights: torch.Tensor  # (B,) slot weights
    obj: Objective | None
    dtype: torch.dtype
    first_slot: int


def optimizer_step(state: TrainState, sc: StepContext, inp: TrainInputs, batch: Batch) -> tuple[dict[str, float], torch.Tensor]:
    """One step on this rank's share of the global batch → (record, globally summed [weight, weighted CE,
    context tokens, block tokens, stop votes]). Summing the stop votes with the loss terms costs no extra
    collective and makes every rank stop after the same step."""
    cfg, dcfg = inp.cfg, inp.dcfg
    batch = batch.to(inp.device)
    with _autocast(inp.device, sc.dtype):
        out = forward_batch(sc.fwd, inp.head, batch, sc.weights, cfg.attn_impl, sc.obj)
    stop_vote = 1.0 if inp.stop is not None and inp.stop.requested() else 0.0
    sums = torch.stack([out.weight_sum.float(), out.weighted_ce_sum.detach().float(),
                        torch.tensor(float(batch.n_tokens), device=inp.device),
                        batch.valid[..., sc.first_slot].sum().float() * dcfg.block_size,
                        torch.tensor(stop_vote, device=inp.device)])  # fmt: skip
    _all_reduce(sums, inp.world)
    w_global = sums[0].clamp_min(1e-6)
    (out.weighted_ce_sum / w_global * inp.world).backward()  # DDP averages: x world gives the global-batch gradient
    params = [p for p in state.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    state.opt.step()
    state.sched.step()
    state.opt.zero_grad(set_to_none=True)
    state.step += 1
    rec = {"step": state.step, "loss": float(sums[1] / w_global), "lr": state.sched.get_last_lr()[0],
           "grad_norm": float(grad_norm)}  # float(): syncs the device, so step times are real
    return rec, sums


class Throughput:
    """Steady-state speed (the first two steps of a process excluded: compile / warm-up) and the rate over
    each logging window; evals and checkpoints are outside the timed spans."""

    def __init__(self, first_step: int) -> None:
        self.first_step = first_step
        self.total = {"steps": 0.0, "seconds": 0.0, "ctx_tokens": 0.0, "block_tokens": 0.0}
        self.window_start, self.window_ctx, self.window_blk = time.perf_counter(), 0.0, 0.0
        self.step_start = time.perf_counter()

    def begin_step(self) -> None:
        self.step_start = time.perf_counter()

    def end_step(self, step_index: int, ctx_tokens: float, block_tokens: float) -> None:
        self.window_ctx += ctx_tokens
        self.window_blk += block_tokens
        if step_index >= self.first_step + 2:
            for key, v in (("steps", 1.0), ("seconds", time.perf_counter() - self.step_start),
                           ("ctx_tokens", ctx_tokens), ("block_tokens", block_tokens)):  # fmt: skip
                self.total[key] += v

    def window(self) -> dict[str, float]:
        """Tokens/s since the last call (the logging window); starts the next window."""
        dt = max(time.perf_counter() - self.window_start, 1e-9)
        rates = {"ctx_tokens_per_s": self.window_ctx / dt, "block_tokens_per_s": self.window_blk / dt}
        self.window_start, self.window_ctx, self.window_blk = time.perf_counter(), 0.0, 0.0
        return rates

    def summary(self) -> dict[str, float] | None:
        t = self.total
        if t["seconds"] <= 0:
            return None
        return {"steps": t["steps"], "seconds": t["seconds"], "ctx_tokens_per_s": t["ctx_tokens"] / t["seconds"],
                "block_tokens_per_s": t["block_tokens"] / t["seconds"]}  # fmt: skip


def validate(state: TrainState, inp: TrainInputs, dtype: torch.dtype) -> None:
    """Val metrics at this step into state.evals; a new best (val_sim_tau) is kept as best.pt (rank 0)."""
    if inp.val_source is None:
        return
    metrics = evaluate(state.model, inp, dtype)
    metrics["step"] = state.step
    state.evals.append(metrics)
    rank0 = inp.rank == 0
    if state.best is None or metrics["val_sim_tau"] > state.best["val_sim_tau"]:
        state.best = dict(metrics)
        if rank0:
            save_best(inp.ckpt_dir, state.model.state_dict(), {"metrics": state.best, "resume_key": inp.resume_key})
    if rank0 and inp.logger is not None:
        inp.logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=state.step)
    if rank0:
        log.info("step %d: val loss %.4f acc %.3f sim_tau %.3f", state.step, metrics["val_loss"], metrics["val_acc"],
                 metrics["val_sim_tau"])


def train(inp: TrainInputs) -> TrainResult:
    """Train (or resume) to cfg's total steps. `inp.stop` (a StopRequest) ends the run early after a step,
    with a checkpoint of that step written: the result is then `interrupted` and a rerun resumes there."""
    cfg, dcfg, rank0 = inp.cfg, inp.dcfg, inp.rank == 0
    if cfg.batch_seqs < 1:
        raise ValueError(f"train.batch_seqs={cfg.batch_seqs}: need >= 1 sequence per rank")
    per_epoch, total = total_steps(cfg, len(inp.train_source), inp.world)
    dtype = compute_dtype(cfg, inp.device)
    state = new_state(inp, total)
    first = convention(dcfg)[0]
    sc = StepContext(training_module(state.model, inp), slot_weights(dcfg.block_size, cfg.loss_gamma, first).to(inp.device),
                     make_objective(cfg, dcfg, inp.loss_weights, inp.acceptance_weighting), dtype, first)

    def checkpoint() -> None:
        save_checkpoint_rank0(inp.ckpt_dir, state.step, lambda: state.payload(inp), keep=cfg.keep_checkpoints,
                              rank=inp.rank, world=inp.world)

    interrupted = False
    state.model.train()
    it = Prefetcher(batches(inp, state.step, per_epoch, total), depth=cfg.prefetch)
    bar = tqdm(total=total, initial=state.step, disable=not rank0, desc="train", unit="step")
    speed = Throughput(state.step)
    try:
        for step_index, epoch, batch in it:
            rec, sums = optimizer_step(state, sc, inp, batch)
            rec["epoch"] = epoch
            speed.end_step(step_index, float(sums[2]), float(sums[3]))
            state.history.append(rec)
            bar.update(1)
            step = state.step
            if step % cfg.log_every == 0 or step == total:
                if rank0 and inp.logger is not None:
                    inp.logger.log_metrics({**{k: v for k, v in rec.items() if k != "step"}, **speed.window()}, step=step)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}")
            if step % cfg.eval_every == 0 or step == total:
                validate(state, inp, dtype)
            saved = step % cfg.ckpt_every == 0 or step == total
            if saved:
                checkpoint()
            if float(sums[4]) > 0 and step < total:  # a rank was asked to stop: all stop after this step
                if not saved:
                    checkpoint()
                interrupted = True
                break
            speed.begin_step()
    finally:
        it.close()
        bar.close()
    return TrainResult(state.model, state.history, state.evals, state.best, state.step, total, interrupted, speed.summary())
