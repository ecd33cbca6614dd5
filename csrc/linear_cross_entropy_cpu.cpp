// CPU kernels of linear cross-entropy: the elementwise work on one logit tile,
// fused so that each row is read and written once while it sits in L1/L2.
// The GEMMs stay in MKL or oneDNN (resident_trainer/ops/_gemm.py picks the
// faster on the CPU it runs on); these replace the five to
// eight separate torch passes (tanh, max, sub, exp, sum, mul ...) per tile,
// each a parallel region of its own over a tile larger than L2.
//
// All ops work in place on a contiguous fp32 (rows, cols) tile and take
// per-row fp32 vectors; rows are split across ATen's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// exp(x) for fp32 by range reduction to [-ln2/2, ln2/2] and a degree-6
// minimax polynomial (Cephes expf coefficients); inputs are clamped to
// [-87.3, 88.3], so exp(-inf) gives ~1e-38 rather than 0 (harmless here: it
// only ever multiplies an empty sum). Max relative error 2 ulp, measured in
// tests/test_linear_cross_entropy.py against torch.exp. Written to
// auto-vectorize; NaN propagates. Always inlined: a call inside a loop stops its
// vectorization, and GCC's heuristics left it out of line in the gradient rows
// (all three loops scalar: 1.69 ns an element against 0.13 for exp + sum on a
// 2-thread Sapphire Rapids-class Xeon).
__attribute__((always_inline)) static inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;  // NaN compares false and passes through
  x = x > 88.3f ? 88.3f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: add/subtract rounds to an integer
  const float k = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(k) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits, absolute error ~1e-7.
__attribute__((always_inline)) static inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

// The row loops below are compiled for AVX-512, for AVX2 + FMA (x86-64-v3)
// and for baseline x86-64, and picked at load time. Measured on a 2-core Zen 5
// EPYC (one 2048 x 1024 tile, exp + sum per row, one thread): baseline SSE2
// 6.9 ms, AVX2 4.2 ms, AVX-512 0.48 ms; torch.exp alone takes 1.4 ms. Without
// the AVX2 clone an AVX2-only CPU ran the SSE2 one: on a 2-core Zen 3 (loaded
// by other processes; best of 9) exp + sum took 23.6 ms against 6.0 ms for
// torch.exp + sum, and 11.5 ms with the AVX2 clone (torch.exp + sum: 18.8 ms
// in that run). That clone was still scalar: GCC kept exp's clamps as branches
// until built with -fno-trapping-math (setup.py); vectorized, 1.45 ms.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RT_ROW_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RT_ROW_KERNEL
#endif

// Softcap a row in place (and its slope, if wanted), then its max and sum.
// Always inlined, so each target clone of its callers gets its own copy.
__attribute__((always_inline)) static inline void softcap_max_sum(float* zr, float* sl, int64_t cols, float cap,
                                                                  float* mx_out, float* sum_out) {
  if (cap > 0) {
    const float inv_cap = 1.0f / cap;
    if (sl) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float t = fast_tanh(zr[c] * inv_cap);
        sl[c] = 1.0f - t * t;
        zr[c] = cap * t;
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) zr[c] = cap * fast_tanh(zr[c] * inv_cap);
    }
  }
  float mx = -std::numeric_limits<float>::infinity();
  float tot = 0.0f;
  // On values, not std::max's references: GCC kept the reference form as a
  // branch ("control flow in loop") and ran this loop scalar, 0.48 ns an
  // element (2-thread Xeon). A NaN compares false and is skipped, as before.
#pragma omp simd reduction(max : mx) reduction(+ : tot)
  for (int64_t c = 0; c < cols; ++c) {
    const float z = zr[c];
    mx = z > mx ? z : mx;
    tot += z;
  }
  *mx_out = mx;
  *sum_out = tot;
}

