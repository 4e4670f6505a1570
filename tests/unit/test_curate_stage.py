"""End-to-end curate stage on a tiny random target (HF generate backend): shards, accounting,
resume after an interrupted regeneration, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from curate_fixtures import chat_records, make_ctx, write_jsonl
from draftforge.curate import stage as curate_stage
from draftforge.curate.regenerate import HFBackend
from draftforge.errors import StageError


def _sources(tmp: Path, n: int = 40) -> list[dict]:
    a = write_jsonl(tmp / "data" / "a.jsonl", chat_records(n, "a"))
    sharegpt = [{"id": f"b{r['id']}", "conversations": [{"from": "human", "value": r["messages"][0]["content"] + " (b)"},
                                                        {"from": "gpt", "value": "ok"}]} for r in chat_records(n // 2, "x")]
    b = write_jsonl(tmp / "data" / "b.jsonl", sharegpt + ["{not json"])
    return [{"name": "a", "kind": "jsonl", "path": str(a)}, {"name": "b", "kind": "jsonl", "path": str(b)}]


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.parquet"))}


def test_stage_writes_contract_and_accounts(tmp_path, tiny_target_info):
    ctx = make_ctx(tmp_path, tiny_target_info, _sources(tmp_path))
    curate_stage.main(ctx)
    manifest = json.loads((ctx.out_dir / "manifest.json").read_text())
    c = manifest["counts"]
    assert c["in"] == 61 and c["in"] == c["kept"] + c["dropped"] + c["failed"]
    assert manifest["per_source"]["b"]["dropped"]["malformed"] == 1
    assert manifest["target_fingerprint"] == tiny_target_info["fingerprint"]
    tr = manifest["truncation"]  # regenerated answers that hit max_new_tokens without an end of turn
    assert tr["answers"] >= c["kept"] and 0 <= tr["truncated"] <= tr["answers"]
    assert tr["rate"] == pytest.approx(tr["truncated"] / tr["answers"], abs=1e-4)
    assert sum(v["answers"] for v in tr["per_source"].values()) == tr["answers"]
    files = manifest["shards"]["train"] + manifest["shards"]["val"]
    assert files and sorted(files) == sorted(p.name for p in ctx.out_dir.glob("*.parquet"))
    rows = 0
    for name in files:
        t = pq.read_table(ctx.out_dir / name)
        assert str(t.schema.field("input_ids").type) == "list<element: int32>"
        assert str(t.schema.field("loss_mask").type) == "list<element: uint8>"
        for ids, mask, n in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist(), t["n_tokens"].to_pylist()):
            assert len(ids) == len(mask) == n and 0 < sum(mask) < n
        rows += t.num_rows
    assert rows == c["kept"] == manifest["rows"]["train"] + manifest["rows"]["val"]
    assert (ctx.out_dir / "preview.jsonl").read_text().strip()
    assert (ctx.out_dir / "token_hist.png").stat().st_size > 1000


class _Interrupt(KeyboardInterrupt):
    pass


def test_resume_after_interrupted_regeneration_equals_uninterrupted(tmp_path, tiny_target_info):
    from draftforge.target.load import load_target_model, load_tokenizer

    full = make_ctx(tmp_path / "full", tiny_target_info, _sources(tmp_path))
    curate_stage.main(full)
    expected = _shard_bytes(full.out_dir)
    assert len(expected) >= 3

    ctx = make_ctx(tmp_path / "resumed", tiny_target_info, _sources(tmp_path))
    calls = {"n": 0}
    model, tok = load_target_model(tiny_target_info), load_tokenizer(tiny_target_info)

    class Dying(HFBackend):
        def generate(self, prompts, seeds):
            calls["n"] += 1
            if calls["n"] == 3:  # killed while generating the third chunk
                raise _Interrupt()
            return super().generate(prompts, seeds)

    from draftforge.curate.tokenize import end_of_turn_ids

    rcfg = curate_stage.curate_config(ctx.cfg).regenerate
    with pytest.raises(_Interrupt):
        curate_stage.main(ctx, make_backend=lambda: Dying(model, tok, rcfg, end_of_turn_ids(tok, [2])))
    assert not (ctx.out_dir / "manifest.json").exists()
    chunks = sorted(ctx.work_dir.glob("regen-*/chunk-*.jsonl"))
    assert len(chunks) == 2  # two finished chunks persisted, the interrupted one not

    generated = {"n": 0}

    class Counting(HFBackend):
        def generate(self, prompts, seeds):
            generated["n"] += len(prompts)
            return super().generate(prompts, seeds)

    curate_stage.main(ctx, make_backend=lambda: Counting(model, tok, rcfg, end_of_turn_ids(tok, [2])))
    manifest = json.loads((ctx.out_dir / "manifest.json").read_text())
    assert manifest["regeneration"]["chunks_resumed"] == 2
    selected = sum(1 for _ in open(next(ctx.work_dir.glob("selection-*/selected.jsonl"))))
    assert generated["n"] == selected - 2 * 8  # finished rows were not regenerated
    assert _shard_bytes(ctx.out_dir) == expected


def test_truncated_generations_dropped_as_failures(tmp_path, tiny_target_info):
    ctx = make_ctx(tmp_path, tiny_target_info, _sources(tmp_path, 16), regenerate={"truncated": "drop", "max_new_tokens": 2})
    with pytest.raises(StageError, match="no training rows"):
        curate_stage.main(ctx)  # a random model never stops within 2 tokens: everything fails, counted
    assert not (ctx.out_dir / "manifest.json").exists()


def test_missing_file_is_one_clear_error_and_keeps_previous_outputs(tmp_path, tiny_target_info):
    ctx = make_ctx(tmp_path, tiny_target_info, _sources(tmp_path, 16))
    curate_stage.main(ctx)
    before = _shard_bytes(ctx.out_dir)
    manifest = (ctx.out_dir / "manifest.json").read_bytes()
    bad = make_ctx(tmp_path, tiny_target_info, [{"name": "gone", "kind": "jsonl", "path": str(tmp_path / "nope.jsonl")}])
    with pytest.raises(StageError, match="nope.jsonl: source 'gone' not found"):
        curate_stage.main(bad)
    assert _shard_bytes(ctx.out_dir) == before and (ctx.out_dir / "manifest.json").read_bytes() == manifest


def test_zero_usable_rows_source_errors_or_warns(tmp_path, tiny_target_info):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["{broken", json.dumps({"messages": []}), json.dumps({"foo": 1})])
    sources = _sources(tmp_path, 16) + [{"name": "junk", "kind": "jsonl", "path": str(empty)}]
    ctx = make_ctx(tmp_path, tiny_target_info, sources)
    with pytest.raises(StageError, match=r"curate.sources\[junk\]: zero usable rows"):
        curate_stage.main(ctx)
    assert not (ctx.out_dir / "manifest.json").exists() and not list(ctx.out_dir.glob("*.parquet"))
    shutil.rmtree(ctx.work_dir)
    ctx = make_ctx(tmp_path, tiny_target_info, sources, filters={"on_empty_source": "warn"})
    curate_stage.main(ctx)
    junk = json.loads((ctx.out_dir / "manifest.json").read_text())["per_source"]["junk"]
    assert junk == {"in": 3, "kept": 0, "dropped": {"empty": 1, "malformed": 2}, "failed": {}}


def test_malformed_line_as_error_names_file_and_line(tmp_path, tiny_target_info):
    ctx = make_ctx(tmp_path, tiny_target_info, _sources(tmp_path, 16), filters={"on_malformed": "error"})
    with pytest.raises(StageError, match=r"b.jsonl:9: malformed JSON"):
        curate_stage.main(ctx)


def test_without_regeneration_the_dataset_answers_are_trained(tmp_path, tiny_target_info):
    from draftforge.target.load import load_tokenizer

    ctx = make_ctx(tmp_path, tiny_target_info, _sources(tmp_path, 16), regenerate={"enabled": False}, mask_turns="all")
    curate_stage.main(ctx)
    manifest = json.loads((ctx.out_dir / "manifest.json").read_text())
    assert manifest["regeneration"] == {"enabled": False} and manifest["counts"]["kept"] >= 16
    tok = load_tokenizer(tiny_target_info)
    t = pq.read_table(ctx.out_dir / manifest["shards"]["train"][0])
    for ids, mask in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist()):
        text = tok.decode([i for i, m in zip(ids, mask) if m])
        assert text.startswith("Answer ") or text == "ok<|im_end|>"
        assert text.endswith("<|im_end|>") and "<|im_start|>" not in text
