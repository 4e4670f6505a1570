"""Fixtures for curate tests: a StageContext on a tiny random target, JSONL sources, a Qwen3-like
think-tag template (owned by the curate stage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# Qwen3-style: the final assistant turn is rendered with an (empty) think block before the content,
# and the generation prompt carries the same empty think block (enable_thinking=False behaviour).
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% if loop.last %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write((rec if isinstance(rec, str) else json.dumps(rec)) + "\n")
    return path


def chat_records(n: int, prefix: str = "q") -> list[dict[str, Any]]:
    """n distinct OpenAI-style single-turn records with varied wording (no near-duplicates)."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
    out = []
    for i in range(n):
        topic = " ".join(words[(i * 7 + j * 3) % len(words)] + str((i * 31 + j) % 97) for j in range(6))
        out.append({"id": f"{prefix}{i}", "messages": [
            {"role": "user", "content": f"Question {i}: tell me about {topic}."},
            {"role": "assistant", "content": f"Answer {i}."},
        ]})  # fmt: skip
    return out


def make_ctx(tmp: Path, target_info: dict, sources: list[dict], **curate: Any):
    """A real StageContext (composed config, experiment=smoke) whose target.json is `target_info`."""
    from draftforge.cli import make_context
    from draftforge.io import write_json

    ctx = make_context("curate", [
        "experiment=smoke", "target=tiny-random", f"results_root={tmp / 'results'}", "tracking.enabled=false",
    ])  # fmt: skip
    base = {
        "sources": sources,
        "max_rows": None, "val_fraction": 0.2, "shard_rows": 16, "decontam": {"eval_sets": False},
        "filters": {"min_tokens": 4, "max_tokens": 2048, "max_prompt_tokens": 512},
        "regenerate": {"backend": "hf", "max_new_tokens": 6, "chunk_rows": 8, "batch_size": 4, "truncated": "keep"},
    }  # fmt: skip
    merged = OmegaConf.merge(ctx.cfg.curate, base, curate)
    ctx.cfg.curate = merged
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    write_json(ctx.input_dir("target") / "target.json", target_info)
    return ctx
