// omnilab quantized GEMV: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b[N]); x, b, y fp32, W int8 per output
// channel or int4 per group along K (omnilab/kernels/quant.py: layout, codes, scales, reference).
//
// Layout (quant.py): output rows in blocks of 16, a block's 16 rows interleaved 4 bytes at a time, so a
// 64-byte chunk is 16 rows x 4 bytes (int8: 4 k per row; int4: 8 k per row, nibbles k and k+4 in a byte).
// Vector lanes are output rows (AVX-512: the 16 rows of a block; AVX2: 8, two halves per block, both done in one
// pass with int8 activations): a chunk is used as loaded, there is no horizontal reduction, and a thread reads its
// blocks as one sequential stream.
// The weights are read from memory once for all M rows: the block is finished for rows 0..MB-1, then the
// next MB rows re-read it from L1/L2 (a block is 16 x K bytes or less).
//
// Three modes (argument act: 0 fp32, 1 int8, 2 int16 activations):
//  - int8 activations: x quantized per row and 32-wide block of K (xq = rne(x * 127/amax), xs = amax/127,
//    quant.py: quantize_activations). Per block, an exact int32 dot: AVX-512 vpdpbusd (unsigned stored code x
//    signed activation, 4 products per lane per instruction; the stored code's offset (+128 / +8) is removed
//    by starting the accumulator at -offset * sum(xq of the block)); AVX2 vpmaddubsw + vpmaddwd (int8 weights
//    through abs / sign so no pair saturates: 2 * 128 * 127 < 2^15; int4: the 8 vpmaddubsw of a block summed in
//    int16 and widened by one vpmaddwd, 8 * 2 * 15 * 127 < 2^15, measured +1-14 % on a 2-core AVX2 EPYC with
//    bitwise the same results). Then, per block, in fp32:
//    acc += float(dot) * (scale[n, group] * xs[m, block]).
//  - int16 activations: x quantized per row and 32-wide block as above with 32767 for 127 (quant.py:
//    quantize_activations(bits=16)), stored per 4 k as (k0, k2), (k1, k3) pairs. Per block an exact int32 dot of
//    the stored unsigned code (u8, or nibble) and the int16 activation, two k per lane per instruction: AVX-512
//    VNNI vpdpwssd, AVX2 vpmaddwd; the code's word is split out of its dword by a mask and a 16-bit shift (even
//    bytes: k0, k2; odd: k1, k3), the offset removed through the start value as above. |dot| <= 32 * 255 * 32767
//    + 128 * 32 * 32767 < 2^31. The activation error is 1/256 of int8's (next to int8 weights' ~0.8 %,
//    negligible), at the integer path's cost: no code is expanded to fp32.
//  - fp32 activations: each code is expanded to fp32 in registers (int8: shifts + convert; int4 on AVX-512:
//    a 16-entry vpermps table of -8..7, on AVX2: shift, mask, convert), multiplied by x[m, k] broadcast into
//    two per-group accumulators (alternate k, for FMA latency), acc += (g0 + g1) * scale[n, group] at the end
//    of each group. Measured 1.3-2.2x slower than int8 activations (conversion work: compute bound).
//
// Determinism: every (row m, output n) lane runs the same instruction sequence whatever M, the batch mates,
// the thread count (threads split whole 16-row blocks) or the ISA (the int32 dots are exact and the fp32
// steps are the same per lane), so results are bitwise identical across all of them.
//
// Scales: fp32, or fp16 (int4: half the scale bytes), widened exactly to fp32 on load (vcvtph2ps), so the fp32 steps
// are the same for both.
//
// Built by build.py as -mavx512f -mfma -mavx512vnni -mavx512bw (qgemv.py uses it only on CPUs with avx512_vnni and
// avx512bw) and -mavx2 -mfma -mf16c. OpenMP threads come from torch's runtime, their number from the caller.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#define ROWS 16
#define ACT 32
// Software prefetch distance in bytes ahead in the thread's stream (0: none), per kind of call: one row with
// int8 activations, 2-16 rows with int8 activations, fp32 activations. The best distance is the CPU's: on Zen 4
// (1 thread, decode matrices from DRAM) 2048 gave +10-25 % for 2+ rows and the fp32 mode and -5-15 % for one
// int8-activation row (the hardware prefetcher alone did better); on a Xeon (Emerald Rapids, 2 threads) 4096 gave
// +30 % for that one row. These are the priors; omnilab/tuning/prefetch.py times the candidates on the machine and
// sets them (omnilab_qgemv_set_prefetch). A prefetch never changes a result.
static int64_t g_prefetch[3] = {0, 2048, 2048};

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define LANES 16
#define MB_I8 8   // rows per pass over a block (registers: 2-3 per row)
#define MB_F32 4
#define W8_OFFSET 128  // int8 dot counts the stored offset (code + 128); removed via the start value
typedef __m512 vf;
typedef __m512i vi;
static inline vf fzero() { return _mm512_setzero_ps(); }
static inline vf fload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf fset(float v) { return _mm512_set1_ps(v); }
static inline vf ffma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf fmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf fadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf cvt(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi iload(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
static inline vi iset(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
// int8 codes: stored u8 (q + 128) x signed x bytes.
struct W8 {
  vi v;
  explicit W8(vi raw) : v(raw) {}
  vi dot(vi acc, int32_t x4) const { return _mm512_dpbusd_epi32(acc, v, _mm512_set1_epi32(x4)); }
};
static inline vi dot4(vi acc, vi u4, int32_t x4) { return _mm512_dpbusd_epi32(acc, u4, _mm512_set1_epi32(x4)); }
static const float NIB_TABLE[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// code of nibble p (bits 4p..4p+3 of each lane) as fp32: vpermps reads only the low 4 bits of the index.
static inline vf nibble(vi v, int p, vf table) { return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * p), table); }
static inline vf nib_table() { return _mm512_loadu_ps(NIB_TABLE); }
static inline void store(float* y, const float* b, vf acc, int valid) {
  const __mmask16 mk = (__mmask16)((1u << valid) - 1);
  if (b) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mk, b));
  _mm512_mask_storeu_ps(y, mk, acc);
}
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LANES 8
#define MB_I8 4
#define MB_PAIR 4  // rows per pass of pair_i8 (both halves: 2 accumulators per row); 2 and 3 measured no faster
#define MB_F32 2
#define W8_OFFSET 0  // the abs/sign form counts the signed code itself
typedef __m256 vf;
typedef __m256i vi;
static inline vf fzero() { return _mm256_setzero_ps(); }
static inline vf fload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf fset(float v) { return _mm256_set1_ps(v); }
static inline vf ffma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf fmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf fadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf cvt(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi iload(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi iset(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi madd4(vi acc, vi u8, vi s8) {  // acc + sum of 4 (u8 * s8) per lane, exact here
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
struct W8 {
  vi q, a;  // signed codes and their magnitudes
  explicit W8(vi raw) : q(_mm256_xor_si256(raw, _mm256_set1_epi8((char)0x80))), a(_mm256_abs_epi8(q)) {}
  vi dot(vi acc, int32_t x4) const { return madd4(acc, a, _mm256_sign_epi8(_mm256_set1_epi32(x4), q)); }
};
static inline vf nibble(vi v, int p, vf) {
  const vi n = _mm256_and_si256(_mm256_srli_epi32(v, 4 * p), _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}
static inline vf nib_table() { return _mm256_setzero_ps(); }
static inline void store(float* y, const float* b, vf acc, int valid) {
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  for (int l = 0; l < valid; ++l) y[l] = b ? t[l] + b[l] : t[l];
}
#define ISA_NAME "avx2"
#else
#error "qgemv.cpp needs -mavx512f -mavx512vnni or -mavx2 -mfma"
#endif
#define HALVES (ROWS / LANES)

struct Args {
  const uint8_t* w;   // packed codes, [Np/16] blocks of 16 * Kp * bits / 8 bytes
  const void* s;      // scales [Np/16, groups, 16]: fp32, or fp16 where s16
  int s16;
  const float* b;     // bias [N] or null
  float* y;           // [M, N]
  int64_t M, N, Kp, gs, groups, nb;  // nb = Kp / 32
  const int8_t* xq;   // int8 / int16 modes: [M, Kp] codes (int16: as bytes), xs [M, nb] scales, xc [M, nb] starts
  const float* xs;
  const int32_t* xc;
  const float* xf;    // fp32 mode: x [M, Kp] (zero-padded)
};

// LANES scales from element idx: fp32, or fp16 widened exactly (F16C).
static inline vf sload(const Args& a, int64_t idx) {
#if LANES == 16
  if (a.s16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)a.s + idx)));
#else
  if (a.s16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)a.s + idx)));
