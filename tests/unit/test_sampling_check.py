"""The T > 0 lossless check (evaluate/sampling_check.py): the χ² test and its stated power, the PIT of a
correct sampler is uniform, and a sampler that draws from another distribution is caught."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import (  # noqa: E402
    generate_ar,
    generate_ddtree,
    generate_dflash,
    loops,
    wrap_target,
)
from draftforge.evaluate.sampling_check import detectable_tv, pit_values, pooled_checks, uniformity  # noqa: E402
from draftforge.target.config import RandomTargetConfig  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402
from engine_fixtures import one_thread, tiny_drafter  # noqa: E402, F401  (one_thread: autouse fixture)


def test_uniform_values_pass_and_skewed_ones_fail():
    rng = np.random.default_rng(0)
    ok = uniformity(rng.random(2000).tolist(), bins=10, alpha=0.001)
    assert ok["passed"] is True and ok["n"] == 2000 and sum(ok["counts"]) == 2000 and ok["dof"] == 9
    assert ok["tv"] < 0.05 and 0 < ok["detectable_tv"] < 0.1
    skewed = uniformity(rng.beta(0.8, 1.0, 2000).tolist(), bins=10, alpha=0.001)
    assert skewed["passed"] is False and skewed["p_value"] < 1e-6
    few = uniformity([0.5] * 20, bins=10, alpha=0.001)
    assert few["passed"] is None and few["p_value"] is None  # fewer than 5 expected per bin: not tested


def test_detectable_tv_is_detected_at_the_stated_power():
    """Histograms at exactly the stated TV (the least detectable shape: the deviation spread over all bins)
    are rejected in ~80% of seeded trials; half that TV far less often; a smaller n states a larger TV."""
    n, bins, alpha = 1000, 10, 0.01
    delta = detectable_tv(n, bins, alpha)
    assert detectable_tv(4 * n, bins, alpha) == pytest.approx(delta / 2, rel=1e-6)  # δ* ∝ 1/√n

    def rejection_rate(tv: float) -> float:
        q = np.full(bins, 1.0 / bins) + np.where(np.arange(bins) % 2 == 0, 2 * tv / bins, -2 * tv / bins)
        rng = np.random.default_rng(1)
        hits = 0
        for _ in range(400):
            idx = rng.choice(bins, size=n, p=q)
            u = (idx + rng.random(n)) / bins
            hits += uniformity(u.tolist(), bins, alpha)["passed"] is False
        return hits / 400

    assert 0.72 <= rejection_rate(delta) <= 0.88
    assert rejection_rate(delta / 2) < 0.35


def _flat_target(seed: int = 3):
    spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=4, hidden_size=32, intermediate_size=64,
                              num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, seed=seed)  # fmt: skip
    model = build_random_model(spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)  # flat next-token laws: drafts are accepted often
    return wrap_target(model, (0,))


def _pits(tm, drafter, method: str, responses: int, seed: int) -> tuple[list[float], int]:
    """PIT values of `responses` 8-token answers at T = 1 from `method`; also the accepted drafts."""
    gen = torch.Generator().manual_seed(seed)
    u, accepted = [], 0
    for i in range(responses):
        p = [i % 4, 1 + i % 3, 2]
        if method == "ar":
            res = generate_ar(tm, p, 8, temperature=1.0, generator=gen)
        elif method == "dflash":
            res = generate_dflash(tm, drafter, p, 8, temperature=1.0, generator=gen)
        else:
            res = generate_ddtree(tm, drafter, p, 8, budget=8, temperature=1.0, generator=gen)
        accepted += sum(a - 1 for a in res.accept_lengths)
        u += pit_values(tm, p, res.tokens, 1.0, seed=10_000 + i)
    return u, accepted


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_pit_of_a_lossless_sampler_is_uniform(method):
    tm = _flat_target()
    drafter = tiny_drafter(tm, seed=1, block=4)
    u, accepted = _pits(tm, drafter, method, responses=150, seed=7)
    assert len(u) == 150 * 8 and all(0.0 <= x <= 1.0 for x in u)
    if method != "ar":
        assert accepted > 150, "drafts must be accepted often for the check to test the acceptance path"
    check = uniformity(u, bins=10, alpha=0.001)
    assert check["passed"] is True, check


def test_a_verify_that_samples_another_temperature_is_caught(monkeypatch):
    """The bug a T > 0 check exists for: the verify forward samples at T = 0.6 while the engine serves T = 1 (the
    prompt's first token is still drawn right). The responses of the passing test's seeds fail the check."""
    tm = _flat_target()
    drafter = tiny_drafter(tm, seed=1, block=4)
    real = loops.verify_round

    def cooler(tm, state, method, drafted, bonus, temperature, gen, timer, engine=None):
        return real(tm, state, method, drafted, bonus, 0.6 * temperature, gen, timer, engine)

    monkeypatch.setattr(loops, "verify_round", cooler)
    u, accepted = _pits(tm, drafter, "ddtree", responses=150, seed=7)
    check = uniformity(u, bins=10, alpha=0.001)
    assert check["passed"] is False and check["p_value"] < 1e-6, check
    assert check["counts"][0] > check["counts"][-1]  # too many of the most likely tokens: the bottom bins fill


def test_pooled_checks_group_by_temperature_and_method_and_count_accepted_drafts():
    rng = np.random.default_rng(2)
    recs = [{"temperature": 1.0, "method": m, "accept_lengths": [2, 1, 3], "pit": rng.random(40).tolist()}
            for m in ("ddtree", "ddtree", "ar")] + [{"temperature": 0.0, "method": "ar", "accept_lengths": [1]}]
    checks = pooled_checks(recs, bins=4, alpha=0.001)
    assert [(c["temperature"], c["method"], c["responses"], c["n"]) for c in checks] == [(1.0, "ar", 1, 40), (1.0, "ddtree", 2, 80)]
    assert checks[1]["accepted_drafts"] == 6 and checks[1]["passed"] is True


def test_pit_refuses_greedy():
    tm = _flat_target()
    with pytest.raises(ValueError, match="temperature 0"):
        pit_values(tm, [1, 2], [3], 0.0, seed=0)
