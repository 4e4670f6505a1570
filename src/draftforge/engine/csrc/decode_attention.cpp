// Attention of a decode step's few query rows over the KV cache on x86 with AVX2 + FMA (docs/architecture.md
// "CPU attention"): o (G, R, D) = softmax(q kᵀ · scale + mask) v per KV head g, for R query rows (a KV group's query
// heads × the span's nodes, folded) over the cache's first L rows. SDPA's CPU kernel pays a fixed cost per call
// (blocking, per-thread buffers) larger than this whole product at a few rows: 1.5–2.2× this kernel's time at ≤ 6 rows,
// about equal from 12 (measured: docs/benchmarks.md "A decode-attention kernel"). Each pass of ≤ 4 rows loads a key
// or value row once for all of them.
// Each output row is one thread's sum in a fixed order, so results do not depend on the thread count.
// Preconditions (checked here): fp32; q (G, R, D) contiguous; k, v (G, ≥ L, D) with unit stride along D; D a multiple
// of 8; mask (R, L) contiguous additive (−inf hides a key) or none. A row whose keys are all hidden gets zeros
// (SDPA gives NaN there; the engine never asks for one).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using draftforge_avx2::exp_nonpos;
using draftforge_avx2::hsum;

constexpr int MB = 4;  // query rows per pass: each key and value row is loaded once for up to MB rows

// Softmax of one row of scores s (L) in place → their sum; s[j] = exp(s[j] − max) (0 where −inf). Returns 0 when
// every key is hidden.
float softmax_row(float* s, int64_t L) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t j = 0; j < L; ++j) mx = s[j] > mx ? s[j] : mx;
  if (mx == ninf) return 0.f;  // every key hidden
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 p = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  float sum = hsum(vsum);
  if (j < L) {  // the tail through the same lanes, so every probability has one formula
    float tail[8] = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
    for (int64_t i = 0; j + i < L; ++i) tail[i] = s[j + i] - mx;
    float p[8];
    _mm256_storeu_ps(p, exp_nonpos(_mm256_loadu_ps(tail)));
    for (int64_t i = 0; j + i < L; ++i) {
      s[j + i] = p[i];
      sum += p[i];
    }
  }
  return sum;
}

// Rows r0 … r0+M−1 (M ≤ MB) of one KV group: q rows (M, D) contiguous, keys / values k, v (L rows, row strides
// ks / vs), mask rows (M, L) or none → out rows (M, D); s: scratch of MB × (L + 8) floats.
template <int M>
void attend_rows(const float* q, const float* k, const float* v, const float* mask, float* out, int64_t L, int64_t D,
                 int64_t ks, int64_t vs, float scale, float* s) {
  const int64_t sl = L + 8;
  for (int64_t j = 0; j < L; ++j) {  // scores: each key row read once for the M rows
    const float* kj = k + j * ks;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(kj + d);
      for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), kv, acc[r]);
    }
    for (int r = 0; r < M; ++r) s[r * sl + j] = hsum(acc[r]) * scale + (mask ? mask[r * L + j] : 0.f);
  }
  float inv[M];
  for (int r = 0; r < M; ++r) {
    const float sum = softmax_row(s + r * sl, L);
    inv[r] = sum > 0.f ? 1.f / sum : 0.f;  // all hidden: zeros (probabilities are never read then)
    if (sum == 0.f)
      for (int64_t j = 0; j < L; ++j) s[r * sl + j] = 0.f;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {  // values: 16 columns × M rows of accumulators per pass
    const int w = D - d0 >= 16 ? 2 : 1;
    __m256 acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const float* vj = v + j * vs + d0;
      const __m256 v0 = _mm256_loadu_ps(vj);
      const __m256 v1 = w == 2 ? _mm256_loadu_ps(vj + 8) : _mm256_setzero_ps();
      for (int r = 0; r < M; ++r) {
        const __m256 p = _mm256_set1_ps(s[r * sl + j]);
        acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < M; ++r) {
      const __m256 vi = _mm256_set1_ps(inv[r]);
      _mm256_storeu_ps(out + r * D + d0, _mm256_mul_ps(acc[r][0], vi));
      if (w == 2) _mm256_storeu_ps(out + r * D + d0 + 8, _mm256_mul_ps(acc[r][1], vi));
    }
  }
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               int64_t L, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q (G, R, D), k, v (G, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  const int64_t G = q.size(0), R = q.size(1), D = q.size(2);
  TORCH_CHECK(k.size(0) == G && v.size(0) == G && k.size(2) == D && v.size(2) == D, "decode_attention: shapes differ");
  TORCH_CHECK(L > 0 && k.size(1) >= L && v.size(1) >= L, "decode_attention: L outside the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: k, v need unit stride along D");
  TORCH_CHECK(D % 8 == 0, "decode_attention: D must be a multiple of 8");
  const float* mp = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->is_contiguous() && mask->numel() == R * L,
                "decode_attention: mask must be a contiguous fp32 (R, L)");
    mp = mask->data_ptr<float>();
  }
  auto out = torch::empty({G, R, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks = k.stride(1), vs = v.stride(1), kg = k.stride(0), vg = v.stride(0);
  const float sc = static_cast<float>(scale);
  const int64_t passes = (R + MB - 1) / MB;  // per group; a pass's rows share each key and value load
  at::parallel_for(0, G * passes, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(MB * (L + 8));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / passes, r0 = (i % passes) * MB, m = std::min<int64_t>(MB, R - r0);
      const float* qr = qp + (g * R + r0) * D;
      const float* kg0 = kp + g * kg;
      const float* vg0 = vp + g * vg;
      const float* mr = mp ? mp + r0 * L : nullptr;
      float* orow = op + (g * R + r0) * D;
      if (m == 4) attend_rows<4>(qr, kg0, vg0, mr, orow, L, D, ks, vs, sc, s.data());
      else if (m == 3) attend_rows<3>(qr, kg0, vg0, mr, orow, L, D, ks, vs, sc, s.data());
      else if (m == 2) attend_rows<2>(qr, kg0, vg0, mr, orow, L, D, ks, vs, sc, s.data());
      else attend_rows<1>(qr, kg0, vg0, mr, orow, L, D, ks, vs, sc, s.data());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "softmax(q kᵀ · scale + mask) v over the first L cache rows");
}
