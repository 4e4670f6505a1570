// Skinny fp32 products on x86 with AVX2 + FMA: y (M, N) = x (M, K) · w (N, K)ᵀ (+ bias) for the few rows a
// decode step multiplies (docs/architecture.md "CPU products"). The weight streams from memory once per call: each
// thread takes whole blocks of NB weight rows, and every pass of up to 3 x rows reuses that block from L1. With 2–8
// rows (several passes per block) the next block is prefetched during the current one, so memory stays busy while
// later passes compute; one row streams on the hardware prefetcher alone, and above 8 rows the passes are
// compute-bound (measured: docs/benchmarks.md "The engine's AVX2 kernel").
// Every output element is one thread's sum in a fixed order, so results do not depend on the thread count.
// Preconditions (checked here): fp32, contiguous, K a multiple of 8, bias (N,) or none.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t NB = 4;  // weight rows per block: 3 x rows × 4 = 12 accumulators + 4 weight vectors ≤ 16 registers

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// y[m0 : m0+MB, n0 : n0+R] for the R ≤ NB weight rows of the block at n0; prefetches the next block when `next`.
template <int MB, int R>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, const float* next) {
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (next != nullptr && (k & 15) == 0)  // one 64-byte line per weight row every 16 floats
      for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    __m256 wv[R];
    for (int j = 0; j < R; ++j) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < R; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < R; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + (bias ? bias[n0 + j] : 0.f);
}

// Every x row through the R weight rows at n0: passes of 3 rows, then 2, then 1.
template <int R>
inline void block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                  int64_t n0, const float* next) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<3, R>(x, w, bias, y, K, N, m, n0, next);
  for (; m + 2 <= M; m += 2) tile<2, R>(x, w, bias, y, K, N, m, n0, next);
  if (m < M) tile<1, R>(x, w, bias, y, K, N, m, n0, next);
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous operands");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "skinny_linear: K must be a multiple of 8");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "skinny_linear: bias must be a contiguous fp32 (N,)");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool prefetch = M >= 2 && M <= 8;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* next = prefetch && b + 1 < b1 ? wp + (b + 1) * NB * K : nullptr;
      block<NB>(xp, wp, bp, yp, M, K, N, b * NB, next);
    }
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<1>(xp, wp, bp, yp, M, K, N, n, nullptr);  // N % 4 rows
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "x (M, K) · w (N, K)ᵀ + bias"); }
