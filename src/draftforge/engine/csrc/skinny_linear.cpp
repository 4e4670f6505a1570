// Skinny fp32 products on x86 with AVX2 + FMA: y (M, N) = x (M, K) · w (N, K)ᵀ (+ bias) for the few rows a
// decode step multiplies (docs/architecture.md "CPU products"). The weight streams from memory once per call: each
// thread takes whole blocks of NB weight rows, and every row pair of x reuses that block from L1. Every output
// element is one thread's sum in a fixed order, so results do not depend on the thread count.
// Preconditions (checked by the caller and here): fp32, contiguous, K a multiple of 8.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// y[m0:m0+MB, n0:n0+NB] = x[m0:m0+MB] · w[n0:n0+NB]ᵀ (+ bias); K a multiple of 8.
template <int MB, int NB>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);
    for (int i = 0; i < MB; ++i) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <int NB>
inline void rows_of_block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<2, NB>(x, w, bias, y, K, N, m, n0);
  if (m < M) tile<1, NB>(x, w, bias, y, K, N, m, n0);
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous operands");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "skinny_linear: K must be a multiple of 8");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "skinny_linear: bias must be a contiguous fp32 (N,)");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  constexpr int64_t NB = 4;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows_of_block<NB>(xp, wp, bp, yp, M, K, N, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows_of_block<1>(xp, wp, bp, yp, M, K, N, n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "x (M, K) · w (N, K)ᵀ + bias"); }
