// CPU fingerprint: lane sums of a byte buffer, multi-threaded with ATen's pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "fingerprint.h"

namespace {

// Lane sums of n full words starting at word index `lo0` within one 2^32 run.
// The loop is written so GCC vectorizes it (memcpy loads, unsigned wrap);
// target_clones picks AVX-512 or AVX2 at load time, since one vector multiply
// per lane is what bounds the speed (measured: scalar code reaches ~1/4 of the
// read bandwidth on this class of CPU).
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
void hash_run(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key0_hi,
              uint32_t key1_hi, uint32_t* out) {
  uint32_t s0 = 0, s1 = 0;
  // Position keys as additive inductions (lo * MUL + hi_key, stepped by MUL),
  // so the vector loop spends its multiplies on the mixers only.
  uint32_t k0 = lo0 * RT_FP_KEY0_MUL + key0_hi;
  uint32_t k1 = lo0 * RT_FP_KEY1_MUL + key1_hi;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t w;
    std::memcpy(&w, p + 4 * j, 4);
    s0 += rt_fp_fmix32(w ^ k0);
    s1 += rt_fp_lowbias32(w + k1);
    k0 += RT_FP_KEY0_MUL;
    k1 += RT_FP_KEY1_MUL;
  }
  out[0] += s0;
  out[1] += s1;
}

// Words [begin, end) of the buffer, global index word_offset + j; split where
// the high half of the global index changes so every run has a fixed key.
void hash_words(const unsigned char* base, int64_t begin, int64_t end,
                uint64_t word_offset, uint32_t* out) {
  int64_t j = begin;
  while (j < end) {
    const uint64_t g = word_offset + (uint64_t)j;
    const uint64_t run_left = (uint64_t{1} << 32) - (g & 0xFFFFFFFFull);
    const int64_t n = (int64_t)std::min<uint64_t>((uint64_t)(end - j), run_left);
    const uint32_t hi = (uint32_t)(g >> 32);
    hash_run(base + 4 * j, n, (uint32_t)g, rt_fp_key0_hi(hi), rt_fp_key1_hi(hi), out);
    j += n;
  }
}

at::Tensor fingerprint_lanes_cpu(const at::Tensor& data, int64_t word_offset) {
  TORCH_CHECK(data.device().is_cpu(), "fingerprint_lanes_cpu: data must be a CPU tensor");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "fingerprint_lanes: data must be a contiguous 1-D uint8 tensor, got ",
              data.scalar_type(), " with shape ", data.sizes());
  TORCH_CHECK(word_offset >= 0, "fingerprint_lanes: word_offset must be >= 0, got ", word_offset);
  const unsigned char* p = data.const_data_ptr<uint8_t>();
  const int64_t nbytes = data.numel();
  const int64_t nfull = nbytes / 4;
  const uint64_t off = (uint64_t)word_offset;

  // One accumulator pair per worker thread; wrap-around sums commute, so the
  // result does not depend on how ATen splits the range.
  const int nthreads = at::get_num_threads();
  std::vector<uint32_t> acc(2 * (size_t)nthreads + 2, 0u);
  // 64 Ki words (256 KiB) per task: large enough to hide the task overhead,
  // small enough to balance two to a few dozen threads.
  constexpr int64_t kGrain = 1 << 16;
  at::parallel_for(0, nfull, kGrain, [&](int64_t b, int64_t e) {
    hash_words(p, b, e, off, &acc[2 * (size_t)at::get_thread_num()]);
  });
  uint32_t s0 = 0, s1 = 0;
  for (int t = 0; t < nthreads; ++t) {
    s0 += acc[2 * t];
    s1 += acc[2 * t + 1];
  }
  const int64_t rem = nbytes - 4 * nfull;
  if (rem > 0) {
    const uint64_t g = off + (uint64_t)nfull;
    const uint32_t w = rt_fp_tail_word(p + 4 * nfull, rem);
    const uint32_t hi = (uint32_t)(g >> 32);
    s0 += rt_fp_lane0(w, (uint32_t)g, rt_fp_key0_hi(hi));
    s1 += rt_fp_lane1(w, (uint32_t)g, rt_fp_key1_hi(hi));
  }
  at::Tensor out = at::empty({2}, data.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = (int64_t)s0;
  o[1] = (int64_t)s1;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident_trainer, m) {
  m.def("fingerprint_lanes(Tensor data, int word_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident_trainer, CPU, m) {
  m.impl("fingerprint_lanes", &fingerprint_lanes_cpu);
}
