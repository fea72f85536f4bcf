// omnilab small-batch GEMV: y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]), fp32, M = 1..8 rows.
//
// Decode-time linears are memory bound: each weight element is read once per call. MKL's fp32 GEMM
// reads W at about half its 1-row bandwidth once M >= 3 (packing), so 4 decoding rows cost ~2x one row.
// This kernel streams W exactly once for all M rows: every weight vector loaded is multiplied with the M
// rows held in registers. Per output the sum runs over k in VEC-wide lanes in ascending order, then a
// fixed lane reduction, then the scalar tail: the result of a row does not depend on M or on the other
// rows (batch invariant for 1..8 rows).
//
// Built by omnilab/kernels/build.py twice per source hash: with -mavx512f (VEC = 16) and with
// -mavx2 -mfma (VEC = 8). OpenMP threads come from the OpenMP runtime already loaded by torch
// (same soname), and their number from the caller (torch.get_num_threads()).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vec_t;
static inline vec_t vzero() { return _mm512_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
typedef __m256 vec_t;
static inline vec_t vzero() { return _mm256_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec_t v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define ISA_NAME "avx2"
#else
#error "gemv.cpp needs -mavx512f or -mavx2 -mfma"
#endif

static const int64_t PREFETCH_FLOATS = 256;  // 1 KiB ahead per weight row (measured: +5-10 % at 4 rows)

// R consecutive outputs n0..n0+R-1 for all M rows.
template <int M, int R>
static inline void block(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                         float* __restrict y, int64_t n0, int64_t N, int64_t K) {
  vec_t acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vzero();
  const int64_t kv = K - K % VEC;
  for (int64_t k = 0; k < kv; k += VEC) {
    vec_t xv[M];
    for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const float* wr = w + (n0 + r) * K + k;
      _mm_prefetch((const char*)(wr + PREFETCH_FLOATS), _MM_HINT_T0);
      const vec_t wv = vload(wr);
      for (int m = 0; m < M; ++m) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* wr = w + (n0 + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t k = kv; k < K; ++k) s += wr[k] * x[m * K + k];
      if (b) s += b[n0 + r];
      y[m * N + n0 + r] = s;
    }
  }
}

template <int M>
static void gemv(const float* x, const float* w, const float* b, float* y, int64_t N, int64_t K, int nt) {
#if VEC == 16
  constexpr int R = M <= 4 ? 4 : 2;
#else
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
#endif
  const int64_t blocks = N / R;
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;  // contiguous rows of W per thread
    for (int64_t i = lo; i < hi; ++i) block<M, R>(x, w, b, y, i * R, N, K);
    if (t == T - 1)
      for (int64_t n = blocks * R; n < N; ++n) block<M, 1>(x, w, b, y, n, N, K);
  }
}

extern "C" {
const char* omnilab_gemv_isa() { return ISA_NAME; }
int omnilab_gemv_max_rows() { return 8; }

// Returns 0, or -1 when M is outside 1..8 (the caller checks first).
int omnilab_gemv_f32(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                     int nt) {
  if (nt < 1) nt = 1;
  switch (M) {
    case 1: gemv<1>(x, w, b, y, N, K, nt); return 0;
    case 2: gemv<2>(x, w, b, y, N, K, nt); return 0;
    case 3: gemv<3>(x, w, b, y, N, K, nt); return 0;
    case 4: gemv<4>(x, w, b, y, N, K, nt); return 0;
    case 5: gemv<5>(x, w, b, y, N, K, nt); return 0;
    case 6: gemv<6>(x, w, b, y, N, K, nt); return 0;
    case 7: gemv<7>(x, w, b, y, N, K, nt); return 0;
    case 8: gemv<8>(x, w, b, y, N, K, nt); return 0;
    default: return -1;
  }
}
}
