"""Render a conversation with the target's own chat template and build its loss mask.

Loss mask = the tokens of the trained assistant contents plus the end-of-turn token right after each;
never role headers, system prompts, user text or template-inserted think tags (e.g. an empty
`<think>\n\n</think>` a Qwen3 template puts before the answer).

How spans are found (template-agnostic, checked per row):
1. full = template(messages). For assistant turn i, prefix = template(messages[:i], generation prompt);
   the longest common prefix of `prefix` and `full` ends at or before where turn i's content begins,
   so the content is searched in `full` only from there (it cannot match earlier turns or the system text).
2. Tokenize `full` with offsets; a token is an assistant token iff its first char lies in the content
   span; the end-of-turn token is the first token starting at or after the span end and must be one
   of `eot_ids`.
3. Verify: decoding each turn's masked content tokens gives back exactly its content; else Drop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from draftforge.chat import ChatMode, render_text
from draftforge.curate.schema import Drop


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def end_of_turn_ids(tokenizer: Any, extra: list[int] | tuple[int, ...] = ()) -> set[int]:
    """Tokens that may close an assistant turn: eos, <|im_end|>/<|eot_id|>/<end_of_turn> when present."""
    ids = {int(i) for i in extra}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if name in vocab:
            ids.add(int(vocab[name]))
    return ids


def special_strings(tokenizer: Any) -> list[str]:
    """Text forms of special/added tokens: inside message content they would tokenize as specials."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted(t for t in found if t)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    common = os.path.commonprefix([a[:n], b[:n]])
    return len(common)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], trained: list[int],
                    mode: ChatMode) -> tuple[str, list[tuple[int, int]]]:
    """(full rendered text in the target's chat mode, char span [start, end) of each trained assistant turn's content)."""
    full = render_text(tokenizer, messages, mode)
    spans = []
    for i in trained:
        prefix = render_text(tokenizer, messages[:i], mode, generation_prompt=True)
        cursor = _common_prefix_len(prefix, full)
        content = messages[i]["content"]
        start = full.find(content, cursor)
        if start < 0:
            raise Drop("mask_mismatch", f"template does not render assistant turn {i} verbatim")
        spans.append((start, start + len(content)))
    return full, spans


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, str]],
    eot_ids: set[int],
    mask_turns: str = "last",
    eot_in_mask: bool = True,
    specials: list[str] | None = None,
    *,
    mode: ChatMode,
) -> Tokenized:
    """input_ids and loss_mask (1 = trained assistant content token or its end-of-turn token), rendered in the
    target's chat mode (`mode`: the curate stage's `ChatMode.of(cfg)`)."""
    if specials:
        for m in messages:
            if any(sp in m["content"] for sp in specials):
                raise Drop("special_token_in_text")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise Drop("no_assistant_turn")
    trained = assistant[-1:] if mask_turns == "last" else assistant
    full, spans = assistant_spans(tokenizer, messages, trained, mode)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    for (s, e), i in zip(spans, trained, strict=True):
        content_tok = [j for j, (a, _b) in enumerate(offsets) if s <= a < e]
        if not content_tok or tokenizer.decode([ids[j] for j in content_tok]) != messages[i]["content"]:
            raise Drop("mask_mismatch", f"assistant turn {i} tokens do not decode to its content")
        after = next((j for j, (a, b) in enumerate(offsets) if a >= e and b > a), None)
        if after is None or ids[after] not in eot_ids:
            raise Drop("mask_mismatch", f"assistant turn {i} is not followed by an end-of-turn token")
        for j in content_tok:
            mask[j] = 1
        if eot_in_mask or i != trained[-1]:
            mask[after] = 1
    return Tokenized(input_ids=ids, loss_mask=mask)
