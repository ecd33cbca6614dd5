// CPU added-expert block, fp32: out = (silu(x Wg^T) * (x Wu^T)) Wd^T, forward
// and backward, fused around oneDNN's batch-reduce GEMM micro-kernel
// (at::native::cpublas::brgemm, AVX-512 where the CPU has it).
//
// Why not torch.mm: on AMD CPUs MKL's sgemm runs its AVX2 code, half the
// AVX-512 rate (2-core Zen 5: 206 GFLOP/s for torch.mm against 480 for the
// micro-kernel). Against oneDNN's inner product (what the torch composition
// in resident_trainer/ops/added_expert.py calls), this kernel keeps the
// elementwise work on tiles in cache and needs no transposed copies of
// activations: the backward epilogue writes dh and p transposed for the
// weight gradients. That wins at D = 576 (up to 25%, forward + backward); from
// D = 1024 on the inner product blocks the long D loops better, so the op
// picks this kernel for D < 1024 only (packing every B operand into
// contiguous panels, 128-token blocks and 256-deep K steps measured no
// better there).
//
// Layout: x (N, D); w_gate and w_up (A, D), or w_gate packed (2A, D), gate
// rows first, and w_up absent; w_down (D, A). The weights are copied once per
// call into the (K x N) row-major layout the micro-kernel reads: W_gu^T for
// gate/up, Wd^T for the down product, W_gu packed for dx.
// Work is cut in blocks of kBM tokens: the forward computes gate/up, the
// SwiGLU and the down product of a block while its tiles are in cache; the
// backward computes dp, the elementwise backward and dx per block, then the
// weight gradients as two K = N products.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBM = 64;   // tokens per block: C tiles of 64 x 64 fp32 stay in L1/L2
constexpr int64_t kBN = 64;   // neurons per gate (and up) tile
constexpr int64_t kBC = 64;   // output columns per call of the D-wide products
// K per micro-kernel call: the A block and B panel of a call (64 x 512 and
// 512 x 64 fp32, 128 KiB each) stay in L2. With K = 4096 in one call a
// (2048 x 4096) @ (4096 x 512) product took 84 ms against 40 ms in 512-steps.
constexpr int64_t kBK = 512;

// C (m x n, ldc) = A (m x k, lda) @ B (k x n, ldb) [+ C], row-major fp32,
// in K steps of kBK accumulated in C (fp32).
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t k0 = 0; k0 < k; k0 += kBK) {
    at::native::cpublas::brgemm(m, n, std::min(kBK, k - k0), lda, ldb, ldc, accumulate || k0 > 0, a + k0,
                                b + k0 * ldb, c, /*is_vnni=*/false);
  }
}

// Gate and up of tokens x (m x d) for neurons [n0, n0 + n): w_t is the
// transposed packed weight (d x 2A); gu gets rows [gate (n) | up (n)].
// Two products, two accumulators.
inline void gate_up_tile(int64_t m, int64_t n, int64_t d, const float* x, int64_t ldx, const float* w_t,
                         int64_t a, int64_t n0, float* gu) {
  gemm(m, n, d, x, ldx, w_t + n0, 2 * a, gu, 2 * n, false);
  gemm(m, n, d, x, ldx, w_t + a + n0, 2 * a, gu + n, 2 * n, false);
}

// exp(x) for the sigmoid, written so GCC vectorizes the loops that call it
// (no libm call): Cody-Waite reduction by ln 2, degree-6 Taylor polynomial on
// |r| <= ln2/2 (relative error below 2e-7, ~2 ulp), 2^k through the exponent
// bits. Inputs are clamped to the finite range; NaN passes through. The
// clamps compare values: written with std::min/std::max (references) GCC kept
// them as branches ("control flow in loop") and every SwiGLU loop ran scalar.
// Always inlined: a call inside the loops would stop their vectorization too.
__attribute__((always_inline)) inline float exp_f32(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // Round to nearest with the 1.5 * 2^23 trick: pure arithmetic, vectorizes.
  const float kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - kf * 0.693145751953125f) - kf * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// Flush-to-zero and denormals-are-zero while an elementwise loop runs (x86;
// restored after). GCC if-converts exp_f32's clamps: it computes the clamped
// case for every lane and blends it in, and for the sigmoid that case is
// g * 1 / (1 + e^88), g times a denormal (~6e-39). Every such vector multiply
// took a microcode assist: the forward's loop ran 3.1 ns an element against
// 0.8 with denormals flushed (one thread, Sapphire Rapids-class Xeon).
// Results below 1.2e-38 become zero, far under the rounding of whatever they
// are added to.
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

