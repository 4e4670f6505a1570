"""Source kind `target_queries` on the default world's real target: queries sampled from SmolLM2's own chat
template, selected, answered and written like any source; reused on a rerun; bad options named."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from curate_fixtures import SMOLLM2_TEMPLATE, make_ctx, template_tokenizer
from draftforge.chat import ChatMode
from draftforge.curate import stage as curate_stage
from draftforge.curate.config import SourceConfig
from draftforge.curate.queries import QueryOptions, user_turn_prefix
from draftforge.errors import StageError

pytestmark = pytest.mark.integration

QUERIES = {"name": "tq", "kind": "target_queries", "options": {"size": 12, "max_new_tokens": 48, "seed": 3}}


def test_user_turn_prefix_is_the_templates_opening_of_a_user_turn():
    tok = template_tokenizer(SMOLLM2_TEMPLATE)
    prefix = user_turn_prefix(tok, ChatMode())
    assert tok.decode(prefix) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                                  "Face<|im_end|>\n<|im_start|>user\n")  # fmt: skip
    whole = tok.apply_chat_template([{"role": "user", "content": "Hi there."}], tokenize=True)["input_ids"]
    assert list(whole[: len(prefix)]) == prefix


def test_bad_query_options_are_named():
    with pytest.raises(StageError, match=r"curate.sources\[tq\].options: unknown option\(s\) \['sizes'\]"):
        QueryOptions.of(SourceConfig(name="tq", kind="target_queries", options={"sizes": 3}))
    with pytest.raises(StageError, match=r"curate.sources\[tq\].options: temperature must be > 0"):
        QueryOptions.of(SourceConfig(name="tq", kind="target_queries", options={"temperature": 0}))
    with pytest.raises(StageError, match=r"curate.sources\[tq\].options"):
        QueryOptions.of(SourceConfig(name="tq", kind="target_queries", options={"size": "many"}))


def test_queries_from_the_real_target_are_selected_answered_and_reused(tmp_path, smollm2_target_info):
    ctx = make_ctx(tmp_path, smollm2_target_info, [QUERIES], regenerate={"max_new_tokens": 8, "batch_size": 12})
    curate_stage.main(ctx)
    qfile = next(ctx.work_dir.glob("queries-tq-*/queries.jsonl"))
    queries = [json.loads(line) for line in qfile.read_text(encoding="utf-8").splitlines()]
    # SmolLM2-Instruct closes most sampled user turns with <|im_end|> within 48 tokens; the rest are dropped.
    assert 6 <= len(queries) <= 12 and all(q["prompt"] and q["prompt"] == q["prompt"].strip() for q in queries)
    assert len({q["id"] for q in queries}) == len(queries)
    manifest = json.loads((ctx.out_dir / "manifest.json").read_text())
    src = manifest["per_source"]["tq"]
    assert src["in"] == len(queries) and src["kept"] >= 1
    texts = {q["prompt"] for q in queries}
    from draftforge.target.load import load_tokenizer

    tok = load_tokenizer(smollm2_target_info)
    rows = 0
    for name in manifest["shards"]["train"] + manifest["shards"]["val"]:
        for ids in pq.read_table(ctx.out_dir / name)["input_ids"].to_pylist():
            user = tok.decode(ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            assert user in texts  # every row asks one of the sampled queries
            rows += 1
    assert rows == src["kept"]

    before = qfile.read_bytes()

    def no_sampling(_rcfg):
        raise AssertionError("a rerun with the same settings samples no query again")

    (ctx.out_dir / "manifest.json").unlink()
    curate_stage.main(ctx, make_query_backend=no_sampling)
    assert qfile.read_bytes() == before
    assert json.loads((ctx.out_dir / "manifest.json").read_text())["per_source"]["tq"] == src
