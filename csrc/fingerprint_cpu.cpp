// CPU fingerprint: lane sums of a byte buffer, multi-threaded with ATen's pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "fingerprint.h"

namespace {

// Lane sums of n full words starting at word index `lo0` within one 2^32 run.
// The loop is written so GCC vectorizes it (memcpy loads, unsigned wrap), and
// target_clones picks AVX-512 or AVX2 at load time: the four multiplies per
// word bound the speed. Measured on a 2-core Zen 5 EPYC (512 MiB, standalone):
// scalar 4.6 GB/s per thread, AVX-512 26 GB/s per thread, two threads 37 GB/s
// against 38 GB/s for a plain summing read. Software prefetch inside the loop
// stops GCC from vectorizing it (2.7 GB/s), so there is none.
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

void check_data(const at::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu(), "fingerprint_lanes (CPU): data must be a CPU tensor, got one on ",
              data.device());
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "fingerprint_lanes: data must be a contiguous 1-D uint8 tensor, got ",
              data.scalar_type(), " with shape ", data.sizes());
}

// Lane sums of several byte buffers in one parallel region, buffer i starting
// at global word word_offsets[i]: the buffers are cut into tasks of at most
// kGrain words, so a model's many small tensors (norms, biases), or the row
// pieces of a tensor-parallel column shard, share threads instead of each
// paying a fork/join.
at::Tensor fingerprint_lanes_many_cpu(at::TensorList datas, at::IntArrayRef word_offsets) {
  TORCH_CHECK(word_offsets.size() == datas.size(), "fingerprint_lanes_many: ", datas.size(), " buffers but ",
              word_offsets.size(), " word offsets");
  for (int64_t o : word_offsets) TORCH_CHECK(o >= 0, "fingerprint_lanes: word_offset must be >= 0, got ", o);
  // 64 Ki words (256 KiB) per task: large enough to hide the task overhead,
  // small enough to balance two to a few dozen threads.
  constexpr int64_t kGrain = 1 << 16;
  struct Task {
    int64_t tensor, begin, end;
  };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < (int64_t)datas.size(); ++i) {
    check_data(datas[i]);
    const int64_t nfull = datas[i].numel() / 4;
    for (int64_t b = 0; b < nfull; b += kGrain) tasks.push_back({i, b, std::min(nfull, b + kGrain)});
  }
  // One accumulator pair per task; wrap-around sums commute, so the result
  // does not depend on how the tasks are spread over threads.
  std::vector<uint32_t> acc(2 * tasks.size(), 0u);
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Task& t = tasks[k];
      hash_words(datas[t.tensor].const_data_ptr<uint8_t>(), t.begin, t.end, (uint64_t)word_offsets[t.tensor], &acc[2 * k]);
    }
  });
  at::Tensor out = at::zeros({(int64_t)datas.size(), 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<uint32_t> sums(2 * datas.size(), 0u);
  for (size_t k = 0; k < tasks.size(); ++k) {
    sums[2 * tasks[k].tensor] += acc[2 * k];
    sums[2 * tasks[k].tensor + 1] += acc[2 * k + 1];
  }
  for (int64_t i = 0; i < (int64_t)datas.size(); ++i) {
    const unsigned char* p = datas[i].const_data_ptr<uint8_t>();
    const int64_t nbytes = datas[i].numel(), nfull = nbytes / 4, rem = nbytes - 4 * nfull;
    if (rem > 0) {
      const uint64_t g = (uint64_t)word_offsets[i] + (uint64_t)nfull;
      const uint32_t w = rt_fp_tail_word(p + 4 * nfull, rem);
      const uint32_t hi = (uint32_t)(g >> 32);
      sums[2 * i] += rt_fp_lane0(w, (uint32_t)g, rt_fp_key0_hi(hi));
      sums[2 * i + 1] += rt_fp_lane1(w, (uint32_t)g, rt_fp_key1_hi(hi));
    }
    o[2 * i] = (int64_t)sums[2 * i];
    o[2 * i + 1] = (int64_t)sums[2 * i + 1];
  }
  return out;
}

at::Tensor fingerprint_lanes_cpu(const at::Tensor& data, int64_t word_offset) {
  check_data(data);
  return fingerprint_lanes_many_cpu({data}, {word_offset}).reshape({2});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident_trainer, m) {
  m.def("fingerprint_lanes(Tensor data, int word_offset) -> Tensor");
  m.def("fingerprint_lanes_many(Tensor[] datas, int[] word_offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(resident_trainer, CPU, m) {
  m.impl("fingerprint_lanes", &fingerprint_lanes_cpu);
  m.impl("fingerprint_lanes_many", &fingerprint_lanes_many_cpu);
}
