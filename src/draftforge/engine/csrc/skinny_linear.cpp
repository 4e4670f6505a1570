// Skinny fp32 products on x86 with AVX2 + FMA: y (M, N) = x (M, K) · w (N, K)ᵀ (+ bias) for the few rows a
// decode step multiplies (docs/architecture.md "CPU products"). The weight streams from memory once per call: each
// thread takes whole blocks of NB weight rows, and every pass of up to 3 x rows reuses that block from L1. With 2+
// rows each pass prefetches its share of the next block's lines, so memory stays busy while the passes compute; one
// row streams on the hardware prefetcher alone (measured: docs/benchmarks.md "The engine's AVX2 kernel" and "The
// kernel prefetches at every row count").
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

// The lines of the next block one pass prefetches: columns [k0, k1) of its R rows, spread over the pass's k loop.
struct Prefetch {
  const float* next;  // the next block's first row, or nullptr
  int64_t k0, k1;     // multiples of 16 floats (one 64-byte line)
};

// y[m0 : m0+MB, n0 : n0+R] for the R ≤ NB weight rows of the block at n0.
template <int MB, int R>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, Prefetch pf) {
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t span = pf.k1 - pf.k0;
  for (int64_t k = 0; k < K; k += 8) {
    if (pf.next != nullptr && (k & 15) == 0) {  // at most one line per weight row every 16 floats of k
      const int64_t pk = (pf.k0 + k * span / K) & ~int64_t(15);
      if (pk < pf.k1)
        for (int j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf.next + j * K + pk), _MM_HINT_T0);
    }
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

// Rows per pass: 3 while more than 4 remain (or exactly 3), then 2 + 2, 2 or 1. A 1-row pass keeps only R FMA chains
// in flight and costs most of a 3-row pass, so only M = 1 has one.
inline int64_t pass_rows(int64_t left) { return left == 4 ? 2 : left >= 3 ? 3 : left; }

inline int64_t n_passes(int64_t M) {
  int64_t p = 0;
  for (int64_t left = M; left > 0; left -= pass_rows(left)) ++p;
  return p;
}

// Every x row through the R weight rows at n0. With `next`, pass p of P prefetches the p-th P-part of the next
// block's lines, so the next block arrives while this one computes whatever the number of passes.
template <int R>
inline void block(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                  int64_t n0, const float* next, int64_t passes) {
  if (M == 1) return tile<1, R>(x, w, bias, y, K, N, 0, n0, Prefetch{nullptr, 0, 0});
  int64_t m = 0;
  for (int64_t p = 0; m < M; ++p) {
    const int64_t rows = pass_rows(M - m);
    const Prefetch pf{next, (K * p / passes) & ~int64_t(15), p + 1 == passes ? K : (K * (p + 1) / passes) & ~int64_t(15)};
    if (rows == 3) tile<3, R>(x, w, bias, y, K, N, m, n0, pf);
    else if (rows == 2) tile<2, R>(x, w, bias, y, K, N, m, n0, pf);
    else tile<1, R>(x, w, bias, y, K, N, m, n0, pf);
    m += rows;
  }
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
  const bool prefetch = M >= 2;  // one row: the hardware prefetcher alone keeps up (measured)
  const int64_t blocks = N / NB, passes = n_passes(M);
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* next = prefetch && b + 1 < b1 ? wp + (b + 1) * NB * K : nullptr;
      block<NB>(xp, wp, bp, yp, M, K, N, b * NB, next, passes);
    }
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<1>(xp, wp, bp, yp, M, K, N, n, nullptr, passes);  // N % 4 rows
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "x (M, K) · w (N, K)ᵀ + bias"); }
