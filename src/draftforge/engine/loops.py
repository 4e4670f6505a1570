"""The batch-1 decoding loop: one target, one state, one sampling rule, any method (`methods.py`).

Protocol: prefill the prompt (TTFT ends when the first token is sampled); the first token is the
initial "bonus": generated, but not yet in the target state. Committed length `start` = rows in the
state. A speculative method then runs its drafter's first context prefill and first draft (timed
apart as `draft_prefill_s`, excluded from decode time); that draft serves round 1.

Per round: τ = tokens committed by one target verification forward (bonus included). Stage times per
round: draft (drafter forward + logits), build (tree/chain), verify (target forward + logits +
sampling), commit (walk, state commit, draft-context update). A round returns a `Round`; the clock
stays in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from draftforge.engine.methods import Features, Method, make_method
from draftforge.engine.sampling import sample
from draftforge.engine.span import chain_span, tree_span
from draftforge.engine.state import TargetState
from draftforge.engine.target import TargetModel, forward
from draftforge.engine.timing import Clock, StageTimer
from draftforge.engine.tree import walk

STAGES = ("draft", "build", "verify", "commit")
CAPACITY_SLACK = 8


@dataclass
class GenResult:
    method: str
    tokens: list[int]  # generated tokens, truncated at max_new_tokens / after the first EOS
    prompt_len: int
    ttft_s: float  # target prefill + first sample
    decode_s: float  # after TTFT (and the draft's first context prefill) until the last round ends
    draft_prefill_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # τ per round
    stage_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})

    @property
    def n_decode(self) -> int:
        """Tokens produced in the decode phase (all but the first)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def tpot_s(self) -> float:
        return self.decode_s / self.n_decode if self.n_decode else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")


@dataclass
class Round:
    committed: list[int]  # the old bonus + the accepted drafts (τ = len)
    bonus: int  # the target's token after them: the next round's root


class _Output:
    """Generated tokens with the stop rule (max_new_tokens or an EOS token)."""

    def __init__(self, max_new: int, eos: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self.max_new, self.eos, self.done = max_new, set(int(e) for e in eos), False

    def extend(self, toks: Sequence[int]) -> None:
        for t in toks:
            if self.done:
                return
            self.tokens.append(int(t))
            self.done = int(t) in self.eos or len(self.tokens) >= self.max_new


def ar_round(tm: TargetModel, state: TargetState, bonus: int, temperature: float,
             gen: torch.Generator | None, engine: Any = None) -> Round:
    """Append the bonus (committed whole) and sample the next token."""
    if engine is not None:  # static step (graph.CapturedEngine)
        return Round([bonus], int(sample(engine.ar_step(bonus), temperature, gen)[0]))
    ids = torch.tensor([[bonus]], device=tm.device, dtype=torch.long)
    h, _ = forward(tm, state, chain_span(ids, state.length, tm.dtype, commit_all=True))
    return Round([bonus], int(sample(tm.lm_head(h[:, -1]), temperature, gen)[0]))


def verify_round(tm: TargetModel, state: TargetState, method: Method, drafted: Any, bonus: int,
                 temperature: float, gen: torch.Generator | None, timer: StageTimer, engine: Any = None) -> Round:
    """Build the method's tree, verify it in one forward, walk it, commit the accepted path."""
    tree = method.build(drafted, bonus)
    timer.lap("build")
    if engine is not None:  # static step (graph.CapturedEngine): same tree, same rule
        logits, h, taps = engine.verify(tree)
    else:
        start = state.length
        if tree.is_chain:
            span = chain_span(torch.tensor([tree.tokens], device=tm.device), start, tm.dtype, commit_all=False)
        else:
            span = tree_span(tree, start, tm.device, tm.dtype, tm.conv_kernel)
        h, taps = forward(tm, state, span, method.needs_taps)
        logits = tm.lm_head(h[0])
    post = sample(logits, temperature, gen).tolist()  # (n,) the target's token after each node
    timer.lap("verify")
    path = walk(tree, post)
    if engine is not None:
        taps = taps if method.needs_taps else None
        engine.commit(path)
    else:
        state.commit(path)
    rows = torch.tensor(path, device=tm.device, dtype=torch.long)
    ids = torch.tensor([[tree.tokens[i] for i in path]])  # committed tokens, on the host (methods read them as ints)
    method.observe(Features(taps[:, rows] if taps is not None else None, h[:, rows], ids))
    timer.lap("commit")
    return Round([tree.tokens[i] for i in path], post[path[-1]])


@torch.no_grad()
def generate(tm: TargetModel, method: Method | None, prompt_ids: Sequence[int], max_new_tokens: int, *,
             temperature: float = 0.0, eos_ids: Sequence[int] = (),
             generator: torch.Generator | None = None, engine: Any = None) -> GenResult:
    """Decode with `method` (None = autoregressive: one target forward per token).

    engine: a `graph.CapturedEngine` over `tm` (static verify steps, CUDA graphs on a GPU) or None
    (eager). The prompt prefill is eager either way; tokens are the same.
    """
    clock = Clock(tm.device)
    verify = method.verify_size if method is not None else 1
    t0 = clock.now()
    if engine is not None:
        state = engine.begin(method, len(prompt_ids), max_new_tokens)
    else:
        state = TargetState(tm, len(prompt_ids) + max_new_tokens + verify + CAPACITY_SLACK, max_span=verify)
    ids = torch.tensor([list(prompt_ids)], device=tm.device, dtype=torch.long)  # (1, P)
    want_taps = method is not None and method.needs_taps
    h, taps = forward(tm, state, chain_span(ids, 0, tm.dtype, commit_all=True), want_taps)
    bonus = int(sample(tm.lm_head(h[:, -1]), temperature, generator)[0])
    out = _Output(max_new_tokens, eos_ids)
    out.extend([bonus])
    t1 = clock.now()
    drafted = None
    if method is not None:
        method.begin(Features(taps, h, torch.tensor([list(prompt_ids)])))
        drafted = method.draft(bonus, state.length) if not out.done else None
    t2 = clock.now()
    res = GenResult(method.name if method else "ar", [], len(prompt_ids), ttft_s=t1 - t0, decode_s=0.0,
                    draft_prefill_s=t2 - t1)
    timer = StageTimer(tm.device, STAGES)
    first = True
    while not out.done:
        timer.start()
        if method is None:
            rnd = ar_round(tm, state, bonus, temperature, generator, engine)
            timer.lap("verify")
        else:
            if not first:
                drafted = method.draft(bonus, state.length)
                timer.lap("draft")
            rnd = verify_round(tm, state, method, drafted, bonus, temperature, generator, timer, engine)
        out.extend(rnd.committed[1:] + [rnd.bonus])  # drafts accepted after the old bonus, then the new bonus
        res.accept_lengths.append(len(rnd.committed))
        bonus, first = rnd.bonus, False
    res.decode_s = clock.now() - t2
    res.stage_s = timer.stage_s()
    res.tokens = out.tokens
    return res


def generate_ar(tm: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int, **kw: Any) -> GenResult:
    return generate(tm, None, prompt_ids, max_new_tokens, **kw)


def generate_dflash(tm: TargetModel, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                    **kw: Any) -> GenResult:
    return generate(tm, make_method("dflash", tm, drafter), prompt_ids, max_new_tokens, **kw)


def generate_ddtree(tm: TargetModel, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    budget: int, **kw: Any) -> GenResult:
    return generate(tm, make_method("ddtree", tm, drafter, budget), prompt_ids, max_new_tokens, **kw)
