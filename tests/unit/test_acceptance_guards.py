"""Guards on what makes the product good, not only lossless: acceptance reaches its maximum with a
perfect drafter, the engine drafts exactly the block the drafter was trained on, training supervises
exactly the loss-masked slots, and every decontamination / hold-out threshold holds at its boundary.

Written against public APIs only (generate_dflash / generate_ddtree / GenResult.accept_lengths and
the drafter's inference `draft` and training API), so they survive engine refactors.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import CapturedEngine, generate, generate_ar, generate_ddtree, generate_dflash, make_method  # noqa: E402
from draftforge.engine.graph import verify_buckets  # noqa: E402
from engine_fixtures import (  # noqa: E402
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    tiny_drafter,
    tiny_dspark_drafter,
    tiny_target,
)

BLOCK = 6




class OracleDrafter:
    """The drafter API the engine uses (cfg, fc, layers, project_context, draft) with a perfect drafter behind
    it: block slot k at position start+k gets a hidden state whose LM-head argmax is the target's own greedy
    token at the position it was trained to predict, start + k + cfg.pred_offset (DFlash's fill-in block: the
    slot's own position; DSpark's default block: the next one). `sequence` = prompt + greedy continuation. A
    DSpark drafter's Markov head is kept (its bias is small beside the oracle's margin)."""

    def __init__(self, real_drafter, tm, sequence: list[int]) -> None:
        self.cfg, self.fc, self.layers = real_drafter.cfg, real_drafter.fc, real_drafter.layers
        self.markov_head = getattr(real_drafter, "markov_head", None)
        self.offset = real_drafter.cfg.pred_offset
        self.seq = sequence
        self.W = tm.hf.get_output_embeddings().weight.detach().float()
        self._rows: dict[int, torch.Tensor] = {}

    def _row(self, token: int) -> torch.Tensor:
        """A hidden state whose logits put `token` on top by a wide margin."""
        if token not in self._rows:
            W, h = self.W, self.W[token].clone()
            for _ in range(500):
                logits = W @ h
                logits[token] = -float("inf")
                rival = int(logits.argmax())
                if float((W[token] - W[rival]) @ h) > 20.0:
                    break
                h = h + 0.5 * (W[token] - W[rival])
            assert int((W @ h).argmax()) == token, f"token {token} cannot be put on top of this LM head"
            self._rows[token] = h
        return self._rows[token]

    def draft(self, block_embeds, block_pos, ctx_feats, ctx_pos, kv, kv_len, blocks=None, fused=None):
        start = int(block_pos[0])
        static = kv_len > start + block_embeds.shape[1]  # a captured engine's padded pass (new context rows padded)
        assert static or ctx_pos.numel() == 0 or int(ctx_pos[-1]) == start - 1, "context positions are not contiguous"
        B, off = block_embeds.shape[1], self.offset
        rows = [self._row(self.seq[start + k + off]) if start + k + off < len(self.seq) else torch.zeros_like(self.W[0])
                for k in range(B)]
        return torch.stack(rows)[None].to(block_embeds.dtype)


def _greedy(tm, ids: list[int], n: int) -> list[int]:
    return ids + generate_ar(tm, ids, n).tokens


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", BLOCK - 1), ("ddtree", 32)])
def test_oracle_drafter_accepts_the_whole_block_every_round(method, budget):
    tm = tiny_target(seed=3, taps=(0, 2))
    real = tiny_drafter(tm, block=BLOCK)
    ids = prompt(tm.vocab_size, 9, seed=2)
    n_new = 5 * BLOCK + 2
    oracle = OracleDrafter(real, tm, _greedy(tm, ids, n_new + 2 * BLOCK))
    if method == "dflash":
        res = generate_dflash(tm, oracle, ids, n_new)
    else:
        res = generate_ddtree(tm, oracle, ids, n_new, budget=budget)
    assert res.tokens == oracle.seq[len(ids) : len(ids) + n_new]  # lossless, as always
    assert len(res.accept_lengths) >= 5
    assert res.accept_lengths == [BLOCK] * len(res.accept_lengths), res.accept_lengths  # bonus + B-1 drafts, every round


@pytest.mark.parametrize("bonus_anchor", [False, True], ids=["dspark_block", "fill_in_block"])
def test_oracle_dspark_drafter_accepts_every_draft_of_its_block(bonus_anchor):
    """A perfect DSpark drafter: every method reading its block (the Markov chain, the Markov tree with a budget of
    exactly one spine and a larger one, and the marginal chain / tree) accepts all n_draft drafts every round,
    τ = n_draft + 1 (B + 1 with DSpark's default block, where slot 0 already drafts). The engine must read the
    drafter's own predicting slots (first_slot..) and the tree must reach the deepest drafted depth; a draft read
    one slot late, or a tree one depth short, still decodes losslessly but loses τ. Eager and captured engines."""
    tm = tiny_target(seed=3, taps=(0, 2))
    real = tiny_dspark_drafter(tm, seed=1, block=BLOCK, bonus_anchor=bonus_anchor)
    n_draft = real.cfg.n_draft
    assert n_draft == (BLOCK - 1 if bonus_anchor else BLOCK)
    ids = prompt(tm.vocab_size, 9, seed=2)
    n_new = 4 * (n_draft + 1) + 2
    oracle = OracleDrafter(real, tm, _greedy(tm, ids, n_new + 2 * BLOCK))
    plan = [("dspark", None), ("ddtree_markov", n_draft), ("ddtree_markov", 24), ("dflash", None), ("ddtree", n_draft)]
    eng = CapturedEngine(tm, 128, verify_buckets(make_method(m, tm, oracle, b).verify_size for m, b in plan), drafter=oracle)
    for name, budget in plan:
        for engine in (None, eng):
            res = generate(tm, make_method(name, tm, oracle, budget), ids, n_new, engine=engine)
            where = (name, budget, "captured" if engine else "eager")
            assert res.tokens == oracle.seq[len(ids) : len(ids) + n_new], where  # lossless, as always
            assert len(res.accept_lengths) >= 4, where
            assert res.accept_lengths == [n_draft + 1] * len(res.accept_lengths), (where, res.accept_lengths)


class RecordingDrafter:
    """A real drafter behind the same API, recording every block it drafts."""

    def __init__(self, drafter) -> None:
        self.d, self.cfg, self.fc, self.layers = drafter, drafter.cfg, drafter.fc, drafter.layers
        self.blocks: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def draft(self, block_embeds, block_pos, *args, **kwargs):
        h = self.d.draft(block_embeds, block_pos, *args, **kwargs)
        self.blocks.append((int(block_pos[0]), block_embeds.clone(), h.clone()))
        return h


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_engine_draft_block_equals_the_training_forward(method):
    """Every block the engine drafts = the drafter's training forward on the committed sequence with an
    anchor at that block's start: same bonus token, mask slots, context features and positions."""
    tm = tiny_target(seed=1, taps=(0, 2))
    rec = RecordingDrafter(tiny_drafter(tm, seed=4, block=BLOCK))
    ids = prompt(tm.vocab_size, 8, seed=5)
    gen = generate_dflash if method == "dflash" else lambda *a, **k: generate_ddtree(*a, budget=12, **k)
    res = gen(tm, rec, ids, 24)
    seq = torch.tensor(ids + res.tokens)
    with torch.no_grad():
        out = tm.hf(seq[None], output_hidden_states=True)
        tapped = torch.cat([out.hidden_states[t + 1] for t in rec.cfg.target_layer_ids], dim=-1)
        emb = tm.hf.get_input_embeddings()
        checked = 0
        for start, block_embeds, h_engine in rec.blocks:
            if start >= len(seq):
                continue
            block_ids = torch.tensor([int(seq[start])] + [rec.cfg.mask_token_id] * (BLOCK - 1))
            train_embeds = emb(block_ids)[None]
            torch.testing.assert_close(block_embeds, train_embeds)  # the block the drafter was trained on
            h_train = rec.d(tapped, train_embeds, torch.tensor([[start]]), attn_impl="sdpa")
            torch.testing.assert_close(tm.lm_head(h_engine[0]), tm.lm_head(h_train[0]), atol=2e-4, rtol=2e-4)
            checked += 1
    assert checked >= 3 and len(res.accept_lengths) >= 3


def test_collate_supervises_exactly_the_masked_slots():
    """Blocks crossing unsupervised tokens: slot k (>= 1) is supervised iff anchor+k is inside the
    sequence and its loss_mask is 1; anchors need their token and the next one supervised."""
    from draftforge.train.data import anchor_candidates, collate

    ids = torch.arange(100, 112)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.uint8)
    assert anchor_candidates(mask).tolist() == [1, 2, 6, 7, 10]
    batch = collate([(ids, mask, torch.zeros(12, 4))], [torch.tensor([2, 7, 10])], block_size=5, mask_token_id=3)
    assert batch.block_ids.tolist() == [[102, 3, 3, 3, 3, 107, 3, 3, 3, 3, 110, 3, 3, 3, 3]]
    assert batch.valid[0].tolist() == [
        [False, True, False, False, True],  # positions 3, 4, 5, 6: masked 4 and 5 in the middle
        [False, True, False, True, True],  # positions 8, 9, 10, 11: masked 9
        [False, True, False, False, False],  # position 11, then past the end
    ]
    assert batch.targets[0, 0].tolist() == [102, 103, 104, 105, 106]