RT_ROW_KERNEL void online_rows(float* zp, float* slp, float* mp, float* sp, float* szp, float* ap, float* accp,
                               int64_t acc_cols, const int64_t* yp, float* zyp, int64_t v0, int64_t r0, int64_t r1,
                               int64_t cols, float cap, bool apply_slope) {
  for (int64_t r = r0; r < r1; ++r) {
    float* zr = zp + r * cols;
    float* sl = slp ? slp + r * cols : nullptr;
    float mx, tot;
    softcap_max_sum(zr, sl, cols, cap, &mx, &tot);
    if (szp) szp[r] += tot;
    if (yp) {  // the target's (capped) logit, if this tile holds it
      const int64_t yc = yp[r] - v0;
      if (yp[r] >= 0 && yc >= 0 && yc < cols) zyp[r] = zr[yc];
    }
    // A NaN anywhere in the row must reach the loss: max() skips it, the
    // exp below does not, and the sum carries it.
    const float m_new = std::max(mp[r], mx);
    const float a = fast_exp(mp[r] - m_new);
    if (accp && a != 1.0f) {  // rescale the row's accumulator only when its max moved
      float* acc = accp + r * acc_cols;
#pragma omp simd
      for (int64_t c = 0; c < acc_cols; ++c) acc[c] *= a;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
      const float p = fast_exp(zr[c] - m_new);
      zr[c] = p;
      sum += p;
    }
    if (apply_slope) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) zr[c] *= sl[c];
    }
    sp[r] = sp[r] * a + sum;
    mp[r] = m_new;
    ap[r] = a;
  }
}

RT_ROW_KERNEL void exp_sum_rows(const float* zp, const float* mp, float* out, int64_t r0, int64_t r1, int64_t cols) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* zr = zp + r * cols;
    const float mr = mp[r];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) sum += fast_exp(zr[c] - mr);
    out[r] = sum;
  }
}

RT_ROW_KERNEL void max_sum_rows(float* zp, float* slp, float* mo, float* so, int64_t r0, int64_t r1, int64_t cols,
                                float cap) {
  for (int64_t r = r0; r < r1; ++r) softcap_max_sum(zp + r * cols, slp ? slp + r * cols : nullptr, cols, cap, mo + r, so + r);
}

// One row of G in place, by kind (plain, slope given, softcap here).
__attribute__((always_inline)) static inline void grad_row_plain(float* __restrict zr, int64_t cols, float l,
                                                                 float k, float off) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) zr[c] = fast_exp(zr[c] - l) * k - off;
}

__attribute__((always_inline)) static inline void grad_row_slope(float* __restrict zr, const float* __restrict sl,
                                                                 int64_t cols, float l, float k, float off) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) zr[c] = (fast_exp(zr[c] - l) * k - off) * sl[c];
}

__attribute__((always_inline)) static inline void grad_row_cap(float* __restrict zr, int64_t cols, float l, float k,
                                                               float off, float cap, float inv_cap) {
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    const float t = fast_tanh(zr[c] * inv_cap);
    zr[c] = (fast_exp(cap * t - l) * k - off) * (1.0f - t * t);
  }
}

RT_ROW_KERNEL void grad_rows(float* zp, const float* lp, const float* cp, const float* wp, const int64_t* yp,
                             const float* slp, int64_t v0, float tw, float sm, float cap, bool cap_here, int64_t r0,
                             int64_t r1, int64_t cols) {
  const float inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    float* zr = zp + r * cols;
    const float l = lp[r], k = cp[r], off = wp[r] * sm;
    // The target column's softcap slope, read before the raw logit is
    // overwritten.
    const int64_t yc = yp[r] - v0;
    const bool has_y = yp[r] >= 0 && yc >= 0 && yc < cols;
    float slope_y = 1.0f;
    if (has_y && slp) {
      slope_y = slp[r * cols + yc];
    } else if (has_y && cap_here) {
      const float t = fast_tanh(zr[yc] * inv_cap);
      slope_y = 1.0f - t * t;
    }
    if (cap_here) {
      grad_row_cap(zr, cols, l, k, off, cap, inv_cap);
    } else if (slp) {
      grad_row_slope(zr, slp + r * cols, cols, l, k, off);
    } else {
      grad_row_plain(zr, cols, l, k, off);
    }
    if (has_y) zr[yc] -= wp[r] * tw * slope_y;
  }
}

