"""Curate on the default world's real pieces: SmolLM2's own ChatML template (tokenizer from the GGUF
via the target stage) and the packaged corpora."""

from __future__ import annotations

import json
import random

import pytest

from draftforge.chat import ChatMode
from draftforge.curate.config import SourceConfig
from draftforge.curate.schema import Row
from draftforge.curate.sources import iter_source
from draftforge.curate.tokenize import end_of_turn_ids, special_strings, tokenize_conversation

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_target_info):
    from draftforge.target.load import load_tokenizer

    return load_tokenizer(smollm2_target_info)


def _sample_rows(n_per_source: int = 12) -> list[Row]:
    rows: list[Row] = []
    for kind, opts in [("chitchat", {"max_turns": 4}), ("chatterbot", {}), ("gsm_symbolic", {"size": 20}), ("stdlib_code", {})]:
        got = [r for r in iter_source(SourceConfig(name=kind, kind=kind, options=opts), min_chars=2, on_malformed="drop") if isinstance(r, Row)]
        rows += random.Random(0).sample(got, n_per_source)
    return rows


@pytest.mark.parametrize("turns", ["last", "all"])
def test_smollm2_mask_is_exactly_assistant_content_plus_im_end(smollm2_tokenizer, turns):
    tok = smollm2_tokenizer
    eot = end_of_turn_ids(tok, [2])
    assert tok.convert_ids_to_tokens(sorted(eot)) == ["<|im_end|>"]
    specials = special_strings(tok)
    checked = 0
    for row in _sample_rows():
        msgs = row.messages
        if msgs[-1]["role"] != "assistant":  # stand-in for a regenerated answer
            msgs = msgs + [{"role": "assistant", "content": f"Answer for {row.id}:\n  - step one\n  - 42 ✓"}]
        out = tokenize_conversation(tok, msgs, eot, turns, specials=specials, mode=ChatMode())
        assert out.input_ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
        trained = [m["content"] for m in msgs if m["role"] == "assistant"]
        trained = trained[-1:] if turns == "last" else trained
        runs, cur = [], []
        for t, m in zip(out.input_ids, out.loss_mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert [tok.decode(r) for r in runs] == [c + "<|im_end|>" for c in trained]
        masked = {t for t, m in zip(out.input_ids, out.loss_mask) if m}
        assert 1 not in masked  # <|im_start|> (role headers) never trained
        checked += 1
    assert checked == 48


@pytest.mark.vllm
def test_vllm_backend_generates_and_marks_finish(smollm2_target_info, smollm2_tokenizer):
    from draftforge.chat import prompt_ids
    from draftforge.curate.config import RegenerateConfig
    from draftforge.curate.regenerate import VLLMBackend

    tok = smollm2_tokenizer
    cfg = RegenerateConfig(max_new_tokens=24, vllm_kv_cache_bytes=128 << 20, vllm_max_model_len=512, vllm_max_num_seqs=4)
    backend = VLLMBackend(smollm2_target_info["hf_path"], tok, cfg, end_of_turn_ids(tok, [2]))
    try:
        prompts = [prompt_ids(tok, [{"role": "user", "content": q}], ChatMode()) for q in ("Say hi.", "What is 2+3? Answer with a number.")]
        gens = backend.generate(prompts, [0, 1])
    finally:
        backend.close()
    assert len(gens) == 2 and all(g.text.strip() for g in gens)
    assert all(len(g.token_ids) <= 24 and (g.finished or len(g.token_ids) == 24) for g in gens)
    assert 2 not in gens[0].token_ids
    print(json.dumps([g.text for g in gens]))