def _words(n: int, tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_decontamination_thresholds_at_their_boundaries():
    from draftforge.curate.decontam import Decontaminator

    eval_words = _words(11, "e")  # 10 distinct bigrams
    filler = _words(200, "f")

    def shares(k: int, extra: list[str]) -> str:  # k bigrams of the eval prompt, then `extra`
        return " ".join(eval_words[: k + 1] + extra)

    share = Decontaminator({"set": [" ".join(eval_words)]}, ngram=2, threshold=0.5, min_shared_ngrams=1)
    assert share.match(shares(5, filler)) == "set"  # 5/10 of the eval prompt's bigrams: exactly the threshold
    assert share.match(shares(4, filler)) is None  # 4/10
    long_eval = Decontaminator({"set": [" ".join(_words(41, "e"))]}, ngram=2, threshold=0.5, min_shared_ngrams=1)
    assert long_eval.match(shares(5, filler[:5])) == "set"  # a piece of the eval prompt: 5 of its own 10 bigrams
    assert long_eval.match(shares(5, filler[:6])) is None  # 5 of 11
    floor = Decontaminator({"set": [" ".join(eval_words)]}, ngram=2, threshold=0.1, min_shared_ngrams=5)
    assert floor.match(shares(5, filler)) == "set"  # h = min_shared_ngrams
    assert floor.match(shares(4, filler)) is None  # h = min_shared_ngrams - 1
    short = Decontaminator({"set": ["e0"]}, ngram=2, threshold=0.5, min_shared_ngrams=1)
    assert short.match("e0") == "set" and short.match("e0 f0") is None  # shorter than n words: exact only


def _bucket(conv_id: str) -> int:
    return int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16) % 10000