void check_tile(const at::Tensor& z, const char* op) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.dim() == 2 && z.is_contiguous(),
              op, ": the tile must be a contiguous 2-D float32 CPU tensor, got ", z.scalar_type(), " ",
              z.sizes(), z.is_contiguous() ? "" : " (non-contiguous)");
}

void check_rows(const at::Tensor& t, int64_t rows, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == rows &&
                  t.is_contiguous(),
              op, ": ", name, " must be a contiguous float32 CPU vector of ", rows, " rows, got ",
              t.scalar_type(), " ", t.sizes());
}

// Online-softmax update of one tile, in place. Per row r:
//   softcap > 0: z = softcap * tanh(z / softcap), slope = 1 - tanh^2 (if given)
//   sz[r] += sum(z)                                   (if sz given)
//   zy[r] = z[y[r] - v0] if the tile holds the target (if y_local given)
//   m' = max(m[r], max(z)); alpha[r] = exp(m[r] - m'); z = exp(z - m')
//   acc[r, :] *= alpha[r] where alpha[r] != 1        (if acc given)
//   s[r] = s[r] * alpha[r] + sum(z); m[r] = m'
//   apply_slope: z *= slope  (the softcap chain rule, for the dh accumulator)
// Returns alpha, the factor by which the row's running accumulators rescale.
at::Tensor lce_online_update(at::Tensor z, at::Tensor m, at::Tensor s, std::optional<at::Tensor> slope,
                             std::optional<at::Tensor> sz, std::optional<at::Tensor> acc,
                             std::optional<at::Tensor> y_local, std::optional<at::Tensor> zy, int64_t v0,
                             double softcap, bool apply_slope) {
  const char* op = "lce_online_update";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1);
  check_rows(m, rows, op, "m");
  check_rows(s, rows, op, "s");
  if (sz) check_rows(*sz, rows, op, "sz");
  if (slope) TORCH_CHECK(slope->sizes() == z.sizes() && slope->is_contiguous(), op, ": slope must match the tile");
  TORCH_CHECK(!apply_slope || slope, op, ": apply_slope needs slope");
  if (acc)
    TORCH_CHECK(acc->scalar_type() == at::kFloat && acc->dim() == 2 && acc->size(0) == rows && acc->is_contiguous(),
                op, ": acc must be a contiguous float32 (rows, D) tensor");
  TORCH_CHECK(y_local.has_value() == zy.has_value(), op, ": y_local and zy go together");
  if (y_local) {
    TORCH_CHECK(y_local->scalar_type() == at::kLong && y_local->numel() == rows && y_local->is_contiguous(), op,
                ": y_local must be a contiguous int64 vector of ", rows, " rows");
    check_rows(*zy, rows, op, "zy");
  }
  at::Tensor alpha = at::empty({rows}, z.options());
  float* zp = z.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  float* ap = alpha.data_ptr<float>();
  float* slp = slope ? slope->data_ptr<float>() : nullptr;
  float* szp = sz ? sz->data_ptr<float>() : nullptr;
  float* accp = acc ? acc->data_ptr<float>() : nullptr;
  const int64_t acc_cols = acc ? acc->size(1) : 0;
  const int64_t* yp = y_local ? y_local->const_data_ptr<int64_t>() : nullptr;
  float* zyp = zy ? zy->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    online_rows(zp, slp, mp, sp, szp, ap, accp, acc_cols, yp, zyp, v0, r0, r1, cols, (float)softcap, apply_slope);
  });
  return alpha;
}

// Sum over each row of exp(z - m[r]) (read only).
at::Tensor lce_row_exp_sum(const at::Tensor& z, const at::Tensor& m) {
  const char* op = "lce_row_exp_sum";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1);
  check_rows(m, rows, op, "m");
  at::Tensor out = at::empty({rows}, z.options());
  const float* zp = z.const_data_ptr<float>();
  const float* mp = m.const_data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { exp_sum_rows(zp, mp, op_, r0, r1, cols); });
  return out;
}