#endif
  return fload((const float*)a.s + idx);
}

#if LANES == 16
// Outputs of one block (the 16 rows at i * 16; h is 0) for rows m0..m0+MB-1, int8 activations, AVX-512 (AVX2 runs
// pair_i8 below).
template <int BITS, int MB, bool A16>
static void block_i8(const Args& a, int64_t i, int h, int64_t m0) {
  constexpr int CH = BITS == 8 ? 8 : 4;  // 64-byte chunks per 32-wide K block
  const uint8_t* w = a.w + i * ROWS * a.Kp * BITS / 8 + h * LANES * 4;
  const int64_t s0 = i * a.groups * ROWS + h * LANES;
  const int64_t per_group = a.gs / ACT;
  // Two int32 chains per row when few rows (shorter dependency chains; integer sums are exact, so the split may
  // depend on MB without changing any result).
  constexpr int NA = (LANES == 16 && MB <= 4) ? 2 : 1;
  const int64_t pf = g_prefetch[a.M == 1 ? 0 : 1];
  constexpr int XB = A16 ? 2 : 1;  // bytes per activation
  vf acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = fzero();
  for (int64_t kb = 0; kb < a.nb; ++kb) {
    vi dot[NA][MB];
    const int32_t* x4[MB];
    for (int m = 0; m < MB; ++m) {
      dot[0][m] = iset(a.xc[(m0 + m) * a.nb + kb]);
      if (NA == 2) dot[NA - 1][m] = iset(0);
      x4[m] = (const int32_t*)(a.xq + ((m0 + m) * a.Kp + kb * ACT) * XB);
    }
    for (int c = 0; c < CH; ++c) {
      if (pf) _mm_prefetch((const char*)(w + (kb * CH + c) * 64 + pf), _MM_HINT_T0);
      const vi raw = iload(w + (kb * CH + c) * 64);
      if constexpr (A16) {
        const vi lo8 = iset(0x00FF00FF);
        if constexpr (BITS == 8) {  // chunk c: k 4c..4c+3, activation dwords 2c (k0, k2) and 2c + 1 (k1, k3)
          const vi ev = _mm512_and_si512(raw, lo8), od = _mm512_srli_epi16(raw, 8);
          for (int m = 0; m < MB; ++m) {
            dot[0][m] = _mm512_dpwssd_epi32(dot[0][m], ev, iset(x4[m][2 * c]));
            dot[NA - 1][m] = _mm512_dpwssd_epi32(dot[NA - 1][m], od, iset(x4[m][2 * c + 1]));
          }
        } else {  // low nibbles: k 8c..8c+3 (dwords 4c, 4c + 1); high: k 8c+4..8c+7 (4c + 2, 4c + 3)
          const vi mask = iset(0x0F0F0F0F);
          const vi lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi32(raw, 4), mask);
          const vi q[4] = {_mm512_and_si512(lo, lo8), _mm512_srli_epi16(lo, 8), _mm512_and_si512(hi, lo8),
                           _mm512_srli_epi16(hi, 8)};
          for (int m = 0; m < MB; ++m)
            for (int j = 0; j < 4; ++j)
              dot[j & (NA - 1)][m] = _mm512_dpwssd_epi32(dot[j & (NA - 1)][m], q[j], iset(x4[m][4 * c + j]));
        }
      } else if constexpr (BITS == 8) {
        const W8 wv(raw);
        for (int m = 0; m < MB; ++m) dot[c % NA][m] = wv.dot(dot[c % NA][m], x4[m][c]);
      } else {
        const vi mask = iset(0x0F0F0F0F);
        const vi lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi32(raw, 4), mask);
        for (int m = 0; m < MB; ++m) {
          dot[0][m] = dot4(dot[0][m], lo, x4[m][2 * c]);
          dot[NA - 1][m] = dot4(dot[NA - 1][m], hi, x4[m][2 * c + 1]);
        }
      }
    }
    if (NA == 2)
      for (int m = 0; m < MB; ++m) dot[0][m] = iadd(dot[0][m], dot[NA - 1][m]);
    const vf ws = sload(a, s0 + kb / per_group * ROWS);
    for (int m = 0; m < MB; ++m) acc[m] = ffma(cvt(dot[0][m]), fmul(ws, fset(a.xs[(m0 + m) * a.nb + kb])), acc[m]);
  }
  const int64_t n0 = i * ROWS + h * LANES;
  const int valid = (int)(a.N - n0 < LANES ? a.N - n0 : LANES);
  for (int m = 0; m < MB; ++m) store(a.y + (m0 + m) * a.N + n0, a.b ? a.b + n0 : nullptr, acc[m], valid);
}

