"""Captured engine: static-shape target and drafter steps, one CUDA graph per verify-size bucket.

The eager engine (`target.forward`) slices the state to the committed length, builds a mask of that
length and launches every kernel from Python; on a GPU the launches, not the weights, then bound a
step. Here every verify forward has a fixed shape, so it can be captured once and replayed:

- Buckets: verify sizes n ∈ {1 (AR step), B (DFlash chain), budget + 1 (DDTree)}; a tree smaller than
  its bucket is padded. Padded nodes are their own roots (depth 0, see only themselves, β = 0 in GDN
  layers) and are never on an accepted path, so they cannot change a real node's output.
- Inputs are device buffers the step reads: token ids, rotary positions, depths, the state rows the
  span's K/V go to (written with `index_copy_`), the span's ancestor matrix (the attention mask over the
  whole fixed capacity and the GDN tree form are built from it inside the step), a real/padded flag and,
  for GDN convs, each node's nearest ancestors. Outputs (final hidden states, logits, tapped layers, GDN
  verify scratch) are buffers too.
- Attention reads K/V in place over the fixed capacity (rows past the span are masked): native GQA by
  folding each KV head's query heads into the query axis (no per-step K/V expansion or copy).
- The committed prefix is never moved by a verify; `commit(path)` moves the accepted rows' K/V and
  advances every GDN layer's conv and recurrent state in a few batched kernels (eager, outside the graph).
- The drafter's block pass is static the same way (`static_drafter.py`).

On CPU (or with `graphs=False`) the same static step runs eagerly; tokens equal the eager engine's.
Prompt prefill stays eager (`target.forward`, one per generation). Errors: a prompt or generation that
does not fit the fixed capacity raises `CapacityError`; a method whose verify size has no bucket raises
`BucketError` naming the captured buckets (build the engine with that budget: no silent re-capture).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftforge.engine import fused as fused_blocks
from draftforge.engine import gdn, split_attention
from draftforge.engine.capture import align, capture_graph
from draftforge.engine.state import CapacityError, TargetState
from draftforge.engine.static_drafter import StaticDrafter
from draftforge.engine.target import (
    TargetModel,
    attend_folded,
    attention_out,
    mlp,
    project_qkv,
    rope_tables,
)
from draftforge.engine.tree import Tree, ancestor_matrix


class BucketError(ValueError):
    pass


def verify_buckets(block_size: int | None = None, budgets: Iterable[int] = ()) -> tuple[int, ...]:
    """Verify sizes to capture: 1 (AR step), the chain's block size, every DDTree budget + 1."""
    sizes = {1}
    if block_size:
        sizes.add(int(block_size))
    sizes.update(int(b) + 1 for b in budgets)
    return tuple(sorted(sizes))