__attribute__((always_inline)) inline void swiglu_row(int64_t n, const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ p) {
  for (int64_t j = 0; j < n; ++j) p[j] = g[j] / (1.0f + exp_f32(-g[j])) * u[j];
}

// One tile's SwiGLU: rows of gu are [gate (n) | up (n)], row stride ldgu;
// p = silu(gate) * up. Stores h = [gate | up] rows when h_gate != nullptr.
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void swiglu_tile(int64_t m, int64_t n, const float* gu, int64_t ldgu, const bool* keep, float* p,
                 int64_t ldp, float* h_gate, float* h_up, int64_t ldh) {
  const FlushDenormals ftz;
  for (int64_t i = 0; i < m; ++i) {
    const float* g = gu + i * ldgu;
    float* pr = p + i * ldp;
    if (keep != nullptr && !keep[i]) {
      std::memset(pr, 0, n * sizeof(float));
    } else {
      swiglu_row(n, g, g + n, pr);
    }
    if (h_gate != nullptr) {
      std::memcpy(h_gate + i * ldh, g, n * sizeof(float));
      std::memcpy(h_up + i * ldh, g + n, n * sizeof(float));
    }
  }
}

// One row of the elementwise backward: with s = sigmoid(g), a = g * s,
// p = a * u, du = dp * a, dg = dp * u * s * (1 + g * (1 - s)). The restrict
// qualifiers let GCC vectorize: without them it gives up on the alias checks
// of six arrays and the loop runs scalar, 10x slower.
__attribute__((always_inline)) inline void swiglu_backward_row(int64_t n, const float* __restrict__ g, const float* __restrict__ u,
                                const float* __restrict__ dp, float* __restrict__ dg, float* __restrict__ du,
                                float* __restrict__ p) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = 1.0f / (1.0f + exp_f32(-g[j]));
    const float act = g[j] * s;
    p[j] = act * u[j];
    du[j] = dp[j] * act;
    dg[j] = dp[j] * u[j] * (s * (1.0f + g[j] * (1.0f - s)));
  }
}

// One tile of the elementwise backward: dg, du row-major into dh (row stride
// lddh, up half at +a_total), p into p_tile (row stride ldp).
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void swiglu_backward_tile(int64_t m, int64_t n, const float* g0, const float* u0, int64_t ldgu,
                          const float* dp0, int64_t lddp, const bool* keep, float* dh, int64_t lddh,
                          int64_t a_total, float* p_tile, int64_t ldp) {
  const FlushDenormals ftz;
  for (int64_t i = 0; i < m; ++i) {
    float* dg = dh + i * lddh;
    float* pr = p_tile + i * ldp;
    if (keep != nullptr && !keep[i]) {
      std::memset(dg, 0, n * sizeof(float));
      std::memset(dg + a_total, 0, n * sizeof(float));
      std::memset(pr, 0, n * sizeof(float));
    } else {
      swiglu_backward_row(n, g0 + i * ldgu, u0 + i * ldgu, dp0 + i * lddp, dg, dg + a_total, pr);
    }
  }
}

// dst (n x m, row stride ldd) = src (m x n, row stride lds)^T. Callers pad
// lds off powers of two: with a 2 KiB stride the 64 reads of a column share
// two L1 sets, and the transpose ran 15x slower.
inline void transpose_tile(int64_t m, int64_t n, const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int64_t j = 0; j < n; ++j) {
    float* row = dst + j * ldd;
    for (int64_t i = 0; i < m; ++i) row[i] = src[i * lds + j];
  }
}

// Row-major with unit column stride, as the micro-kernel reads it; anything
// else (a transposed or expanded gradient) is copied once.
at::Tensor rows_unit_stride(const at::Tensor& t) {
  return t.stride(1) == 1 && t.stride(0) >= t.size(1) ? t : t.contiguous();
}

