// omnilab small-batch GEMV: y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y fp32; W fp32 or bf16.
//
// Decode-time linears are memory bound: each weight element is read once per call. MKL's fp32 GEMM
// reads W at about half its 1-row bandwidth once M >= 3 (packing), so 4 decoding rows cost ~2x one row.
// This kernel streams W exactly once for all M rows: every weight vector loaded is multiplied with the M
// rows held in registers. Per output the sum runs over k in VEC-wide lanes in ascending order, then a
// fixed lane reduction, then the scalar tail: the result of a row does not depend on M or on the other
// rows (batch invariant for any M: rows beyond 8 go in groups of 8).
//
// bf16 weights (the released checkpoints' storage dtype) are expanded exactly to fp32 in registers, so
// an fp32 model whose matrices stay in bf16 computes the same products from half the bytes: decode,
// which is bandwidth bound, reads 2x fewer bytes per frame.
//
// Built by omnilab/kernels/build.py twice per source hash (vector helpers: simd.h): with -mavx512f (VEC = 16)
// and with -mavx2 -mfma (VEC = 8). OpenMP threads come from the OpenMP runtime already loaded by torch
// (same soname), and their number from the caller (torch.get_num_threads()).
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

static inline float to_float(float v) { return v; }
static inline float to_float(uint16_t v) { return bf16_to_f32(v); }

// R consecutive outputs n0..n0+R-1 for all M rows. WT: float, or uint16_t holding bf16 bit patterns
// (expanded exactly to fp32 in registers; all arithmetic is fp32 either way).
template <typename WT, int M, int R>
static inline void block(const float* __restrict x, const WT* __restrict w, const float* __restrict b,
                         float* __restrict y, int64_t n0, int64_t N, int64_t K) {
  constexpr int64_t per_line = 64 / sizeof(WT);  // weights per cache line
  vec_t acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  const int64_t kv = K - K % VEC;
  for (int64_t k = 0; k < kv; k += VEC) {
    vec_t xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const WT* wr = w + (n0 + r) * K + k;
      // The same line of the next block's row (R rows on): one block ahead of the hardware prefetcher,
      // which restarts at every short row (bf16 rows of 1024 are only 2 KiB). Measured at 1 row over the
      // predictor's matrices: bf16 weights 20 -> 27 GB/s, fp32 unchanged to +5 %; at 4 rows +15-25 %.
      if (k % per_line == 0) _mm_prefetch((const char*)(wr + R * K), _MM_HINT_T0);
      const vec_t wv = vload(wr);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const WT* wr = w + (n0 + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t k = kv; k < K; ++k) s = fmaf(to_float(wr[k]), x[m * K + k], s);  // explicit: no contraction choice
      if (b) s += b[n0 + r];
      y[m * N + n0 + r] = s;
    }
  }
}

// One row (a single decoding stream): each thread reads its contiguous rows of W front to back, one output at a
// time, so its reads are one sequential stream that the hardware prefetcher follows (no software prefetch: it
// measured no better). block<WT, M, R> interleaves R rows' streams instead, which the prefetcher follows worse
// when rows are short: on 2 Zen 4 cores a code-predictor pass of bf16 matrices (5 layers, K = 1024 / 2048 / 3072)
// took 5.5-5.6 ms this way against 6.2-6.6 ms with R = 8 (medians of 40 interleaved rounds). Per output the
// arithmetic is block<WT, 1, R>'s (the same lanes, reduction and tail), so results are bitwise those of any M.
template <typename WT>
static void gemv_one_row(const float* x, const WT* w, const float* b, float* y, int64_t N, int64_t K, int nt) {
  const int64_t kv = K - K % VEC;
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t lo = N * t / T, hi = N * (t + 1) / T;
    for (int64_t n = lo; n < hi; ++n) {
      const WT* wr = w + n * K;
      vec_t acc = vzero();
      for (int64_t k = 0; k < kv; k += VEC) acc = vfma(vload(wr + k), vload(x + k), acc);
      float s = vsum(acc);
      for (int64_t k = kv; k < K; ++k) s = fmaf(to_float(wr[k]), x[k], s);
      if (b) s += b[n];
      y[n] = s;
    }
  }
}

template <typename WT, int M>
static void gemv(const float* x, const WT* w, const float* b, float* y, int64_t N, int64_t K, int nt) {
  if (M == 1) return gemv_one_row<WT>(x, w, b, y, N, K, nt);
#if VEC == 16
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 2);
#else
  constexpr int R = M <= 1 ? 8 : (M <= 2 ? 4 : (M <= 4 ? 2 : 1));
#endif
  const int64_t blocks = N / R;
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;  // contiguous rows of W per thread
    for (int64_t i = lo; i < hi; ++i) block<WT, M, R>(x, w, b, y, i * R, N, K);
    if (t == T - 1)
      for (int64_t n = blocks * R; n < N; ++n) block<WT, M, 1>(x, w, b, y, n, N, K);
  }
}

// Rows beyond 8 go in groups of 8 (W streamed once per group); a row's result never depends on its group.
template <typename WT>
static void gemv_any(const float* x, const WT* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                     int nt) {
  if (nt < 1) nt = 1;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (M - m0 < 8 ? M - m0 : 8) {
      case 1: gemv<WT, 1>(xm, w, b, ym, N, K, nt); break;
      case 2: gemv<WT, 2>(xm, w, b, ym, N, K, nt); break;
      case 3: gemv<WT, 3>(xm, w, b, ym, N, K, nt); break;
      case 4: gemv<WT, 4>(xm, w, b, ym, N, K, nt); break;
      case 5: gemv<WT, 5>(xm, w, b, ym, N, K, nt); break;
      case 6: gemv<WT, 6>(xm, w, b, ym, N, K, nt); break;
      case 7: gemv<WT, 7>(xm, w, b, ym, N, K, nt); break;
      default: gemv<WT, 8>(xm, w, b, ym, N, K, nt); break;
    }
  }
}

extern "C" {
const char* omnilab_gemv_isa() { return ISA_NAME; }
int omnilab_gemv_max_rows() { return 8; }

// fp32 weights. Returns 0, or -1 when M is outside 1..8 (the caller checks first).
int omnilab_gemv_f32(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                     int nt) {
  if (M < 1 || M > 8) return -1;
  gemv_any<float>(x, w, b, y, M, N, K, nt);
  return 0;
}

// bf16 weights (uint16 bit patterns), fp32 x / b / y, any M >= 1 (groups of 8 rows). Returns 0, or -1 for M < 1.
int omnilab_gemv_bf16w(const float* x, const uint16_t* w, const float* b, float* y, int64_t M, int64_t N,
                       int64_t K, int nt) {
  if (M < 1) return -1;
  gemv_any<uint16_t>(x, w, b, y, M, N, K, nt);
  return 0;
}
}
