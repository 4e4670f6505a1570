"""The CPU layer-ops kernel (engine/csrc/layer_ops.cpp) computes what the modules and torch expressions it replaces
compute (the rotary bit for bit), serves only fp32 CPU calls without autograd, and only modules a probe showed to be
the plain RMSNorm / SiLU; the target's and the drafter's passes give the same states with it as without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.engine_fixtures import one_thread, prompt, tiny_drafter, tiny_target  # noqa: F401
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftforge.drafter.model import RMSNorm
from draftforge.engine import blocks, cpu_kernel, layer_ops
from draftforge.engine.draft import DrafterContext
from draftforge.engine.span import chain_span
from draftforge.engine.state import TargetState
from draftforge.engine.target import forward


@pytest.fixture(autouse=True)
def built_kernel() -> None:
    if not cpu_kernel.available("layer_ops"):
        pytest.skip(f"the layer-ops kernel is unavailable here: {cpu_kernel.unavailable_reason('layer_ops')}")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _norm(cls: type, n: int, seed: int) -> nn.Module:
    norm = cls(n, 1e-6) if cls is RMSNorm else cls(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, generator=_gen(seed)))
    return norm.requires_grad_(False)


class OnePlusWeightNorm(nn.Module):
    """The (1 + weight) RMSNorm some models use: not the plain form, so the kernel must not serve it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("cls", [LlamaRMSNorm, RMSNorm])
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 5, 64), (3, 7, 16), (1, 13, 960)])
def test_norms_compute_the_modules_function(cls, shape):
    norm = _norm(cls, shape[-1], seed=len(shape))
    x, r = 3 * torch.randn(shape, generator=_gen(1)), torch.randn(shape, generator=_gen(2))
    with torch.no_grad():
        torch.testing.assert_close(layer_ops.rms_norm(norm, x), norm(x), rtol=2e-6, atol=1e-6)
        s, y = layer_ops.add_rms_norm(norm, x, r)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(y, norm(x + r), rtol=2e-6, atol=1e-6)
    assert norm.__dict__["_draftforge_rms"] == 1e-6


@pytest.mark.parametrize("shape", [(1, 1, 3072), (1, 6, 256), (2, 3, 16), (1, 3, 26)])
def test_silu_mul_computes_silu_times_up(shape):
    gu = 6 * torch.randn(shape, generator=_gen(3))
    gu.view(-1)[:6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5])  # exp's range ends; 26: a tail of 5 lanes
    g, u = gu.chunk(2, dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(layer_ops.act_mul(None, gu), F.silu(g) * u, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(layer_ops.act_mul(nn.SiLU(), gu), F.silu(g) * u, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("n_heads,n_kv,hd,n", [(9, 3, 64, 1), (9, 3, 64, 13), (4, 2, 16, 5), (2, 2, 8, 3)])
def test_rotary_equals_torchs_bit_for_bit(n_heads, n_kv, hd, n):
    qkv = torch.randn(1, n, (n_heads + 2 * n_kv) * hd, generator=_gen(4))
    ang = torch.randn(1, 1, n, hd // 2, generator=_gen(5)).repeat(1, 1, 1, 2)
    cos, sin = ang.cos(), ang.sin()
    with torch.no_grad():
        got = layer_ops.rope_heads(nn.Module(), qkv, cos, sin, n_heads, n_kv, hd, qk_norm=False)
        q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
        want = blocks.split_heads(nn.Module(), q, k, v, cos, sin, n_heads, n_kv, hd, False, False)[:3]
    assert got is not None
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)


def test_rotary_with_qk_norms_matches_the_modules():
    n_heads, n_kv, hd, n = 4, 2, 16, 6
    attn = nn.Module()
    attn.q_norm, attn.k_norm = _norm(LlamaRMSNorm, hd, 6), _norm(LlamaRMSNorm, hd, 7)
    qkv = torch.randn(1, n, (n_heads + 2 * n_kv) * hd, generator=_gen(8))
    ang = torch.randn(1, 1, n, hd // 2, generator=_gen(9)).repeat(1, 1, 1, 2)
    with torch.no_grad():
        got = layer_ops.rope_heads(attn, qkv, ang.cos(), ang.sin(), n_heads, n_kv, hd, qk_norm=True)
        q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
        want = blocks.split_heads(attn, q, k, v, ang.cos(), ang.sin(), n_heads, n_kv, hd, True, False)[:3]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_only_probed_modules_and_plain_calls_take_the_kernel(monkeypatch):
    calls: list[str] = []
    real = cpu_kernel.layer_ops()

    class Spy:
        def __getattr__(self, name: str):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_kernel, "layer_ops", lambda: Spy())
    x = torch.randn(1, 3, 32, generator=_gen(10))
    other = OnePlusWeightNorm(32)
    with torch.no_grad():
        assert torch.equal(layer_ops.rms_norm(other, x), other(x))  # probed (one kernel call), then the module
    assert other.__dict__["_draftforge_rms"] is None and calls == ["rms_norm"]
    gelu = nn.GELU()
    gu = torch.randn(1, 3, 64, generator=_gen(11))
    with torch.no_grad():
        assert torch.equal(layer_ops.act_mul(gelu, gu), gelu(gu[..., :32]) * gu[..., 32:])
    assert gelu.__dict__["_draftforge_silu"] is False

    calls.clear()
    norm = _norm(LlamaRMSNorm, 32, 12).requires_grad_(True)
    out = layer_ops.rms_norm(norm, x)  # autograd: the module, so gradients flow
    assert out.grad_fn is not None and calls == []
    with torch.no_grad():
        assert torch.equal(layer_ops.rms_norm(norm, x.bfloat16()), norm(x.bfloat16()))
        long = torch.randn(1, layer_ops.KERNEL_ROWS + 1, 32, generator=_gen(13))  # a prefill: torch's ops
        assert torch.equal(layer_ops.rms_norm(norm, long), norm(long))
        assert torch.equal(layer_ops.rms_norm(norm, x.transpose(1, 2).contiguous().transpose(1, 2)), norm(x))
        monkeypatch.setattr(layer_ops, "ENABLED", False)
        assert torch.equal(layer_ops.rms_norm(norm, x), norm(x))
    assert calls == []


def test_the_kernel_names_what_is_wrong():
    ops = cpu_kernel.layer_ops()
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="weight has 5 values for rows of 8"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(5), 1e-6)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"qkv width 40 is not \(2 \+ 2·1\)·8"):
        ops.rope_heads(torch.randn(1, 1, 40), torch.ones(1, 8), torch.ones(1, 8), 2, 1, 8, None, None, 1e-6)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_target_and_drafter_passes_agree_with_and_without_the_kernel(arch, monkeypatch):
    tm = tiny_target(arch)
    d = tiny_drafter(tm)
    ids = torch.tensor([prompt(tm.vocab_size, 9)])
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(layer_ops, "ENABLED", enabled)
        state = TargetState(tm, 32)
        with torch.no_grad():
            h, taps = forward(tm, state, chain_span(ids, 0, tm.dtype, commit_all=True), want_taps=True)
            ctx = DrafterContext(d, tm)
            ctx.add(taps)
            out[enabled] = (h, taps, ctx.block_logits(5, ids.shape[1]))
    for a, b in zip(out[True], out[False]):  # rounding of 4 + 1 random layers apart: within 1e-5 of each one's scale
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    # the kernel served the target's and the drafter's norms (a probe verdict is kept only where one ran)
    assert tm.layers[0].input_layernorm.__dict__["_draftforge_rms"] is not None
    assert d.layers[0].post_attention_layernorm.__dict__["_draftforge_rms"] is not None