void check_inputs(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                  const at::Tensor& w_down, const std::optional<at::Tensor>& mask) {
  const bool cpu = x.device().is_cpu() && w_gate.device().is_cpu() && w_down.device().is_cpu() &&
                   (!w_up.has_value() || w_up->device().is_cpu());
  TORCH_CHECK(cpu, "added_expert (CPU kernel): all tensors must be on the CPU");
  const bool f32 = x.scalar_type() == at::kFloat && w_gate.scalar_type() == at::kFloat &&
                   w_down.scalar_type() == at::kFloat && (!w_up.has_value() || w_up->scalar_type() == at::kFloat);
  TORCH_CHECK(f32, "added_expert (CPU kernel): float32 only, got x ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && w_gate.dim() == 2 && w_down.dim() == 2, "added_expert (CPU kernel): 2-D tensors only");
  const int64_t d = x.size(1), a = w_down.size(1);
  TORCH_CHECK(d > 0 && a > 0, "added_expert (CPU kernel): D and A must be positive");
  TORCH_CHECK(w_down.size(0) == d, "added_expert (CPU kernel): w_down must be (D, A) = (", d, ", ", a, "), got ",
              w_down.sizes());
  const int64_t rows = w_up.has_value() ? a : 2 * a;
  TORCH_CHECK(w_gate.size(0) == rows && w_gate.size(1) == d, "added_expert (CPU kernel): w_gate must be (",
              rows, ", ", d, "), got ", w_gate.sizes());
  TORCH_CHECK(!w_up.has_value() || w_up->sizes() == w_gate.sizes(), "added_expert (CPU kernel): w_up must be (", a,
              ", ", d, ")");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 1 && mask->size(0) == x.size(0),
                "added_expert (CPU kernel): token_mask must be a (N,) bool tensor");
  }
}

// (D, 2A) row-major [Wg^T | Wu^T]: the B operand of gate/up.
at::Tensor gate_up_transposed(const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, int64_t a, int64_t d) {
  if (!w_up.has_value()) return w_gate.t().contiguous();
  at::Tensor out = at::empty({d, 2 * a}, w_gate.options());
  out.narrow(1, 0, a).copy_(w_gate.t());
  out.narrow(1, a, a).copy_(w_up->t());
  return out;
}

// (2A, D) row-major [Wg; Wu]: the B operand of dx, one K = 2A product.
at::Tensor gate_up_packed(const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up) {
  return w_up.has_value() ? at::cat({w_gate, *w_up}) : w_gate.contiguous();
}

