"""Sources, normalization, filters, dedup, decontamination, mixture quotas and split (no model)."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curate_fixtures import chat_records, write_jsonl
from draftforge.curate.config import CurateConfig, SourceConfig
from draftforge.curate.decontam import Decontaminator
from draftforge.curate.schema import Drop, Row, messages_from_record, normalize_messages
from draftforge.curate.select import quotas, select_rows, split_of
from draftforge.curate.sources import iter_source
from draftforge.errors import StageError

HUMANEVAL_LIKE = (
    'def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    """ Check if in given list of '
    "numbers, are any two numbers closer to each other than given threshold.\n    >>> has_close_elements([1.0, 2.0, "
    '3.0], 0.5)\n    False\n    """\n'
)
GSM_LIKE = (
    "There are 12 students playing basketball and twice that number playing volleyball. There are 17 boys and "
    "17 girls playing table tennis. If each student only participates in one group, how many students are there "
    "in total? Give the result as your final answer. Do not include units."
)
CHAT_LIKE = [{"role": "user", "content": "hey, what did you think of the new album that dropped last friday night?"}]


def _run(cfg: CurateConfig, rows_by_source: dict[str, list], decon=None, **kw):
    out: list[dict] = []

    def items_of(src):
        for rec in rows_by_source[src.name]:
            if isinstance(rec, Drop):
                yield rec
                continue
            try:
                yield Row(str(rec.get("id", "?")), src.name, normalize_messages(messages_from_record(rec)))
            except Drop as d:
                yield d

    sel = select_rows(cfg, items_of, decon, out.append, **kw)
    return sel, out


def _user(i, text):
    return {"id": str(i), "messages": [{"role": "user", "content": text}]}


def test_formats_normalize_to_one_schema():
    openai = {"messages": [{"role": "system", "content": " s "}, {"role": "user", "content": [{"type": "text", "text": "q"}]}, {"role": "assistant", "content": "a"}]}
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    prompt = {"instruction": "q", "output": "a"}
    want = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize_messages(messages_from_record(openai)) == [{"role": "system", "content": "s"}, *want]
    assert normalize_messages(messages_from_record(sharegpt))[1:] == want
    assert normalize_messages(messages_from_record(prompt)) == want


@pytest.mark.parametrize(
    "rec, reason",
    [
        ({"messages": [{"role": "user", "content": "  "}]}, "empty"),
        ({"messages": [{"role": "user", "content": {"img": 1}}]}, "non_text"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "non_text"),
        ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}, "bad_role_order"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}, "bad_role_order"),
        ({"messages": [{"role": "tool", "content": "q"}]}, "bad_role"),
        ({"messages": "hi"}, "malformed"),
        ({"text": "no schema"}, "malformed"),
    ],
)
def test_bad_records_drop_with_reason(rec, reason):
    with pytest.raises(Drop) as info:
        normalize_messages(messages_from_record(rec))
    assert info.value.reason == reason


def test_jsonl_parquet_adapters_and_errors(tmp_path):
    recs = chat_records(5)
    path = write_jsonl(tmp_path / "a.jsonl", [recs[0], "{bad json", "", recs[1]])
    items = list(iter_source(SourceConfig(name="a", kind="jsonl", path=str(path)), min_chars=1, on_malformed="drop"))
    assert [type(i).__name__ for i in items] == ["Row", "Drop", "Row"]
    assert items[0].id == "a:q0" and items[1].reason == "malformed"
    with pytest.raises(StageError, match=r"a.jsonl:2: malformed JSON"):
        list(iter_source(SourceConfig(name="a", kind="jsonl", path=str(path)), min_chars=1, on_malformed="error"))
    with pytest.raises(StageError, match="not found"):
        list(iter_source(SourceConfig(name="m", kind="jsonl", path=str(tmp_path / "missing.jsonl")), min_chars=1, on_malformed="drop"))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "p.parquet")
    rows = list(iter_source(SourceConfig(name="p", kind="parquet", path=str(tmp_path / "p.parquet")), min_chars=1, on_malformed="drop"))
    assert [r.id for r in rows] == [f"p:q{i}" for i in range(5)] and rows[0].messages == recs[0]["messages"]
    (tmp_path / "bad.parquet").write_text("nope")
    with pytest.raises(StageError, match="bad.parquet: not a readable parquet"):
        list(iter_source(SourceConfig(name="b", kind="parquet", path=str(tmp_path / "bad.parquet")), min_chars=1, on_malformed="drop"))


def test_hf_disk_without_datasets_is_a_clear_error(tmp_path):
    pytest.importorskip("draftforge")
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(StageError, match="hf_disk needs the `datasets` package"):
        list(iter_source(SourceConfig(name="h", kind="hf_disk", path=str(tmp_path)), min_chars=1, on_malformed="drop"))