#endif

// The same outputs with fp32 activations: codes expanded to fp32 in registers, FMA with x broadcast.
template <int BITS, int MB>
static void block_f32(const Args& a, int64_t i, int h, int64_t m0) {
  constexpr int KC = BITS == 8 ? 4 : 8;  // k per row in a chunk
  const uint8_t* w = a.w + i * ROWS * a.Kp * BITS / 8 + h * LANES * 4;
  const int64_t s0 = i * a.groups * ROWS + h * LANES;
  const int64_t chunks = a.gs / KC;  // per group
  const vf table = nib_table();
  const int64_t pf = g_prefetch[2];
  vf acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = fzero();
  for (int64_t g = 0; g < a.groups; ++g) {
    vf gacc[2][MB];  // two chains per row (FMA latency), always two: fp32 sums must not depend on MB
    for (int m = 0; m < MB; ++m) gacc[0][m] = gacc[1][m] = fzero();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      if (pf) _mm_prefetch((const char*)(w + c * 64 + pf), _MM_HINT_T0);
      const vi raw = iload(w + c * 64);
      const float* xk = a.xf + m0 * a.Kp + c * KC;
      if constexpr (BITS == 8) {
#if LANES == 16
        const vi v = _mm512_xor_si512(raw, iset((int32_t)0x80808080u));
#define BYTE_J(j) _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * (j)), 24)
#else
        const vi v = _mm256_xor_si256(raw, iset((int32_t)0x80808080u));
#define BYTE_J(j) _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * (j)), 24)
#endif
        for (int j = 0; j < 4; ++j) {
          const vf wf = cvt(BYTE_J(j));
          for (int m = 0; m < MB; ++m) gacc[j & 1][m] = ffma(wf, fset(xk[m * a.Kp + j]), gacc[j & 1][m]);
        }
#undef BYTE_J
      } else {
        for (int p = 0; p < 8; ++p) {  // nibble p: byte p/2, k = p/2 (low) or p/2 + 4 (high)
          const vf wf = nibble(raw, p, table);
          const int kk = (p >> 1) + 4 * (p & 1);
          for (int m = 0; m < MB; ++m) gacc[p & 1][m] = ffma(wf, fset(xk[m * a.Kp + kk]), gacc[p & 1][m]);
        }
      }
    }
    const vf ws = sload(a, s0 + g * ROWS);
    for (int m = 0; m < MB; ++m) acc[m] = ffma(fadd(gacc[0][m], gacc[1][m]), ws, acc[m]);
  }
  const int64_t n0 = i * ROWS + h * LANES;
  const int valid = (int)(a.N - n0 < LANES ? a.N - n0 : LANES);
  for (int m = 0; m < MB; ++m) store(a.y + (m0 + m) * a.N + n0, a.b ? a.b + n0 : nullptr, acc[m], valid);
}

