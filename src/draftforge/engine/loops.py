"""The three batch-1 decoding loops over one target wrapper, cache, sampling rule and clock.

Shared protocol: prefill the prompt (TTFT ends when the first token is sampled); the first token is
the initial "bonus": generated, but not yet in the target cache. Committed length `start` = rows in
the target cache. Speculative loops additionally run the drafter's first context prefill (timed
apart as `draft_prefill_s`, excluded from decode time); its draft serves round 1.

Per round: τ = tokens committed by one target verification forward (bonus included).
Stage times per round: draft (drafter forward + logits), build (chain/tree + mask), verify (target
forward + logits + sampling), commit (walk/accept, KV crop/compaction, draft-context gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from draftforge.engine.sampling import sample
from draftforge.engine.target import KVCache, TargetModel, causal_mask, embed_tokens, forward
from draftforge.engine.timing import Clock
from draftforge.engine.tree import build_tree, draft_topk, tree_inputs, walk

STAGES = ("draft", "build", "verify", "commit")


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


@torch.no_grad()
def _prefill(tm: TargetModel, prompt_ids: Sequence[int], capacity: int, temperature: float,
             gen: torch.Generator | None, want_taps: bool) -> tuple[KVCache, int, torch.Tensor | None]:
    cache = KVCache(tm, capacity)
    ids = torch.tensor([list(prompt_ids)], device=tm.device, dtype=torch.long)  # (1, P)
    h, taps = forward(tm, cache, ids, torch.arange(ids.shape[1], device=tm.device), "causal", want_taps)
    first = int(sample(tm.lm_head(h[:, -1]), temperature, gen)[0])
    return cache, first, taps


@torch.no_grad()
def generate_ar(tm: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                eos_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> GenResult:
    """Autoregressive baseline: one target forward per token, same target/cache/attention."""
    clock = Clock(tm.device)
    t0 = clock.now()
    cache, tok, _ = _prefill(tm, prompt_ids, len(prompt_ids) + max_new_tokens + 8, temperature, generator, False)
    out = _Output(max_new_tokens, eos_ids)
    out.extend([tok])
    t1 = clock.now()
    res = GenResult("ar", [], len(prompt_ids), ttft_s=t1 - t0, decode_s=0.0)
    while not out.done:
        s0 = clock.now()
        ids = torch.tensor([[tok]], device=tm.device, dtype=torch.long)
        h, _ = forward(tm, cache, ids, torch.tensor([cache.length], device=tm.device), None)
        tok = int(sample(tm.lm_head(h[:, -1]), temperature, generator)[0])
        out.extend([tok])
        res.accept_lengths.append(1)
        res.stage_s["verify"].append(clock.now() - s0)
    res.decode_s = clock.now() - t1
    res.tokens = out.tokens
    return res


class _DraftState:
    """The drafter's context cache plus the tapped features of committed-but-not-yet-drafted tokens."""

    def __init__(self, drafter: Any, tm: TargetModel, taps: torch.Tensor) -> None:
        self.drafter, self.tm = drafter, tm
        self.cache = drafter.new_cache()
        self.pending = taps  # (1, n_new, n_taps*H) target features of positions cache.length..start-1
        self.block = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id

    def draft_logits(self, bonus: int, start: int) -> torch.Tensor:
        """One drafter pass over [bonus, mask x (B-1)] → (B-1, V) logits for depths 1..B-1."""
        d = self.drafter
        ctx_new = d.project_context(self.pending) if self.pending is not None and self.pending.shape[1] else None
        emb = embed_tokens(self.tm, [bonus] + [self.mask_id] * (self.block - 1)).to(d.fc.weight.dtype)
        h = d.draft(emb, start, ctx_new, self.cache)  # (1, B, H)
        self.cache.crop(start)  # context only: committed positions 0..start-1
        self.pending = None
        return self.tm.lm_head(h[0, 1:].to(self.tm.dtype))  # (B-1, V)


