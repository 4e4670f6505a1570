"""The extract stage end to end in one process: values, dtypes, resume, disk preflight, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from draftforge.errors import StageError
from draftforge.extract.reader import FeatureReader
from draftforge.extract.stage import run_extract
from draftforge.io import read_json, write_json
from extract_fixtures import EXPERIMENT, LENGTHS, context, make_experiment

TAPS = [1, 2]  # tiny-random: 4 layers, 2 taps


def _run(root: Path, *extra: str, **kw):
    return run_extract(context(root, *extra), **kw)


def _reader(root: Path, info: dict, **kw) -> FeatureReader:
    return FeatureReader(root / EXPERIMENT / "extract", target_fingerprint=info["fingerprint"],
                         target_layer_ids=TAPS, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_target_info):
    """One uninterrupted float32 run: (root, index, input rows)."""
    root = tmp_path_factory.mktemp("xfull")
    rows = make_experiment(root, tiny_target_info, LENGTHS)
    return root, _run(root), rows


def test_index_records_contract(full_run, tiny_target_info):
    root, index, _ = full_run
    on_disk = read_json(root / EXPERIMENT / "extract" / "index.json")
    assert on_disk["shards"] == index["shards"]
    assert index["target_layer_ids"] == TAPS == tiny_target_info["drafter"]["target_layer_ids"]
    assert index["target_fingerprint"] == tiny_target_info["fingerprint"]
    assert index["feature_dim"] == 2 * 128 and index["storage_dtype"] == "float32"
    assert index["splits"]["train"]["n_seqs"] == 11 and index["splits"]["val"]["n_seqs"] == 3
    assert index["n_tokens"] == sum(sum(f) for fl in LENGTHS.values() for f in fl)
    assert {s["split"] for s in index["shards"]} == {"train", "val"}
    assert index["throughput"]["tokens_per_s_total"] > 0
    assert index["chat_template_kwargs"] == {}  # a manifest without a chat mode: the template's defaults


def test_index_carries_the_chat_mode_curate_rendered_in(tmp_path, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, {"train": [[12, 9]], "val": [[7]]},
                    chat_template_kwargs={"enable_thinking": False})
    assert _run(tmp_path)["chat_template_kwargs"] == {"enable_thinking": False}  # train reads it from here (offline)


def test_stored_vectors_equal_single_sequence_forward(full_run, tiny_target_info):
    root, _, rows = full_run
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_info["hf_path"], dtype=torch.float32).eval()
    model.set_attn_implementation("eager")
    reader = _reader(root, tiny_target_info, verify="open")
    by_ids = {split: {tuple(r.tolist()): r for r in rs} for split, rs in rows.items()}
    seen = 0
    for split in reader.splits:
        for ids, mask, hidden in reader.iter_sequences(split):
            assert ids.dtype == torch.int64 and mask.dtype == torch.uint8 and hidden.dtype == torch.float32
            assert tuple(ids.tolist()) in by_ids[split]
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True).hidden_states
            ref = torch.cat([hs[L + 1][0] for L in TAPS], dim=-1)  # layer id L = hidden_states[L+1]
            diff = (hidden - ref).abs().max().item()
            limit = 1e-5 if ids.shape[0] >= 16 else 1e-5 * ref.abs().max().item()  # see test_extract_capture
            assert diff <= limit, (split, ids.shape[0], diff)
            seen += 1
    assert seen == 14


@pytest.mark.parametrize("dtype,rel", [("bfloat16", 2**-8), ("float8_e4m3fn", 2**-3)])
def test_compact_storage_dtypes(tmp_path, full_run, tiny_target_info, dtype, rel):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    index = _run(tmp_path, f"extract.storage_dtype={dtype}")
    assert index["storage_dtype"] == dtype
    exact = list(_reader(full_run[0], tiny_target_info).iter_sequences("train"))
    got = list(_reader(tmp_path, tiny_target_info).iter_sequences("train"))
    for (i0, m0, h0), (i1, m1, h1) in zip(exact, got):
        assert torch.equal(i0, i1) and torch.equal(m0, m1)
        # error bound per (token, tap) row relative to that row's largest magnitude
        err = (h1 - h0).abs().view(h0.shape[0], 2, -1).amax(-1)
        scale = h0.abs().view(h0.shape[0], 2, -1).amax(-1)
        assert (err <= rel * scale).all()
    if dtype == "float8_e4m3fn":
        assert index["n_bytes"] < 0.3 * full_run[1]["n_bytes"]


def test_resume_recomputes_only_missing_shards(tmp_path, full_run, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    assert _run(tmp_path, stop_after=2) is None  # "killed" after two shards
    out = tmp_path / EXPERIMENT / "extract"
    assert not (out / "index.json").exists()
    shard_dir = next((tmp_path / EXPERIMENT / ".work" / "extract" / "shards").iterdir())
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shard_dir.glob("shard-*.safetensors")}
    assert len(first) == 2
    index = _run(tmp_path)
    tp = index["throughput"]
    assert tp["shards_resumed"] == 2 and tp["shards_computed"] == len(index["shards"]) - 2
    for name, stamp in first.items():  # untouched: not recomputed, not rewritten
        assert ((shard_dir / name).stat().st_ino, (shard_dir / name).stat().st_mtime_ns) == stamp
        assert os.path.samefile(shard_dir / name, out / name)  # hard link, no second copy
    assert index["shards"] == full_run[1]["shards"]  # same bytes as an uninterrupted run
    again = _run(tmp_path)  # a complete rerun computes nothing
    assert again["throughput"]["shards_computed"] == 0 and again["shards"] == index["shards"]


def test_disk_preflight_refuses_and_keeps_finished_shards(tmp_path, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    _run(tmp_path, stop_after=1)
    shard_dir = next((tmp_path / EXPERIMENT / ".work" / "extract" / "shards").iterdir())
    kept = sorted(p.name for p in shard_dir.iterdir())
    with pytest.raises(StageError, match=r"not enough disk for the features: need ~\d+\.\d KiB .* but 1000 B is free"):
        _run(tmp_path, free_bytes=lambda path: 1000)
    assert sorted(p.name for p in shard_dir.iterdir()) == kept
    index = _run(tmp_path, free_bytes=lambda path: 10**9)
    assert index["throughput"]["shards_resumed"] == 1


def test_corrupt_resumed_shard_is_recomputed(tmp_path, full_run, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    _run(tmp_path, stop_after=1)
    shard = next((tmp_path / EXPERIMENT / ".work" / "extract" / "shards").iterdir()) / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, wrong bytes
    shard.write_bytes(bytes(data))
    index = _run(tmp_path)
    assert index["throughput"]["shards_resumed"] == 0 and index["shards"] == full_run[1]["shards"]


def test_reader_refuses_mismatches(full_run, tiny_target_info):
    root, _, _ = full_run
    with pytest.raises(StageError, match=r"index\.json: features were extracted from target [0-9a-f]{12}, not the requested target 0{12}"):
        FeatureReader(root / EXPERIMENT / "extract", target_fingerprint="0" * 64, target_layer_ids=TAPS)
    with pytest.raises(StageError, match=r"tapped layers \[1, 2\] != requested target_layer_ids \[0, 2\]"):
        FeatureReader(root / EXPERIMENT / "extract", target_fingerprint=tiny_target_info["fingerprint"],
                      target_layer_ids=[0, 2])  # fmt: skip
    reader = _reader(root, tiny_target_info)
    assert reader.num_sequences("train") == 11 and reader.n_taps == 2 and reader.hidden_size == 128
    with pytest.raises(StageError, match="no split 'test'"):
        reader.num_tokens("test")
    plain = [tuple(x[0].tolist()) for x in reader.iter_sequences("train")]
    mixed = [tuple(x[0].tolist()) for x in reader.iter_sequences("train", shuffle=True, seed=3)]
    assert mixed != plain and sorted(mixed) == sorted(plain)
    halves = [[tuple(x[0].tolist()) for x in reader.iter_sequences("train", rank=r, world_size=2, shuffle=True, seed=3)]
              for r in (0, 1)]  # fmt: skip
    assert sorted(halves[0] + halves[1]) == sorted(plain) and not set(halves[0]) & set(halves[1])


def _copy_extract(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src / EXPERIMENT / "extract", dst / "extract")
    return dst / "extract"


def test_reader_refuses_missing_truncated_and_corrupt_shards(tmp_path, full_run, tiny_target_info):
    fp = tiny_target_info["fingerprint"]
    out = _copy_extract(full_run[0], tmp_path)
    shard = out / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # truncated
    with pytest.raises(StageError, match=r"shard-00001\.safetensors: \d+ bytes, index records \d+ \(truncated"):
        FeatureReader(out, target_fingerprint=fp, target_layer_ids=TAPS)
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0x01  # same size, one bit flipped
    shard.write_bytes(bytes(corrupt))
    with pytest.raises(StageError, match=r"shard-00001\.safetensors: sha256 differs"):
        FeatureReader(out, target_fingerprint=fp, target_layer_ids=TAPS, verify="open")
    lazy = FeatureReader(out, target_fingerprint=fp, target_layer_ids=TAPS, verify="lazy")
    with pytest.raises(StageError, match=r"shard-00001\.safetensors: sha256 differs"):
        list(lazy.iter_sequences("train"))
    with pytest.raises(StageError, match=r"shard-00001\.safetensors: sha256 differs"):
        lazy.check_shard(lazy.shards("train")[1])
    lazy.check_shard(lazy.shards("train")[0])  # intact shard passes
    shard.unlink()
    with pytest.raises(StageError, match=r"shard-00001\.safetensors: shard listed in index\.json is missing"):
        FeatureReader(out, target_fingerprint=fp, target_layer_ids=TAPS)


def test_stage_refuses_curate_for_another_target(tmp_path, tiny_target_info):
    make_experiment(tmp_path, tiny_target_info, LENGTHS)
    manifest = tmp_path / EXPERIMENT / "curate" / "manifest.json"
    write_json(manifest, {**json.loads(manifest.read_text()), "target_fingerprint": "f" * 64})
    with pytest.raises(StageError, match=r"manifest\.json: target_fingerprint ffffffffffff != target\.json"):
        _run(tmp_path)
    assert not (tmp_path / EXPERIMENT / "extract" / "index.json").exists()


def test_stage_refuses_bad_taps_in_target_json(tmp_path, tiny_target_info):
    bad = {**tiny_target_info, "drafter": {**tiny_target_info["drafter"], "target_layer_ids": [1, 4]}}
    make_experiment(tmp_path, bad, LENGTHS)
    with pytest.raises(StageError, match=r"target\.json: drafter\.target_layer_ids \[1, 4\] must be strictly"):
        _run(tmp_path)


def test_train_mtp_stores_the_last_layer(tmp_path, tiny_target_info):
    """An mtp drafter branch (trained head) → the same single last-layer mechanism as DSpark: the taps stay and
    the shards carry `last_hidden` (the final-normed last layer) as the train source's 4th element."""
    from draftforge.train.features import open_features

    make_experiment(tmp_path, tiny_target_info, {"train": [[20, 30]], "val": [[25]]})
    index = _run(tmp_path, "drafters=[dflash,mtp]")
    assert index["target_layer_ids"] == TAPS and index["meta"]["last_hidden"] is True
    train_src, _ = open_features(tmp_path / EXPERIMENT / "extract", tiny_target_info, dtype=torch.float32)
    ids, _, taps, last = train_src[0]
    assert taps.shape == (ids.numel(), 2 * 128) and last.shape == (ids.numel(), 128)


def test_last_layer_stored_when_a_dspark_drafter_trains(tmp_path, tiny_target_info):
    """A listed dspark drafter → shards carry last_hidden = the final-normed last layer (HF hidden_states[-1]),
    the train source yields it as a 4th element, and the plan key differs from a taps-only run."""
    from transformers import AutoModelForCausalLM

    from draftforge.train.features import open_features

    lengths = {"train": [[20, 9]], "val": [[12]]}
    make_experiment(tmp_path, tiny_target_info, lengths)
    index = _run(tmp_path, "drafters=[dflash,dspark]")
    assert index["meta"]["last_hidden"] is True
    train_src, val_src = open_features(tmp_path / EXPERIMENT / "extract", tiny_target_info, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_info["hf_path"], dtype=torch.float32).eval()
    model.set_attn_implementation("eager")
    for i in range(len(train_src)):
        ids, mask, hidden, last = train_src[i]
        with torch.no_grad():
            ref = model(ids[None], output_hidden_states=True).hidden_states[-1][0]
        assert torch.allclose(last, ref, atol=1e-4 * max(1.0, ref.abs().max().item())), i
    assert len(val_src[0]) == 4
