"""The CPU decode-attention kernel (engine/csrc/decode_attention.cpp) computes SDPA's function where `blocks.attend`
routes to it, and only there; each row's result depends neither on the thread count nor on the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftforge.engine import blocks, cpu_kernel


@pytest.fixture(autouse=True)
def built_kernel() -> None:
    if not cpu_kernel.available("decode_attention"):
        pytest.skip(f"the AVX2 kernel is unavailable here: {cpu_kernel.unavailable_reason('decode_attention')}")


def _case(G: int, R: int, D: int, L: int, masked: bool, seed: int = 0):
    """q (1, G, R, D), k / v views of the first L rows of a larger cache, an additive mask with hidden keys or None."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, G, L + 37, D, generator=g)
    qf = torch.randn(1, G, R, D, generator=g)
    mask = None
    if masked:
        hide = torch.rand(R, L, generator=g) < 0.4
        hide[:, torch.randint(L, (1,), generator=g)] = False  # every row sees a key
        mask = torch.zeros(1, 1, R, L).masked_fill(hide, float("-inf"))
    return qf, cache[0, :, :L][None], cache[1, :, :L][None], mask


@pytest.mark.parametrize("G,R,D,L,masked", [(3, 3, 64, 257, False), (3, 12, 64, 300, True), (2, 5, 32, 5, True),
                                             (1, 7, 128, 77, True), (4, 1, 8, 1, False), (3, 39, 64, 301, True),
                                             (1, 2, 24, 33, True), (2, 9, 16, 1000, False)])
def test_the_kernel_computes_sdpa(G, R, D, L, masked):
    qf, k, v, mask = _case(G, R, D, L, masked)
    got = cpu_kernel.decode_attention(qf[0], k[0], v[0], None if mask is None else mask[0, 0], L, 0.1)[None]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=0.1),
                               rtol=1e-5, atol=2e-6)


def test_a_rows_result_depends_neither_on_threads_nor_on_its_neighbours():
    qf, k, v, mask = _case(3, 7, 64, 130, True, seed=1)
    m = mask[0, 0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.decode_attention(qf[0], k[0], v[0], m, 130, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(2, threads))
    try:
        assert torch.equal(cpu_kernel.decode_attention(qf[0], k[0], v[0], m, 130, 0.125), one)
    finally:
        torch.set_num_threads(threads)
    for r in range(7):  # alone, a row is computed in a pass of one instead of a pass of four
        alone = cpu_kernel.decode_attention(qf[0, :, r : r + 1].contiguous(), k[0], v[0], m[r : r + 1].contiguous(), 130, 0.125)
        assert torch.equal(alone[:, 0], one[:, r])


def test_attend_routes_few_fp32_rows_without_autograd_to_the_kernel(monkeypatch):
    calls = []
    real = cpu_kernel.decode_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = blocks.KERNEL_ATTENTION_ROWS
    with torch.no_grad():
        qf, k, v, mask = _case(3, rows, 64, 40, True)
        torch.testing.assert_close(blocks.attend_folded(qf, k, v, mask, None),
                                   F.scaled_dot_product_attention(qf, k, v, attn_mask=mask), rtol=1e-5, atol=2e-6)
        assert calls == [(3, rows, 64)]  # scale None: hd^-1/2, as SDPA's default
        q = torch.randn(1, 6, 1, 64)  # an AR step: 2 query heads per KV head, no mask
        torch.testing.assert_close(blocks.attend(q, k, v, None, False, 0.125),
                                   F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                  scale=0.125), rtol=1e-5, atol=2e-6)  # fmt: skip
        assert calls[-1] == (3, 2, 64)
        n = len(calls)
        blocks.attend_folded(*_case(3, rows + 1, 64, 40, True), None)  # more rows: SDPA
        blocks.attend_folded(qf.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(), None)  # not fp32
        blocks.attend_folded(qf, k, v, mask.isfinite(), None)  # a boolean mask
        blocks.attend(torch.randn(1, 9, 4, 64), k, v, None, True, None)  # a prefill from row 0: SDPA's causal rule
    blocks.attend_folded(qf.requires_grad_(), k, v, mask, None)  # autograd
    assert len(calls) == n


def test_without_the_kernel_attention_stays_on_sdpa_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "_modules", {})
    monkeypatch.setattr(cpu_kernel, "_reasons", {})
    monkeypatch.setenv("DRAFTFORGE_CPU_KERNEL", "0")
    qf, k, v, mask = _case(3, 3, 64, 40, True)
    with torch.no_grad():
        out = blocks.attend_folded(qf, k, v, mask, 0.125)
    assert torch.equal(out, F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=0.125))
    assert "DRAFTFORGE_CPU_KERNEL=0" in cpu_kernel.unavailable_reason("decode_attention")
    assert [r.getMessage() for r in caplog.records if "decode_attention is unavailable" in r.getMessage()]