@torch.no_grad()
def _speculative(method: str, tm: TargetModel, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                 temperature: float, eos_ids: Sequence[int], generator: torch.Generator | None,
                 budget: int) -> GenResult:
    if tuple(drafter.cfg.target_layer_ids) != tm.tap_ids:
        raise ValueError(f"drafter taps {drafter.cfg.target_layer_ids} != target wrapper taps {list(tm.tap_ids)}")
    clock = Clock(tm.device)
    B = drafter.cfg.block_size
    n_verify = B if method == "dflash" else 1 + budget
    capacity = len(prompt_ids) + max_new_tokens + n_verify + 8
    t0 = clock.now()
    cache, bonus, taps = _prefill(tm, prompt_ids, capacity, temperature, generator, True)
    out = _Output(max_new_tokens, eos_ids)
    out.extend([bonus])
    t1 = clock.now()
    state = _DraftState(drafter, tm, taps)
    start = cache.length
    dlogits = state.draft_logits(bonus, start) if not out.done else None
    t2 = clock.now()
    res = GenResult(method, [], len(prompt_ids), ttft_s=t1 - t0, decode_s=0.0, draft_prefill_s=t2 - t1)
    first_round = True
    while not out.done:
        s0 = clock.now()
        if not first_round:
            dlogits = state.draft_logits(bonus, start)
        s1 = clock.now()
        if method == "dflash":
            committed, bonus, s2, s3 = _chain_round(tm, cache, state, dlogits, bonus, start, temperature, generator, clock)
        else:
            committed, bonus, s2, s3 = _tree_round(tm, cache, state, dlogits, bonus, start, temperature, generator, clock, budget)
        out.extend(committed[1:] + [bonus])  # drafts accepted after the old bonus, then the new bonus
        start = cache.length
        s4 = clock.now()
        res.accept_lengths.append(len(committed))
        for name, dt in zip(STAGES, (None if first_round else s1 - s0, s2 - s1, s3 - s2, s4 - s3)):
            if dt is not None:
                res.stage_s[name].append(dt)
        first_round = False
    res.decode_s = clock.now() - t2
    res.tokens = out.tokens
    return res


def _chain_round(tm, cache, state, dlogits, bonus, start, temperature, generator, clock):
    """DFlash chain: verify [bonus, d1..d(B-1)] causally; accept the longest prefix d_i == p_(i-1)."""
    drafts = dlogits.argmax(dim=-1)  # (B-1,) per-slot argmax, at any temperature
    ids = torch.cat([torch.tensor([bonus], device=tm.device), drafts])[None]  # (1, B)
    mask = causal_mask(start, ids.shape[1], tm.device, tm.dtype)
    s2 = clock.now()
    h, taps = forward(tm, cache, ids, torch.arange(start, start + ids.shape[1], device=tm.device), mask, True)
    post = sample(tm.lm_head(h[0]), temperature, generator).tolist()  # (B,) target token after slot i
    s3 = clock.now()
    chain = ids[0].tolist()
    a = 0
    while a + 1 < len(chain) and chain[a + 1] == post[a]:
        a += 1
    cache.crop(start + a + 1)  # keep bonus + a accepted drafts
    state.pending = taps[:, : a + 1]  # (1, a+1, n_taps*H) new draft context
    return chain[: a + 1], post[a], s2, s3


def _tree_round(tm, cache, state, dlogits, bonus, start, temperature, generator, clock, budget):
    """DDTree: top-K per depth → best-first tree → one masked verify → walk → KV compaction."""
    logp, toks = draft_topk(dlogits, min(budget, dlogits.shape[-1]))
    tree = build_tree(bonus, logp, toks, budget)
    ids, positions, mask = tree_inputs(tree, start, tm.device, tm.dtype)
    s2 = clock.now()
    h, taps = forward(tm, cache, ids, positions, mask, True)
    post = sample(tm.lm_head(h[0]), temperature, generator).tolist()  # (1+N,) target token after node i
    s3 = clock.now()
    path = walk(tree, post)
    rows = torch.tensor(path, device=tm.device, dtype=torch.long)
    cache.length = start + len(tree)  # rows of the whole flattened tree, then keep only the path
    cache.compact(start + rows, start)
    state.pending = taps[:, rows]  # (1, len(path), n_taps*H)
    return [tree.tokens[i] for i in path], post[path[-1]], s2, s3


def generate_dflash(tm: TargetModel, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    temperature: float = 0.0, eos_ids: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> GenResult:
    return _speculative("dflash", tm, drafter, prompt_ids, max_new_tokens, temperature, eos_ids, generator, 0)


def generate_ddtree(tm: TargetModel, drafter: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    budget: int, temperature: float = 0.0, eos_ids: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> GenResult:
    if budget < 1:
        raise ValueError(f"ddtree budget {budget} < 1")
    return _speculative("ddtree", tm, drafter, prompt_ids, max_new_tokens, temperature, eos_ids, generator, budget)
