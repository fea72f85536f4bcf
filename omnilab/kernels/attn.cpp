// omnilab decode attention for the decoder stacks: one new token per row, in one call per layer.
//
// For each row b (one decoding request or predictor row) and its fused projection output qkv[b] =
// [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]:
//   1. q and k heads: RMSNorm over D with the stacked per-head weights nw [Hq + Hkv, D] (fp32 statistics, as
//      norm.cpp), then rotate-half RoPE at the row's position: y[i] * cos[i] + y[(i + D/2) % D] * sins[i]
//      (sins = sin with its first half negated, the decoder's table), each op rounded to the dtype as torch's;
//   2. k and v written into the row's cache at position pos[b] (cache [Hkv, cap, D] per row);
//   3. out[b, h] = softmax(q_h . K^T * scale) V over positions 0..pos[b] of kv head h / (Hq / Hkv): scores and
//      sums in fp32 (exp: glibc's vector expf), normalised at the end, rounded once to the dtype.
// torch needs ~25 ops for this at one token (cat, norm, roll, muls, adds, transposes, two cache copies, SDPA).
//
// Numerics: every (row, head) is computed whole by one thread in a fixed order (dot products over D in lanes,
// a fixed lane reduction, positions ascending), so results do not depend on batch mates, on the thread count
// or on the cache's capacity; against torch's SDPA they differ by fp32 rounding (another summation order).
// dtype 0: fp32 everything; 1: bf16 qkv / nw / cos / sins / caches / out (uint16 bit patterns).
// Built by omnilab/kernels/build.py with -mavx512f (VEC = 16) or -mavx2 -mfma (VEC = 8), linked with -lmvec.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "simd.h"  // vexp: glibc's vector expf

