"""engine/cpu_linear.py: prepacked oneDNN linears compute F.linear's function, never read a stale weight, and
leave autograd to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine.cpu_linear import PACK_MIN, SMALL_WEIGHT, linear, pack_linears, weight_left

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _lin(n_out: int, n_in: int, bias: bool) -> nn.Linear:
    torch.manual_seed(n_out + n_in)
    return nn.Linear(n_in, n_out, bias=bias)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 16, 17, 32])  # GEMV, W·xᵀ (2-5, 16, 32), oneDNN (6, 17)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_and_is_repacked_after_a_weight_change(rows, bias):
    big = _lin(SMALL_WEIGHT // 64 + 1, 64, bias)  # one row through a large weight also goes through oneDNN
    small = _lin(PACK_MIN // 64 + 1, 64, bias)  # packed; one row stays on F.linear
    for lin in (big, small):
        assert pack_linears(lin) == 1 and pack_linears(lin) == 0  # idempotent
        x = torch.randn(1, rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            lin.weight.mul_(-2.0)  # in place, as an optimizer step: the packed copy must not be read
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            lin.load_state_dict({k: v * 0.5 for k, v in lin.state_dict().items()})
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_a_tiny_weight_is_left_on_f_linear():
    tiny = _lin(64, 64, False)
    assert pack_linears(tiny) == 0 and not hasattr(tiny, "_draftforge_packed")


def test_autograd_goes_through_f_linear():
    lin = _lin(PACK_MIN // 16 + 1, 16, True)
    assert pack_linears(lin) == 1
    x = torch.randn(3, 16)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, torch.ones(PACK_MIN // 16 + 1, 1) * x.sum(0)[None])


def test_weight_left_rows_and_leading_dims():
    assert [r for r in range(1, 41) if weight_left(r)] == [2, 3, 4, 5, 16, 24, 32, 40]
    lin = _lin(PACK_MIN // 64 + 1, 64, True)
    pack_linears(lin)
    x = torch.randn(2, 8, 64)  # 16 rows over two leading dims: the W·xᵀ path keeps the leading shape
    with torch.no_grad():
        y = lin(x)
    assert y.shape == (2, 8, PACK_MIN // 64 + 1)
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 15, 16])
def test_linear_for_an_unpacked_weight_is_f_linear(rows):
    w = torch.randn(300, 64)  # a draft-vocabulary head: a buffer, not an nn.Linear
    x = torch.randn(rows, 64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    wg = w.clone().requires_grad_(True)
    linear(x, wg).sum().backward()  # under autograd: F.linear's graph
    torch.testing.assert_close(wg.grad, x.sum(0)[None].expand(300, 64))
