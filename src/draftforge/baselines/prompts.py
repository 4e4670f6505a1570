"""The evaluate stage's prompt sets, rendered once with the target's chat template into token ids.

Every method's engine receives the same `prompt_token_ids` (vLLM never re-renders: no `LLM.chat`, no
`chat_template_kwargs` reach it), so the chat mode is the one `chat.prompt_ids` applied here, the target's
(`ChatMode.of(cfg)`), as in evaluate; methods and the standalone engine are compared on identical inputs.
Prompt ids are `<dataset>/<index>`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from draftforge.chat import ChatMode, prompt_ids
from draftforge.errors import StageError

Messages = list[dict[str, str]]
PromptSets = dict[str, list[Messages]]


def first_turn_only(messages: Messages) -> Messages:
    """Multi-turn sets with consecutive user turns (MT-Bench) need the model's own answers in between;
    baselines measure the first turn (everything up to the first run of user turns)."""
    out: Messages = []
    for msg in messages:
        if out and msg["role"] == "user" and out[-1]["role"] == "user":
            break
        out.append(msg)
    return out


def render(tokenizer: Any, messages: Messages, where: str, mode: ChatMode) -> list[int]:
    """Chat template in the target's chat mode, with the generation prompt → token ids."""
    if not messages or messages[-1].get("role") != "user":
        raise StageError(f"{where}: a prompt must be a non-empty conversation ending on a user turn")
    return prompt_ids(tokenizer, messages, mode)


def render_sets(tokenizer: Any, sets: Mapping[str, Sequence[Messages]], mode: ChatMode) -> dict[str, list[dict[str, Any]]]:
    rendered: dict[str, list[dict[str, Any]]] = {}
    for name, prompts in sets.items():
        if not prompts:
            raise StageError(f"baselines.datasets: prompt set {name!r} is empty")
        rendered[name] = [
            {"id": f"{name}/{i}", "token_ids": render(tokenizer, first_turn_only(list(msgs)), f"{name}/{i}", mode)}
            for i, msgs in enumerate(prompts)
        ]
    return rendered


def load_sets(cfg: Any, datasets: Sequence[str], num_prompts: int, loader: Callable[..., PromptSets] | None = None) -> PromptSets:
    """The evaluate stage's prompt sets (`draftforge.evaluate.prompts.eval_prompt_sets`), first
    `num_prompts` of each (0 = all), restricted to `datasets` (same order as evaluate)."""
    if loader is None:
        from draftforge.evaluate.prompts import eval_prompt_sets as loader
    from omegaconf import OmegaConf

    ev = OmegaConf.to_container(cfg.evaluate, resolve=True) if OmegaConf.is_config(cfg.evaluate) else dict(cfg.evaluate)
    ev["datasets"] = list(datasets)
    sets = loader(OmegaConf.create({"evaluate": ev}), limit=num_prompts or None)
    missing = [d for d in datasets if d not in sets]
    if missing:
        raise StageError(f"baselines.datasets: prompt sets {missing} not produced by the evaluate prompt loader")
    return {d: list(sets[d]) for d in datasets}
