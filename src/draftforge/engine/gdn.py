"""Gated DeltaNet (linear attention) layers of hybrid targets, over a verify tree in one pass.

Conventions (transformers' Qwen3.5 / Qwen3-Next GatedDeltaNet): a causal depthwise conv (kernel K) + SiLU
over the projected [q; k; v]; q and k l2-normalised (eps 1e-6), q scaled by dk^-1/2; β = sigmoid(b); log-gate
g = −exp(A_log)·softplus(a + dt_bias) ≤ 0; per token along a sequence:
    S ← e^g S;   Δ = β (v − Sᵀk);   S ← S + k Δᵀ;   o = Sᵀq          S: (Hv, dk, dv)
then a gated RMSNorm with z and the output projection.

Tree form (docs/architecture.md, "Hybrid targets"): with G_i the sum of g along node i's root path and
anc*(i) its ancestors including itself, unrolling the recurrence along each root path gives
    (I + A) Δ = β ⊙ (v − e^G ⊙ K S₀),   A[i, j] = β_i e^(G_i − G_j) (k_i·k_j) for j a strict ancestor of i
    o_i = e^(G_i) q_i S₀ + Σ_{j ∈ anc*(i)} e^(G_i − G_j) (q_i·k_j) Δ_j
    S(m) = e^(G_m) S₀ + Σ_{j ∈ anc*(m)} e^(G_m − G_j) k_j Δ_jᵀ        (state after the path ending at m)
(I + A) is unit lower-triangular in topological order, so one triangular solve gives Δ: no per-node
states. A chain is the one-path tree (A restricted to the causal triangle), which is also how a long
prompt is prefilled, chunk by chunk. All of it runs in fp32 (or the model's dtype if wider).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from draftforge.engine.state import GDNScratch

PREFILL_CHUNK = 64  # prompt tokens per dense triangular block (O(chunk²) memory per head)


@dataclass
class GDNShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


def gdn_shape(mixer: nn.Module) -> GDNShape:
    return GDNShape(mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, mixer.conv_kernel_size)


def project(mixer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (1, n, H) → conv input (n, conv_dim), z (n, Hv, dv), b (n, Hv), a (n, Hv) for either HF layout."""
    n = x.shape[1]
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5: separate projections
        mixed = mixer.in_proj_qkv(x)[0]
        z = mixer.in_proj_z(x)[0].view(n, -1, mixer.head_v_dim)
        return mixed, z, mixer.in_proj_b(x)[0], mixer.in_proj_a(x)[0]
    # Qwen3-Next: fused, per-key-head interleaved projections; the module's own reordering is the reference.
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    mixed = torch.cat([t.reshape(1, n, -1) for t in (q, k, v)], dim=-1)[0]
    return mixed, z[0], b[0], a[0]


def conv_window_index(depths: torch.Tensor, anc_at: torch.Tensor | None, K: int) -> torch.Tensor:
    """(n, K) rows into [conv state (K−1 rows, oldest first); span inputs (n rows)] for each node's window.

    Column o is the node's o-th ancestor (0 = itself), reaching into the committed conv state past the
    span's root. anc_at None means a chain (node i's o-th ancestor is i − o).
    """
    n = depths.shape[0]
    o = torch.arange(K, device=depths.device)[None]  # (1, K)
    if anc_at is None:
        return (K - 1) + torch.arange(n, device=depths.device)[:, None] - o
    in_tree = o <= depths[:, None]
    return torch.where(in_tree, (K - 1) + anc_at.clamp(min=0), (K - 1) - (o - depths[:, None]))


def ancestors_at(parents: torch.Tensor, K: int) -> torch.Tensor:
    """parents (n,) (−1 at the root) → (n, K): column o = the o-th ancestor (−1 past the root)."""
    cols = [torch.arange(parents.shape[0], device=parents.device)]
    for _ in range(1, K):
        prev = cols[-1]
        cols.append(torch.where(prev >= 0, parents[prev.clamp(min=0)], prev))
    return torch.stack(cols, dim=1)


