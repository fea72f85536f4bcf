// omnilab decode stack: one token per row through every layer of a Qwen3 decoder (and its final RMSNorm) in one
// call, and the SwiGLU activation the MLP uses on both paths (omnilab/kernels/stack.py).
//
// Why: a layer's one-token step is ~8 kernel calls (gemv.cpp / qgemv.cpp, norm.cpp, attn.cpp) and two residual
// adds; made from Python each costs a ctypes call, a tensor allocation and the glue around it. Here the same
// kernels are called through the function pointers the caller passes (the libraries it already loaded), with
// the same arguments and the same order, into buffers this file owns, so the result is bitwise the per-layer
// path: the residual adds are single fp32 additions (what torch's `x + o` does) and the activation is this
// file's own `swiglu`, which the per-layer path calls too.
//
// SwiGLU: act[i] = (g / (1 + exp(-g))) * u per element, g and u the two halves of the fused gate/up output
// (torch's silu formula, then the product; exp is glibc's vector expf, within 1 ulp; built with
// -ffp-contract=off so no product is fused into a sum). Elementwise: independent of batch mates and threads.
//
// bf16 compute (dtype 1): the rows, norms, tables and caches are bf16 and every op is rounded where torch's bf16 op
// rounds (the matrices' fp32 kernels on the exactly widened rows, rounded once; the adds; SwiGLU's silu and product).
// The paged entry (vLLM's "vec" cache) takes both dtypes.
//
// Built by build.py as -mavx512f -mfma and -mavx2 -mfma, linked with -lmvec (glibc's vector math).
#include <stdint.h>
#include <string.h>

#include <vector>

#include "simd.h"  // vec_t, VEC lanes, vexp (glibc's vector expf), ISA_NAME

// The entry points of the other kernel libraries (their own files say what each computes).
typedef int (*gemv_fn)(const float* x, const uint16_t* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                       int nt);
typedef int (*qgemv_fn)(const float* x, const uint8_t* w, const void* s, int s16, const float* b, float* y,
                        int64_t M, int64_t N, int64_t K, int bits, int64_t gs, int act, int nt);
typedef int (*norm_fn)(const void* x, const void* w, void* y, int64_t rows, int64_t D, int64_t w_rows, float eps,
                       int dtype, int nt);
typedef int (*attn_fn)(const void* qkv, const void* nw, const void* cos, const void* sins, int64_t rope_stride,
                       const int64_t* kptr, const int64_t* vptr, const int64_t* cap, const int64_t* pos, void* out,
                       int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float eps, float scale, int dtype, int nt);
typedef int (*pattn_fn)(const void* qkv, const void* nw, const void* cos, const void* sins, int64_t rope_stride,
                        void* cache, const int32_t* bt, int64_t bt_stride, const int64_t* pos, int64_t bs, int64_t Dp,
                        int64_t nblocks, void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float eps,
                        float scale, int dtype, int nt);

extern "C" {
// Layouts shared with stack.py (ctypes Structures of the same fields, in the same order).
struct Kernels {
  gemv_fn gemv;    // omnilab_gemv_bf16w (bf16 weights, fp32 rows)
  qgemv_fn qgemv;  // omnilab_qgemv
  norm_fn norm;    // omnilab_rmsnorm
  attn_fn attn;    // omnilab_decode_attn
  pattn_fn pattn;  // omnilab_paged_attn (the paged entry only)
};
struct Mat {         // one bias-free decode matrix [n, k]
  int64_t kind;      // 0: bf16 weights (gemv), 1: quantized (qgemv)
  const void* w;     // weights / packed codes
  const void* s;     // quantized: scales (fp32, or fp16 where s16)
  int64_t n, k, bits, gs, act, s16;  // act: 0 fp32, 1 int8, 2 int16 activations
};
struct Layer {
  Mat qkv, o, gu, down;            // fused q/k/v [(Hq + 2 Hkv) D, H], o [H, Hq D], fused gate/up [2 I, H], down [H, I]
  const void* ln1;                 // input_layernorm [H] (the stack's dtype, as the next two)
  const void* ln2;                 // post_attention_layernorm [H]
  const void* qk;                  // q_norm / k_norm weights per head [Hq + Hkv, D]
  float ln1_eps, ln2_eps, qk_eps, scale;
  int64_t hq, hkv, d, inter;
};
}

static inline void swiglu_rows(const float* gu, float* act, int64_t rows, int64_t inter) {
  const vec_t one = vset(1.0f), zero = vset(0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* y = act + r * inter;
    int64_t i = 0;
    for (; i + VEC <= inter; i += VEC) {
      const vec_t gv = vload(g + i);
      vstore(y + i, vmul(vdiv(gv, vadd(one, vexp(vsub(zero, gv)))), vload(u + i)));
    }
    if (i < inter) {  // the tail through a zero-padded vector: the same lane arithmetic
      alignas(64) float tg[VEC] = {0}, tu[VEC] = {0}, ty[VEC];
      memcpy(tg, g + i, (inter - i) * sizeof(float));
      memcpy(tu, u + i, (inter - i) * sizeof(float));
      const vec_t gv = vload(tg);
      vstore(ty, vmul(vdiv(gv, vadd(one, vexp(vsub(zero, gv)))), vload(tu)));
      memcpy(y + i, ty, (inter - i) * sizeof(float));
    }
  }
}

