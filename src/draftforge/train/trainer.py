"""The one training loop (docs/architecture.md, "Training loop"): every drafter kind trains through `run`.

What differs per kind is a `TrainTask`: the trainable module, one step's batch built from this rank's
share of the epoch order, the step's loss in two phases around one all-reduce, the val metrics, what a
checkpoint holds beyond the loop's state. The block drafters' task is `train.loop.BlockTask`, the MTP
head's is `train.mtp.MTPTask`. The loop owns the rest, once: AdamW + warmup/cosine, the per-step stop
vote, the gradient all-reduce, clipping, checkpoints (rank 0, atomic, `latest`, `keep_checkpoints`),
resume, validation cadence, best-val selection, the metrics history and MLflow logging (rank 0).

Distributed invariants (W ranks, gloo on CPU / NCCL on GPU under torchrun):
- step s takes the sequences `epoch_order(n, batch_seqs x W, seed, epoch)` lists for it, this rank's
  `rank_share`; a task draws any randomness of a sequence from (seed, step or epoch, sequence), so the
  stream depends neither on W nor on where a run resumed;
- phase 1 (`TrainTask.forward`) returns the sums the loss is normalised by; the loop sums them over ranks
  together with the stop votes (one collective), so every rank knows the global normaliser and every
  rank stops after the same step;
- phase 2 (`TrainTask.backward`) back-propagates this rank's share of the *global* loss; the loop sums
  the gradients over ranks, so W ranks of b sequences take the step one process takes on W·b sequences.
- a task's phase boundary s (`TrainTask.phase_steps`): no batch of a step >= s is built before
  `TrainTask.enter_phase(s)` ran on every rank (the prefetcher is drained at s and restarted after it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from draftforge.train.checkpoint import load_best, load_latest, rng_state, save_best, save_checkpoint, set_rng_state
from draftforge.train.data import Prefetcher, epoch_order, rank_share

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """Phase 1 of a step on this rank's share: `sums` (n,) float64, the terms the loss is normalised by
    and the work counted (the loop sums them over ranks); `state` is what phase 2 needs (a forward's graph)."""

    sums: torch.Tensor
    state: Any = None


@dataclass
class StepOut:
    """Phase 2's result: the step's global loss terms (history, MLflow) and work done (throughput, per s)."""

    record: dict[str, float]
    work: dict[str, float] = field(default_factory=dict)


class TrainTask(Protocol):
    """What one drafter kind contributes to the loop. `forward`, `backward` and `validate` run on every rank
    in step; whatever collective they issue, every rank issues it too."""

    name: str  # progress bar and log prefix
    select: str  # the val metric (higher is better) whose best weights are kept and exported
    model: torch.nn.Module  # the trainable module, on the loop's device
    n_train: int  # training sequences (the epoch order's length)

    def batch(self, seqs: list[int], step: int, epoch: int) -> Any:
        """This rank's share of step `step` (0-based) from its sequence indices; runs on the prefetch thread."""
        ...

    def forward(self, batch: Any) -> Pending: ...

    def backward(self, pending: Pending, sums: torch.Tensor) -> StepOut | None:
        """Back-propagate this rank's part of the global loss (`sums` = pending.sums summed over ranks).
        None: no supervised row in the whole global batch, no update (decided from `sums`: all ranks agree)."""
        ...

    def validate(self) -> dict[str, float] | None:
        """Val metrics, the same on every rank (None: no val set)."""
        ...

    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint holds beyond the loop's state (plain containers and tensors)."""
        ...

    def restore_extra(self, payload: dict[str, Any]) -> None:
        """Take back what `checkpoint_extra` wrote (a resumed run continues with the same task state)."""
        ...

    def phase_steps(self) -> list[int]:
        """Steps s before which the task changes how it builds batches: the loop runs `enter_phase(s)` after step
        s - 1 (its eval and checkpoint included) and builds no batch of a step >= s before that."""
        ...

    def enter_phase(self, step: int) -> dict[str, float]:
        """Runs on every rank, in step (collectives allowed), at a boundary of `phase_steps` that a resumed run
        has not passed yet; returns metrics to log at `step` (rank 0 logs them, the result keeps them)."""
        ...


@dataclass
class LoopSpec:
    """The recipe and the place of one run."""

    total: int  # optimizer steps of the whole run (the schedule's length)
    batch_seqs: int  # sequences per rank per step; the global batch is batch_seqs x world
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # <= 0: no clipping (the norm is still recorded)
    seed: int = 0
    eval_every: int = 100
    log_every: int = 10
    ckpt_every: int = 200  # 0: only at the end
    keep_checkpoints: int = 2
    prefetch: int = 2  # batches built ahead on a background thread
    ckpt_dir: Path | None = None  # None: no checkpoints, no resume
    resume_key: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world: int = 1
    logger: Any = None  # draftforge.tracking.RunLogger (rank 0) or None
    stop: Any = None  # a train.stop.StopRequest, asked once per step (None: never)


@dataclass
class LoopResult:
    model: torch.nn.Module  # the last weights
    history: list[dict[str, float]]
    evals: list[dict[str, float]]
    best: dict[str, float] | None  # the val metrics of the best step (every rank)
    best_state: dict[str, torch.Tensor] | None  # rank 0: the best step's weights (CPU); None elsewhere / no val
    step: int  # steps done (< total_steps when interrupted)
    total_steps: int
    resumed_from: int | None = None  # the checkpoint's step this run continued from
    interrupted: bool = False
    # Steady-state speed of this process's steps (first 2 excluded: compile/warm-up), evals and checkpoints
    # excluded: {"steps", "seconds", "<work>_per_s"} (global work).
    throughput: dict[str, float] | None = None
    seconds: float = 0.0  # this process's time in the loop (a resumed run: since the resume)
    phases: list[dict[str, float]] = field(default_factory=list)  # enter_phase's metrics, with "step"

    def selected(self) -> dict[str, torch.Tensor]:
        """The weights to export: the best val step's on rank 0, else the last."""
        return self.best_state if self.best_state is not None else self.model.state_dict()


def lr_lambda(total: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    warmup = max(1, round(total * warmup_ratio)) if warmup_ratio > 0 else 0

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    """Sum over ranks in place (identity in one process)."""
    if world > 1:
        dist.all_reduce(t)
    return t


def sync_grads(params: list[torch.nn.Parameter], world: int, bucket_bytes: int = 1 << 26) -> None:
    """Sum the gradients over ranks, a few flat buckets at a time. A parameter without a gradient on this
    rank (no rows here) contributes zeros, so every rank issues the same collectives."""
    if world <= 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    start = 0
    while start < len(grads):
        end, size = start, 0
        while end < len(grads) and (end == start or size + grads[end].numel() * grads[end].element_size() <= bucket_bytes):
            size += grads[end].numel() * grads[end].element_size()
            end += 1
        flat = torch.cat([g.reshape(-1) for g in grads[start:end]])  # (Σ numel,)
        dist.all_reduce(flat)
        offset = 0
        for g in grads[start:end]:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        start = end


def save_checkpoint_rank0(ckpt_dir: Path, step: int, payload: Callable[[], dict[str, Any]], *, keep: int, rank: int,
                          world: int) -> None:
    """Rank 0 writes `payload()` as the step's checkpoint (atomically, `latest` names it, `keep` newest kept);
    every rank waits for it, so no rank runs ahead of the newest checkpoint."""
    if rank == 0:
        save_checkpoint(ckpt_dir, step, payload(), keep=keep)
    if world > 1:
        dist.barrier()


def step_batches(task: TrainTask, spec: LoopSpec, start: int, end: int | None = None) -> Iterator[tuple[int, int, Any]]:
    """(0-based step, epoch, this rank's batch) from `start` to `end` (spec.total)."""
    gb = spec.batch_seqs * max(1, spec.world)
    per_epoch = -(-task.n_train // gb)
    order: tuple[int, list[list[int]]] | None = None
    for step in range(start, spec.total if end is None else end):
        epoch, in_epoch = divmod(step, per_epoch)
        if order is None or order[0] != epoch:
            order = (epoch, epoch_order(task.n_train, gb, spec.seed, epoch))
        yield step, epoch, task.batch(rank_share(order[1][in_epoch], spec.rank, spec.world), step, epoch)


def phased_batches(task: TrainTask, spec: LoopSpec, start: int,
                   on_phase: Callable[[int], None]) -> Iterator[tuple[int, int, Any]]:
    """`step_batches` from `start` to spec.total, prefetched `spec.prefetch` ahead within each phase: at a phase
    boundary s the previous phase's prefetcher has ended (it builds nothing past s - 1), `on_phase(s)` runs on
    the consumer's thread once step s - 1 is done, then a fresh prefetcher builds from s. Closing this generator
    closes the running prefetcher."""
    cuts = {s for s in task.phase_steps() if start <= s < spec.total}  # a run resumed at a boundary enters it too
    points = sorted(cuts | {start})  # each phase once, even when it starts at `start`
    for lo, hi in zip(points, [*points[1:], spec.total]):
        if lo in cuts:
            on_phase(lo)
        it = Prefetcher(step_batches(task, spec, lo, hi), depth=spec.prefetch)
        try:
            yield from it
        finally:
            it.close()


class Throughput:
    """Steady-state speed (the first two steps of a process excluded: compile / warm-up) and the rate over
    each logging window; evals and checkpoints are outside the timed spans."""

    def __init__(self, first_step: int) -> None:
        self.first_step = first_step
        self.steps, self.seconds = 0.0, 0.0
        self.total: dict[str, float] = {}
        self.window_start, self.window_work = time.perf_counter(), {}
        self.step_start = time.perf_counter()

    def begin_step(self) -> None:
        self.step_start = time.perf_counter()

    def end_step(self, step_index: int, work: dict[str, float]) -> None:
        for k, v in work.items():
            self.window_work[k] = self.window_work.get(k, 0.0) + v
        if step_index >= self.first_step + 2:
            self.steps += 1
            self.seconds += time.perf_counter() - self.step_start
            for k, v in work.items():
                self.total[k] = self.total.get(k, 0.0) + v

    def window(self) -> dict[str, float]:
        """Work per second since the last call (the logging window); starts the next window."""
        dt = max(time.perf_counter() - self.window_start, 1e-9)
        rates = {f"{k}_per_s": v / dt for k, v in self.window_work.items()}
        self.window_start, self.window_work = time.perf_counter(), {}
        return rates

    def summary(self) -> dict[str, float] | None:
        if self.seconds <= 0:
            return None
        return {"steps": self.steps, "seconds": self.seconds, **{f"{k}_per_s": v / self.seconds for k, v in self.total.items()}}


def _cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _restore(task: TrainTask, spec: LoopSpec, res: LoopResult, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Continue from the newest checkpoint whose resume key matches (all ranks read it; rank 0 keeps the best
    weights it carries). A checkpoint of an older version without `best_model` takes best.pt's, if its key matches."""
    payload = load_latest(spec.ckpt_dir, spec.resume_key) if spec.ckpt_dir is not None else None
    if payload is None:
        return
    res.model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    sched.load_state_dict(payload["scheduler"])
    res.step = res.resumed_from = payload["step"]
    res.history, res.evals, res.best = payload["history"], payload["evals"], payload["best"]
    res.phases = list(payload.get("phases", []))  # absent in checkpoints written before phases existed
    if spec.rank == 0 and res.best is not None:
        res.best_state = payload.get("best_model")
        if res.best_state is None and spec.ckpt_dir is not None:
            old = load_best(spec.ckpt_dir)
            res.best_state = old["model"] if old is not None and old.get("resume_key") == spec.resume_key else None
    set_rng_state(payload["rng"])
    task.restore_extra(payload)


def run(task: TrainTask, spec: LoopSpec) -> LoopResult:
    """Train (or resume) `task` to spec.total steps. `spec.stop` ends the run early after a step, with that
    step's checkpoint written: the result is then `interrupted` and a rerun resumes there, bit-identically."""
    if spec.batch_seqs < 1:
        raise ValueError(f"{task.name}: batch_seqs={spec.batch_seqs}: need >= 1 sequence per rank")
    rank0, world, total = spec.rank == 0, spec.world, spec.total
    model = task.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay,
                            fused=spec.device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, spec.warmup_ratio, spec.min_lr_ratio))
    res = LoopResult(model, [], [], None, None, 0, total)
    _restore(task, spec, res, opt, sched)
    if world > 1:  # every rank starts from rank 0's weights (equal already: built from one seed; this guards it)
        for t in model.state_dict().values():
            dist.broadcast(t, 0)

    def checkpoint() -> None:
        if spec.ckpt_dir is None:
            return
        save_checkpoint_rank0(spec.ckpt_dir, res.step, lambda: {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": res.step, "history": res.history, "evals": res.evals, "best": res.best,
            "best_model": res.best_state, "rng": rng_state(), "resume_key": spec.resume_key, "phases": res.phases,
            **task.checkpoint_extra(),
        }, keep=spec.keep_checkpoints, rank=spec.rank, world=world)  # fmt: skip

    def validate() -> None:
        metrics = task.validate()
        if metrics is None:
            return
        metrics["step"] = res.step
        res.evals.append(metrics)
        if res.best is None or metrics[task.select] > res.best[task.select]:
            res.best = dict(metrics)
            if rank0:  # the best weights: kept in memory, in every checkpoint, and as best.pt
                res.best_state = _cpu_copy(model.state_dict())
                if spec.ckpt_dir is not None:
                    save_best(spec.ckpt_dir, res.best_state, {"metrics": res.best, "resume_key": spec.resume_key})
        if rank0 and spec.logger is not None:
            spec.logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=res.step)
        if rank0:
            log.info("%s step %d: %s %.3f", task.name, res.step, task.select, metrics[task.select])

    def enter_phase(step: int) -> None:
        metrics = task.enter_phase(step)
        model.train()  # whatever the task ran (eval mode, no grad), training continues in train mode
        res.phases.append({"step": step, **metrics})
        if rank0 and spec.logger is not None and metrics:
            spec.logger.log_metrics(metrics, step=step)
        if rank0:
            log.info("%s step %d: phase %s", task.name, step, metrics)
        speed.begin_step()  # the phase's work is outside the step times, like evals

    model.train()
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=res.step, disable=not rank0, desc=task.name, unit="step")
    speed = Throughput(res.step)
    it = phased_batches(task, spec, res.step, enter_phase)
    try:
        for step_index, epoch, batch in it:
            pending = task.forward(batch)
            vote = 1.0 if spec.stop is not None and spec.stop.requested() else 0.0
            sums = all_reduce(torch.cat([pending.sums.double(), pending.sums.new_tensor([vote], dtype=torch.float64)]), world)
            stop_now, sums = bool(sums[-1] > 0), sums[:-1]  # the stop votes ride with the loss sums
            out = task.backward(pending, sums)
            if out is not None:  # `None` on every rank alike (from the global sums): no update
                sync_grads(params, world)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.grad_clip if spec.grad_clip > 0 else float("inf"))
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                rec = {"step": step_index + 1, **out.record, "lr": sched.get_last_lr()[0],
                       "grad_norm": float(grad_norm), "epoch": epoch}  # float(): syncs the device, so step times are real
                res.history.append(rec)
                speed.end_step(step_index, out.work)
            res.step = step = step_index + 1
            bar.update(1)
            if out is not None and (step % spec.log_every == 0 or step == total):
                if rank0 and spec.logger is not None:
                    spec.logger.log_metrics({**{k: v for k, v in rec.items() if k != "step"}, **speed.window()}, step=step)
                bar.set_postfix({k: f"{v:.3g}" for k, v in out.record.items()})
            if step % max(1, spec.eval_every) == 0 or step == total:
                validate()
            saved = (spec.ckpt_every > 0 and step % spec.ckpt_every == 0) or step == total
            if saved:
                checkpoint()
            if stop_now and step < total:  # a rank was asked to stop: all stop after this step
                if not saved:
                    checkpoint()
                res.interrupted = True
                break
            speed.begin_step()
    finally:
        it.close()
        bar.close()
    res.seconds = time.perf_counter() - t0
    res.throughput = speed.summary()
    return res

