"""Fixtures of the train tests: features from a real (tiny, random) target, in memory.

The per-sequence tuple is exactly the extract reader's: (input_ids (T,) int64, loss_mask (T,) uint8,
hidden (T, n_taps*H) float32) with hidden = concat over taps L of HF hidden_states[L+1].
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch

from draftforge.drafter.config import DFlashConfig
from draftforge.train.config import TrainConfig
from draftforge.train.data import InMemorySource
from draftforge.train.head import FrozenTargetHead
from draftforge.train.loop import TrainInputs


def load_target(info: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(info["hf_path"], dtype=torch.float32).eval()


@torch.no_grad()
def tapped_features(model, ids: torch.Tensor, taps: list[int]) -> torch.Tensor:
    """ids (T,) → (T, n_taps*H): outputs of decoder layers `taps` (HF hidden_states[L+1])."""
    out = model(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[t + 1][0] for t in taps], dim=-1).float()


def synthetic_items(info: dict, n_seq: int, seed: int = 0, min_len: int = 24, max_len: int = 48, prompt_len: int = 6, model=None):
    """Random byte-token sequences; loss mask covers everything after a short prompt."""
    model = model or load_target(info)
    taps = info["drafter"]["target_layer_ids"]
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n_seq):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(6, 262, (T,), generator=gen)
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[prompt_len:] = 1
        items.append((ids, mask, tapped_features(model, ids, taps)))
    return items


def with_last(info: dict, items, model=None):
    """items + the target's final-normed last layer (extract's `last_hidden`) as a 4th element."""
    model = model or load_target(info)
    out = []
    for ids, mask, taps in items:
        with torch.no_grad():
            out.append((ids, mask, taps, model(ids[None], output_hidden_states=True).hidden_states[-1][0]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank: int, world: int, port: int, worker: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(worker: Callable, world: int, *args) -> None:
    """worker(rank, world, *args) in `world` spawned processes joined in one gloo process group
    (`worker` must be a module-level function; results go through files)."""
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_entry, args=(world, free_port(), worker, args), nprocs=world, join=True, start_method="spawn")


def make_inputs(info: dict, cfg: TrainConfig, train_items, val_items, ckpt_dir: Path, rank: int = 0, world: int = 1, resume_key: str = "test") -> TrainInputs:
    from drafter_fixtures import drafter_of

    dcfg = DFlashConfig.from_target(info, drafter_of())  # tiny-random's drafter shape: 1 layer, block 8
    return TrainInputs(
        cfg=cfg,
        dcfg=dcfg,
        train_source=InMemorySource(train_items),
        val_source=InMemorySource(val_items) if val_items else None,
        head=FrozenTargetHead.from_target(info["hf_path"]),
        ckpt_dir=Path(ckpt_dir),
        resume_key=resume_key,
        rank=rank,
        world=world,
        target_hf_path=info["hf_path"],
    )


def write_extract_index(out_dir: Path, splits: dict, info: dict, fingerprint: str | None = None, taps: list[int] | None = None) -> Path:
    """An extract output (shards + index.json) in the extract stage's on-disk format, from tuples."""
    from draftforge.extract.shard_format import FORMAT, INDEX_NAME, encode_hidden, shard_name, write_shard
    from draftforge.io import write_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    taps = list(taps if taps is not None else info["drafter"]["target_layer_ids"])
    shards, agg = [], {}
    for split, items in splits.items():
        for part in (items[: len(items) // 2 or 1], items[len(items) // 2 or 1 :]):  # two shards per split
            if not part:
                continue
            ids = torch.cat([it[0] for it in part]).to(torch.int32)
            mask = torch.cat([it[1] for it in part]).to(torch.uint8)
            hidden, _ = encode_hidden(torch.cat([it[2] for it in part]), len(taps), "float32")
            offsets = torch.tensor([0] + [it[0].numel() for it in part]).cumsum(0)
            name = shard_name(len(shards))
            tensors = {"hidden": hidden, "input_ids": ids, "loss_mask": mask, "offsets": offsets,
                       "seq_index": torch.arange(len(part))}
            if all(len(it) > 3 for it in part):  # the target's last layer (a 4th element), as extract stores it
                tensors["last_hidden"] = torch.cat([it[3] for it in part]).float()
            sha, size = write_shard(out_dir / name, tensors)
            rec = {"file": name, "split": split, "n_seqs": len(part), "n_tokens": int(ids.numel()),
                   "n_loss_tokens": int(mask.sum()), "n_bytes": size, "sha256": sha}
            shards.append(rec)
            a = agg.setdefault(split, {"n_shards": 0, "n_seqs": 0, "n_tokens": 0, "n_loss_tokens": 0})
            a["n_shards"] += 1
            for k in ("n_seqs", "n_tokens", "n_loss_tokens"):
                a[k] += rec[k]
    index = {"format": FORMAT, "target_fingerprint": fingerprint or info["fingerprint"], "target_layer_ids": taps,
             "hidden_size": info["hidden_size"], "n_taps": len(taps), "feature_dim": len(taps) * info["hidden_size"],
             "storage_dtype": "float32", "splits": agg, "shards": shards,
             "n_seqs": sum(s["n_seqs"] for s in shards), "n_tokens": sum(s["n_tokens"] for s in shards),
             "n_bytes": sum(s["n_bytes"] for s in shards)}
    write_json(out_dir / INDEX_NAME, index)
    return out_dir


class StopAfter:
    """A train.stop.StopRequest that is requested from the n-th step it is asked about on (the loops ask once
    per optimizer step): a deterministic interruption at step n of this run."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.reason = "test"

    def requested(self) -> bool:
        self.left -= 1
        return self.left <= 0