// bf16 SwiGLU as torch's bf16 ops round it: silu(g) in fp32 (the fp32 formula above) rounded to bf16, then the
// product of two bf16 values in fp32, rounded: act = rnd(rnd(silu(g)) * u).
static inline void swiglu_rows(const uint16_t* gu, uint16_t* act, int64_t rows, int64_t inter) {
  const vec_t one = vset(1.0f), zero = vset(0.0f);
  static thread_local std::vector<float> g, y;  // per layer and step: kept, not reallocated
  g.resize(inter), y.resize(inter);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gr = gu + r * 2 * inter;
    const uint16_t* u = gr + inter;
    for (int64_t i = 0; i < inter; ++i) g[i] = bf16_to_f32(gr[i]);
    int64_t i = 0;
    for (; i + VEC <= inter; i += VEC) {
      const vec_t gv = vload(g.data() + i);
      vstore(y.data() + i, vdiv(gv, vadd(one, vexp(vsub(zero, gv)))));
    }
    if (i < inter) {  // the tail through a zero-padded vector: the same lane arithmetic
      alignas(64) float tg[VEC] = {0}, ty[VEC];
      memcpy(tg, g.data() + i, (inter - i) * sizeof(float));
      const vec_t gv = vload(tg);
      vstore(ty, vdiv(gv, vadd(one, vexp(vsub(zero, gv)))));
      memcpy(y.data() + i, ty, (inter - i) * sizeof(float));
    }
    uint16_t* out = act + r * inter;
    for (int64_t k = 0; k < inter; ++k) out[k] = f32_to_bf16(bf16_to_f32(f32_to_bf16(y[k])) * bf16_to_f32(u[k]));
  }
}

static inline int matmul(const Kernels& f, const Mat& m, const float* x, float* y, int64_t B, int nt) {
  if (m.kind == 0) return f.gemv(x, (const uint16_t*)m.w, nullptr, y, B, m.n, m.k, nt);
  return f.qgemv(x, (const uint8_t*)m.w, m.s, (int)m.s16, nullptr, y, B, m.n, m.k, (int)m.bits, m.gs, (int)m.act,
                 nt);
}

// bf16 rows: widened exactly, the fp32 kernel, the result rounded once (what kernels.linear does for bf16 compute)
static inline int matmul(const Kernels& f, const Mat& m, const uint16_t* x, uint16_t* y, int64_t B, int nt) {
  static thread_local std::vector<float> xf, yf;
  xf.resize(B * m.k), yf.resize(B * m.n);
  for (int64_t i = 0; i < B * m.k; ++i) xf[i] = bf16_to_f32(x[i]);
  const int rc = matmul(f, m, xf.data(), yf.data(), B, nt);
  for (int64_t i = 0; i < B * m.n; ++i) y[i] = f32_to_bf16(yf[i]);
  return rc;
}

static inline void add_into(float* x, const float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + o[i];
}
static inline void add_into(uint16_t* x, const uint16_t* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(o[i]));
}
template <typename T> static inline int dtype_code() { return sizeof(T) == 2 ? 1 : 0; }

// The stack's body; attn(l, qkv, qk weights, out) is the layer's one-token attention (its cache writes included).
template <typename T, class Attn>
static int stack_body(const Kernels* f, const Layer* L, int64_t nl, const T* x, int64_t B, int64_t H,
                      const void* norm_w, float norm_eps, T* out, int nt, Attn attn) {
  if (nl < 0 || B < 1 || H < 1) return -1;
  int64_t nmax = H;
  for (int64_t l = 0; l < nl; ++l) {
    const Layer& y = L[l];
    nmax = y.qkv.n > nmax ? y.qkv.n : nmax;
    nmax = y.gu.n > nmax ? y.gu.n : nmax;
    nmax = y.hq * y.d > nmax ? y.hq * y.d : nmax;
  }
  static thread_local std::vector<T> xs, h, a, b, c;
  const int code = dtype_code<T>();
  xs.assign(x, x + B * H);
  h.resize(B * H), a.resize(B * nmax), b.resize(B * nmax), c.resize(B * nmax);
  int call = 0;
#define CHECK(expr) do { ++call; if ((expr) != 0) return call; } while (0)
  for (int64_t l = 0; l < nl; ++l) {
    const Layer& y = L[l];
    // input norm -> fused q/k/v -> one-token attention (writes the caches) -> o_proj, residual
    CHECK(f->norm(xs.data(), y.ln1, h.data(), B, H, 1, y.ln1_eps, code, nt));
    CHECK(matmul(*f, y.qkv, h.data(), a.data(), B, nt));
    CHECK(attn(l, y, a.data(), b.data()));
    CHECK(matmul(*f, y.o, b.data(), c.data(), B, nt));
    add_into(xs.data(), c.data(), B * H);
    // post-attention norm -> fused gate/up -> silu(gate) * up -> down_proj, residual
    CHECK(f->norm(xs.data(), y.ln2, h.data(), B, H, 1, y.ln2_eps, code, nt));
    CHECK(matmul(*f, y.gu, h.data(), a.data(), B, nt));
    swiglu_rows(a.data(), b.data(), B, y.inter);
    CHECK(matmul(*f, y.down, b.data(), c.data(), B, nt));
    add_into(xs.data(), c.data(), B * H);
  }
  CHECK(f->norm(xs.data(), norm_w, out, B, H, 1, norm_eps, code, nt));
#undef CHECK
  return 0;
}

