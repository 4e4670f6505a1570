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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from draftforge.drafter.mtp import MTPHead
from draftforge.extract.preflight import FreeBytes
from draftforge.train.branch import Branch, check_disk, open_device
from draftforge.train.config import TrainConfig
from draftforge.train.data import FeatureSource, _hash_seed, truncate
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import val_indices
from draftforge.train.trainer import LoopResult, LoopSpec, Pending, StepOut, all_reduce, run

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
class MTPInputs:
    cfg: TrainConfig  # the mtp_* fields, max_seq_len, val_max_seqs, seed, warmup_ratio, grad_clip, ckpt_every, ...
    head: MTPHead
    frozen: FrozenTargetHead  # the target's embedding table and LM head
    train_source: FeatureSource  # items carry `last_hidden` as the 4th element
    val_source: FeatureSource | None
    ckpt_dir: Path | None = None  # None: no checkpoints, no resume
    resume_key: str = ""
    device: torch.device = torch.device("cpu")
    rank: int = 0
    world: int = 1
    logger: Any = None
    stop: Any = None


class MTPTask:
    """The MTP head as a `trainer.TrainTask`. A step's batch is `mtp_batch_seqs` sequences per rank, each with
    up to `mtp_rows` rows per depth drawn from a generator of (seed, step, sequence). Its loss is the mean over
    depths of the CE summed over all ranks' rows of that depth ÷ their global count (phase 1 counts the rows,
    the loop sums the counts over ranks, phase 2 runs one sequence's forward + backward at a time)."""

    name, select = "train mtp", "val_mtp_sim_tau"

    def __init__(self, inp: MTPInputs) -> None:
        self.inp, self.cfg, self.n_train = inp, inp.cfg, len(inp.train_source)
        self.model = inp.head.to(inp.device).train()
        picked = val_indices(len(inp.val_source), self.cfg.val_max_seqs) if inp.val_source is not None else []
        self.has_val = bool(picked)
        self.val: list[MTPSeq] = []  # rank 0 evaluates and broadcasts the metrics
        if inp.rank == 0:
            self.val = [self._on_device(mtp_item(inp.val_source, i, self.cfg.max_seq_len)) for i in picked]  # type: ignore[arg-type]

    def _on_device(self, s: MTPSeq) -> MTPSeq:
        d = self.inp.device
        return MTPSeq(s.ids.to(d), s.mask.to(d), s.hidden.to(d))

    def batch(self, seqs: list[int], step: int, epoch: int) -> list[tuple[MTPSeq, list[torch.Tensor]]]:
        """(sequence, rows of each depth) for this rank's sequences of `step`; sequences under 3 tokens drop out."""
        cfg, work = self.cfg, []
        for i in seqs:
            seq = mtp_item(self.inp.train_source, i, cfg.max_seq_len)
            if seq.ids.numel() < 3:
                continue
            seq = self._on_device(seq)
            work.append((seq, depth_rows(seq, cfg.mtp_depth, cfg.mtp_rows, torch.Generator().manual_seed(_hash_seed(cfg.seed, step, i)))))
        return work

    def forward(self, batch: list[tuple[MTPSeq, list[torch.Tensor]]]) -> Pending:
        """sums = rows per depth (depth,) on this rank; the forward waits for the global counts (phase 2)."""
        counts = torch.zeros(self.cfg.mtp_depth, dtype=torch.float64, device=self.inp.device)
        for _, picks in batch:
            counts += torch.tensor([p.numel() for p in picks], dtype=torch.float64, device=self.inp.device)
        return Pending(counts, batch)

    def backward(self, pending: Pending, counts: torch.Tensor) -> StepOut | None:
        depth = self.cfg.mtp_depth
        active = counts > 0  # (depth,) depths with a row anywhere
        n_active = int(active.sum())
        if not n_active:  # no supervised row in any rank's sequences: no update (every rank sees the same counts)
            return None
        ce = torch.zeros(depth, dtype=torch.float64, device=self.inp.device)
        for seq, picks in pending.state:
            sums = depth_ce_sums(self.model, self.inp.frozen, seq, picks)
            parts = [s / (float(counts[d]) * n_active) for d, s in enumerate(sums) if s is not None]
            if parts:
                torch.stack(parts).sum().backward()
                ce += torch.stack([s.detach().double() if s is not None else ce.new_zeros(()) for s in sums])
        all_reduce(ce, self.inp.world)
        per = {d + 1: float(ce[d] / counts[d]) for d in range(depth) if active[d]}
        return StepOut({"mtp_loss": sum(per.values()) / n_active, **{f"mtp_loss_{d}": v for d, v in per.items()}},
                       {"rows": float(counts.sum())})

    def validate(self) -> dict[str, float] | None:
        if not self.has_val:
            return None
        cfg = self.cfg
        m = mtp_eval(self.model, self.inp.frozen, self.val, cfg.mtp_val_drafts, cfg.mtp_rows, cfg.seed + 1) if self.inp.rank == 0 else None
        if self.inp.world > 1:
            box = [m]
            dist.broadcast_object_list(box, src=0)
            m = box[0]
        return m

    def checkpoint_extra(self) -> dict[str, Any]:
        return {}

    def restore_extra(self, payload: dict[str, Any]) -> None:
        pass

    def phase_steps(self) -> list[int]:
        return []

    def enter_phase(self, step: int) -> dict[str, float]:
        return {}


def train_mtp(inp: MTPInputs) -> LoopResult:
    """Train (or resume) the MTP head to cfg.mtp_steps through the one loop (`trainer.run`): AdamW (0.9, 0.95),
    no weight decay, warmup + cosine to 0, clip `grad_clip` (1.0 when 0). `.selected()` is the best val τ head
    on rank 0."""
    return run(MTPTask(inp), train_spec(inp))


