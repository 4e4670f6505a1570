"""The chat template, applied one way for every stage (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Messages = list[dict[str, str]]


def render_text(tokenizer: Any, messages: Messages, generation_prompt: bool = False) -> str:
    """The conversation as the template's text (curate locates assistant spans in it)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of the conversation with the generation prompt: what the target continues.

    transformers 5 returns a BatchEncoding (a mapping with `input_ids`), older versions a list; a
    batched form (list of lists) holds one conversation here.
    """
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]
