"""CPU decoding: each product x·Wᵀ of the engine takes the fastest of its routes for its weight's shape and
its row count, measured on this machine the first time that pair occurs.

Routes (all compute F.linear's function; rounding differs):
  gemv    F.linear (MKL: a GEMV for one row)
  left    W·xᵀ, MKL's GEMM with the weight as the left operand, its (N, M) output copied row-major
  packed  oneDNN over a copy of the weight reordered once into its blocked layout
  kernel  the engine's own AVX2 kernel (engine/cpu_kernel.py), where it is built and K is a multiple of 8

On the 2-core AVX2 machine the default world runs on, no library route wins everywhere (docs/benchmarks.md
"Skinny products on the CPU"): at one row F.linear is quickest through 576 × 576 and oneDNN through the fused
960 × 576 q/k/v and 3,072 × 576 gate/up weights; at 2–5 and 16 rows W·xᵀ leads; at 17 rows oneDNN. The kernel
leads every shape there through 17 rows, but not the LM head at 65 rows ("The engine's AVX2 kernel"), and
another CPU ranks them its own way. So the choice is measured, not written down: a weight's *group* is
every registered weight of its shape, and a route is timed over as many of them as exceed the caches (a decode
step streams its weights from memory; one weight timed alone would sit in cache).

Invariants: the engine reaches the routes only without autograd, in fp32 on the CPU, outside torch.compile
(anything else is F.linear); a packed copy is rebuilt when its weight changed in place (an optimizer step,
load_state_dict), so a stale copy is never read; the route of a (shape, rows) pair is fixed once chosen, so
every engine mode in one process computes the same function with the same rounding.
`DRAFTFORGE_CPU_LINEAR` = auto (default: every route) | library (auto over the library routes gemv, left, packed)
| fixed (the former rule: F.linear for one row through a weight of fewer than 4M values, oneDNN otherwise) | gemv |
left | packed | kernel — for benchmarks and tests that pin a route (a pinned kernel serves the shapes it cannot
take on gemv).
"""

from __future__ import annotations

import os
import time
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine import cpu_kernel

LIBRARY_ROUTES = ("gemv", "left", "packed")
ROUTES = (*LIBRARY_ROUTES, "kernel")
TUNED = ("auto", "library")  # policies that measure their route per (shape, rows)
POLICIES = (*TUNED, "fixed", *ROUTES)
# Below this many values a Linear is not registered: oneDNN's fixed cost per call exceeds the whole product, and
# only tiny models (the tests' random ones) have such weights; SmolLM2-135M's smallest, k/v, is 576 × 192.
PACK_MIN = 1 << 16
SMALL_WEIGHT = 1 << 22  # the `fixed` policy's bound for one row on F.linear
TUNE_MAX_ROWS = 128  # more rows (prefill): oneDNN, untimed
TUNE_BYTES = 64 << 20  # a route is timed over a group's weights up to this many bytes (beyond the caches)
TUNE_REPS = 3


@dataclass
class _Group:
    """The registered weights of one shape (N, K) and the route chosen per row count."""

    weights: list[weakref.ref] = field(default_factory=list)
    routes: dict[tuple[str, int], str] = field(default_factory=dict)  # (tuned policy, rows) → route
    timings: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)  # → route → seconds


_groups: dict[tuple[int, int], _Group] = {}
_packed: dict[int, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}  # id(weight) → (ref, (ptr, version), copy)


def policy() -> str:
    p = os.environ.get("DRAFTFORGE_CPU_LINEAR", "auto")
    if p not in POLICIES:
        raise ValueError(f"DRAFTFORGE_CPU_LINEAR={p!r} is not one of {list(POLICIES)}")
    return p


def register(w: torch.Tensor) -> bool:
    """Make `w` (N, K) a weight the engine's products may route (fp32, CPU, ≥ PACK_MIN values) → registered."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or w.numel() < PACK_MIN:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    w._draftforge_registered = True  # routes apply to registered tensors only, never to a same-shaped stranger
    group = _groups.setdefault(tuple(w.shape), _Group())
    group.weights = [r for r in group.weights if r() is not None]  # models freed since
    if not any(r() is w for r in group.weights):
        group.weights.append(weakref.ref(w))
    return True


def _packed_of(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `w`, rebuilt when `w` changed since it was made."""
    entry = _packed.get(id(w))
    version = (w.data_ptr(), w._version)
    if entry is None or entry[0]() is not w or entry[1] != version:
        if entry is None or entry[0]() is not w:  # the copy dies with its weight
            weakref.finalize(w, _packed.pop, id(w), None)
        entry = (weakref.ref(w), version, torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1))
        _packed[id(w)] = entry
    return entry[2]