def _mask_over(anc: torch.Tensor, past: torch.Tensor, cols: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (1, 1, group·n, cap) mask: node i sees committed rows (< past) and its span ancestors."""
    n = anc.shape[0]
    rel = cols - past  # (cap,) span index of each column (negative: committed)
    in_span = (rel >= 0) & (rel < n)
    vis = (rel < 0)[None] | (in_span[None] & anc.index_select(1, rel.clamp(0, n - 1)))  # (n, cap)
    mask = torch.zeros((), device=anc.device, dtype=dtype).masked_fill(~vis, float("-inf"))
    if group > 1:  # query rows are (query head in group, node): the same mask per head
        mask = mask.repeat(group, 1)
    return mask[None, None]


@dataclass
class _Bucket:
    n: int
    meta: torch.Tensor  # (5 + Kc, n) int64 device: ids, positions, depths, slots, real, ancestors 0..Kc−1
    anc: torch.Tensor  # (n, n) bool device
    hmeta: torch.Tensor  # host staging (pinned on CUDA)
    hanc: torch.Tensor
    h: torch.Tensor  # (1, n, H) final-normed
    logits: torch.Tensor  # (n, V)
    taps: torch.Tensor | None  # (1, n, n_taps·H)
    ar: torch.Tensor  # host arange(n)
    graph: Any = None
    n_real: int = 0
    chain: tuple[torch.Tensor, torch.Tensor] | None = None  # cached structure of the full chain
    anc_is_chain: bool = False  # the device ancestor buffer holds the full chain


@dataclass
class _GDNScratch:
    """Verify outputs every GDN layer keeps for commit, at the largest bucket (smaller ones use a prefix)."""

    conv_in: torch.Tensor  # (n_gdn, N, C)
    G: torch.Tensor  # (n_gdn, Hv, N) fp32
    K: torch.Tensor  # (n_gdn, Hv, N, dk) fp32
    delta: torch.Tensor  # (n_gdn, Hv, N, dv) fp32


class CapturedEngine:
    """A target (and optionally its block drafter) with static verify steps at a fixed capacity.

        eng = CapturedEngine(tm, capacity=4096, buckets=verify_buckets(16, [16, 64]), drafter=d)
        eng.capture()                      # CUDA: one graph per bucket (+ the drafter's block pass)
        generate(tm, method, prompt, 128, engine=eng)

    One generation at a time; the state is reused across generations (reset in `begin`).
    """

    def __init__(self, tm: TargetModel, capacity: int, buckets: Sequence[int] = (1,), drafter: Any = None,
                 graphs: bool | None = None, gdn_mixers: bool = True, fused: bool = False,
                 compile: bool = False, split_attention: bool = True) -> None:
        self.tm = tm
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise BucketError(f"captured engine: verify buckets {self.buckets} must be >= 1")
        self.graphs = (tm.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs and tm.device.type != "cuda":
            raise ValueError("captured engine: CUDA graphs need a CUDA target (graphs=False runs the static step eagerly)")
        if self.graphs and any(hasattr(layer.mlp, "experts") for layer in tm.layers):
            raise ValueError("captured engine: MoE MLPs route tokens with data-dependent shapes and cannot be captured "
                             "in a CUDA graph; use the eager engine (or graphs=False) for this target")
        self.blocks = None  # fused layer blocks (`fused.py`): fused=True runs them as is, compile=True compiled
        if fused or compile:
            if compile and any(hasattr(layer.mlp, "experts") for layer in tm.layers):
                raise ValueError("captured engine: compile=True needs dense MLPs (MoE routing is data-dependent)")
            self.fused = fused_blocks.fuse_projections(tm)
            self.blocks = fused_blocks.layer_blocks(compiled=compile)
        # fused blocks on CUDA: split-KV attention (split_attention.py) where SDPA would leave SMs idle
        # (split_attention.usable decides per step); faster or equal at every verify size measured on an
        # H200 (docs/benchmarks.md, "Split-KV attention"), so on by default
        self.split_attention = split_attention
        self.capacity = align(int(capacity))
        self.gdn_mixers = gdn_mixers  # benchmarks only: False skips GDN token mixers (their share of a step)
        dev, dt = tm.device, tm.dtype
        self.state = TargetState(tm, self.capacity)
        self.state.kv.zero_()  # masked columns are read: they must hold finite values
        self.cols = torch.arange(self.capacity, device=dev)
        self.group = tm.num_heads // tm.num_kv_heads
        self.kc = max(tm.conv_kernel, 1)
        n_max = self.buckets[-1]
        self.scratch = None
        if tm.hybrid:
            g, n_gdn = tm.gdn, tm.kinds.count("gdn")
            ct = gdn.compute_dtype(dt)
            self.scratch = _GDNScratch(
                conv_in=torch.zeros(n_gdn, n_max, g.conv_dim, device=dev, dtype=dt),
                G=torch.zeros(n_gdn, g.num_v_heads, n_max, device=dev, dtype=ct),
                K=torch.zeros(n_gdn, g.num_v_heads, n_max, g.head_k_dim, device=dev, dtype=ct),
                delta=torch.zeros(n_gdn, g.num_v_heads, n_max, g.head_v_dim, device=dev, dtype=ct),
            )
        pin = dev.type == "cuda"
        n_taps = len(tm.tap_ids)
        self._buckets: dict[int, _Bucket] = {}
        for n in self.buckets:
            hmeta = torch.zeros(5 + self.kc, n, dtype=torch.long, pin_memory=pin)
            hanc = torch.zeros(n, n, dtype=torch.bool, pin_memory=pin)
            self._buckets[n] = _Bucket(
                n=n, meta=torch.zeros(5 + self.kc, n, dtype=torch.long, device=dev),
                anc=torch.zeros(n, n, dtype=torch.bool, device=dev), hmeta=hmeta, hanc=hanc,
                h=torch.zeros(1, n, tm.hidden_size, device=dev, dtype=dt),
                logits=torch.zeros(n, tm.vocab_size, device=dev, dtype=dt),
                taps=torch.zeros(1, n, n_taps * tm.hidden_size, device=dev, dtype=dt) if n_taps else None,
                ar=torch.arange(n),
            )
        self.drafter = StaticDrafter(self, drafter) if drafter is not None else None
        self.pool = None
        self.capture_s: dict[str, float] = {}
        self.last: _Bucket | None = None

    # ---- sizes ------------------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int:
        """The verify bucket a span of n tokens runs in: the smallest captured size ≥ n."""
        for b in self.buckets:
            if b >= n:
                return b
        raise BucketError(f"captured engine: a verify of {n} tokens exceeds the largest captured bucket "
                          f"{self.buckets[-1]} (buckets {list(self.buckets)}); build the engine with that budget")

    def check_method(self, verify_size: int) -> None:
        if verify_size not in self.buckets:
            raise BucketError(f"captured engine: verify size {verify_size} (budget {verify_size - 1}) is not a captured "
                              f"bucket {list(self.buckets)}; build the engine with this budget or block size")

    # ---- the static step ----------------------------------------------------------------------------------
    def _fill(self, b: _Bucket, tokens: Sequence[int], parents: Sequence[int], depths: Sequence[int]) -> None:
        """Stage a tree (topological order, parents[0] = −1) padded to the bucket, at the state's length."""
        n, r = b.n, len(tokens)
        if r > n:
            raise BucketError(f"captured engine: {r} tokens do not fit bucket {n}")
        past = self.state.length
        if past + n > self.capacity:
            raise CapacityError(f"captured engine: {past} committed + a verify bucket of {n} exceed the fixed "
                                f"capacity of {self.capacity}; build the engine with a larger capacity")
        m, nb = b.hmeta, b.meta.device.type == "cuda"
        full_chain = r == n and list(parents) == list(range(-1, n - 1))
        if full_chain:  # AR step / DFlash chain: only ids and positions change (structure rows cached)
            if b.chain is None:
                b.chain = self._structure(list(range(-1, n - 1)), list(range(n)), n)
            m[5:], m[2], m[4] = b.chain[0][5:], b.chain[0][2], b.chain[0][4]
            m[0] = torch.as_tensor(list(tokens), dtype=torch.long)
            m[1] = past + m[2]
            m[3] = past + b.ar
            b.meta.copy_(m, non_blocking=nb)
            if not b.anc_is_chain:
                b.anc.copy_(b.chain[1], non_blocking=nb)
                b.anc_is_chain = True
        else:
            struct, anc = self._structure(list(parents), list(depths), n)
            m.copy_(struct)
            m[0, :r] = torch.as_tensor(list(tokens), dtype=torch.long)
            m[0, r:] = 0
            m[1] = past + m[2]
            m[3] = past + b.ar
            b.hanc.copy_(anc)
            b.meta.copy_(m, non_blocking=nb)
            b.anc.copy_(b.hanc, non_blocking=nb)
            b.anc_is_chain = False
        b.n_real = r

    def _structure(self, parents: list[int], depths: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host (5 + Kc, n) meta rows of a tree padded to n (rows 2, 4, 5.. filled) and its (n, n) ancestor matrix."""
        r = len(parents)
        par = torch.full((n,), -1, dtype=torch.long)
        dep = torch.zeros(n, dtype=torch.long)
        par[:r] = torch.as_tensor(parents, dtype=torch.long)
        dep[:r] = torch.as_tensor(depths, dtype=torch.long)
        m = torch.zeros(5 + self.kc, n, dtype=torch.long)
        m[2] = dep
        m[4, :r] = 1
        m[5:] = gdn.ancestors_at(par, self.kc).T
        return m, ancestor_matrix(par.clamp(min=0), dep, int(dep.max()))

    def _step(self, b: _Bucket) -> None:
        """The static forward over bucket b's staged inputs (captured on CUDA)."""
        tm, n = self.tm, b.n
        meta = b.meta
        ids, pos, depths, slots = meta[0:1], meta[1], meta[2], meta[3]
        real = meta[4]
        anc_at = meta[5:].T  # (n, Kc)
        cos, sin = rope_tables(tm, pos)
        mask = _mask_over(b.anc, slots[:1], self.cols, self.group, tm.dtype)
        h = tm.embed(ids)
        for i, layer in enumerate(tm.layers):
            if self.blocks is not None:  # fused blocks: norms inside, cache writes outside
                h = self._fused_layer(i, layer, h, cos, sin, slots, mask, depths, b, anc_at, real, n)
            else:
                h = self._layer(i, layer, h, cos, sin, slots, mask, depths, b, anc_at, real, n)
            t = tm._tap_pos.get(i)
            if t is not None and b.taps is not None:
                H = tm.hidden_size
                b.taps[:, :, t * H : (t + 1) * H].copy_(h)
        hn = tm.norm(h)
        b.h.copy_(hn)
        b.logits.copy_(tm.lm_head(hn[0]))

    def _layer(self, i, layer, h, cos, sin, slots, mask, depths, b, anc_at, real, n) -> torch.Tensor:
        """One decoder layer from the HF modules."""
        tm, st = self.tm, self.state
        x = layer.input_layernorm(h)
        s = tm.slots[i]
        if tm.kinds[i] == "attention":
            attn = layer.self_attn
            q, k, v, gate = project_qkv(tm, attn, x, cos, sin)
            kv = st.kv[s]
            kv[0].index_copy_(1, slots, k[0])
            kv[1].index_copy_(1, slots, v[0])
            o = attend_folded(q, kv[0][None], kv[1][None], mask, attn.scaling)
            h = h + attention_out(attn, o, gate)
        elif self.gdn_mixers:
            h = h + self._gdn(layer.linear_attn, x, s, depths, b.anc, anc_at, real, n)
        return h + mlp(layer, layer.post_attention_layernorm(h))

    def _fused_layer(self, i, layer, h, cos, sin, slots, mask, depths, b, anc_at, real, n) -> torch.Tensor:
        """One decoder layer through the fused blocks (fused.py, compiled or not); same function as `_layer`."""
        tm, fl, blk = self.tm, self.fused[i], self.blocks
        s = tm.slots[i]
        if tm.kinds[i] == "attention":
            attn = layer.self_attn
            q, k, v, gate = blk.qkv(attn, layer.input_layernorm, fl.wqkv, fl.bqkv, h, cos, sin, fl.q_out, fl.kv_out,
                                    tm.num_heads, tm.num_kv_heads, tm.head_dim, tm.qk_norm, tm.gated_attention)
            kv = self.state.kv[s]
            kv[0].index_copy_(1, slots, k[0])
            kv[1].index_copy_(1, slots, v[0])
            if self.split_attention and split_attention.usable(q, self.group * n, tm.num_kv_heads):
                kv_len = slots[-1:] + 1  # rows past the span's last slot are masked: the kernel stops there
                parts = split_attention.split_partials(q, kv[0], kv[1], mask, kv_len, attn.scaling)
                return blk.split(layer, fl.wgu, h, *parts, gate, n)
            return blk.out(layer, fl.wgu, h, q, kv[0], kv[1], mask, gate, attn.scaling)
        if self.gdn_mixers:
            h = h + self._gdn(layer.linear_attn, layer.input_layernorm(h), s, depths, b.anc, anc_at, real, n)
        return blk.mlp(layer, fl.wgu, h)

    def _gdn(self, mixer, x, s, depths, anc, anc_at, real, n) -> torch.Tensor:
        st, sc = self.state, self.scratch
        conv_in, z, bb, a = gdn.project(mixer, x)
        window = gdn.conv_window_index(depths, anc_at, mixer.conv_kernel_size)
        conv_out = gdn.tree_conv(conv_in, st.conv[s], mixer.conv1d.weight[:, 0], window)
        q, k, v, g, beta = gdn.qkv_gates(mixer, conv_out, bb, a)
        beta = beta * real.to(beta.dtype)  # padded nodes: Δ = 0
        out, G, delta = gdn.delta_rule_tree(q, k, v, g, beta, st.rec[s], anc)
        sc.conv_in[s, :n].copy_(conv_in)
        sc.G[s, :, :n].copy_(G)
        sc.K[s, :, :n].copy_(k)
        sc.delta[s, :, :n].copy_(delta)
        return gdn.gated_out(mixer, out, z, x.dtype)

    def _run(self, b: _Bucket) -> None:
        if b.graph is not None:
            b.graph.replay()
        else:
            self._step(b)
        self.last = b

    # ---- capture ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> dict[str, float]:
        """Capture one CUDA graph per bucket (and the drafter's block pass); → seconds per graph."""
        if not self.graphs:
            return {}
        self.pool = torch.cuda.graph_pool_handle()
        for n in self.buckets:
            b = self._buckets[n]
            t0 = time.perf_counter()
            self.state.length = 0
            self._fill(b, [0] * n, list(range(-1, n - 1)), list(range(n)))  # a valid chain: finite warm-up rows
            try:
                b.graph = capture_graph(lambda b=b: self._step(b), self.pool)
            except RuntimeError as e:
                raise RuntimeError(f"captured engine: capturing the verify step of {n} tokens failed: {e}") from e
            torch.cuda.synchronize()
            self.capture_s[f"verify_{n}"] = time.perf_counter() - t0
        if self.drafter is not None:
            t0 = time.perf_counter()
            self.drafter.capture(self.pool)
            self.capture_s["draft"] = time.perf_counter() - t0
        self.reset()
        return self.capture_s

    # ---- generation API (loops.generate(..., engine=eng)) ------------------------------------------------
    def reset(self) -> None:
        st = self.state
        st.length, st.pending = 0, 0
        st.conv.zero_()
        st.rec.zero_()  # KV rows past the committed length are scratch (finite values from earlier steps)

    def begin(self, method: Any, prompt_len: int, max_new_tokens: int) -> TargetState:
        """Reset the state for a generation; check sizes up front; give the method the static drafter."""
        if prompt_len > self.capacity:
            raise CapacityError(f"captured engine: prompt of {prompt_len} tokens is longer than the fixed capacity "
                                f"{self.capacity}; build the engine with a larger capacity")
        verify = method.verify_size if method is not None else 1
        self.check_method(verify)
        need = prompt_len + max_new_tokens + verify
        if need > self.capacity:
            raise CapacityError(f"captured engine: prompt {prompt_len} + max_new_tokens {max_new_tokens} + verify "
                                f"{verify} = {need} rows exceed the fixed capacity {self.capacity}")
        self.reset()
        ctx = getattr(method, "ctx", None)
        if ctx is not None and self.drafter is not None and getattr(ctx, "drafter", None) is self.drafter.d:
            method.ctx = self.drafter.context()
        return self.state

    def verify(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One static verify of `tree` → logits (r, V), final states (1, r, H), taps (1, r, ·) | None (views)."""
        b = self._buckets[self.bucket_for(len(tree))]
        self._fill(b, tree.tokens, tree.parents, tree.depths)
        self._run(b)
        r = b.n_real
        return b.logits[:r], b.h[:, :r], (b.taps[:, :r] if b.taps is not None else None)

    def ar_step(self, token: int) -> torch.Tensor:
        """One AR step (bucket 1), committed; → logits (1, V)."""
        b = self._buckets[self.bucket_for(1)]
        self._fill(b, [token], [-1], [0])
        self._run(b)
        self.commit([0])
        return b.logits[:1]

    @torch.no_grad()
    def commit(self, path: Sequence[int]) -> None:
        """Keep the last verify's nodes `path` (a root path, ascending): K/V rows and GDN states."""
        st, b = self.state, self.last
        if b is None:
            raise RuntimeError("captured engine: commit without a verify")
        m, past = len(path), st.length
        dev = self.tm.device
        if st.kv.shape[0] and list(path) != list(range(m)):
            src = torch.tensor(list(path), device=dev) + past
            dst = torch.arange(past, past + m, device=dev)
            st.kv.index_copy_(3, dst, st.kv.index_select(3, src))
        if self.scratch is not None and self.gdn_mixers:
            sc = self.scratch
            p = torch.tensor(list(path), device=dev)
            last = int(path[-1])
            Gm = sc.G[:, :, last]  # (L, Hv)
            w = (Gm[..., None] - sc.G[:, :, p]).exp()  # (L, Hv, m)
            Kp = sc.K[:, :, p] * w[..., None]
            st.rec.copy_(Gm.exp()[..., None, None] * st.rec + Kp.transpose(-1, -2) @ sc.delta[:, :, p])
            km1 = st.conv.shape[1]
            st.conv.copy_(torch.cat([st.conv, sc.conv_in[:, p].to(st.conv.dtype)], dim=1)[:, -km1:])
        st.length = past + m
        st.pending = 0
        self.last = None
