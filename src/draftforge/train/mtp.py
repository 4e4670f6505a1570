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

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
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


def mtp_loss(head: MTPHead, frozen: FrozenTargetHead, seq: MTPSeq, depth: int, rows: int,
             gen: torch.Generator | None) -> tuple[torch.Tensor, list[float]]:
    """Mean over depths of the CE on sampled supervised rows; per-depth CE values."""
    outs = recursive_outputs(head, frozen.embed, seq, depth)
    losses, per = [], []
    for d, out in enumerate(outs, start=1):
        tgt, valid = depth_targets(seq, d)
        pick = sample_rows(valid, rows, gen)
        if pick.numel() == 0:
            continue
        logits = out[pick].float() @ frozen.lm_head.float().T
        ce = F.cross_entropy(logits, tgt[pick])
        losses.append(ce)
        per.append(float(ce.detach()))
    if not losses:
        return torch.zeros((), requires_grad=True), per
    return torch.stack(losses).mean(), per


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
    head: MTPHead  # the selected (best val τ) weights
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    best: dict[str, float] | None = None
    steps: int = 0
    seconds: float = 0.0


def train_mtp(head: MTPHead, frozen: FrozenTargetHead, train_src: FeatureSource,
              val_src: FeatureSource | None, *, steps: int, lr: float, depth: int, rows: int, val_drafts: int,
              eval_every: int, max_len: int, val_max_seqs: int, seed: int = 0, warmup_ratio: float = 0.04,
              grad_clip: float = 1.0, device: torch.device | str = "cpu", logger: Any = None,
              progress: bool = False) -> MTPResult:
    """Single-process AdamW + cosine schedule, one sequence per step."""
    from tqdm import tqdm

    from draftforge.train.loop import lr_lambda, val_indices

    device = torch.device(device)
    head = head.to(device).train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup_ratio, 0.0))
    gen = torch.Generator().manual_seed(seed)
    val = []
    if val_src is not None:
        val = [mtp_item(val_src, i, max_len) for i in val_indices(len(val_src), val_max_seqs)]
        val = [MTPSeq(s.ids.to(device), s.mask.to(device), s.hidden.to(device)) for s in val]
    res = MTPResult(head)
    best_state = None

    def run_eval(at: int) -> None:
        nonlocal best_state
        if not val:
            return
        m = {**mtp_eval(head, frozen, val, val_drafts, rows, seed + 1), "step": at}
        res.evals.append(m)
        if logger is not None:
            logger.log_metrics({k: v for k, v in m.items() if k != "step"}, step=at)
        if res.best is None or m["val_mtp_sim_tau"] > res.best["val_mtp_sim_tau"]:
            res.best, best_state = dict(m), copy.deepcopy(head.state_dict())
        log.info("mtp step %d: val sim_tau %.3f acc_1 %.3f", at, m["val_mtp_sim_tau"], m["val_mtp_acc_1"])

    t0 = time.perf_counter()
    order = torch.randperm(len(train_src), generator=gen).tolist()
    for step in tqdm(range(steps), desc="train mtp", unit="step", disable=not progress):
        if step % len(order) == 0 and step:
            order = torch.randperm(len(train_src), generator=gen).tolist()
        seq = mtp_item(train_src, order[step % len(order)], max_len)
        seq = MTPSeq(seq.ids.to(device), seq.mask.to(device), seq.hidden.to(device))
        if seq.ids.numel() < 3:
            continue
        loss, per = mtp_loss(head, frozen, seq, depth, rows, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step + 1, "mtp_loss": float(loss.detach()), **{f"mtp_loss_{d}": v for d, v in enumerate(per, start=1)}}
        res.history.append(rec)
        if logger is not None and ((step + 1) % 25 == 0 or step + 1 == steps):
            logger.log_metrics({k: v for k, v in rec.items() if k != "step"}, step=step + 1)
        if (step + 1) % max(1, eval_every) == 0 or step + 1 == steps:
            run_eval(step + 1)
    res.steps, res.seconds = steps, time.perf_counter() - t0
    if best_state is not None:
        head.load_state_dict(best_state)
    res.head = head.eval()
    return res


def run_mtp_training(ctx, cfg: Any, info: dict[str, Any], device: torch.device, run: Any) -> dict[str, Any]:
    """The train stage's MTP part (rank 0): train, export to out_dir/mtp in vLLM's MiMo MTP format,
    return the metrics.json entry."""
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head
    from draftforge.errors import StageError
    from draftforge.train.features import open_features

    train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=torch.float32)
    try:
        mtp_item(train_src, 0, 1)  # the store carries `last_hidden` (extract ran with an mtp drafter listed)
        head, copied = new_trained_head(info["hf_path"], init_from_target=True, seed=cfg.seed)
    except ValueError as exc:
        raise StageError(f"drafter=mtp: {ctx.input_marker('extract')}: {exc}") from None
    frozen = FrozenTargetHead.from_target(info["hf_path"], dtype=torch.float32, device=device)
    res = train_mtp(head, frozen, train_src, val_src, steps=cfg.mtp_steps, lr=cfg.mtp_lr,
                    depth=cfg.mtp_depth, rows=cfg.mtp_rows, val_drafts=cfg.mtp_val_drafts,
                    eval_every=cfg.mtp_eval_every, max_len=cfg.max_seq_len, val_max_seqs=cfg.val_max_seqs,
                    seed=cfg.seed, warmup_ratio=cfg.warmup_ratio, grad_clip=cfg.grad_clip or 1.0, device=device,
                    logger=run, progress=ctx.is_rank0)  # fmt: skip
    selected = f"best val_mtp_sim_tau at step {res.best['step']}" if res.best else "last"
    out = ctx.out_dir / "mtp"
    export_mimo_head(res.head, out, info["hf_path"], dtype=getattr(torch, cfg.export_dtype),
                     extra={"target": info["name"], "target_fingerprint": info["fingerprint"], "selected": selected,
                            "steps": res.steps, "init_layer": copied})
    h = res.history
    k = max(1, min(25, len(h) // 4))
    return {
        "dir": str(out), "format": "mimo", "selected": selected, "steps": res.steps, "seconds": res.seconds,
        "init_from_target_layer": copied,
        "loss_first": sum(r["mtp_loss"] for r in h[:k]) / k if h else None,
        "loss_last": sum(r["mtp_loss"] for r in h[-k:]) / k if h else None,
        "best": res.best, "val_curve": res.evals,
    }  # fmt: skip
