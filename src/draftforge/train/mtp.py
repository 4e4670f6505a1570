"""Train an MTP head (docs/architecture.md, "MTP head") from the extracted features.

Per sequence (tokens x_0..x_{T-1}, final-normed last-layer states h_0..h_{T-1} of the target):
depth 1 row i takes (h_i, x_{i+1}) at position i and predicts x_{i+2}; depth d row i takes (depth d−1's
output at row i, x_{i+d}) at position i+d−1 and predicts x_{i+d+1}, attending to the depth-1 keys of
rows 0..i plus the deeper keys of its own row — exactly what the engine computes when it drafts
recursively. Loss: mean CE over depths 1..mtp_depth on up to mtp_rows sampled supervised rows per
depth (the frozen LM head dominates the cost). Val: per-depth top-1 accuracy of mtp_val_drafts
recursive drafts and the simulated acceptance length τ = 1 + leading correct drafts, on rows whose
next mtp_val_drafts+1 tokens are all supervised. The exported weights are the best val τ seen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from draftforge.drafter.mtp import MTPHead
from draftforge.train.data import FeatureSource, truncate
from draftforge.train.head import FrozenTargetHead

log = logging.getLogger(__name__)


@dataclass
class MTPSeq:
    ids: torch.Tensor  # (T,) int64
    mask: torch.Tensor  # (T,) bool, supervised tokens
    hidden: torch.Tensor  # (T, H) final-normed last-layer states


def mtp_item(src: FeatureSource, i: int, max_len: int) -> MTPSeq:
    """Sequence i of a feature source whose items carry the target's final-normed last layer as the 4th
    element (`last_hidden`, stored by extract when `drafter.settings.needs_last_layer`); the taps are unused."""
    item = src[i]
    if len(item) < 4 or item[3] is None:
        raise ValueError("the features carry no final-normed last layer (`last_hidden`): rerun extract with "
                         "mtp in `drafters` (draftforge.drafter.settings.needs_last_layer decides what extract stores)")
    ids, lmask, _, last = truncate(item, max_len)  # type: ignore[misc]
    return MTPSeq(ids.long(), lmask.bool(), last)


def recursive_outputs(head: MTPHead, embed: torch.Tensor, seq: MTPSeq, depth: int) -> list[torch.Tensor]:
    """Outputs of depths 1..depth for rows i = 0..T-2: list of (n, H) with n = T-1."""
    ids, T = seq.ids, seq.ids.numel()
    n = T - 1
    rows = torch.arange(n, device=ids.device)
    prev = seq.hidden[:n][None].to(head.proj.weight.dtype)
    keys_k: list[torch.Tensor] = []
    keys_v: list[torch.Tensor] = []
    outs = []
    tril = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=ids.device)
    for d in range(1, depth + 1):
        tok = ids[(rows + d).clamp(max=T - 1)]
        pos = (rows + d - 1)[None]
        emb = embed[tok][None].to(prev.dtype)
        if d == 1:
            out, k, v = head(prev, emb, pos)
        else:
            mask = torch.cat([tril] + [eye] * (d - 1), dim=1)  # depth-1 keys ≤ i, then row i's deeper keys
            out, k, v = head(prev, emb, pos, keys=(torch.cat(keys_k, dim=2), torch.cat(keys_v, dim=2)), mask=mask)
        keys_k.append(k)
        keys_v.append(v)
        outs.append(out[0])
        prev = out
    return outs


def depth_targets(seq: MTPSeq, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets (n,), valid (n,)) of depth d: row i predicts x_{i+d+1}, valid when supervised."""
    T = seq.ids.numel()
    idx = torch.arange(T - 1, device=seq.ids.device) + d + 1
    inside = idx < T
    idx = idx.clamp(max=T - 1)
    return seq.ids[idx], inside & seq.mask[idx]


