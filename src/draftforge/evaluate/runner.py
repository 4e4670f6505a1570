"""Run AR / DFlash / DDTree on the same prompts (batch 1) and record one dict per response.

A method config is (method, budget): ("ar", None), ("dflash", None), ("ddtree", b) per budget.
Timing order (`run_dataset`), the invariant the medians rely on: each of the `repeats` timed repeats is
one whole pass over the prompts, and within a pass every prompt runs every method config back to back
(with the same sampling seed) before the next prompt starts. So a slow period of a shared machine hits
all configs of the prompts it overlaps alike (the per-repeat speedups, AR and method timed side by side,
stay honest), and it hits only the repeat(s) it overlaps (the median over repeats drops it). The config
order within a prompt is rotated by ⌊r·n/R⌋ in repeat r (n configs, R repeats), so no config always runs
first after a prompt switch. Multi-turn prompts (consecutive user turns, MT-Bench) are answered turn by
turn, each method continuing from its own answers (all turns of one config back to back).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from draftforge import chat
from draftforge.drafter.registry import MTP_HEAD, artifact_of_method, source_key_of_method, tree_methods
from draftforge.engine import METHODS, CapacityError, GenResult, TargetModel, cpu_linear, generate, make_method
from draftforge.errors import StageError
from draftforge.evaluate.sampling_check import pit_values

Messages = list[dict[str, str]]
MethodCfg = tuple[str, "int | None"]
KNOWN_METHODS = ("ar", *METHODS)


@dataclass
class EngineSet:
    tm: TargetModel
    drafter: Any  # DFlashDrafter | None (AR only)
    tokenizer: Any
    eos_ids: list[int]
    max_new_tokens: int
    engine: Any = None  # graph.CapturedEngine (evaluate.engine = captured) | None (eager)
    mtp: Any = None  # MTPHead (native or trained) for the methods drafting with an MTP head
    # The target's chat mode (the stage's ChatMode.of(cfg)): every prompt is rendered in it.
    chat_mode: chat.ChatMode = field(kw_only=True)

    def drafter_for(self, name: str) -> Any:
        """What `make_method` gets as the drafter: the MTP head for a method of an MTP-head type, the block
        drafter otherwise (drafter.registry.artifact_of_method)."""
        return self.mtp if artifact_of_method(name) == MTP_HEAD else self.drafter


def method_plan(methods: Sequence[str], budgets: Sequence[int]) -> list[MethodCfg]:
    """Method configs in a fixed order; AR always first (the reference for speedup and losslessness)."""
    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise StageError(f"evaluate.methods: unknown {unknown}; known: {list(KNOWN_METHODS)}")
    if any(m in tree_methods() for m in methods) and (not budgets or any(int(b) < 1 for b in budgets)):
        raise StageError(f"evaluate.budgets: {list(budgets)} must be a non-empty list of integers >= 1")
    plan: list[MethodCfg] = [("ar", None)]
    for name in KNOWN_METHODS[1:]:
        if name in methods:
            plan += [(name, int(b)) for b in budgets] if name in tree_methods() else [(name, None)]
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
    try:
        return generate(es.tm, method, prompt_ids, es.max_new_tokens, temperature=temperature, eos_ids=es.eos_ids,
                        generator=gen, engine=es.engine)
    except CapacityError as exc:  # only the captured engine has a fixed capacity
        verify = method.verify_size if method is not None else 1
        need = len(prompt_ids) + es.max_new_tokens + verify
        raise StageError(f"evaluate.engine_capacity: {getattr(es.engine, 'capacity', '?')} rows do not fit a prompt of "
                         f"{len(prompt_ids)} tokens + evaluate.max_new_tokens {es.max_new_tokens} + {name}'s verify "
                         f"{verify}; set evaluate.engine_capacity >= {need} ({exc})") from None


def record(res: GenResult, *, dataset: str, prompt_index: int, turn: int, temperature: float,
           budget: int | None, repeat: int = 0, split: str = "eval") -> dict[str, Any]:
    return {
        "dataset": dataset, "prompt_index": prompt_index, "turn": turn, "method": res.method, "budget": budget,
        "temperature": temperature, "split": split, "repeat": repeat, "prompt_len": res.prompt_len,
        "n_tokens": len(res.tokens), "n_decode": res.n_decode, "ttft_s": res.ttft_s, "decode_s": res.decode_s,
        "draft_prefill_s": res.draft_prefill_s, "tpot_s": res.tpot_s if res.n_decode else None,
        "tokens_per_s": res.tokens_per_s if res.n_decode else None, "accept_lengths": res.accept_lengths,
        "stage_s": res.stage_s, "tokens": res.tokens,
    }  # fmt: skip


def rotated(plan: Sequence[MethodCfg], repeat: int, repeats: int) -> list[MethodCfg]:
    """The plan rotated left by ⌊repeat·n/repeats⌋: over the repeats each config leads at evenly spread places."""
    n = len(plan)
    k = (repeat * n // max(1, repeats)) % n if n else 0
    return list(plan[k:]) + list(plan[:k])


def calibration_plan(plan: Sequence[MethodCfg]) -> list[MethodCfg]:
    """The configs calibration measures: every budget of every tree method."""
    return [(m, b) for m, b in plan if m in tree_methods()]


def decode_rows(es: EngineSet, plan: Sequence[MethodCfg]) -> set[int]:
    """Row counts the products of a decode of `plan` may see (engine/cpu_linear.decode_rows)."""
    block = int(getattr(getattr(es.drafter, "cfg", None), "block_size", 0) or 0)
    return cpu_linear.decode_rows(block, [(b + 1, make_method(m, es.tm, es.drafter, b).verify_size)
                                          for m, b in plan if b is not None])


def warm_up(es: EngineSet, plan: list[MethodCfg], prompt: Messages, temperature: float, n: int) -> None:
    """Run every method config n times on one prompt and discard the results (allocator, kernels); on the CPU,
    then choose every product route a decode of the plan may need (engine/cpu_linear.py), so no timed round
    pays for choosing one."""
    ids = chat.prompt_ids(es.tokenizer, split_turns(prompt)[0], es.chat_mode)
    for _ in range(n):
        for method in plan:
            run_one(es, method, ids, temperature, seed=0)
    if es.tm.device.type == "cpu":
        cpu_linear.pretune(sorted(decode_rows(es, plan)))


def run_dataset(es: EngineSet, plan: list[MethodCfg], dataset: str, prompts: Sequence[tuple[int, Messages]],
                temperature: float, seed: int, warmup: int, show: bool = True, repeats: int = 1,
                split: str = "eval", pit: bool = False) -> list[dict[str, Any]]:
    """All method configs on (index, prompt) pairs of one dataset at one temperature, `repeats` timed
    passes in the order the module docstring states. Records carry `repeat` and `split` ("eval", or
    "calibration" for the prompts that choose the auto budget). pit (T > 0): the first repeat's records
    also carry `pit`, their tokens' PIT values (evaluate/sampling_check.py; later repeats redraw the same
    tokens from the same seeds)."""
    out: list[dict[str, Any]] = []
    if not prompts or not plan:
        return out
    if warmup > 0:
        warm_up(es, plan, prompts[0][1], temperature, warmup)
    for repeat in range(repeats):
        desc = f"evaluate {dataset} T={temperature}" + (" calibration" if split != "eval" else "")
        desc += f" repeat {repeat + 1}/{repeats}" if repeats > 1 else ""
        for index, messages in tqdm(prompts, desc=desc, disable=not show):
            for method in rotated(plan, repeat, repeats):
                out += run_turns(es, method, dataset, index, messages, temperature, seed, repeat=repeat, split=split,
                                 pit=pit and repeat == 0 and temperature > 0)
    return out


def run_turns(es: EngineSet, method: MethodCfg, dataset: str, index: int, messages: Messages, temperature: float,
              seed: int, repeat: int = 0, split: str = "eval", pit: bool = False) -> list[dict[str, Any]]:
    """One method config on every turn of one prompt → one record per turn (with `pit` values when asked)."""
    out: list[dict[str, Any]] = []
    turns = split_turns(messages)
    history_extra: list[dict[str, str]] = []  # this method's own answers to earlier turns
    for turn, conv in enumerate(turns):
        if turn:
            conv = with_answers(conv, history_extra)
        ids = chat.prompt_ids(es.tokenizer, conv, es.chat_mode)
        res = run_one(es, method, ids, temperature, seed=seed + index * 1000 + turn)
        out.append(record(res, dataset=dataset, prompt_index=index, turn=turn, temperature=temperature,
                          budget=method[1], repeat=repeat, split=split))
        source_key = source_key_of_method(method[0])  # an MTP head: "native" (the target's layer) or "trained"
        if source_key:
            out[-1][source_key] = getattr(es.drafter_for(method[0]), "source", None)
        if pit:  # after the timed generate: one teacher-forced forward, its own uniform stream per response
            stream = zlib.crc32(f"{seed}/{dataset}/{split}/{method[0]}/{method[1]}/{index}/{turn}".encode())
            out[-1]["pit"] = [round(u, 6) for u in pit_values(es.tm, ids, res.tokens, temperature, stream)]
        if turn + 1 < len(turns):
            history_extra.append(answer_message(es.tokenizer, res.tokens))
    return out


def answer_message(tokenizer: Any, tokens: Sequence[int]) -> dict[str, str]:
    """A generated answer as the assistant turn a later user turn follows (its text, special tokens dropped)."""
    return {"role": "assistant", "content": tokenizer.decode(list(tokens), skip_special_tokens=True)}


def with_answers(conv: Messages, answers: list[dict[str, str]]) -> Messages:
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
