"""The static-shape engine (engine/graph.py) run eagerly on CPU: same tokens as the eager engine, padding
invariance of verify buckets (attention and GDN trees), bucket selection and its errors."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter.registry import tree_methods  # noqa: E402
from draftforge.engine import METHODS, CapacityError, generate, make_method  # noqa: E402
from draftforge.engine.draft import DrafterContext  # noqa: E402
from draftforge.engine.graph import BucketError, CapturedEngine, verify_buckets  # noqa: E402
from draftforge.engine.span import chain_span  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.engine.tree import build_tree, chain_tree, draft_topk  # noqa: E402
from engine_fixtures import (  # noqa: E402
    drafter_kinds,
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    tiny_drafter,
    tiny_dspark_drafter,
    tiny_hybrid_target,
    tiny_target,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-9)).item()


def _random_tree(n_nodes: int, seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logp, toks = draft_topk(torch.randn(5, vocab, generator=g) * 3, 8)
    return build_tree(5, logp, toks, n_nodes)


def test_every_registered_method_is_covered_by_the_equivalence_test():
    covered = {m for _, methods in drafter_kinds().values() for m in methods}
    assert covered == set(METHODS), sorted(set(METHODS) ^ covered)


@pytest.mark.parametrize("kind", ["dflash", "dflash_sliding", "dflash_draft_vocab", "dspark", "dspark_bonus_anchor",
                                  "dspark_draft_vocab", "mtp"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_static_engine_equals_eager_in_tokens_and_accept_lengths(arch, kind):
    """Static (captured, run eagerly on CPU) == eager for every method of every drafter type: the same tokens
    (both equal AR: lossless) and the same accept length every round (the drafts are the same)."""
    hybrid = arch != "Qwen3ForCausalLM"
    tm = (tiny_hybrid_target if hybrid else tiny_target)(arch, vocab=16, seed=3)  # small vocab: drafts get accepted
    build, names = drafter_kinds()[kind]
    d = build(tm)
    budgets = (1, 16)
    plan = [(m, b) for m in names for b in (budgets if m in tree_methods() else (None,))]
    block = d if kind != "mtp" else None
    sizes = [make_method(m, tm, d, b).verify_size for m, b in plan]
    eng = CapturedEngine(tm, 192, verify_buckets(sizes), drafter=block)
    assert not eng.graphs  # CPU: the static step runs eagerly
    longest = 1
    for seed, plen in ((0, 9), (1, 70)):  # 70 > GDN prefill chunk and > one drafter block
        p = prompt(tm.vocab_size, plen, seed=seed)
        ar = generate(tm, None, p, 24).tokens
        assert generate(tm, None, p, 24, engine=eng).tokens == ar
        for name, b in plan:
            eager = generate(tm, make_method(name, tm, d, b), p, 24)
            static = generate(tm, make_method(name, tm, d, b), p, 24, engine=eng)
            assert static.tokens == eager.tokens == ar, (name, b, seed)
            assert static.accept_lengths == eager.accept_lengths, (name, b, seed)
            longest = max(longest, *eager.accept_lengths)
    assert longest > 1, "no method accepted a draft: the accept-length comparison would be vacuous"


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_padded_bucket_gives_the_real_nodes_the_same_outputs_and_state(arch):
    """A tree verified alone and padded into a larger bucket: same logits/taps for its nodes and, after
    committing a root path, the same KV rows and GDN conv/recurrent states."""
    hybrid = arch != "Qwen3ForCausalLM"
    tm = (tiny_hybrid_target if hybrid else tiny_target)(arch, seed=4)
    tree = _random_tree(12, seed=4, vocab=tm.vocab_size)
    r = len(tree)
    p = torch.tensor([prompt(tm.vocab_size, 11, seed=4)])
    outs = []
    for buckets in ((r,), (r + 19,)):
        eng = CapturedEngine(tm, 128, buckets)
        st = eng.begin(SimpleNamespace(verify_size=buckets[0]), 11, 40)
        forward(tm, st, chain_span(p, 0, tm.dtype, commit_all=True))
        logits, _, taps = eng.verify(tree)
        logits, taps = logits.clone(), taps.clone()
        path = [0]
        while True:  # the root path down each node's first child
            kids = [i for i in range(1, r) if tree.parents[i] == path[-1]]
            if not kids:
                break
            path.append(kids[0])
        eng.commit(path)
        outs.append((logits, taps, st.kv[..., : st.length, :].clone(), st.conv.clone(), st.rec.clone()))
    a, b = outs
    assert a[0].shape == b[0].shape == (r, tm.vocab_size)
    for x, y in zip(a, b):
        assert _rel(x, y) < 1e-5 if y.numel() else True


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_one_bucket_staging_a_chain_then_a_tree_then_the_chain_again(arch):
    """A bucket caches the full chain's ancestor matrix and skips re-staging it while its flag says the device buffer
    holds it; staging a tree (or a padded chain) in between must clear that flag. The same chain verified before and
    after a tree in the same bucket gives the same logits, and the tree's equal a fresh engine's."""
    hybrid = arch != "Qwen3ForCausalLM"
    tm = (tiny_hybrid_target if hybrid else tiny_target)(arch, seed=4)
    tree = _random_tree(7, seed=4, vocab=tm.vocab_size)
    n = len(tree)
    assert not tree.is_chain
    chain = [tree.tokens[0]] + prompt(tm.vocab_size, n - 1, seed=9)
    full = chain_tree(chain[0], chain[1:])
    short = chain_tree(chain[0], chain[1:3])  # a chain padded into the bucket
    p = torch.tensor([prompt(tm.vocab_size, 11, seed=4)])

    def fresh(t):
        eng = CapturedEngine(tm, 128, (n,))
        eng.begin(SimpleNamespace(verify_size=n), 11, 40)
        forward(tm, eng.state, chain_span(p, 0, tm.dtype, commit_all=True))
        return eng, eng.verify(t)[0].clone()

    eng, first = fresh(full)
    for between in (tree, short):  # verifies stage without committing: the state stays the prompt's
        got_between = eng.verify(between)[0].clone()
        assert _rel(got_between, fresh(between)[1]) < 1e-5
        again = eng.verify(full)[0].clone()
        assert _rel(again, first) < 1e-5, between


class ScriptedDrafter:
    """A drafter (the API the engine uses) whose slot k at position start+k puts the target's own greedy token there
    on top (`seq`: the prompt + AR continuation), so a DFlash chain (argmax) accepts its whole block every round;
    slot `tie` has a near-tied runner-up and later slots are flat (every other token 1 logit lower), so DDTree's
    best-first tree of B-1 nodes branches at depth `tie` instead of being a chain. The vocabulary is smaller than the
    width, so each row's logits are set exactly (least squares through the LM head)."""

    def __init__(self, real, tm, tie: int = 3) -> None:
        self.cfg, self.fc, self.layers = real.cfg, real.fc, real.layers
        self.W, self.tie, self.seq = tm.lm_head.weight.detach().float(), tie, []
        assert self.W.shape[0] < self.W.shape[1]

    def _row(self, token: int, k: int) -> torch.Tensor:
        V = self.W.shape[0]
        logits = torch.full((V,), 29.0 if k > self.tie else 0.0)
        logits[token] = 30.0
        if k == self.tie:
            logits[(token + 1) % V] = 29.9
        return torch.linalg.lstsq(self.W, logits[:, None]).solution[:, 0]

    def draft(self, block_embeds, block_pos, ctx_feats, ctx_pos, kv, kv_len, blocks=None, fused=None):
        start, B = int(block_pos[0]), block_embeds.shape[1]
        return torch.stack([self._row(self.seq[start + k], k) for k in range(B)])[None].to(block_embeds.dtype)


