"""The block drafters' task in the one training loop (train/trainer.py): DFlash / DSpark blocks, the decayed
CE or the distribution objective (train/dspark_loss.py), block val metrics, warm starts.

Distributed invariant: each rank takes `batch_seqs` sequences per step (global batch = batch_seqs x
world); the loss is normalized by the *global* sum of valid-slot weights (summed over ranks in the
loop's one per-step all-reduce) and the loop sums the gradients over ranks, so W ranks of b sequences
compute exactly the gradient one process computes on the same W*b sequences.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftforge.drafter.config import DFlashConfig
from draftforge.drafter.dspark import DSparkDrafter, is_dspark
from draftforge.drafter.model import DFlashDrafter
from draftforge.drafter.registry import exported_type, model_class
from draftforge.drafter.vocab import choose_draft_vocab, coverage, target_to_draft
from draftforge.train.config import TrainConfig
from draftforge.train.data import Batch, FeatureSource, collate, draw_anchors, truncate
from draftforge.train.dspark_loss import analytic_stats, check_weights, objective, summarize_analytic, target_lse
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loss import BlockOutputs, block_losses, compile_loss, slot_stats, slot_weights, summarize
from draftforge.train.lse_cache import TargetLseCache
from draftforge.train.replay import ReplayTable, build_table, draw_replay_anchors
from draftforge.train.trainer import LoopResult, LoopSpec, Pending, StepOut, all_reduce, lr_lambda, run

__all__ = ["TrainInputs", "TrainResult", "BlockTask", "train", "lr_lambda"]

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
    # (D,) the draft vocabulary (`draft_vocab_for`) when dcfg.draft_vocab_size = D > 0; a resumed run's
    # checkpoint carries the same ids (they depend only on the train split).
    draft_ids: torch.Tensor | None = None
    stop: Any = None  # a train.stop.StopRequest: asked once per step whether to stop after it (None: never)


TrainResult = LoopResult  # .model holds the last weights, .best_state (rank 0) the best val step's


def global_batch(cfg: TrainConfig, world: int) -> int:
    """Sequences per optimizer step over all ranks."""
    return cfg.batch_seqs * max(1, world)


def total_steps(cfg: TrainConfig, n_seq: int, world: int = 1) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps)."""
    per_epoch = -(-n_seq // global_batch(cfg, world))
    total = cfg.max_steps if cfg.max_steps > 0 else per_epoch * cfg.epochs
    return per_epoch, total


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


def convention(dcfg: DFlashConfig) -> tuple[int, int]:
    """(first predicting slot, prediction offset): DFlash (1, 0); DSpark per its bonus_anchor."""
    return dcfg.first_slot, dcfg.pred_offset


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
    weights = check_weights(dict(loss_weights) if loss_weights else dict(exported_type(dcfg.ARCHITECTURE).default_loss_weights))
    if not is_dspark(dcfg) and weights == {"ce": 1.0} and not acceptance_weighting:
        return None
    conf = cfg.confidence_loss_weight if (is_dspark(dcfg) and dcfg.enable_confidence_head) else 0.0
    return Objective(weights, conf, cfg.loss_vocab_chunk, acceptance_weighting)


def dist_block_losses(model, h: torch.Tensor, head: FrozenTargetHead, batch: Batch, weights: torch.Tensor,
                      obj: Objective, lse_cache: TargetLseCache | None = None) -> BlockOutputs:
    """Valid slots through the distribution objective (+ Markov bias and confidence for DSpark)."""
    S, N, B = batch.valid.shape
    flat = batch.valid.reshape(-1)
    hv = h.reshape(S * N * B, -1)[flat]
    rows, targets = drafted_rows(model, head, batch.targets)
    y = targets.reshape(-1)[flat]  # (M,) row of `rows`, -1 outside a draft vocabulary
    prev = batch.prev_ids.reshape(-1)[flat]
    w_row = weights.to(h.device)[None, None, :].expand(S, N, B).reshape(-1)[flat]
    ht = t_index = None
    if batch.last is not None:  # the target's state before each row's position, once per distinct (sequence, position)
        k = torch.arange(B, device=h.device)
        T = batch.last.shape[1]
        pos = (batch.anchors[:, :, None] + k + batch.pred_offset - 1).clamp(0, T - 1)  # (S, N, B)
        seq = torch.arange(S, device=h.device)[:, None, None].expand(S, N, B)
        distinct, t_index = torch.unique(seq.reshape(-1)[flat] * T + pos.reshape(-1)[flat], return_inverse=True)  # (U,), (M,)
        ht = batch.last[distinct // T, distinct % T].to(hv.dtype)  # (U, H)
    lse_full = None  # (U,) the target's normaliser over its whole vocabulary, needed with a draft vocabulary
    if ht is not None and rows is not head.lm_head:
        cached = lse_cache is not None and batch.seq_ids is not None
        lse_full = lse_cache.lookup(batch.seq_ids, distinct, T, ht.dtype) if cached else target_lse(ht, head.lm_head)
    raw = model
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
    out = objective(hv, rows, y, w_row, obj.weights, ht=ht, e=e, w2=w2, conf_logit=conf_logit,
                    conf_weight=obj.conf_weight, chunk=obj.chunk, reach=reach, t_index=t_index, lse_full=lse_full)
    correct = torch.zeros(S * N * B, dtype=torch.bool, device=h.device)
    correct[flat] = out.hits
    res = BlockOutputs(out.weighted_sum, out.weight_sum, correct.view(S, N, B), batch.valid)
    res.extra = out  # type: ignore[attr-defined]  (analytic val metrics)
    return res


def drafted_rows(model: torch.nn.Module, head: FrozenTargetHead, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head the drafter drafts with and each target token's row of it: the target's whole head (rows =
    token ids), or a draft vocabulary's D rows (row of each token, -1 outside; docs/architecture.md, "Draft
    vocabulary")."""
    if not model.cfg.draft_vocab_size:
        return head.lm_head, targets
    t2d = target_to_draft(model.draft_ids, head.lm_head.shape[0])
    return model.draft_head.to(head.lm_head.dtype), t2d[targets]


def forward_batch(model: torch.nn.Module, head: FrozenTargetHead, batch: Batch, weights: torch.Tensor, attn_impl: str | None,
                  obj: Objective | None = None, lse_cache: TargetLseCache | None = None):
    block_embeds = head.embed_ids(batch.block_ids).float()  # (S, N*B, H)
    h = model(batch.tapped, block_embeds, batch.anchors, attn_impl)
    if obj is not None:
        return dist_block_losses(model, h, head, batch, weights, obj, lse_cache)
    rows, targets = drafted_rows(model, head, batch.targets)
    return block_losses(h, rows, targets, batch.valid, weights)


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
    all_reduce(sums, inp.world)
    all_reduce(loss_sums, inp.world)
    metrics = {f"val_{k}": v for k, v in summarize(sums.cpu(), B, first).items()}
    if obj is not None and obj.needs_target:
        if ana is None:  # this rank had no rows: zeros keep the all-reduce in step
            ana = analytic_stats(torch.zeros(0, device=inp.device), None, torch.zeros(0, dtype=torch.long, device=inp.device),
                                 torch.zeros(0, dtype=torch.long, device=inp.device), 0, n_draft)
        all_reduce(ana, inp.world)
        with_conf = is_dspark(dcfg) and dcfg.enable_confidence_head
        metrics.update({f"val_{k}": v for k, v in summarize_analytic(ana.cpu(), n_draft, with_conf).items()})
    metrics["val_loss"] = float(loss_sums[0] / loss_sums[1]) if loss_sums[1] > 0 else float("nan")
    metrics["val_blocks"] = float(sums[-1])
    return metrics


def draft_vocab_for(source: FeatureSource, dcfg: DFlashConfig) -> tuple[torch.Tensor | None, float]:
    """The draft vocabulary of a drafter config (None without one) and the share of the source's supervised
    tokens it covers: the D most frequent of them (drafter/vocab.py)."""
    if not dcfg.draft_vocab_size:
        return None, 1.0
    counts = source.label_counts(dcfg.vocab_size)
    ids = choose_draft_vocab(counts, dcfg.draft_vocab_size)
    return ids, coverage(counts, ids)


def build_model(inp: TrainInputs) -> DFlashDrafter:
    torch.manual_seed(inp.cfg.seed)
    model = model_class(inp.dcfg.ARCHITECTURE)(inp.dcfg, attn_impl=inp.cfg.attn_impl)
    if inp.dcfg.draft_vocab_size:
        if inp.draft_ids is None or inp.draft_ids.shape != (inp.dcfg.draft_vocab_size,):
            raise ValueError(f"drafter.draft_vocab_size={inp.dcfg.draft_vocab_size}: TrainInputs.draft_ids must hold "
                             "that many ids (draft_vocab_for)")
        model.set_draft_vocab(inp.draft_ids, inp.head.lm_head.cpu())
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
    from draftforge.drafter.config import read_exported_config
    from draftforge.drafter.export import DRAFT_VOCAB_NAMES, load_weights
    from draftforge.errors import StageError

    src_cfg = read_exported_config(directory)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "target_layer_ids", "layer_types", "vocab_size")
    diff = [k for k in keys if getattr(src_cfg, k) != getattr(model.cfg, k)]
    if diff:
        raise StageError(f"train.init_from={directory}: drafter shape differs in {diff}")
    tensors = load_weights(Path(directory) / "model.safetensors")
    own = model.state_dict()
    fresh = ("markov_head.", "confidence_head.", *DRAFT_VOCAB_NAMES)  # heads and this run's draft vocabulary
    backbone = {k: v.to(own[k].dtype) for k, v in tensors.items() if k in own and not k.startswith(fresh)}
    missing = [k for k in own if not k.startswith(fresh) and k not in backbone]
    if missing:
        raise StageError(f"train.init_from={directory}: missing {missing[:4]}")
    model.load_state_dict(backbone, strict=False)




class BlockTask:
    """The block drafters (DFlash, DSpark) as a `trainer.TrainTask`: a step's batch is `batch_seqs` sequences with
    `num_anchors` blocks each (anchors drawn from (seed, epoch, sequence)); its loss is the weighted CE (or the
    distribution objective) summed over this rank's valid slots ÷ the global weight sum."""

    select = "val_sim_tau"

    def __init__(self, inp: TrainInputs) -> None:
        cfg, dcfg = inp.cfg, inp.dcfg
        self.inp, self.name, self.n_train = inp, "train", len(inp.train_source)
        self.dtype = compute_dtype(cfg, inp.device)
        self.first = convention(dcfg)[0]
        self.weights = slot_weights(dcfg.block_size, cfg.loss_gamma, self.first).to(inp.device)  # (B,)
        self.obj = make_objective(cfg, dcfg, inp.loss_weights, inp.acceptance_weighting)
        self.model = build_model(inp)
        if cfg.compile:  # per layer: the mask is built outside the compiled regions
            for layer in self.model.layers:
                layer.compile()
            compile_loss()
        # On-policy replay: the table is built before step `replay_at` (trainer phase boundary) and read by every
        # later batch; None until then (a resumed run past it takes the checkpoint's).
        self.replay_at = replay_step(cfg, total_steps(cfg, self.n_train, inp.world)[1])
        self.replay: ReplayTable | None = None
        # With a draft vocabulary and stored features, each training position's target normaliser is computed once
        # and read back at later epochs (train/lse_cache.py); online features are recomputed, so not cached.
        epochs = total_steps(cfg, self.n_train, inp.world)[1] * global_batch(cfg, inp.world) / max(1, self.n_train)
        cached = self.obj is not None and self.obj.needs_target and dcfg.draft_vocab_size > 0 and epochs > 1
        self.lse_cache = (TargetLseCache(inp.head.lm_head, inp.train_source, cfg.max_seq_len, self.dtype)
                          if cached and inp.train_source.stored_features else None)  # fmt: skip

    def batch(self, seqs: list[int], step: int, epoch: int) -> Batch:
        cfg, dcfg = self.inp.cfg, self.inp.dcfg
        items = [truncate(self.inp.train_source[i], cfg.max_seq_len) for i in seqs]
        table = self.replay  # set only between prefetch phases: no batch of a step >= replay_at is built without it
        if table is None:
            anchors = [draw_anchors(it[1], cfg.num_anchors, cfg.seed, epoch, i) for it, i in zip(items, seqs)]
        else:
            anchors = [draw_replay_anchors(it[1], table.rejected(i), cfg.num_anchors, cfg.replay_share, cfg.seed, epoch, i)
                       for it, i in zip(items, seqs)]  # fmt: skip
        batch = collate(items, anchors, dcfg.block_size, dcfg.mask_token_id, self.dtype, *convention(dcfg))
        batch.seq_ids = torch.tensor(seqs, dtype=torch.int64)
        return batch.pin_memory() if self.inp.device.type == "cuda" else batch

    def forward(self, batch: Batch) -> Pending:
        """sums = [weight sum, weighted CE sum, context tokens, block tokens] of this rank's valid slots."""
        batch = batch.to(self.inp.device)
        with _autocast(self.inp.device, self.dtype):
            out = forward_batch(self.model, self.inp.head, batch, self.weights, self.inp.cfg.attn_impl, self.obj,
                                self.lse_cache)  # fmt: skip
        n_blk = batch.valid[..., self.first].sum().double() * self.inp.dcfg.block_size
        sums = torch.stack([out.weight_sum.double(), out.weighted_ce_sum.detach().double(),
                            torch.tensor(float(batch.n_tokens), dtype=torch.float64, device=n_blk.device), n_blk])
        return Pending(sums, out)

    def backward(self, pending: Pending, sums: torch.Tensor) -> StepOut:
        w_global = sums[0].float().clamp_min(1e-6)
        (pending.state.weighted_ce_sum / w_global).backward()  # this rank's part of the global mean
        return StepOut({"loss": float(sums[1] / w_global)}, {"ctx_tokens": float(sums[2]), "block_tokens": float(sums[3])})

    def validate(self) -> dict[str, float] | None:
        if self.inp.val_source is None:
            return None
        return evaluate(self.model, self.inp, self.dtype)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"dcfg": self.inp.dcfg.to_dict(), **({"replay": self.replay.state()} if self.replay is not None else {})}

    def restore_extra(self, payload: dict[str, Any]) -> None:
        if "replay" in payload:
            self.replay = ReplayTable.from_state(payload["replay"])

    def phase_steps(self) -> list[int]:
        return [self.replay_at] if self.replay_at is not None else []

    @torch.no_grad()
    def enter_phase(self, step: int) -> dict[str, float]:
        """Build the replay table with the current weights (eval mode, no grad; every rank walks its share)."""
        if self.replay is not None:  # restored from a checkpoint written after it was built
            return {}
        inp, dcfg = self.inp, self.inp.dcfg
        first, offset = convention(dcfg)
        obj = self.obj if is_dspark(dcfg) else None  # DFlash: the argmax over the drafted rows; DSpark: with its Markov bias
        was_training = self.model.training
        self.model.eval()

        def score(batch: Batch) -> BlockOutputs:
            batch = batch.to(inp.device)
            with _autocast(inp.device, self.dtype):
                return forward_batch(self.model, inp.head, batch, self.weights, inp.cfg.attn_impl, obj)

        rows = val_indices(self.n_train, inp.cfg.replay_rows)
        self.replay = build_table(score, inp.train_source, rows, step, block_size=dcfg.block_size,
                                  mask_token_id=dcfg.mask_token_id, first_slot=first, pred_offset=offset,
                                  max_seq_len=inp.cfg.max_seq_len, dtype=self.dtype, device=inp.device,
                                  rank=inp.rank, world=inp.world)  # fmt: skip
        self.model.train(was_training)
        return {"replay_step": float(step), **self.replay.metrics}


def replay_step(cfg: TrainConfig, total: int) -> int | None:
    """The step before which the replay table is built (train.replay_from of the run's steps); None: off."""
    return round(cfg.replay_from * total) if cfg.replay_from > 0 else None


def loop_spec(inp: TrainInputs, total: int) -> LoopSpec:
    cfg = inp.cfg
    return LoopSpec(total=total, batch_seqs=cfg.batch_seqs, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                    warmup_ratio=cfg.warmup_ratio, min_lr_ratio=cfg.min_lr_ratio, grad_clip=cfg.grad_clip, seed=cfg.seed,
                    eval_every=cfg.eval_every, log_every=cfg.log_every, ckpt_every=cfg.ckpt_every,
                    keep_checkpoints=cfg.keep_checkpoints, prefetch=cfg.prefetch, ckpt_dir=inp.ckpt_dir,
                    resume_key=inp.resume_key, device=inp.device, rank=inp.rank, world=inp.world, logger=inp.logger,
                    stop=inp.stop)  # fmt: skip


def train(inp: TrainInputs) -> TrainResult:
    """Train (or resume) a block drafter to cfg's total steps through the one loop (`trainer.run`)."""
    if inp.cfg.batch_seqs < 1:
        raise ValueError(f"train.batch_seqs={inp.cfg.batch_seqs}: need >= 1 sequence per rank")
    _, total = total_steps(inp.cfg, len(inp.train_source), inp.world)
    return run(BlockTask(inp), loop_spec(inp, total))