static inline float ld(const float* p, int64_t i) { return p[i]; }
static inline float ld(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
// The value a torch op of this dtype stores: fp32 as is, bf16 rounded.
static inline float rnd(float v, float*) { return v; }
static inline float rnd(float v, uint16_t*) { return bf16_to_f32(f32_to_bf16(v)); }
static inline void st(float* p, int64_t i, float v) { p[i] = v; }
static inline void st(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

static inline float dot(const float* a, const float* b, int64_t D) {
  vec_t acc = vzero();
  const int64_t dv = D - D % VEC;
  for (int64_t k = 0; k < dv; k += VEC) acc = vfma(vload(a + k), vload(b + k), acc);
  float s = vsum(acc);
  for (int64_t k = dv; k < D; ++k) s = fmaf(a[k], b[k], s);
  return s;
}

// A cache row as fp32: fp32 rows in place, bf16 rows widened exactly into buf.
static inline const float* kb_f32(const float* row, float*, int64_t) { return row; }
static inline const float* kb_f32(const uint16_t* row, float* buf, int64_t D) {
  const int64_t dv = D - D % VEC;
  for (int64_t k = 0; k < dv; k += VEC) vstore(buf + k, vload(row + k));  // widened in lanes (simd.h)
  for (int64_t k = dv; k < D; ++k) buf[k] = ld(row, k);
  return buf;
}

// One head of D <= 512 values: RMSNorm (weight row w) then RoPE; the result (values of dtype T, as fp32) in out.
template <typename T>
static void norm_rope(const T* x, const T* w, const T* cos, const T* sins, int64_t D, float eps, float* out) {
  float buf[512], y[512];
  for (int64_t k = 0; k < D; ++k) buf[k] = ld(x, k);
  const float scale = 1.0f / sqrtf(dot(buf, buf, D) / (float)D + eps);
  for (int64_t k = 0; k < D; ++k) {
    const float h = rnd(buf[k] * scale, (T*)nullptr);  // h.to(dtype)
    y[k] = rnd(ld(w, k) * h, (T*)nullptr);              // weight * h
  }
  const int64_t half = D / 2;
  // qk * cos + roll(qk, D/2) * sin_signed, each op rounded as torch's; roll's partner of k is k + D/2 in the first
  // half and k - D/2 in the second (two loops: no modulo, vectorizable)
  for (int64_t k = 0; k < half; ++k) {
    const float a = rnd(y[k] * ld(cos, k), (T*)nullptr);
    const float b = rnd(y[k + half] * ld(sins, k), (T*)nullptr);
    out[k] = rnd(a + b, (T*)nullptr);
  }
  for (int64_t k = half; k < D; ++k) {
    const float a = rnd(y[k] * ld(cos, k), (T*)nullptr);
    const float b = rnd(y[k - half] * ld(sins, k), (T*)nullptr);
    out[k] = rnd(a + b, (T*)nullptr);
  }
}

// scores[0..L) (max m) -> exp(s - m) in lanes (the tail padded with -inf -> 0), their sum in ascending order, and
// acc = sum_j p_j v_j over positions ascending with D in lanes (each lane's chain fixed: no dependence on threads or
// batch; D % VEC lanes in a scalar tail); value(j) gives row j's values as fp32. Returns 1 / sum (scores needs
// room for L rounded up to VEC).
template <class Value>
static inline float softmax_values(float* scores, int64_t L, float m, int64_t D, float* acc, Value value) {
  const int64_t Lp = (L + VEC - 1) / VEC * VEC;
  for (int64_t j = L; j < Lp; ++j) scores[j] = -INFINITY;
  const vec_t mv = vset(m);
  for (int64_t j = 0; j < Lp; j += VEC) vstore(scores + j, vexp(vsub(vload(scores + j), mv)));
  float denom = 0.0f;
  for (int64_t j = 0; j < L; ++j) denom += scores[j];
  const int64_t dv = D - D % VEC;
  for (int64_t k = 0; k < D; ++k) acc[k] = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = value(j);
    const vec_t p = vset(scores[j]);
    for (int64_t k = 0; k < dv; k += VEC) vstore(acc + k, vfma(p, vload(vj + k), vload(acc + k)));
    for (int64_t k = dv; k < D; ++k) acc[k] = fmaf(scores[j], vj[k], acc[k]);
  }
  return 1.0f / denom;
}

template <typename T>
static void run(const T* qkv, const T* nw, const T* cos, const T* sins, int64_t rope_stride, T* const* kc,
                T* const* vc, const int64_t* cap, const int64_t* pos, T* out, int64_t B, int64_t Hq, int64_t Hkv,
                int64_t D, float eps, float scale, int nt) {
  const int64_t ntot = (Hq + 2 * Hkv) * D;
  // 1-2: k heads normalised, rotated and written with v into the cache (one (row, kv head) per iteration).
  for (int64_t i = 0; i < B * Hkv; ++i) {
    const int64_t b = i / Hkv, h = i % Hkv;
    const T* row = qkv + b * ntot;
    float kr[512];
    norm_rope<T>(row + (Hq + h) * D, nw + (Hq + h) * D, cos + b * rope_stride, sins + b * rope_stride, D, eps, kr);
    T* kdst = kc[b] + (h * cap[b] + pos[b]) * D;
    T* vdst = vc[b] + (h * cap[b] + pos[b]) * D;
    const T* vsrc = row + (Hq + Hkv + h) * D;
    for (int64_t k = 0; k < D; ++k) st(kdst, k, kr[k]);
    memcpy(vdst, vsrc, D * sizeof(T));
  }
  // 3: every (row, q head) whole on one thread.
  const int64_t work = B * Hq;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = pos[b] + 1 > longest ? pos[b] + 1 : longest;
  if (nt < 1 || work * longest * D < (1 << 17)) nt = 1;
  const int64_t group = Hq / Hkv;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> scores, kf, acc(D);
    float q[512];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < work; ++i) {
      const int64_t b = i / Hq, h = i % Hq, g = h / group, L = pos[b] + 1;
      const T* row = qkv + b * ntot;
      norm_rope<T>(row + h * D, nw + h * D, cos + b * rope_stride, sins + b * rope_stride, D, eps, q);
      const T* kb = kc[b] + g * cap[b] * D;
      const T* vb = vc[b] + g * cap[b] * D;
      scores.resize(L + VEC);
      kf.resize(D);
      float m = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        const float* kj = kb_f32(kb + j * D, kf.data(), D);  // fp32 rows are read in place, bf16 rows widened
        const float s = dot(q, kj, D) * scale;
        scores[j] = s;
        m = s > m ? s : m;
      }
      const float inv = softmax_values(scores.data(), L, m, D, acc.data(),
                                       [&](int64_t j) { return kb_f32(vb + j * D, kf.data(), D); });
      T* o = out + b * Hq * D + h * D;
      for (int64_t k = 0; k < D; ++k) st(o, k, acc[k] * inv);
    }
  }
}

