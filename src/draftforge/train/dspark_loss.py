"""Distribution-matching block objective (DSpark; also available to DFlash drafters), chunked over the vocabulary.

Per supervised draft row (a block slot that predicts position p):
    z = lm_head(h) [+ markov_w2 · markov_w1[prev]]       draft logits, q = softmax(z)
    t = lm_head(target last hidden state at p - 1)       the target's own next-token logits, p_t = softmax(t)
    ce = -log q[y]            (y = the data token at p)
    kl = KL(p_t || q)
    tv = ½ ‖q - p_t‖₁         (total variation; 1 - tv is the analytic acceptance probability of the draft)
Loss = Σ_rows w_row (λ_ce ce + λ_kl kl + λ_tv tv + λ_conf BCE(conf_logit, 1 - tv)) / Σ_rows w_row, with the
position weight w = exp(-k/γ) for the k-th draft of a block (k = 0 for the first). The paper's default
0.9 × L1 + 0.1 × CE is λ_tv = 1.8, λ_ce = 0.1. Acceptance weighting (drafter.acceptance_weighting) also
multiplies w by Π_{j<k} (1 - tv_j), the analytic chance the verifier reaches draft k (detached).

Memory: the vocabulary is processed in chunks of `chunk` columns, in fp32, by a custom autograd function
(two passes forward: log-sum-exp of z and t, then the terms; one pass backward recomputing each chunk):
nothing of size rows × V is ever materialised beyond one rows × chunk block. When one chunk covers the
vocabulary (`objective` picks that whenever the rows × V fp32 probabilities fit WHOLE_VOCAB_BYTES: a CPU
batch of 512 rows × 49,152 is 200 MB) the logits are computed once and q, q - p_t kept for the backward —
~1.8× fewer LM-head products than recomputing, the same values up to summation order. The gradient w.r.t. z_j is
    g_ce (q_j - 1[j=y]) + g_kl (q_j - p_j) + g_tv · ½ q_j (s_j - Σ_v q_v s_v),   s = sign(q - p_t).
With a draft vocabulary (docs/architecture.md, "Draft vocabulary") `lm_head` is the drafter's D rows, q lives on
those D tokens and p_t is the target's distribution over its whole vocabulary restricted to them (`lse_t`: the
target's log-normaliser over all V, given). Then tv = ½ (Σ_D |q - p_t| + p_t mass outside the D), so 1 - tv is
still the acceptance probability; kl is the restricted Σ_D p_t log(p_t / q); a row whose data token is outside
the D (y = -1) has ce = 0. In the gradient above the kl part becomes g_kl (q_j P - p_j), P = Σ_D p_t (the tv part
is unchanged: the outside mass does not depend on z).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TERMS = ("ce", "kl", "tv")
DFLASH_WEIGHTS = {"ce": 1.0}
DSPARK_WEIGHTS = {"tv": 1.8, "ce": 0.1}  # = 0.9 × L1 + 0.1 × CE
N_CAL_BINS = 10
WHOLE_VOCAB_BYTES = 512 << 20  # q (and p_t) kept for the backward up to this size; larger → chunked recompute


def effective_chunk(rows: int, vocab: int, with_target: bool, chunk: int) -> int:
    """The vocabulary chunk `objective` uses: the whole vocabulary when its kept probabilities fit."""
    return vocab if rows * vocab * 4 * (2 if with_target else 1) <= WHOLE_VOCAB_BYTES else chunk


def check_weights(weights: dict[str, float]) -> dict[str, float]:
    bad = sorted(set(weights) - set(TERMS))
    if bad or not any(float(v) > 0 for v in weights.values()) or any(float(v) < 0 for v in weights.values()):
        raise ValueError(f"loss weights {dict(weights)}: terms from {list(TERMS)}, >= 0, at least one > 0")
    return {k: float(v) for k, v in weights.items()}


def _matmul_dtype(h: torch.Tensor, lm_head: torch.Tensor) -> torch.dtype:
    """The dtype of the logit products: autocast's when the forward runs under it (the backward, which
    runs outside autocast, must recompute the same logits), else the promoted input dtype."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, lm_head.dtype)


def _chunk_logits(h, e, w2, lm_head, lo, hi, dt):
    z = h.to(dt) @ lm_head[lo:hi].to(dt).t()
    if e is not None:
        z = z + e.to(dt) @ w2[lo:hi].to(dt).t()
    return z.float()


def _target_logits(ht, lm_head, lo, hi, dt, t_index=None):
    """(M, hi - lo) fp32 target logits of every row: one product per distinct state, gathered per row."""
    t = (ht.to(dt) @ lm_head[lo:hi].to(dt).t()).float()
    return t if t_index is None else t[t_index]