#if LANES == 8
// AVX2, int8 activations: both 8-row halves of a block in one pass, so each 64-byte chunk is loaded whole, once, in
// stream order (block_i8 runs one half, then the other: each pass reads half of every cache line and the stream
// pauses during the second). Per lane the same integer dot and the same fp32 steps in the same order as block_i8,
// so the results are bitwise the same. Measured on a 2-core AVX2 EPYC, 2 threads, int4, the 0.6B predictor's
// four fused decode shapes x 5 (42 MB), median of 7 alternated rounds: one row 20.6 vs 17.9 GB/s, 4 rows 12.4 vs
// 10.9, 8 rows 7.3 vs 6.2 (prefetch 4096); int8 2 rows 20.9 vs 17.8.
template <int BITS, int MB, bool A16>
static void pair_i8(const Args& a, int64_t i, int64_t m0) {
  constexpr int CH = BITS == 8 ? 8 : 4;  // 64-byte chunks per 32-wide K block
  const uint8_t* w = a.w + i * ROWS * a.Kp * BITS / 8;
  const int64_t s0 = i * a.groups * ROWS;
  const int64_t per_group = a.gs / ACT;
  const int64_t pf = g_prefetch[a.M == 1 ? 0 : 1];
  vf acc[2][MB];
  for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = fzero();
  for (int64_t kb = 0; kb < a.nb; ++kb) {
    vi dot[2][MB];
    const int32_t* x4[MB];
    for (int m = 0; m < MB; ++m) {
      dot[0][m] = dot[1][m] = iset(a.xc[(m0 + m) * a.nb + kb]);
      x4[m] = (const int32_t*)(a.xq + ((m0 + m) * a.Kp + kb * ACT) * (A16 ? 2 : 1));
    }
    const uint8_t* wb = w + kb * CH * 64;
    if constexpr (A16) {  // as block_i8's int16 mode, vpmaddwd for vpdpwssd, both halves per chunk
      const vi lo8 = iset(0x00FF00FF), mask = iset(0x0F0F0F0F);
      for (int c = 0; c < CH; ++c) {
        if (pf) _mm_prefetch((const char*)(wb + c * 64 + pf), _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
          const vi raw = iload(wb + c * 64 + 32 * h);
          if constexpr (BITS == 8) {
            const vi ev = _mm256_and_si256(raw, lo8), od = _mm256_srli_epi16(raw, 8);
            for (int m = 0; m < MB; ++m)
              dot[h][m] = iadd(dot[h][m], iadd(_mm256_madd_epi16(ev, iset(x4[m][2 * c])),
                                               _mm256_madd_epi16(od, iset(x4[m][2 * c + 1]))));
          } else {
            const vi lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi32(raw, 4), mask);
            const vi q[4] = {_mm256_and_si256(lo, lo8), _mm256_srli_epi16(lo, 8), _mm256_and_si256(hi, lo8),
                             _mm256_srli_epi16(hi, 8)};
            for (int m = 0; m < MB; ++m)
              for (int j = 0; j < 4; ++j) dot[h][m] = iadd(dot[h][m], _mm256_madd_epi16(q[j], iset(x4[m][4 * c + j])));
          }
        }
      }
    } else if constexpr (BITS == 4) {
      // the block's 8 vpmaddubsw results summed in int16, widened once: each vpmaddubsw lane is
      // code_a * x_a + code_b * x_b with codes 0..15 and |x| <= 127, |.| <= 3810, so the 8 of a 32-wide block sum to
      // |.| <= 30480 < 2^15 (no overflow: the int32 dot is the same exact integer; measured +1-14 %)
      const vi mask = iset(0x0F0F0F0F);
      vi s16[2][MB];
      for (int m = 0; m < MB; ++m) s16[0][m] = s16[1][m] = _mm256_setzero_si256();
      for (int c = 0; c < CH; ++c) {
        if (pf) _mm_prefetch((const char*)(wb + c * 64 + pf), _MM_HINT_T0);
        const vi r0 = iload(wb + c * 64), r1 = iload(wb + c * 64 + 32);
        const vi lo0 = _mm256_and_si256(r0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi32(r0, 4), mask);
        const vi lo1 = _mm256_and_si256(r1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi32(r1, 4), mask);
        for (int m = 0; m < MB; ++m) {
          const vi xa = iset(x4[m][2 * c]), xb = iset(x4[m][2 * c + 1]);
          s16[0][m] = _mm256_add_epi16(s16[0][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa),
                                                                   _mm256_maddubs_epi16(hi0, xb)));
          s16[1][m] = _mm256_add_epi16(s16[1][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa),
                                                                   _mm256_maddubs_epi16(hi1, xb)));
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < MB; ++m) dot[h][m] = iadd(dot[h][m], _mm256_madd_epi16(s16[h][m], _mm256_set1_epi16(1)));
    } else {
      for (int c = 0; c < CH; ++c) {
        if (pf) _mm_prefetch((const char*)(wb + c * 64 + pf), _MM_HINT_T0);
        const W8 w0(iload(wb + c * 64)), w1(iload(wb + c * 64 + 32));
        for (int m = 0; m < MB; ++m) {
          dot[0][m] = w0.dot(dot[0][m], x4[m][c]);
          dot[1][m] = w1.dot(dot[1][m], x4[m][c]);
        }
      }
    }
    const int64_t sg = s0 + kb / per_group * ROWS;
    const vf ws0 = sload(a, sg), ws1 = sload(a, sg + LANES);
    for (int m = 0; m < MB; ++m) {
      const vf xs = fset(a.xs[(m0 + m) * a.nb + kb]);
      acc[0][m] = ffma(cvt(dot[0][m]), fmul(ws0, xs), acc[0][m]);
      acc[1][m] = ffma(cvt(dot[1][m]), fmul(ws1, xs), acc[1][m]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t n0 = i * ROWS + h * LANES;
    if (n0 >= a.N) break;
    const int valid = (int)(a.N - n0 < LANES ? a.N - n0 : LANES);
    for (int m = 0; m < MB; ++m) store(a.y + (m0 + m) * a.N + n0, a.b ? a.b + n0 : nullptr, acc[h][m], valid);
  }
}