// The same step over vLLM's paged KV cache as its CPU attention backend lays it out for the "vec" ISA: one
// tensor per layer [blocks, Hkv, bs, 2 Dp] of the dtype (Dp >= D: the head size vLLM was given, zero-padded); for
// block n and kv head h the region at (n Hkv + h) 2 bs Dp holds the keys transposed, [Dp][bs] (element d of token j
// at d bs + j), then the values, [bs][Dp]. Row b's token j lives in block bt[b * bt_stride + j / bs] at j % bs. The
// new k and v go to position pos[b] (pads zeroed). Scores are computed with the tokens in lanes (the transposed
// keys, bf16 ones widened exactly): s_j = sum_d q_d k_dj as one FMA chain per token over d ascending, times scale;
// softmax and the weighted sum of values as run(), the output rounded once to the dtype. Each (row, head) whole on
// one thread, fixed order: independent of batch mates, threads, the block size and which blocks a row holds;
// against run() (dot over D in lanes) it differs by fp32 rounding only (before the dtype's one rounding).
template <typename T>
static void run_paged(const T* qkv, const T* nw, const T* cos, const T* sins, int64_t rope_stride, T* cache,
                      const int32_t* bt, int64_t bt_stride, const int64_t* pos, int64_t bs, int64_t Dp, T* out,
                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float eps, float scale, int nt) {
  const int64_t ntot = (Hq + 2 * Hkv) * D, region = 2 * bs * Dp;
  auto head = [&](int64_t b, int64_t h, int64_t j) { return cache + ((int64_t)bt[b * bt_stride + j / bs] * Hkv + h) * region; };
  for (int64_t i = 0; i < B * Hkv; ++i) {
    const int64_t b = i / Hkv, h = i % Hkv, off = pos[b] % bs;
    const T* row = qkv + b * ntot;
    float kr[512];
    norm_rope<T>(row + (Hq + h) * D, nw + (Hq + h) * D, cos + b * rope_stride, sins + b * rope_stride, D, eps, kr);
    T* r = head(b, h, pos[b]);
    for (int64_t d = 0; d < Dp; ++d) st(r, d * bs + off, d < D ? kr[d] : 0.0f);
    T* vr = r + bs * Dp + off * Dp;
    memcpy(vr, row + (Hq + Hkv + h) * D, D * sizeof(T));
    for (int64_t d = D; d < Dp; ++d) st(vr, d, 0.0f);
  }
  const int64_t work = B * Hq, group = Hq / Hkv;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = pos[b] + 1 > longest ? pos[b] + 1 : longest;
  if (nt < 1 || work * longest * D < (1 << 17)) nt = 1;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> scores, acc(D), vf(D);
    float q[512];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < work; ++i) {
      const int64_t b = i / Hq, h = i % Hq, g = h / group, L = pos[b] + 1, nblk = (L + bs - 1) / bs;
      norm_rope<T>(qkv + b * ntot + h * D, nw + h * D, cos + b * rope_stride, sins + b * rope_stride, D, eps, q);
      scores.resize(nblk * bs);
      const vec_t sc = vset(scale);
      for (int64_t n = 0; n < nblk; ++n) {
        const T* kt = head(b, g, n * bs);
        const int64_t have = L - n * bs < bs ? L - n * bs : bs;
        // up to 8 vectors of tokens at once (independent chains: FMA latency hidden; each lane's chain is the
        // same); bs is a multiple of VEC, so lanes past L read the block's rest (overwritten below)
        for (int64_t j0 = 0; j0 < have; j0 += 8 * VEC) {
          const int64_t left = (have - j0 + VEC - 1) / VEC, nc = left < 8 ? left : 8;
          vec_t a[8];
          for (int64_t c = 0; c < nc; ++c) a[c] = vzero();
          for (int64_t d = 0; d < D; ++d) {
            const vec_t qd = vset(q[d]);
            const T* kr = kt + d * bs + j0;
            for (int64_t c = 0; c < nc; ++c) a[c] = vfma(qd, vload(kr + c * VEC), a[c]);  // bf16: widened exactly
          }
          for (int64_t c = 0; c < nc; ++c) vstore(scores.data() + n * bs + j0 + c * VEC, vmul(a[c], sc));
        }
      }
      float m = -INFINITY;
      for (int64_t j = 0; j < L; ++j) m = scores[j] > m ? scores[j] : m;
      const float inv = softmax_values(scores.data(), L, m, D, acc.data(), [&](int64_t j) {
        return kb_f32(head(b, g, j) + bs * Dp + (j % bs) * Dp, vf.data(), D);  // fp32 in place, bf16 widened
      });
      T* o = out + b * Hq * D + h * D;
      for (int64_t k = 0; k < D; ++k) st(o, k, acc[k] * inv);
    }
  }
}

