// omnilab fused SnakeBeta (code2wav's activation): y = x + inv_beta[c] * sin(alpha[c] * x)^2 in one pass.
//
// x, y: [rows, L] fp32 with rows = B * C (row r is channel r % C); alpha, inv_beta: [C] (already exp'd / inverted
// by the caller). torch needs four passes and two temporaries for this (mul, sin, square, addcmul); the
// decoder runs it 29 times per 25-frame block over activations of up to 96 x 48000 floats, so the passes,
// not the sine, cost most. y may alias x (in place).
//
// sin is glibc's vector sinf (libmvec, x86_64 vector ABI: _ZGVeN16v_sinf / _ZGVdN8v_sinf, within 4 ulp,
// correct for every finite argument). Every element, tails included (masked / padded vectors), goes through
// the same vector call, so an element's result depends only on its value and its channel: not on L, on
// where a chunk starts, on the batch or on the thread count (streaming == offline bitwise for this op).
//
// Built by omnilab/kernels/build.py with -mavx512f (VEC = 16) or -mavx2 -mfma (VEC = 8), linked with -lmvec.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vec_t;
extern "C" __m512 _ZGVeN16v_sinf(__m512);
static inline vec_t vsin(vec_t v) { return _ZGVeN16v_sinf(v); }
static inline vec_t vset(float a) { return _mm512_set1_ps(a); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm512_mul_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec_t v) { _mm512_storeu_ps(p, v); }
static inline vec_t vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void vstore_n(float* p, vec_t v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
typedef __m256 vec_t;
extern "C" __m256 _ZGVdN8v_sinf(__m256);
static inline vec_t vsin(vec_t v) { return _ZGVdN8v_sinf(v); }
static inline vec_t vset(float a) { return _mm256_set1_ps(a); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm256_mul_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec_t v) { _mm256_storeu_ps(p, v); }
static inline vec_t vload_n(const float* p, int n) {
  float buf[VEC] = {0};
  memcpy(buf, p, sizeof(float) * n);
  return _mm256_loadu_ps(buf);
}
static inline void vstore_n(float* p, vec_t v, int n) {
  float buf[VEC];
  _mm256_storeu_ps(buf, v);
  memcpy(p, buf, sizeof(float) * n);
}
#define ISA_NAME "avx2"
#else
#error "snake.cpp needs -mavx512f or -mavx2 -mfma"
#endif

// x + (s * s) * inv_beta with s = sin(alpha * x): the order of torch's SnakeBeta (mul, sin, square, addcmul).
static inline vec_t snake(vec_t x, vec_t a, vec_t ib) {
  const vec_t s = vsin(vmul(x, a));
  return vadd(x, vmul(vmul(s, s), ib));
}

extern "C" {
const char* omnilab_snake_isa() { return ISA_NAME; }

// Returns 0, or -1 for shapes it does not take (rows not a multiple of C, C < 1, negative sizes).
int omnilab_snake(const float* x, const float* alpha, const float* inv_beta, float* y, int64_t rows, int64_t C,
                  int64_t L, int nt) {
  if (C < 1 || rows < 0 || L < 0 || rows % C) return -1;
  if (nt < 1) nt = 1;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const vec_t a = vset(alpha[r % C]), ib = vset(inv_beta[r % C]);
    const float* xr = x + r * L;
    float* yr = y + r * L;
    const int64_t lv = L - L % VEC;
    for (int64_t t = 0; t < lv; t += VEC) vstore(yr + t, snake(vload(xr + t), a, ib));
    if (lv < L) vstore_n(yr + lv, snake(vload_n(xr + lv, (int)(L - lv)), a, ib), (int)(L - lv));
  }
  return 0;
}
}