extern "C" {
const char* omnilab_stack_isa() { return ISA_NAME; }

// gu [rows, 2 * inter] (gate then up) -> act [rows, inter]. Returns 0, or -1 for bad sizes.
int omnilab_swiglu(const float* gu, float* act, int64_t rows, int64_t inter) {
  if (rows < 0 || inter < 1) return -1;
  swiglu_rows(gu, act, rows, inter);
  return 0;
}

// The same for bf16 (uint16 bit patterns) in and out: rnd(rnd(silu(g)) * u), silu in fp32 as above.
int omnilab_swiglu_bf16(const uint16_t* gu, uint16_t* act, int64_t rows, int64_t inter) {
  if (rows < 0 || inter < 1) return -1;
  swiglu_rows(gu, act, rows, inter);
  return 0;
}

// x [B, H] (not modified) through layers L[0..nl-1] at one token per row, then the final RMSNorm (norm_w [H],
// norm_eps) into out [B, H]; dtype 0: fp32 rows, norms, tables and caches; 1: all of them bf16 (every op rounded
// as torch's bf16 op: the matrices' fp32 kernels on the widened rows, rounded once; residual adds rounded; the bf16
// SwiGLU above). Row b's k/v of layer l are written at pos[b] of kptr[l * B + b] / vptr[l * B + b] (capacity
// cap[b]); cos / sins [*, D] with rope_stride 0 (all rows at one position) or D (one row each).
// Returns 0, or the 1-based index of the call that failed (a kernel that rejected its arguments).
int omnilab_stack_step(const Kernels* f, const Layer* L, int64_t nl, const void* x, int64_t B, int64_t H,
                       const void* cos, const void* sins, int64_t rope_stride, const int64_t* kptr,
                       const int64_t* vptr, const int64_t* cap, const int64_t* pos, const void* norm_w,
                       float norm_eps, void* out, int dtype, int nt) {
  auto attn = [&](int64_t l, const Layer& y, const void* qkv, void* o) {
    return f->attn(qkv, y.qk, cos, sins, rope_stride, kptr + l * B, vptr + l * B, cap, pos, o, B, y.hq, y.hkv, y.d,
                   y.qk_eps, y.scale, dtype, nt);
  };
  if (dtype == 0) return stack_body(f, L, nl, (const float*)x, B, H, norm_w, norm_eps, (float*)out, nt, attn);
  if (dtype == 1) return stack_body(f, L, nl, (const uint16_t*)x, B, H, norm_w, norm_eps, (uint16_t*)out, nt, attn);
  return -1;
}

// The same over vLLM's paged caches (attn.cpp's omnilab_paged_attn), dtype 0 (fp32) or 1 (bf16, rounded as above):
// layer l's cache tensor at caches[l] (nblocks blocks of bs tokens, head size Dp), row b's blocks in
// bt[b * bt_stride ...], its new token at pos[b].
int omnilab_stack_step_paged(const Kernels* f, const Layer* L, int64_t nl, const void* x, int64_t B, int64_t H,
                             const void* cos, const void* sins, int64_t rope_stride, const int64_t* caches,
                             const int32_t* bt, int64_t bt_stride, const int64_t* pos, int64_t bs, int64_t Dp,
                             int64_t nblocks, const void* norm_w, float norm_eps, void* out, int dtype, int nt) {
  if (f->pattn == nullptr) return -1;
  auto attn = [&](int64_t l, const Layer& y, const void* qkv, void* o) {
    return f->pattn(qkv, y.qk, cos, sins, rope_stride, (void*)caches[l], bt, bt_stride, pos, bs, Dp, nblocks, o, B,
                    y.hq, y.hkv, y.d, y.qk_eps, y.scale, dtype, nt);
  };
  if (dtype == 0) return stack_body(f, L, nl, (const float*)x, B, H, norm_w, norm_eps, (float*)out, nt, attn);
  if (dtype == 1) return stack_body(f, L, nl, (const uint16_t*)x, B, H, norm_w, norm_eps, (uint16_t*)out, nt, attn);
  return -1;
}
}
