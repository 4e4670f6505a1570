"""Run AR / DFlash / DDTree on the same prompts (batch 1) and record one dict per response.

A method config is (method, budget): ("ar", None), ("dflash", None), ("ddtree", b) per budget.
For every prompt all method configs run back to back (interleaved, so slow drift in machine speed
hits every method alike) with the same sampling seed. Multi-turn prompts (consecutive user turns,
MT-Bench) are answered turn by turn, each method continuing from its own answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from draftforge import chat
from draftforge.engine import METHODS, GenResult, TargetModel, generate, make_method
from draftforge.errors import StageError

Messages = list[dict[str, str]]
MethodCfg = tuple[str, "int | None"]
KNOWN_METHODS = ("ar", *METHODS)
TREE_METHODS = ("ddtree", "ddtree_markov")  # methods swept over evaluate.budgets


@dataclass
class EngineSet:
    tm: TargetModel
    drafter: Any  # DFlashDrafter | None (AR only)
    tokenizer: Any
    eos_ids: list[int]
    max_new_tokens: int
    engine: Any = None  # graph.CapturedEngine (evaluate.engine = captured) | None (eager)
    mtp: Any = None  # MTPHead (native or trained) for the `mtp` method

    def drafter_for(self, name: str) -> Any:
        """What `make_method` gets as the drafter: the MTP head for `mtp`, the DFlash drafter otherwise."""
        return self.mtp if name == "mtp" else self.drafter


def method_plan(methods: Sequence[str], budgets: Sequence[int]) -> list[MethodCfg]:
    """Method configs in a fixed order; AR always first (the reference for speedup and losslessness)."""
    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise StageError(f"evaluate.methods: unknown {unknown}; known: {list(KNOWN_METHODS)}")
    if any(m in TREE_METHODS for m in methods) and (not budgets or any(int(b) < 1 for b in budgets)):
        raise StageError(f"evaluate.budgets: {list(budgets)} must be a non-empty list of integers >= 1")
    plan: list[MethodCfg] = [("ar", None)]
    for name in KNOWN_METHODS[1:]:
        if name in methods:
            plan += [(name, int(b)) for b in budgets] if name in TREE_METHODS else [(name, None)]
    return plan


def split_turns(messages: Messages) -> list[tuple[Messages, Messages]]:
    """→ [(history up to and including this user turn, ...)]: one entry per user turn to answer.

    A conversation ending on a user turn is one turn; consecutive user messages (no assistant
    between) are separate turns whose assistant answers the engine generates.
    """
    if not messages or messages[-1].get("role") != "user":
        raise StageError("evaluate prompt: a conversation must be non-empty and end on a user turn")
    turns, history = [], []
    for i, msg in enumerate(messages):
        history.append(msg)
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if msg["role"] == "user" and (nxt is None or nxt["role"] == "user"):
            turns.append(list(history))
    return turns


def run_one(es: EngineSet, method: MethodCfg, prompt_ids: list[int], temperature: float, seed: int) -> GenResult:
    name, budget = method
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=es.tm.device).manual_seed(seed)
    method = make_method(name, es.tm, es.drafter_for(name), budget)
    return generate(es.tm, method, prompt_ids, es.max_new_tokens, temperature=temperature, eos_ids=es.eos_ids,
                    generator=gen, engine=es.engine)


def record(res: GenResult, *, dataset: str, prompt_index: int, turn: int, temperature: float,
           budget: int | None) -> dict[str, Any]:
    return {
        "dataset": dataset, "prompt_index": prompt_index, "turn": turn, "method": res.method, "budget": budget,
        "temperature": temperature, "prompt_len": res.prompt_len, "n_tokens": len(res.tokens),
        "n_decode": res.n_decode, "ttft_s": res.ttft_s, "decode_s": res.decode_s,
        "draft_prefill_s": res.draft_prefill_s, "tpot_s": res.tpot_s if res.n_decode else None,
        "tokens_per_s": res.tokens_per_s if res.n_decode else None, "accept_lengths": res.accept_lengths,
        "stage_s": res.stage_s, "tokens": res.tokens,
    }  # fmt: skip


def warm_up(es: EngineSet, plan: list[MethodCfg], prompt: Messages, temperature: float, n: int) -> None:
    """Run every method config n times on one prompt and discard the results (allocator, kernels)."""
    ids = chat.prompt_ids(es.tokenizer, split_turns(prompt)[0])
    for _ in range(n):
        for method in plan:
            run_one(es, method, ids, temperature, seed=0)


def run_dataset(es: EngineSet, plan: list[MethodCfg], dataset: str, prompts: Sequence[tuple[int, Messages]],
                temperature: float, seed: int, warmup: int, show: bool = True) -> list[dict[str, Any]]:
    """All method configs on (index, prompt) pairs of one dataset at one temperature."""
    out: list[dict[str, Any]] = []
    if not prompts:
        return out
    if warmup > 0:
        warm_up(es, plan, prompts[0][1], temperature, warmup)
    for index, messages in tqdm(prompts, desc=f"evaluate {dataset} T={temperature}", disable=not show):
        turns = split_turns(messages)
        for method in plan:
            history_extra: list[dict[str, str]] = []  # this method's own answers to earlier turns
            for turn, conv in enumerate(turns):
                if turn:
                    conv = _with_answers(conv, history_extra)
                ids = chat.prompt_ids(es.tokenizer, conv)
                res = run_one(es, method, ids, temperature, seed=seed + index * 1000 + turn)
                out.append(record(res, dataset=dataset, prompt_index=index, turn=turn, temperature=temperature,
                                  budget=method[1]))
                if method[0] == "mtp":  # "native" (the target's MTP layer) or "trained" (train/mtp)
                    out[-1]["mtp_source"] = getattr(es.mtp, "source", None)
                if turn + 1 < len(turns):
                    history_extra.append({"role": "assistant",
                                          "content": es.tokenizer.decode(res.tokens, skip_special_tokens=True)})
    return out


def _with_answers(conv: Messages, answers: list[dict[str, str]]) -> Messages:
    """Insert the method's own assistant answers after each earlier user turn of a consecutive run."""
    merged: Messages = []
    k = 0
    for i, msg in enumerate(conv):
        merged.append(msg)
        nxt = conv[i + 1] if i + 1 < len(conv) else None
        if msg["role"] == "user" and nxt is not None and nxt["role"] == "user" and k < len(answers):
            merged.append(answers[k])
            k += 1
    return merged