@torch.no_grad()
def target_lse(ht: torch.Tensor, lm_head: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """ht (U, H), lm_head (V, H) the target's whole head → (U,) fp32 log-normaliser of its logits (no gradient:
    the target is frozen). With a draft vocabulary the objective's p_t needs it over all V, not only the D."""
    dt = _matmul_dtype(ht, lm_head)
    out = torch.full((ht.shape[0],), float("-inf"), device=ht.device)
    for lo in range(0, lm_head.shape[0], chunk):
        out = torch.logaddexp(out, torch.logsumexp(_target_logits(ht, lm_head, lo, min(lm_head.shape[0], lo + chunk), dt), -1))
    return out


class ChunkedDistLoss(torch.autograd.Function):
    """→ terms (M, 3) fp32 [ce, kl, tv] per row (differentiable) and top-1 hits (M,) bool."""

    @staticmethod
    def forward(ctx, h, e, w2, lm_head, ht, y, chunk: int, t_index=None, lse_full=None):
        M, V = h.shape[0], lm_head.shape[0]
        dev, dt = h.device, _matmul_dtype(h, lm_head)
        has_t = ht is not None
        ctx.whole = chunk >= V
        if ctx.whole:
            return _forward_whole(ctx, h, e, w2, lm_head, ht, y, dt, t_index, lse_full)
        lse_z = torch.full((M,), float("-inf"), device=dev)
        lse_t = torch.full((M,), float("-inf"), device=dev)
        if lse_full is not None:  # the target's normaliser over its whole vocabulary (a draft vocabulary)
            lse_t = lse_full if t_index is None else lse_full[t_index]
        best = torch.full((M,), float("-inf"), device=dev)
        arg = torch.zeros(M, dtype=torch.long, device=dev)
        z_y = torch.zeros(M, device=dev)
        for lo in range(0, V, chunk):
            hi = min(V, lo + chunk)
            z = _chunk_logits(h, e, w2, lm_head, lo, hi, dt)
            lse_z = torch.logaddexp(lse_z, torch.logsumexp(z, -1))
            m, i = z.max(-1)
            upd = m > best
            best, arg = torch.where(upd, m, best), torch.where(upd, i + lo, arg)
            inside = (y >= lo) & (y < hi)
            z_y = torch.where(inside, z.gather(1, (y - lo).clamp(0, hi - lo - 1)[:, None]).squeeze(1), z_y)
            if has_t and lse_full is None:
                lse_t = torch.logaddexp(lse_t, torch.logsumexp(_target_logits(ht, lm_head, lo, hi, dt, t_index), -1))
        kl = torch.zeros(M, device=dev)
        l1 = torch.zeros(M, device=dev)
        qs = torch.zeros(M, device=dev)
        p_in = torch.zeros(M, device=dev)
        if has_t:
            for lo in range(0, V, chunk):
                hi = min(V, lo + chunk)
                logq = _chunk_logits(h, e, w2, lm_head, lo, hi, dt) - lse_z[:, None]
                logp = _target_logits(ht, lm_head, lo, hi, dt, t_index) - lse_t[:, None]
                q, p = logq.exp(), logp.exp()
                kl += (p * (logp - logq)).sum(-1)
                l1 += (q - p).abs().sum(-1)
                qs += (q * torch.sign(q - p)).sum(-1)
                p_in += p.sum(-1)
            if lse_full is not None:
                l1 += (1.0 - p_in).clamp_min(0.0)  # the target's mass outside the draft vocabulary
        ce = torch.where(y >= 0, lse_z - z_y, 0.0)  # y = -1: a data token outside the draft vocabulary
        terms = torch.stack([ce, kl, 0.5 * l1], dim=-1)
        hits = arg == y
        ctx.save_for_backward(h, e, w2, lm_head, ht, y, lse_z, lse_t, qs, t_index,
                              p_in if lse_full is not None else None)  # fmt: skip
        ctx.chunk, ctx.dt = chunk, dt
        ctx.mark_non_differentiable(hits)
        return terms, hits

    @staticmethod
    def backward(ctx, g_terms, _g_hits):
        if ctx.whole:
            return _backward_whole(ctx, g_terms)
        h, e, w2, lm_head, ht, y, lse_z, lse_t, qs, t_index, p_in = ctx.saved_tensors
        V, dt = lm_head.shape[0], ctx.dt
        g_ce, g_kl, g_tv = g_terms.float().unbind(-1)
        g_ce = g_ce * (y >= 0)  # ce is the constant 0 where y = -1
        need_h, need_e, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        gh = torch.zeros_like(h, dtype=torch.float32) if need_h else None
        ge = torch.zeros_like(e, dtype=torch.float32) if (need_e and e is not None) else None
        gw2 = torch.zeros_like(w2, dtype=torch.float32) if (need_w2 and w2 is not None) else None
        rows = torch.arange(h.shape[0], device=h.device)
        for lo in range(0, V, ctx.chunk):
            hi = min(V, lo + ctx.chunk)
            q = (_chunk_logits(h, e, w2, lm_head, lo, hi, dt) - lse_z[:, None]).exp()
            gz = g_ce[:, None] * q
            inside = (y >= lo) & (y < hi)
            gz[rows[inside], y[inside] - lo] -= g_ce[inside]
            if ht is not None:
                p = (_target_logits(ht, lm_head, lo, hi, dt, t_index) - lse_t[:, None]).exp()
                gz += g_kl[:, None] * ((q if p_in is None else q * p_in[:, None]) - p)
                gz += (0.5 * g_tv)[:, None] * q * (torch.sign(q - p) - qs[:, None])
            if gh is not None:
                gh += gz @ lm_head[lo:hi].float()
            if ge is not None:
                ge += gz @ w2[lo:hi].float()
            if gw2 is not None:
                gw2[lo:hi] += gz.t() @ e.float()
        cast = lambda g, ref: None if g is None else g.to(ref.dtype)  # noqa: E731
        return cast(gh, h), cast(ge, e), cast(gw2, w2), None, None, None, None, None, None


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, V), (M, V) → (M,) Σ_v a·b in one pass (a batched GEMV; no (M, V) product is materialised)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _forward_whole(ctx, h, e, w2, lm_head, ht, y, dt, t_index=None, lse_full=None):
    """ChunkedDistLoss.forward with one chunk: logits once, q and d = q - p_t saved for the backward.

    Each (M, V) pass is memory-bound on a CPU, so the terms take as few as they can:
    kl = Σ p log p (once per distinct target state) - Σ p log q, tv = ½ Σ d·sign(d), qs = Σ q·sign(d)."""
    V = lm_head.shape[0]
    z = _chunk_logits(h, e, w2, lm_head, 0, V, dt)  # (M, V) fp32
    lse_z = torch.logsumexp(z, -1)
    arg = z.argmax(-1)
    known = y >= 0  # y = -1: a data token outside the draft vocabulary (ce = 0)
    ce = torch.where(known, lse_z - z.gather(1, y.clamp_min(0)[:, None]).squeeze(1), 0.0)
    logq = z.sub_(lse_z[:, None])  # z is not read again
    q = logq.exp()
    if ht is not None:
        t = _target_logits(ht, lm_head, 0, V, dt)  # (U, V): one per distinct state
        logp = torch.log_softmax(t, -1) if lse_full is None else t.sub_(lse_full[:, None])
        p = logp.exp()
        p_logp = _rowdot(p, logp)  # (U,)
        p_out = (1.0 - p.sum(-1)).clamp_min(0.0) if lse_full is not None else None  # mass outside the draft vocabulary
        if t_index is not None:
            p, p_logp = p[t_index], p_logp[t_index]  # (M, V), (M,)
            p_out = p_out[t_index] if p_out is not None else None
        kl = p_logp - _rowdot(p, logq)
        d = q - p
        del p, logq
        sign = torch.sign(d)
        l1, qs = _rowdot(d, sign), _rowdot(q, sign)
        if p_out is not None:
            l1 = l1 + p_out
    else:
        d = qs = p_out = None
        kl = l1 = torch.zeros_like(ce)
    ctx.save_for_backward(h, e, w2, lm_head, y, q, d, qs, p_out)
    hits = arg == y  # never for y = -1
    ctx.mark_non_differentiable(hits)
    return torch.stack([ce, kl, 0.5 * l1], dim=-1), hits


