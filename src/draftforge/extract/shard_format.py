"""On-disk format of extracted features: one safetensors file per shard plus index.json (the marker).

Shard tensors (N = tokens in the shard, S = sequences, D = n_taps·H):
  hidden        (N, D)        bfloat16 | float32 | float8_e4m3fn; row t = concat over taps of the
                              output of decoder layer L (HF hidden_states[L+1]) at token t
  hidden_scale  (N, n_taps)   float32, fp8 only: hidden[t, k·H:(k+1)·H] ≈ q · hidden_scale[t, k]
  input_ids     (N,)          int32
  loss_mask     (N,)          uint8 (1 = supervised assistant token)
  offsets       (S+1,)        int64; sequence s is tokens offsets[s]:offsets[s+1]
  seq_index     (S,)          int64; row of the sequence in its split (curate file order)
  last_hidden   (N, H)        optional (when a consumer needs the target's next-token distribution):
                              the target's final-normed last-layer state (the LM head's input);
                              storage dtype, bfloat16 when that is fp8
Invariant: a shard file either does not exist under its final name or is complete (temp + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from draftforge.io import atomic_path

FORMAT = "draftforge-extract/1"
INDEX_NAME = "index.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
STORAGE_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
BYTES_PER_VALUE = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
SAFETENSORS_DTYPE = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
}  # fmt: skip
WRITE_CHUNK = 64 << 20


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def bytes_per_token(feature_dim: int, n_taps: int, storage_dtype: str) -> int:
    """Stored bytes per token: hidden (+ fp8 scales) + input_ids int32 + loss_mask uint8."""
    scale = 4 * n_taps if storage_dtype == "float8_e4m3fn" else 0
    return feature_dim * BYTES_PER_VALUE[storage_dtype] + scale + 4 + 1


def encode_hidden(hidden: torch.Tensor, n_taps: int, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, n_taps·H) float → (stored (N, n_taps·H), scales (N, n_taps) float32 or None).

    fp8: one scale per token and tap (layers differ in magnitude by orders), scale = amax / 448, so
    every value is finite and the largest one of each (token, tap) row maps to ±448.
    """
    if storage_dtype != "float8_e4m3fn":
        return hidden.to(STORAGE_TORCH_DTYPES[storage_dtype]), None
    n = hidden.shape[0]
    rows = hidden.float().view(n, n_taps, -1)  # (N, n_taps, H)
    scale = rows.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # (N, n_taps)
    q = (rows / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, -1), scale


def decode_hidden(stored: torch.Tensor, scale: torch.Tensor | None, n_taps: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of encode_hidden: (N, n_taps·H) stored → (N, n_taps·H) in `dtype`."""
    if scale is None:
        return stored.to(dtype)
    n = stored.shape[0]
    rows = stored.float().view(n, n_taps, -1) * scale.float().unsqueeze(-1)
    return rows.view(n, -1).to(dtype)


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors header: u64 length + JSON (tensors in the given order), space-padded to 8 bytes."""
    meta: dict[str, object] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        meta[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_shard(path: str | Path, tensors: dict[str, torch.Tensor], fsync: bool = True) -> tuple[str, int]:
    """Write a shard atomically in safetensors format; returns (sha256, bytes).

    Streams each tensor's bytes from host memory and hashes them in the same pass (no re-read).
    The bytes depend only on the tensors and their order (deterministic header), so equal inputs give
    equal checksums whatever the world size.
    """
    digest = hashlib.sha256()
    size = 0
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            for block in _blocks(tensors):
                fh.write(block)
                digest.update(block)  # releases the GIL for large blocks
                size += len(block)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    return digest.hexdigest(), size


def _blocks(tensors: dict[str, torch.Tensor]):
    yield _header(tensors)
    for t in tensors.values():
        if t.device.type != "cpu":
            raise ValueError("write_shard needs host tensors")
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()  # little-endian host bytes, no copy
        for start in range(0, raw.shape[0], WRITE_CHUNK):
            yield memoryview(raw[start : start + WRITE_CHUNK])