def run_route(route: str, x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) → (M, N) by one route."""
    if route == "gemv":
        return F.linear(x2, w, bias)
    if route == "left":  # (M, N) from (N, K)·(K, M), made row-major: a transposed view slows every consumer
        y = torch.mm(w, x2.t()).t().contiguous()
        return y if bias is None else y + bias
    if route == "kernel":
        return cpu_kernel.skinny_linear(x2, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), _packed_of(w), bias, "none", [], "")


def candidates(p: str, shape: tuple[int, int]) -> tuple[str, ...]:
    """The routes tuned policy `p` chooses among for a weight of `shape`."""
    if p == "auto" and cpu_kernel.eligible(shape) and cpu_kernel.available():
        return ROUTES
    return LIBRARY_ROUTES


def _tune(group: _Group, rows: int, w0: torch.Tensor, routes: tuple[str, ...] = LIBRARY_ROUTES) -> tuple[str, dict[str, float]]:
    """Time `routes` over the group's weights (up to TUNE_BYTES; `w0` when none is alive) with `rows` random
    rows → (the fastest, route → seconds)."""
    ws, size = [], 0
    for ref in group.weights:
        w = ref()
        if w is not None and size < TUNE_BYTES:
            ws.append(w)
            size += w.numel() * 4
    ws = ws or [w0]
    x2 = torch.randn(rows, w0.shape[1], generator=torch.Generator().manual_seed(rows))  # the caller's RNG untouched
    best = dict.fromkeys(routes, float("inf"))
    for _ in range(TUNE_REPS):  # routes interleaved, so host noise hits each alike; min of the reps
        for route in routes:
            t0 = time.perf_counter()
            for w in ws:
                run_route(route, x2, w, None)
            best[route] = min(best[route], time.perf_counter() - t0)
    return min(best, key=best.get), best


def route_for(w: torch.Tensor, rows: int) -> str:
    """The route of `rows` rows through the registered weight `w` under the current policy."""
    p = policy()
    if p == "kernel":
        if not cpu_kernel.available():
            raise ValueError(f"DRAFTFORGE_CPU_LINEAR=kernel: the kernel is unavailable ({cpu_kernel.unavailable_reason()})")
        return "kernel" if cpu_kernel.eligible(tuple(w.shape)) else "gemv"
    if p in ROUTES:
        return p
    if p == "fixed":
        return "gemv" if rows == 1 and w.numel() < SMALL_WEIGHT else "packed"
    if rows > TUNE_MAX_ROWS:
        return "packed"
    group = _groups[tuple(w.shape)]
    route = group.routes.get((p, rows))
    if route is None:
        route = _choose(group, p, rows, w)
    return route


def _choose(group: _Group, p: str, rows: int, w0: torch.Tensor) -> str:
    route, group.timings[(p, rows)] = _tune(group, rows, w0, candidates(p, tuple(w0.shape)))
    group.routes[(p, rows)] = route
    return route


def decode_rows(block: int, tree_sizes: Iterable[tuple[int, int]]) -> set[int]:
    """Row counts the products of a decode may see: a drafter's context chunk or a chain's verify (1 … block + 1,
    at least 1 … 17: an MTP round, short chunks, a Markov tree's bias product of up to 16 nodes) and a tree's
    verify (each (smallest, largest) verify size of a tree method: budget + 1, and up to the method's
    `verify_size` where its tree grows past the budget)."""
    return set(range(1, max(block, 16) + 2)) | {n for lo, hi in tree_sizes for n in range(int(lo), int(hi) + 1)}


def pretune(rows: Iterable[int]) -> int:
    """Choose now, under the current policy, the route of every registered shape for each row count in `rows` that
    has none yet → pairs tuned. A decode met a new (shape, rows) pair mid-generation otherwise and paid its
    timing (tens of ms) inside a timed round; a warm-up calls this before timing starts.

    A pair chosen here whose route differs from that of both its neighbours (rows ± 1, where chosen) is timed once
    more and takes the second choice: a host slowdown can span all TUNE_REPS repetitions of one tuning, and a route
    picked on such a sample would hold for the process (measured: docs/benchmarks.md, "The kernel prefetches at
    every row count", a 17-row product left on a route 2× slower)."""
    p = policy()
    if p not in TUNED:
        return 0
    n = 0
    for group in _groups.values():
        w0 = next((w for w in (r() for r in group.weights) if w is not None), None)
        if w0 is None:
            continue
        fresh = [m for m in rows if 1 <= m <= TUNE_MAX_ROWS and (p, m) not in group.routes]
        for m in fresh:
            _choose(group, p, m, w0)
        n += len(fresh)
        for m in fresh:
            near = [group.routes[(p, m + d)] for d in (-1, 1) if (p, m + d) in group.routes]
            if near and group.routes[(p, m)] not in near:
                _choose(group, p, m, w0)
    return n


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x (..., K), w (N, K) → (..., N), by the route chosen for w's shape and x's rows when
    w is registered and the call is an fp32 CPU product without autograd; F.linear otherwise."""
    if not (getattr(w, "_draftforge_registered", False) and cpu_kernel.eager_fp32(x, w)):
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    y = run_route(route_for(w, rows), x.reshape(rows, x.shape[-1]), w, bias)  # (M, N)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def route_linears(module: nn.Module) -> int:
    """Register every fp32 CPU nn.Linear of `module` with at least PACK_MIN weights and route its forward through
    `linear` (idempotent) → how many were newly routed. Packed copies are made when a route first needs them."""
    n = 0
    for lin in module.modules():
        if not isinstance(lin, nn.Linear) or getattr(lin, "_draftforge_routed", False):
            continue
        if not register(lin.weight):
            continue
        lin.forward = types.MethodType(_routed_forward, lin)
        lin._draftforge_routed = True
        n += 1
    return n


def tuned_routes() -> dict[str, dict[str, object]]:
    """What the tuner chose and measured so far: "N×K" → {rows: {"route": …, "ms": {route: ms over the group}}}
    (rows as "R" under `auto`, "R library" under `library`)."""
    out: dict[str, dict[str, object]] = {}
    for (n, k), g in _groups.items():
        out[f"{n}x{k}"] = {(str(r) if p == "auto" else f"{r} {p}"): {
            "route": g.routes[(p, r)], "ms": {k2: 1e3 * v for k2, v in g.timings.get((p, r), {}).items()}}
            for p, r in sorted(g.routes)}
    return out