def _backward_whole(ctx, g_terms):
    """gz = q ⊙ (g_ce + ½ g_tv (sign(d) - qs)) + g_kl d - g_ce 1[y]  (= the module docstring's gradient, d = q - p)."""
    h, e, w2, lm_head, y, q, d, qs, p_out = ctx.saved_tensors
    g_ce, g_kl, g_tv = g_terms.float().unbind(-1)
    known = y >= 0
    g_ce = g_ce * known  # ce is the constant 0 where y = -1
    if d is not None:
        half_tv = 0.5 * g_tv
        gz = torch.sign(d).mul_(half_tv[:, None]).add_((g_ce - half_tv * qs)[:, None]).mul_(q)  # (M, V) fp32
        gz.addcmul_(d, g_kl[:, None])
        if p_out is not None:  # restricted kl: g_kl (q P - p) = g_kl (d - q (1 - P))
            gz.addcmul_(q, (g_kl * p_out)[:, None], value=-1.0)
    else:
        gz = g_ce[:, None] * q
    rows = torch.arange(h.shape[0], device=h.device)
    gz[rows[known], y[known]] -= g_ce[known]
    need_h, need_e, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    gh = (gz @ lm_head.float()).to(h.dtype) if need_h else None
    ge = (gz @ w2.float()).to(e.dtype) if (need_e and e is not None) else None
    gw2 = (gz.t() @ e.float()).to(w2.dtype) if (need_w2 and w2 is not None) else None
    return gh, ge, gw2, None, None, None, None, None, None


