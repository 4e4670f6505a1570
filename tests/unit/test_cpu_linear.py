"""engine/cpu_linear.py: every route computes F.linear's function, a packed copy is never stale, autograd and
unregistered weights stay on F.linear, and the tuner's choice is measured once per (shape, rows) and kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine import cpu_kernel, cpu_linear
from draftforge.engine.cpu_linear import PACK_MIN, ROUTES, linear, register, route_for, route_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _usable(route: str) -> bool:
    return route != "kernel" or cpu_kernel.available()


def _lin(n_out: int, n_in: int, bias: bool) -> nn.Linear:
    torch.manual_seed(n_out + n_in)
    return nn.Linear(n_in, n_out, bias=bias)


@pytest.mark.parametrize("policy", [*ROUTES, "fixed", "auto"])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_every_route_is_f_linear_and_never_reads_a_stale_copy(monkeypatch, policy, rows, bias):
    if not _usable(policy):
        pytest.skip(f"the AVX2 kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", policy)
    lin = _lin(PACK_MIN // 64 + 1, 64, bias)
    assert route_linears(lin) == 1 and route_linears(lin) == 0  # idempotent
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(-2.0)  # in place, as an optimizer step: a packed copy must not be read
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.load_state_dict({k: v * 0.5 for k, v in lin.state_dict().items()})
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    if policy in ROUTES:
        assert route_for(lin.weight, rows) == policy


def test_the_tuner_measures_once_per_shape_and_rows(monkeypatch):
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "auto")
    lins = [_lin(PACK_MIN // 48 + 7, 48, False) for _ in range(3)]  # one group: a shape of their own
    for lin in lins:
        route_linears(lin)
    x = torch.randn(3, 48)
    state = torch.get_rng_state()
    with torch.no_grad():
        lins[0](x)
    assert torch.equal(torch.get_rng_state(), state)  # timing draws from its own generator (seeded sampling stays put)
    picked = cpu_linear.tuned_routes()[f"{PACK_MIN // 48 + 7}x48"]["3"]
    usable = {r for r in ROUTES if _usable(r)}  # auto times every route this machine has (the kernel where built)
    assert picked["route"] in usable and set(picked["ms"]) == usable
    calls = []
    monkeypatch.setattr(cpu_linear, "_tune", lambda *a: calls.append(a) or ("gemv", {}))
    with torch.no_grad():
        lins[2](torch.randn(3, 48))  # the same shape and rows: the kept choice, no new timing
    assert not calls and route_for(lins[1].weight, 3) == picked["route"]


def test_pretune_chooses_every_missing_pair_once_and_decoding_then_times_nothing(monkeypatch):
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "auto")
    lin = _lin(PACK_MIN // 40 + 3, 40, True)  # a shape of its own
    route_linears(lin)
    with torch.no_grad():
        lin(torch.randn(2, 40))  # rows 2 chosen by use; pretune must keep that choice
    kept = route_for(lin.weight, 2)
    state = torch.get_rng_state()
    assert cpu_linear.pretune(range(1, 6)) >= 4  # rows 1, 3, 4, 5 of this shape (other tests' shapes may add more)
    assert torch.equal(torch.get_rng_state(), state)
    assert cpu_linear.pretune(range(1, 6)) == 0  # nothing left to choose
    routes = cpu_linear.tuned_routes()[f"{PACK_MIN // 40 + 3}x40"]
    assert set(routes) >= {"1", "2", "3", "4", "5"} and routes["2"]["route"] == kept
    calls = []
    monkeypatch.setattr(cpu_linear, "_tune", lambda *a: calls.append(a) or ("gemv", {}))
    x = torch.randn(5, 40)
    with torch.no_grad():
        for rows in range(1, 6):
            torch.testing.assert_close(lin(x[:rows]), F.linear(x[:rows], lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not calls  # every row count the decode meets was chosen before it
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "gemv")
    assert cpu_linear.pretune(range(6, 9)) == 0  # a pinned route has nothing to choose


def test_a_bad_policy_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "fastest")
    lin = _lin(PACK_MIN // 64 + 1, 64, False)
    route_linears(lin)
    with torch.no_grad(), pytest.raises(ValueError, match="DRAFTFORGE_CPU_LINEAR='fastest'"):
        lin(torch.randn(2, 64))


def test_tiny_and_unregistered_weights_stay_on_f_linear(monkeypatch):
    tiny = _lin(64, 64, False)
    assert route_linears(tiny) == 0 and not getattr(tiny, "_draftforge_routed", False)
    assert not register(torch.randn(64, 64)) and not register(torch.randn(PACK_MIN, 2, dtype=torch.float64))
    calls = []
    monkeypatch.setattr(cpu_linear, "run_route", lambda *a: calls.append(a))
    w, x = torch.randn(301, 64), torch.randn(4, 64)  # a shape never registered
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=0, atol=0)
    assert not calls


def test_autograd_goes_through_f_linear():
    lin = _lin(PACK_MIN // 16 + 1, 16, True)
    assert route_linears(lin) == 1
    x = torch.randn(3, 16)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, torch.ones(PACK_MIN // 16 + 1, 1) * x.sum(0)[None])


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_a_registered_buffer_weight_routes_with_leading_dims(rows):
    w = torch.randn(PACK_MIN // 64 + 3, 64)  # a draft-vocabulary head: a buffer, not an nn.Linear
    assert register(w)
    x = torch.randn(2, rows, 64)
    with torch.no_grad():
        y = linear(x, w)
    assert y.shape == (2, rows, PACK_MIN // 64 + 3)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_auto_keeps_the_library_routes_and_a_pinned_kernel_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "_modules", {})
    monkeypatch.setattr(cpu_kernel, "_reasons", {})
    monkeypatch.setenv("DRAFTFORGE_CPU_KERNEL", "0")
    assert not cpu_kernel.available() and "DRAFTFORGE_CPU_KERNEL=0" in cpu_kernel.unavailable_reason()
    assert [r.getMessage() for r in caplog.records if "skinny_linear is unavailable" in r.getMessage()]  # said, not silent
    assert cpu_linear.candidates("auto", (4096, 64)) == cpu_linear.LIBRARY_ROUTES
    lin = _lin(PACK_MIN // 56 + 5, 56, False)
    route_linears(lin)
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "kernel")
    with torch.no_grad(), pytest.raises(ValueError, match="DRAFTFORGE_CPU_LINEAR=kernel: the kernel is unavailable"):
        lin(torch.randn(2, 56))


def test_the_kernel_takes_only_widths_of_whole_vectors(monkeypatch):
    if not cpu_kernel.available():
        pytest.skip(f"the AVX2 kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    assert cpu_linear.candidates("auto", (4096, 64)) == ROUTES
    assert cpu_linear.candidates("auto", (4096, 60)) == cpu_linear.LIBRARY_ROUTES  # K % 8: no kernel
    assert cpu_linear.candidates("library", (4096, 64)) == cpu_linear.LIBRARY_ROUTES
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "kernel")
    odd = _lin(PACK_MIN // 60 + 9, 60, True)
    route_linears(odd)
    x = torch.randn(3, 60)
    with torch.no_grad():
        assert route_for(odd.weight, 3) == "gemv"  # a pinned kernel serves the shapes it cannot take on F.linear
        torch.testing.assert_close(odd(x), F.linear(x, odd.weight, odd.bias), rtol=1e-5, atol=1e-5)


def test_the_kernel_equals_f_linear_for_every_pass_split_and_prefetch_range():
    """Rows 1…19 cover every split of the kernel's passes (3s, then 2 + 2, 2 or 1) and so every share of the next
    block's lines a pass prefetches; K = 72 is not a whole number of 64-byte lines and N % 4 = 3 leaves a tail."""
    if not cpu_kernel.available():
        pytest.skip(f"the AVX2 kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
    torch.manual_seed(0)
    w, bias = torch.randn(4 * 37 + 3, 72), torch.randn(4 * 37 + 3)
    for rows in range(1, 20):
        x = torch.randn(rows, 72)
        torch.testing.assert_close(cpu_kernel.skinny_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cpu_kernel.skinny_linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_pretune_times_again_a_choice_unlike_its_neighbours(monkeypatch):
    """A route chosen on a slow sample (all routes timed during a host slowdown) is re-timed when it differs from
    both neighbouring row counts' routes; a choice that agrees with a neighbour is timed once."""
    monkeypatch.setenv("DRAFTFORGE_CPU_LINEAR", "auto")
    lin = _lin(PACK_MIN // 24 + 5, 24, False)  # a shape of its own
    route_linears(lin)
    answers = {1: ["gemv"], 2: ["gemv"], 3: ["left", "gemv"], 4: ["gemv"]}  # rows 3: a slow sample picks `left` once
    calls = []

    def fake_tune(group, rows, w0, routes=cpu_linear.LIBRARY_ROUTES):
        if tuple(w0.shape) != tuple(lin.weight.shape):  # other tests' shapes in this process
            return "gemv", {}
        calls.append(rows)
        return answers[rows].pop(0), {}

    monkeypatch.setattr(cpu_linear, "_tune", fake_tune)
    assert cpu_linear.pretune(range(1, 5)) >= 4  # other tests' shapes may add more
    assert sorted(calls) == [1, 2, 3, 3, 4]  # rows 3 timed twice
    with torch.no_grad():
        assert [route_for(lin.weight, m) for m in range(1, 5)] == ["gemv"] * 4