// Softcap in place (z = cap * tanh(z / cap), slope = 1 - tanh^2 if given),
// then per-row max and sum of the capped logits.
std::tuple<at::Tensor, at::Tensor> lce_row_max_sum(at::Tensor z, std::optional<at::Tensor> slope, double softcap) {
  const char* op = "lce_row_max_sum";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1);
  if (slope) TORCH_CHECK(slope->sizes() == z.sizes() && slope->is_contiguous(), op, ": slope must match the tile");
  at::Tensor mx_out = at::empty({rows}, z.options());
  at::Tensor sum_out = at::empty({rows}, z.options());
  float* zp = z.data_ptr<float>();
  float* slp = slope ? slope->data_ptr<float>() : nullptr;
  float* mo = mx_out.data_ptr<float>();
  float* so = sum_out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    max_sum_rows(zp, slp, mo, so, r0, r1, cols, (float)softcap);
  });
  return {mx_out, sum_out};
}

// Gradient of the loss w.r.t. one tile of logits, in place over z:
//   zc = softcap ? softcap * tanh(z / softcap) : z     (skipped if slope given:
//                                                      z is then already capped)
//   G = exp(zc - lse[r]) * coef[r] - wtok[r] * (smooth + target_w [v0 + c == y[r]])
//   G *= softcap'(z)  (slope, given or computed)
void lce_grad_tile(at::Tensor z, const at::Tensor& lse, const at::Tensor& coef, const at::Tensor& wtok,
                   const at::Tensor& y_local, int64_t v0, double target_w, double smooth, double softcap,
                   std::optional<at::Tensor> slope) {
  const char* op = "lce_grad_tile";
  check_tile(z, op);
  const int64_t rows = z.size(0), cols = z.size(1);
  check_rows(lse, rows, op, "lse");
  check_rows(coef, rows, op, "coef");
  check_rows(wtok, rows, op, "wtok");
  TORCH_CHECK(y_local.scalar_type() == at::kLong && y_local.dim() == 1 && y_local.numel() == rows &&
                  y_local.is_contiguous(),
              op, ": y_local must be a contiguous int64 vector of ", rows, " rows");
  if (slope) TORCH_CHECK(slope->sizes() == z.sizes() && slope->is_contiguous(), op, ": slope must match the tile");
  float* zp = z.data_ptr<float>();
  const float* lp = lse.const_data_ptr<float>();
  const float* cp = coef.const_data_ptr<float>();
  const float* wp = wtok.const_data_ptr<float>();
  const int64_t* yp = y_local.const_data_ptr<int64_t>();
  const float* slp = slope ? slope->const_data_ptr<float>() : nullptr;
  const bool cap_here = softcap > 0 && !slope;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    grad_rows(zp, lp, cp, wp, yp, slp, v0, (float)target_w, (float)smooth, (float)softcap, cap_here, r0, r1, cols);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident_trainer, m) {
  m.def("lce_online_update(Tensor(a!) z, Tensor(b!) m, Tensor(c!) s, Tensor(d!)? slope, Tensor(e!)? sz, "
        "Tensor(f!)? acc, Tensor? y_local, Tensor(g!)? zy, int v0, float softcap, bool apply_slope) -> Tensor");
  m.def("lce_row_exp_sum(Tensor z, Tensor m) -> Tensor");
  m.def("lce_row_max_sum(Tensor(a!) z, Tensor(b!)? slope, float softcap) -> (Tensor, Tensor)");
  m.def("lce_grad_tile(Tensor(a!) z, Tensor lse, Tensor coef, Tensor wtok, Tensor y_local, int v0, "
        "float target_w, float smooth, float softcap, Tensor? slope) -> ()");
}

TORCH_LIBRARY_IMPL(resident_trainer, CPU, m) {
  m.impl("lce_online_update", &lce_online_update);
  m.impl("lce_row_exp_sum", &lce_row_exp_sum);
  m.impl("lce_row_max_sum", &lce_row_max_sum);
  m.impl("lce_grad_tile", &lce_grad_tile);
}
