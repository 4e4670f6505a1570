"""Captured engine: static-shape target and drafter steps, one CUDA graph per verify-size bucket.

The eager engine (`target.forward`) slices the state to the committed length, builds a mask of that
length and launches every kernel from Python; on a GPU the launches, not the weights, then bound a
step. Here every verify forward has a fixed shape, so it can be captured once and replayed:

- Buckets: the verify sizes of the methods it serves (`verify_buckets`: 1 for the AR step, each method's
  `verify_size`); a tree smaller than its bucket is padded. Padded nodes are their own roots (depth 0, see only themselves, β = 0 in GDN
  layers) and are never on an accepted path, so they cannot change a real node's output.
- Inputs are device buffers the step reads: token ids, rotary positions, depths, the state rows the
  span's K/V go to (written with `index_copy_`), the span's ancestor matrix (the attention mask over the
  whole fixed capacity and the GDN tree form are built from it inside the step), a real/padded flag and,
  for GDN convs, each node's nearest ancestors. Outputs (final hidden states, logits, tapped layers, GDN
  verify scratch) are buffers too.
- Attention reads K/V in place over the fixed capacity (rows past the span are masked): native GQA by
  folding each KV head's query heads into the query axis (no per-step K/V expansion or copy).
- The committed prefix is never moved by a verify; `commit(path)` is the state's own commit
  (`TargetState.commit`: the accepted rows' K/V and every GDN layer's states in a few batched kernels).
- The layers are the eager engine's (`target.run_layers`), the drafter's block pass too (`draft.py`): this
  module owns only fixed-capacity buffers, verify buckets, staging, graph capture and compilation.

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
from draftforge.engine import gdn
from draftforge.engine.capture import align, capture_graph
from draftforge.engine.draft import DrafterContext, StaticDraft
from draftforge.engine.state import CapacityError, TargetState
from draftforge.engine.target import LayerRuntime, Step, TargetModel, eager_runtime, run_layers
from draftforge.engine.tree import Tree, ancestor_matrix


class BucketError(ValueError):
    pass


def verify_buckets(verify_sizes: Iterable[int] = ()) -> tuple[int, ...]:
    """Verify sizes to capture: 1 (the AR step) and each method's `verify_size` (root included)."""
    return tuple(sorted({1, *(int(n) for n in verify_sizes)}))


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


class CapturedEngine:
    """A target (and optionally its block drafter) with static verify steps at a fixed capacity.

        eng = CapturedEngine(tm, capacity=4096, buckets=verify_buckets([16, 17, 65]), drafter=d)
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
        if compile and any(hasattr(layer.mlp, "experts") for layer in tm.layers):
            raise ValueError("captured engine: compile=True needs dense MLPs (MoE routing is data-dependent)")
        # The layers run as in the eager engine (`target.run_layers`); fused / compile put fused weights and
        # torch.compile'd blocks (`fused.py`) on top. Split-KV attention (split_attention.py, CUDA) where SDPA
        # would leave SMs idle: faster or equal at every verify size measured on an H200 (docs/benchmarks.md,
        # "Split-KV attention"), so on by default.
        fuse = fused or compile
        eager = eager_runtime(tm)
        self.runtime = LayerRuntime(
            fused=fused_blocks.fuse_projections(tm) if fuse else eager.fused,
            blocks=fused_blocks.layer_blocks(compiled=compile) if fuse else eager.blocks,
            split_attention=split_attention and fuse, gdn_mixers=gdn_mixers)
        self.capacity = align(int(capacity))
        dev, dt = tm.device, tm.dtype
        self.state = TargetState(tm, self.capacity, max_span=self.buckets[-1])
        self.cols = torch.arange(self.capacity, device=dev)
        self.group = tm.num_heads // tm.num_kv_heads
        self.kc = max(tm.conv_kernel, 1)
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
        self.drafter = None  # the drafter's static context: the same block pass, fixed buffers (draft.py)
        if drafter is not None:
            static = StaticDraft(self.capacity, self.runtime.blocks,
                                 fused_blocks.fuse_drafter(drafter) if fuse else None)
            self.drafter = DrafterContext(drafter, tm, static)
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
                              f"bucket {list(self.buckets)}; build the engine with this method's verify size")

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
        """The static forward over bucket b's staged inputs (captured on CUDA): the eager engine's layers
        over the whole fixed capacity, the mask built from the staged ancestor matrix."""
        tm, meta = self.tm, b.meta
        slots = meta[3]
        step = Step(ids=meta[0:1], positions=meta[1], slots=slots, kv_len=self.capacity,
                    mask=_mask_over(b.anc, slots[:1], self.cols, self.group, tm.dtype), causal=False,
                    gdn=gdn.GDNSpan(meta[2], b.anc, meta[5:].T, meta[4], commit_all=False) if tm.hybrid else None)
        h, taps = run_layers(tm, self.state, step, self.runtime, want_taps=b.taps is not None)
        b.h.copy_(h)
        b.logits.copy_(tm.lm_head(h[0]))
        if b.taps is not None:
            b.taps.copy_(taps)

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
        self.state.reset()

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
        if hasattr(method, "attach"):  # a block-drafter method drafts through the engine's static context
            if self.drafter is None:
                raise ValueError(f"captured engine: method {method.name!r} drafts with a block drafter; build the "
                                 "engine with drafter=<that drafter>")
            method.attach(self.drafter)
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
        """Keep the last verify's nodes `path` (a root path, ascending): the state's own commit."""
        if self.last is None:
            raise RuntimeError("captured engine: commit without a verify")
        self.state.commit(path)
        self.last = None