def train_spec(inp: MTPInputs) -> LoopSpec:
    cfg = inp.cfg
    return LoopSpec(total=cfg.mtp_steps, batch_seqs=cfg.mtp_batch_seqs, lr=cfg.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0,
                    warmup_ratio=cfg.warmup_ratio, min_lr_ratio=0.0, grad_clip=cfg.grad_clip or 1.0, seed=cfg.seed,
                    eval_every=cfg.mtp_eval_every, log_every=cfg.log_every, ckpt_every=cfg.ckpt_every,
                    keep_checkpoints=cfg.keep_checkpoints, prefetch=cfg.prefetch, ckpt_dir=inp.ckpt_dir,
                    resume_key=inp.resume_key, device=inp.device, rank=inp.rank, world=inp.world, logger=inp.logger,
                    stop=inp.stop)  # fmt: skip


MTP_CHECKPOINTS = "mtp_checkpoints"  # the MTP head's resumable checkpoints: ctx.work_dir / MTP_CHECKPOINTS
# The keys that change what MTP training computes (with the target, the features and the global batch).
_MTP_RESUME_KEYS = ("mtp_steps", "mtp_lr", "mtp_depth", "mtp_rows", "mtp_val_drafts", "max_seq_len", "seed",
                    "warmup_ratio", "grad_clip")


def mtp_branch(ctx, cfg: TrainConfig, info: dict[str, Any], free_bytes: FreeBytes) -> Branch:
    """The mtp drafter's branch (a `trainer.Branch`): the target's native MTP layer serves (nothing to train), or
    the MiMo-form head trains on every rank (resuming from ctx.work_dir/mtp_checkpoints) and rank 0 exports it
    to out_dir/mtp in vLLM's MiMo MTP format; metrics.json holds the `mtp` block."""
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head, wants_trained_head
    from draftforge.errors import StageError
    from draftforge.io import sha256_file, sha256_json
    from draftforge.train.features import open_features

    def marker(mtp: dict[str, Any] | None) -> dict[str, Any]:
        log.info("train: mtp head %s", "trained" if mtp else "native (the target's own MTP layer; nothing to train)")
        return {"target": info["name"], "target_fingerprint": info["fingerprint"], "drafter_type": "mtp",
                "mtp_source": "trained" if mtp else "native", "mtp": mtp}

    if not wants_trained_head(info):
        return Branch(None, None, lambda result, run: marker(None))
    if cfg.features == "online":
        raise StageError("drafter=mtp with train.features=online: the MTP head trains on the target's final-normed "
                         "last layer, which only the extract stage stores (offline); use train.features=offline "
                         "or drop mtp from `drafters`")
    device = open_device(ctx, cfg)
    train_src, val_src = open_features(ctx.input_dir("extract"), info, dtype=torch.float32)
    try:
        mtp_item(train_src, 0, 1)  # the store carries `last_hidden` (extract ran with an mtp drafter listed)
        head, copied = new_trained_head(info["hf_path"], init_from_target=True, seed=cfg.seed)
    except ValueError as exc:
        raise StageError(f"drafter=mtp: {ctx.input_marker('extract')}: {exc}") from None
    ckpt_dir = ctx.work_dir / MTP_CHECKPOINTS
    if ctx.is_rank0:  # once the head's size is known, before any write
        check_disk(ckpt_dir, ctx.out_dir, sum(p.numel() for p in head.parameters() if p.requires_grad), cfg, free_bytes)
    frozen = FrozenTargetHead.from_target(info["hf_path"], dtype=torch.float32, device=device)
    resume_key = sha256_json({"mtp": {k: getattr(cfg, k) for k in _MTP_RESUME_KEYS}, "target": info["fingerprint"],
                              "extract": sha256_file(ctx.input_marker("extract")),
                              "global_batch": cfg.mtp_batch_seqs * ctx.world_size, "init_layer": copied})
    inp = MTPInputs(cfg, head, frozen, train_src, val_src, ckpt_dir, resume_key, device, ctx.rank, ctx.world_size)
    task = MTPTask(inp)

    def finish(res: LoopResult | None, run: Any) -> dict[str, Any]:
        assert res is not None
        selected = f"best val_mtp_sim_tau at step {res.best['step']}" if res.best else "last"
        res.model.load_state_dict(res.selected())
        out = ctx.out_dir / "mtp"
        export_mimo_head(res.model.eval(), out, info["hf_path"], dtype=getattr(torch, cfg.export_dtype),
                         extra={"target": info["name"], "target_fingerprint": info["fingerprint"], "selected": selected,
                                "steps": res.total_steps, "init_layer": copied})
        if res.best:
            run.log_metrics({"best_val_mtp_sim_tau": res.best["val_mtp_sim_tau"]})
        h = res.history
        k = max(1, min(25, len(h) // 4))
        return marker({
            "dir": str(out), "format": "mimo", "selected": selected, "steps": res.total_steps, "seconds": res.seconds,
            "world_size": ctx.world_size, "global_batch": cfg.mtp_batch_seqs * ctx.world_size,
            "resumed_from": res.resumed_from, "init_from_target_layer": copied,
            "loss_first": sum(r["mtp_loss"] for r in h[:k]) / k if h else None,
            "loss_last": sum(r["mtp_loss"] for r in h[-k:]) / k if h else None,
            "best": res.best, "val_curve": res.evals,
        })  # fmt: skip

    return Branch(task, train_spec(inp), finish, label="train (mtp)", run_name=f"train/{info['name']}/mtp",
                  run_params=ctx.params)