def sample_rows(valid: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    rows = valid.nonzero().flatten()
    if k > 0 and rows.numel() > k:
        pick = torch.randperm(rows.numel(), generator=gen)[:k].to(rows.device)
        rows = rows[pick].sort().values
    return rows


def depth_rows(seq: MTPSeq, depth: int, rows: int, gen: torch.Generator | None) -> list[torch.Tensor]:
    """The supervised rows each depth 1..depth trains on (up to `rows` sampled per depth)."""
    return [sample_rows(depth_targets(seq, d)[1], rows, gen) for d in range(1, depth + 1)]


def depth_ce_sums(head: MTPHead, frozen: FrozenTargetHead, seq: MTPSeq, picks: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Summed CE of each depth over its picked rows (None where a depth has no rows)."""
    outs = recursive_outputs(head, frozen.embed, seq, len(picks))
    sums: list[torch.Tensor | None] = []
    for d, (out, pick) in enumerate(zip(outs, picks), start=1):
        if pick.numel() == 0:
            sums.append(None)
            continue
        tgt, _ = depth_targets(seq, d)
        logits = out[pick].float() @ frozen.lm_head.float().T
        sums.append(F.cross_entropy(logits, tgt[pick], reduction="sum"))
    return sums


@torch.no_grad()
def mtp_eval(head: MTPHead, frozen: FrozenTargetHead, seqs: list[MTPSeq], drafts: int, rows: int, seed: int) -> dict[str, float]:
    """val_mtp_acc_<d> (d = 1..drafts), val_mtp_sim_tau, val_mtp_rows."""
    was = head.training
    head.eval()
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(drafts, dtype=torch.float64)
    tau_sum, n_rows = 0.0, 0
    for seq in seqs:
        T = seq.ids.numel()
        if T < drafts + 2:
            continue
        n = T - 1
        i = torch.arange(n)
        ok = torch.ones(n, dtype=torch.bool)
        for j in range(1, drafts + 2):  # x_{i+1} .. x_{i+drafts+1} all supervised and inside
            idx = i + j
            ok &= (idx < T) & seq.mask[idx.clamp(max=T - 1)]
        pick = sample_rows(ok, rows, gen)
        if pick.numel() == 0:
            continue
        outs = recursive_outputs(head, frozen.embed, seq, drafts)
        hits = []
        for d, out in enumerate(outs, start=1):
            tgt, _ = depth_targets(seq, d)
            pred = (out[pick].float() @ frozen.lm_head.float().T).argmax(-1)
            hits.append(pred == tgt[pick])
        hit = torch.stack(hits, dim=1)  # (rows, drafts)
        correct += hit.double().sum(0)
        tau_sum += float((1 + hit.long().cumprod(dim=1).sum(1)).sum())
        n_rows += pick.numel()
    head.train(was)
    out = {f"val_mtp_acc_{d + 1}": float(correct[d] / max(n_rows, 1)) for d in range(drafts)}
    out["val_mtp_sim_tau"] = tau_sum / n_rows if n_rows else float("nan")
    out["val_mtp_rows"] = float(n_rows)
    return out


@dataclass
class MTPResult:
    head: MTPHead  # the selected (best val τ) weights on rank 0; the last weights on other ranks
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    best: dict[str, float] | None = None
    steps: int = 0  # the run's total steps
    seconds: float = 0.0  # this process's training time (a resumed run: since the resume)
    step: int = 0  # steps done (< steps when interrupted)
    resumed_from: int | None = None  # the checkpoint's step this run continued from
    interrupted: bool = False


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
    return t


def _cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def train_mtp(head: MTPHead, frozen: FrozenTargetHead, train_src: FeatureSource,
              val_src: FeatureSource | None, *, steps: int, lr: float, depth: int, rows: int, val_drafts: int,
              eval_every: int, max_len: int, val_max_seqs: int, seed: int = 0, warmup_ratio: float = 0.04,
              grad_clip: float = 1.0, device: torch.device | str = "cpu", logger: Any = None,
              progress: bool = False, batch_seqs: int = 1, rank: int = 0, world: int = 1,
              ckpt_dir: Path | None = None, resume_key: str = "", ckpt_every: int = 0, keep_checkpoints: int = 2,
              stop: Any = None) -> MTPResult:
    """AdamW + cosine schedule over `steps` steps of `batch_seqs` sequences per rank (global batch
    batch_seqs x world), every rank training its share; resumes from ckpt_dir's latest checkpoint
    with a matching resume_key. `stop` (a train.stop.StopRequest) ends the run after a step, with that step's
    checkpoint written (`interrupted`; a rerun resumes there).

    Determinism: step s takes the sequences epoch_order(seed, epoch) lists for it (the drafter's order)
    and samples each sequence's rows from a generator of (seed, s, sequence), so the stream depends on
    neither the world size nor where a run resumed. The loss of a step is the mean over depths of the
    CE summed over all ranks' rows of that depth divided by their global count; each rank
    back-propagates its part and the gradients are summed over ranks, so W ranks of b sequences take
    the step one process takes on the same W*b sequences. Rank 0 evaluates and broadcasts the metrics,
    so every rank records the same val history and best step; rank 0 keeps the best weights, writes
    the checkpoints and holds the selected head at the end."""
    from tqdm import tqdm

    from draftforge.train.checkpoint import load_latest, rng_state, set_rng_state
    from draftforge.train.data import _hash_seed, epoch_order, rank_share
    from draftforge.train.loop import lr_lambda, save_checkpoint_rank0, val_indices

    if batch_seqs < 1:
        raise ValueError(f"train.mtp_batch_seqs={batch_seqs}: need >= 1 sequence per rank")
    device, rank0 = torch.device(device), rank == 0
    head = head.to(device).train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup_ratio, 0.0))
    res = MTPResult(head, steps=steps)
    best_state: dict[str, torch.Tensor] | None = None  # rank 0: the best val τ weights (CPU)
    payload = load_latest(ckpt_dir, resume_key) if ckpt_dir is not None else None
    if payload is not None:
        head.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        sched.load_state_dict(payload["scheduler"])
        res.step = res.resumed_from = payload["step"]
        res.history, res.evals, res.best = payload["history"], payload["evals"], payload["best"]
        best_state = payload["best_model"] if rank0 else None
        set_rng_state(payload["rng"])
        del payload
    if world > 1:  # every rank starts from rank 0's weights (they are equal already; this guards it)
        for t in head.state_dict().values():
            dist.broadcast(t, 0)
    picked = val_indices(len(val_src), val_max_seqs) if val_src is not None else []
    val = []
    if rank0 and picked:
        val = [mtp_item(val_src, i, max_len) for i in picked]  # type: ignore[arg-type]
        val = [MTPSeq(s.ids.to(device), s.mask.to(device), s.hidden.to(device)) for s in val]

    def run_eval(at: int) -> None:
        nonlocal best_state
        if not picked:
            return
        m = {**mtp_eval(head, frozen, val, val_drafts, rows, seed + 1), "step": at} if rank0 else None
        if world > 1:
            box = [m]
            dist.broadcast_object_list(box, src=0)
            m = box[0]
        res.evals.append(m)
        if res.best is None or m["val_mtp_sim_tau"] > res.best["val_mtp_sim_tau"]:
            res.best = dict(m)
            if rank0:
                best_state = _cpu_copy(head.state_dict())
        if rank0 and logger is not None:
            logger.log_metrics({k: v for k, v in m.items() if k != "step"}, step=at)
        if rank0:
            log.info("mtp step %d: val sim_tau %.3f acc_1 %.3f", at, m["val_mtp_sim_tau"], m["val_mtp_acc_1"])

    def checkpoint(at: int) -> None:
        if ckpt_dir is None:
            return
        save_checkpoint_rank0(ckpt_dir, at, lambda: {
            "model": head.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": at, "history": res.history, "evals": res.evals, "best": res.best, "best_model": best_state,
            "rng": rng_state(), "resume_key": resume_key,
        }, keep=keep_checkpoints, rank=rank, world=world)  # fmt: skip

    gb = batch_seqs * max(1, world)
    per_epoch = -(-len(train_src) // gb)
    order: tuple[int, list[list[int]]] | None = None
    t0 = time.perf_counter()
    bar = tqdm(total=steps, initial=res.step, desc="train mtp", unit="step", disable=not progress)
    try:
        for step in range(res.step, steps):
            epoch, in_epoch = divmod(step, per_epoch)
            if order is None or order[0] != epoch:
                order = (epoch, epoch_order(len(train_src), gb, seed, epoch))
            work, counts = [], torch.zeros(depth, dtype=torch.float64, device=device)
            for i in rank_share(order[1][in_epoch], rank, world):
                seq = mtp_item(train_src, i, max_len)
                if seq.ids.numel() < 3:
                    continue
                seq = MTPSeq(seq.ids.to(device), seq.mask.to(device), seq.hidden.to(device))
                picks = depth_rows(seq, depth, rows, torch.Generator().manual_seed(_hash_seed(seed, step, i)))
                counts += torch.tensor([p.numel() for p in picks], dtype=torch.float64, device=device)
                work.append((seq, picks))
            vote = torch.tensor([1.0 if stop is not None and stop.requested() else 0.0], dtype=torch.float64, device=device)
            counts = _all_reduce(torch.cat([counts, vote]), world)  # the stop votes ride with the row counts
            stop_now, counts = bool(counts[depth] > 0), counts[:depth]
            active = counts > 0
            n_active = int(active.sum())
            ce = torch.zeros(depth, dtype=torch.float64, device=device)
            for seq, picks in work:
                sums = depth_ce_sums(head, frozen, seq, picks)
                parts = [s / (float(counts[d]) * n_active) for d, s in enumerate(sums) if s is not None]
                if parts:
                    torch.stack(parts).sum().backward()
                    ce += torch.stack([s.detach().double() if s is not None else ce.new_zeros(()) for s in sums])
            if n_active:  # no supervised row anywhere in this step's sequences: no update
                if world > 1:
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad)
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                _all_reduce(ce, world)
                per = {d + 1: float(ce[d] / counts[d]) for d in range(depth) if active[d]}
                rec = {"step": step + 1, "mtp_loss": sum(per.values()) / n_active,
                       **{f"mtp_loss_{d}": v for d, v in per.items()}}
                res.history.append(rec)
                if rank0 and logger is not None and ((step + 1) % 25 == 0 or step + 1 == steps):
                    logger.log_metrics({k: v for k, v in rec.items() if k != "step"}, step=step + 1)
            res.step = step + 1
            bar.update(1)
            if (step + 1) % max(1, eval_every) == 0 or step + 1 == steps:
                run_eval(step + 1)
            if (ckpt_every > 0 and (step + 1) % ckpt_every == 0) or step + 1 == steps:
                checkpoint(step + 1)
            if stop_now and step + 1 < steps:  # a rank was asked to stop: all stop after this step
                if not (ckpt_every > 0 and (step + 1) % ckpt_every == 0):
                    checkpoint(step + 1)
                res.interrupted = True
                break
    finally:
        bar.close()
    res.seconds = time.perf_counter() - t0
    if best_state is not None and not res.interrupted:
        head.load_state_dict(best_state)
    res.head = head.eval()
    return res


MTP_CHECKPOINTS = "mtp_checkpoints"  # the MTP head's resumable checkpoints: ctx.work_dir / MTP_CHECKPOINTS
# The keys that change what MTP training computes (with the target, the features and the global batch).
_MTP_RESUME_KEYS = ("mtp_steps", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "max_seq_len", "seed",
                    "warmup_ratio", "grad_clip")


def run_mtp_training(ctx, cfg: Any, info: dict[str, Any], device: torch.device, run: Any,
                     stop: Any = None, disk_check: Any = None) -> dict[str, Any] | None:
    """The train stage's MTP part, on every rank: train (resuming from ctx.work_dir/mtp_checkpoints),
    then rank 0 exports to out_dir/mtp in vLLM's MiMo MTP format and returns the metrics.json entry
    (None on other ranks). A `stop` request ends it after a checkpointed step with one StageError;
    `disk_check(n_trainable_params)` (rank 0) may refuse before anything is written."""
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head
    from draftforge.errors import StageError
    from draftforge.io import sha256_file, sha256_json
    from draftforge.train.features import open_features

    train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=torch.float32)
    try:
        mtp_item(train_src, 0, 1)  # the store carries `last_hidden` (extract ran with an mtp drafter listed)
        head, copied = new_trained_head(info["hf_path"], init_from_target=True, seed=cfg.seed)
    except ValueError as exc:
        raise StageError(f"drafter=mtp: {ctx.input_marker('extract')}: {exc}") from None
    if disk_check is not None:
        disk_check(sum(p.numel() for p in head.parameters() if p.requires_grad))
    frozen = FrozenTargetHead.from_target(info["hf_path"], dtype=torch.float32, device=device)
    resume_key = sha256_json({"mtp": {k: getattr(cfg, k) for k in _MTP_RESUME_KEYS}, "target": info["fingerprint"],
                              "extract": sha256_file(ctx.input_marker("extract")),
                              "global_batch": cfg.mtp_batch_seqs * ctx.world_size, "init_layer": copied})
    res = train_mtp(head, frozen, train_src, val_src, steps=cfg.mtp_steps, lr=cfg.mtp_lr,
                    depth=cfg.mtp_depth, rows=cfg.mtp_rows, val_drafts=cfg.mtp_val_drafts,
                    eval_every=cfg.mtp_eval_every, max_len=cfg.max_seq_len, val_max_seqs=cfg.val_max_seqs,
                    seed=cfg.seed, warmup_ratio=cfg.warmup_ratio, grad_clip=cfg.grad_clip or 1.0, device=device,
                    logger=run, progress=ctx.is_rank0, batch_seqs=cfg.mtp_batch_seqs, rank=ctx.rank,
                    world=ctx.world_size, ckpt_dir=ctx.work_dir / MTP_CHECKPOINTS, resume_key=resume_key,
                    ckpt_every=cfg.ckpt_every, keep_checkpoints=cfg.keep_checkpoints, stop=stop)  # fmt: skip
    if res.interrupted:
        raise StageError(f"train (mtp): stopped by {getattr(stop, 'reason', None) or 'request'} after step {res.step}/"
                         f"{cfg.mtp_steps}; checkpoint in {ctx.work_dir / MTP_CHECKPOINTS}; rerun the same command to resume")
    if not ctx.is_rank0:
        return None
    selected = f"best val_mtp_sim_tau at step {res.best['step']}" if res.best else "last"
    out = ctx.out_dir / "mtp"
    export_mimo_head(res.head, out, info["hf_path"], dtype=getattr(torch, cfg.export_dtype),
                     extra={"target": info["name"], "target_fingerprint": info["fingerprint"], "selected": selected,
                            "steps": res.steps, "init_layer": copied})
    h = res.history
    k = max(1, min(25, len(h) // 4))
    return {
        "dir": str(out), "format": "mimo", "selected": selected, "steps": res.steps, "seconds": res.seconds,
        "world_size": ctx.world_size, "global_batch": cfg.mtp_batch_seqs * ctx.world_size,
        "resumed_from": res.resumed_from, "init_from_target_layer": copied,
        "loss_first": sum(r["mtp_loss"] for r in h[:k]) / k if h else None,
        "loss_last": sum(r["mtp_loss"] for r in h[-k:]) / k if h else None,
        "best": res.best, "val_curve": res.evals,
    }  # fmt: skip