std::tuple<at::Tensor, at::Tensor> added_expert_fused_forward(const at::Tensor& x_in, const at::Tensor& w_gate,
                                                              const std::optional<at::Tensor>& w_up,
                                                              const at::Tensor& w_down,
                                                              const std::optional<at::Tensor>& token_mask,
                                                              bool store_pre) {
  check_inputs(x_in, w_gate, w_up, w_down, token_mask);
  const int64_t n_tok = x_in.size(0), d = x_in.size(1), a = w_down.size(1);
  at::Tensor h = at::empty({store_pre ? n_tok : 0, 2 * a}, x_in.options());
  at::Tensor out = at::empty({n_tok, d}, x_in.options());
  if (n_tok == 0) return {out, h};
  const at::Tensor x = rows_unit_stride(x_in);
  const at::Tensor w_t = gate_up_transposed(w_gate, w_up, a, d);
  const at::Tensor wd_t = w_down.t().contiguous();  // (A, D): B of the down product
  at::Tensor mask_c = token_mask.has_value() ? token_mask->contiguous() : at::Tensor();
  const bool* keep = token_mask.has_value() ? mask_c.const_data_ptr<bool>() : nullptr;
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = w_t.const_data_ptr<float>();
  const float* wdt = wd_t.const_data_ptr<float>();
  float* hp = store_pre ? h.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t blocks = (n_tok + kBM - 1) / kBM;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> gu(kBM * 2 * kBN), p(kBM * a);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * kBM, m = std::min(kBM, n_tok - m0);
      for (int64_t n0 = 0; n0 < a; n0 += kBN) {
        const int64_t n = std::min(kBN, a - n0);
        gate_up_tile(m, n, d, xp + m0 * ldx, ldx, wp, a, n0, gu.data());
        swiglu_tile(m, n, gu.data(), 2 * n, keep ? keep + m0 : nullptr, p.data() + n0, a,
                    hp ? hp + m0 * 2 * a + n0 : nullptr, hp ? hp + m0 * 2 * a + a + n0 : nullptr, 2 * a);
      }
      for (int64_t c0 = 0; c0 < d; c0 += kBC) {
        gemm(m, std::min(kBC, d - c0), a, p.data(), a, wdt + c0, d, op + m0 * d + c0, d, false);
      }
    }
  });
  return {out, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> added_expert_fused_backward(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& w_gate,
    const std::optional<at::Tensor>& w_up, const at::Tensor& w_down, const std::optional<at::Tensor>& h_in,
    const std::optional<at::Tensor>& token_mask, bool need_dx, bool need_dw_gate_up, bool need_dw_down) {
  check_inputs(x_in, w_gate, w_up, w_down, token_mask);
  const int64_t n_tok = x_in.size(0), d = x_in.size(1), a = w_down.size(1);
  TORCH_CHECK(grad_out.scalar_type() == at::kFloat && grad_out.dim() == 2 && grad_out.size(0) == n_tok &&
                  grad_out.size(1) == d,
              "added_expert (CPU kernel): grad_out must be a float32 (N, D) tensor, got ", grad_out.sizes());
  const bool recompute = !h_in.has_value();
  if (!recompute) {
    TORCH_CHECK(h_in->scalar_type() == at::kFloat && h_in->dim() == 2 && h_in->size(0) == n_tok &&
                    h_in->size(1) == 2 * a,
                "added_expert (CPU kernel): h must be a float32 (N, 2A) tensor, got ", h_in->sizes());
  }
  const bool need_dw = need_dw_gate_up || need_dw_down;
  at::Tensor dx = need_dx ? at::empty({n_tok, d}, x_in.options()) : at::Tensor();
  at::Tensor dwgu = need_dw_gate_up ? at::empty({2 * a, d}, x_in.options()) : at::Tensor();
  at::Tensor dwd_t = need_dw_down ? at::empty({a, d}, x_in.options()) : at::Tensor();
  // Gradients not asked for come back as 0-element placeholders.
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    const at::Tensor none = at::empty({0}, x_in.options());
    return {need_dx ? dx : none, need_dw_gate_up ? dwgu : none, need_dw_down ? dwd_t.t().contiguous() : none};
  };
  if (n_tok == 0 || !(need_dx || need_dw)) {
    if (need_dw_gate_up) dwgu.zero_();
    if (need_dw_down) dwd_t.zero_();
    return result();
  }
  const at::Tensor x = rows_unit_stride(x_in);
  const at::Tensor dout = rows_unit_stride(grad_out);
  const at::Tensor h = recompute ? at::Tensor() : rows_unit_stride(*h_in);
  const at::Tensor w_t = recompute ? gate_up_transposed(w_gate, w_up, a, d) : at::Tensor();
  const at::Tensor wd = w_down.contiguous();        // (D, A): B of dp = dout @ Wd
  const at::Tensor wgu = need_dx ? gate_up_packed(w_gate, w_up) : at::Tensor();
  // Transposed dh and p: the A operands of the weight gradients, row-major.
  // Row strides padded by 16 floats, off powers of two (see transpose_tile).
  const int64_t ld_t = n_tok + 16, lddh = 2 * a + 16, ldp = kBN + 16;
  at::Tensor dh_t = need_dw ? at::empty({2 * a, ld_t}, x_in.options()) : at::Tensor();
  at::Tensor p_t = need_dw ? at::empty({a, ld_t}, x_in.options()) : at::Tensor();
  at::Tensor mask_c = token_mask.has_value() ? token_mask->contiguous() : at::Tensor();
  const bool* keep = token_mask.has_value() ? mask_c.const_data_ptr<bool>() : nullptr;

  const float* xp = x.const_data_ptr<float>();
  const float* dop = dout.const_data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = dout.stride(0);
  const int64_t ldh = recompute ? 0 : h.stride(0);
  const float* hp = recompute ? nullptr : h.const_data_ptr<float>();
  const float* wp = recompute ? w_t.const_data_ptr<float>() : nullptr;
  const float* wdp = wd.const_data_ptr<float>();
  const float* wgup = need_dx ? wgu.const_data_ptr<float>() : nullptr;
  float* dxp = need_dx ? dx.data_ptr<float>() : nullptr;
  float* dhtp = need_dw ? dh_t.data_ptr<float>() : nullptr;
  float* ptp = need_dw ? p_t.data_ptr<float>() : nullptr;

  const int64_t blocks = (n_tok + kBM - 1) / kBM;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> dp(kBM * kBN), gu(recompute ? kBM * 2 * kBN : 0), dh(kBM * lddh), p_tile(kBM * ldp);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * kBM, m = std::min(kBM, n_tok - m0);
      for (int64_t n0 = 0; n0 < a; n0 += kBN) {
        const int64_t n = std::min(kBN, a - n0);
        gemm(m, n, d, dop + m0 * ldo, ldo, wdp + n0, a, dp.data(), n, false);
        const float *g, *u;
        int64_t ldgu;
        if (recompute) {
          gate_up_tile(m, n, d, xp + m0 * ldx, ldx, wp, a, n0, gu.data());
          g = gu.data(), u = gu.data() + n, ldgu = 2 * n;
        } else {
          g = hp + m0 * ldh + n0, u = hp + m0 * ldh + a + n0, ldgu = ldh;
        }
        swiglu_backward_tile(m, n, g, u, ldgu, dp.data(), n, keep ? keep + m0 : nullptr, dh.data() + n0, lddh, a,
                             p_tile.data(), ldp);
        if (need_dw) {
          transpose_tile(m, n, dh.data() + n0, lddh, dhtp + n0 * ld_t + m0, ld_t);
          transpose_tile(m, n, dh.data() + a + n0, lddh, dhtp + (a + n0) * ld_t + m0, ld_t);
          transpose_tile(m, n, p_tile.data(), ldp, ptp + n0 * ld_t + m0, ld_t);
        }
      }
      if (dxp != nullptr) {
        // dx = [dgate | dup] @ W_gu: one K = 2A product, one fp32 accumulator.
        for (int64_t c0 = 0; c0 < d; c0 += kBC) {
          gemm(m, std::min(kBC, d - c0), 2 * a, dh.data(), lddh, wgup + c0, d, dxp + m0 * d + c0, d, false);
        }
      }
    }
  });

  if (need_dw) {
    // dW_gu = dh^T @ x (2A x D) and dWd^T = p^T @ dout (A x D), tiled together
    // so that both threads stay busy; K = N, fp32 throughout.
    const int64_t col_tiles = (d + kBC - 1) / kBC;
    const int64_t gu_tiles = need_dw_gate_up ? ((2 * a + kBM - 1) / kBM) * col_tiles : 0;
    const int64_t dn_tiles = need_dw_down ? ((a + kBM - 1) / kBM) * col_tiles : 0;
    float* dwgup = need_dw_gate_up ? dwgu.data_ptr<float>() : nullptr;
    float* dwdtp = need_dw_down ? dwd_t.data_ptr<float>() : nullptr;
    at::parallel_for(0, gu_tiles + dn_tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const bool is_gu = t < gu_tiles;
        const int64_t tt = is_gu ? t : t - gu_tiles;
        const int64_t r0 = (tt / col_tiles) * kBM, c0 = (tt % col_tiles) * kBC;
        const int64_t rows = std::min(kBM, (is_gu ? 2 * a : a) - r0), cols = std::min(kBC, d - c0);
        const float* lhs = (is_gu ? dhtp : ptp) + r0 * ld_t;
        const float* rhs = is_gu ? xp : dop;
        const int64_t ldr = is_gu ? ldx : ldo;
        float* c = (is_gu ? dwgup : dwdtp) + r0 * d + c0;
        gemm(rows, cols, n_tok, lhs, ld_t, rhs + c0, ldr, c, d, false);
      }
    });
  }
  return result();
}

