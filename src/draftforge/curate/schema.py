"""The one conversation schema every source is normalized to, and the record-level checks.

Row = {"id": str, "source": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}.
Invariants after `normalize_messages`: roles are known; at most one leading system message; user and
assistant strictly alternate starting with user; every content is a non-empty stripped str.
A record that breaks them raises `Drop(reason)`; reasons are counted, never silently lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user", "prompt": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
}  # fmt: skip


class Drop(Exception):
    """A record is unusable; `reason` is a short stable key counted in the manifest."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason if not detail else f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Row:
    id: str
    source: str
    messages: list[dict[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "messages": self.messages}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Row:
        return Row(id=d["id"], source=d["source"], messages=d["messages"])


def _content(value: Any) -> str:
    """Text content; OpenAI content-part lists of text parts are joined, anything else is non-text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        raise Drop("non_text", "content has non-text parts")
    if value is None:
        raise Drop("empty")
    raise Drop("non_text", f"content is {type(value).__name__}")


def messages_from_record(rec: Any, fmt: str = "auto") -> list[dict[str, str]]:
    """Raw record (OpenAI `messages`, ShareGPT `conversations`, or `prompt`/`response`) → raw messages."""
    if not isinstance(rec, dict):
        raise Drop("malformed", f"record is {type(rec).__name__}, not an object")
    if fmt in ("auto", "openai") and "messages" in rec:
        turns = rec["messages"]
        if not isinstance(turns, list):
            raise Drop("malformed", "messages is not a list")
        out = []
        for t in turns:
            if not isinstance(t, dict) or "role" not in t or "content" not in t:
                raise Drop("malformed", "message lacks role/content")
            out.append({"role": str(t["role"]), "content": _content(t["content"])})
        return out
    if fmt in ("auto", "sharegpt") and "conversations" in rec:
        turns = rec["conversations"]
        if not isinstance(turns, list):
            raise Drop("malformed", "conversations is not a list")
        out = []
        for t in turns:
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise Drop("malformed", "conversation turn lacks from/value")
            out.append({"role": str(t["from"]), "content": _content(t["value"])})
        return out
    if fmt in ("auto", "prompt"):
        for pk, rk in (("prompt", "response"), ("instruction", "output"), ("question", "answer")):
            if pk in rec:
                out = [{"role": "user", "content": _content(rec[pk])}]
                if rec.get(rk) is not None:
                    out.append({"role": "assistant", "content": _content(rec[rk])})
                return out
    raise Drop("malformed", f"no messages/conversations/prompt field (format={fmt})")


def normalize_messages(raw: list[dict[str, str]], min_chars: int = 1) -> list[dict[str, str]]:
    """Map role aliases, strip contents, check order; ends on a user turn or an assistant turn."""
    if not raw:
        raise Drop("empty")
    msgs: list[dict[str, str]] = []
    for i, m in enumerate(raw):
        role = ROLE_ALIASES.get(str(m["role"]).strip().lower())
        if role is None:
            raise Drop("bad_role", repr(m["role"]))
        content = m["content"]
        if not isinstance(content, str):
            raise Drop("non_text")
        content = content.strip()
        if "\x00" in content:
            raise Drop("non_text", "NUL byte")
        if len(content) < min_chars:
            raise Drop("empty" if not content else "too_short")
        if role == "system" and i != 0:
            raise Drop("bad_role_order", "system message not first")
        msgs.append({"role": role, "content": content})
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    if not body:
        raise Drop("empty", "only a system message")
    for i, m in enumerate(body):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise Drop("bad_role_order", f"turn {i} is {m['role']}")
    return msgs


def prompt_messages(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to and including its last user turn (what the target answers)."""
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: last_user + 1]


def prompt_text(msgs: list[dict[str, str]]) -> str:
    """User-authored text of a conversation: what dedup and decontamination compare."""
    return "\n".join(m["content"] for m in msgs if m["role"] == "user")