template <int BITS, int MB, bool A16>
static inline void pair_rows(const Args& a, int64_t i, int64_t m0, int64_t r) {
  if constexpr (MB > 1)
    if (r < MB) return pair_rows<BITS, MB - 1, A16>(a, i, m0, r);
  pair_i8<BITS, MB, A16>(a, i, m0);
}
#endif

// ACTM: 0 fp32, 1 int8, 2 int16 activations.
template <int BITS, int ACTM, int MB>
static inline void block(const Args& a, int64_t i, int h, int64_t m0) {
#if LANES == 16
  if constexpr (ACTM > 0) return block_i8<BITS, MB, ACTM == 2>(a, i, h, m0);
#else
  static_assert(ACTM == 0, "AVX2 runs integer activations through pair_i8");
#endif
  block_f32<BITS, MB>(a, i, h, m0);
}

// block<MB = r> for r = 1..MB rows.
template <int BITS, int ACTM, int MB>
static inline void rows(const Args& a, int64_t i, int h, int64_t m0, int64_t r) {
  if constexpr (MB > 1)
    if (r < MB) return rows<BITS, ACTM, MB - 1>(a, i, h, m0, r);
  block<BITS, ACTM, MB>(a, i, h, m0);
}

template <int BITS, int ACTM>
static void run(const Args& a, int nt) {
  constexpr bool I8 = ACTM > 0;
  constexpr int MB = I8 ? MB_I8 : MB_F32;
  const int64_t blocks = (a.N + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t lo = blocks * t / T, hi = blocks * (t + 1) / T;  // contiguous blocks per thread
#if LANES == 8
    if constexpr (I8) {
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t m0 = 0; m0 < a.M; m0 += MB_PAIR)
          pair_rows<BITS, MB_PAIR, ACTM == 2>(a, i, m0, a.M - m0 < MB_PAIR ? a.M - m0 : MB_PAIR);
    } else
#endif
    for (int64_t i = lo; i < hi; ++i)
      for (int h = 0; h < HALVES && i * ROWS + h * LANES < a.N; ++h)
        for (int64_t m0 = 0; m0 < a.M; m0 += MB) rows<BITS, ACTM, MB>(a, i, h, m0, a.M - m0 < MB ? a.M - m0 : MB);
  }
}

