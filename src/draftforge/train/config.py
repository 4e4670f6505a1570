"""Typed config of the `train` stage (torch-free). Owned by the train stage.

Defaults are the published DFlash recipe as the reference training code (SpecForge's
`scripts/train_dflash.py`) runs it: AdamW lr 6e-4, cosine with 4% warmup, clip 1.0, 6 epochs,
512 anchors per sequence, max length 3072, bf16 on GPU, one sequence per rank per step.
CPU worlds scale num_anchors / max_steps down in their experiment file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from draftforge.errors import check


@dataclass
class TrainConfig:
    gpus: int = 0  # 0 = CPU (gloo, cpu_procs processes); N = torchrun over N GPUs (NCCL)
    cpu_procs: int = 1  # processes on the CPU (per node)
    # Nodes the job spans: a SLURM run only (one srun task per process, draftforge.launch; docs/cluster.md).
    # World = nodes x (gpus or cpu_procs); the global batch is batch_seqs x world.
    nodes: int = 1
    device: str = "auto"  # auto (cuda:LOCAL_RANK when CUDA exists and gpus > 0) | cpu | cuda
    # offline: read the extract stage's feature store. online: the target runs beside the drafter and
    # computes the tapped features of each batch from the curate shards (no extract stage, no store).
    features: str = "offline"
    epochs: int = 6
    max_steps: int = -1  # -1: run all epochs; otherwise stop (and schedule) at this many steps
    # Per-branch max_steps, by drafter name ({dflash_aw: 3000}): a listed branch trains (and schedules) that many
    # steps instead of max_steps, so one drafter can train longer without the others paying for it. A command-line
    # `train.max_steps=` wins over it for every branch. Resolved when the config is composed (config.compose);
    # stage params and resume keys see only the resolved max_steps.
    branch_max_steps: Dict[str, int] = field(default_factory=dict)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    # torch's AdamW defaults, which the reference trainer uses (SpecForge `specforge/optimizer.py`
    # builds `torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)`, betas not set). No
    # measurement here has preferred another value.
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    num_anchors: int = 512  # anchors per sequence, re-drawn each epoch
    # Slot weight w_k = exp(-(k-1)/gamma). None: by block size (`train.loss.default_gamma`: 7 / 5 / 4
    # for B = 16 / 10 / 8, the DFlash paper's values, which SpecForge's --loss-decay-gamma help repeats).
    loss_gamma: Optional[float] = None
    max_seq_len: int = 3072  # longer sequences are truncated
    # Sequences per rank per optimizer step; the global batch is batch_seqs x ranks (as the reference
    # trainer's per-GPU --batch-size), so adding GPUs adds data per step and never refuses a world size.
    batch_seqs: int = 1
    init_from_target: bool = True  # warm start draft layers from the target's last layers
    init_layers: Optional[List[int]] = None  # target layers to copy (None: the last num_layers)
    attn_impl: str = "auto"  # auto (flex on CUDA, dense SDPA mask on CPU) | flex | sdpa
    # "" = bfloat16 autocast on CUDA, float32 on CPU; "auto" = bfloat16 autocast on CUDA and on CPUs with
    # native bf16 (AVX512-BF16 / AMX), else float32; or a dtype name
    compute_dtype: str = ""
    compile: bool = False  # torch.compile the draft layers (CUDA)
    log_every: int = 10
    eval_every: int = 100  # steps between val evaluations (and at the end)
    val_max_seqs: int = 64  # val sequences evaluated (first N of the val split)
    val_num_anchors: int = 64  # anchors per val sequence (fixed seed, same each eval)
    ckpt_every: int = 200  # steps between resumable checkpoints in work_dir (and at the end)
    keep_checkpoints: int = 2
    prefetch: int = 2  # batches collated ahead in a background thread
    export_dtype: str = "bfloat16"  # dtype of the exported drafter weights
    dist_timeout_min: int = 60
    seed: int = 0
    # MTP head (MiMo form, one Qwen2 layer) for targets without native MTP layers: the branch of a drafter of
    # type mtp (conf/drafter/mtp.yaml) trains it from the same features (extract then also stores the
    # final-normed last layer, `drafter.settings.needs_last_layer`). Loss: CE of depths 1..mtp_depth applied
    # recursively, on up to mtp_rows supervised rows per sequence and depth. Every rank trains (global batch =
    # mtp_batch_seqs x ranks, as batch_seqs for the drafter); checkpoints every ckpt_every steps in
    # work_dir/mtp_checkpoints.
    mtp_steps: int = 2000
    mtp_batch_seqs: int = 1  # sequences per rank per MTP step
    mtp_lr: float = 1e-3
    mtp_depth: int = 2
    mtp_rows: int = 256
    mtp_val_drafts: int = 3  # val: per-depth accuracy and simulated τ of this many recursive drafts
    mtp_eval_every: int = 500
    # DSpark drafters: BCE of the confidence head vs the analytic acceptance 1 - tv
    confidence_loss_weight: float = 1.0
    loss_vocab_chunk: int = 8192  # vocabulary columns per chunk of the fp32 distribution objective
    init_from: str = ""  # warm start from a trained DFlash drafter folder (config.json + model.safetensors)
    # On-policy replay (block drafters; docs/architecture.md, "On-policy replay"). replay_from: 0 = off; else
    # the fraction of the run's steps after which the current drafter walks `replay_rows` train rows (spread
    # evenly over the split) as the engine's T = 0 chain decode would, and from then on replay_share of each
    # walked row's num_anchors are drawn from the positions where its drafts were rejected (the rest uniform).
    replay_from: float = 0.0
    replay_share: float = 0.5
    replay_rows: int = 256

    def __post_init__(self) -> None:
        check(self.gpus >= 0, "train.gpus", f"{self.gpus} must be >= 0")
        check(self.cpu_procs >= 1, "train.cpu_procs", f"{self.cpu_procs} must be >= 1")
        check(self.nodes >= 1, "train.nodes", f"{self.nodes} must be >= 1")
        check(self.device in ("auto", "cpu", "cuda"), "train.device", f"{self.device!r}: use one of auto, cpu, cuda")
        check(self.lr > 0, "train.lr", f"{self.lr} must be > 0")
        check(self.max_steps == -1 or self.max_steps >= 1, "train.max_steps", f"{self.max_steps}: use -1 (all epochs) or >= 1")
        bad = {k: v for k, v in self.branch_max_steps.items() if not (v == -1 or v >= 1)}
        check(not bad, "train.branch_max_steps", f"{bad}: each value must be -1 (all epochs) or >= 1")
        check(self.batch_seqs >= 1, "train.batch_seqs", f"{self.batch_seqs} must be >= 1")
        check(self.num_anchors >= 1, "train.num_anchors", f"{self.num_anchors} must be >= 1")
        check(0 <= self.warmup_ratio < 1, "train.warmup_ratio", f"{self.warmup_ratio} must be in [0, 1)")
        check(self.mtp_steps >= 1, "train.mtp_steps", f"{self.mtp_steps} must be >= 1")
        check(self.mtp_batch_seqs >= 1, "train.mtp_batch_seqs", f"{self.mtp_batch_seqs} must be >= 1")
        check(self.mtp_lr > 0, "train.mtp_lr", f"{self.mtp_lr} must be > 0")
        check(self.mtp_depth >= 1, "train.mtp_depth", f"{self.mtp_depth} must be >= 1")
        check(self.mtp_rows >= 1, "train.mtp_rows", f"{self.mtp_rows} must be >= 1")
        check(self.mtp_val_drafts >= 1, "train.mtp_val_drafts", f"{self.mtp_val_drafts} must be >= 1")
        check(self.mtp_eval_every >= 1, "train.mtp_eval_every", f"{self.mtp_eval_every} must be >= 1")
        check(self.replay_from == 0 or 0 < self.replay_from < 1, "train.replay_from",
              f"{self.replay_from}: use 0 (off) or a fraction of the steps in (0, 1)")
        check(0 <= self.replay_share <= 1, "train.replay_share", f"{self.replay_share} must be in [0, 1]")
        check(self.replay_rows >= 1, "train.replay_rows", f"{self.replay_rows} must be >= 1")