def test_static_engine_equals_eager_when_chains_and_trees_share_a_bucket():
    """dflash (a chain of B) and ddtree with budget B-1 (trees of B nodes) verify in the same bucket: generations that
    alternate between them through one captured engine equal the eager engine's in tokens and accept lengths. The
    bucket really stages a branching tree between full chains, and every chain draft is accepted, so a chain verified
    under a stale tree mask (a staging flag left set) would commit a wrong token or a shorter accept length."""
    tm = tiny_target("Qwen3ForCausalLM", vocab=16, seed=3)
    real = tiny_drafter(tm, seed=3)
    B = real.cfg.block_size
    plan = [("dflash", None), ("ddtree", B - 1), ("dflash", None), ("ddtree", B - 1), ("dflash", None)]
    d = ScriptedDrafter(real, tm)
    eng = CapturedEngine(tm, 192, verify_buckets([B]), drafter=d)
    staged: list[bool] = []  # per verify in bucket B: was it a full chain?
    fill = eng._fill

    def recording_fill(b, tokens, parents, depths):
        if b.n == B:
            staged.append(len(tokens) == B and list(parents) == list(range(-1, B - 1)))
        return fill(b, tokens, parents, depths)

    eng._fill = recording_fill
    for i, (name, b) in enumerate(plan):
        p = prompt(tm.vocab_size, 9, seed=i)
        ar = generate(tm, None, p, 24 + 2 * B).tokens
        d.seq = p + ar  # this prompt's oracle continuation
        eager = generate(tm, make_method(name, tm, d, b), p, 24)
        static = generate(tm, make_method(name, tm, d, b), p, 24, engine=eng)
        assert static.tokens == eager.tokens == ar[:24], (i, name)
        assert static.accept_lengths == eager.accept_lengths, (i, name, static.accept_lengths, eager.accept_lengths)
        if name == "dflash":
            assert eager.accept_lengths == [B] * len(eager.accept_lengths), eager.accept_lengths
    trees = [j for j, is_chain in enumerate(staged) if not is_chain]
    assert trees and any(staged[:trees[0]]) and any(staged[trees[0] + 1 :]), staged  # chain(s), tree(s), chain(s)