// One 32-wide block of a row of x (K wide) from k0, zero-padded past K.
static inline void load_block(const float* row, int64_t K, int64_t k0, float* v) {
  const int64_t have = K - k0 < ACT ? K - k0 : ACT;
  memcpy(v, row + k0, have * sizeof(float));
  for (int64_t j = have; j < ACT; ++j) v[j] = 0.0f;
}

// Per row and 32-wide block: amax, inv = 127 / amax (0 if amax is 0), xq = rne(x * inv), xs = amax / 127,
// xc = -offset * sum(xq). The same fp32 operations as quant.py: quantize_activations (bitwise equal codes;
// |x * inv| <= 127 * (1 + 2^-23), so the conversion (round to nearest even) never leaves [-127, 127]).
static void quantize_x(const float* x, int64_t M, int64_t K, int64_t Kp, int bits, int8_t* xq, float* xs,
                       int32_t* xc) {
  const int32_t off = bits == 8 ? W8_OFFSET : 8;
  const int64_t nb = Kp / ACT;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < nb; ++kb) {
      alignas(64) float v[ACT];
      const int64_t k0 = kb * ACT;
      load_block(x + m * K, K, k0, v);
      int8_t* q = xq + m * Kp + k0;
#if LANES == 16
      const __m512 a = _mm512_load_ps(v), b = _mm512_load_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
      _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 mx = _mm256_andnot_ps(sign, _mm256_load_ps(v));
      for (int j = 8; j < ACT; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_load_ps(v + j)));
      alignas(32) float t[8];
      _mm256_store_ps(t, mx);
      float amax = 0.0f;
      for (int j = 0; j < 8; ++j) amax = t[j] > amax ? t[j] : amax;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m256i qi[4];
      for (int j = 0; j < 4; ++j)
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + 8 * j), _mm256_set1_ps(inv)));
      const __m256i s16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(s16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      alignas(32) int32_t u[8];
      _mm256_store_si256((__m256i*)u, _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
      int32_t sum = 0;
      for (int j = 0; j < 8; ++j) sum += u[j];
#endif
      xs[m * nb + kb] = amax / 127.0f;
      xc[m * nb + kb] = -off * sum;
    }
}