def test_holdouts_at_their_boundaries():
    """The one hold-out rule (used by curate and evaluate) at the exact chitchat bucket boundary, and
    training gsm_symbolic seeds may touch but never enter the evaluation range."""
    from draftforge.curate.config import SourceConfig
    from draftforge.curate.packaged import iter_gsm_symbolic
    from draftforge.errors import StageError
    from draftforge.holdout import chitchat_is_heldout

    for conv_id in ("conv-a", "conv-b", "conv-c"):
        b = _bucket(conv_id)
        assert chitchat_is_heldout(conv_id, b + 1) and not chitchat_is_heldout(conv_id, b), (conv_id, b)

    ev = SimpleNamespace(gsm_symbolic=SimpleNamespace(seed=1000, size=10))
    ok = SourceConfig(name="gsm", kind="gsm_symbolic", options={"seed": 990, "size": 10})  # [990, 1000): touches
    assert next(iter(iter_gsm_symbolic(ok, 1, ev))) is not None
    for seed, size in ((991, 10), (1009, 5)):  # last training seed 1000 / first training seed 1009: inside
        bad = SourceConfig(name="gsm", kind="gsm_symbolic", options={"seed": seed, "size": size})
        with pytest.raises(StageError, match="overlap the evaluation seeds"):
            next(iter(iter_gsm_symbolic(bad, 1, ev)))
