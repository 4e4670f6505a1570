"""Loss mask: masked tokens decode to exactly the trained assistant contents + end-of-turn tokens,
never role headers, system text, user text or template-inserted (empty) think tags."""

from __future__ import annotations

import pytest

from curate_fixtures import QWEN3_LIKE_TEMPLATE
from draftforge.chat import ChatMode
from draftforge.curate.schema import Drop
from draftforge.curate.tokenize import end_of_turn_ids, tokenize_conversation
from draftforge.target.random import build_byte_tokenizer

NO_OPTIONS = ChatMode()  # the template's defaults

CONVS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "Be brief. Assistant answers only."},
        {"role": "user", "content": "assistant"},  # user text equal to a role name
        {"role": "assistant", "content": "user"},  # content equal to a role name
        {"role": "user", "content": "Unicode: naïve café 你好 🙂"},
        {"role": "assistant", "content": "Sure: naïve café 你好 🙂\nSecond line, indented:\n    code()"},
    ],
]


def masked_pieces(tok, ids, mask):
    """Decode each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.fixture(params=["chatml", "qwen3_think"])
def tokenizer(request):
    tok = build_byte_tokenizer(512)
    if request.param == "qwen3_think":
        tok.chat_template = QWEN3_LIKE_TEMPLATE
    return tok


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("turns", ["last", "all"])
def test_masked_tokens_are_assistant_content_plus_eot(tokenizer, conv, turns):
    eot = end_of_turn_ids(tokenizer)
    out = tokenize_conversation(tokenizer, conv, eot, turns, mode=NO_OPTIONS)
    assert out.input_ids == list(tokenizer.apply_chat_template(conv, tokenize=True)["input_ids"])
    trained = [m["content"] for m in conv if m["role"] == "assistant"]
    trained = trained[-1:] if turns == "last" else trained
    assert masked_pieces(tokenizer, out.input_ids, out.loss_mask) == [c + "<|im_end|>" for c in trained]
    think_ids = set(tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<|im_start|>"]))
    assert not any(m and t in think_ids for t, m in zip(out.input_ids, out.loss_mask))


def test_think_template_renders_empty_think_tags_outside_the_mask():
    tok = build_byte_tokenizer(512)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    conv = CONVS[0]
    out = tokenize_conversation(tok, conv, end_of_turn_ids(tok), "last", mode=NO_OPTIONS)
    text = tok.decode(out.input_ids)
    assert "<think>\n\n</think>\n\nHello!" in text  # the template did insert them
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    assert "<think>\n\n</think>" in unmasked


def test_truncated_answer_keeps_eot_out_of_mask():
    tok = build_byte_tokenizer(512)
    out = tokenize_conversation(tok, CONVS[0], end_of_turn_ids(tok), "last", eot_in_mask=False, mode=NO_OPTIONS)
    assert masked_pieces(tok, out.input_ids, out.loss_mask) == ["Hello! How can I help?"]


def test_template_that_rewrites_content_is_a_counted_drop():
    tok = build_byte_tokenizer(512)
    tok.chat_template = tok.chat_template.replace("message['content']", "message['content'] | upper")
    with pytest.raises(Drop) as info:
        tokenize_conversation(tok, CONVS[0], end_of_turn_ids(tok), "last", mode=NO_OPTIONS)
    assert info.value.reason == "mask_mismatch"


def test_no_assistant_turn_is_a_drop():
    tok = build_byte_tokenizer(512)
    with pytest.raises(Drop):
        tokenize_conversation(tok, CONVS[0][:1], end_of_turn_ids(tok), "last", mode=NO_OPTIONS)


def test_special_token_text_inside_content_is_a_counted_drop():
    from draftforge.curate.tokenize import special_strings

    tok = build_byte_tokenizer(512)
    conv = [{"role": "user", "content": "say <|im_end|> please"}, {"role": "assistant", "content": "no"}]
    assert "<|im_end|>" in special_strings(tok)
    with pytest.raises(Drop) as info:
        tokenize_conversation(tok, conv, end_of_turn_ids(tok), "last", specials=special_strings(tok), mode=NO_OPTIONS)
    assert info.value.reason == "special_token_in_text"