// int16 activations: per row and 32-wide block, amax, inv = 32767 / amax (0 if amax is 0), q = rne(x * inv),
// xs = amax / 32767, xc = -offset * sum(q) (offset 128 for int8 codes, 8 for int4, on both ISAs); q stored per 4 k
// as (k0, k2, k1, k3), the pairs the kernel's 16-bit dots take. The same fp32 operations as quant.py:
// quantize_activations(bits=16) (|x * inv| <= 32767 * (1 + 2^-23): the conversion never leaves [-32767, 32767]).
static void quantize_x16(const float* x, int64_t M, int64_t K, int64_t Kp, int bits, int16_t* xq, float* xs,
                         int32_t* xc) {
  const int32_t off = bits == 8 ? 128 : 8;
  const int64_t nb = Kp / ACT;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < nb; ++kb) {
      alignas(64) float v[ACT];
      const int64_t k0 = kb * ACT;
      load_block(x + m * K, K, k0, v);
      float amax = 0.0f;
      for (int j = 0; j < ACT; ++j) {
        const float av = v[j] < 0.0f ? -v[j] : v[j];
        amax = av > amax ? av : amax;
      }
      const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      int16_t* q = xq + m * Kp + k0;
      int32_t sum = 0;
      for (int j = 0; j < ACT; ++j) {
        const int32_t r = (int32_t)__builtin_nearbyintf(v[j] * inv);  // round half to even (default mode)
        const int32_t c = r > 32767 ? 32767 : r < -32767 ? -32767 : r;
        q[(j & ~3) + ((j & 1) << 1) + ((j >> 1) & 1)] = (int16_t)c;  // k0, k1, k2, k3 -> slots 0, 2, 1, 3
        sum += c;
      }
      xs[m * nb + kb] = amax / 32767.0f;
      xc[m * nb + kb] = -off * sum;
    }
}

