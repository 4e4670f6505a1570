"""Shard planning: a pure function of the inputs (never of the world size), token-budgeted, sorted."""

from __future__ import annotations

import numpy as np
import pytest

from draftforge.errors import StageError
from draftforge.extract.plan import InputReader, plan_extraction
from extract_fixtures import write_curate_shards

LENGTHS = {"train": [[37, 5, 60, 12, 12, 1, 44], [29, 3, 71, 18]], "val": [[33, 9, 21]]}


def _plan(d, **kw):
    args = dict(max_seq_len=64, tokens_per_shard=100, seqs_per_shard=3, sort_window=6)
    args.update(kw)
    return plan_extraction(d, ["train", "val"], **args)


def test_plan_covers_every_row_once_sorted_within_windows(tmp_path):
    write_curate_shards(tmp_path, lengths=LENGTHS)
    plan = _plan(tmp_path)
    for split, n_rows in (("train", 11), ("val", 3)):
        rows = np.concatenate([s.rows for s in plan.shards if s.split == split])
        assert sorted(rows.tolist()) == list(range(n_rows))
    for s in plan.shards:
        assert s.n_seqs <= 3 and (s.n_tokens <= 100 or s.n_seqs == 1)
        assert list(s.lengths) == sorted(s.lengths, reverse=True)
        assert len({int(r) // 6 for r in s.rows}) == 1  # never crosses a sort window
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    assert plan.n_truncated == 1  # the 71-token row, stored as 64
    assert max(int(s.lengths.max()) for s in plan.shards) == 64


def test_assignment_is_independent_of_world_size(tmp_path):
    write_curate_shards(tmp_path, lengths=LENGTHS)
    plan = _plan(tmp_path)
    for world in (1, 2, 3):
        owned = [s.index for r in range(world) for s in plan.owned(r, world)]
        assert sorted(owned) == list(range(len(plan.shards)))
        assert all(s.index % world == r for r in range(world) for s in plan.owned(r, world))
    again = _plan(tmp_path)
    assert again.key == plan.key
    assert all(np.array_equal(a.rows, b.rows) for a, b in zip(plan.shards, again.shards))
    assert _plan(tmp_path, tokens_per_shard=90).key != plan.key  # settings change bytes → new key


def test_reader_returns_rows_truncated(tmp_path):
    rows = write_curate_shards(tmp_path, lengths=LENGTHS)
    plan = _plan(tmp_path)
    reader = InputReader(plan, vocab_size=512, max_seq_len=64)
    for shard in plan.shards:
        got = reader.load(shard)
        for k, row in enumerate(shard.rows.tolist()):
            seq = got.input_ids[got.offsets[k] : got.offsets[k + 1]]
            assert np.array_equal(seq, rows[shard.split][row][:64])


def test_bad_inputs_name_the_file(tmp_path):
    with pytest.raises(StageError, match="no curate shards"):
        _plan(tmp_path)
    write_curate_shards(tmp_path, lengths={"train": [[4, 5]]}, vocab=600)  # ids up to 599
    plan = _plan(tmp_path)
    with pytest.raises(StageError, match=r"train-00000\.parquet: row \d \(id .*\): input_ids outside"):
        for shard in plan.shards:
            InputReader(plan, vocab_size=7, max_seq_len=64).load(shard)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "n_tokens": [3]}), tmp_path / "val-00000.parquet")
    with pytest.raises(StageError, match=r"val-00000\.parquet: missing column"):
        _plan(tmp_path)


def test_taps_key_ignores_the_last_layer_and_train_keys_on_it(tmp_path):
    """Storing the last layer beside the taps changes the plan (new shards) but not the taps' identity, so a
    branch that reads only the taps keeps its training resume key; one that reads the last layer does not."""
    from draftforge.extract.stage import taps_key
    from draftforge.io import write_json
    from draftforge.train.stage import offline_data_key

    write_curate_shards(tmp_path / "curate", lengths=LENGTHS)
    base = {"target": "fp", "taps": [1, 3], "storage": "bfloat16"}
    with_last = {**base, "last_hidden": True}
    plan, plan_last = _plan(tmp_path / "curate", extra_key=base), _plan(tmp_path / "curate", extra_key=with_last)
    assert plan.key != plan_last.key
    assert taps_key(plan, base) == taps_key(plan_last, with_last)
    assert taps_key(plan, base) != taps_key(_plan(tmp_path / "curate", extra_key=base, max_seq_len=32), base)
    assert taps_key(plan, base) != taps_key(plan, {**base, "taps": [1, 2]})
    keys = []
    for extra, p, timing in ((base, plan, 1.0), (with_last, plan_last, 2.0)):  # timings differ between runs
        index = tmp_path / f"index-{len(keys)}.json"
        write_json(index, {"meta": {"taps_key": taps_key(p, extra), "last_hidden": "last_hidden" in extra},
                           "throughput": {"tokens_per_s_total": timing}})
        keys.append((offline_data_key(index, False), offline_data_key(index, True)))
    assert keys[0][0] == keys[1][0]  # taps only: the same features
    assert keys[0][1] != keys[0][0]
    old = tmp_path / "old.json"  # an index from before the taps key: keyed by its content
    write_json(old, {"meta": {}})
    assert "extract" in offline_data_key(old, False)