extern "C" {
const char* omnilab_attn_isa() { return ISA_NAME; }

// The paged form (run_paged above); dtype 0: fp32 qkv / nw / tables / cache / out, 1: all bf16 (uint16 bit patterns).
// nblocks: the cache's block count (every block id a row needs is checked against it). Returns 0, or -1 for
// arguments outside what it takes.
int omnilab_paged_attn(const void* qkv, const void* nw, const void* cos, const void* sins, int64_t rope_stride,
                       void* cache, const int32_t* bt, int64_t bt_stride, const int64_t* pos, int64_t bs, int64_t Dp,
                       int64_t nblocks, void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float eps,
                       float scale, int dtype, int nt) {
  if (B < 1 || Hkv < 1 || Hq % Hkv || D < 2 || D > 512 || D % 2 || Dp < D || bs < VEC || bs % VEC) return -1;
  if (dtype != 0 && dtype != 1) return -1;
  for (int64_t b = 0; b < B; ++b) {
    if (pos[b] < 0) return -1;
    for (int64_t n = 0; n <= pos[b] / bs; ++n)
      if (bt[b * bt_stride + n] < 0 || bt[b * bt_stride + n] >= nblocks) return -1;
  }
  if (dtype == 0)
    run_paged<float>((const float*)qkv, (const float*)nw, (const float*)cos, (const float*)sins, rope_stride,
                     (float*)cache, bt, bt_stride, pos, bs, Dp, (float*)out, B, Hq, Hkv, D, eps, scale, nt);
  else
    run_paged<uint16_t>((const uint16_t*)qkv, (const uint16_t*)nw, (const uint16_t*)cos, (const uint16_t*)sins,
                        rope_stride, (uint16_t*)cache, bt, bt_stride, pos, bs, Dp, (uint16_t*)out, B, Hq, Hkv, D, eps,
                        scale, nt);
  return 0;
}

// Returns 0, or -1 for sizes the kernel does not take (D > 512 or odd, Hq not a multiple of Hkv, a position past
// its cache's capacity, dtype not 0/1).
int omnilab_decode_attn(const void* qkv, const void* nw, const void* cos, const void* sins, int64_t rope_stride,
                        const int64_t* kptr, const int64_t* vptr, const int64_t* cap, const int64_t* pos, void* out,
                        int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float eps, float scale, int dtype, int nt) {
  if (B < 1 || Hkv < 1 || Hq % Hkv || D < 2 || D > 512 || D % 2 || (dtype != 0 && dtype != 1)) return -1;
  for (int64_t b = 0; b < B; ++b)
    if (pos[b] < 0 || pos[b] >= cap[b]) return -1;
  if (dtype == 0)
    run<float>((const float*)qkv, (const float*)nw, (const float*)cos, (const float*)sins, rope_stride,
               (float* const*)kptr, (float* const*)vptr, cap, pos, (float*)out, B, Hq, Hkv, D, eps, scale, nt);
  else
    run<uint16_t>((const uint16_t*)qkv, (const uint16_t*)nw, (const uint16_t*)cos, (const uint16_t*)sins,
                  rope_stride, (uint16_t* const*)kptr, (uint16_t* const*)vptr, cap, pos, (uint16_t*)out, B, Hq, Hkv,
                  D, eps, scale, nt);
  return 0;
}
}