extern "C" {
const char* omnilab_qgemv_isa() { return ISA_NAME; }

// Prefetch distances in bytes (0 = none, else a multiple of 64 up to 65536) for one int8-activation row, 2-16
// int8-activation rows, fp32 activations; a negative value keeps that one. Returns 0, or -1 (nothing changed).
int omnilab_qgemv_set_prefetch(int64_t one_row_i8, int64_t rows_i8, int64_t f32) {
  const int64_t v[3] = {one_row_i8, rows_i8, f32};
  for (int i = 0; i < 3; ++i)
    if (v[i] > 65536 || (v[i] >= 0 && v[i] % 64)) return -1;
  for (int i = 0; i < 3; ++i)
    if (v[i] >= 0) g_prefetch[i] = v[i];
  return 0;
}

// y[M, N] = x[M, K] @ W^T (+ b). bits 8 (group: all of K) or 4 (gs in 32, 64, 128 dividing K). s16: the scales
// are fp16 (0: fp32). act: 0 = fp32 activations, 1 = int8, 2 = int16. nt threads. Returns 0, or -1 for arguments
// outside that.
int omnilab_qgemv(const float* x, const uint8_t* w, const void* s, int s16, const float* b, float* y, int64_t M,
                  int64_t N, int64_t K, int bits, int64_t gs, int act, int nt) {
  if (M < 1 || N < 1 || K < 1 || (bits != 8 && bits != 4) || act < 0 || act > 2 || s16 < 0 || s16 > 1) return -1;
  if (bits == 4 && (gs < ACT || gs % ACT || K % gs)) return -1;
  const int64_t Kp = bits == 8 ? (K + ACT - 1) / ACT * ACT : K;
  if (bits == 8) gs = Kp;
  Args a{w, s, s16, b, y, M, N, Kp, gs, Kp / gs, Kp / ACT, nullptr, nullptr, nullptr, x};
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<int16_t> xq16;
  static thread_local std::vector<float> xs, xf;
  static thread_local std::vector<int32_t> xc;
  if (nt < 1) nt = 1;
  if (act == 2) {
    xq16.resize(M * Kp);
    xs.resize(M * a.nb);
    xc.resize(M * a.nb);
    quantize_x16(x, M, K, Kp, bits, xq16.data(), xs.data(), xc.data());
    a.xq = (const int8_t*)xq16.data(), a.xs = xs.data(), a.xc = xc.data();
    if (bits == 8) run<8, 2>(a, nt); else run<4, 2>(a, nt);
  } else if (act == 1) {
    xq.resize(M * Kp);
    xs.resize(M * a.nb);
    xc.resize(M * a.nb);
    quantize_x(x, M, K, Kp, bits, xq.data(), xs.data(), xc.data());
    a.xq = xq.data(), a.xs = xs.data(), a.xc = xc.data();
    if (bits == 8) run<8, 1>(a, nt); else run<4, 1>(a, nt);
  } else {
    if (Kp != K) {
      xf.assign(M * Kp, 0.0f);
      for (int64_t m = 0; m < M; ++m) memcpy(xf.data() + m * Kp, x + m * K, K * sizeof(float));
      a.xf = xf.data();
    }
    if (bits == 8) run<8, 0>(a, nt); else run<4, 0>(a, nt);
  }
  return 0;
}
}