@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["dflash", "dflash_sliding", "dspark"])
def test_static_drafter_matches_eager_drafter_logits(fused, kind):
    """The padded static block pass == the eager one, slot for slot (incl. DSpark's slot 0 and windows)."""
    tm = tiny_target("Qwen3ForCausalLM", seed=5)
    d = drafter_kinds()[kind][0](tm)
    eng = CapturedEngine(tm, 128, (1, d.cfg.block_size), drafter=d, fused=fused)
    ref, sd = DrafterContext(d, tm), eng.drafter
    assert sd.first_slot == d.cfg.first_slot and sd.n_draft == d.cfg.n_draft
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(1, 30, len(tm.tap_ids) * tm.hidden_size, generator=g)
    start = 0
    for n_new in (20, 3, 6, 1):  # a prompt longer than one block, then rounds of τ ≤ B
        for c in (ref, sd):
            c.add(taps[:, start : start + n_new])
        start += n_new
        bonus = int(torch.randint(4, tm.vocab_size, (1,), generator=g))
        a, b = sd.block_logits(bonus, start), ref.block_logits(bonus, start)
        assert a.shape == b.shape == (d.cfg.n_draft, tm.vocab_size)
        assert _rel(a, b) < 1e-5


def test_buckets_and_errors():
    assert verify_buckets([16, 17, 65]) == (1, 16, 17, 65)
    assert verify_buckets() == (1,)
    tm = tiny_target(seed=6)
    d = tiny_drafter(tm, seed=6)
    eng = CapturedEngine(tm, 100, verify_buckets([d.cfg.block_size, 17]), drafter=d)
    assert eng.capacity == 128  # rounded up to the alignment
    assert eng.bucket_for(1) == 1 and eng.bucket_for(5) == d.cfg.block_size and eng.bucket_for(17) == 17
    with pytest.raises(BucketError, match="largest captured bucket 17"):
        eng.bucket_for(18)
    p = prompt(tm.vocab_size, 9)
    with pytest.raises(BucketError, match=r"verify size 65 \(budget 64\) is not a captured bucket"):
        generate(tm, make_method("ddtree", tm, d, 64), p, 8, engine=eng)
    with pytest.raises(CapacityError, match="longer than the fixed capacity"):
        generate(tm, None, prompt(tm.vocab_size, 129), 8, engine=eng)
    with pytest.raises(CapacityError, match="exceed the fixed capacity"):
        generate(tm, make_method("ddtree", tm, d, 16), p, 110, engine=eng)
    assert generate(tm, make_method("ddtree", tm, d, 16), p, 8, engine=eng).tokens == generate(tm, None, p, 8).tokens


