"""Typed config of the `train` stage (torch-free). Owned by the train stage.

Defaults are the published DFlash recipe (AdamW 6e-4, cosine with 4% warmup, clip 1.0, 6 epochs,
512 anchors, max length 3072, bf16 on GPU). CPU worlds scale num_anchors / max_steps down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class TrainConfig:
    gpus: int = 0  # 0 = CPU (gloo, cpu_procs processes); N = torchrun over N GPUs (NCCL)
    cpu_procs: int = 1
    device: str = "auto"  # auto (cuda:LOCAL_RANK when CUDA exists and gpus > 0) | cpu | cuda
    epochs: int = 6
    max_steps: int = -1  # -1: run all epochs; otherwise stop (and schedule) at this many steps
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    num_anchors: int = 512  # anchors per sequence, re-drawn each epoch
    loss_gamma: float = 7.0  # slot weight w_k = exp(-(k-1)/gamma)
    max_seq_len: int = 3072  # longer sequences are truncated
    batch_seqs: int = 1  # global batch in sequences per optimizer step (split across ranks)
    init_from_target: bool = True  # warm start draft layers from the target's last layers
    init_layers: Optional[List[int]] = None  # target layers to copy (None: the last num_layers)
    attn_impl: str = "auto"  # auto (flex on CUDA, dense SDPA mask on CPU) | flex | sdpa
    compute_dtype: str = ""  # "" = bfloat16 autocast on CUDA, float32 on CPU
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
    # MTP head (MiMo form, one Qwen2 layer) for targets without native MTP layers, trained after the
    # drafter from the same features (extract then also stores the last layer). Loss: CE of depths
    # 1..mtp_depth applied recursively, on up to mtp_rows supervised rows per sequence and depth.
    mtp: bool = False
    mtp_steps: int = 2000
    mtp_lr: float = 1e-3
    mtp_depth: int = 2
    mtp_rows: int = 256
    mtp_val_drafts: int = 3  # val: per-depth accuracy and simulated τ of this many recursive drafts
    mtp_eval_every: int = 500