def test_gsm_symbolic_training_seeds_must_avoid_eval_seeds():
    from draftforge.evaluate.config import EvaluateConfig, GsmSymbolicEvalConfig

    eval_cfg = EvaluateConfig(gsm_symbolic=GsmSymbolicEvalConfig(seed=100, size=50))
    src = SourceConfig(name="g", kind="gsm_symbolic", options={"seed": 120, "size": 10})
    with pytest.raises(StageError, match=r"overlap the evaluation seeds \[100, 150\)"):
        list(iter_source(src, min_chars=1, on_malformed="drop", eval_cfg=eval_cfg))
    src = SourceConfig(name="g", kind="gsm_symbolic", options={"seed": 0, "size": 3})
    rows = list(iter_source(src, min_chars=1, on_malformed="drop", eval_cfg=eval_cfg))
    assert [r.id for r in rows] == ["g:s0", "g:s1", "g:s2"] and "final answer" in rows[0].messages[0]["content"]


def test_exact_and_near_duplicates_removed():
    base = "Please explain how a binary search tree keeps its keys ordered and why lookups take logarithmic time"
    rows = [_user(0, base), _user(1, base.upper() + "!!"), _user(2, base.replace("Please", "Kindly")), _user(3, "Something else entirely about cooking pasta at home tonight")]
    sel, out = _run(CurateConfig(sources=[SourceConfig(name="s", kind="jsonl")]), {"s": rows})
    assert [r["id"] for r in out] == ["0", "3"]
    assert sel.per_source["s"].dropped == Counter({"duplicate_exact": 1, "duplicate_near": 1})


def test_decontamination_removes_planted_copies_and_near_copies_counted_per_set():
    eval_sets = {
        "humaneval": [[{"role": "user", "content": "Complete the following Python function.\n\n" + HUMANEVAL_LIKE}]],
        "gsm_symbolic": [[{"role": "user", "content": GSM_LIKE}]],
        "chitchat": [CHAT_LIKE],
    }
    clean = [_user(100 + i, r["messages"][0]["content"]) for i, r in enumerate(chat_records(20))]
    planted = [
        _user(1, HUMANEVAL_LIKE),  # copy without the instruction
        _user(2, "Write tests for this:\n" + HUMANEVAL_LIKE.replace("threshold", "limit", 1) + "\nThanks!"),  # near copy inside
        _user(3, GSM_LIKE.replace("12 students", "12 pupils").replace("17 girls", "17  GIRLS")),  # near copy
        _user(4, CHAT_LIKE[0]["content"].upper()),  # case-changed copy
        _user(5, "Hey, what did you think of the new album that dropped last Friday night? I loved it"),
    ]
    decon = Decontaminator(eval_sets, ngram=6, threshold=0.5)
    sel, out = _run(CurateConfig(sources=[SourceConfig(name="s", kind="jsonl")]), {"s": clean[:10] + planted + clean[10:]}, decon)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in clean)
    assert sel.decontam == {
        "humaneval": {"eval_prompts": 1, "removed": 2},
        "gsm_symbolic": {"eval_prompts": 1, "removed": 1},
        "chitchat": {"eval_prompts": 1, "removed": 2},
    }
    assert sel.per_source["s"].dropped == Counter({"contaminated:humaneval": 2, "contaminated:gsm_symbolic": 1, "contaminated:chitchat": 2})


def test_short_common_phrases_are_not_contamination():
    decon = Decontaminator({"chitchat": [CHAT_LIKE]}, ngram=6, threshold=0.5)
    assert decon.match("what did you think") is None  # shorter than one n-gram: exact match only
    assert decon.match("What did you think of the new album?") is None  # 3 n-grams < min_shared_ngrams
    assert decon.match("so what did you think of the new album that dropped last friday") == "chitchat"


def test_weights_caps_and_split_are_deterministic():
    cfg = CurateConfig(sources=[SourceConfig(name="a", kind="jsonl", weight=3.0), SourceConfig(name="b", kind="jsonl", weight=1.0, cap=5)], max_rows=40, val_fraction=0.25)
    assert quotas(cfg) == {"a": 30, "b": 5}
    data = {"a": chat_records(50, "a"), "b": chat_records(50, "b")}
    sel, out = _run(cfg, data)
    assert Counter(r["source"] for r in out) == {"a": 30, "b": 5}
    assert sel.per_source["a"].read == 30  # stops reading once full
    _, again = _run(cfg, data)
    assert out == again
    assert all(r["split"] == split_of(r["id"], 0.25) for r in out)
    assert 0 < sum(r["split"] == "val" for r in out) < len(out)
    sel2, _ = _run(cfg, data, read_past_quota=True)
    assert sel2.per_source["a"].read == 50 and sel2.per_source["a"].dropped["over_quota"] == 20


def test_zero_usable_rows_is_an_error_naming_the_source():
    cfg = CurateConfig(sources=[SourceConfig(name="junk", kind="jsonl")])
    with pytest.raises(StageError, match=r"curate.sources\[junk\]: zero usable rows"):
        _run(cfg, {"junk": [{"foo": 1}, Drop("malformed")]})


def test_sample_subsamples_deterministically_and_counts():
    cfg = CurateConfig(sources=[SourceConfig(name="a", kind="jsonl", sample=0.3)])
    data = {"a": chat_records(200, "a")}
    sel, out = _run(cfg, data)
    assert 30 < len(out) < 90 and sel.per_source["a"].dropped["not_sampled"] == 200 - len(out)
    assert _run(cfg, data)[1] == out
