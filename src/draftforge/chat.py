"""The chat template, applied one way for every stage (torch-free).

The target owns its chat mode: the options its template is rendered with (`target.chat_template_kwargs`,
e.g. `{enable_thinking: false}` for a Qwen3 hybrid-thinking target). A stage builds one `ChatMode` from its
config (`ChatMode.of(cfg)`) and hands it to every rendering call here; nothing else passes template options.
Stages that produce or consume a drafter record the mode (`ChatMode.record_of`): curate's manifest names the
mode its data was rendered in, extract and train carry it forward, and evaluate / baselines compare the
trained mode with the one they serve (`check_served`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]
RECORD_KEY = "chat_template_kwargs"  # the key every record (manifest, index, metrics, markers) uses
CONFIG_KEY = "target.chat_template_kwargs"


def _plain(value: Any) -> Any:
    """A JSON-plain copy (DictConfig, tuples and other mappings become dicts / lists), keys sorted."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # GPU benchmark machines without omegaconf pass plain dicts
        OmegaConf = None  # noqa: N806
    if OmegaConf is not None and OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return json.loads(json.dumps(value, sort_keys=True, default=dict))


@dataclass(frozen=True)
class ChatMode:
    """The chat-template options a conversation is rendered with; empty = the template's own defaults."""

    items: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> ChatMode:
        plain = _plain(kwargs if kwargs is not None else {})
        if not isinstance(plain, dict):
            raise TypeError(f"{CONFIG_KEY}: expected a mapping, got {type(kwargs).__name__}")
        return cls(tuple(sorted(plain.items())))

    @classmethod
    def of(cls, cfg: Any) -> ChatMode:
        """The mode a stage serves: its composed config's `target.chat_template_kwargs` (the one place it is read)."""
        target = cfg["target"] if isinstance(cfg, Mapping) else cfg.target
        kwargs = target.get(RECORD_KEY) if hasattr(target, "get") else getattr(target, RECORD_KEY, None)
        return cls.from_kwargs(kwargs)

    @classmethod
    def record_of(cls, record: Mapping[str, Any]) -> ChatMode:
        """The mode a stage's record (curate manifest, extract index, train metrics) says its data was made in. A
        record written before the option existed has no key: the template's defaults, the only mode then."""
        return cls.from_kwargs(record.get(RECORD_KEY) or {})

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.items)

    def overrides_from(self, current: ChatMode) -> list[str]:
        """The Hydra overrides that turn a config serving `current` into one serving this mode (a dict override
        would merge into the target file's options, so each option is set or removed by its own key)."""
        theirs = current.kwargs
        out = [f"++{CONFIG_KEY}.{k}={json.dumps(v)}" for k, v in self.items if k not in theirs or theirs[k] != v]
        return out + [f"~{CONFIG_KEY}.{k}" for k in sorted(theirs) if k not in self.kwargs]

    def __str__(self) -> str:
        """`{enable_thinking: false}` (a Hydra override value); `{}` for the template's defaults."""
        return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in self.items) + "}"


def render_text(tokenizer: Any, messages: Messages, mode: ChatMode, generation_prompt: bool = False) -> str:
    """The conversation as the template's text (curate locates assistant spans in it)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **mode.kwargs)


def prompt_ids(tokenizer: Any, messages: Messages, mode: ChatMode) -> list[int]:
    """Token ids of the conversation with the generation prompt: what the target continues.

    transformers 5 returns a BatchEncoding (a mapping with `input_ids`), older versions a list; a
    batched form (list of lists) holds one conversation here.
    """
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **mode.kwargs)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def check_served(served: ChatMode, train_marker: Path, allow_key: str, allowed: bool) -> str | None:
    """Compare the mode a drafter was trained in (its train marker's record) with the mode a stage serves it in.

    Same mode → None. Different → a StageError naming both modes and the keys to change, unless `allowed`
    (the stage's `allow_chat_mode_mismatch`): then the label the stage puts on its rows.
    """
    from draftforge.errors import StageError
    from draftforge.io import read_json

    trained = ChatMode.record_of(read_json(train_marker, what="train marker"))
    if trained == served:
        return None
    if not allowed:
        raise StageError(f"{train_marker}: drafter trained with {CONFIG_KEY}={trained} but served with {served}; serve "
                         f"it as trained ({' '.join(trained.overrides_from(served))}) or retrain it in {served}, or set "
                         f"{allow_key}=true to measure it anyway (rows labelled chat_mode_mismatch)")
    return f"trained {trained}, served {served}"
