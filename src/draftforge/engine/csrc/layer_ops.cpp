// The element-wise work of a decoder layer for a decode step's few rows on the CPU, fp32 (docs/architecture.md
// "CPU layer ops"): RMSNorm, residual add + RMSNorm, SwiGLU's silu(g)·u, and the q/k/v split with per-head norms and
// rotary. In torch each is 5–20 small ops at 3–9 µs of dispatch apiece on the 2-core host, more than their arithmetic
// over a few thousand values; here each is one call.
// Arithmetic is as written: the engine builds this file with -ffp-contract=off (no fused multiply-add), so the rotary
// equals torch's x·cos + rotate_half(x)·sin bit for bit. A norm's sum of squares is accumulated in double (torch's mean
// sums in float in another order: the two agree within a few ulp); silu's exp is the attention kernel's polynomial
// (avx2_math.h, relative error < 2e−7).
// Preconditions (checked here): fp32, contiguous, shapes as each function states. Single-threaded: each call is a few
// microseconds of work.
#include <torch/extension.h>
#include <immintrin.h>

#include "avx2_math.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace {

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, "layer_ops: ", name, " must be fp32 on the CPU");
  TORCH_CHECK(t.is_contiguous(), "layer_ops: ", name, " must be contiguous");
}

// y[i] = w[i] · (x[i] · r), r = 1 / sqrt(mean(x²) + eps): HF's RMSNorm in that order of operations.
inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// o = x·cos + rotate_half(x)·sin over one head, rotate_half(x) = [−x₂, x₁]: three roundings per value, as torch's.
inline void rope_row(const float* x, const float* c, const float* s, float* o, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i], b = -x[i + half] * s[i];
    o[i] = a + b;
  }
  for (int64_t i = half; i < hd; ++i) {
    const float a = x[i] * c[i], b = x[i - half] * s[i];
    o[i] = a + b;
  }
}

// silu(g)·u over 8 lanes: sigmoid from e = exp(−|g|) ≤ 1 (1 / (1 + e) for g ≥ 0, e / (1 + e) below), so exp never
// overflows.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 abs_g = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 e = draftforge_avx2::exp_nonpos(_mm256_sub_ps(_mm256_setzero_ps(), abs_g));
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg), den);
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

}  // namespace

// x (..., n) → RMSNorm over the last dim with weight w (n).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check(x, "x");
  check(w, "weight");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  TORCH_CHECK(w.numel() == n, "layer_ops.rms_norm: weight has ", w.numel(), " values for rows of ", n);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) norm_row(xp + m * n, wp, yp + m * n, n, static_cast<float>(eps));
  return y;
}

// h, r (..., n) → (s = h + r, RMSNorm(s)): a residual add and the next norm in one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor r, torch::Tensor w, double eps) {
  check(h, "h");
  check(r, "residual");
  check(w, "weight");
  TORCH_CHECK(h.sizes() == r.sizes(), "layer_ops.add_rms_norm: h ", h.sizes(), " and residual ", r.sizes(), " differ");
  const int64_t n = h.size(-1), rows = h.numel() / n;
  TORCH_CHECK(w.numel() == n, "layer_ops.add_rms_norm: weight has ", w.numel(), " values for rows of ", n);
  auto s = torch::empty_like(h), y = torch::empty_like(h);
  const float *hp = h.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t i = 0; i < rows * n; ++i) sp[i] = hp[i] + rp[i];
  for (int64_t m = 0; m < rows; ++m) norm_row(sp + m * n, wp, yp + m * n, n, static_cast<float>(eps));
  return {s, y};
}

// gu (..., 2I) = [gate | up] rows of the fused gate/up product → silu(gate) · up (..., I).
torch::Tensor silu_mul(torch::Tensor gu) {
  check(gu, "gate/up");
  const int64_t two_i = gu.size(-1), inter = two_i / 2, rows = gu.numel() / two_i;
  TORCH_CHECK(two_i % 2 == 0, "layer_ops.silu_mul: odd gate/up width ", two_i);
  auto sizes = gu.sizes().vec();
  sizes.back() = inter;
  auto y = torch::empty(sizes, gu.options());
  const float* p = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    const float *g = p + m * two_i, *u = g + inter;
    float* o = yp + m * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < inter) {  // the tail through the same lanes, so a value's result does not depend on where it sits
      float gt[8] = {0}, ut[8] = {0}, ot[8];
      for (int64_t j = i; j < inter; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
      _mm256_storeu_ps(ot, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
      for (int64_t j = i; j < inter; ++j) o[j] = ot[j - i];
    }
  }
  return y;
}

// qkv (1, M, (Hq + 2·Hkv)·hd) rows of the fused q/k/v product, cos/sin (M, hd) → q (1, Hq, M, hd), k, v (1, Hkv, M, hd)
// contiguous: per-head RMSNorm of q and k first where q_norm / k_norm weights (hd) are given, then rotary on q and k.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_heads(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                                 int64_t n_q, int64_t n_kv, int64_t hd,
                                                                 c10::optional<torch::Tensor> q_norm,
                                                                 c10::optional<torch::Tensor> k_norm, double eps) {
  check(qkv, "qkv");
  check(cos, "cos");
  check(sin, "sin");
  const int64_t width = qkv.size(-1), rows = qkv.numel() / width;
  TORCH_CHECK(width == (n_q + 2 * n_kv) * hd && hd % 2 == 0, "layer_ops.rope_heads: qkv width ", width, " is not (",
              n_q, " + 2·", n_kv, ")·", hd);
  TORCH_CHECK(cos.numel() == rows * hd && sin.numel() == rows * hd, "layer_ops.rope_heads: cos/sin must be (", rows,
              ", ", hd, ")");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "layer_ops.rope_heads: q and k norms come together");
  const float *qn = nullptr, *kn = nullptr;
  if (q_norm.has_value()) {
    check(*q_norm, "q_norm");
    check(*k_norm, "k_norm");
    TORCH_CHECK(q_norm->numel() == hd && k_norm->numel() == hd, "layer_ops.rope_heads: q/k norm weights must have ", hd,
                " values");
    qn = q_norm->data_ptr<float>();
    kn = k_norm->data_ptr<float>();
  }
  auto opt = qkv.options();
  auto q = torch::empty({1, n_q, rows, hd}, opt), k = torch::empty({1, n_kv, rows, hd}, opt),
       v = torch::empty({1, n_kv, rows, hd}, opt);
  const float *p = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  std::vector<float> normed(hd);
  for (int64_t m = 0; m < rows; ++m) {
    const float *row = p + m * width, *c = cp + m * hd, *s = sp + m * hd;
    for (int64_t h = 0; h < n_q + n_kv; ++h) {
      const float* x = row + h * hd;
      float* o = h < n_q ? qp + (h * rows + m) * hd : kp + ((h - n_q) * rows + m) * hd;
      if (qn != nullptr) {
        norm_row(x, h < n_q ? qn : kn, normed.data(), hd, static_cast<float>(eps));
        x = normed.data();
      }
      rope_row(x, c, s, o, hd);
    }
    for (int64_t h = 0; h < n_kv; ++h) {
      const float* x = row + (n_q + n_kv + h) * hd;
      float* o = vp + (h * rows + m) * hd;
      for (int64_t i = 0; i < hd; ++i) o[i] = x[i];
    }
  }
  return {q, k, v};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "(h + r, RMSNorm(h + r))");
  m.def("silu_mul", &silu_mul, "silu(gate) · up of fused gate/up rows");
  m.def("rope_heads", &rope_heads, "fused q/k/v rows → q, k, v heads with optional q/k norms and rotary");
}
