"""Config keys grouped by the drafter types that read them (torch-free).

A type lists the groups it never reads in its `DrafterType.ignores` (drafter/registry.py); config.stage_params
leaves them out of that type's branch params, so a change to one reruns only the branches that read it.
"""

from __future__ import annotations

# Read only by a DSpark branch: its heads' shapes and the confidence head's loss weight.
HEAD_KEYS = ("drafter.markov_rank", "drafter.confidence_head", "drafter.confidence_head_with_markov",
             "drafter.bonus_anchor", "train.confidence_loss_weight")
# Read only by an MTP branch: its head's training (train/mtp.py) and its chain's drafts per round.
MTP_KEYS = ("train.mtp_steps", "train.mtp_batch_seqs", "train.mtp_lr", "train.mtp_depth", "train.mtp_rows",
            "train.mtp_val_drafts", "train.mtp_eval_every", "evaluate.mtp_drafts")
# What the block drafters' loop reads and the MTP head's task never does (train/mtp.py reads its own mtp_*
# schedule); with the DSpark head keys, an MTP branch's ignores.
BLOCK_TRAIN_KEYS = ("train.epochs", "train.max_steps", "train.lr", "train.min_lr_ratio", "train.weight_decay",
                    "train.betas", "train.num_anchors", "train.loss_gamma", "train.batch_seqs", "train.init_from_target",
                    "train.init_layers", "train.eval_every", "train.val_num_anchors", "train.loss_vocab_chunk",
                    "train.init_from", "train.confidence_loss_weight", "train.replay_from", "train.replay_share",
                    "train.replay_rows")