def tree_conv(conv_in: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
              window: torch.Tensor) -> torch.Tensor:
    """conv_in (n, C), conv_state (K−1, C), weight (C, K) (column K−1 = newest), window (n, K) → SiLU(conv) (n, C)."""
    rows = torch.cat([conv_state.to(conv_in.dtype), conv_in], dim=0)  # (K-1+n, C)
    taps = rows[window.flip(1)]  # (n, K, C): oldest first, matching the weight's column order
    return F.silu(torch.einsum("nkc,ck->nc", taps.to(weight.dtype), weight)).to(conv_in.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence runs in fp32 (fp64 for an fp64 model, as exactness tests use)."""
    return torch.promote_types(dtype, torch.float32)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def qkv_gates(mixer: nn.Module, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """conv_out (n, C) → q, k (Hv, n, dk) fp32 normalised (q scaled), v (Hv, n, dv), g, β (Hv, n) fp32."""
    n = conv_out.shape[0]
    ct = compute_dtype(conv_out.dtype)
    kd, vd = mixer.num_k_heads * mixer.head_k_dim, mixer.num_v_heads * mixer.head_v_dim
    q, k, v = torch.split(conv_out.to(ct), [kd, kd, vd], dim=-1)
    q = q.view(n, mixer.num_k_heads, mixer.head_k_dim)
    k = k.view(n, mixer.num_k_heads, mixer.head_k_dim)
    rep = mixer.num_v_heads // mixer.num_k_heads
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = _l2norm(q) * mixer.head_k_dim**-0.5
    k = _l2norm(k)
    v = v.view(n, mixer.num_v_heads, mixer.head_v_dim)
    g = -mixer.A_log.to(ct).exp() * F.softplus(a.to(ct) + mixer.dt_bias.to(ct))  # (n, Hv)
    beta = b.to(ct).sigmoid()
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T


def delta_rule_tree(q, k, v, g, beta, S0: torch.Tensor, anc: torch.Tensor):
    """One span (tree or chain) from state S0 (Hv, dk, dv); anc (n, n) bool ancestor-or-self.

    q, k (Hv, n, dk); v (Hv, n, dv); g, β (Hv, n). → outputs (Hv, n, dv), G (Hv, n), Δ (Hv, n, dv).
    """
    ancf = anc.to(g.dtype)
    G = g @ ancf.T  # (Hv, n): G_i = Σ_{j ∈ anc*(i)} g_j
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~anc, float("-inf"))  # (Hv, n, n), ≤ 0 where defined
    decay = diff.exp()  # e^(G_i − G_j) on anc*(i), 0 elsewhere
    eG = G.exp()[..., None]  # (Hv, n, 1)
    strict = decay * (~torch.eye(anc.shape[0], dtype=torch.bool, device=anc.device))
    A = beta[..., None] * strict * (k @ k.transpose(1, 2))  # (Hv, n, n) strictly lower
    rhs = beta[..., None] * (v - eG * (k @ S0))  # (Hv, n, dv)
    eye = torch.eye(anc.shape[0], dtype=A.dtype, device=A.device)
    delta = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    out = eG * (q @ S0) + (decay * (q @ k.transpose(1, 2))) @ delta
    return out, G, delta


def state_after(S0: torch.Tensor, G: torch.Tensor, K: torch.Tensor, delta: torch.Tensor,
                path: torch.Tensor) -> torch.Tensor:
    """Recurrent state after the root path `path` (ascending span indices, ending at node m)."""
    m = path[-1]
    w = (G[:, m : m + 1] - G[:, path]).exp()  # (Hv, p): e^(G_m − G_j)
    Kp = K[:, path] * w[..., None]  # (Hv, p, dk)
    return G[:, m].exp()[:, None, None] * S0 + Kp.transpose(1, 2) @ delta[:, path]


def mix(mixer: nn.Module, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, span: "GDNSpan",
        scratch: "GDNScratch | None", layer_slot: int) -> torch.Tensor:
    """The GDN token mixer over a span: x (1, n, H) normed → (1, n, H). One function for every engine.

    span.commit_all (prefill, eager AR step): the span is a chain committed whole; conv_state (K−1, C) and
    rec_state (Hv, dk, dv) advance in place. Otherwise (verify) the states are untouched and the span's
    conv inputs, G, K and Δ go to rows 0..n−1 of `scratch` at `layer_slot`, from which
    `TargetState.commit(path)` advances every layer along the accepted path.
    """
    n = x.shape[1]
    conv_in, z, b, a = project(mixer, x)
    K = mixer.conv_kernel_size
    window = conv_window_index(span.depths, span.anc_at, K)
    conv_out = tree_conv(conv_in, conv_state, mixer.conv1d.weight[:, 0], window)
    q, k, v, g, beta = qkv_gates(mixer, conv_out, b, a)
    if span.real is not None:  # padded nodes of a static bucket: Δ = 0, so they change nothing
        beta = beta * span.real.to(beta.dtype)
    if span.commit_all:  # chain: dense triangular blocks of PREFILL_CHUNK tokens, state carried between them
        outs, S = [], rec_state
        for s in range(0, n, PREFILL_CHUNK):
            e = min(n, s + PREFILL_CHUNK)
            tril = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).tril()
            o, G, delta = delta_rule_tree(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S, tril)
            S = state_after(S, G, k[:, s:e], delta, torch.arange(e - s, device=x.device))
            outs.append(o)
        out = torch.cat(outs, dim=1)
        rec_state.copy_(S)
        conv_state.copy_(torch.cat([conv_state, conv_in.to(conv_state.dtype)], dim=0)[-(K - 1):])
    else:
        anc = span.anc if span.anc is not None else torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        out, G, delta = delta_rule_tree(q, k, v, g, beta, rec_state, anc)
        scratch.conv_in[layer_slot, :n].copy_(conv_in)
        scratch.G[layer_slot, :, :n].copy_(G)
        scratch.K[layer_slot, :, :n].copy_(k)
        scratch.delta[layer_slot, :, :n].copy_(delta)
    return gated_out(mixer, out, z, x.dtype)


@dataclass
class GDNSpan:
    """A span's visibility as GDN layers read it (the attention layers read the same as a mask)."""

    depths: torch.Tensor  # (n,) distance from the span's root
    anc: torch.Tensor | None  # (n, n) bool ancestor-or-self; None = causal chain
    anc_at: torch.Tensor | None  # (n, K) o-th ancestor (−1 past the root); None = chain
    real: torch.Tensor | None  # (n,) 1 for real nodes, 0 for a static bucket's padding; None = all real
    commit_all: bool  # a chain kept whole: states advance in place


def gated_out(mixer: nn.Module, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Recurrence outputs (Hv, n, dv) → gated RMSNorm with z (n, Hv, dv) → output projection (1, n, H)."""
    n = out.shape[1]
    o = out.transpose(0, 1).to(dtype)  # (n, Hv, dv)
    o = mixer.norm(o.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim)).view(1, n, -1)
    return mixer.out_proj(o)
