// Prototype, not in the engine (docs/benchmarks.md "What a CPU decode step pays beside its products"): attention of
// a decode step's few query rows over the KV cache with AVX2 + FMA, o (G, R, D) = softmax(q kᵀ · scale + mask) v per
// KV head g, over the cache's first L rows. Each (g, row) is one thread's work; keys and values are re-read per row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x ≤ 0: 2^n · 2^f, f in [−0.5, 0.5], degree-6 polynomial for 2^f; x below −87 gives 0.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

void attend_row(const float* q, const float* k, const float* v, const float* mask, float* out, int64_t L, int64_t D,
                int64_t ks, int64_t vs, float scale, float* s) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t j = 0; j < L; ++j) {
    const float* kj = k + j * ks;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), acc);
    const float sj = hsum(acc) * scale + (mask ? mask[j] : 0.f);
    s[j] = sj;
    mx = sj > mx ? sj : mx;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (mx == ninf) return;
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 p = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  float sum = hsum(vsum);
  if (j < L) {
    float tail[8] = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
    for (int64_t i = 0; j + i < L; ++i) tail[i] = s[j + i] - mx;
    float p[8];
    _mm256_storeu_ps(p, exp_nonpos(_mm256_loadu_ps(tail)));
    for (int64_t i = 0; j + i < L; ++i) {
      s[j + i] = p[i];
      sum += p[i];
    }
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t w = D - d0 < 64 ? (D - d0) / 8 : 8;
    __m256 acc[8];
    for (int c = 0; c < w; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < L; ++jj) {
      const __m256 p = _mm256_set1_ps(s[jj]);
      const float* vj = v + jj * vs + d0;
      for (int c = 0; c < w; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), acc[c]);
    }
    for (int c = 0; c < w; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               int64_t L, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_contiguous(), "q (G, R, D) contiguous, k, v (G, L, D)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && q.size(2) % 8 == 0, "unit stride along D, D % 8 == 0");
  const int64_t G = q.size(0), R = q.size(1), D = q.size(2);
  const float* mp = mask.has_value() ? mask->data_ptr<float>() : nullptr;
  auto out = torch::empty({G, R, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks = k.stride(1), vs = v.stride(1), kg = k.stride(0), vg = v.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, G * R, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(L + 8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / R, r = i % R;
      attend_row(qp + i * D, kp + g * kg, vp + g * vg, mp ? mp + r * L : nullptr, op + i * D, L, D, ks, vs, sc, s.data());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention, "decode-step attention"); }
