// omnilab's fp32 vector helpers shared by the decoder kernels (gemv.cpp, norm.cpp, attn.cpp, stack.cpp): one register of
// VEC lanes, with -mavx512f (VEC = 16) or -mavx2 -mfma (VEC = 8). build.py hashes this header with every source that
// includes it, so an edit here rebuilds them. vsum's lane reduction is fixed per ISA (results stay independent
// of batch mates and thread counts).
#pragma once
#include <immintrin.h>
#include <stdint.h>

// bf16 (uint16 bit patterns) <-> fp32, scalar: widening is exact (the 16 bits become the high half of the word);
// rounding is to nearest even, as torch's fp32 -> bf16 conversion, with NaN kept quiet.
static inline float bf16_to_f32(uint16_t v) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)v << 16;
  return c.f;
}
static inline uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } c;
  c.f = f;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
  return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#define VEC 16
typedef __m512 vec_t;
static inline vec_t vzero() { return _mm512_setzero_ps(); }
static inline vec_t vset(float a) { return _mm512_set1_ps(a); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
// bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word.
static inline vec_t vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void vstore(float* p, vec_t v) { _mm512_storeu_ps(p, v); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec_t vsub(vec_t a, vec_t b) { return _mm512_sub_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm512_mul_ps(a, b); }
static inline vec_t vdiv(vec_t a, vec_t b) { return _mm512_div_ps(a, b); }
static inline float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
// glibc's vector expf (libmvec, x86_64 vector ABI; a source that calls it links -lmvec: build.py LINK_FLAGS)
extern "C" __m512 _ZGVeN16v_expf(__m512);
static inline vec_t vexp(vec_t v) { return _ZGVeN16v_expf(v); }
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC 8
typedef __m256 vec_t;
static inline vec_t vzero() { return _mm256_setzero_ps(); }
static inline vec_t vset(float a) { return _mm256_set1_ps(a); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec_t vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void vstore(float* p, vec_t v) { _mm256_storeu_ps(p, v); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec_t vsub(vec_t a, vec_t b) { return _mm256_sub_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm256_mul_ps(a, b); }
static inline vec_t vdiv(vec_t a, vec_t b) { return _mm256_div_ps(a, b); }
extern "C" __m256 _ZGVdN8v_expf(__m256);
static inline vec_t vexp(vec_t v) { return _ZGVdN8v_expf(v); }
static inline float vsum(vec_t v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define ISA_NAME "avx2"
#else
#error "omnilab's kernels need -mavx512f or -mavx2 -mfma"
#endif
