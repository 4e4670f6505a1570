"""The engine with every product on engine/cpu_linear.py's CPU routes (the real targets' case: their weights are
large enough to be registered; the tests' tiny ones are not unless PACK_MIN is lowered, as here), each route
pinned in turn and the tuner's own choice: tree nodes must still get HF's logits of their root path (1 + 4 …
1 + 31 verified rows), and speculative decoding must equal AR token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import cpu_kernel, cpu_linear, generate_ar, generate_ddtree, generate_dflash  # noqa: E402
from draftforge.engine.span import chain_span, tree_span  # noqa: E402
from draftforge.engine.state import TargetState  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.engine.tree import build_tree, draft_topk  # noqa: E402
from engine_fixtures import one_thread, prompt, tiny_drafter, tiny_hybrid_target, tiny_target  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture(autouse=True, params=[*cpu_linear.ROUTES, "auto"])
def route_everything(request, monkeypatch):
    if request.param == "kernel" and not cpu_kernel.available():
        pytest.skip(f"the AVX2 kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    monkeypatch.setattr(cpu_linear, "PACK_MIN", 0)
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", request.param)


def _target(kind: str, vocab: int, seed: int):
    tm = tiny_target(vocab=vocab, seed=seed) if kind == "dense" else tiny_hybrid_target(vocab=vocab, seed=seed)
    assert all(getattr(m, "_draftforge_routed", False) for m in tm.hf.modules() if isinstance(m, torch.nn.Linear))
    return tm


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("nodes", [4, 16])
def test_tree_nodes_match_hf_on_every_route(kind, nodes):
    tm = _target(kind, 24, seed=nodes)
    p = prompt(tm.vocab_size, 9, seed=nodes)
    logp, toks = draft_topk(torch.randn(6, tm.vocab_size, generator=torch.Generator().manual_seed(nodes)) * 3, 24)
    tree = build_tree(5, logp, toks, budget=nodes)  # verifies 1 + nodes rows
    state = TargetState(tm, 64)
    forward(tm, state, chain_span(torch.tensor([p]), 0, tm.dtype, True))
    with torch.no_grad():
        h, _ = forward(tm, state, tree_span(tree, len(p), tm.device, tm.dtype, tm.conv_kernel))
        logits = tm.lm_head(h[0])  # (1 + nodes, V)
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        ref = tm.hf(torch.tensor([p + path[::-1]])).logits[0, -1]  # under autograd: F.linear's route
        assert ((logits[i] - ref).abs().max() / ref.abs().max()).item() < 1e-4, f"node {i}"


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("seed", [0])
def test_lossless_on_every_route(kind, seed):
    """A 16-slot drafter block, DFlash chains of 16 rows, trees of 5 / 16 / 17 rows."""
    tm = _target(kind, 32, seed)
    drafter = tiny_drafter(tm, seed=seed, block=16)
    p = prompt(tm.vocab_size, 12, seed=seed)
    ar = generate_ar(tm, p, 40)
    assert generate_dflash(tm, drafter, p, 40).tokens == ar.tokens
    for budget in (4, 15, 16):
        assert generate_ddtree(tm, drafter, p, 40, budget=budget).tokens == ar.tokens, f"budget {budget}"
