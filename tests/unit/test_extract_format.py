"""Shard file format: our streaming writer produces standard safetensors, hashed in one pass."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftforge.extract.shard_format import decode_hidden, encode_hidden, write_shard


def _tensors(storage: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    h = torch.randn(9, 2 * 16) * torch.tensor([0.01] * 16 + [300.0] * 16)  # taps of very different scale
    enc, scale = encode_hidden(h, 2, storage)
    out = {"hidden": enc, "input_ids": torch.arange(9, dtype=torch.int32), "loss_mask": torch.ones(9, dtype=torch.uint8),
           "offsets": torch.tensor([0, 4, 9]), "seq_index": torch.tensor([3, 1])}  # fmt: skip
    if scale is not None:
        out["hidden_scale"] = scale
    return out


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float8_e4m3fn"])
def test_write_shard_is_standard_safetensors(tmp_path, storage):
    tensors = _tensors(storage)
    sha, size = write_shard(tmp_path / "a.safetensors", tensors)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert sha == hashlib.sha256(data).hexdigest() and size == len(data)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8))
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "draftforge-extract/1"}
        assert f.get_slice("hidden")[2:5].shape == (3, 32)
    sha2, _ = write_shard(tmp_path / "b.safetensors", _tensors(storage))
    assert sha2 == sha  # deterministic bytes
    assert not list(tmp_path.glob(".*tmp"))


def test_fp8_scales_per_token_and_tap():
    h = torch.randn(50, 3 * 64) * torch.tensor([1e-3] * 64 + [1.0] * 64 + [1e3] * 64)
    q, scale = encode_hidden(h, 3, "float8_e4m3fn")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 3)
    back = decode_hidden(q, scale, 3, torch.float32)
    rows, err = h.view(50, 3, 64), (back - h).abs().view(50, 3, 64)
    assert (err.amax(-1) <= rows.abs().amax(-1) / 8).all()  # e4m3: 3 mantissa bits, per-row scale
    assert torch.isfinite(back).all()


def test_disk_estimate_matches_design_scale_check():
    """docs/architecture.md ("Layer taps"): Qwen3-8B, 5 taps, bf16 ≈ 40 KiB/token; fp8 halves it (+ per-tap scales)."""
    import numpy as np

    from draftforge.extract.plan import ShardSpec
    from draftforge.extract.preflight import check_disk, estimate_bytes
    from draftforge.extract.shard_format import bytes_per_token

    assert bytes_per_token(5 * 4096, 5, "bfloat16") == 40 * 1024 + 5
    assert bytes_per_token(5 * 4096, 5, "float8_e4m3fn") == 20 * 1024 + 20 + 5
    shard = ShardSpec(0, "train", np.arange(1000), np.full(1000, 1200))
    need = estimate_bytes([shard] * 800, 5 * 4096, 5, "bfloat16")  # 800K samples of 1.2K tokens
    assert 36e12 < need < 40e12
    assert check_disk(Path("/"), need, 1.05, lambda p: int(need * 1.1)) is None
    msg = check_disk(Path("/data"), need, 1.05, lambda p: 10 * 2**40)
    assert msg.startswith("/data: not enough disk for the features: need ~35.8 TiB") and "10.0 TiB is free" in msg