// --- the elementwise part alone, for the torch composition ---------------------
//
// Where torch.mm's products are the faster (MKL on Intel CPUs), the torch
// composition runs them and these two ops do its elementwise work in one pass
// each instead of torch's two (forward) and five (backward): on a 2-core
// Sapphire Rapids-class Xeon those seven passes took ~2 ms of a 20 ms step at
// N=2048, D=576, A=256. Forward and backward compute p the same way,
// p = (g * sigmoid(g)) * u, so the p the backward gives for dWd is
// bit-identical to the forward's.

__attribute__((always_inline)) inline void act_row(int64_t n, const float* __restrict__ g,
                                                   const float* __restrict__ u, float* __restrict__ p) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = 1.0f / (1.0f + exp_f32(-g[j]));
    p[j] = (g[j] * s) * u[j];
  }
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void act_rows(int64_t r0, int64_t r1, int64_t a, const float* h, const bool* keep, float* p) {
  const FlushDenormals ftz;
  for (int64_t i = r0; i < r1; ++i) {
    if (keep != nullptr && !keep[i]) {
      std::memset(p + i * a, 0, a * sizeof(float));
    } else {
      act_row(a, h + i * 2 * a, h + i * 2 * a + a, p + i * a);
    }
  }
}

void check_act(const at::Tensor& h, const std::optional<at::Tensor>& token_mask, const char* op) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 2 && h.size(1) % 2 == 0,
              op, ": h must be a 2-D float32 CPU tensor [gate | up] of even width, got ", h.scalar_type(), " ",
              h.sizes());
  if (token_mask) {
    TORCH_CHECK(token_mask->scalar_type() == at::kBool && token_mask->dim() == 1 &&
                    token_mask->size(0) == h.size(0),
                op, ": token_mask must be a bool vector of h's ", h.size(0), " rows, got ",
                token_mask->scalar_type(), " ", token_mask->sizes());
  }
}