def dist_terms(h, lm_head, y, ht=None, e=None, w2=None, chunk: int = 8192, t_index=None, lse_full=None):
    """h (M, H), lm_head (V, H) frozen, y (M,), ht (U, H) target last hidden states or None, t_index (M,) the
    state of each row (None: U = M, row i's is ht[i]), e (M, r) / w2 (V, r) the Markov embedding and projection
    (or None) → (terms (M, 3) [ce, kl, tv], hits (M,)). The target's logits are computed once per distinct
    state: the overlapping blocks of a sequence predict the same positions many times over. With a draft
    vocabulary lm_head is its D rows, y its row of each data token (-1: none) and lse_full (U,) the target's
    log-normaliser over its whole vocabulary (`target_lse`)."""
    return ChunkedDistLoss.apply(h, e, w2, lm_head, ht, y, int(chunk), t_index, lse_full)


def dense_terms(h, lm_head, y, ht=None, e=None, w2=None, t_index=None, draft_ids=None):
    """Reference of dist_terms with full (M, V) tensors (tests). draft_ids (D,): the draft vocabulary, with
    lm_head the target's whole head and y target ids (q is the drafter's softmax over those D rows)."""
    if ht is not None and t_index is not None:
        ht = ht[t_index]
    rows = lm_head if draft_ids is None else lm_head[draft_ids]
    z = h @ rows.t() + (e @ w2.t() if e is not None else 0)
    logq = torch.log_softmax(z, -1)
    if draft_ids is not None:  # the drafter's distribution on the target's vocabulary: 0 outside the D
        logq = torch.full((z.shape[0], lm_head.shape[0]), float("-inf"), dtype=z.dtype).index_copy_(1, draft_ids, logq)
    ce = -logq.gather(1, y[:, None]).squeeze(1)
    ce = torch.where(torch.isinf(ce), 0.0, ce)  # a data token the drafter cannot draft: no ce
    if ht is None:
        zero = torch.zeros_like(ce)
        return torch.stack([ce, zero, zero], -1)
    logp = torch.log_softmax(ht @ lm_head.t(), -1)
    p = logp.exp()
    inside = torch.isfinite(logq)
    kl = torch.where(inside, p * (logp - logq), 0.0).sum(-1)
    tv = 0.5 * (logq.exp() - p).abs().sum(-1)
    return torch.stack([ce, kl, tv], -1)


@dataclass
class DistOutputs:
    weighted_sum: torch.Tensor  # scalar, differentiable: Σ w (λ·terms + λ_conf BCE)
    weight_sum: torch.Tensor  # Σ w over rows
    terms: torch.Tensor  # (M, 3) detached
    accept: torch.Tensor | None  # (M,) analytic acceptance 1 - tv (None without the target's distribution)
    conf: torch.Tensor | None  # (M,) predicted acceptance sigmoid(conf_logit)
    hits: torch.Tensor  # (M,) bool


def reach_weights(accept: torch.Tensor, block_id: torch.Tensor, draft_index: torch.Tensor, n_blocks: int,
                  n_draft: int) -> torch.Tensor:
    """(M,) the chance each row's position is reached: Π_{j<k} a_j over the same block's earlier draft rows
    (a row absent from the block ends the product: positions after it are not reached)."""
    grid = torch.zeros(n_blocks, n_draft, device=accept.device, dtype=torch.float32)
    grid[block_id, draft_index] = accept.float()
    before = torch.cumprod(torch.cat([torch.ones_like(grid[:, :1]), grid[:, :-1]], dim=1), dim=1)
    return before[block_id, draft_index]


