"""Split-KV attention over the fixed-capacity cache for small verify spans (one Triton kernel, CUDA).

The captured step attends over the whole fixed capacity with an additive mask (graph.py). With few query
rows (an AR step: one token × the GQA group) a fused SDPA kernel runs one CTA per (KV head, query tile):
8 CTAs for a Qwen3-8B AR step, so each reads its head's whole cache alone and the step spends ~0.8 ms in
attention (docs/benchmarks.md, "Compiled engine"). Here the key axis is split as well:

    partials  grid (Hkv, splits, query tiles): each program scans ≤ `chunk` cache rows of one KV head with an
              online softmax and writes an unnormalised output, its running max and its sum (fp32)
    combine   `combine_splits` (torch ops; inside the compiled post-attention block, so Inductor fuses it)

and each program stops at `kv_len` (a device scalar: the span's last slot + 1), so the cost follows the
committed length rather than the capacity. Rows ≥ kv_len are masked by construction (the mask sees committed
rows and the span's ancestors only), so the bound changes work, not results.

Invariant: `combine_splits(*split_partials(q, k, v, mask, kv_len, scale))` = `blocks.attend(q, k, v, mask, False,
scale)` up to the rounding of a different reduction order (checked on CPU under TRITON_INTERPRET=1 and on CUDA).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the captured engine keeps SDPA
    triton = None

TARGET_PROGRAMS = 256  # ≈ 2 programs per SM on an H100/H200
# Tile sizes follow the head dim so one program's shared memory (a q tile, K and V tiles per pipeline
# stage) stays under Hopper's 227 KiB: head dim ≤ 128 takes 64 cache rows per inner tile and 3 stages,
# larger heads (Qwen3.5/3.6: 256) 32 rows, query tiles ≤ 32 rows and 2 stages (64 × 256 with 3 stages
# asked for 232 KiB on an H200).
WIDE_HEAD = 128


def usable(q: torch.Tensor, group_rows: int, n_kv: int) -> bool:
    """Whether the split kernel serves this attention: Triton present, a power-of-two head dim, and few
    enough (KV head, query tile) pairs that a fused SDPA kernel would leave most SMs idle."""
    if triton is None or q.device.type != "cuda":
        return False
    hd = q.shape[-1]
    return 16 <= hd <= 256 and hd & (hd - 1) == 0 and n_kv * _tiles(group_rows, hd) < 64


def _block_m(group_rows: int, head_dim: int) -> int:
    """Query rows per program."""
    cap = 64 if head_dim <= WIDE_HEAD else 32
    return min(cap, 16 if group_rows <= 16 else (32 if group_rows <= 32 else 64))


def _block_n(head_dim: int) -> int:
    """Cache rows per inner tile."""
    return 64 if head_dim <= WIDE_HEAD else 32


def _stages(head_dim: int) -> int:
    return 3 if head_dim <= WIDE_HEAD else 2


def _tiles(group_rows: int, head_dim: int) -> int:
    return math.ceil(group_rows / _block_m(group_rows, head_dim))


def plan(capacity: int, n_kv: int, group_rows: int, head_dim: int) -> tuple[int, int]:
    """(splits, chunk): chunk a multiple of the inner tile, splits · chunk ≥ capacity, ≈ TARGET_PROGRAMS programs."""
    per_split = n_kv * _tiles(group_rows, head_dim)
    bn = _block_n(head_dim)
    splits = max(1, min(math.ceil(capacity / bn), TARGET_PROGRAMS // per_split))
    chunk = math.ceil(math.ceil(capacity / splits) / bn) * bn
    return math.ceil(capacity / chunk), chunk


if triton is not None:

    @triton.jit
    def _partials_kernel(Q, K, V, Mask, KvLen, Acc, Mx, Sum,
                         s_qh, s_qg, s_kh, s_kn, s_vh, s_vn, s_mg, s_ah, s_as, s_ag, s_mh, s_ms,
                         G, chunk, scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
        h, s, mt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # folded query rows (group member, node)
        d = tl.arange(0, D)
        row_ok = rows < G
        q = tl.load(Q + h * s_qh + rows[:, None] * s_qg + d[None, :], mask=row_ok[:, None], other=0.0)
        start = s * chunk
        end = tl.minimum(start + chunk, tl.load(KvLen))
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile keeps exp(m − m) = 1
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            k = tl.load(K + h * s_kh + cols[:, None] * s_kn + d[None, :], mask=col_ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N) fp32
            bias = tl.load(Mask + rows[:, None] * s_mg + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                           other=float("-inf"))
            sc = sc + bias.to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + h * s_vh + cols[:, None] * s_vn + d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        tl.store(Acc + h * s_ah + s * s_as + rows[:, None] * s_ag + d[None, :], acc, mask=row_ok[:, None])
        tl.store(Mx + h * s_mh + s * s_ms + rows, m_i, mask=row_ok)
        tl.store(Sum + h * s_mh + s * s_ms + rows, l_i, mask=row_ok)


def split_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   kv_len: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, Hq, n, hd), caches (Hkv, cap, hd), additive folded mask (1, 1, g·n, cap), kv_len (1,) long
    → acc (Hkv, S, g·n, hd), max (Hkv, S, g·n), sum (Hkv, S, g·n), all fp32."""
    _, hq, n, hd = q.shape
    hkv, cap, _ = k_cache.shape
    G = (hq // hkv) * n
    qf = q.reshape(hkv, G, hd)  # same folding as blocks.attend: rows (group member, node)
    if qf.stride(-1) != 1:
        qf = qf.contiguous()
    m2 = mask.reshape(G, cap)
    splits, chunk = plan(cap, hkv, G, hd)
    bm = _block_m(G, hd)
    acc = torch.empty(hkv, splits, G, hd, device=q.device, dtype=torch.float32)
    mx = torch.empty(hkv, splits, G, device=q.device, dtype=torch.float32)
    sm = torch.empty_like(mx)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (hkv, splits, math.ceil(G / bm))
    _partials_kernel[grid](qf, k_cache, v_cache, m2, kv_len, acc, mx, sm,
                           qf.stride(0), qf.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                           v_cache.stride(1), m2.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
                           mx.stride(0), mx.stride(1), G, chunk, scale,
                           BLOCK_M=bm, BLOCK_N=_block_n(hd), D=hd, PRECISION=precision, num_stages=_stages(hd))
    return acc, mx, sm


def combine_splits(acc: torch.Tensor, mx: torch.Tensor, sm: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Partials of `split_partials` → attention output (1, Hq, n, hd) in `dtype`. Every row sees at least
    itself, so at least one split has a positive sum."""
    hkv, _, G, hd = acc.shape
    top = mx.amax(dim=1, keepdim=True)  # (Hkv, 1, G)
    w = torch.exp(mx - top)  # splits past kv_len: max −1e30 → weight 0
    out = (acc * w[..., None]).sum(1) / (sm * w).sum(1)[..., None]  # (Hkv, G, hd)
    return out.to(dtype).reshape(1, hkv * (G // n), n, hd)
