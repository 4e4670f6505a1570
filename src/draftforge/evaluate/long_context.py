"""The `long_context` evaluation set: prompts of at least `evaluate.long_context.min_tokens` tokens, built from
text every install has (torch-free, no download), for "does the speedup hold at long context".

Two kinds, interleaved (prompts.interleave_by_category), categories `long: code` and `long: conversations`:
- code: the opening of a Python standard-library module (this interpreter's own sources, modules in name
  order, each cut at a line end once the prompt reaches its size), to explain section by section. Another
  Python version has other sources: the prompts, hence the evaluate rows, follow the interpreter.
- conversations: held-out chitchat conversations (`holdout.chitchat_is_heldout`, never in training data)
  written one after another as a transcript, to summarise one by one.

Sizes are in characters, `CHARS_PER_TOKEN` per requested token: a little more than English text and code
take in the default target's tokenizer, so each prompt has at least `min_tokens` tokens and, for code (the
densest), under twice that; the response records hold each prompt's real token count (`prompt_len`).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from draftforge.errors import StageError

Messages = list[dict[str, str]]
CHARS_PER_TOKEN = 4.5
CODE, CONVERSATIONS = "long: code", "long: conversations"
CODE_ASK = "Explain what this code does, section by section."
CHAT_ASK = "Summarise each conversation above in one sentence, in order."


def stdlib_sources(min_chars: int, n: int) -> list[tuple[str, str]]:
    """(module name, source) of the first `n` stdlib modules, in name order, at least `min_chars` long (files
    shorter on disk than that are never read)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")):
        if len(out) >= n:
            break
        if path.stat().st_size < min_chars:  # bytes >= characters: too short either way
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= min_chars:
            out.append((path.stem, text))
    return out


def cut_at_line(text: str, min_chars: int) -> str:
    """The shortest prefix of whole lines at least `min_chars` long (the whole text when shorter)."""
    end = text.find("\n", min_chars)
    return text if end < 0 else text[:end]


def code_prompts(min_chars: int, n: int) -> list[Messages]:
    out = []
    for name, source in stdlib_sources(min_chars, n):
        body = cut_at_line(source, min_chars)
        out.append([{"role": "user", "content": f"The opening of the Python module `{name}`:\n\n```python\n{body}\n"
                                                f"```\n\n{CODE_ASK}"}])
    return out


def transcript(conversation: Messages, number: int) -> str:
    speakers = ("A", "B")
    lines = [f"{speakers[i % 2]}: {m['content']}" for i, m in enumerate(conversation)]
    return f"Conversation {number}:\n" + "\n".join(lines)


def conversation_prompts(conversations: list[Messages], min_chars: int, n: int) -> list[Messages]:
    """Consecutive conversations, each prompt taking the next ones until it reaches `min_chars`."""
    out: list[Messages] = []
    parts: list[str] = []
    for conv in conversations:
        if len(out) >= n:
            break
        parts.append(transcript(conv, len(parts) + 1))
        if sum(map(len, parts)) >= min_chars:
            out.append([{"role": "user", "content": "\n\n".join(parts) + f"\n\n{CHAT_ASK}"}])
            parts = []
    return out


def long_context_records(ev: Any, chitchat: list[Messages]) -> list[tuple[Messages, str]]:
    """(prompt, category) of the set, both kinds interleaved; `chitchat` = the held-out chitchat pool."""
    from draftforge.evaluate.prompts import interleave_by_category

    lc = ev.long_context
    min_chars = int(int(lc.min_tokens) * CHARS_PER_TOKEN)
    half = (int(lc.size) + 1) // 2
    code = [(p, CODE) for p in code_prompts(min_chars, half)]
    chats = [(p, CONVERSATIONS) for p in conversation_prompts(chitchat, min_chars, int(lc.size) - len(code))]
    if not code and not chats:
        raise StageError(f"evaluate.long_context.min_tokens={lc.min_tokens}: no stdlib module nor held-out chitchat "
                         "transcript is that long; lower it")
    return interleave_by_category(code + chats)
