// omnilab RMSNorm for the decoder stacks: y = w * (x * rsqrt(mean(x^2) + eps)) per row, fp32 statistics.
//
// Why: at decode each norm is a [1, H] or [heads, D] input, and torch spends ~8 ops (cast, pow, mean, add,
// rsqrt, mul, cast, mul) on it; a frame runs ~325 of them (0.6B talker + 15 predictor passes). One call here.
//
// Numerics: the sum of squares runs over VEC lanes in ascending order, a fixed lane reduction, then the
// scalar tail; the scale is 1 / sqrtf(sum / D + eps), and each element is (x * scale) rounded to the
// output dtype, then multiplied by the weight (and rounded again for bf16), as the reference does. A row's
// result depends only on that row (not on the other rows, the thread count or the chunking); against torch's
// ops it differs by the summation order of the mean (fp32 rounding).
//
// x, y: [rows, D] (fp32, or bf16 as uint16 bit patterns: x, w and y all bf16 then); w: [w_rows, D], row r using
// weight row r % w_rows (w_rows = 1: one weight; the q/k norms of stacked heads: one per head). y may alias x.
// Built by omnilab/kernels/build.py with -mavx512f (VEC = 16) or -mavx2 -mfma (VEC = 8); vector helpers: simd.h.
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

// Sum of squares of one fp32 row: lanes, fixed reduction, scalar tail (explicit fmaf: no contraction choice).
static inline float sumsq(const float* x, int64_t D) {
  vec_t acc = vzero();
  const int64_t dv = D - D % VEC;
  for (int64_t k = 0; k < dv; k += VEC) {
    const vec_t v = vload(x + k);
    acc = vfma(v, v, acc);
  }
  float s = vsum(acc);
  for (int64_t k = dv; k < D; ++k) s = fmaf(x[k], x[k], s);
  return s;
}

static void row_f32(const float* x, const float* w, float* y, int64_t D, float eps) {
  const float scale = 1.0f / sqrtf(sumsq(x, D) / (float)D + eps);
  for (int64_t k = 0; k < D; ++k) {
    const float h = x[k] * scale;  // rounded to fp32 (the reference's h.to(fp32)), then the weight
    y[k] = w[k] * h;
  }
}

static void row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t D, float eps, float* tmp) {
  for (int64_t k = 0; k < D; ++k) tmp[k] = bf16_to_f32(x[k]);
  const float scale = 1.0f / sqrtf(sumsq(tmp, D) / (float)D + eps);
  for (int64_t k = 0; k < D; ++k) {
    const float h = bf16_to_f32(f32_to_bf16(tmp[k] * scale));  // h.to(bf16)
    y[k] = f32_to_bf16(bf16_to_f32(w[k]) * h);                  // weight * h in bf16 (computed in fp32, rounded)
  }
}

extern "C" {
const char* omnilab_norm_isa() { return ISA_NAME; }

// dtype 0: fp32, 1: bf16. Rows go to threads in contiguous ranges only when there are many (a prefill).
// Returns 0, or -1 for bad sizes / dtype.
int omnilab_rmsnorm(const void* x, const void* w, void* y, int64_t rows, int64_t D, int64_t w_rows, float eps,
                    int dtype, int nt) {
  if (rows < 0 || D < 1 || w_rows < 1 || rows % w_rows || (dtype != 0 && dtype != 1)) return -1;
  if (nt < 1 || rows * D < 65536) nt = 1;
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t lo = rows * t / T, hi = rows * (t + 1) / T;
    if (dtype == 0) {
      for (int64_t r = lo; r < hi; ++r)
        row_f32((const float*)x + r * D, (const float*)w + (r % w_rows) * D, (float*)y + r * D, D, eps);
    } else {
      float tmp[4096];
      for (int64_t r = lo; r < hi; ++r) {
        if (D > 4096) continue;  // checked by the caller (bf16 rows up to 4096)
        row_bf16((const uint16_t*)x + r * D, (const uint16_t*)w + (r % w_rows) * D, (uint16_t*)y + r * D,
                 D, eps, tmp);
      }
    }
  }
  return 0;
}
}