def test_evaluate_engine_key_builds_a_static_engine_with_the_plan_buckets():
    from draftforge.errors import ConfigError
    from draftforge.evaluate.config import EvaluateConfig
    from draftforge.evaluate.runner import method_plan
    from draftforge.evaluate.stage import captured_engine

    tm = tiny_target(seed=7)
    d = tiny_drafter(tm, seed=7)
    plan = method_plan(["ar", "dflash", "ddtree"], [4, 16])
    assert captured_engine(EvaluateConfig(), tm, d, None, plan) is None  # default: eager
    eng = captured_engine(EvaluateConfig(engine="captured", engine_capacity=256, budgets=[4, 16], max_new_tokens=16), tm, d, None, plan)
    assert eng.buckets == (1, 5, d.cfg.block_size, 17) and eng.capacity == 256
    with pytest.raises(ConfigError, match="evaluate.engine: 'graph' is not one of"):  # refused at compose
        EvaluateConfig(engine="graph")
    # a DSpark chain verifies its n_draft + 1 = B + 1 rows (every slot drafts): the bucket is the method's own
    ds = tiny_dspark_drafter(tm, seed=7)
    eng = captured_engine(EvaluateConfig(engine="captured", engine_capacity=256, budgets=[4, 16], max_new_tokens=16), tm, ds, None,
                          method_plan(["ar", "dspark", "ddtree_markov"], [8]))
    assert eng.buckets == (1, ds.cfg.block_size + 1, 9)  # B = 6: dspark 7, ddtree_markov budget 8 → 9


def test_a_prompt_over_the_engine_capacity_is_one_stage_error_naming_the_key():
    """evaluate's generations (runner.run_one) turn the captured engine's CapacityError into one StageError line
    naming evaluate.engine_capacity, the prompt length and the capacity that fits."""
    from draftforge.chat import ChatMode
    from draftforge.errors import StageError
    from draftforge.evaluate.runner import EngineSet, run_one

    tm = tiny_target(seed=6)
    d = tiny_drafter(tm, seed=6)
    eng = CapturedEngine(tm, 100, verify_buckets([d.cfg.block_size]), drafter=d)  # 128 rows after alignment
    es = EngineSet(tm=tm, drafter=d, tokenizer=None, eos_ids=[], max_new_tokens=8, engine=eng, chat_mode=ChatMode())
    with pytest.raises(StageError, match=r"evaluate.engine_capacity: 128 rows do not fit a prompt of 129 tokens .* "
                                         r"set evaluate.engine_capacity >= 138") as err:
        run_one(es, ("ar", None), prompt(tm.vocab_size, 129), 0.0, seed=0)
    assert "\n" not in str(err.value)
    with pytest.raises(StageError, match=r"prompt of 120 tokens \+ evaluate.max_new_tokens 8 \+ dflash's verify"):
        run_one(es, ("dflash", None), prompt(tm.vocab_size, 120), 0.0, seed=0)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_fused_blocks_give_the_eager_tokens_and_share_the_weights(arch):
    """fused=True: q/k/v and gate/up run as one projection each (the blocks torch.compile compiles on a GPU);
    the HF Linear weights become views of the fused tensors, so the eager engine reads the same storage."""
    hybrid = arch.startswith("Qwen3_5")
    tm = (tiny_hybrid_target if hybrid else tiny_target)(arch, seed=4)
    d = tiny_drafter(tm, seed=4)
    p = prompt(tm.vocab_size, 20, seed=2)
    ar = generate(tm, None, p, 20).tokens
    eng = CapturedEngine(tm, 128, verify_buckets([d.cfg.block_size, 17]), drafter=d, fused=True)
    attn_layer = next(layer for layer, k in zip(tm.layers, tm.kinds) if k == "attention")
    fl = attn_layer._draftforge_fused
    a = attn_layer.self_attn
    assert a.k_proj.weight.untyped_storage().data_ptr() == fl.wqkv.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), fl.wqkv)
    da = d.layers[0].self_attn  # the drafter's layers are fused the same way
    assert da.v_proj.weight.untyped_storage().data_ptr() == d.layers[0]._draftforge_fused.wqkv.untyped_storage().data_ptr()
    assert generate(tm, None, p, 20).tokens == ar  # eager engine over the re-pointed weights
    assert generate(tm, None, p, 20, engine=eng).tokens == ar
    for name, b in (("dflash", None), ("ddtree", 16)):
        eager = generate(tm, make_method(name, tm, d, b), p, 20)
        fused = generate(tm, make_method(name, tm, d, b), p, 20, engine=eng)
        assert fused.tokens == eager.tokens == ar and fused.accept_lengths == eager.accept_lengths, name