// p = silu(gate) * up, (N, A), from h = [gate | up] (N, 2A); rows where
// token_mask is False are zero.
at::Tensor added_expert_act_forward(const at::Tensor& h_in, const std::optional<at::Tensor>& token_mask) {
  check_act(h_in, token_mask, "added_expert_act_forward");
  const at::Tensor h = h_in.contiguous();
  const int64_t n = h.size(0), a = h.size(1) / 2;
  at::Tensor p = at::empty({n, a}, h.options());
  const at::Tensor keep = token_mask ? token_mask->contiguous() : at::Tensor();
  const bool* kp = token_mask ? keep.const_data_ptr<bool>() : nullptr;
  const float* hp = h.const_data_ptr<float>();
  float* pp = p.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { act_rows(r0, r1, a, hp, kp, pp); });
  return p;
}

__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void act_backward_rows(int64_t r0, int64_t r1, int64_t a, const float* h, const float* dp, const bool* keep,
                       float* dh, float* p) {
  const FlushDenormals ftz;
  for (int64_t i = r0; i < r1; ++i) {
    float* dhr = dh + i * 2 * a;
    if (keep != nullptr && !keep[i]) {
      std::memset(dhr, 0, 2 * a * sizeof(float));
      std::memset(p + i * a, 0, a * sizeof(float));
    } else {
      swiglu_backward_row(a, h + i * 2 * a, h + i * 2 * a + a, dp + i * a, dhr, dhr + a, p + i * a);
    }
  }
}

// (dh, p): dh = [dgate | dup] (N, 2A) for dp = dL/dp (N, A), and p again (for
// dWd), from h = [gate | up]; rows where token_mask is False are zero in both.
std::tuple<at::Tensor, at::Tensor> added_expert_act_backward(const at::Tensor& h_in, const at::Tensor& dp_in,
                                                              const std::optional<at::Tensor>& token_mask) {
  check_act(h_in, token_mask, "added_expert_act_backward");
  const int64_t n = h_in.size(0), a = h_in.size(1) / 2;
  TORCH_CHECK(dp_in.scalar_type() == at::kFloat && dp_in.dim() == 2 && dp_in.size(0) == n && dp_in.size(1) == a,
              "added_expert_act_backward: dp must be float32 of shape (", n, ", ", a, "), got ",
              dp_in.scalar_type(), " ", dp_in.sizes());
  const at::Tensor h = h_in.contiguous(), dp = dp_in.contiguous();
  at::Tensor dh = at::empty({n, 2 * a}, h.options());
  at::Tensor p = at::empty({n, a}, h.options());
  const at::Tensor keep = token_mask ? token_mask->contiguous() : at::Tensor();
  const bool* kp = token_mask ? keep.const_data_ptr<bool>() : nullptr;
  const float* hp = h.const_data_ptr<float>();
  const float* dpp = dp.const_data_ptr<float>();
  float* dhp = dh.data_ptr<float>();
  float* pp = p.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { act_backward_rows(r0, r1, a, hp, dpp, kp, dhp, pp); });
  return {dh, p};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident_trainer, m) {
  m.def(
      "added_expert_fused_forward(Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor? token_mask, "
      "bool store_pre) -> (Tensor, Tensor)");
  m.def(
      "added_expert_fused_backward(Tensor grad_out, Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, "
      "Tensor? h, Tensor? token_mask, bool need_dx, bool need_dw_gate_up, bool need_dw_down) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("added_expert_act_forward(Tensor h, Tensor? token_mask) -> Tensor");
  m.def("added_expert_act_backward(Tensor h, Tensor dp, Tensor? token_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(resident_trainer, CPU, m) {
  m.impl("added_expert_fused_forward", &added_expert_fused_forward);
  m.impl("added_expert_fused_backward", &added_expert_fused_backward);
  m.impl("added_expert_act_forward", &added_expert_act_forward);
  m.impl("added_expert_act_backward", &added_expert_act_backward);
}