def objective(h, lm_head, y, w_row, weights: dict[str, float], ht=None, e=None, w2=None, conf_logit=None,
              conf_weight: float = 0.0, chunk: int = 8192,
              reach: tuple[torch.Tensor, torch.Tensor, int, int] | None = None, t_index=None,
              lse_full=None) -> DistOutputs:
    """The weighted block objective over M rows (see the module docstring). `reach` = (block_id, draft_index,
    n_blocks, n_draft) of each row: the row weights are also multiplied by `reach_weights` (acceptance
    weighting, detached). ht, t_index: the distinct target states and each row's; lse_full: a draft vocabulary's
    target normaliser (`dist_terms`)."""
    weights = check_weights(weights)
    if ht is None and (weights.get("kl", 0) > 0 or weights.get("tv", 0) > 0 or (conf_logit is not None and conf_weight > 0)
                       or reach is not None):
        raise ValueError("kl / tv / confidence terms and acceptance weighting need the target's last hidden state "
                         "(extract it for this drafter)")
    terms, hits = dist_terms(h, lm_head, y, ht, e, w2, effective_chunk(h.shape[0], lm_head.shape[0], ht is not None, chunk),
                             t_index, lse_full)
    lam = torch.tensor([weights.get(t, 0.0) for t in TERMS], device=h.device)
    per_row = (terms * lam).sum(-1)
    accept = (1.0 - terms[:, 2]).detach() if ht is not None else None
    conf = None
    if conf_logit is not None:
        conf = torch.sigmoid(conf_logit.detach().float())
        if conf_weight > 0:
            per_row = per_row + conf_weight * F.binary_cross_entropy_with_logits(
                conf_logit.float(), accept.clamp(0.0, 1.0), reduction="none")
    w = w_row.float()
    if reach is not None:
        w = w * reach_weights(accept, *reach)
    weighted = (w * per_row).sum() + h.sum() * 0.0
    return DistOutputs(weighted, w.sum().detach(), terms.detach(), accept, conf, hits)


def analytic_stats(accept: torch.Tensor, conf: torch.Tensor | None, draft_index: torch.Tensor, block_id: torch.Tensor,
                   n_blocks: int, n_draft: int) -> torch.Tensor:
    """All-reducible sums for the val metrics.

    accept (M,) analytic acceptance of each valid row, draft_index (M,) k = 0..n_draft-1, block_id (M,) in
    [0, n_blocks). Layout: [Σ accept per k (n_draft), rows per k (n_draft), Σ analytic τ over blocks, blocks,
    per calibration bin (count, Σ conf, Σ accept) × N_CAL_BINS].
    The analytic τ of a block = 1 + Σ_k Π_{j ≤ k} a_j (a missing row ends the product).
    """
    dev = accept.device
    acc_k = torch.zeros(n_draft, device=dev, dtype=torch.float64).index_add_(0, draft_index, accept.double())
    cnt_k = torch.zeros(n_draft, device=dev, dtype=torch.float64).index_add_(0, draft_index, torch.ones_like(accept, dtype=torch.float64))
    grid = torch.zeros(n_blocks, n_draft, device=dev, dtype=torch.float64)
    grid[block_id, draft_index] = accept.double()
    tau = (1.0 + torch.cumprod(grid, dim=-1).sum(-1)).sum().reshape(1)
    cal = torch.zeros(N_CAL_BINS, 3, device=dev, dtype=torch.float64)
    if conf is not None:
        b = (conf.double() * N_CAL_BINS).long().clamp(0, N_CAL_BINS - 1)
        cal.index_add_(0, b, torch.stack([torch.ones_like(conf, dtype=torch.float64), conf.double(), accept.double()], -1))
    return torch.cat([acc_k, cnt_k, tau, torch.tensor([float(n_blocks)], device=dev, dtype=torch.float64), cal.flatten()])


def summarize_analytic(stats: torch.Tensor, n_draft: int, with_conf: bool) -> dict[str, float]:
    """val metrics: analytic_accept_k (per draft index), analytic_tau, conf_ece (binned |conf - acceptance|)."""
    acc_k, cnt_k = stats[:n_draft], stats[n_draft : 2 * n_draft]
    tau, blocks = float(stats[2 * n_draft]), float(stats[2 * n_draft + 1])
    cal = stats[2 * n_draft + 2 :].view(N_CAL_BINS, 3)
    out = {f"analytic_accept_{k}": float(acc_k[k] / cnt_k[k]) if cnt_k[k] > 0 else 0.0 for k in range(n_draft)}
    out["analytic_tau"] = tau / blocks if blocks > 0 else 1.0
    if with_conf and cal[:, 0].sum() > 0:
        n = cal[:, 0].sum()
        nz = cal[:, 0] > 0
        out["conf_ece"] = float(((cal[nz, 1] - cal[nz, 2]).abs()).sum() / n)
    return out
